"""The passes, in order. Each is a function in its own module; this file only lists them."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from passes.batchnorm import batchnorm_pass, fold_twins
from passes.costs import costs_pass
from passes.dropout import dropout_pass
from passes.memory import Estimate, JointLiveness, memory_pass
from passes.plan import Plan
from passes.partition import partition_pass
from passes.regions import PATH_KEY, REGION_KEY, forward_nodes, regions_pass
from passes.schedule import schedule_pass
from passes.budget import BudgetSpec
from passes.select import REASON_KEY, RECOMPUTE, NamedPolicy, Policy, hard_rules, select_pass
from passes.warn import warn_user
from passes._compat import RECOMPUTE_KEY, CheckpointPolicy, activation_memory_budget

log = logging.getLogger("ckpt_fx")



class PassError(RuntimeError):
    """A pass failed; carries the pass's name."""

    def __init__(self, name: str, error: BaseException):
        super().__init__(f"ckpt_fx pass '{name}' failed: {type(error).__name__}: {error}")
        self.pass_name = name


def run(
    joint: torch.fx.GraphModule,
    joint_inputs: object,
    *,
    policy: Policy,
    policy_name: str,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
    partitioner: str = "default",
    strict: bool = False,
    dump: Callable[[str, str, torch.fx.GraphModule], None] | None = None,
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, Plan]:
    """dropout -> batchnorm -> regions -> costs -> select -> partition -> schedule -> memory; returns (fw, bw, plan).

    `partitioner`: "default" or "min_cut" (passes.partition, Note [Min-cut under Inductor]).
    `strict`: a memory budget no plan reaches raises instead of planning the lowest with a warning.
    `dump(pass_name, "before"|"after", gm)`, when given, sees each pass's graph.
    """
    timings: dict[str, float] = {}

    def step(name: str, fn: Callable[[], object], gm: torch.fx.GraphModule | None = None) -> object:
        if dump is not None and gm is not None:
            dump(name, "before", gm)
        start = time.perf_counter()
        try:
            result = fn()
        except PassError:
            raise
        except Exception as error:
            raise PassError(name, error) from error
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
        return result

    step("dropout", lambda: dropout_pass(joint), joint)
    step("batchnorm", lambda: batchnorm_pass(joint), joint)
    # A policy that does not look at blocks (graph(), none()) needs no warning about missing ones.
    warn = uses_blocks(policy)
    region_map = step("regions", lambda: regions_pass(joint, warn=warn), joint)
    step("costs", lambda: costs_pass(joint), joint)

    def plan_with(node_policy: Policy, name: str) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, Plan]:
        forced = step("select", lambda: select_pass(joint, policy=node_policy), joint)
        if dump is not None:
            dump("select", "after", joint)
        forward_names = {n.name for n in forward_nodes(joint.graph) if n.op == "call_function"}
        fw, bw = step(
            "partition",
            lambda: partition_pass(
                joint,
                joint_inputs,
                num_fwd_outputs=num_fwd_outputs,
                static_lifetime_input_indices=static_lifetime_input_indices,
                partitioner=partitioner,
            ),
            joint,
        )
        step("batchnorm", lambda: fold_twins(fw), fw)
        recomputed = {n.name for n in bw.graph.nodes if n.name in forward_names}
        bw = step("schedule", lambda: schedule_pass(bw, recomputed=recomputed), bw)
        if dump is not None:
            dump("schedule", "after", bw)
            dump("partition", "forward", fw)
        plan = step(
            "memory",
            lambda: memory_pass(
                fw,
                bw,
                num_fwd_outputs=num_fwd_outputs,
                policy=name,
                forward_names=forward_names,
                hard_rules=forced,
                top_level_units=region_map.top_level_units,
                block_paths=tuple(b.name for b in region_map.blocks),
                static_input_indices=static_lifetime_input_indices,
                fused=partitioner == "min_cut",
            ),
        )
        return fw, bw, plan

    if not isinstance(policy, BudgetSpec):
        fw, bw, plan = plan_with(policy, policy_name)
    else:
        fw, bw, plan = _choose(step, plan_with, policy, policy_name, joint, num_fwd_outputs=num_fwd_outputs,
                               static_lifetime_input_indices=static_lifetime_input_indices,
                               partitioner=partitioner, strict=strict)
    plan = dataclasses.replace(plan, **_graph_facts(joint, region_map))
    log.log(
        logging.INFO if dump is not None else logging.DEBUG,  # debug runs list the passes at INFO
        "ckpt_fx passes: %s",
        ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in timings.items()),
    )
    return fw, bw, plan


def _graph_facts(joint: torch.fx.GraphModule, region_map) -> dict:
    """What the Plan records of the joint graph itself, for explain and the backend's warnings:
    its units, its module paths, the embedding ops the policy asked to recompute."""
    embedding_asked = sum(
        1 for n in forward_nodes(joint.graph)
        if n.meta.get(REASON_KEY) == "policy" and n.meta.get(RECOMPUTE_KEY) in RECOMPUTE
        and getattr(n.meta.get(REGION_KEY), "kind", None) == "embedding"
    )
    paths = tuple(sorted({n.meta[PATH_KEY] for n in joint.graph.nodes if n.meta.get(PATH_KEY)}))
    return {"units": region_map.blocks, "module_paths": paths, "recomputed_embedding_ops": embedding_asked}


def uses_blocks(policy: Policy) -> bool:
    """Whether a policy decides by blocks: False for none(), graph() and a budget, which need no
    blocks (no warning when a graph has none, or when they recompute nothing); True for the block
    policies and any other callable."""
    return policy.uses_blocks if isinstance(policy, (NamedPolicy, BudgetSpec)) else True


def _choose(step, plan_with, policy, policy_name, joint, *, num_fwd_outputs, static_lifetime_input_indices,
            partitioner, strict):
    """_choices's plan, the budget's choice recorded in it (Plan.budget)."""
    (fw, bw, plan), choice = _choices(step, plan_with, policy, policy_name, joint, num_fwd_outputs=num_fwd_outputs,
                                      static_lifetime_input_indices=static_lifetime_input_indices,
                                      partitioner=partitioner, strict=strict)
    return fw, bw, dataclasses.replace(plan, budget=choice)


def _choices(step, plan_with, policy, policy_name, joint, *, num_fwd_outputs, static_lifetime_input_indices,
             partitioner, strict):
    """A policy with candidates (a memory budget) offers several plans; the policy picks one by
    their predicted peaks (Note [Peak-aware budget]). Under the default partition each peak is
    predicted from the joint graph (Note [Peak from the joint graph]) and only the chosen one is
    partitioned; under min-cut, which adds recomputes of its own, each candidate is partitioned and
    its peak read from the partitioned graphs, until one fits, and torch's own plan at the same
    budget is a candidate too (Note [Torch's knob as a candidate]). Returns ((fw, bw, plan), choice)."""
    from passes.budget import Choice, recompute_cost

    exact = partitioner == "min_cut"
    liveness = None if exact else step(
        "memory",
        lambda: JointLiveness(joint, num_fwd_outputs=num_fwd_outputs, static_input_indices=static_lifetime_input_indices),
    )
    chooser = policy.chooser()
    knob = None
    if exact and chooser.fraction is not None:
        with activation_memory_budget(chooser.fraction):
            knob = plan_with(_leave_open, policy_name)
        chooser.ceiling = knob[2].peak_bytes
    first = lowest = planned = lowest_planned = None
    lowest_peak = None
    offered = iter(step("solve", lambda: policy.candidates(joint, hard_rules(joint), fused=exact)))
    choice = None
    while (candidate := step("solve", lambda: next(offered, None))) is not None:
        if exact:
            planned = plan_with(candidate, policy_name)
            estimate = Estimate(peak_bytes=planned[2].peak_bytes, gradient_bytes=planned[2].gradient_bytes)
        else:
            estimate = step("memory", lambda: liveness.estimate(candidate.recomputed))
        first = first or candidate
        if lowest_peak is None or estimate.peak_bytes < lowest_peak:
            lowest, lowest_peak, lowest_planned = candidate, estimate.peak_bytes, planned
        choice = step("select", lambda: chooser.accept(estimate, candidate))
        if choice is not None:
            break
    if knob is not None:
        knob_cost = recompute_cost(joint, knob[2].recomputed, fused=True)
        if choice is None and knob[2].peak_bytes <= chooser.limit:  # none of ours is as lean: torch's
            return knob, Choice(
                limit_bytes=chooser.limit, baseline_peak=chooser.base.peak_bytes,
                smallest_peak=min(chooser.peaks + [knob[2].peak_bytes]), peak=knob[2].peak_bytes, cost=knob_cost,
                solver="torch-knob", candidates=len(chooser.peaks) + 1,
            )
        chooser.peaks.append(knob[2].peak_bytes)  # the lowest any plan reaches counts torch's too
    if choice is not None:
        return (planned if exact else plan_with(candidate, policy_name)), choice
    # Nothing fits: the lowest plan, with the budget it reaches (an error under strict); or, when
    # no plan lowers this graph's peak at all (nothing in it to recompute), the graph as it is.
    knob_lowest = knob is not None and knob[2].peak_bytes < lowest_peak
    if knob_lowest:
        lowest_peak = knob[2].peak_bytes
    choice, error = step("select", lambda: chooser.reject(first, lowest, lowest_peak))
    if error is not None:
        if strict:
            raise error
        warn_user(f"ckpt_fx: {error}; planned the lowest")
    if knob_lowest and error is not None:
        return knob, dataclasses.replace(choice, cost=knob_cost, solver="torch-knob")
    found = lowest if error is not None else first
    if exact and found is lowest and lowest_planned is not None:
        return lowest_planned, choice
    return plan_with(found, policy_name), choice


def _leave_open(info) -> CheckpointPolicy:
    """Every decision left to the partitioner (torch's own plan)."""
    return CheckpointPolicy.PREFER_SAVE


# Note [Torch's knob as a candidate]
# Under Inductor, torch's activation_memory_budget=x plans with the min-cut partitioner too, by
# its own rules (a knapsack over the ops min-cut would not recompute). budget:x plans torch's plan
# at the same x first and takes its predicted peak as a ceiling: our cheapest candidate whose
# predicted peak fits both our limit and that ceiling is chosen; only when none does is torch's
# plan itself used (Choice.solver == "torch-knob"). So budget:x is predicted to keep no more than
# torch's knob at x. Choosing torch's plan whenever our cost model priced it lower was tried: the
# memory pass predicts torch's aggressive pointwise recompute poorly under Inductor (GPT-2 12x256
# at 0.3: 207.9 MB predicted, 301.9 MB measured), so it was chosen over a plan measured at 193 MB.
