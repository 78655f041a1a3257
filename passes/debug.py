"""debug: check every recomputed tensor in the backward against the forward's original.

Note [Debug checks]
A recomputed value must be what the forward computed: same shape, dtype and strides always, and
the same values for deterministic ops. The checks run in the backward, right after each
recomputed node, and the first mismatch raises a RuntimeError naming the node and its module path.
Shapes, dtypes and strides are compared with the traced metadata (symbolic sizes are skipped).
Values need the original, so with values=True the forward also keeps every value it will
recompute, in a store owned by this graph's pair of checks: debugging memory, not training memory.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch

from passes.regions import PATH_KEY


def _expected(node: torch.fx.Node) -> tuple | None:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    shape = tuple(d if isinstance(d, int) else None for d in value.shape)
    try:
        stride = tuple(s if isinstance(s, int) else None for s in value.stride())
    except RuntimeError:  # sparse or otherwise strideless
        stride = None
    return shape, stride, value.dtype


def check_recomputed(value: object, name: str, path: str, expected: tuple, original: object = None) -> None:
    """Raise RuntimeError if a recomputed tensor differs from what the forward produced."""
    if not isinstance(value, torch.Tensor):
        return
    shape, stride, dtype = expected
    where = f"recomputed {name} (module {path or '<top>'})"
    got_shape = tuple(value.shape)
    if len(got_shape) != len(shape) or any(e is not None and e != g for e, g in zip(shape, got_shape)):
        raise RuntimeError(f"ckpt_fx debug: {where} has shape {got_shape}, the forward's was {shape}")
    if value.dtype != dtype:
        raise RuntimeError(f"ckpt_fx debug: {where} has dtype {value.dtype}, the forward's was {dtype}")
    if stride is not None and any(e is not None and e != g for e, g in zip(stride, value.stride())):
        raise RuntimeError(f"ckpt_fx debug: {where} has strides {value.stride()}, the forward's were {stride}")
    if isinstance(original, torch.Tensor) and not torch.equal(value, original):
        diff = (value.double() - original.double()).abs().max().item()
        raise RuntimeError(f"ckpt_fx debug: {where} differs from the forward's value (max abs difference {diff:g})")


def _named(fn: Callable, name: str) -> Callable:
    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = __name__
    return fn


def debug_checks_pass(
    fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, *, recomputed: set[str], values: bool = False
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Insert a check after every recomputed node of bw (Note [Debug checks]); with values=True
    also stash the originals from fw. Mutates both graphs in place, keeps names; deterministic."""
    store: dict[str, torch.Tensor] = {}

    def stash(name: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            store[name] = value.detach()

    def check(value: object, name: str, path: str, expected: tuple) -> None:
        check_recomputed(value, name, path, expected, store.pop(name, None) if values else None)

    stash, check = _named(stash, "ckpt_fx_stash"), _named(check, "ckpt_fx_check")
    if values:
        for node in list(fw.graph.nodes):
            if node.name in recomputed and node.op == "call_function" and node.target is not operator.getitem:
                with fw.graph.inserting_after(node):
                    fw.graph.call_function(stash, (node.name, node))
        fw.recompile()
    for node in list(bw.graph.nodes):
        if node.name not in recomputed or node.op != "call_function" or node.target is operator.getitem:
            continue
        expected = _expected(node)
        if expected is None:
            continue
        with bw.graph.inserting_after(node):
            bw.graph.call_function(check, (node, node.name, node.meta.get(PATH_KEY, ""), expected))
    bw.recompile()
    return fw, bw
