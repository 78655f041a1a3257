"""The passes, in order. Each is a function in its own module; this file only lists them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from passes.costs import costs_pass
from passes.dropout import dropout_pass
from passes.memory import JointLiveness, Plan, memory_pass
from passes.partition import partition_pass
from passes.regions import forward_nodes, regions_pass
from passes.schedule import schedule_pass
from passes.select import Policy, hard_rules, select_pass

log = logging.getLogger("ckpt_fx")

PASSES = ("dropout", "regions", "costs", "select", "partition", "schedule", "memory")


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
    dump: Callable[[str, str, torch.fx.GraphModule], None] | None = None,
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, Plan]:
    """dropout -> regions -> costs -> select -> partition -> schedule -> memory; returns (fw, bw, plan).

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
    # A policy that does not look at blocks (graph(), none()) needs no warning about missing ones.
    warn = getattr(policy, "uses_blocks", True)
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
            ),
            joint,
        )
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
                block_paths=tuple(b.path for b in region_map.blocks),
                static_input_indices=static_lifetime_input_indices,
            ),
        )
        return fw, bw, plan

    # A policy with candidates (a memory budget) offers several plans; the policy picks one by
    # their predicted peaks (Note [Peak-aware budget]), each predicted from the joint graph (Note
    # [Peak from the joint graph]); only the chosen one is partitioned.
    candidates = getattr(policy, "candidates", None)
    if candidates is None:
        fw, bw, plan = plan_with(policy, policy_name)
    else:
        liveness = step(
            "memory",
            lambda: JointLiveness(
                joint, num_fwd_outputs=num_fwd_outputs, static_input_indices=static_lifetime_input_indices
            ),
        )
        chooser = policy.chooser()
        found = first = None
        offered = iter(step("solve", lambda: candidates(joint, hard_rules(joint))))
        while (candidate := step("solve", lambda: next(offered, None))) is not None:
            estimate = step("memory", lambda: liveness.estimate(candidate.recomputed))
            first = first or candidate
            choice = step("select", lambda: chooser.accept(estimate, candidate))
            if choice is not None:
                found = candidate
                policy.choices.append(choice)
                break
        if found is None:
            # Nothing fits: an error naming the smallest feasible budget, or, when no plan lowers
            # this graph's peak at all (nothing in it to recompute), the graph as it is.
            policy.choices.append(step("select", lambda: chooser.reject(first)))
            found = first
        fw, bw, plan = plan_with(found, policy_name)
    log.log(
        logging.INFO if dump is not None else logging.DEBUG,  # debug runs list the passes at INFO
        "ckpt_fx passes: %s",
        ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in timings.items()),
    )
    return fw, bw, plan
