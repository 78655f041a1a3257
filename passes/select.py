"""select: one recompute decision per forward node, hard rules first, then the policy."""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass

import torch

from passes._compat import (
    RECOMPUTE_KEY,
    CheckpointPolicy,
    HigherOrderOperator,
    OpOverload,
    dropout_off,
    is_impure_not_random,
    op_schema,
    size_hint,
)
from passes.costs import BYTES_KEY, FLOPS_KEY, is_multi_output, is_view, tensor_bytes
from passes.graphs import forward_nodes
from passes.offload import OFFLOAD_KEY, offloadable
from passes.policy import NodeInfo, Policy
from passes.regions import PATH_KEY, WHOLE_UNIT_KEY, Region, RegionKind, region_of

REASON_KEY = "ckpt_fx.reason"
CPU_RNG_STATE_BYTES = torch.get_rng_state().numel()  # a uint8 tensor: 5056 bytes
"""The CPU generator's state in bytes: what a replayed CPU dropout saves instead of its mask."""

SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
RECOMPUTE = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
OFFLOAD = (CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD)
"""Saved in host memory (Note [Offload] in passes/offload.py): MUST_ offloads the value, PREFER_
offloads it when the partitioner saves it."""


class HardRule(str, enum.Enum):
    """Why a node must never be recomputed; no policy overrides these."""

    RANDOM = "random"
    """It draws random numbers (a dropout mask): a second draw would differ. A CPU dropout whose
    mask outweighs the generator's state is drawn again from that state instead (replayable)."""
    COLLECTIVE = "collective"
    """It communicates with other ranks."""
    MUTATION = "mutation"
    """It writes into its inputs."""
    EFFECTFUL = "effectful"
    """It has effects torch orders with tokens."""
    IMPURE = "impure"
    """fx counts it as having side effects."""
    MUTATION_SOURCE = "mutation source"
    """Its value is copied into an input (BatchNorm's running statistics): it runs exactly once."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Reason:
    """Who decided a forward node (node.meta[REASON_KEY]): a hard rule, on the node itself or on
    the tuple it is an element of, or the policy (rule None)."""

    rule: HardRule | None = None
    tuple_element: bool = False

    def __str__(self) -> str:
        if self.rule is None:
            return "policy"
        return f"{self.rule} (tuple element)" if self.tuple_element else str(self.rule)


BY_POLICY = Reason()


def hard_rule(node: torch.fx.Node) -> HardRule | None:
    """Why a node must never be recomputed, or None. No policy overrides these."""
    target = node.target
    if node.op != "call_function":
        return None
    if isinstance(target, OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags and not dropout_off(target, node.args, node.kwargs) and not replayable(node):
            return HardRule.RANDOM
        if target.namespace in ("_c10d_functional", "c10d_functional", "c10d", "_dtensor"):
            return HardRule.COLLECTIVE
        if op_schema(target).is_mutable:
            return HardRule.MUTATION
    if isinstance(target, HigherOrderOperator) and target.name() in ("with_effects", "run_with_rng_state"):
        return HardRule.EFFECTFUL
    if is_impure_not_random(node):
        return HardRule.IMPURE
    # The source of a mutation of an input (BatchNorm's running stats), or a tuple one element
    # of which is: the op runs exactly once, in the forward.
    outputs = [u for u in node.users if u.target is operator.getitem] or [node]
    for out in outputs:
        for user in out.users:
            if user.target is torch.ops.aten.copy_.default and user.args[1] is out:
                return HardRule.MUTATION_SOURCE
    return None


# Note [Dropout replayed]
# torch.utils.checkpoint keeps no dropout mask: it saves the generator's state at a block's entry
# and draws the same numbers again when it recomputes the block. torch's partitioners do the same
# for a random op a plan recomputes (functionalize_rng_ops): the forward runs it under
# run_and_save_rng_state, the backward under run_with_rng_state with the saved state, so the
# mask drawn again is the forward's, bit for bit (Inductor runs both wrappers as eager kernels).
# A CPU generator's state is 5056 bytes, a mask one byte an element: a dropout whose mask is the
# larger is replayable, so a policy may recompute it and the plan keeps the state (a
# "random-number state" among Plan.saved) instead of the mask; a smaller one stays a hard rule
# (saving its mask keeps less). Not on CUDA yet, where the state is a seed and an offset and
# torch threads it through graph-safe generators: not tested here without a GPU, so CUDA dropouts
# keep their masks. Inductor's own random numbers (fallback_random off) are drawn by its seed ops,
# which stay hard-ruled; their masks are saved as before.


def replayable(node: torch.fx.Node) -> bool:
    """A dropout (native_dropout) on a CPU whose mask takes more bytes than the generator's state:
    recomputed, it draws again from the state saved when it first ran, so its mask equals the
    forward's and the state is saved instead of the mask (Note [Dropout replayed])."""
    if node.target is not torch.ops.aten.native_dropout.default:
        return False
    p = node.args[1] if len(node.args) > 1 else None
    if not isinstance(p, float) or not 0.0 < p < 1.0:
        return False  # no draw to replay (a dropout of 0 is left as it was)
    value = node.meta.get("val")
    mask = value[1] if isinstance(value, (tuple, list)) and len(value) == 2 else None
    if not isinstance(mask, torch.Tensor) or mask.device.type != "cpu":
        return False
    return tensor_bytes(mask) > CPU_RNG_STATE_BYTES


def _info(node: torch.fx.Node, fwd: set[torch.fx.Node]) -> NodeInfo:
    region: Region = region_of(node) or Region(kind=RegionKind.OTHER)
    users = []
    for user in node.users:
        if user.op == "output" or user in fwd:
            r = region_of(user)
            users.append(r.block if r is not None else None)
    value = node.meta.get("val")
    tensor = isinstance(value, torch.Tensor)
    op = node.target
    return NodeInfo(
        name=node.name,
        op="getitem" if op is operator.getitem else str(op),
        module_path=node.meta.get(PATH_KEY, ""),
        region=region.kind,
        block=region.block,
        user_blocks=tuple(users),
        shape=tuple(size_hint(d) for d in value.shape) if tensor else None,
        dtype=value.dtype if tensor else None,
        nbytes=node.meta.get(BYTES_KEY, 0),
        flops=node.meta.get(FLOPS_KEY, 0),
        is_view=is_view(node),
        producer=str(node.args[0].target) if op is operator.getitem and isinstance(node.args[0], torch.fx.Node) else str(op),
    )


def hard_rules(gm: torch.fx.GraphModule) -> dict[str, Reason]:
    """{node name: why} for the forward call nodes that must never be recomputed (see hard_rule);
    a tuple element inherits its producer's rule."""
    forced: dict[str, Reason] = {}
    for node in forward_nodes(gm.graph):
        if node.op != "call_function":
            continue
        rule = hard_rule(node)
        parent = node.args[0] if node.target is operator.getitem else None
        if rule is not None:
            forced[node.name] = Reason(rule)
        elif isinstance(parent, torch.fx.Node) and (parent_rule := hard_rule(parent)) is not None:
            forced[node.name] = Reason(parent_rule, tuple_element=True)
    return forced


def select_pass(gm: torch.fx.GraphModule, *, policy: Policy) -> dict[str, Reason]:
    """Write a CheckpointPolicy into node.meta["recompute"] of every forward call node.

    Hard rules (random ops, mutations and their sources, effectful ops, collectives) give
    MUST_SAVE and are applied to a multi-output node's getitems too; the policy decides the rest.
    An offload decision (OFFLOAD) is written as a save, with node.meta[OFFLOAD_KEY] set: the
    planner's offload pass moves what was saved (passes.offload).
    node.meta[REASON_KEY] says who decided (Reason); node.meta[WHOLE_UNIT_KEY] marks what a policy
    that recomputes whole units (NamedPolicy.whole_units) decided. Mutates node.meta only; deterministic.
    Returns {node name: reason} for the hard-ruled nodes.
    """
    fwd_list = forward_nodes(gm.graph)
    fwd = set(fwd_list)
    for node in gm.graph.nodes:
        node.meta.pop(RECOMPUTE_KEY, None)
        node.meta.pop(REASON_KEY, None)
        node.meta.pop(OFFLOAD_KEY, None)
        node.meta.pop(WHOLE_UNIT_KEY, None)
    whole = bool(getattr(policy, "whole_units", False))
    forced = hard_rules(gm)
    for node in fwd_list:
        if node.name in forced:
            node.meta[RECOMPUTE_KEY] = CheckpointPolicy.MUST_SAVE
            node.meta[REASON_KEY] = forced[node.name]
    for node in fwd_list:
        if node.op != "call_function" or node.name in forced:
            continue
        decision = policy(_info(node, fwd))
        if not isinstance(decision, CheckpointPolicy):
            raise TypeError(
                f"policy {getattr(policy, '__name__', policy)!r} returned {decision!r} for node "
                f"{node.name} ({node.meta.get(PATH_KEY, '')}); a policy must return a "
                "torch.utils.checkpoint.CheckpointPolicy (MUST_SAVE, PREFER_SAVE, MUST_RECOMPUTE, PREFER_RECOMPUTE, "
                "MUST_CPU_OFFLOAD or PREFER_CPU_OFFLOAD)"
            )
        if decision in OFFLOAD:
            if offloadable(node):  # what cannot move (a size under dynamic shapes, a view) stays on the device
                node.meta[OFFLOAD_KEY] = True
            decision = CheckpointPolicy.MUST_SAVE if decision == CheckpointPolicy.MUST_CPU_OFFLOAD else CheckpointPolicy.PREFER_SAVE
        node.meta[RECOMPUTE_KEY] = decision
        node.meta[REASON_KEY] = BY_POLICY
        if whole:
            node.meta[WHOLE_UNIT_KEY] = True
    _recompute_tuples_of_recomputed_elements(fwd_list)
    _replayed_or_saved(fwd_list)
    return forced


def _replayed_or_saved(nodes: list[torch.fx.Node]) -> None:
    """A replayable dropout is recomputed or saved as the policy says, never left to the
    partitioner (PREFER_): torch draws it again from a saved state only when it is tagged
    recomputed, so one that min-cut chose to recompute on its own would draw new numbers. Saved,
    its elements are saved with it, as under the hard rule."""
    for node in nodes:
        if node.op != "call_function" or node.meta.get(REASON_KEY) != BY_POLICY or not replayable(node):
            continue
        if node.meta.get(RECOMPUTE_KEY) in RECOMPUTE:
            node.meta[RECOMPUTE_KEY] = CheckpointPolicy.MUST_RECOMPUTE
            continue
        node.meta[RECOMPUTE_KEY] = CheckpointPolicy.MUST_SAVE
        for user in node.users:
            if user.target is operator.getitem:
                user.meta[RECOMPUTE_KEY] = CheckpointPolicy.MUST_SAVE


def _recompute_tuples_of_recomputed_elements(nodes: list[torch.fx.Node]) -> None:
    """A multi-output node (its users all getitems) is never saved itself: rebuilding a recomputed
    element recomputes the node. So a node with a recomputed element is marked recomputed too, or
    torch's partitioner does not keep its inputs for the backward: a parameter the backward reads
    nowhere else (BatchNorm's bias) is then missing, and partitioning fails."""
    for node in nodes:
        if node.op != "call_function" or node.meta.get(REASON_KEY) != BY_POLICY:
            continue
        if node.meta.get(RECOMPUTE_KEY) not in SAVE or not is_multi_output(node):
            continue
        elements = [u.meta.get(RECOMPUTE_KEY) for u in node.users]
        if CheckpointPolicy.MUST_RECOMPUTE in elements:
            node.meta[RECOMPUTE_KEY] = CheckpointPolicy.MUST_RECOMPUTE
        elif CheckpointPolicy.PREFER_RECOMPUTE in elements:
            node.meta[RECOMPUTE_KEY] = CheckpointPolicy.PREFER_RECOMPUTE
