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
        int, list[tuple[str, int, int, int, int]], dict[str, int], dict[str, str]]:
    """How Inductor will run a partitioned graph, from its own lowering and scheduler (what it
    fuses, the order it picks, the buffers it writes in place), as plain data; nothing is compiled.
    Returns (steps, buffers, last_read, in_place): each buffer as (name, step it is allocated at,
    last step that reads it or -1 when the graph returns it, bytes allocated, bytes freed); for
    each graph input the last step that reads it; for each buffer a kernel writes into the storage
    of one it reads for the last time, that one's name (a buffer or a graph input). Raises where
    this torch's Inductor cannot be asked; the caller falls back (Note [Inductor's own schedule]
    in passes/memory.py). `donated`: the backward's placeholders (by position) holding saved
    values it may reuse, as AOTAutograd computes them once the partition is made
    (functorch's donated_buffer). `gm` is lowered as it is: pass a copy."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._guards import detect_fake_mode
    from torch._inductor import memory as inductor_memory
    from torch._inductor.codegen.wrapper import can_match_buffer_size
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.scheduler import BaseSchedulerNode, Scheduler, SchedulerNode
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
            # Sizes and successors of the final (fused, ordered) nodes, as Inductor's own
            # peak-memory pass computes them (it may be switched off).
            inductor_memory.prepare_planning_info(
                nodes, scheduler.name_to_buf, scheduler.name_to_fused_node, graph_inputs, graph_outputs)
            infos, _, _ = inductor_memory.compute_memory_timeline(nodes, {}, graph_outputs)
            buffers = [(b.buffer.get_name(), b.start_step, b.end_step, int(b.size_alloc), int(b.size_free)) for b in infos]
            step_of = {sub: step for step, node in enumerate(nodes) for sub in node.get_nodes()}
            last_read: dict[str, int] = {}
            for step, node in enumerate(nodes):
                for dep in node.read_writes.reads:
                    if dep.name in graph_inputs:
                        last_read[dep.name] = step
            # What the code generator writes in place (Scheduler.decide_inplace_update, decided
            # there as kernels are generated): a generated kernel's output into a buffer or a
            # donated input it is the last reader of, read at the index it writes, of the same
            # dtype and size.
            readable = {**scheduler.name_to_buf, **scheduler.name_to_donated_buffer}
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
                            later = [u for u in users
                                     if step_of.get(u.node, -1) >= step and u.node.get_name() not in sub.ancestors]
                            accesses = {d for u in users if step_of.get(u.node) == step
                                        for d in u.node.read_writes.reads_and_writes() if d.name == read.name}
                            if (len(later) == 1 and later[0].can_inplace and later[0].node is sub and len(accesses) <= 1
                                    and source.node is not None and can_match_buffer_size(source.node, out.node)):
                                in_place[name] = read.name
                                break
            return len(nodes), buffers, last_read, in_place


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
