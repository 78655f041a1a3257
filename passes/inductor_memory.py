"""inductor_memory: how Inductor will hold a partitioned graph's memory, from its own lowering and
scheduler and its code generator's buffer rules (Note [Inductor's own schedule]). The part of the
project that reads Inductor's internals most deeply: the one file to check on a torch upgrade
(tests/test_inductor_memory.py checks its predictions against measured peaks)."""

from __future__ import annotations

import contextlib
import logging

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from passes._compat import backward_lowering_config, blocks_kept_apart
from passes.costs import tensor_bytes
from passes.head import workspace_bytes
from passes.graphs import copy_graph_module
from passes.regions import block_of, recomputed_block, recomputed_whole

log = logging.getLogger("ckpt_fx")

# Note [Inductor's own schedule]
# The memory pass's walk allocates every op's output, less the ops min-cut's view calls fused away
# (memory.fused_away). Inductor does not work that way: its lowering inlines some pointwise ops
# into each consumer and stores others (CPU: a reused exp or tanh), its scheduler fuses by its
# own rules, moves kernels (a fused recompute runs where its earliest member stood) and reuses
# buffers in place. Where a plan recomputes much, the walk's guess falls far short of the measured
# peak (the README's Known limits gives figures). So under Inductor the memory pass asks Inductor
# itself (inductor_schedule: its lowering and scheduler, no code generated) for each graph's
# storages and the steps that allocate them and that they live through, by the code generator's
# rules: a kernel writing in place into a buffer it last reads; a freed buffer handed to a later
# one of the same size while Inductor's own estimate of the peak allows it (so a freed buffer can
# stay allocated long after its last read); on a CPU, a run of generated kernels allocating
# together and freeing after the run; a buffer written and last read inside one fused kernel
# dropped (Kernel.remove_kernel_local_buffers); each element of the tuple an extern kernel returns
# (a custom op, SDPA) a storage allocated by that kernel and alive until its own last read, not
# the tuple's unpacking (an MoE's experts as transformers' custom op were under-predicted by 21%);
# a buffer computed straight into a slice of a later one (a cat whose inputs other ops read too:
# NonOwningLayout) no storage of its own, the later one allocated when the first slice is written
# (counting the slices apart put an MoE's gate and up halves twice: +12%).
# The memory pass's accounting goes on top (inputs count zero, saved values and incoming
# gradients live from the backward's start until Inductor is done with their storage, outputs
# held). It costs Inductor's lowering and scheduling once more per plan, of each distinct block
# once (Note [A schedule per block]), and the budget asks it for few candidates (Note
# [Peak-aware budget] in passes/budget.py).
# Where Inductor cannot be asked (another torch, an op it cannot lower here) the walk's fused
# guess stands, and Plan.peak_model says so.


@dataclass(slots=True)
class Storage:
    """One storage a graph allocates under Inductor's schedule. `last` grows while the schedule is
    read (a later buffer written into it, or handed it once freed, lengthens its life)."""

    first: int
    """The step that allocates it."""
    last: int | None
    """The last step it lives through; None when the graph returns it."""
    nbytes: int
    kind: str | None = None
    """Its reuse key: a later buffer of this key may be handed it once freed (None: none may)."""


class Schedule(NamedTuple):
    """How Inductor runs a graph and holds its memory (inductor_schedule's answer)."""

    steps: int
    storages: list[Storage]
    """Each storage the graph allocates."""
    input_end: dict[str, int | None]
    """Per graph input read (by name): the last step it lives through."""
    returned: list[int | str | None]
    """Per graph output: the storage it returns (an index into storages, an input's name, or None)."""
    strides: list[tuple[int, ...] | None]
    """Per graph output: its stride as Inductor lays it out (None: unknown)."""


def inductor_schedule(gm: torch.fx.GraphModule, *, is_backward: bool, donated: tuple[int, ...] = ()) -> Schedule:
    """How Inductor will run a partitioned graph and hold its memory, from its own lowering and
    scheduler (what it fuses, the order it picks) and its code generator's rules for buffers (what
    it writes in place, which freed buffer it hands to a later one); nothing is compiled.

    Returns a Schedule: each storage the graph allocates (the step that allocates it, the last step
    it lives through or None when the graph returns it, bytes, reuse key): a buffer written into
    another's storage, or given a freed one, lengthens that one's life instead of
    allocating; for each graph input read, the last step it lives through (a donated input whose
    storage a buffer takes over lives as long as that buffer; None when the graph returns it); and
    for each of the graph's outputs, the storage it returns (an index, an input's name, or None)
    and its stride as Inductor lays it out (None: unknown). Under layout optimization an output
    may come back channels-last, and an output that is an input in a storage of its own, the copy
    Inductor converted for a convolution. Raises where
    this torch's Inductor cannot be asked; the caller falls back (Note [Inductor's own schedule]).
    `donated`: the backward's placeholders (by position) holding saved values it may reuse, as
    AOTAutograd computes them once the partition is made (functorch's donated_buffer). `gm` is
    lowered as it is: pass a copy."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._guards import detect_fake_mode
    from torch._inductor import memory as inductor_memory
    from torch._inductor.codegen.wrapper import buffer_reuse_key, can_match_buffer_size
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.ir import MultiOutput, MultiOutputLayout, NonOwningLayout
    from torch._inductor.scheduler import BaseSchedulerNode, Scheduler, SchedulerNode
    from torch._inductor.virtualized import V
    from torch.utils._ordered_set import OrderedSet
    from torch.utils._python_dispatch import _disable_current_modes

    inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake = detect_fake_mode(inputs)
    if fake is None:
        raise RuntimeError("the graph's inputs carry no fake tensors to lower it with")
    # Lower and schedule only: no autotuning benchmarks, no debug folders.
    quiet = {"trace.enabled": False, "max_autotune": False, "max_autotune_gemm": False, "benchmark_fusion": False,
             **(backward_lowering_config() if is_backward else {})}  # as the backend compiles it
    with _disable_current_modes(), inductor_config.patch(quiet), V.set_fake_mode(fake), DebugContext():
        graph = GraphLowering(gm, example_inputs=inputs, shape_env=fake.shape_env, is_backward=is_backward)
        if is_backward:  # read from the tracing context, which holds another graph's at partition time
            graph.bw_donated_idxs = list(donated) if functorch_config.donated_buffer else []
        apart = blocks_kept_apart(recomputed_block, gm, recomputed_whole) if is_backward else contextlib.nullcontext()
        with V.set_graph_handler(graph), apart:  # Note [A backward's blocks kept apart]
            graph.run(*inputs)
            scheduler = Scheduler(graph.operations)
            nodes = scheduler.nodes
            graph_inputs = OrderedSet(graph.graph_inputs.keys())
            graph_outputs = OrderedSet(graph.get_output_names())
            # Sizes of the final (fused, ordered) nodes' buffers, as Inductor's own peak-memory
            # pass computes them (it may be switched off), and its estimate of each step's memory,
            # which the code generator lets no reused buffer exceed.
            _, freeable = inductor_memory.prepare_planning_info(
                nodes, scheduler.name_to_buf, scheduler.name_to_fused_node, graph_inputs, graph_outputs)
            overall, by_step = inductor_memory.estimate_peak_memory(nodes, freeable, graph_outputs)
            by_step = list(by_step)
            in_place = _in_place(nodes, scheduler, graph, graph_outputs, BaseSchedulerNode, SchedulerNode,
                                 can_match_buffer_size)

            book = _Book(scheduler, graph, graph_outputs, by_step=by_step, peak=overall,
                         reuse=inductor_config.allow_buffer_reuse, reuse_key=buffer_reuse_key)
            packed: dict[str, int] = {}  # an extern kernel's tuple of outputs -> the step that made it
            dropped: set[str] = set()  # buffers local to one fused kernel
            owner = book.owner
            for step, node in enumerate(nodes):
                extern = node.is_extern()
                device = node.get_device()
                on_cpu = device is not None and device.type == "cpu"
                if extern and step > 0:
                    book.release(step - 1)
                if on_cpu and not extern and book.group is None:
                    book.group = step
                members = OrderedSet(sub.get_name() for sub in node.get_nodes())
                generated = not extern and all(isinstance(sub, SchedulerNode) for sub in node.get_nodes())
                for buf in node.get_outputs():
                    name = buf.get_name()
                    if name in in_place and in_place[name] not in dropped:
                        owner[name] = owner.get(in_place[name], in_place[name])
                        book.taken.add(in_place[name])
                        continue
                    if generated and name not in graph_outputs and scheduler.can_buffer_be_removed_through_fusion(name, members):
                        dropped.add(name)  # written and last read inside one fused kernel: the code generator drops it
                        continue
                    if isinstance(buf.node.layout, MultiOutputLayout):
                        packed[name] = step  # an extern kernel's tuple: each element a storage of its own
                        # A chunked loss head's temporaries, while it runs (passes/head.py).
                        workspace = max((workspace_bytes(o) for o in buf.node.origins), default=0)
                        if workspace:
                            book.hold(Storage(step, step, workspace))
                        continue
                    if isinstance(buf.node, MultiOutput) and buf.mpi_buffer.size_free:
                        # An element of the tuple an extern kernel (a custom op, a fallback)
                        # returned: allocated by that kernel, alive as long as it is read.
                        made = next((packed[i.get_name()] for i in buf.node.inputs if i.get_name() in packed), step)
                        book.hold(Storage(made, step, int(buf.mpi_buffer.size_free)), name)
                        continue
                    if name in owner:
                        continue  # its storage was allocated for a view written into it first
                    layout = buf.node.layout
                    target = layout.view.get_name() if isinstance(layout, NonOwningLayout) else None
                    if target in scheduler.name_to_buf:
                        # Computed straight into a slice of a later buffer (cat's inputs): the code
                        # generator allocates that buffer here, and this one is a view of it.
                        if target not in owner:
                            book.allocate(scheduler.name_to_buf[target], step, on_cpu and not extern)
                        owner[name] = owner[target]
                        continue
                    if not buf.mpi_buffer.size_alloc:
                        continue  # an alias, a mutation, or fused away: no storage of its own
                    book.allocate(buf, step, on_cpu and not extern)
                book.pending.extend(node.last_usage)
                if extern or not on_cpu:
                    book.release(step)
            book.release(len(nodes) - 1)
            # A buffer read through an alias lives as long as Inductor's own timeline says.
            infos, _, _ = inductor_memory.compute_memory_timeline(nodes, {}, graph_outputs)
            for info in infos:
                if info.buffer.get_name() in owner:
                    book.end(info.buffer.get_name(), None if info.end_step == -1 else info.end_step)
            for name in graph_outputs:
                if name in owner or name in graph_inputs:
                    book.end(name, None)
            returned: list[int | str | None] = []
            for name in graph.get_output_names():
                where = owner.get(name, name)
                returned.append(where if isinstance(where, int) or where in graph_inputs else None)
            strides: list[tuple[int, ...] | None] = []  # each output's, as Inductor lays it out
            for out in graph.graph_outputs:
                try:
                    strides.append(tuple(int(V.graph.sizevars.optimization_hint(d, fallback=1)) for d in out.get_stride()))
                except Exception:  # noqa: BLE001 - no tensor, or no fixed layout: its stride is the graph's
                    strides.append(None)
            return Schedule(len(nodes), book.storages, book.input_end, returned, strides)


class _Book:
    """The code generator's storages as a graph's kernels run (Note [Inductor's own schedule]):
    which storage each buffer is in, how long each lives, and which freed ones a later buffer of
    their kind may take.

    The code generator's order of events (Scheduler._codegen): on a CPU, consecutive generated
    kernels run as one group called before the next extern kernel, so a group's buffers are all
    allocated before it runs (from `group`, the step it starts at) and what its kernels last read
    is freed after it; elsewhere each kernel frees what it last read. Frees go in name order."""

    def __init__(self, scheduler, graph, graph_outputs, *, by_step: list[int], peak: int, reuse: bool, reuse_key):
        self.scheduler, self.graph, self.graph_outputs = scheduler, graph, graph_outputs
        self.by_step = by_step
        """Inductor's estimate of each step's memory, raised as freed storages are handed on."""
        self.peak = peak
        """Inductor's estimate of the graph's peak, which no hand-over may exceed."""
        self.reuse, self.reuse_key = reuse, reuse_key  # allow_buffer_reuse; the code generator's buffer_reuse_key
        self.storages: list[Storage] = []
        self.owner: dict[str, int | str] = {}  # buffer -> its storage (an index, or a donated input's name)
        self.input_end: dict[str, int | None] = {}
        self.pool: dict[object, list[tuple[int, str]]] = {}  # freed buffers a later one of its kind may take
        self.pending: list[str] = []  # buffers last read since the last release
        self.taken: set[str] = set()  # buffers whose storage a later one was written into
        self.group: int | None = None  # the step a CPU group of kernels starts at

    def end(self, name: str, step: int | None) -> None:
        """`name`'s storage lives through `step` at least (None: to the graph's end)."""
        where = self.owner.get(name, name)
        storage = self.storages[where] if isinstance(where, int) else None
        last = storage.last if storage is not None else self.input_end.get(where, -1)
        last = None if step is None or last is None else max(last, step)
        if storage is not None:
            storage.last = last
        else:
            self.input_end[where] = last

    def release(self, at: int) -> None:
        """Free what was last read since the last release, after step `at`."""
        scheduler = self.scheduler
        for name in sorted(set(self.pending)):
            if name in self.graph_outputs:
                continue
            self.end(name, at)
            if name in self.taken:
                continue  # a later buffer was written into its storage: not free
            source = scheduler.name_to_buf.get(name) if name in self.owner else scheduler.name_to_donated_buffer.get(name)
            if (source is not None and source.node is not None and source.node.should_allocate()
                    and name not in self.graph.removed_buffers and not source.node.get_inputs_that_alias_output()):
                self.pool.setdefault(self.reuse_key(source.node), []).append((at, name))
        self.pending.clear()
        self.group = None

    def hold(self, storage: Storage, name: str | None = None) -> None:
        """A storage the code generator does not allocate or hand on (an extern kernel's own
        output, a chunked head's workspace); `name`: the buffer it holds."""
        if name is not None:
            self.owner[name] = len(self.storages)
        self.storages.append(storage)

    def allocate(self, buf, step: int, grouped: bool) -> None:
        """Give `buf` a storage at `step`: a freed one of its kind while Inductor's estimate of the
        peak allows, else its own (from the start of the CPU group it runs in)."""
        name = buf.get_name()
        key = self.reuse_key(buf.node) if buf.node.should_allocate() else None
        freed = self.pool.get(key) if key is not None and self.reuse else None
        if freed:
            free_step, old = freed.pop()
            size = _nbytes(buf)
            if free_step + 1 == step or size + max(self.by_step[free_step + 1:step], default=0) <= self.peak:
                for t in range(free_step + 1, step):
                    self.by_step[t] += size
                self.owner[name] = self.owner.get(old, old)
                return
            freed.append((free_step, old))
        self.owner[name] = len(self.storages)
        self.storages.append(Storage(self.group if grouped else step, step, int(buf.mpi_buffer.size_alloc),
                                     repr(key) if key is not None and self.reuse else None))


def _nbytes(buf) -> int:
    """A scheduler buffer's storage bytes, as the code generator sizes it."""
    from torch._inductor.utils import get_dtype_size
    from torch._inductor.virtualized import V

    size = V.graph.sizevars.optimization_hint(V.graph.get_allocation_storage_size(buf.node), fallback=0)
    return int(size) * get_dtype_size(buf.node.get_dtype())


def _in_place(nodes, scheduler, graph, graph_outputs, BaseSchedulerNode, SchedulerNode, can_match_buffer_size) -> dict[str, str]:
    """What Inductor's code generator writes in place (Scheduler.decide_inplace_update, decided
    there as kernels are generated): a generated kernel's output into a buffer or a donated input
    it is the last reader of, read at the index it writes, of the same dtype and size. {output
    buffer: the buffer or input whose storage it takes}."""
    from torch._inductor import ir

    # Inputs that are no buffer of their own to write into (a scatter's or mutation's output, a
    # tuple), which decide_inplace_update passes over: reading their dtype raises.
    unwritable = tuple(getattr(ir, name) for name in ("NoneLayout", "MultiOutputLayout", "MutationLayoutSHOULDREMOVE",
                                                      "CommBufferLayout") if hasattr(ir, name))
    readable = {**scheduler.name_to_buf, **scheduler.name_to_donated_buffer}
    step_of = {sub: step for step, node in enumerate(nodes) for sub in node.get_nodes()}
    in_place: dict[str, str] = {}
    for step, node in enumerate(nodes):
        for sub in node.get_nodes():
            if not isinstance(sub, SchedulerNode):
                continue
            for out in sub.get_outputs():
                name = out.get_name()
                if (name in graph.removed_buffers or not out.node.should_allocate()
                        or out.node.get_inputs_that_alias_output() or out.node.get_mutation_names()):
                    continue
                for read in sub.read_writes.reads:
                    source = readable.get(read.name)
                    if source is None or read.name in in_place.values() or read.name in graph_outputs:
                        continue
                    users = [u for u in source.users if isinstance(u.node, BaseSchedulerNode)]
                    later = [u for u in users if step_of.get(u.node, -1) >= step and u.node.get_name() not in sub.ancestors]
                    accesses = {d for u in users if step_of.get(u.node) == step
                                for d in u.node.read_writes.reads_and_writes() if d.name == read.name}
                    if (len(later) == 1 and later[0].can_inplace and later[0].node is sub and len(accesses) <= 1
                            and source.node is not None and not isinstance(source.node.get_output_spec(), unwritable)
                            and can_match_buffer_size(source.node, out.node)):
                        in_place[name] = read.name
                        break
    return in_place



def scheduled_peaks(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, *, entry: dict[object, int],
                     key_of: dict[torch.fx.Node, object], pinned: set[object], by_block: bool = True) -> tuple[int, int, int] | None:
    """(forward peak, backward peak, copies) from Inductor's schedules of the two graphs (Note
    [Inductor's own schedule]), or None when Inductor could not be asked. `entry` is what is live
    as the backward starts (saved values, incoming gradients, held outputs), by storage key;
    `key_of` maps the backward's placeholders to those keys; `pinned` keys are never freed.
    `copies`: the bytes of saved inputs the forward returns as copies of its own (Note [Saved
    inputs in another layout]), live from the forward's end as the saved values in `entry` are.
    The forward is scheduled block by block; the backward too when `by_block` (Note [A schedule
    per block])."""
    # Saved values no output shares a storage with: AOTAutograd lets Inductor reuse them.
    out_keys = {key_of.get(a) for a in bw.graph.output_node().all_input_nodes}
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    donated = tuple(i for i, n in enumerate(placeholders)
                    if isinstance(key_of.get(n), torch.fx.Node) and key_of[n] is not n  # from the forward
                    and key_of[n] in entry and key_of[n] not in pinned and key_of[n] not in out_keys)

    def own(node: torch.fx.Node) -> str | None:
        block = block_of(node)
        return block.name if block is not None else None

    def readers(node: torch.fx.Node) -> set[str]:
        """The blocks that read a node; through a reader of no block (SDPA run with its RNG
        state), the blocks that read that one."""
        blocks = {own(u) for u in node.users}
        if None in blocks:
            blocks |= {own(w) for u in node.users if own(u) is None for w in u.users}
        return blocks - {None}

    def label(node: torch.fx.Node) -> str | None:
        """A node's block; none for a value another block reads (min-cut's CSE shares masks and
        rotary tables between blocks, and recomputes them in the backward where a later block
        reads them)."""
        blocks = readers(node)
        return None if blocks - {own(node)} else own(node)

    def shared(node: torch.fx.Node) -> bool:
        """A value several blocks read."""
        return len(readers(node)) > 1

    def schedule(gm: torch.fx.GraphModule, segmented: bool, **kwargs) -> Schedule:
        if segmented:
            try:
                return segmented_schedule(gm, label=label, shared=shared, **kwargs)
            except Exception as error:  # noqa: BLE001 - a cut Inductor cannot lower: the whole graph
                log.info("ckpt_fx: Inductor's schedule per block unavailable (%s: %s); scheduling the whole graph",
                         type(error).__name__, error)
        return inductor_schedule(copy_graph_module(gm), **kwargs)

    try:
        with _without_guards(fw):  # Note [Predicting adds no guards]
            forward = schedule(fw, True, is_backward=False)
            backward = schedule(_restrided(bw, fw, forward.strides), by_block, is_backward=True, donated=donated)
    except Exception as error:  # noqa: BLE001 - any failure: the walk's own prediction stands
        log.info("ckpt_fx: Inductor's schedule unavailable (%s: %s); the memory pass predicts fusion itself",
                 type(error).__name__, error)
        return None
    # Note [Saved inputs in another layout]
    # Under layout optimization (on a CPU whenever a graph convolves; on a GPU where Inductor's
    # heuristic finds it pays) Inductor converts a convolution's input and weight to channels-last
    # and, where the forward saves them for the backward, returns and saves the converted copies
    # instead of the inputs: storages the forward allocates and the backward frees after its last
    # read, where the memory pass counts a saved input as free. ViT's patch embedding saves its
    # images and weight so (5.3 MB at batch 8 x 224 x 224): counted free, every plan of the
    # README's sweep was predicted that much under the measured peak (every block: 43.7 MB for
    # 52.2). A segment reading such an input returns it too, so the segment that converts it shows
    # the copy (Note [A schedule per block]).
    results = _results(fw.graph)
    copies = {n.name: forward.storages[place].nbytes for n, place in zip(results, forward.returned)
              if isinstance(n, torch.fx.Node) and n.op == "placeholder" and isinstance(place, int)}
    if copies:
        entry, key_of = dict(entry), dict(key_of)
        for node in placeholders:
            if node.name in copies:
                key_of[node] = ("copy", node.name)
                entry[key_of[node]] = copies[node.name]
    # Entry storage -> the last step it lives through (None: to the end; -1: not read at all).
    freed: dict[object, int | None] = {key: None for key in entry if key in pinned}
    for node in bw.graph.nodes:
        key = key_of.get(node)
        if node.op != "placeholder" or key not in entry or key in pinned:
            continue
        end = backward.input_end.get(node.name, -1)
        last = freed.get(key, -1)
        freed[key] = None if end is None or last is None else max(last, end)
    return (schedule_peak(forward, entry={}, freed={}), schedule_peak(backward, entry=entry, freed=freed),
            sum(copies.values()))


def _restrided(bw: torch.fx.GraphModule, fw: torch.fx.GraphModule, strides: list) -> torch.fx.GraphModule:
    """`bw`, or a copy whose saved values have the strides the forward's schedule gives them, as
    AOTAutograd restrides the backward's inputs to the compiled forward's outputs before compiling
    it: under layout optimization a saved activation comes channels-last, and the backward's
    kernels (and what they copy) follow it."""
    from torch._guards import detect_fake_mode

    results = _results(fw.graph)
    stride_of = {n.name: st for n, st in zip(results, strides) if isinstance(n, torch.fx.Node) and st is not None}
    changed = {}
    for node in bw.graph.nodes:
        value = node.meta.get("val")
        if (node.op == "placeholder" and node.name in stride_of and isinstance(value, torch.Tensor)
                and tuple(value.stride()) != stride_of[node.name] and len(value.shape) == len(stride_of[node.name])):
            changed[node.name] = stride_of[node.name]
    if not changed:
        return bw
    copy = copy_graph_module(bw)
    fake = detect_fake_mode([n.meta.get("val") for n in copy.graph.nodes if n.op == "placeholder"])
    with fake if fake is not None else contextlib.nullcontext():
        for node in copy.graph.nodes:
            if node.name in changed and node.op == "placeholder":
                value = node.meta["val"]
                node.meta = {**node.meta, "val": value.as_strided(value.shape, changed[node.name])}
    return copy


# Note [A backward's blocks kept apart]
# A checkpointed backward recomputes block k-1 after block k's gradients, and holds one block's
# insides at a time only if it runs in that order. Inductor's scheduler does not keep it: it fuses
# independent nodes that read the same buffer (a horizontal fusion), and block k-1's recomputed
# RMSNorm and rotary tables read what block k's attention backward reads (the rotary frequencies),
# so the start of block k-1's recompute ran inside block k's first kernel and its projections
# followed, alive through block k's backward. So each backward of ours is lowered with no
# horizontal fusion between nodes recomputed for different blocks (blocks_kept_apart in
# passes/_compat.py; a node the policy did not ask to recompute fuses as before; the README's
# table beside HF's checkpointing shows what it changed). Inside a block: its two RMSNorm weight
# gradients, fused horizontally (both read the block's input), ran after the attention backward and
# kept the MLP's input gradients and the attention's output alive through it, where HF's
# checkpointing has freed them; the o_proj weight gradient waited the same way. So where the
# policy recomputes whole units (NamedPolicy.whole_units: blocks, offload, segments, sqrt; select_pass
# marks what they recompute) no horizontal fusion where either node holds such a recomputation is
# made at all: `enable` on transformers' Llama, Qwen3 and Phi3 peaks below HF's checkpointing. Not
# for a budget or selective: their blocks are recomputed in part, and there the stricter rule raised
# a budget's measured peak above torch's knob (tests/test_inductor.py) while this memory pass's
# prediction barely moved, so a budget would have chosen blind. Nor in a backward that convolves:
# ConvNeXt's block fuses its recomputed GELU with the GELU's gradient (both read one projection),
# and without that fusion every block peaked as high as no checkpointing (tests/test_inductor_memory.py).
# Lowering without Inductor's peak-memory reordering was tried too: it raises other models' peaks
# (GPT-2's, torch's knob's), so the reordering stays. What is left: Inductor fuses an add into its
# consumer instead of forming the sum, so under LoRA a projection's base and adapter outputs (and
# their gradients) are both alive where eager keeps their sum. Storing each such recomputed sum in
# a kernel of its own (realized, not fused with its consumers) frees the adapter's outputs but does
# not lower the step: the SwiGLU backward's fused kernel then writes the gradients of both terms
# apart, as many buffers as it saved, and the step peaked higher.
# The memory pass schedules backwards with the same fusion rule.


# Note [Predicting adds no guards]
# Lowering a graph with Inductor records guards on its symbolic sizes in the shape environment
# dynamo traced it with: the graphs the prediction lowers (a block's segment, a backward given the
# forward's strides, a candidate plan) are not the graph that runs, and a guard one of them adds
# (comparing a symbolic stride with its hint) would specialize the size for good: dynamo would
# compile every new sequence length as a static graph until its recompile limit, and the steps
# after it would run without a plan. A prediction reads sizes at their hints and adds nothing.


def _without_guards(gm: torch.fx.GraphModule):
    """A context in which the shape environment of gm's fake inputs records no guards (none for
    a graph of static shapes)."""
    from torch._guards import detect_fake_mode

    fake = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    shape_env = getattr(fake, "shape_env", None)
    return shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext()


def _results(graph: torch.fx.Graph) -> tuple:
    """A graph's outputs in order, as Inductor lists them (its output node's one argument, a tuple
    or a single value)."""
    results = graph.output_node().args[0]
    return tuple(results) if isinstance(results, (tuple, list)) else (results,)


def schedule_peak(schedule: Schedule, *, entry: dict[object, int], freed: dict[object, int | None]) -> int:
    """The peak of live bytes over a schedule (Note [Inductor's own schedule]): each storage from
    the step that allocates it through the last it lives through (None: to the end), on top of
    `entry` (bytes live at the start by storage key, each freed after the step `freed` names: None
    never, -1 at once, as is one not named)."""
    delta = [0] * (schedule.steps + 2)
    for storage in schedule.storages:
        delta[storage.first] += storage.nbytes
        if storage.last is not None:
            delta[storage.last + 1] -= storage.nbytes
    for key, nbytes in entry.items():
        last = freed.get(key, -1)
        if last is not None:
            delta[last + 1] -= nbytes
    live = peak = sum(entry.values())
    for change in delta:
        live += change
        peak = max(peak, live)
    return peak




# Note [A schedule per block]
# Lowering and scheduling a whole graph costs about what Inductor's own compile does before code
# generation (about 40 s for the backward of 24 blocks on a 2-core CPU), and a fixed policy plans
# twice, a budget several times. A stack's blocks are alike: under one plan, block 7's forward (or
# backward) is block 3's graph again, with the same shapes. So a graph is cut into segments, each
# a run of nodes of one block (a forward or recomputed node's region; a gradient, or a value
# another block reads, joins the run it stands in), each segment is
# lowered and scheduled on its own once per distinct structure (cached for the process, keyed by
# Inductor's settings too: a budget's candidates share most of their blocks), and the schedules
# are laid end to end: a value one segment passes to a later one lives from the step that made it
# to the last step that reads it. A segment's input that only it reads (a saved value, or in the
# backward a gradient from the block before) is donated to it, as Inductor reuses it within the
# whole graph; and a storage freed in one segment is handed to a later segment's buffer of its
# kind while that keeps within the peak of the segments laid end to end without such hand-overs
# (the graph's inputs counted until their last read), as the code generator bounds its own
# hand-overs by its estimate of the graph's peak, which counts the inputs it may free. What this
# cannot see (fusion across a block boundary, the code generator's exact bound) moves the
# prediction by up to 7% against the whole graph's on the test models, both ways
# (tests/test_inductor_memory.py holds both to the measured peak), and more with depth: a block
# scheduled alone hands buffers on under its own peak, the whole graph under the graph's (GPT-2
# 12 x 256, every block, with hand-overs: backward +8.7%, forward -2.7%; a backward of whole units
# hands nothing over: Note [Hand-overs in a backward of whole units]). In the forward, what stands before the
# first block is a segment of its own (the embedding), and so is what stands after the last (the
# head and the loss), so the first and last blocks are alike to the others and the head, which no
# plan changes, is lowered once for all a budget's candidates; and a forward value several blocks
# read that the prelude alone computes (a mask or rotary table min-cut's CSE left in the first
# block that reads it) joins the prelude. The backward's prelude (the loss's gradient and the
# head's backward) stays in the last block's segment: cut off, it under-predicted ViT's backward
# against the whole graph's schedule (by 4.9 MB under `budget:0.9` of the README's sweep); joined,
# ViT's backward laid end to end equals the whole graph's on every plan of that budget's search.
# A graph that does not cut into a few runs per block, or passes a tuple or a size across a cut,
# is scheduled whole; and so is the backward of a plan that min-cut partitioned after its CSE and
# that asks for recomputes (the planner says which; Note [Whole backward schedules] in
# passes/planner.py): there Inductor fuses neighbouring blocks' recomputes sideways (GPT 3 x 128, every block:
# block 1's softmax `amax` recompute runs in one kernel with block 2's, during block 2's backward)
# and the whole graph's peak is not the blocks' laid end to end (9.8 MB whole, 8.0 laid end to
# end; GPT-2 12 x 256: 121.7 whole, 138.8 laid end to end), which no cut between blocks can show.
# (Un-sharing the values the CSE shares between blocks, the causal mask's constants, changes
# nothing: it is the fusion.) Its forward recomputes nothing and is cut as any other. Blocks whose
# dropout reads another of the step's seeds (an index into one tensor) are alike: the index is
# left out of the key.


# Note [Hand-overs in a backward of whole units]
# A backward that recomputes whole units (blocks, segments) is laid end to end with no storage
# handed from one segment to a later one. Each block's backward is alike, so with hand-overs every
# storage its MLP backward frees is taken by the same buffer of the next block, and each is chained
# from the last block's backward to the first's. Inductor's schedule of the whole graph lets some of
# them go, and equals the one laid end to end without hand-overs on transformers' Llama
# (tests/test_inductor_memory.py holds every-block plans to 5% of the measured peak; the README
# gives the figures). A plan that recomputes parts of blocks (selective, a budget's candidates)
# keeps the hand-overs: without them a selective plan was predicted under its measured peak, which a
# budget would trust.
_SEGMENT_SCHEDULES: dict[str, Schedule] = {}
_SEGMENT_CACHE_SIZE = 512


def segmented_schedule(gm: torch.fx.GraphModule, *, is_backward: bool, donated: tuple[int, ...] = (),
                       label, shared=lambda node: False) -> Schedule:
    """inductor_schedule's answer for `gm`, from one schedule per distinct block (Note [A schedule
    per block]); `label(node)` names a node's block or None, `shared(node)` says whether several
    blocks read it. `gm` is not changed."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = gm.graph.output_node()
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    segments = _segments(compute, label, shared=shared, is_backward=is_backward)
    blocks = {label(n) for n in compute} - {None}
    if (len(segments) < 3 or len(segments) > 3 * len(blocks) + 4
            or any(n.op != "call_function" for n in compute)):
        return inductor_schedule(copy_graph_module(gm), is_backward=is_backward, donated=donated)
    segment_of = {n: i for i, seg in enumerate(segments) for n in seg}
    graph_outputs = set(output.all_input_nodes)
    config = _config_key()
    donated_names = {placeholders[i].name for i in donated}

    prepared: list[_Segment] = []
    lowered = 0
    for index, members in enumerate(segments):
        inside = set(members)
        inputs = list(dict.fromkeys(a for n in members for a in n.all_input_nodes if a not in inside))
        outs = [n for n in members if n in graph_outputs or any(segment_of.get(u, -1) > index for u in n.users)]
        # A graph input the graph returns (a saved one) is returned by each segment that reads it:
        # where Inductor converts it (layout optimization), it returns the converted copy.
        outs += [n for n in inputs if n.op == "placeholder" and n in graph_outputs]
        for n in inputs + outs:
            value = n.meta.get("val")
            if not isinstance(value, torch.Tensor):  # a tuple, a symbolic size: schedule the whole
                return inductor_schedule(copy_graph_module(gm), is_backward=is_backward, donated=donated)
        gives = tuple(
            i for i, n in enumerate(inputs)
            if is_backward and all(segment_of.get(u) == index for u in n.users)
            and (n.name in donated_names or (n.op != "placeholder" and n not in graph_outputs)))
        key = config + _segment_key(members, inputs, outs, is_backward=is_backward, donated=gives)
        result = _SEGMENT_SCHEDULES.get(key)
        if result is None:
            # Inputs named by position ("p0", "p1", ...), not by name: an alike segment elsewhere
            # has inputs of other names.
            lowered_one = inductor_schedule(_segment_module(members, inputs, outs), is_backward=is_backward, donated=gives)
            position = {n.name: f"p{i}" for i, n in enumerate(inputs)}
            result = lowered_one._replace(
                input_end={position[k]: v for k, v in lowered_one.input_end.items() if k in position},
                returned=[position.get(r, r) if isinstance(r, str) else r for r in lowered_one.returned])
            lowered += 1
            if len(_SEGMENT_SCHEDULES) >= _SEGMENT_CACHE_SIZE:
                _SEGMENT_SCHEDULES.clear()
            _SEGMENT_SCHEDULES[key] = result
        prepared.append(_Segment(inputs, outs, result))
    log.debug("ckpt_fx: %s scheduled in %d segments, %d of them lowered (%d cached schedules)",
              "backward" if is_backward else "forward", len(segments), lowered, len(_SEGMENT_SCHEDULES))

    # The bytes live at each step when no buffer is handed across segments, the graph's inputs
    # until their last read among them: the bound on handing one on, as Inductor's own estimate
    # (which counts the inputs it may free) is within a graph.
    apart = _stitch(prepared, placeholders, segment_of, graph_outputs, None)
    steps, storages = apart.steps, apart.storages
    for n in placeholders:
        if n.name in apart.input_end:
            storages.append(Storage(0, apart.input_end[n.name], tensor_bytes(n.meta.get("val"))))
    delta = [0] * (steps + 1)
    for storage in storages:
        delta[storage.first] += storage.nbytes
        delta[steps if storage.last is None else storage.last + 1] -= storage.nbytes
    live, running = [], 0
    for change in delta[:steps]:
        running += change
        live.append(running)
    # Note [Hand-overs in a backward of whole units]
    joined = _stitch(prepared, placeholders, segment_of, graph_outputs,
                     None if is_backward and any(map(recomputed_whole, compute)) else live)
    results = _results(gm.graph)
    returned = [joined.where.get(n) if isinstance(n, torch.fx.Node) else None for n in results]
    # Each output's stride from the segment that makes it (an input's: the one that copies it).
    stride_of: dict[torch.fx.Node, tuple[int, ...] | None] = {}
    for segment in prepared:
        for n, place, stride in zip(segment.outs, segment.schedule.returned, segment.schedule.strides):
            if n.op != "placeholder" or isinstance(place, int):
                stride_of.setdefault(n, stride)
    return Schedule(joined.steps, joined.storages, joined.input_end, returned, [stride_of.get(n) for n in results])


@dataclass(frozen=True)
class _Segment:
    """A run of one block's nodes scheduled on its own (Note [A schedule per block]): its inputs
    and outputs in the whole graph, and its schedule, whose inputs are named by position ("p0")."""

    inputs: list[torch.fx.Node]
    outs: list[torch.fx.Node]
    schedule: Schedule


@dataclass
class _Stitched:
    """Segments' schedules laid end to end: the steps so far, the storages (new ones: a cached
    segment's are read, never changed), the graph inputs' last steps, and where each value of the
    graph is (a storage's index, or an input's name)."""

    steps: int = 0
    storages: list[Storage] = field(default_factory=list)
    input_end: dict[str, int | None] = field(default_factory=dict)
    where: dict[torch.fx.Node, int | str] = field(default_factory=dict)

    def extend(self, node: torch.fx.Node, step: int | None) -> None:
        """`node`'s storage lives through `step` at least (None: to the graph's end)."""
        place = self.where.get(node)
        if place is None:
            return
        if isinstance(place, int):
            last = self.storages[place].last
            self.storages[place].last = None if step is None or last is None else max(last, step)
        else:
            last = self.input_end.get(place, -1)
            self.input_end[place] = None if step is None or last is None else max(last, step)


def _stitch(segments: list[_Segment], placeholders: list[torch.fx.Node], segment_of: dict[torch.fx.Node, int],
            graph_outputs: set[torch.fx.Node], live: list[int] | None) -> _Stitched:
    """The segments' schedules end to end; with `live` (the bytes live at each step with no buffer
    handed across segments), a storage freed in one segment is handed to a later segment's buffer
    of its kind while that keeps within the peak of `live`, as the code generator does within a
    graph. `live` is raised where a storage is handed on."""
    joined = _Stitched(where={n: n.name for n in placeholders})
    storages, where = joined.storages, joined.where
    bound = max(live, default=0) if live is not None else 0
    for index, segment in enumerate(segments):
        local, offset = segment.schedule, joined.steps
        last_step = offset + local.steps - 1
        pool: dict[str, list[int]] = {}  # freed storages a buffer of their kind may take, longest-lived last
        if live is not None:
            held = {p for n, p in where.items()
                    if isinstance(p, int) and any(segment_of.get(u, -1) >= index for u in n.users)}
            for i, storage in enumerate(storages):
                if storage.last is not None and i not in held and storage.kind is not None:
                    pool.setdefault(storage.kind, []).append(i)
            for kind in pool.values():
                kind.sort(key=lambda i: storages[i].last)
        index_of: list[int] = []  # each of the segment's storages: its index in the joined list
        for storage in local.storages:
            end_step = last_step if storage.last is None else offset + storage.last
            kind = storage.kind
            if live is not None and kind is not None and pool.get(kind):
                old = pool[kind][-1]
                gap = range(storages[old].last + 1, offset + storage.first)
                if storage.nbytes + max((live[t] for t in gap), default=0) <= bound:
                    pool[kind].pop()
                    for t in gap:
                        live[t] += storage.nbytes
                    storages[old].last = end_step
                    index_of.append(old)
                    continue
            index_of.append(len(storages))
            storages.append(Storage(offset + storage.first, end_step, storage.nbytes, kind))
        for i, n in enumerate(segment.inputs):
            if f"p{i}" in local.input_end:
                step = local.input_end[f"p{i}"]
                joined.extend(n, last_step if step is None else offset + step)
        for n, place in zip(segment.outs, local.returned):
            if isinstance(place, int):  # a storage of this segment's
                if n.op == "placeholder" and isinstance(where[n], int):
                    continue  # an earlier segment's copy of the input is the one returned
                where[n] = index_of[place]
            elif isinstance(place, str):  # an input's, by its position
                where[n] = where.get(segment.inputs[int(place[1:])], segment.inputs[int(place[1:])].name)
            if n in graph_outputs:
                joined.extend(n, None)
        joined.steps += local.steps
    for n in graph_outputs:
        joined.extend(n, None)
    return joined


def _config_key() -> str:
    """Inductor's settings, as part of a cached schedule's key: a schedule under other settings
    is another schedule."""
    import torch._inductor.config as inductor_config

    try:
        return str(hash(repr(sorted(inductor_config.save_config_portable().items()))))
    except Exception:  # noqa: BLE001 - a torch without it: settings are not told apart
        return ""


def _segments(compute: list[torch.fx.Node], label, *, shared, is_backward: bool) -> list[list[torch.fx.Node]]:
    """Runs of nodes of one block, in graph order; a node of no block joins the run it stands in,
    and a getitem joins its tuple's run. In the forward, what stands before the first block's
    nodes is a run of its own (the prelude: the embedding), and so is what stands after the last
    block's (the loss); a forward value several blocks read, computed from the prelude alone, joins
    the prelude, with what only such values read (Note [A schedule per block])."""
    import operator

    labelled = [i for i, n in enumerate(compute) if label(n) is not None]
    first = labelled[0] if labelled else len(compute)
    cuts = {first, labelled[-1] + 1} if labelled and not is_backward else set()  # the forward's prelude and head
    hoisted: set[torch.fx.Node] = set()
    if not is_backward and first > 0:
        feeds: set[torch.fx.Node] = set()  # values several blocks read, what only they read, the constants they read
        for node in reversed(compute[first + 1:]):
            if (shared(node) or (node.users and all(u in feeds for u in node.users))
                    or (not node.all_input_nodes and any(u in feeds for u in node.users))):
                feeds.add(node)
        prelude = set(compute[:first])
        for node in compute[first + 1:]:
            if node in feeds and all(a in prelude or a in hoisted or a.op == "placeholder" for a in node.all_input_nodes):
                hoisted.add(node)
    segments: list[list[torch.fx.Node]] = []
    current: object = None
    run_of: dict[torch.fx.Node, int] = {}
    for position, node in enumerate(compute):
        if node.target is operator.getitem and node.args and node.args[0] in run_of:
            run_of[node] = run_of[node.args[0]]
            segments[run_of[node]].append(node)
            continue
        if node in hoisted:
            run_of[node] = 0
            segments[0].append(node)
            continue
        block = label(node)
        if (not segments or position in cuts
                or (block is not None and current is not None and block != current)):
            segments.append([])
        if block is not None:
            current = block
        run_of[node] = len(segments) - 1
        segments[-1].append(node)
    return segments


def _segment_key(members: list[torch.fx.Node], inputs: list[torch.fx.Node], outs: list[torch.fx.Node], *,
                 is_backward: bool, donated: tuple[int, ...]) -> str:
    """A key equal for segments of the same structure, shapes and donated inputs: its nodes by
    position, not name (an alike segment elsewhere has nodes of other names)."""
    number = {n: f"p{i}" for i, n in enumerate(inputs)} | {n: f"n{i}" for i, n in enumerate(members)}

    def describe(value: object) -> object:
        if isinstance(value, torch.fx.Node):
            return number[value]
        if isinstance(value, torch.Tensor):
            return ("T", tuple(str(d) for d in value.shape), tuple(str(d) for d in value.stride()),
                    str(value.dtype), str(value.device))
        if isinstance(value, (list, tuple)):
            return tuple(describe(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, describe(v)) for k, v in value.items())
        return repr(value)

    body = []
    for n in members:
        # Which of the step's seeds a block's dropout reads is a scalar index into one tensor: it
        # changes no buffer, so blocks differing only there share a schedule.
        args = n.args[:1] if str(n.target) == "prims.inductor_lookup_seed.default" else n.args
        # Whether a node holds a recomputation changes what it may fuse with (Note [A backward's
        # blocks kept apart]).
        kept_apart = (recomputed_block(n) is not None, recomputed_whole(n))
        body.append((str(n.target), describe(args), describe(n.kwargs), describe(n.meta.get("val")), kept_apart))
    return repr((is_backward, donated, tuple(describe(n.meta.get("val")) for n in inputs), tuple(body),
                 tuple(number[n] for n in outs)))


def _segment_module(members: list[torch.fx.Node], inputs: list[torch.fx.Node],
                    outs: list[torch.fx.Node]) -> torch.fx.GraphModule:
    """A graph module of one segment, its inputs as placeholders of the same names; built only for
    a segment whose key (_segment_key) has no schedule yet."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in members:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[n] for n in outs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)
