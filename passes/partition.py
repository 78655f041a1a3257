"""partition: joint graph + per-node decisions -> forward and backward graphs."""

from __future__ import annotations

import contextlib

import torch

from passes._compat import RECOMPUTE_KEY, without_joint_cse
from passes.select import RECOMPUTE
from passes.targets import EAGER, Target


def partition_pass(
    joint: torch.fx.GraphModule,
    joint_inputs: object,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
    target: Target = EAGER,
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Split the joint graph by the decisions select_pass wrote into node.meta["recompute"].

    The target's partitioner (passes.targets) does it; both are torch's and both honour the
    MUST_SAVE / MUST_RECOMPUTE tags (torch's selective-checkpointing contract); they differ on what
    a policy leaves open (PREFER_SAVE):
    - the eager target's saves every such forward value the backward needs (AOTAutograd's default
      partition): nothing is recomputed that the policy did not ask for. The eager inner compiler
      uses it: without fusion, a recomputed pointwise op is a kernel of its own.
    - Inductor's gives the open decisions to torch's min-cut partitioner, which recomputes cheap
      fusible ops when that saves bytes (Note [Min-cut under Inductor]): with no tags this is
      exactly Inductor's own partition, and every policy's savings stack on top of it. Min-cut
      first merges identical nodes of the joint graph (its CSE) as torch does, unless the policy
      recomputes anything (Note [CSE under recompute]).
    The backward receives copies of the recomputed nodes (same names, same meta). Torch orders the
    backward it returns much as schedule_pass does; schedule_pass still runs after it, so the
    just-in-time order is ours to guarantee. Mutates the joint graph only as torch's partitioners
    do (dead code removed, tags of forced saves added; min_cut may replace joint.graph by its CSE'd
    copy, node names and meta kept); deterministic.
    """
    merge = merges_joint(joint, target=target)
    # A joint graph min-cut merged before needs no second CSE: it would find nothing more to merge.
    with without_joint_cse() if merge is False or joint.meta.get(MERGED_KEY) else contextlib.nullcontext():
        fw, bw = target.partition(
            joint,
            joint_inputs,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices,
        )
    if merge:
        joint.meta[MERGED_KEY] = True
    return fw, bw


MERGED_KEY = "ckpt_fx_merged"
"""The joint GraphModule's meta key saying min-cut's CSE has merged its identical nodes (its graph
is CSE's copy): a later partition skips the CSE, which finds nothing more to merge."""


def recomputes(joint: torch.fx.GraphModule) -> bool:
    """Whether select_pass marked any node of the joint graph for recompute."""
    return any(n.meta.get(RECOMPUTE_KEY) in RECOMPUTE for n in joint.graph.nodes)


def merges_joint(joint: torch.fx.GraphModule, *, target: Target) -> bool | None:
    """Whether partition_pass lets min-cut CSE the joint graph first: when nothing is marked for
    recompute (Note [CSE under recompute]); None under the default partition, which has no such
    step."""
    if not target.fuses:
        return None
    return not recomputes(joint)


# Note [Min-cut under Inductor]
# Inductor fuses pointwise ops into their consumers, so recomputing one in the backward costs
# about its extra reads, not a kernel and not a stored tensor; torch's min-cut partitioner exploits
# that and saves far less than the default partition (GPT-2 12x256 on a CPU: 635 vs 920 MB peak).
# Under Inductor, our policies decide what they care about (MUST_RECOMPUTE inside a checkpointed
# unit, MUST_SAVE at its edges and for hard-ruled ops) and leave the rest PREFER_SAVE; min-cut
# honours the MUST_* tags and decides the rest as Inductor alone would. So `none` is Inductor's
# own partition and no policy starts from a worse baseline than Inductor alone.

# Note [CSE under recompute]
# torch's min-cut partitioner first merges identical nodes of the joint graph (CSE). Under a
# policy that recomputes, that ties the blocks together: values each block computes alike from
# the same inputs (an attention mask converted per layer, rotary slices) become one node that
# every block's recompute reads. Whether that lowers the peak depends on how Inductor then fuses:
# one shared mask instead of one per block lowers it a little; neighbouring blocks' recomputes
# that read the shared node fused into one kernel, which runs the earlier block's recompute during
# the later block's backward, raises it a lot. The memory pass cannot tell the two apart cheaply:
# a CSE'd backward has to be scheduled whole (Note [Whole backward schedules] in
# passes/planner.py), and the two predictions differ from the measured peaks by more than the
# peaks differ from each other (the README's Known limits gives the measured pairs). So a policy
# that recomputes is partitioned once, without the CSE: never the large loss, at most a few
# percent above the CSE'd partition where that one wins, and one partition and one whole-graph
# schedule fewer per compile. A plan without recomputes (`none`) keeps torch's setting and stays
# exactly Inductor's own partition. A budget's candidates are planned after one with nothing
# recomputed (and after torch's own plan), so they are partitioned, without CSE, from the graph
# that CSE made.
