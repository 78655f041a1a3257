"""costs: the cost model. Bytes and FLOPs per node, from the fake values tracing left in
node.meta["val"]; what recomputing a node costs (a roofline, or its time measured); which ops the
inner compiler fuses."""

from __future__ import annotations

import fnmatch
import functools
import operator
import time
from collections.abc import Callable

import torch
from torch.utils.flop_counter import flop_registry

from passes._compat import OpOverload, is_fusible, op_schema, outside_fake_mode, pytree, size_at, size_hint

BYTES_KEY = "ckpt_fx.bytes"
FLOPS_KEY = "ckpt_fx.flops"


def tensor_bytes(value: object, sizes: dict[str, int] | None = None) -> int:
    """Bytes a tensor value occupies (0 for non-tensors); symbolic sizes use their hints, or the
    values `sizes` gives their symbols."""
    if not isinstance(value, torch.Tensor):
        return 0
    return _numel(value, sizes) * value.dtype.itemsize


def is_view(node: torch.fx.Node) -> bool:
    """True when the node's output aliases an input (a view: it allocates nothing)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return False
    return _returns_an_alias(target)


@functools.cache
def _returns_an_alias(op: OpOverload) -> bool:
    """Whether an op's schema marks a returned value as aliasing an input. Cached: the passes ask it
    of every node, many times per plan, and reading a schema's returns builds them anew."""
    return any(ret.alias_info is not None for ret in op_schema(op).returns)


def is_multi_output(node: torch.fx.Node) -> bool:
    """A node whose value is a tuple read through getitem nodes."""
    return bool(node.users) and all(u.target is operator.getitem for u in node.users)


# Note [Op classes]
# The ops that compute, by class: what selective() saves by name, and what the cost model must
# never price by bytes alone. A class is matched on the op's overload packet name ("aten.mm"), so
# a kernel torch adds under a known name pattern (another attention variant, a grouped matmul of a
# library's own namespace) falls into its class without a change here. Backward kernels are not in
# a class: selective saves forward values.
OP_CLASSES = {
    "matmul": ("aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten._int_mm", "aten._grouped_mm",
               "*grouped_mm*"),
    "conv": ("aten.convolution", "aten.cudnn_convolution", "aten.mkldnn_convolution", "aten._convolution"),
    "attention": ("*attention*", "*attn*"),
}


def op_class(packet: str) -> str | None:
    """The class (Note [Op classes]) of an op named by its overload packet ("aten.mm"), or None."""
    if "backward" in packet:
        return None
    for name, patterns in OP_CLASSES.items():
        if any(fnmatch.fnmatchcase(packet, pattern) for pattern in patterns):
            return name
    return None


def _attention_flops(query: object, key: object, value: object) -> int:
    """Two matrix products of an attention forward, q @ k^T and p @ v, with as many key heads as
    query heads or fewer (grouped-query attention); a causal mask is not halved (torch's counter
    does the same)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in (query, key, value)):
        return 0
    d, s_k, d_v = size_hint(query.shape[-1]), size_hint(key.shape[-2]), size_hint(value.shape[-1])
    query_rows = _numel(query) // d  # batch x heads x query length
    return 2 * query_rows * s_k * (d + d_v)


def _own_formula(packet: str, args: tuple, out: object) -> int:
    """FLOPs of a computing op torch's counter has no formula for (Note [Op classes]): attention
    kernels by their query, key and value (a backward: two and a half forwards, as torch counts),
    matrix products by their output and inner dimension; 0 for any other op."""
    backward = packet.endswith("_backward")
    kind = op_class(packet[: -len("_backward")] if backward else packet)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if kind == "attention":
        q, k, v = (tensors[1:4] if backward else tensors[:3]) if len(tensors) >= 3 + backward else (None,) * 3
        forward = _attention_flops(q, k, v)
        return forward * 5 // 2 if backward else forward
    if kind == "matmul" and backward and len(tensors) >= 2:
        # (input, weight, ..., grad_output), as transformers' grouped_mm_fallback_backward takes them:
        # the input's gradient and the weight's, each one product the size of the forward's.
        return 2 * 2 * _numel(tensors[0]) * size_hint(tensors[-1].shape[-1])
    if kind == "matmul" and tensors and isinstance(out, torch.Tensor):
        return 2 * _numel(out) * size_hint(tensors[0].shape[-1])
    return 0


def _numel(value: torch.Tensor, sizes: dict[str, int] | None = None) -> int:
    """Elements of a tensor value, symbolic sizes at their hints or at the values `sizes` gives."""
    numel = 1
    for dim in value.shape:
        numel *= size_at(dim, sizes) if sizes else size_hint(dim)
    return numel


def node_flops(node: torch.fx.Node) -> int:
    """FLOPs of one call, from torch.utils.flop_counter's formulas, or our own for the computing ops
    it has none for (Note [Op classes]); 0 for the rest (pointwise, normalisation, data movement:
    the roofline prices them by their bytes)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return 0

    def val(a):
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    args = pytree.tree_map(val, node.args)
    kwargs = pytree.tree_map(val, node.kwargs)
    formula = flop_registry.get(target.overloadpacket)
    try:
        if formula is None:
            return _own_formula(str(target.overloadpacket), tuple(args), node.meta.get("val"))
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


# Note [Roofline cost]
# The recompute cost of a node is its time on a roofline: max(FLOPs / peak FLOP/s, bytes moved /
# bandwidth), bytes moved being its inputs' and output's sizes. Only ratios between nodes matter to
# the solver, so the constants need to be right in proportion, not exactly: they put matmuls
# (compute-bound) and pointwise ops (memory-bound) on one scale.
ROOFLINES = {  # device type: (FLOP/s, bytes/s)
    "cpu": (2e11, 2e10),
    "cuda": (4e14, 3e12),
}
_OVERHEAD_S = 1e-6  # per op: launching anything costs something


def fuses(node: torch.fx.Node) -> bool:
    """Whether Inductor fuses the op into its consumers: torch's min-cut partitioner's list
    (pointwise ops and reductions), the one notion of fusion the cost model and the memory pass
    share."""
    return is_fusible(node)


def roofline_cost(node: torch.fx.Node, device: str, *, fused: bool = False) -> float:
    """Note [Roofline cost]; `fused`: the inner compiler fuses ops into their consumers (Inductor,
    `fuses`), so recomputing one costs reading its inputs once more: no launch, no output written."""
    flops_s, bytes_s = ROOFLINES.get(device, ROOFLINES["cuda"])
    if is_view(node) or node.target is operator.getitem:
        return 0.0
    reads = sum(tensor_bytes(arg.meta.get("val")) for arg in node.all_input_nodes)
    if fused and fuses(node):
        return reads / bytes_s
    moved = reads + tensor_bytes(node.meta.get("val"))
    return _OVERHEAD_S + max(node.meta.get(FLOPS_KEY, 0) / flops_s, moved / bytes_s)


def graph_device(gm: torch.fx.GraphModule) -> str:
    """The device type of a graph's first tensor value ("cpu" when it has none)."""
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


def recompute_cost(gm: torch.fx.GraphModule, names: tuple[str, ...] | list[str] | frozenset[str], *,
                   fused: bool) -> float:
    """Roofline cost (Note [Roofline cost]) of recomputing the named forward nodes of a joint graph."""
    device = graph_device(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    return sum(roofline_cost(by_name[n], device, fused=fused) for n in names if n in by_name)


def measured_costs(device: str) -> Callable[[torch.fx.Node], float]:
    """A cost per node from timing it: the op run on random tensors of its arguments' shapes and
    dtypes (integers as zeros, so indices stay in range), best of three after a warm-up. Ops alike
    in target, shapes and arguments are timed once. A node that cannot be run this way (an op
    needing particular values) gets its roofline cost. Timings differ between machines and runs:
    under a process group the ranks agree on rank 0's (agreed_costs)."""
    seen: dict[tuple, float] = {}

    def real(value: object) -> object:
        if isinstance(value, torch.fx.Node):
            value = value.meta.get("val")
        if isinstance(value, torch.Tensor):
            shape = tuple(size_hint(d) for d in value.shape)
            if value.dtype.is_floating_point or value.dtype.is_complex:
                return torch.randn(shape, dtype=value.dtype, device=device)
            return torch.zeros(shape, dtype=value.dtype, device=device)
        if isinstance(value, torch.SymInt):
            return size_hint(value)
        return value

    def describe(value: object) -> object:
        value = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(size_hint(d) for d in value.shape), value.dtype)
        return repr(value)

    def cost(node: torch.fx.Node) -> float:
        if is_view(node) or node.target is operator.getitem or node.op != "call_function":
            return 0.0
        key = (str(node.target), tuple(map(describe, node.args)), tuple((k, describe(v)) for k, v in node.kwargs.items()))
        if key not in seen:
            try:
                with outside_fake_mode(), torch.no_grad():  # real tensors, timed: not the tracer's fakes
                    args = pytree.tree_map(real, node.args)
                    kwargs = pytree.tree_map(real, node.kwargs)
                    times = []
                    for _ in range(4):
                        start = time.perf_counter()
                        node.target(*args, **kwargs)
                        if device == "cuda":
                            torch.cuda.synchronize()
                        times.append(time.perf_counter() - start)
                seen[key] = min(times[1:])
            except Exception:  # noqa: BLE001 - an op that needs particular values: the roofline
                seen[key] = roofline_cost(node, device)
        return seen[key]

    return cost


def agreed_costs(names: tuple[str, ...], costs: tuple[float, ...]) -> tuple[float, ...]:
    """Costs every rank of a process group agrees on: rank 0's, broadcast with its node names
    (Note [Plans bounded by counts]: ranks must reach the same plan; timed costs differ between
    them). Outside a process group, `costs` as they are. Raises RuntimeError when rank 0 planned
    another graph (its node names differ)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return costs
    message = [(names, costs)]
    with outside_fake_mode():  # a partitioner runs under the tracer's fake mode
        dist.broadcast_object_list(message, src=0)
    theirs, agreed = message[0]
    if tuple(theirs) != tuple(names):
        raise RuntimeError(
            f"costs='measured': rank {dist.get_rank()} plans another graph than rank 0 "
            f"({len(names)} values here, {len(theirs)} there), so the ranks cannot share rank 0's timings; "
            "use costs='roofline' (the default), which every rank computes alike")
    return tuple(agreed)
