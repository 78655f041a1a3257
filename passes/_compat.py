"""Every private torch import of the project lives here (supported: torch 2.11 to 2.13).

When torch moves one of these, this is the only file to change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import default_partition
from torch._functorch.partitioners import min_cut_rematerialization_partition as min_cut_partition
from torch._ops import HigherOrderOperator, OpOverload
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensor, FakeTensorMode  # ckpt_fx.fit: planning without storage
from torch.utils.checkpoint import CheckpointPolicy

try:  # torch >= 2.12
    from torch.fx.experimental.symbolic_shapes import optimization_hint as _hint
except ImportError:  # torch 2.11
    _hint = None

__all__ = [
    "CheckpointPolicy",
    "HigherOrderOperator",
    "OpOverload",
    "pytree",
    "activation_memory_budget",
    "aot_autograd",
    "aot_module_simplified",
    "boxed_nop",
    "without_joint_cse",
    "default_partition",
    "min_cut_partition",
    "is_fusible",
    "is_primal",
    "is_tangent",
    "size_hint",
    "cache_hash",
    "inductor_random_as_eager",
    "inductor_schedule",
    "mark_dynamic",
    "no_fx_graph_cache",
    "dynamo_recompile_limit",
    "own_backend",
    "per_block_checkpointing",
]

# The meta key torch's partitioners read for per-node recompute decisions.
RECOMPUTE_KEY = "recompute"


def is_tangent(node: torch.fx.Node) -> bool:
    """A joint-graph placeholder holding an incoming gradient."""
    return node.op == "placeholder" and "tangents" in str(node.target)


def is_primal(node: torch.fx.Node) -> bool:
    """A joint-graph placeholder holding a forward input (parameters and buffers included)."""
    name = str(node.target)
    return node.op == "placeholder" and not is_tangent(node) and "seed" not in name and "offset" not in name


def size_hint(value: int | torch.SymInt, fallback: int = 1) -> int:
    """A concrete integer for a possibly symbolic size, without adding guards."""
    if isinstance(value, int):
        return value
    if _hint is not None:
        try:
            return int(_hint(value, fallback=fallback))
        except Exception:  # noqa: BLE001 - an unbacked or odd symbol: use the fallback
            return fallback
    hint = getattr(getattr(value, "node", None), "hint", None)
    return int(hint) if hint is not None else fallback


def symbols_of(value: int | torch.SymInt) -> dict[str, int]:
    """{symbol name: hint} of the symbols in a possibly symbolic size ({} for an int)."""
    node = getattr(value, "node", None)
    expr, env = getattr(node, "expr", None), getattr(node, "shape_env", None)
    if expr is None or env is None:
        return {}
    values = getattr(env, "backed_var_to_val", None)  # torch >= 2.13; var_to_val before
    values = values if values is not None else env.var_to_val
    return {str(sym): int(values[sym]) for sym in expr.free_symbols if sym in values}


def size_at(value: int | torch.SymInt, sizes: dict[str, int]) -> int:
    """A possibly symbolic size with some symbols set (`sizes`, by name) and the rest at their hints."""
    if isinstance(value, int) or not sizes:
        return size_hint(value)
    node = getattr(value, "node", None)
    expr = getattr(node, "expr", None)
    if expr is None:
        return size_hint(value)
    hints = symbols_of(value)
    try:
        return int(expr.subs({sym: sizes.get(str(sym), hints.get(str(sym))) for sym in expr.free_symbols}))
    except (TypeError, ValueError):  # a symbol without a hint: the size's own hint
        return size_hint(value)


def is_impure_not_random(node: torch.fx.Node) -> bool:
    """fx's side-effect check, random ops not counted (select judges those by their arguments)."""
    try:
        return node.is_impure(impure_random=False)
    except TypeError:  # an fx without the keyword: it did not count random ops as impure
        return node.is_impure()


@functools.cache
def _op_types():
    from torch._functorch.partitioners import get_default_op_list

    return get_default_op_list()


def is_fusible(node: torch.fx.Node) -> bool:
    """In torch's min-cut partitioner's list of ops Inductor fuses (pointwise ops, reductions)."""
    return node.op == "call_function" and _op_types().is_fusible(node)


def activation_memory_budget(fraction: float):
    """A context in which torch's min-cut partitioner plans under its own memory-budget knob."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=fraction)


def without_joint_cse():
    """A context in which torch's min-cut partitioner does not CSE the joint graph first."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(cse=False)


def has_inductor_partitioner_hook() -> bool:
    import torch._inductor.config as inductor_config

    return hasattr(inductor_config, "custom_partitioner_fn")


def inductor_with_partitioner(partition: Callable[..., Any], uuid: str | None) -> Callable[..., Any] | None:
    """A torch.compile backend running Inductor with `partition` as its partitioner, after
    Inductor's own joint-graph passes (config.custom_partitioner_fn); None when this torch lacks
    the hook. `uuid` keys Inductor's FX graph cache: it must change with anything that changes
    the plan, or the cache serves a plan made for another policy; None turns the cache off."""
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "custom_partitioner_fn"):
        return None
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class Partitioner(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            kwargs.pop("compiler", None)
            return partition(gm, joint_inputs, **kwargs)

        def uuid(self) -> str | None:
            return uuid

        def __reduce__(self):  # the cache key pickles the config: the uuid stands for us
            return (str, (str(uuid),))

    def compile_with_partitioner(gm, example_inputs):
        with inductor_config.patch(custom_partitioner_fn=Partitioner()):
            return compile_fx(gm, example_inputs)

    return compile_with_partitioner


def inductor_schedule(gm: torch.fx.GraphModule, *, is_backward: bool, donated: tuple[int, ...] = ()) -> tuple[
        int, list[tuple[int, int | None, int]], dict[str, int | None]]:
    """How Inductor will run a partitioned graph and hold its memory, from its own lowering and
    scheduler (what it fuses, the order it picks) and its code generator's rules for buffers (what
    it writes in place, which freed buffer it hands to a later one); nothing is compiled.

    Returns (steps, storages, input_end): each storage the graph allocates as (step that allocates
    it, last step it lives through or None when the graph returns it, bytes): a buffer written into
    another's storage, or given a freed one, lengthens that one's life instead of allocating; and
    for each graph input read, the last step it lives through (a donated input whose storage a
    buffer takes over lives as long as that buffer; None when the graph returns it). Raises where
    this torch's Inductor cannot be asked; the caller falls back (Note [Inductor's own schedule]
    in passes/memory.py). `donated`: the backward's placeholders (by position) holding saved values
    it may reuse, as AOTAutograd computes them once the partition is made (functorch's
    donated_buffer). `gm` is lowered as it is: pass a copy."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._guards import detect_fake_mode
    from torch._inductor import memory as inductor_memory
    from torch._inductor.codegen.wrapper import buffer_reuse_key, can_match_buffer_size
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.scheduler import BaseSchedulerNode, Scheduler, SchedulerNode
    from torch._inductor.utils import get_dtype_size
    from torch._inductor.virtualized import V
    from torch.utils._ordered_set import OrderedSet
    from torch.utils._python_dispatch import _disable_current_modes

    inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake = detect_fake_mode(inputs)
    if fake is None:
        raise RuntimeError("the graph's inputs carry no fake tensors to lower it with")
    # Lower and schedule only: no autotuning benchmarks, no debug folders.
    quiet = {"trace.enabled": False, "max_autotune": False, "max_autotune_gemm": False, "benchmark_fusion": False}
    with _disable_current_modes(), inductor_config.patch(quiet), V.set_fake_mode(fake), DebugContext():
        graph = GraphLowering(gm, example_inputs=inputs, shape_env=fake.shape_env, is_backward=is_backward)
        if is_backward:  # read from the tracing context, which holds another graph's at partition time
            graph.bw_donated_idxs = list(donated) if functorch_config.donated_buffer else []
        with V.set_graph_handler(graph):
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
            donated_inputs = set(scheduler.name_to_donated_buffer)

            def nbytes(buf) -> int:
                sizevars = V.graph.sizevars
                hint = getattr(sizevars, "optimization_hint", None) or sizevars.size_hint  # renamed in torch 2.13
                size = hint(V.graph.get_allocation_storage_size(buf.node), fallback=0)
                return int(size) * get_dtype_size(buf.node.get_dtype())

            storages: list[list[int | None]] = []  # [first step, last step, bytes]
            owner: dict[str, int | str] = {}  # buffer -> its storage (an index, or a donated input's name)
            input_end: dict[str, int | None] = {}
            pool: dict[object, list[tuple[int, str]]] = {}  # freed buffers a later one of its size may take

            def end(name: str, step: int | None) -> None:
                """`name`'s storage lives through `step` at least (None: to the graph's end)."""
                where = owner.get(name, name)
                ends = storages[where] if isinstance(where, int) else None
                last = ends[1] if ends is not None else input_end.get(where, -1)
                last = None if step is None or last is None else max(last, step)
                if ends is not None:
                    ends[1] = last
                else:
                    input_end[where] = last

            # The code generator's order of events (Scheduler._codegen): on a CPU, consecutive
            # generated kernels run as one group called before the next extern kernel, so a group's
            # buffers are all allocated before it runs and what its kernels last read is freed
            # after it; elsewhere each kernel frees what it last read. Frees go in name order.
            pending: list[str] = []
            taken: set[str] = set()  # buffers whose storage a later one was written into
            group: int | None = None  # the step a CPU group of kernels starts at

            def release(at: int) -> None:
                nonlocal group
                for name in sorted(set(pending)):
                    if name in graph_outputs:
                        continue
                    end(name, at)
                    if name in taken:
                        continue  # a later buffer was written into its storage: not free
                    source = scheduler.name_to_buf.get(name) if name in owner else scheduler.name_to_donated_buffer.get(name)
                    if (source is not None and source.node is not None and source.node.should_allocate()
                            and name not in graph.removed_buffers):
                        pool.setdefault(buffer_reuse_key(source.node), []).append((at, name))
                pending.clear()
                group = None

            for step, node in enumerate(nodes):
                extern = node.is_extern()
                device = node.get_device()
                on_cpu = device is not None and device.type == "cpu"
                if extern and step > 0:
                    release(step - 1)
                if on_cpu and not extern and group is None:
                    group = step
                for buf in node.get_outputs():
                    name = buf.get_name()
                    if name in in_place:
                        owner[name] = owner.get(in_place[name], in_place[name])
                        taken.add(in_place[name])
                        continue
                    if not buf.mpi_buffer.size_alloc:
                        continue  # an alias, a mutation, or fused away: no storage of its own
                    key = buffer_reuse_key(buf.node) if buf.node.should_allocate() else None
                    freed = pool.get(key) if key is not None and inductor_config.allow_buffer_reuse else None
                    if freed:
                        free_step, old = freed.pop()
                        size = nbytes(buf)
                        if free_step + 1 == step or size + max(by_step[free_step + 1:step], default=0) <= overall:
                            for t in range(free_step + 1, step):
                                by_step[t] += size
                            owner[name] = owner.get(old, old)
                            continue
                        freed.append((free_step, old))
                    owner[name] = len(storages)
                    first = group if on_cpu and not extern else step
                    storages.append([first, step, int(buf.mpi_buffer.size_alloc)])
                pending.extend(node.last_usage)
                if extern or not on_cpu:
                    release(step)
            release(len(nodes) - 1)
            # A buffer read through an alias lives as long as Inductor's own timeline says.
            infos, _, _ = inductor_memory.compute_memory_timeline(nodes, {}, graph_outputs)
            for info in infos:
                if info.buffer.get_name() in owner:
                    end(info.buffer.get_name(), None if info.end_step == -1 else info.end_step)
            for name in graph_outputs:
                if name in owner or name in graph_inputs:
                    end(name, None)
            return len(nodes), [tuple(s) for s in storages], input_end


def _in_place(nodes, scheduler, graph, graph_outputs, BaseSchedulerNode, SchedulerNode, can_match_buffer_size) -> dict[str, str]:
    """What Inductor's code generator writes in place (Scheduler.decide_inplace_update, decided
    there as kernels are generated): a generated kernel's output into a buffer or a donated input
    it is the last reader of, read at the index it writes, of the same dtype and size. {output
    buffer: the buffer or input whose storage it takes}."""
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
                            and source.node is not None and can_match_buffer_size(source.node, out.node)):
                        in_place[name] = read.name
                        break
    return in_place


def inductor_random_as_eager(on: bool = True):
    """A context in which Inductor draws random numbers as eager does (its fallback_random), when
    `on`; else one that changes nothing."""
    import contextlib

    import torch._inductor.config as inductor_config

    return inductor_config.patch(fallback_random=True) if on else contextlib.nullcontext()


def no_fx_graph_cache():
    """A context in which Inductor compiles afresh instead of serving a graph from its FX graph
    cache (a cached graph makes no plan and times no compile)."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(fx_graph_cache=False)


def dynamo_recompile_limit(limit: int):
    """A context in which Dynamo compiles a function up to `limit` times before it gives up on it
    (config.recompile_limit; cache_size_limit before torch renamed it)."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    return dynamo_config.patch({name: max(limit, getattr(dynamo_config, name))})


def own_backend(name: str) -> Callable[..., Any]:
    """torch.compile's backend `name` ("inductor", "aot_eager") as a callable of its own: Dynamo
    serves a function's compiled graph to any later call under an equal backend, and two
    torch.compile(backend=name) are equal, whatever config they were compiled under."""
    from torch._dynamo import lookup_backend

    return functools.partial(lookup_backend(name))


def cache_hash(files: tuple[str, ...]) -> str:
    """Inductor's hash of the contents of `files` (hex), for a cache key that changes with them."""
    from torch._inductor.custom_graph_pass import get_hash_for_files

    return get_hash_for_files(files).hex()


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Tell Dynamo to trace dimension `dim` of `t` as a symbol, not a constant."""
    torch._dynamo.mark_dynamic(t, dim)


def per_block_checkpointing(model: torch.nn.Module, is_block: Callable[[torch.nn.Module], bool],
                            **checkpoint_kwargs: Any) -> torch.nn.Module:
    """torch.utils.checkpoint around every submodule `is_block` accepts, in place: torch's
    apply_activation_checkpointing (the FSDP recipe) with the non-reentrant wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    wrapper = functools.partial(checkpoint_wrapper, **checkpoint_kwargs)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=is_block)
    return model
