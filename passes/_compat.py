"""Every private torch import of the project lives here, as thin shims (supported: torch 2.13 to
2.15, Note [Versions of torch]); Inductor's memory model, which reads Inductor's internals deeply, lives in
passes/inductor_memory.py. When torch moves one of these, these two files are the ones to change.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import pathlib
import time
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
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils.checkpoint import CheckpointPolicy

__all__ = [
    "autograd_cache_hits",
    "activation_memory_budget",
    "aot_autograd",
    "aot_module_simplified",
    "backward_lowering_config",
    "blocks_kept_apart",
    "boxed_nop",
    "cache_hash",
    "CHECKPOINT_REGION_KEY",
    "CheckpointPolicy",
    "CPU_OFFLOAD_PREFIX",
    "current_recompile_limit",
    "default_partition",
    "dropout_off",
    "dynamo_recompile_limit",
    "FakeCopyMode",
    "FakeTensor",
    "FakeTensorMode",
    "GPU_RELOAD_PREFIX",
    "has_inductor_partitioner_hook",
    "HigherOrderOperator",
    "inductor_cache_dir",
    "inductor_random_as_eager",
    "inductor_with_partitioner",
    "insert_offloads",
    "is_fusible",
    "is_impure_not_random",
    "is_primal",
    "is_tangent",
    "logging_calls_ignored",
    "memory_events",
    "offload_bandwidth",
    "op_schema",
    "op_short_name",
    "mark_dynamic",
    "min_cut_partition",
    "no_fx_graph_cache",
    "OFFLOAD_OPS",
    "OpOverload",
    "PARTITIONER_KNOWS_SDPA_WITHOUT_DROPOUT",
    "outside_fake_mode",
    "own_backend",
    "torch_offloading",
    "per_block_checkpointing",
    "pytree",
    "pytree_info",
    "RECOMPUTE_KEY",
    "saved_state_draws_nothing",
    "size_at",
    "size_hint",
    "symbols_of",
    "without_joint_cse",
]

# The meta key torch's partitioners read for per-node recompute decisions.
RECOMPUTE_KEY = "recompute"
# The meta key on nodes traced inside a torch.utils.checkpoint region (one id per region).
CHECKPOINT_REGION_KEY = "ac_graph_id"


# Note [Versions of torch]
# Supported: torch 2.13 to 2.15 (what CI runs: the 2.13 CPU wheel and 2.15). What differs
# between them is decided here, by testing for the feature, never by comparing version strings:
# - SDPA without dropout: torch 2.15's partitioners no longer count an SDPA op called with
#   dropout_p=0 as random (torch._functorch.partitioners.is_rng_op), so recomputing it no longer
#   saves the CPU generator's state (5 KB) beside it; 2.13's save it
#   (PARTITIONER_KNOWS_SDPA_WITHOUT_DROPOUT). Our own hard rules already treated such a call as
#   deterministic (dropout_off); the difference is only in what torch's partition adds, and that
#   state stands for no draw (saved_state_draws_nothing).


def _partitioner_knows_sdpa_without_dropout() -> bool:
    from torch._functorch import partitioners

    return hasattr(partitioners, "is_rng_op")


PARTITIONER_KNOWS_SDPA_WITHOUT_DROPOUT = _partitioner_knows_sdpa_without_dropout()
"""Whether torch's partitioners recompute an SDPA op called with dropout_p=0 without saving the
random generator's state (Note [Versions of torch])."""


def dropout_off(target: OpOverload, args: tuple, kwargs: dict) -> bool:
    """True for an op tagged random only for its dropout (attention), called with dropout_p=0:
    it is deterministic then, and may be recomputed."""
    for position, argument in enumerate(op_schema(target).arguments):
        if argument.name == "dropout_p":
            value = args[position] if position < len(args) else kwargs.get("dropout_p", argument.default_value)
            return isinstance(value, (int, float)) and value == 0
    return False


def saved_state_draws_nothing(node: torch.fx.Node) -> bool:
    """True for the generator state torch 2.13's partitioners save around an attention op called
    with dropout_p=0 (an element of run_and_save_rng_state's result): its bytes are kept, but no
    random number is drawn with it (Note [Versions of torch])."""
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    target = node.target
    if not (isinstance(target, HigherOrderOperator) and target.name() == "run_and_save_rng_state"):
        return False
    op = node.args[0] if node.args else None
    return isinstance(op, OpOverload) and dropout_off(op, tuple(node.args[1:]), dict(node.kwargs))


def op_schema(op: OpOverload) -> torch.FunctionSchema:
    """An aten op's schema (its arguments, returns, whether it mutates)."""
    return op._schema


def op_short_name(op: OpOverload) -> str:
    """An op's name without namespace and overload: "native_layer_norm"."""
    return op._opname


def pytree_info(gm: torch.fx.GraphModule) -> Any:
    """How a graph module (one from torch.export) flattens its inputs and unflattens its outputs
    (in_spec, out_spec), or None for a graph that takes and returns plain values."""
    return getattr(gm.graph._codegen, "pytree_info", None)


def memory_events(prof: Any) -> list[int]:
    """The sizes of a finished CPU profile's memory events ([memory]: + allocated, - freed), in
    the order they happened."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    return [e.nbytes() for e in events]


def outside_fake_mode():
    """A context in which tensors are real even while AOTAutograd traces or partitions with fake
    tensors (its fake mode is active when it calls a partitioner): for timing ops, or sending
    real values to other ranks."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


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
    try:
        return int(optimization_hint(value, fallback=fallback))
    except Exception:  # noqa: BLE001 - an unbacked or odd symbol: use the fallback
        return fallback


def symbols_of(value: int | torch.SymInt) -> dict[str, int]:
    """{symbol name: hint} of the symbols in a possibly symbolic size ({} for an int)."""
    node = getattr(value, "node", None)
    expr, env = getattr(node, "expr", None), getattr(node, "shape_env", None)
    if expr is None or env is None:
        return {}
    values = env.backed_var_to_val
    return {sym.name: int(values[sym]) for sym in expr.free_symbols if sym in values}


def size_at(value: int | torch.SymInt, sizes: dict[str, int]) -> int:
    """A possibly symbolic size with some symbols set (`sizes`, by name) and the rest at their hints."""
    if isinstance(value, int) or not sizes:
        return size_hint(value)
    node = getattr(value, "node", None)
    expr = getattr(node, "expr", None)
    if expr is None:
        return size_hint(value)
    hints = symbols_of(value)
    values = tuple(sorted((sym.name, sizes.get(sym.name, hints.get(sym.name))) for sym in expr.free_symbols))
    try:
        return _substituted(expr, values)
    except (TypeError, ValueError):  # a symbol without a hint: the size's own hint
        return size_hint(value)


@functools.lru_cache(maxsize=4096)
def _substituted(expr: Any, values: tuple[tuple[str, int | None], ...]) -> int:
    """`expr` with its symbols set (by name): sympy's substitution is slow, and a graph's sizes
    are a few expressions met many times (Plan.at walks every tensor of a graph)."""
    named = dict(values)
    return int(expr.subs({sym: named[sym.name] for sym in expr.free_symbols}))


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


def torch_budget() -> float:
    """torch's min-cut memory-budget knob as it is set now (1.0: off)."""
    import torch._functorch.config as functorch_config

    return float(getattr(functorch_config, "activation_memory_budget", 1.0))


def without_joint_cse():
    """A context in which torch's min-cut partitioner does not CSE the joint graph first."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(cse=False)


def has_inductor_partitioner_hook() -> bool:
    import torch._inductor.config as inductor_config

    return hasattr(inductor_config, "custom_partitioner_fn")


def inductor_with_partitioner(partition: Callable[..., Any], uuid: str | None, *, kernels: bool = True,
                              on_backward: Callable[[float], None] | None = None,
                              block_of: Callable[[torch.fx.Node], object | None] | None = None,
                              whole: Callable[[torch.fx.Node], bool] = lambda node: False) -> Callable[..., Any] | None:
    """A torch.compile backend running Inductor with `partition` as its partitioner, after
    Inductor's own joint-graph passes (config.custom_partitioner_fn); None when this torch lacks
    the hook. `uuid` keys Inductor's FX graph cache: it must change with anything that changes
    the plan, or the cache serves a plan made for another policy; None turns the cache off.
    `kernels=False`: the partitioned graphs run as Python, op by op, instead of as Inductor's
    generated kernels: the plan Inductor would get, without its code generation (no caching).
    `on_backward(seconds)`: called once the backward's kernels are generated (AOTAutograd compiles
    the backward at its first run). `block_of`, `whole`: the backward is lowered with blocks_kept_apart."""
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "custom_partitioner_fn"):
        return None
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class Partitioner(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            kwargs.pop("compiler", None)
            return partition(gm, joint_inputs, **kwargs)

        def uuid(self) -> str | None:
            return uuid

        def __reduce__(self):  # the cache key pickles the config: the uuid stands for us
            return (str, (str(uuid),))

    def lower(gm, example_inputs, *args, **kwargs):
        backward = backward_lowering_config() if kwargs.get("is_backward") else {}
        started = time.perf_counter()
        apart = (blocks_kept_apart(block_of, gm, whole) if kwargs.get("is_backward") and block_of
                 else contextlib.nullcontext())
        # The backward compiles at its first run, outside compile_with_partitioner's patch: the
        # partitioner goes into its cache key too, so the key changes with our lowering (the
        # fusion rule of blocks_kept_apart is no setting Inductor's cache sees).
        with inductor_config.patch({**backward, "custom_partitioner_fn": Partitioner()}), apart:
            compiled = compile_fx_inner(gm, example_inputs, *args, **kwargs)
        if kwargs.get("is_backward") and on_backward is not None:
            on_backward(time.perf_counter() - started)
        return compiled

    def compile_with_partitioner(gm, example_inputs):
        with inductor_config.patch(custom_partitioner_fn=Partitioner()):
            return compile_fx(gm, example_inputs, inner_compile=lower)

    def plan_without_kernels(gm, example_inputs):
        import torch._functorch.config as functorch_config
        from torch._functorch.aot_autograd import make_boxed_func

        def run_as_python(graph, inputs, **kwargs):
            return make_boxed_func(graph.forward)

        with inductor_config.patch(custom_partitioner_fn=Partitioner(), fx_graph_cache=False), \
                functorch_config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=run_as_python)

    return compile_with_partitioner if kernels else plan_without_kernels


# Note [The layout of a backward that recomputes convolutions]
# Inductor decides layout optimization (channels-last buffers around convolutions) per graph,
# from the graph's own `aten.convolution` nodes (GraphLowering.decide_layout_opt). Inductor alone
# never recomputes a convolution (min-cut recomputes fusible ops only), so its backward holds
# convolution backwards but no convolution and is lowered without layout optimization. A backward
# that recomputes convolutions would be lowered with it, and on a CPU a depthwise convolution's
# backward on channels-last buffers takes oneDNN's path, which allocates scratch of the size of
# its unfolded input: checkpointing then raised a ConvNeXt step's peak above the step without it
# (the README's Known limits). So every backward is lowered as Inductor alone lowers its own:
# without layout optimization (a backward with no convolution is lowered as before), unless the
# user forces layout optimization. The memory pass lowers backwards with the same settings.


def blocks_kept_apart(block_of: Callable[[torch.fx.Node], object | None], gm: torch.fx.GraphModule,
                      whole: Callable[[torch.fx.Node], bool] = lambda node: False):
    """A context in which Inductor's scheduler, lowering the backward `gm`, fuses no two independent
    nodes (a horizontal fusion) made from different blocks, by `block_of` of the FX nodes they came
    from (None: no recomputation), and none where either holds a node `whole` says belongs to a
    unit recomputed whole, unless the backward convolves (Note [A backward's blocks kept apart] in
    passes/inductor_memory.py)."""
    convolves = any(n.target is torch.ops.aten.convolution.default for n in gm.graph.nodes)
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    def blocks(node) -> tuple[set, bool]:
        found, whole_unit = set(), False
        for member in node.get_nodes():
            ir = getattr(member, "node", None)
            for origin in (ir.get_origins() if ir is not None else ()):
                block = block_of(origin)
                if block is not None:
                    found.add(block)
                    whole_unit = whole_unit or whole(origin)
        return found, whole_unit

    class Apart(InductorChoices):
        def can_fuse_horizontal(self, scheduler, node1, node2, shared_data_score):  # noqa: D102
            if not InductorChoices.can_fuse_horizontal(scheduler, node1, node2, shared_data_score):
                return False
            (first, first_whole), (second, second_whole) = blocks(node1), blocks(node2)
            if (first_whole or second_whole) and not convolves:
                return False
            return not (first and second and first.isdisjoint(second))

    return V.set_choices_handler(Apart())


def backward_lowering_config() -> dict[str, Any]:
    """Inductor's settings for lowering a backward graph of ours (Note [The layout of a backward
    that recomputes convolutions]), for its compile and for the memory pass's schedule alike."""
    import torch._inductor.config as inductor_config

    if getattr(inductor_config, "force_layout_optimization", False):
        return {}
    return {"layout_optimization": False}


# torch's names for the copies its offload pass inserts (it identifies them by these prefixes).
CPU_OFFLOAD_PREFIX = "cpu_offload_"
GPU_RELOAD_PREFIX = "gpu_reload_"


def _offload_ops() -> dict[str, Any]:
    import torch._functorch._activation_offloading.offload_ops  # noqa: F401 - registers the ao ops

    return {"offload": torch.ops.ao.offload.default, "reload": torch.ops.ao.reload.default,
            "wait": torch.ops.ao.wait_tensor.default}


OFFLOAD_OPS = _offload_ops()
"""torch's asynchronous copy ops (ao.offload, ao.reload, ao.wait_tensor), by role."""


def insert_offloads(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, *, num_fwd_outputs: int,
                    static_inputs: list[torch.fx.Node], streams: bool) -> None:
    """torch's offload pass on partitioned graphs: each forward output marked should_offload is
    copied to host memory after its last forward use and back before its first backward use;
    `streams`: asynchronous copies on a transfer stream (ao ops; a GPU), else synchronous
    device_put. Waits are left where torch puts them (no sink, no prefetch)."""
    import torch._functorch.config as functorch_config
    from torch._functorch._activation_offloading.activation_offloading import enable_activation_offloading
    from torch.utils._ordered_set import OrderedSet

    with functorch_config.patch(activation_offload_separate_stream=streams, activation_offload_sink_wait=False,
                                activation_reload_prefetch=False):
        enable_activation_offloading(fw, bw, num_fwd_outputs, OrderedSet(static_inputs))


def offload_bandwidth() -> float:
    """Bytes per second torch assumes a copy between host and device moves
    (torch._functorch.config.activation_offload_cpu_gpu_bw, in GiB/s)."""
    import torch._functorch.config as functorch_config

    return float(functorch_config.activation_offload_cpu_gpu_bw) * 2**30


def torch_offloading(tag: Callable[[torch.fx.Node], bool], *, streams: bool):
    """A context in which Inductor, planning alone, offloads the joint graph's forward nodes `tag`
    picks (node.meta["should_offload"], set by a joint-graph pass before its min-cut partition),
    with torch's offload pass and its own waits and prefetch: how a user tags values by hand.
    `streams`: asynchronous copies on a transfer stream (a GPU)."""
    import contextlib

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Tag(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            for node in graph.nodes:
                if node.op == "call_function" and tag(node):
                    node.meta["should_offload"] = True

        def uuid(self) -> bytes:
            return b"ckpt_fx.torch_offloading"

    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch(joint_custom_post_pass=Tag()))
    stack.enter_context(functorch_config.patch(
        enable_activation_offloading=True, activation_offload_separate_stream=streams,
        activation_offload_sink_wait=streams, activation_reload_prefetch=streams))
    return stack


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


def logging_calls_ignored(functions: tuple[Callable[..., Any], ...]):
    """A context in which Dynamo traces a call of any of `functions` (logging methods) as a call
    that does nothing, instead of breaking the graph there; the calls then print nothing while
    compiled code runs."""
    import contextlib

    import torch._dynamo.config as dynamo_config

    # The setting by its name, or by its older one (`ignore_logger_methods`) where only that exists.
    name = next((n for n in ("ignore_logging_functions", "ignore_logger_methods") if hasattr(dynamo_config, n)), None)
    if name is None or not functions:
        return contextlib.nullcontext()
    return dynamo_config.patch(**{name: set(getattr(dynamo_config, name)) | set(functions)})


def current_recompile_limit() -> int:
    """How many times Dynamo compiles a function before it runs it uncompiled."""
    import torch._dynamo.config as dynamo_config

    return dynamo_config.recompile_limit


def dynamo_recompile_limit(limit: int):
    """A context in which Dynamo compiles a function up to `limit` times before it gives up on it."""
    import torch._dynamo.config as dynamo_config

    return dynamo_config.patch(recompile_limit=max(limit, dynamo_config.recompile_limit))


def compiling_frame() -> tuple[int, int] | None:
    """The function Dynamo is compiling now, as (frame, compile): a recompile of the same function
    keeps its frame number and counts up its compile; None outside Dynamo."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    if compile_id is None or compile_id.frame_id is None:
        return None
    return compile_id.frame_id, compile_id.frame_compile_id or 0


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


def autograd_cache_hits() -> int:
    """How many graphs AOTAutograd's on-disk cache has served in this process (no partition ran
    for them)."""
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["autograd_cache_hit"]


def inductor_cache_dir() -> pathlib.Path:
    """Inductor's on-disk cache folder (TORCHINDUCTOR_CACHE_DIR, else its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return pathlib.Path(cache_dir())


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


def propagate_fake_values(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
    """Record each node's value as fake tensors (node.meta["val"]) by running gm on fakes of
    `example_inputs`: the traced shapes a torch.fx.symbolic_trace graph lacks, with requires_grad
    as autograd would set it. The module's own parameters and buffers are read, never written
    (their updates land on fake copies)."""

    class Recording(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            value = super().run_node(n)
            n.meta["val"] = value
            return value

    class Running(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gm = gm

        def forward(self, *args: Any) -> Any:
            return Recording(self.gm).run(*args)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    # The parameters and buffers swapped for fakes while it runs: a buffer's in-place update
    # (BatchNorm's batch count) must not reach the real one.
    state = {f"gm.{name}": mode.from_tensor(t) for name, t in
             [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]}
    with mode:
        torch.func.functional_call(Running(), state, tuple(fakes))
