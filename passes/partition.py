"""partition: joint graph + per-node decisions -> forward and backward graphs."""

from __future__ import annotations

import contextlib

import torch

from passes._compat import RECOMPUTE_KEY, default_partition, min_cut_partition, without_joint_cse
from passes.select import RECOMPUTE

PARTITIONERS = ("default", "min_cut")


def partition_pass(
    joint: torch.fx.GraphModule,
    joint_inputs: object,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
    partitioner: str = "default",
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Split the joint graph by the decisions select_pass wrote into node.meta["recompute"].

    Both partitioners are torch's and both honour the MUST_SAVE / MUST_RECOMPUTE tags (torch's
    selective-checkpointing contract); they differ on what a policy leaves open (PREFER_SAVE):
    - "default" saves every such forward value the backward needs (AOTAutograd's default
      partition): nothing is recomputed that the policy did not ask for. The eager inner compiler
      uses it: without fusion, a recomputed pointwise op is a kernel of its own.
    - "min_cut" gives the open decisions to torch's min-cut partitioner, which recomputes cheap
      fusible ops when that saves bytes (Note [Min-cut under Inductor]): with no tags this is
      exactly Inductor's own partition, and every policy's savings stack on top of it. When the
      policy recomputes anything, min-cut runs without its CSE of the joint graph (Note [No CSE
      under recompute]).
    The backward receives copies of the recomputed nodes (same names, same meta). Torch orders the
    backward it returns much as schedule_pass does; schedule_pass still runs after it, so the
    just-in-time order is ours to guarantee. Mutates the joint graph only as torch's partitioners
    do (dead code removed, tags of forced saves added; min_cut may replace joint.graph by its CSE'd
    copy, node names and meta kept); deterministic.
    """
    if partitioner not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {partitioner!r}; valid: {', '.join(PARTITIONERS)}")
    split = min_cut_partition if partitioner == "min_cut" else default_partition
    recomputes = any(n.meta.get(RECOMPUTE_KEY) in RECOMPUTE for n in joint.graph.nodes)
    with without_joint_cse() if partitioner == "min_cut" and recomputes else contextlib.nullcontext():
        return split(
            joint,
            joint_inputs,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices,
        )

# Note [Min-cut under Inductor]
# Inductor fuses pointwise ops into their consumers, so recomputing one in the backward costs
# about its extra reads, not a kernel and not a stored tensor; torch's min-cut partitioner exploits
# that and saves far less than the default partition (GPT-2 12x256 on a CPU: 635 vs 920 MB peak).
# Under Inductor, our policies decide what they care about (MUST_RECOMPUTE inside a checkpointed
# unit, MUST_SAVE at its edges and for hard-ruled ops) and leave the rest PREFER_SAVE; min-cut
# honours the MUST_* tags and decides the rest as Inductor alone would. So `none` is Inductor's
# own partition and no policy starts from a worse baseline than Inductor alone.

# Note [No CSE under recompute]
# torch's min-cut partitioner first merges identical nodes of the joint graph (CSE), which ties
# backward computations to forward nodes a policy marked for recompute. Measured on a 3-block GPT
# (width 128, batch 4x256, CPU, Inductor) checkpointing every block: 27.4 MB peak with that CSE,
# 16.9 MB without (17.0 MB with the default partition; the memory pass predicts 17.5 MB, and does
# not see the difference). Running the same CSE before regions and select instead, so that a
# merged node is one value read by several units, measured 27.5 MB: what it merges is not (only)
# values of several blocks. So a plan with recomputes is partitioned without it; a plan without
# (`none`) keeps torch's setting and stays exactly Inductor's own partition. min-cut's CSE replaces
# joint.graph, so a budget's candidates, planned after one with nothing recomputed (and after
# torch's own plan), are partitioned from the CSE'd graph: that is what the budget tables in the
# README measured. The cost: on GPT-2
# 6x384 `selective` keeps 120.3 MB where torch's op-level selective checkpointing (with CSE)
# keeps 118.3 MB.
