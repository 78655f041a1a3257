"""The passes, in order. Each is a function in its own module; this file only lists them."""

from __future__ import annotations

import logging

import torch

from passes import budget
from passes.batchnorm import batchnorm_pass
from passes.costs import costs_pass
from passes.dropout import dropout_pass
from passes.graphs import forward_nodes
from passes.grouped_mm import grouped_mm_pass
from passes.plan import GraphFacts, Plan, assemble
from passes.planner import Joint, plan_policy
from passes.policy import BudgetSpec, Policy, uses_blocks
from passes._compat import CHECKPOINT_REGION_KEY
from passes.regions import PATH_KEY, block_of, regions_pass
from passes.select import hard_rules
from passes.steps import Dump, Steps
from passes.targets import EAGER, Target

log = logging.getLogger("ckpt_fx")


def run(
    joint: torch.fx.GraphModule,
    joint_inputs: object,
    *,
    policy: Policy,
    policy_name: str,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
    target: Target = EAGER,
    strict: bool = False,
    dump: Dump | None = None,
    device: str | None = None,
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, Plan]:
    """dropout -> batchnorm -> grouped_mm -> regions -> costs, then the plan: a per-node policy's
    (passes.planner: select -> partition -> fold twins -> schedule -> memory), or a memory
    budget's search over such plans (passes.budget); returns (fw, bw, plan).

    `target`: the inner compiler the plan is for (passes.targets).
    `strict`: a memory budget no plan reaches raises instead of planning the lowest with a warning.
    `dump(pass_name, "before"|"after", gm)`, when given, sees each pass's graph.
    `device`: the device type to plan for when not the graph's own (its costs).
    """
    steps = Steps(dump)
    steps.run("dropout", lambda: dropout_pass(joint), joint)
    steps.run("batchnorm", lambda: batchnorm_pass(joint), joint)
    steps.run("grouped_mm", lambda: grouped_mm_pass(joint), joint)
    # A policy that does not look at blocks (graph(), none()) needs no warning about missing ones.
    region_map = steps.run("regions", lambda: regions_pass(joint, warn=uses_blocks(policy)), joint)
    steps.run("costs", lambda: costs_pass(joint), joint)
    forced = steps.run("select", lambda: hard_rules(joint))
    facts = GraphFacts(
        units=region_map.blocks,
        module_paths=tuple(sorted({n.meta[PATH_KEY] for n in joint.graph.nodes if n.meta.get(PATH_KEY)})),
        top_level_units=region_map.top_level_units,
        checkpointed_by_model=tuple(dict.fromkeys(  # before select_pass replaces the model's own tags
            block_of(n).name for n in forward_nodes(joint.graph)
            if CHECKPOINT_REGION_KEY in n.meta and block_of(n) is not None)),
    )
    prepared = Joint(gm=joint, inputs=joint_inputs, num_fwd_outputs=num_fwd_outputs,
                     static_lifetime_input_indices=static_lifetime_input_indices, target=target,
                     block_paths=tuple(b.name for b in region_map.blocks), steps=steps, device=device)
    if isinstance(policy, BudgetSpec):
        planned, choice = budget.choose(prepared, policy, hard_rules=forced, strict=strict)
    else:
        planned, choice = plan_policy(prepared, policy), None
    plan = assemble(planned, policy=policy_name, facts=facts,
                    hard_rules={name: reason.rule for name, reason in forced.items()}, choice=choice)
    log.log(logging.INFO if dump is not None else logging.DEBUG,  # debug runs list the passes at INFO
            "ckpt_fx passes: %s", steps.summary())
    return planned.forward, planned.backward, plan
