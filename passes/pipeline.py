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
from passes.partition import merges_joint, partition_pass
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

    def plan_with(node_policy: Policy, name: str, cse: bool | None = None,
                  ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, Plan]:
        forced = step("select", lambda: select_pass(joint, policy=node_policy), joint)
        if dump is not None:
            dump("select", "after", joint)
        forward_names = {n.name for n in forward_nodes(joint.graph) if n.op == "call_function"}
        merged = merges_joint(joint, partitioner=partitioner, cse=cse)
        fw, bw = step(
            "partition",
            lambda: partition_pass(
                joint,
                joint_inputs,
                num_fwd_outputs=num_fwd_outputs,
                static_lifetime_input_indices=static_lifetime_input_indices,
                partitioner=partitioner,
                cse=cse,
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
        return fw, bw, dataclasses.replace(plan, joint_cse=merged)

    if not isinstance(policy, BudgetSpec):
        fw, bw, plan = plan_with(policy, policy_name)
        if plan.joint_cse is False:  # min-cut, with recomputes
            fw, bw, plan = _both_ways((fw, bw, plan), plan_with(policy, policy_name, cse=True))
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


def _both_ways(without: tuple, merged: tuple) -> tuple:
    """Of a policy's plans partitioned without and with min-cut's CSE of the joint graph, the one
    of lower predicted peak; the cheaper (less recomputed) on a tie (Note [CSE under recompute])."""
    order = lambda planned: (planned[2].peak_bytes, planned[2].recompute_flops)  # noqa: E731
    chosen = min((without, merged), key=order)
    log.info("ckpt_fx: %s partitioned with and without min-cut's CSE: %.1f / %.1f MB predicted; kept %s",
             chosen[2].policy, merged[2].peak_bytes / 2**20, without[2].peak_bytes / 2**20,
             "with" if chosen is merged else "without")
    return chosen


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
    """A memory budget's plan, its choice recorded in it (Plan.budget). A budget offers several
    candidate plans and picks one by their predicted peaks (Note [Peak-aware budget]): under the
    default partition by walking the joint graph (_choose_by_walk), under min-cut by planning them
    (_choose_by_planning). When none fits: the lowest, with a warning naming the budget it
    reaches (an Infeasible error under strict)."""
    if partitioner == "min_cut":
        (fw, bw, plan), choice, error = _choose_by_planning(plan_with, policy, policy_name, joint, step=step)
    else:
        (fw, bw, plan), choice, error = _choose_by_walk(
            plan_with, policy, policy_name, joint, step=step, num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices)
    if error is not None:
        if strict:
            raise error
        warn_user(f"ckpt_fx: {error}; planned the lowest")
    return fw, bw, dataclasses.replace(plan, budget=choice)


def _choose_by_walk(plan_with, policy, policy_name, joint, *, step, num_fwd_outputs, static_lifetime_input_indices):
    """Under the default partition: each candidate's peak predicted from the joint graph (Note
    [Peak from the joint graph]), most saved first, until one fits; only that one is partitioned.
    Returns ((fw, bw, plan), choice, error)."""
    liveness = step(
        "memory",
        lambda: JointLiveness(joint, num_fwd_outputs=num_fwd_outputs, static_input_indices=static_lifetime_input_indices),
    )
    chooser = policy.chooser()
    first = lowest = None
    lowest_peak = None
    offered = iter(step("solve", lambda: policy.candidates(joint, hard_rules(joint), fused=False)))
    while (candidate := step("solve", lambda: next(offered, None))) is not None:
        estimate = step("memory", lambda: liveness.estimate(candidate.recomputed))
        first = first or candidate
        if lowest_peak is None or estimate.peak_bytes < lowest_peak:
            lowest, lowest_peak = candidate, estimate.peak_bytes
        choice = step("select", lambda: chooser.accept(estimate, candidate))
        if choice is not None:
            return plan_with(candidate, policy_name), choice, None
    # Nothing fits: the lowest plan, with the budget it reaches; or, when no plan lowers this
    # graph's peak at all (nothing in it to recompute), the graph as it is.
    choice, error = chooser.reject(first.solution.cost, first.solution.solver, lowest_peak,
                                   lowest.solution.cost, lowest.solution.solver)
    return plan_with(lowest if error is not None else first, policy_name), choice, error


def _choose_by_planning(plan_with, policy, policy_name, joint, *, step):
    """Under min-cut, which adds recomputes of its own, a candidate's peak is known only once it is
    partitioned (the memory pass reads it from Inductor's schedule, Note [Inductor's own
    schedule]), so few are: Inductor's own partition (the baseline the limit counts from), torch's
    plan at the same budget (Note [Torch's knob as a candidate]), then the cheapest of ours that
    fits, found by bisection (the candidates save less and less: their peaks fall along them).
    The cheaper of ours and torch's is chosen, torch's only when it fits the limit. Returns
    ((fw, bw, plan), choice, error)."""
    from passes.budget import recompute_cost

    def estimate(planned) -> Estimate:
        return Estimate(peak_bytes=planned[2].peak_bytes, gradient_bytes=planned[2].gradient_bytes)

    def cost(planned) -> float:
        return recompute_cost(joint, planned[2].recomputed, fused=True)

    chooser = policy.chooser()
    base = plan_with(_leave_open, policy_name)  # what Inductor alone does: nothing recomputed by us
    found, solver = (base, "none") if chooser.fits(estimate(base)) else (None, None)
    torch_plan = knob = None
    if chooser.fraction is not None:
        with activation_memory_budget(chooser.fraction):
            torch_plan = plan_with(_leave_open, policy_name)
        if chooser.fits(estimate(torch_plan)):  # else over the limit: not a choice, and no ceiling on ours
            knob = torch_plan
            chooser.ceiling = knob[2].peak_bytes
            if found is not None and base[2].peak_bytes > chooser.ceiling:
                found = None
    offered = step("solve", lambda: policy.candidates(joint, hard_rules(joint), fused=True))
    planned: dict[tuple, tuple] = {}  # each distinct plan partitioned once

    def plan(i: int) -> tuple:
        candidate = step("solve", lambda: offered[i])
        if not candidate.recomputed:
            return base
        key = (candidate.solution.saved, candidate.solution.recomputed)
        if key not in planned:
            planned[key] = (plan_with(candidate, policy_name), candidate.solution.solver)
        return planned[key][0]

    verdicts: dict[int, bool] = {}  # by plan, judged once: Choice.candidates counts distinct plans

    def fits(i: int) -> bool:
        planned_i = plan(i)
        if id(planned_i) not in verdicts:
            verdicts[id(planned_i)] = chooser.fits(estimate(planned_i))
        return verdicts[id(planned_i)]

    if found is None:
        lowest = _lowest_from_the_end(len(offered), plan)
        if fits(lowest):
            low, high = -1, lowest  # offered[high] fits; offered[low] does not (or is none)
            while high - low > 1:
                middle = (low + high) // 2
                if fits(middle):
                    high = middle
                else:
                    low = middle
            found = plan(high)
            solver = next((name for p, name in planned.values() if p is found), "none")
    if knob is not None and (found is None or cost(knob) < cost(found)):
        found, solver = knob, "torch-knob"
    if found is not None:
        return found, chooser.choice(found[2].peak_bytes, cost=cost(found), solver=solver), None
    # Nothing fits: the lowest plan, with the budget it reaches; or, when no plan lowers this
    # graph's peak at all (nothing in it to recompute), the graph as it is.
    tried = [*planned.values(), *([(torch_plan, "torch-knob")] if torch_plan is not None else [])]
    lowest, solver = min(tried, key=lambda t: t[0][2].peak_bytes, default=(base, "none"))
    choice, error = chooser.reject(0.0, "none", lowest[2].peak_bytes, cost(lowest), solver)
    return (lowest if error is not None else base), choice, error


def _lowest_from_the_end(count: int, plan: Callable[[int], tuple]) -> int:
    """The candidate of lowest predicted peak, looked for from the one that saves least towards
    those that save more while the peak does not rise by more than PLATEAU (past the lowest, a
    plan that saves less can peak higher: it rebuilds more at once), at most LOWEST_SEARCH distinct
    plans; returns its position (of those as low, the one that saves most: the cheapest)."""
    best = count - 1
    tried, i = 1, best - 1
    while i >= 0 and tried < LOWEST_SEARCH:
        if plan(i) is not plan(best):  # else the same plan at another grid point
            tried += 1
            if plan(i)[2].peak_bytes > (1 + PLATEAU) * plan(best)[2].peak_bytes:
                break
            if plan(i)[2].peak_bytes <= plan(best)[2].peak_bytes:
                best = i
        i -= 1
    return best


LOWEST_SEARCH = 6
PLATEAU = 0.01
"""Distinct plans _lowest_from_the_end partitions at most, each costing a partition and
Inductor's schedule."""


def _leave_open(info) -> CheckpointPolicy:
    """Every decision left to the partitioner (torch's own plan)."""
    return CheckpointPolicy.PREFER_SAVE


# Note [Torch's knob as a candidate]
# Under Inductor, torch's activation_memory_budget=x plans with the min-cut partitioner too, by
# its own rules (a knapsack over the ops min-cut would not recompute), and our hard rules still
# hold in it (random ops, mutations are tagged MUST_SAVE before min-cut sees them). budget:x plans
# torch's plan at the same x; when its predicted peak fits our limit, that peak is a ceiling for
# ours, and torch's plan is itself a choice: the cheaper (recompute cost, Note [Roofline cost], of
# what each partition recomputes) of it and our cheapest candidate under the ceiling is used
# (Choice.solver == "torch-knob" when torch's). So budget:x keeps no more than torch's knob at x
# where that fits x's limit, and costs no more by our cost model. This needs the peaks predicted
# as Inductor runs the plans (Note [Inductor's own schedule]): predicted by the walk's own guess
# of fusion, torch's aggressive pointwise recompute looked far leaner than it is (GPT-2 12x256
# at 0.3: 207.9 MB predicted, 301.9 MB measured) and was chosen over a plan measured at 193 MB.
