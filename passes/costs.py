"""costs: bytes and FLOPs per node, from the fake values tracing left in node.meta["val"]."""

from __future__ import annotations

import operator

import torch
from torch.utils.flop_counter import flop_registry

from passes._compat import OpOverload, pytree, size_at, size_hint

BYTES_KEY = "ckpt_fx.bytes"
FLOPS_KEY = "ckpt_fx.flops"


def tensor_bytes(value: object, sizes: dict[str, int] | None = None) -> int:
    """Bytes a tensor value occupies (0 for non-tensors); symbolic sizes use their hints, or the
    values `sizes` gives their symbols."""
    if not isinstance(value, torch.Tensor):
        return 0
    numel = 1
    for dim in value.shape:
        numel *= size_at(dim, sizes) if sizes else size_hint(dim)
    return numel * value.dtype.itemsize


def is_view(node: torch.fx.Node) -> bool:
    """True when the node's output aliases an input (a view: it allocates nothing)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return False
    return any(ret.alias_info is not None for ret in target._schema.returns)


def is_multi_output(node: torch.fx.Node) -> bool:
    """A node whose value is a tuple read through getitem nodes."""
    return bool(node.users) and all(u.target is operator.getitem for u in node.users)


def node_flops(node: torch.fx.Node) -> int:
    """FLOPs of one call, from torch.utils.flop_counter's formulas; 0 where it has none."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return 0
    formula = flop_registry.get(target.overloadpacket)
    if formula is None:
        return 0

    def val(a):
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    args = pytree.tree_map(val, node.args)
    kwargs = pytree.tree_map(val, node.kwargs)
    try:
        return size_hint(formula(*args, out_val=node.meta.get("val"), **kwargs))
    except Exception:  # noqa: BLE001 - a formula that cannot read these shapes counts nothing
        return 0


def costs_pass(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Write BYTES_KEY (0 for views and tuples) and FLOPS_KEY into node.meta of every node.

    Mutates node.meta only; keeps nodes and names; deterministic.
    """
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        node.meta[BYTES_KEY] = 0 if is_view(node) else tensor_bytes(value)
        node.meta[FLOPS_KEY] = node_flops(node)
    return gm
