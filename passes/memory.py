"""memory: walk the partitioned forward then backward (passes.liveness); predict saved bytes and
peak; make the Plan (passes.plan)."""

from __future__ import annotations

import copy
import functools
import logging
import operator
import types
from dataclasses import dataclass

import torch

from passes._compat import (
    OpOverload,
    inductor_schedule,
    is_fusible,
    is_primal,
    is_tangent,
    size_at,
    size_hint,
    symbols_of,
)
from passes.costs import is_view, node_flops, tensor_bytes
from passes.liveness import just_in_time, walk
from passes.plan import BlockPlan, Plan, SavedTensor
from passes.regions import PATH_KEY, REGION_KEY

log = logging.getLogger("ckpt_fx")

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


def _walk(
    graph: torch.fx.Graph,
    *,
    live: dict[object, int],
    key_of: dict[torch.fx.Node, object],
    pinned: set[object],
    sizes: dict[str, int] | None = None,
    fused: bool = False,
) -> int:
    """Simulate one graph: allocate each non-view output, free a storage after its last use.

    `live` maps storage keys to bytes at entry and is updated in place to the state at exit.
    Keys in `pinned` are never freed (held by the caller). `fused`: the graph runs under Inductor,
    where an op fused into its consumers allocates nothing (fused_away). Returns the peak of live bytes.
    """
    nodes = list(graph.nodes)
    for node in nodes:
        if node not in key_of:
            base = node.args[0] if is_view(node) and node.args and isinstance(node.args[0], torch.fx.Node) else None
            key_of[node] = key_of.get(base, base) if base is not None else node
    end = next((i for i, n in enumerate(nodes) if n.op == "output"), len(nodes))
    held = {key_of[a] for a in nodes[end].all_input_nodes} if end < len(nodes) else set()  # returned: kept

    def allocates(node: torch.fx.Node) -> int | None:
        if node.op != "call_function" or is_view(node) or key_of[node] is not node:
            return None
        return 0 if fused and fused_away(node) else tensor_bytes(node.meta.get("val"), sizes)

    return walk(nodes[:end], key=key_of.__getitem__, reads=lambda n: {key_of[a] for a in n.all_input_nodes} | {key_of[n]},
                allocates=allocates, live=live, pinned=pinned, held=held)


def fused_away(node: torch.fx.Node) -> bool:
    """Under Inductor: a fusible op (torch's partitioner's list: pointwise ops and reductions) whose
    every consumer, looking through views, is fusible too is computed inside its consumers' kernel
    and never stored (Note [Predicting a fused graph])."""
    if not is_fusible(node):
        return False
    stack = list(node.users)
    while stack:
        user = stack.pop()
        if user.op != "call_function":
            return False  # a graph output: stored
        if is_view(user):
            stack.extend(user.users)
        elif not is_fusible(user):
            return False
    return True


# Note [Predicting a fused graph]
# The walk allocates every op's output; Inductor does not store what it fuses. Without knowing its
# scheduler's choices, the memory pass takes torch's min-cut partitioner's own view (the one it
# partitions by): a fusible op feeding only fusible ops is not materialized. Measured on GPT-2
# 12x256 (CPU): the prediction under Inductor is then within 15% of the measured peak for every
# policy (tests/test_inductor.py), where counting every output overshot by 30% or more.


# Note [Inductor's own schedule]
# fused_away is min-cut's view of fusion, not Inductor's: Inductor's lowering inlines some
# pointwise ops into each consumer and stores others (CPU: a reused exp or tanh), its scheduler
# fuses by its own rules, moves kernels (a fused recompute runs where its earliest member stood)
# and reuses buffers in place. Where a plan recomputes much, the walk's guess fell far short:
# GPT-2 4x256, batch 8x256, CPU: torch's knob at 0.3 measured 197.9 MB, the walk predicted 119.8;
# every block checkpointed 97.7 MB, predicted 68.6. So under Inductor the memory pass asks
# Inductor itself (_compat.inductor_schedule: its lowering and scheduler, no code generated) for
# each graph's storages and the steps that allocate them and that they live through, by the code
# generator's rules: a kernel writing in place into a buffer it last reads; a freed buffer handed
# to a later one of the same size while Inductor's own estimate of the peak allows it (so a
# freed buffer can stay allocated long after its last read); on a CPU, a run of generated kernels
# allocating together and freeing after the run. This pass's accounting goes on top (inputs count
# zero, saved values and incoming gradients live from the backward's start until Inductor is done
# with their storage, outputs held). Measured on the same model: 0.99x to 1.07x of the measured
# peak for every plan above (the caller dropping the logits early is most of the rest); with
# min-cut's CSE on (which shares recomputed values, so frees come later and reuse differs), the
# builtin GPT's blocks plan measured 36.2 MB, predicted 35.0. It costs Inductor's lowering and
# scheduling once more per plan (about 10 s for GPT-2 12x256 on a 2-core CPU), so the budget
# asks it for few candidates (Note [Peak-aware budget]). Where Inductor cannot be asked (another
# torch, an op it cannot lower here) the walk's fused guess stands, and Plan.peak_model says so.


def _scheduled_peaks(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, *, entry: dict[object, int],
                     key_of: dict[torch.fx.Node, object], pinned: set[object]) -> tuple[int, int] | None:
    """(forward peak, backward peak) from Inductor's schedules of the two graphs (Note
    [Inductor's own schedule]), or None when Inductor could not be asked. `entry` is what is live
    as the backward starts (saved values, incoming gradients, held outputs), by storage key;
    `key_of` maps the backward's placeholders to those keys; `pinned` keys are never freed."""
    # Saved values no output shares a storage with: AOTAutograd lets Inductor reuse them.
    out_keys = {key_of.get(a) for a in next(n for n in reversed(bw.graph.nodes) if n.op == "output").all_input_nodes}
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    donated = tuple(i for i, n in enumerate(placeholders)
                    if isinstance(key_of.get(n), torch.fx.Node) and key_of[n] is not n  # from the forward
                    and key_of[n] in entry and key_of[n] not in pinned and key_of[n] not in out_keys)
    try:
        forward = inductor_schedule(copy_graph_module(fw), is_backward=False)
        backward = inductor_schedule(copy_graph_module(bw), is_backward=True, donated=donated)
    except Exception as error:  # noqa: BLE001 - any failure: the walk's own prediction stands
        log.info("ckpt_fx: Inductor's schedule unavailable (%s: %s); the memory pass predicts fusion itself",
                 type(error).__name__, error)
        return None
    # Entry storage -> the last step it lives through (None: to the end; -1: not read at all).
    freed: dict[object, int | None] = {key: None for key in entry if key in pinned}
    for node in bw.graph.nodes:
        key = key_of.get(node)
        if node.op != "placeholder" or key not in entry or key in pinned:
            continue
        end = backward[2].get(node.name, -1)
        last = freed.get(key, -1)
        freed[key] = None if end is None or last is None else max(last, end)
    return _schedule_peak(forward, entry={}, freed={}), _schedule_peak(backward, entry=entry, freed=freed)


def _schedule_peak(schedule: tuple[int, list[tuple[int, int | None, int]], dict[str, int | None]], *,
                   entry: dict[object, int], freed: dict[object, int | None]) -> int:
    """The peak of live bytes over a schedule (Note [Inductor's own schedule]): each storage from
    the step that allocates it through the last it lives through (None: to the end), on top of
    `entry` (bytes live at the start by storage key, each freed after the step `freed` names: None
    never, -1 at once, as is one not named)."""
    steps, storages, _ = schedule
    delta = [0] * (steps + 2)
    for first, last, nbytes in storages:
        delta[first] += nbytes
        if last is not None:
            delta[last + 1] -= nbytes
    for key, nbytes in entry.items():
        last = freed.get(key, -1)
        if last is not None:
            delta[last + 1] -= nbytes
    live = peak = sum(entry.values())
    for change in delta:
        live += change
        peak = max(peak, live)
    return peak


def memory_pass(
    fw: torch.fx.GraphModule,
    bw: torch.fx.GraphModule,
    *,
    num_fwd_outputs: int,
    policy: str,
    forward_names: set[str],
    hard_rules: dict[str, str] | None = None,
    top_level_units: bool = False,
    block_paths: tuple[str, ...] = (),
    static_input_indices: list[int] | None = None,
    sizes: dict[str, int] | None = None,
    fused: bool = False,
) -> Plan:
    """Walk the forward then the backward (Note [What the predicted peak counts]); return the Plan.

    `fused`: the graphs run under Inductor (Note [Predicting a fused graph]).
    `block_paths` lists the units in forward order; the Plan reports each of them in that order.
    `static_input_indices` (parameters and buffers among the inputs) tells which gradients persist.
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
    fw_peak = _walk(fw.graph, live=fw_live, key_of=key_of, pinned=set(), sizes=sizes, fused=fused)

    out_node = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outputs = [a for a in out_node.args[0] if isinstance(a, torch.fx.Node)]
    user_outputs, saved_nodes = outputs[:num_fwd_outputs], outputs[num_fwd_outputs:]
    by_name = {n.name: n for n in fw.graph.nodes}

    saved: list[SavedTensor] = []
    for node in saved_nodes:
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        region = node.meta.get(REGION_KEY)
        saved.append(
            SavedTensor(
                name=node.name,
                module_path=node.meta.get(PATH_KEY, ""),
                block=region.block.name if region is not None and region.block is not None else None,
                op=op_name(node),
                shape=tuple(size_at(d, sizes) if sizes else size_hint(d) for d in value.shape),
                dtype=value.dtype,
                nbytes=tensor_bytes(value, sizes),
                is_input=isinstance(key_of[node], tuple),
                view_of=key_of[node].name if isinstance(key_of[node], torch.fx.Node) and key_of[node] is not node else None,
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
    bw_peak = _walk(bw.graph, live=bw_live, key_of=bw_key, pinned=pinned, sizes=sizes, fused=fused)
    peak_model = "walk"
    if fused and not sizes:  # at the sizes the graphs were traced with: Inductor can be asked
        scheduled = _scheduled_peaks(fw, bw, entry=bw_entry, key_of=bw_key, pinned=pinned)
        if scheduled is not None:
            fw_peak, bw_peak = scheduled
            peak_model = "inductor"
    bw_out = next(n for n in reversed(bw.graph.nodes) if n.op == "output")
    # Gradients of parameters (static inputs) outlive the step; gradients of activations that
    # came from an earlier graph become that graph's incoming gradients and are counted there.
    keep = set(static_input_indices) if static_input_indices is not None else None
    grads = {
        bw_key[a]: bw_live.get(bw_key[a], 0)
        for i, a in enumerate(bw_out.args[0])
        if isinstance(a, torch.fx.Node) and (keep is None or i in keep)
    }

    recomputed = [n for n in bw.graph.nodes if n.op == "call_function" and n.name in forward_names]
    per_block: dict[str, list[int]] = {path: [0, 0, 0, 0] for path in block_paths}
    for s in saved:
        if s.block is not None and not s.is_input:
            per_block.setdefault(s.block, [0, 0, 0, 0])[0] += s.nbytes
    flops = 0
    for node in recomputed:
        f = node_flops(node)
        flops += f
        region = node.meta.get(REGION_KEY)
        if region is not None and region.block is not None:
            entry = per_block.setdefault(region.block.name, [0, 0, 0, 0])
            entry[1] += 1
            entry[2] += f
            entry[3] += 0 if is_view(node) else tensor_bytes(node.meta.get("val"), sizes)
    checkpointed = {p for p, v in per_block.items() if v[1]}
    recomputed_set = set(recomputed)
    step_flops = sum(node_flops(n) for g in (fw.graph, bw.graph) for n in g.nodes
                     if n.op == "call_function" and n not in recomputed_set)
    return Plan(
        held_outputs=_held_outputs(user_outputs, checkpointed, sizes),
        policy=policy,
        saved=tuple(saved),
        recomputed=tuple(n.name for n in recomputed),
        blocks=tuple(
            BlockPlan(path=p, saved_bytes=v[0], recomputed_ops=v[1], recompute_flops=v[2], recomputed_bytes=v[3])
            for p, v in per_block.items()
        ),
        saved_bytes=saved_bytes,
        recompute_flops=flops,
        forward_peak_bytes=fw_peak,
        backward_peak_bytes=bw_peak,
        peak_model=peak_model,
        forward_end_bytes=forward_end,
        gradient_bytes=sum(grads.values()),
        step_flops=step_flops,
        hard_rules=dict(hard_rules or {}),
        top_level_units=top_level_units,
        symbols=symbols,
        _at=functools.partial(
            memory_pass, _snapshot(fw), _snapshot(bw), num_fwd_outputs=num_fwd_outputs, policy=policy, forward_names=forward_names,
            hard_rules=hard_rules, top_level_units=top_level_units, block_paths=block_paths,
            static_input_indices=static_input_indices, fused=fused,
        ) if symbols else None,
    )



def _held_outputs(outputs: list[torch.fx.Node], checkpointed: set[str], sizes: dict[str, int] | None) -> tuple[tuple[str, int], ...]:
    """Returned values computed inside a checkpointed unit and read inside it too (a block's keys
    and values returned as a KV cache), not the unit's own result: one entry per storage."""
    held: dict[torch.fx.Node, tuple[str, int]] = {}
    for node in outputs:
        base = node
        while is_view(base) and base.args and isinstance(base.args[0], torch.fx.Node):
            base = base.args[0]
        region = base.meta.get(REGION_KEY)
        if region is None or region.block is None or region.block.name not in checkpointed or base in held:
            continue
        inside = [u for u in base.users if u.op != "output" and getattr(u.meta.get(REGION_KEY), "block", None) == region.block]
        if inside and any(not is_view(u) or u not in outputs for u in inside):
            held[base] = (base.meta.get(PATH_KEY, region.block.path), tensor_bytes(base.meta.get("val"), sizes))
    return tuple(held.values())


def _snapshot(gm: torch.fx.GraphModule) -> types.SimpleNamespace:
    """A copy of a graph's nodes (names and meta kept) that later passes of torch cannot change,
    for Plan.at to walk again."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return types.SimpleNamespace(graph=graph)


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a graph module's graph (node names kept, each node's meta copied one level deep),
    to plan again after passes have changed the original."""
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    old_output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    graph.output(output).meta = copy.copy(old_output.meta)
    return torch.fx.GraphModule(gm, graph)


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
    name = target._opname if isinstance(target, OpOverload) else getattr(target, "__name__", str(target))
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


@dataclass(frozen=True)
class Estimate:
    """A candidate's predicted step peak, made from the joint graph."""

    peak_bytes: int
    gradient_bytes: int


class JointLiveness:
    """Predicts the step peak of a joint graph for a set of recomputed forward nodes
    (Note [Peak from the joint graph]). Built once per graph; each estimate is a linear walk."""

    def __init__(
        self, joint: torch.fx.GraphModule, *, num_fwd_outputs: int, static_input_indices: list[int] | None = None
    ):
        from passes.regions import forward_nodes

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
            if is_view(n) and n.args and isinstance(n.args[0], torch.fx.Node):
                self.key[i] = self.key[index[n.args[0]]]
            elif n.op == "call_function":
                self.nbytes[i] = tensor_bytes(n.meta.get("val"))
            elif n.op == "placeholder" and (is_tangent(n) or not is_primal(n)):
                self.entry[i] = tensor_bytes(n.meta.get("val"))
        self.touched = [tuple({self.key[a] for a in self.inputs[i]} | {self.key[i]}) for i in range(len(nodes))]
        self.getitems = [[index[u] for u in n.users if u.target is operator.getitem] for n in nodes]
        self.is_input = [n.op == "placeholder" for n in nodes]
        self.call = [n.op == "call_function" for n in nodes]
        out = nodes[-1] if nodes and nodes[-1].op == "output" else next(n for n in reversed(nodes) if n.op == "output")
        args = list(out.args[0])
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

    def estimate(self, recomputed: set[str] | frozenset[str]) -> Estimate:
        """Peak and parameter-gradient bytes when the forward nodes named in `recomputed` are
        recomputed wherever the backward needs them and every other forward value it needs is saved."""
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
        held = {self.key[i] for i in (*self.fw_outputs, *saved)}
        fw_live: dict[int, int] = {}
        fw_peak = self._walk(fw_order, fw_live, held=held, pinned=held)
        # Backward: saved values and outputs still held, incoming gradients; each node preceded by
        # the recomputed nodes it needs not yet made.
        outputs = {self.key[i] for i in self.fw_outputs}
        saved_keys = {self.key[i] for i in saved}
        bw_live = {k: v for k, v in fw_live.items() if k in outputs or k in saved_keys}
        bw_live.update(self.entry)
        order = just_in_time(
            self.roots, inputs=inputs.__getitem__, rank=int, ready=lambda i: i in forward and i not in remade,
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
