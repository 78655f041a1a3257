"""memory: walk the partitioned forward then backward (passes.liveness), or ask Inductor for its
schedule of them (passes.inductor_memory); predict saved bytes and peaks (a Prediction)."""

from __future__ import annotations

import dataclasses

import functools
import operator

import torch

from passes._compat import (
    CPU_OFFLOAD_PREFIX,
    OpOverload,
    is_primal,
    is_tangent,
    op_short_name,
    saved_state_draws_nothing,
    size_at,
    size_hint,
    symbols_of,
)
from passes.costs import FLOPS_KEY, fuses, is_view, node_flops, tensor_bytes
from passes.graphs import snapshot
from passes.head import workspace_bytes
from passes.inductor_memory import scheduled_peaks
from passes.liveness import just_in_time, walk
from passes.offload import on_host
from passes.plan import BlockPlan, Estimate, PeakModel, Prediction, SavedTensor
from passes.regions import PATH_KEY, block_of, region_of
from passes.targets import EAGER, Target

# Note [What the predicted peak counts]
# Bytes allocated during one training step above what was live before it: forward temporaries,
# saved activations and outputs, then in the backward the incoming gradients, rebuilt activations,
# gradient temporaries and the parameter gradients it returns. Parameters, buffers and inputs
# exist before the step and count zero, as do views (they share their base's storage and keep
# it alive). The eager runner frees a value after its last use, and so does this walk. The
# graph's outputs are assumed held by the caller until its backward ends (HF's output object
# holds the logits); a caller that drops them early peaks a little lower than predicted. Only
# parameter gradients outlive the step: an activation's gradient returned by a later graph is
# the incoming gradient of the earlier one. The measured peak (ckpt_fx.measure) counts the same.


def view_base(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node a view reads its storage from (its first argument); None for a node that is no view."""
    if is_view(node) and node.args and isinstance(node.args[0], torch.fx.Node):
        return node.args[0]
    return None


def storage_of(node: torch.fx.Node) -> torch.fx.Node:
    """The node that allocated the storage a value lives in: itself, or for a view (of a view...)
    the base it reads. Views count zero bytes and keep their base alive."""
    while (base := view_base(node)) is not None:
        node = base
    return node


def _walk(
    graph: torch.fx.Graph,
    *,
    live: dict[object, int],
    key_of: dict[torch.fx.Node, object],
    pinned: set[object],
    sizes: dict[str, int] | None = None,
    fused: bool = False,
    sharded: frozenset[torch.fx.Node] = frozenset(),
    shards: int = 1,
) -> int:
    """Simulate one graph: allocate each non-view output, free a storage after its last use.

    `live` maps storage keys to bytes at entry and is updated in place to the state at exit.
    Keys in `pinned` are never freed (held by the caller). `fused`: the graph runs under Inductor,
    where an op fused into its consumers allocates nothing (fused_away). A node in `sharded` (a
    parameter's gradient under a sharded step) keeps one of `shards` parts of its bytes: the
    rest leaves with the reduce-scatter. Returns the peak of live bytes.
    """
    nodes = list(graph.nodes)
    for node in nodes:
        if node not in key_of:
            root = storage_of(node)
            key_of[node] = key_of.get(root, root)
    end = next((i for i, n in enumerate(nodes) if n.op == "output"), len(nodes))
    held = {key_of[a] for a in nodes[end].all_input_nodes} if end < len(nodes) else set()  # returned: kept

    def allocates(node: torch.fx.Node) -> int | None:
        if node.op != "call_function" or is_view(node) or key_of[node] is not node:
            return None
        if on_host(node) or (fused and fused_away(node)):
            return 0  # a copy in host memory, or fused into its consumers: no device storage
        nbytes = tensor_bytes(node.meta.get("val"), sizes) + workspace_bytes(node, sizes)
        return -(-nbytes // shards) if node in sharded else nbytes

    return walk(nodes[:end], key=key_of.__getitem__, reads=lambda n: {key_of[a] for a in n.all_input_nodes} | {key_of[n]},
                allocates=allocates, live=live, pinned=pinned, held=held)


def fused_away(node: torch.fx.Node) -> bool:
    """Under Inductor: a fusible op (torch's partitioner's list: pointwise ops and reductions) whose
    every consumer, looking through views, is fusible too is computed inside its consumers' kernel
    and never stored (Note [Predicting a fused graph])."""
    if not fuses(node):
        return False
    stack = list(node.users)
    while stack:
        user = stack.pop()
        if user.op != "call_function":
            return False  # a graph output: stored
        if is_view(user):
            stack.extend(user.users)
        elif not fuses(user):
            return False
    return True


# Note [Predicting a fused graph]
# The walk allocates every op's output; Inductor does not store what it fuses. Without knowing its
# scheduler's choices, the memory pass takes torch's min-cut partitioner's own view (the one it
# partitions by): a fusible op feeding only fusible ops is not materialized; counting every
# output overshoots a fused graph's peak far. It stands where Inductor's own schedule cannot be
# asked (Note [Inductor's own schedule]).


@dataclasses.dataclass
class _BlockTally:
    """One unit's figures as the memory pass adds them up (BlockPlan's fields but its path)."""

    saved_bytes: int = 0
    recomputed_ops: int = 0
    recompute_flops: int = 0
    recomputed_bytes: int = 0
    offloaded_bytes: int = 0
    forward_flops: int = 0


def memory_pass(
    fw: torch.fx.GraphModule,
    bw: torch.fx.GraphModule,
    *,
    num_fwd_outputs: int,
    forward_names: set[str],
    block_paths: tuple[str, ...] = (),
    static_input_indices: list[int] | None = None,
    sizes: dict[str, int] | None = None,
    target: Target = EAGER,
    offloaded: tuple[str, ...] = (),
    by_block: bool = True,
    gradient_shards: int = 1,
) -> Prediction:
    """Walk the forward then the backward (Note [What the predicted peak counts]); return what
    they save, recompute and offload and the device peaks they reach.
    `offloaded`: the saved values offload_pass moved to host memory (their copies count no device
    bytes; Note [Offload] in passes/offload.py).

    `target`: the inner compiler the graphs run under (passes.targets): under Inductor, peaks from
    its schedule, or walked as it fuses (Note [Predicting a fused graph]).
    `by_block`: under Inductor, whether the backward may be scheduled block by block (Note [A
    schedule per block]); the forward always may.
    `block_paths` lists the units in forward order; the Plan reports each of them in that order.
    `static_input_indices` (parameters and buffers among the inputs) tells which gradients persist.
    `gradient_shards`: the step is sharded that many ways and each parameter's gradient keeps one
    part on the device, the rest leaving with the reduce-scatter (Note [A sharded step] in
    ckpt_fx/fit.py; the walk's estimate, not Inductor's schedule).
    Reads node.meta only; deterministic.
    """
    key_of: dict[torch.fx.Node, object] = {}
    inputs = {n for n in fw.graph.nodes if n.op == "placeholder"}
    symbols: dict[str, int] = {}
    for n in inputs:
        value = n.meta.get("val")
        for dim in value.shape if isinstance(value, torch.Tensor) else (value,) if isinstance(value, torch.SymInt) else ():
            symbols.update(symbols_of(dim))
    for n in inputs:
        key_of[n] = ("input", n.name)
    fw_live: dict[object, int] = {}
    fw_peak = _walk(fw.graph, live=fw_live, key_of=key_of, pinned=set(), sizes=sizes, fused=target.fuses)

    outputs = [a for a in fw.graph.output_node().args[0] if isinstance(a, torch.fx.Node)]
    user_outputs, saved_nodes = outputs[:num_fwd_outputs], outputs[num_fwd_outputs:]
    by_name = {n.name: n for n in fw.graph.nodes}

    copied = {CPU_OFFLOAD_PREFIX + name: by_name[name] for name in offloaded}  # the host copy -> its value
    saved: list[SavedTensor] = []
    for node in saved_nodes:
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        source = copied.get(node.name, node)
        region = region_of(source)
        saved.append(
            SavedTensor(
                name=source.name,
                module_path=source.meta.get(PATH_KEY, ""),
                block=region.block.name if region is not None and region.block is not None else None,
                op=op_name(source),
                shape=tuple(size_at(d, sizes) if sizes else size_hint(d) for d in value.shape),
                dtype=value.dtype,
                nbytes=tensor_bytes(value, sizes),
                is_input=isinstance(key_of[node], tuple),
                view_of=None if source is not node else (
                    key_of[node].name if isinstance(key_of[node], torch.fx.Node) and key_of[node] is not node else None),
                offloaded=source is not node,
                draws_nothing=saved_state_draws_nothing(source),
            )
        )
    forward_end = sum(fw_live.values())
    saved_keys = {key_of[n] for n in saved_nodes}
    saved_bytes = sum(fw_live.get(k, 0) for k in saved_keys)

    # Backward: saved values arrive as placeholders of the same names; user outputs stay alive.
    bw_key: dict[torch.fx.Node, object] = {}
    bw_live: dict[object, int] = {k: v for k, v in fw_live.items()}
    for node in bw.graph.nodes:
        if node.op != "placeholder":
            continue
        if node.name in by_name:
            bw_key[node] = key_of[by_name[node.name]]
        elif is_tangent(node) or not is_primal(node):
            bw_key[node] = node
            bw_live[node] = tensor_bytes(node.meta.get("val"), sizes)
        else:
            bw_key[node] = ("input", node.name)
    pinned = {key_of[n] for n in user_outputs}
    for key in list(bw_live):
        if key not in pinned and key not in bw_key.values():
            bw_live.pop(key)  # forward values nobody holds any more
    bw_entry = dict(bw_live)
    bw_out = bw.graph.output_node()
    keep = set(static_input_indices) if static_input_indices is not None else None
    param_grads = [a for i, a in enumerate(bw_out.args[0]) if isinstance(a, torch.fx.Node) and (keep is None or i in keep)]
    sharded = frozenset(storage_of(a) for a in param_grads) if gradient_shards > 1 else frozenset()
    bw_peak = _walk(bw.graph, live=bw_live, key_of=bw_key, pinned=pinned, sizes=sizes, fused=target.fuses, sharded=sharded,
                    shards=gradient_shards)
    peak_model = PeakModel.WALK
    # At the sizes the graphs were traced with Inductor can be asked; not of host copies, which
    # its storages would count as the device's.
    if target.fuses and not sizes and not offloaded and gradient_shards == 1:
        scheduled = scheduled_peaks(fw, bw, entry=bw_entry, key_of=bw_key, pinned=pinned, by_block=by_block)
        if scheduled is not None:
            fw_peak, bw_peak, copies = scheduled
            forward_end += copies  # saved inputs Inductor saves as copies (Note [Saved inputs in another layout])
            peak_model = PeakModel.INDUCTOR
    # Gradients of parameters (static inputs) outlive the step; gradients of activations that
    # came from an earlier graph become that graph's incoming gradients and are counted there.
    grads = {bw_key[a]: bw_live.get(bw_key[a], 0) for a in param_grads}

    recomputed = [n for n in bw.graph.nodes if n.op == "call_function" and n.name in forward_names]
    per_block: dict[str, _BlockTally] = {path: _BlockTally() for path in block_paths}
    for s in saved:
        if s.block is not None and not s.is_input:
            tally = per_block.setdefault(s.block, _BlockTally())
            if s.offloaded:
                tally.offloaded_bytes += s.nbytes
            else:
                tally.saved_bytes += s.nbytes
    for node in fw.graph.nodes:
        region = region_of(node)
        if node.op == "call_function" and region is not None and region.block is not None:
            per_block.setdefault(region.block.name, _BlockTally()).forward_flops += _flops(node)
    flops = 0
    for node in recomputed:
        f = _flops(node)
        flops += f
        region = region_of(node)
        if region is not None and region.block is not None:
            tally = per_block.setdefault(region.block.name, _BlockTally())
            tally.recomputed_ops += 1
            tally.recompute_flops += f
            tally.recomputed_bytes += 0 if is_view(node) else tensor_bytes(node.meta.get("val"), sizes)
    checkpointed = {p for p, t in per_block.items() if t.recomputed_ops}
    recomputed_set = set(recomputed)
    step_flops = sum(_flops(n) for g in (fw.graph, bw.graph) for n in g.nodes
                     if n.op == "call_function" and n not in recomputed_set)
    return Prediction(
        held_outputs=_held_outputs(user_outputs, checkpointed, sizes),
        saved=tuple(saved),
        recomputed=tuple(n.name for n in recomputed),
        blocks=tuple(
            BlockPlan(path=p, **dataclasses.asdict(t)) for p, t in per_block.items()
        ),
        saved_bytes=saved_bytes,
        recompute_flops=flops,
        forward_peak_bytes=fw_peak,
        backward_peak_bytes=bw_peak,
        peak_model=peak_model,
        forward_end_bytes=forward_end,
        gradient_bytes=sum(grads.values()),
        step_flops=step_flops,
        offloaded=tuple(offloaded),
        offloaded_bytes=sum(s.nbytes for s in saved if s.offloaded),
        symbols=symbols,
        # At the traced sizes: a way to predict at others (a prediction at other sizes needs none).
        at=functools.partial(_predict_at, snapshot(fw), snapshot(bw), num_fwd_outputs=num_fwd_outputs,
                             forward_names=forward_names, block_paths=block_paths, offloaded=offloaded,
                             static_input_indices=static_input_indices, target=target) if symbols and not sizes else None,
    )


def _flops(node: torch.fx.Node) -> int:
    """A node's FLOPs at the traced sizes: the costs pass's figure, carried from the joint graph."""
    return node.meta[FLOPS_KEY] if FLOPS_KEY in node.meta else node_flops(node)


def _predict_at(fw, bw, sizes: dict[str, int], **kwargs) -> Prediction:
    """memory_pass at other symbolic sizes (Prediction.at, Plan.at)."""
    return memory_pass(fw, bw, sizes=sizes, **kwargs)


def _held_outputs(outputs: list[torch.fx.Node], checkpointed: set[str], sizes: dict[str, int] | None) -> tuple[tuple[str, int], ...]:
    """Returned values computed inside a checkpointed unit and read inside it too (a block's keys
    and values returned as a KV cache), not the unit's own result: one entry per storage."""
    held: dict[torch.fx.Node, tuple[str, int]] = {}
    for node in outputs:
        base = storage_of(node)
        region = region_of(base)
        if region is None or region.block is None or region.block.name not in checkpointed or base in held:
            continue
        inside = [u for u in base.users if u.op != "output" and block_of(u) == region.block]
        if inside and any(not is_view(u) or u not in outputs for u in inside):
            held[base] = (base.meta.get(PATH_KEY, region.block.path), tensor_bytes(base.meta.get("val"), sizes))
    return tuple(held.values())


def op_name(node: torch.fx.Node) -> str:
    """The op that made a value, as people read it: "convolution", "native_layer_norm[0]" for an
    element of a tuple, "detach(relu)" for an alias, "gt(inductor_random)" for a dropout mask drawn
    by Inductor; a placeholder is "placeholder"."""
    if node.op != "call_function":
        return node.op
    target = node.target
    first = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if target is operator.getitem and first is not None:
        return f"{op_name(first)}[{node.args[1]}]"
    name = op_short_name(target) if isinstance(target, OpOverload) else getattr(target, "__name__", str(target))
    if first is not None and (name in ("detach", "alias") or (name in ("gt", "lt", "ge", "le") and op_name(first) == "inductor_random")):
        return f"{name}({op_name(first)})"  # an alias, or a mask drawn from Inductor's random numbers
    return name


# Note [Peak from the joint graph]
# Planning a candidate in full (partition, schedule, memory) builds two graphs: ~3 s for a 32-block
# model. To compare candidates, JointLiveness walks the joint graph once per candidate instead, as
# the pipeline would run it: the forward keeps what the backward reads and does not recompute; the
# backward runs its nodes in joint order, each preceded by the recomputed nodes it needs not yet
# made (Note [Just-in-time recompute]); every storage is freed after its last use (Note [What the
# predicted peak counts]). It predicts the same peak as memory_pass on the partitioned graphs
# (tested); only the chosen candidate is then partitioned.


class JointLiveness:
    """Predicts the step peak of a joint graph for a set of recomputed forward nodes
    (Note [Peak from the joint graph]). Built once per graph; each estimate is a linear walk."""

    def __init__(
        self, joint: torch.fx.GraphModule, *, num_fwd_outputs: int, static_input_indices: list[int] | None = None
    ):
        from passes.graphs import forward_nodes

        nodes = list(joint.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        forward = {index[n] for n in forward_nodes(joint.graph)}
        self.names = {n.name: i for i, n in enumerate(nodes)}
        self.forward = forward
        self.inputs = [[index[a] for a in n.all_input_nodes] for n in nodes]
        self.key = list(range(len(nodes)))
        self.nbytes = [0] * len(nodes)
        self.entry = {}  # backward-entry bytes: incoming gradients and other non-primal inputs
        for i, n in enumerate(nodes):
            if storage_of(n) is not n:
                self.key[i] = index[storage_of(n)]
            elif n.op == "call_function":
                self.nbytes[i] = tensor_bytes(n.meta.get("val")) + workspace_bytes(n)
            elif n.op == "placeholder" and (is_tangent(n) or not is_primal(n)):
                self.entry[i] = tensor_bytes(n.meta.get("val"))
        self.touched = [tuple({self.key[a] for a in self.inputs[i]} | {self.key[i]}) for i in range(len(nodes))]
        self.getitems = [[index[u] for u in n.users if u.target is operator.getitem] for n in nodes]
        self.is_input = [n.op == "placeholder" for n in nodes]
        self.call = [n.op == "call_function" for n in nodes]
        args = list(joint.graph.output_node().args[0])
        self.fw_outputs = [index[a] for a in args[:num_fwd_outputs] if isinstance(a, torch.fx.Node)]
        keep = set(static_input_indices) if static_input_indices is not None else None
        grads = [(k, a) for k, a in enumerate(args[num_fwd_outputs:]) if isinstance(a, torch.fx.Node)]
        self.grads = [index[a] for _, a in grads]
        self.kept_grads = [index[a] for k, a in grads if keep is None or k in keep]
        # The backward's nodes (dead ones dropped), in joint order.
        live: set[int] = set()
        stack = [g for g in self.grads if g not in forward]
        while stack:
            i = stack.pop()
            if i in live or i in forward:
                continue
            live.add(i)
            stack.extend(self.inputs[i])
        self.backward = sorted(i for i in live if self.call[i])
        self.live = live
        # The backward runs from the first node that reads an incoming gradient; a node before it
        # (one that reads only forward values) runs when a later node first needs it, as torch's
        # reordering_to_mimic_autograd_engine orders it (an in-place copy_ excepted).
        tangents = [index[u] for n in nodes if is_tangent(n) for u in n.users]
        first = min((i for i in tangents if i in live), default=0)
        self.roots = [
            i for i in self.backward if i >= first or nodes[i].target is torch.ops.aten.copy_.default
        ]

    def estimate(self, recomputed: set[str] | frozenset[str], offloaded: set[str] | frozenset[str] = frozenset()) -> Estimate:
        """Device peak and parameter-gradient bytes when the forward nodes named in `recomputed` are
        recomputed wherever the backward needs them and every other forward value it needs is
        saved; the saved ones named in `offloaded` leave the device after their last forward use
        and come back just before their first backward use (Note [Offload] in passes/offload.py,
        its copies waited for at once)."""
        rec = {self.names[n] for n in recomputed if n in self.names}
        forward, inputs = self.forward, self.inputs
        # What the backward reads from the forward: saved, or recomputed (with what that needs).
        saved: set[int] = set()
        remade: set[int] = set()
        stack = [a for b in self.backward for a in inputs[b] if a in forward]
        while stack:
            a = stack.pop()
            if a in saved or a in remade:
                continue
            if a in rec and self.call[a]:
                remade.add(a)
                stack.extend(x for x in inputs[a] if x in forward)
            else:
                saved.add(a)
        # Forward: what the outputs and the saved values need, in joint order.
        needed: set[int] = set()
        stack = [*self.fw_outputs, *saved]
        while stack:
            i = stack.pop()
            if i in needed or not (i in forward or self.is_input[i]):
                continue
            needed.add(i)
            stack.extend(inputs[i])
        fw_order = sorted(needed)
        off = {i for i in (self.names[n] for n in offloaded if n in self.names) if i in saved and self.key[i] == i}
        held = {self.key[i] for i in (*self.fw_outputs, *(saved - off))}
        fw_live: dict[int, int] = {}
        fw_peak = self._walk(fw_order, fw_live, held=held, pinned=held)
        # Backward: saved values and outputs still held, incoming gradients; each node preceded by
        # the recomputed nodes it needs not yet made.
        outputs = {self.key[i] for i in self.fw_outputs}
        saved_keys = {self.key[i] for i in saved - off}
        bw_live = {k: v for k, v in fw_live.items() if k in outputs or k in saved_keys}
        bw_live.update(self.entry)
        order = just_in_time(  # an offloaded value is copied back (made from nothing) when first needed
            self.roots, inputs=lambda i: () if i in off else inputs[i], rank=int,
            ready=lambda i: i in forward and i not in remade and i not in off,
            followers=lambda i: [g for g in self.getitems[i] if g in remade or (g not in forward and g in self.live)],
        )
        bw_peak = self._walk(order, bw_live, held=set(), pinned=outputs, final=self.grads)
        grads = {self.key[g]: bw_live.get(self.key[g], 0) for g in self.kept_grads}
        return Estimate(peak_bytes=max(fw_peak, bw_peak), gradient_bytes=sum(grads.values()))

    def _walk(self, order: list[int], live: dict[int, int], *, held: set[int], pinned: set[int],
              final: list[int] = ()) -> int:
        """liveness.walk over joint-graph indices: keys in `held` are read by the graph's output,
        keys in `pinned` are never freed, `final` (gradients) outlive the walk."""
        key, call, nbytes = self.key, self.call, self.nbytes
        return walk(order, key=key.__getitem__, reads=self.touched.__getitem__,
                    allocates=lambda i: nbytes[i] if call[i] and key[i] == i else None, live=live, pinned=pinned,
                    held={*held, *(key[g] for g in final)})
