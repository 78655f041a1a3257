"""planner: one plan of a prepared joint graph under one per-node policy: select -> partition ->
fold_twins -> schedule -> offload -> memory. The pipeline calls it for a fixed policy; the budget search
(passes.budget) calls it for each candidate it judges."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from passes._compat import RECOMPUTE_KEY, torch_budget
from passes.batchnorm import fold_twins
from passes.graphs import forward_nodes
from passes.memory import memory_pass
from passes.offload import offload_pass
from passes.partition import merges_joint, partition_pass, recomputes
from passes.plan import Planned, Prediction
from passes.policy import Policy
from passes.regions import RegionKind, region_of
from passes.schedule import schedule_pass
from passes.select import BY_POLICY, REASON_KEY, RECOMPUTE, select_pass
from passes.steps import Steps
from passes.targets import Target



@dataclass(frozen=True, kw_only=True)
class Joint:
    """A joint graph the graph passes prepared (dropout, batchnorm, regions, costs), and how to
    partition it."""

    gm: torch.fx.GraphModule
    inputs: object
    """AOTAutograd's joint inputs, for the partitioner."""
    num_fwd_outputs: int
    static_lifetime_input_indices: list[int] | None
    target: Target
    """The inner compiler the plan is for (passes.targets): how it is partitioned and predicted."""
    block_paths: tuple[str, ...]
    """The units' names in forward order: the Plan reports each of them."""
    steps: Steps
    device: str | None = None
    """The device type the plan is for, when not the graph's own (fit traces CPU fakes for a GPU):
    what the cost model prices with."""


def plan_policy(joint: Joint, policy: Policy, *, by_block: bool | None = None) -> Planned:
    """Decide every forward node by `policy`, partition, fold BatchNorm's twins, order the backward
    just in time and predict the memory; the joint graph's meta holds the decisions afterwards.
    Under min-cut, a policy that recomputes is partitioned without min-cut's CSE of the joint
    graph (Note [CSE under recompute] in passes/partition.py).
    `by_block`: whether Inductor's schedule of the backward may be taken block by block (Note [A
    schedule per block]); by default, unless min-cut partitioned after its CSE a plan that asks
    for recomputes (torch's budget knob; Note [Whole backward schedules])."""
    steps, gm = joint.steps, joint.gm
    steps.run("select", lambda: select_pass(gm, policy=policy), gm)
    steps.show("select", "after", gm)
    forward_names = {n.name for n in forward_nodes(gm.graph) if n.op == "call_function"}
    embedding_asked = sum(
        1 for n in forward_nodes(gm.graph)
        if n.meta.get(REASON_KEY) == BY_POLICY and n.meta.get(RECOMPUTE_KEY) in RECOMPUTE
        and getattr(region_of(n), "kind", None) == RegionKind.EMBEDDING
    )
    asked = recomputes(gm) or torch_budget() < 1.0
    merged = merges_joint(gm, target=joint.target)
    fw, bw = steps.run(
        "partition",
        lambda: partition_pass(gm, joint.inputs, num_fwd_outputs=joint.num_fwd_outputs,
                               static_lifetime_input_indices=joint.static_lifetime_input_indices,
                               target=joint.target),
        gm,
    )
    steps.run("batchnorm", lambda: fold_twins(fw), fw)
    recomputed = {n.name for n in bw.graph.nodes if n.name in forward_names}
    bw = steps.run("schedule", lambda: schedule_pass(bw, recomputed=recomputed), bw)
    steps.show("schedule", "after", bw)
    offloaded = steps.run("offload", lambda: offload_pass(
        fw, bw, num_fwd_outputs=joint.num_fwd_outputs, static_lifetime_input_indices=joint.static_lifetime_input_indices))
    if offloaded:
        steps.show("offload", "after", bw)
    steps.show("partition", "forward", fw)
    by_block = by_block if by_block is not None else merged is not True or not recomputed or not asked
    prediction = steps.run("memory", lambda: _predicted(joint, fw, bw, forward_names=forward_names, offloaded=offloaded,
                                                        by_block=by_block))
    return Planned(forward=fw, backward=bw, prediction=prediction, joint_cse=merged,
                   recomputed_embedding_ops=embedding_asked)


def scheduled_whole(joint: Joint, planned: Planned) -> Planned:
    """`planned` with its memory predicted from Inductor's schedule of the whole backward (Note
    [Whole backward schedules]) rather than block by block."""
    forward_names = {n.name for n in forward_nodes(joint.gm.graph) if n.op == "call_function"}
    prediction = joint.steps.run("memory", lambda: _predicted(
        joint, planned.forward, planned.backward, forward_names=forward_names,
        offloaded=planned.prediction.offloaded, by_block=False))
    return replace(planned, prediction=prediction)


def _predicted(joint: Joint, fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, *, forward_names: set[str],
               offloaded: tuple[str, ...], by_block: bool) -> Prediction:
    """The memory pass's prediction of a plan's two graphs."""
    return memory_pass(fw, bw, num_fwd_outputs=joint.num_fwd_outputs, forward_names=forward_names,
                       block_paths=joint.block_paths, static_input_indices=joint.static_lifetime_input_indices,
                       target=joint.target, offloaded=offloaded, by_block=by_block)


# Note [Whole backward schedules]
# The backward of a plan min-cut partitioned after its CSE is scheduled whole where recomputes
# were asked for, which only torch's budget knob does (a policy that recomputes is partitioned
# without the CSE: Note [CSE under recompute] in passes/partition.py): Inductor fuses neighbouring
# blocks' recomputes sideways there (Note [A schedule per block]); a budget asks for the whole
# schedule of torch's plan only where it decides anything (Note [Torch's plan beyond reach] in
# passes/budget.py). Inductor's own partition asks
# for none: min-cut recomputes only fusible ops next to their readers, and its backward laid end
# to end block by block equals the whole graph's schedule on the decoders and encoders tested and
# stays a few percent over it on an MoE model (tests/test_inductor_memory.py holds it to 5%).
# So it is scheduled per block: one whole-graph lowering fewer for `none` and for every budget,
# which plans Inductor's own partition as its baseline.
