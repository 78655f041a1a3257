"""The torch.compile backend: options, the partition hook, the inner compiler, the fallback."""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import pickle
import sys
import time
from dataclasses import dataclass, field, replace
from collections.abc import Callable
from typing import Any

import torch

from ckpt_fx import policies
from passes import Plan
from passes import pipeline
from passes._compat import (
    RECOMPUTE_KEY,
    aot_autograd,
    autograd_cache_hits,
    boxed_nop,
    cache_hash,
    compiling_frame,
    has_inductor_partitioner_hook,
    inductor_cache_dir,
    inductor_with_partitioner,
)
from passes.costs import graph_device
from passes.graphs import copy_graph_module
from passes.head import HeadReport, head_pass
from passes.offload import OFFLOAD_KEY
from passes.debug import debug_checks_pass
from passes.policy import BudgetSpec, NamedPolicy, matches_path, uses_blocks
from passes.regions import PATH_KEY, recomputed_block, recomputed_whole
from passes.sizes import format_size
from passes.select import REASON_KEY
from passes.steps import on_a_fresh_stack, without_full_collections
from passes.targets import INDUCTOR, TARGETS, Target
from passes.warn import warn_user

log = logging.getLogger("ckpt_fx")

COMPILERS = tuple(TARGETS)
# Inductor where this torch has its custom partitioner hook: measured on GPT-2 (README), its peak
# under each policy is at or below the eager inner compiler's and its steps are faster.
DEFAULT_COMPILER = "inductor" if has_inductor_partitioner_hook() else "eager"
OPTION_KEYS = ("policy", "compiler", "strict", "debug", "debug_dir", "head", "logits", "progress")
HEADS = ("chunked", "whole")
LOGITS = ("keep", "drop")


@dataclass(frozen=True, kw_only=True)
class Options:
    """What backend="ckpt" does; validated at construction, before any tracing."""

    policy: policies.Policy = field(default_factory=policies.blocks)
    """What to save and what to recompute (see ckpt_fx.policies)."""
    compiler: str = DEFAULT_COMPILER
    """Inner compiler for the partitioned graphs: "inductor" (Inductor's joint-graph passes, then
    our partition, then Inductor's kernels; the default) or "eager" (FX graphs run as Python:
    compiles in seconds, and the only one the debug checks run with)."""
    strict: bool = False
    """Raise instead of falling back to what the inner compiler does without us (Inductor's own
    partition, or AOTAutograd's default) when a pass fails."""
    debug: bool | str = False
    """True: check recomputed tensors' shapes, dtypes, strides and dump each pass's graphs;
    "values": check their values too (keeps the originals: debugging memory)."""
    debug_dir: str = "ckpt_fx_debug"
    """Folder for the debug dumps (one sub-folder per compiled graph)."""
    head: str = "chunked"
    """"chunked": a language model's loss head (vocabulary projection and cross-entropy) runs in
    chunks of tokens, so no tokens x vocabulary tensor is kept (Note [The loss head in chunks] in
    passes/head.py); "whole": as the model wrote it."""
    logits: str = "keep"
    """"keep": the graph returns the logits the model returns; "drop": a chunked head's logits are
    returned as None and never built whole (Note [Logits in training calls] in ckpt_fx/in_place.py)."""
    progress: bool = True
    """One line as each training graph is traced, planned and compiled, and one with its time and
    plan when done (Note [The first step's lines]); False: those lines at debug level only."""

    def __post_init__(self) -> None:
        if not callable(self.policy):
            raise ValueError(f"policy must be callable, got {self.policy!r}")
        if self.compiler not in COMPILERS:
            raise ValueError(f"unknown compiler {self.compiler!r}; valid: {', '.join(map(repr, COMPILERS))}")
        if self.compiler == "inductor" and not has_inductor_partitioner_hook():
            raise ValueError(
                f"compiler='inductor' needs torch._inductor.config.custom_partitioner_fn, which torch "
                f"{torch.__version__} lacks; use compiler='eager'"
            )
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict must be True or False, got {self.strict!r}")
        if self.debug not in (False, True, "values"):
            raise ValueError(f"debug must be False, True or 'values', got {self.debug!r}")
        if self.debug and self.compiler == "inductor":
            raise ValueError("debug checks run Python in the graphs: use them with compiler='eager', not 'inductor'")
        if self.head not in HEADS:
            raise ValueError(f"head must be one of {', '.join(map(repr, HEADS))}, got {self.head!r}")
        if self.logits not in LOGITS:
            raise ValueError(f"logits must be one of {', '.join(map(repr, LOGITS))}, got {self.logits!r}")
        if not isinstance(self.progress, bool):
            raise ValueError(f"progress must be True or False, got {self.progress!r}")
        if not isinstance(self.debug_dir, str) or not self.debug_dir:
            raise ValueError(f"debug_dir must be a non-empty path, got {self.debug_dir!r}")

    @property
    def target(self) -> Target:
        """The inner compiler as the passes take it (passes.targets)."""
        return TARGETS[self.compiler]

    @staticmethod
    def settings_from_env() -> dict[str, Any]:
        """debug settings from CKPT_FX_DEBUG (1 or values) and CKPT_FX_DEBUG_DIR, and the default
        compiler from CKPT_FX_COMPILER, read when asked."""
        flag = os.environ.get("CKPT_FX_DEBUG", "").strip().lower()
        out: dict[str, Any] = {}
        if flag in ("1", "true", "yes"):
            out["debug"] = True
        elif flag == "values":
            out["debug"] = "values"
        elif flag not in ("", "0", "false", "no"):
            raise ValueError(f"CKPT_FX_DEBUG must be 1, values or 0, got {flag!r}")
        if os.environ.get("CKPT_FX_DEBUG_DIR"):
            out["debug_dir"] = os.environ["CKPT_FX_DEBUG_DIR"]
        compiler = os.environ.get("CKPT_FX_COMPILER", "").strip()
        if compiler:
            out["compiler"] = compiler
        return out

    @staticmethod
    def merged(given: dict[str, Any]) -> dict[str, Any]:
        """The environment's settings overridden by `given`; with debugging on and no compiler
        named anywhere, the eager one (the debug checks run Python in the graphs)."""
        settings = {**Options.settings_from_env(), **given}
        if settings.get("debug") and "compiler" not in settings:
            settings["compiler"] = "eager"
        return settings

    @staticmethod
    def from_mapping(options: dict[str, Any] | None) -> Options:
        """Options from torch.compile(..., options={...}); unknown keys raise ValueError."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTION_KEYS))
        if unknown:
            raise ValueError(f"unknown ckpt option(s) {unknown}; valid: {', '.join(OPTION_KEYS)}")
        if "policy" in options:
            options["policy"] = policies.parse(options["policy"])
        return Options(**Options.merged(options))


@dataclass(frozen=True, kw_only=True)
class Partitioned:
    """One graph the backend partitioned, as its observers see it (CkptBackend.on_partitioned)."""

    joint: torch.fx.GraphModule
    """The joint graph, its nodes' meta holding the passes' decisions (module paths, regions, the
    recompute tags and why)."""
    joint_inputs: Any
    kwargs: dict[str, Any]
    """AOTAutograd's keyword arguments to the partitioner (num_fwd_outputs, ...)."""
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    """The graphs returned to AOTAutograd; an observer may change them in place."""
    plan: Plan | None
    """None when the graph fell back to the default partition."""


class CkptBackend:
    """A torch.compile backend; keeps the Plan of every graph it compiled in `plans`.

    Observers: each callable in `on_joint` is called with (joint, joint_inputs, kwargs) as
    AOTAutograd hands a joint graph over, before any pass changes it (to copy it, say); each in
    `on_partitioned` with a Partitioned record once it is planned, before the graphs go back."""

    def __init__(self, options: Options, *, device: str | None = None, kernels: bool = True, count_runs: bool = False):
        """`device`: the device type the plans are for when the graphs are traced on another
        (fit traces on CPU fake tensors for a GPU); by default the graphs' own. `kernels=False`
        (Inductor only): plan as Inductor would, run the graphs as Python, no kernels generated
        (explain's plans, without code generation). `count_runs`: record in `runs` the plan of each graph as it
        runs (a graph run once per block after a graph break in the loop over blocks)."""
        self.options = options
        self.device = device
        self.kernels = kernels
        self.runs: list[int] = []
        """With count_runs: the index in `plans` of each graph's forward run, in order."""
        self.graph_runs = 0
        """How many times a graph this backend compiled has run (forwards; enable reads it to tell a
        training call that ran uncompiled, Note [A training call without its plan] in
        ckpt_fx/in_place.py)."""
        self._count_runs = count_runs
        self.plans: list[Plan] = []
        self.superseded: list[Plan] = []
        """Plans a later graph of the same function replaced in `plans` (Note [A recompile's plan])."""
        self._by_function: dict[int, _FunctionPlan] = {}
        self.checkpointed_by_model: tuple[str, ...] = ()
        """Units the model's own checkpointing would cover in the graphs compiled next, where
        ckpt_fx.enable switched it off for them (Note [The model's own checkpointing under enable]
        in ckpt_fx/in_place.py); each plan reports those of its graph."""
        self.on_joint: list[Callable[[torch.fx.GraphModule, Any, dict[str, Any]], None]] = []
        self.on_partitioned: list[Callable[[Partitioned], None]] = []
        self._graphs = 0
        self._compiles = 0
        self._planning_s = 0.0
        self._warned: set[str] = set()
        self.head_report = HeadReport()
        """What head_pass did to the graph being compiled: its plan records it."""

    @property
    def target(self) -> Target:
        """The inner compiler the plans are made for (passes.targets)."""
        return self.options.target

    def __repr__(self) -> str:
        return f"ckpt_fx.backend(policy={policies.policy_name(self.options.policy)}, compiler={self.options.compiler!r})"

    def partition(self, joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        """AOTAutograd's partition_fn: our pipeline; where it fails, what the inner compiler does
        without us (Inductor's min-cut, or AOTAutograd's default partition), on the joint graph as
        it was handed over, with one warning."""
        for observe in self.on_joint:
            observe(joint, joint_inputs, kwargs)
        handed_over = None if self.options.strict else copy_graph_module(joint)  # the passes rewrite joint
        name = policies.policy_name(self.options.policy)
        self._graphs += 1
        debug = self.options.debug
        folder = pathlib.Path(self.options.debug_dir) / f"graph_{self._graphs:03d}" if debug else None
        started = time.perf_counter()
        try:
            with without_full_collections():  # Note [Collections while planning] in passes/steps.py
                fw, bw, plan = pipeline.run(
                    joint,
                    joint_inputs,
                    policy=self.options.policy,
                    policy_name=name,
                    num_fwd_outputs=kwargs["num_fwd_outputs"],
                    static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
                    target=self.target,
                    strict=self.options.strict,
                    dump=_dumper(folder) if folder is not None else None,
                    device=self.device,
                )
            if debug:
                fw, bw = debug_checks_pass(fw, bw, recomputed=set(plan.recomputed), values=debug == "values")
                log.info("ckpt_fx debug: graphs of each pass in %s", folder)
        except Exception as error:
            if self.options.strict:
                raise
            warn_user(f"ckpt_fx: falling back to {self.target.own_partition} (no checkpointing) for this graph: {error}")
            fw, bw = self.target.partition(
                handed_over,
                joint_inputs,
                num_fwd_outputs=kwargs["num_fwd_outputs"],
                static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
            )
            plan = None
        self._planning_s += time.perf_counter() - started
        if plan is not None:
            if self.checkpointed_by_model and not plan.checkpointed_by_model:
                # The graph's units inside a module the model checkpointed (a Swin stage holds blocks).
                inside = lambda path: any(path == u or path.startswith(u + ".") for u in self.checkpointed_by_model)  # noqa: E731
                plan = replace(plan, facts=replace(plan.facts, checkpointed_by_model=tuple(
                    unit.name for unit in plan.units if inside(unit.path))))
            plan = replace(plan, heads=tuple(self.head_report.heads), head_reasons=tuple(self.head_report.reasons))
            self.plans.append(plan)
            self._warn_if_unmatched(plan, name)
            self._warn_if_outputs_held(plan)
            self._warn_about_offload(plan, joint, fw, name, num_fwd_outputs=kwargs["num_fwd_outputs"])
            self._warn_if_less_than_the_model_had(plan, name)
            log.info(
                "ckpt_fx: %s: saved %.1f MB, offloaded %.1f MB, recompute %d ops (%.2f GFLOP), predicted peak %.1f MB",
                name,
                plan.saved_bytes / 2**20,
                plan.offloaded_bytes / 2**20,
                len(plan.recomputed),
                plan.recompute_flops / 1e9,
                plan.peak_bytes / 2**20,
            )
        if self.on_partitioned:
            record = Partitioned(joint=joint, joint_inputs=joint_inputs, kwargs=kwargs, forward=fw, backward=bw, plan=plan)
            for observe in self.on_partitioned:
                observe(record)
        return fw, bw

    def _warn_if_outputs_held(self, plan: Plan) -> None:
        """Warn once when the graph returns values from inside several checkpointed units (a KV
        cache): they are kept from the forward to the backward whatever the policy."""
        paths = sorted({path for path, _ in plan.held_outputs})
        if len(paths) < 2:  # one unit: a graph split inside a block hands its value on, not a cache
            return
        total = sum(nbytes for _, nbytes in plan.held_outputs)
        shown = ", ".join(paths[:3] + (["..."] if len(paths) > 3 else []))
        self.warn_once(
            f"ckpt_fx: the model returns {len(plan.held_outputs)} tensors computed inside checkpointed blocks "
            f"({format_size(total, digits=1)}; {shown}): they stay alive from the forward to the backward whatever the "
            "policy. For a Hugging Face model this is its KV cache: call it with use_cache=False (or set "
            "model.config.use_cache = False) when training, as its own gradient checkpointing does"
        )

    def _warn_about_offload(self, plan: Plan, joint: torch.fx.GraphModule, fw: torch.fx.GraphModule, name: str, *,
                            num_fwd_outputs: int) -> None:
        """Warn once when values were kept in host memory on a CPU (nowhere to go: it saves
        nothing), and when the policy asked to offload saved values torch's offload pass cannot
        move (views, tuple elements, non-contiguous values, the graph's outputs: they stay on the
        device)."""
        stayed = [n.meta.get(PATH_KEY) or n.name for n in fw.graph.output_node().args[0][num_fwd_outputs:]
                  if isinstance(n, torch.fx.Node) and n.meta.get(OFFLOAD_KEY)]
        if plan.offloaded and (self.device or graph_device(joint)) == "cpu":
            self.warn_once(
                f"ckpt_fx: {name} keeps {len(plan.offloaded)} saved values ({format_size(plan.offloaded_bytes)}) in host "
                "memory, but this graph runs on the CPU: there is no device memory to free, so offloading saves nothing "
                "here (the plan runs as planned and its gradients are exact; on a GPU it lowers the device's peak)")
        if stayed:
            self.warn_once(
                f"ckpt_fx: {name} asked to offload {len(stayed) + len(plan.offloaded)} saved values of this graph; "
                f"{len(stayed)} stay on the device, as torch's offload pass moves only values an op made that are "
                "contiguous, not views or a tuple's elements, and not returned by the graph (in "
                f"{', '.join(sorted(set(stayed))[:3])}{' ...' if len(set(stayed)) > 3 else ''})")

    def _warn_if_less_than_the_model_had(self, plan: Plan, name: str) -> None:
        """Warn once when the model checkpointed units itself (Hugging Face's switch; TRL turns it
        on) and this plan, which replaces that, recomputes fewer of them."""
        recomputed = {b.path for b in plan.blocks if b.recomputed_ops}
        left = [u for u in plan.checkpointed_by_model if u not in recomputed]
        if left:
            shown = ", ".join(left[:4]) + (" ..." if len(left) > 4 else "")
            self.warn_once(
                f"ckpt_fx: the model checkpoints {len(plan.checkpointed_by_model)} units itself (torch.utils.checkpoint, "
                f"e.g. Hugging Face's gradient checkpointing, which TRL turns on); {name} replaces that and recomputes "
                f"{len(plan.checkpointed_by_model) - len(left)} of them, keeping more for the backward than the model's "
                f"own plan would ({shown} not recomputed); policy 'blocks:every=1,skip_first=0' recomputes each of them")
        masks = sum(s.nbytes for s in plan.saved if s.kind == "dropout mask" and s.block in plan.checkpointed_by_model)
        if plan.checkpointed_by_model and masks:
            self.warn_once(
                f"ckpt_fx: the model checkpoints {len(plan.checkpointed_by_model)} units itself (torch.utils.checkpoint, "
                f"e.g. Hugging Face's gradient checkpointing); {name} replaces that and keeps their dropout masks "
                f"({format_size(masks)}, one byte per element), where torch.utils.checkpoint draws them again from a "
                "saved generator state: here only a CPU dropout whose mask outweighs that state (5 KB) is drawn again, "
                "and Inductor's own random numbers are not. Both give the same gradients; "
                "to keep no masks, train with dropout 0 (e.g. attention_dropout, hidden_dropout in the config)")

    def _warn_if_unmatched(self, plan: Plan, name: str) -> None:
        """Warn once when a policy matched nothing in a graph that has blocks, or when an only_in
        pattern names no module of it, listing the module paths that do exist."""
        if not plan.blocks:
            # A graph without blocks after one with them (a loss after a graph break) proves
            # nothing; the first graphs without any say that the policy has nothing to act on.
            if uses_blocks(self.options.policy) and not any(p.blocks for p in self.plans) and plan.saved:
                self.warn_once(
                    f"ckpt_fx: policy {name} found no blocks in this graph (no stack of repeated modules: children "
                    "named 0, 1, ... of one class, as in a ModuleList or Sequential; no submodules to use instead), "
                    "so it recomputes nothing here. Policy 'graph' or a budget ('budget:0.5') plans op by op "
                    "without blocks; only_in('name.*', policy) names the modules to checkpoint")
            return
        paths = plan.module_paths
        policy = self.options.policy
        for pattern in policy.patterns if isinstance(policy, NamedPolicy) else ():
            if not any(matches_path(p, (pattern,)) for p in paths):
                units = [b.path for b in plan.blocks]
                shown = ", ".join(units[:6] + (["..."] if len(units) > 6 else []))
                self.warn_once(f"ckpt_fx: only_in pattern {pattern!r} matches no module of this graph; "
                                f"its units are {shown} (module paths like {paths[0]!r} ... {paths[-1]!r})")
        if not plan.recomputed and uses_blocks(policy):
            self.warn_once(f"ckpt_fx: policy {name} recomputes nothing in a graph with blocks "
                            f"{', '.join(b.path for b in plan.blocks[:6])}{' ...' if len(plan.blocks) > 6 else ''}")

    def warn_once(self, message: str) -> None:
        """warn_user(message), unless this backend said it before."""
        if message not in self._warned:
            self._warned.add(message)
            warn_user(message)

    def cache_key(self) -> str | None:
        """What Inductor's FX graph cache keys our partition on: the policy, the options that change
        the plan, and the source of the passes; None (no caching) for a policy without a spec string
        (a custom callable's name does not identify what it decides)."""
        policy = self.options.policy
        if not isinstance(policy, (NamedPolicy, BudgetSpec)):
            return None
        spec = policy.spec
        root = pathlib.Path(__file__).resolve().parents[1]
        files = sorted((root / "passes").glob("*.py")) + [root / "ckpt_fx" / "policies.py"]
        return f"ckpt_fx:{spec}:strict={self.options.strict}:{cache_hash(tuple(map(str, files)))}"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]):
        planned = len(self.plans)
        training = torch.is_grad_enabled()
        # Note [The loss head in chunks] in passes/head.py: only where gradients are recorded (an
        # inference graph keeps nothing for a backward).
        self.head_report = HeadReport()
        if self.options.head == "chunked" and training:
            self.head_report = head_pass(gm, keep_logits=self.options.logits == "keep")
        self._compiles += 1
        number, inner = self._compiles, "Inductor" if self.target is INDUCTOR else "the eager inner compiler"
        if self.target is INDUCTOR:
            compile_fn = inductor_with_partitioner(
                self.partition, self.cache_key(), kernels=self.kernels,
                on_backward=lambda seconds: self._say("ckpt_fx: graph %d: its backward compiled in %.1f s, at its first "
                                                      "run", number, seconds),
                block_of=recomputed_block, whole=recomputed_whole)
        else:
            compile_fn = aot_autograd(
                fw_compiler=boxed_nop,
                bw_compiler=boxed_nop,
                partition_fn=self.partition,
                keep_inference_input_mutations=True,
            )
        if training:
            ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
            self._say("ckpt_fx: graph %d: %d ops traced; planning (%s) and compiling with %s ...", number, ops,
                      policies.policy_name(self.options.policy), inner)
        frame, inputs = compiling_frame(), _tensor_inputs(gm)
        hits, self._planning_s, started = autograd_cache_hits(), 0.0, time.perf_counter()
        # Note [Compiling on a fresh stack chunk] in passes/steps.py
        compiled = on_a_fresh_stack(lambda: compile_fn(gm, example_inputs))
        elapsed = time.perf_counter() - started
        record = self._plan_record(gm, example_inputs) if training else None
        if len(self.plans) > planned:
            _store_plan(record, self.plans[-1])
            self._say("ckpt_fx: graph %d planned and its forward compiled in %.1f s (planning %.1f s): %s", number,
                      elapsed, self._planning_s, _summary(self.plans[-1]))
        elif training and autograd_cache_hits() > hits:
            plan = _load_plan(record)
            if plan is not None:
                self.plans.append(plan)
                self._say("ckpt_fx: graph %d served from Inductor's cache in %.1f s, its plan as recorded when it "
                          "was compiled: %s", number, elapsed, _summary(plan))
            else:
                self.warn_once(
                    "ckpt_fx: a graph came from Inductor's on-disk cache, compiled by an earlier process with this "
                    "policy, and no record of its plan was found: it runs as planned then, but `plans` and "
                    "step_peak_bytes lack it. TORCHINDUCTOR_AUTOGRAD_CACHE=0 plans every graph again")
        elif training:
            self._say("ckpt_fx: graph %d compiled in %.1f s, without a plan (nothing in it needs gradients, or it "
                      "fell back: see the warnings)", number, elapsed)
        index = self._place(frame, inputs, number) if len(self.plans) == planned + 1 else None
        if self.head_report.dropped_outputs:
            compiled = _with_none_at(compiled, self.head_report.dropped_outputs)
        return _counted(compiled, self, index if self._count_runs else None)

    def _place(self, frame: tuple[int, int] | None, inputs: frozenset[str], number: int) -> int:
        """The index in `plans` of the plan just appended: where a graph with symbolic sizes
        recompiles a function that has a plan (the new plan has size symbols), that plan's place
        (Note [A recompile's plan])."""
        index = len(self.plans) - 1
        if frame is None:
            return index
        function, compile_ = frame
        earlier = self._by_function.get(function)
        if self.plans[-1].symbols and earlier is not None and earlier.compile != compile_ and earlier.inputs == inputs:
            self.superseded.append(self.plans[earlier.index])
            self.plans[earlier.index] = self.plans.pop()
            index = earlier.index
            self._say("ckpt_fx: graph %d serves graph %d's function at any size: its plan replaces graph %d's in "
                      "`plans`", number, earlier.graph, earlier.graph)
        self._by_function[function] = _FunctionPlan(compile=compile_, index=index, graph=number, inputs=inputs)
        return index

    def _say(self, message: str, *args: Any) -> None:
        """One progress line (Note [The first step's lines])."""
        if self.options.progress:
            _progress_log().info(message, *args)
        else:
            log.debug(message, *args)

    def _plan_record(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> pathlib.Path | None:
        """Where the plan of this graph is recorded beside Inductor's cache (Note [Plans of cached
        graphs]); None where Inductor does not cache it."""
        key = self.cache_key() if self.target is INDUCTOR and self.kernels else None
        if key is None:
            return None

        def described(x: Any) -> str:
            if isinstance(x, torch.Tensor):
                return f"{x.dtype}{tuple(x.shape)}{tuple(x.stride())}{x.requires_grad}{x.device.type}"
            return f"{type(x).__name__}:{x}"

        text = "\n".join([key, torch.__version__, str(self.device), repr(self.checkpointed_by_model), gm.code,
                          *map(described, example_inputs)])
        try:
            folder = inductor_cache_dir()
        except Exception:  # noqa: BLE001 - no cache folder: nothing recorded
            return None
        return folder / "ckpt_fx_plans" / f"{hashlib.sha256(text.encode()).hexdigest()[:40]}.pkl"

    def plans_as_run(self) -> list[Plan]:
        """The plans in the order their graphs ran, each as often as it ran (with count_runs;
        else each once, in the order compiled): what step_peak_bytes reads."""
        return [self.plans[i] for i in self.runs] if self.runs else list(self.plans)


def backend(
    *,
    policy: policies.Policy | str | None = None,
    compiler: str | None = None,
    strict: bool = False,
    debug: bool | str | None = None,
    debug_dir: str | None = None,
    head: str = "chunked",
    logits: str = "keep",
    progress: bool = True,
) -> CkptBackend:
    """A torch.compile backend that checkpoints by `policy`; validates everything now.
    compiler, debug and debug_dir default to CKPT_FX_COMPILER, CKPT_FX_DEBUG and CKPT_FX_DEBUG_DIR
    (Inductor, or eager when debugging; off; "ckpt_fx_debug").

    >>> compiled = torch.compile(model, backend=ckpt_fx.backend(policy="segments:4"))
    """
    given = {k: v for k, v in (("debug", debug), ("debug_dir", debug_dir), ("compiler", compiler)) if v is not None}
    return CkptBackend(Options(policy=policies.parse(policy), strict=strict, head=head, logits=logits,
                               progress=progress, **Options.merged(given)))


@dataclass(frozen=True)
class _FunctionPlan:
    """The plan in force for a function Dynamo compiled: which of its compiles made it, its index
    in `plans`, the backend's number for that graph, the names of that graph's tensor inputs."""
    compile: int
    index: int
    graph: int
    inputs: frozenset[str]


def _tensor_inputs(gm: torch.fx.GraphModule) -> frozenset[str]:
    """The names Dynamo gave the graph's tensor inputs (from their sources: the same for every
    compile of one function)."""
    return frozenset(n.name for n in gm.graph.nodes
                     if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor))


def _counted(compiled: Callable[..., Any], backend: CkptBackend, index: int | None) -> Callable[..., Any]:
    """`compiled`, counting its calls in backend.graph_runs and recording `index` (unless None) in
    backend.runs at each; called as `compiled` is (boxed or not)."""
    def counted(*args, **kwargs):
        backend.graph_runs += 1
        if index is not None:
            backend.runs.append(index)
        return compiled(*args, **kwargs)

    if getattr(compiled, "_boxed_call", False):
        counted._boxed_call = True
    return counted


# Note [The first step's lines]
# The first training step compiles: dynamo traces, AOTAutograd builds the joint graph, we plan,
# Inductor generates kernels. On a CPU that takes a minute or more per graph, and under a trainer
# its progress bar sits at 0% meanwhile. So the backend says, on the `ckpt_fx.progress` logger,
# when it starts on each training graph (its ops, the policy, the inner compiler) and, when done,
# the time it took, planning's share, and the plan (blocks, recomputed, predicted peak). Where the
# program configured no logging at all, the logger prints to stderr itself; options
# {"progress": False} (enable(progress=False)) keeps them at debug level.
#
# Note [A recompile's plan]
# A function Dynamo compiled is compiled again when a guard fails; the common case in training is
# a new sequence length, and the second graph is traced with symbolic sizes (automatic dynamic
# shapes). Dynamo tries a function's graphs newest first and the dynamic one accepts the sizes the
# first was made for, so from then on it alone runs: its plan takes the first one's place in
# `plans` (the superseded one kept in `superseded`). Read as two graphs of one step (graph breaks),
# step_peak_bytes(plans) would add the first graph's forward leftovers to the second's peak. A
# recompile with fixed sizes (a changed attribute, dynamic=False) keeps both: the older graph may
# still run for the inputs it was made for, and a function called more than once a step (a block
# after a graph break) may run both in one step. Dynamo numbers functions afresh after
# torch._dynamo.reset(), so a graph takes a plan's place only where its tensor inputs bear the
# same names (from the same sources) as well.
#
# Note [Plans of cached graphs]
# Under Inductor, a graph compiled by an earlier process with the same policy and options is
# served from AOTAutograd's on-disk cache: no joint graph is partitioned, so nothing is planned
# and `plans` would lack the graph (step_peak_bytes would read 0). So each plan is recorded when it
# is made, beside Inductor's cache, keyed by what keys the cached graph (our cache key: policy,
# options, the passes' source; the traced graph's code and its inputs' shapes), and read back on a
# hit. A plan read back has its figures at the sizes it was made for (Plan.from_cache); where no
# record is found the backend says so.


def _progress_log() -> logging.Logger:
    """The `ckpt_fx.progress` logger, printing to stderr where the program configured no logging."""
    logger = logging.getLogger("ckpt_fx.progress")
    configured = [h for lg in (logging.getLogger(), log, logger) for h in lg.handlers if not isinstance(h, logging.NullHandler)]
    if not configured:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def _summary(plan: Plan) -> str:
    recomputed = sum(1 for b in plan.blocks if b.recomputed_ops)
    offloaded = f", {len(plan.offloaded)} saved values offloaded" if plan.offloaded else ""
    return f"{len(plan.blocks)} blocks, {recomputed} recomputed{offloaded}, predicted peak {format_size(plan.peak_bytes)}"


def _store_plan(record: pathlib.Path | None, plan: Plan) -> None:
    """Record `plan` at `record` (Note [Plans of cached graphs]); a failure only loses the record."""
    if record is None:
        return
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        part = record.with_suffix(f".{os.getpid()}.part")
        part.write_bytes(pickle.dumps(replace(plan, prediction=replace(plan.prediction, at=None))))
        part.replace(record)
    except Exception as error:  # noqa: BLE001 - the plan runs; only its record for a later process is lost
        log.info("ckpt_fx: could not record the plan beside Inductor's cache (%s: %s)", type(error).__name__, error)


def _load_plan(record: pathlib.Path | None) -> Plan | None:
    if record is None or not record.exists():
        return None
    try:
        plan = pickle.loads(record.read_bytes())
    except Exception as error:  # noqa: BLE001 - a record of another version: said as no record
        log.info("ckpt_fx: could not read the plan recorded at %s (%s: %s)", record, type(error).__name__, error)
        return None
    return replace(plan, from_cache=True) if isinstance(plan, Plan) else None


def advisory_logging() -> tuple:
    """The logging calls explain and enable trace as no-ops (Note [Logging calls under explain] in
    ckpt_fx/report.py): transformers' `Logger.warning_once`, where
    transformers is imported (it adds the method to logging.Logger)."""
    import logging

    once = getattr(logging.Logger, "warning_once", None)
    return (once,) if once is not None else ()


def _with_none_at(compiled: Callable[..., Any], indices: tuple[int, ...]) -> Callable[..., Any]:
    """`compiled`, its outputs with None put back at `indices` (outputs head_pass removed, which
    dynamo's code after the graph still expects); called as `compiled` is (boxed or not)."""
    def with_none(*args, **kwargs):
        outputs = list(compiled(*args, **kwargs))
        for i in indices:
            outputs.insert(i, None)
        return outputs

    if getattr(compiled, "_boxed_call", False):
        with_none._boxed_call = True
    return with_none


def _dumper(folder: pathlib.Path):
    """dump(pass, stage, gm): write gm's code, and the decisions after select, into folder."""
    folder.mkdir(parents=True, exist_ok=True)
    count = iter(range(1000))

    def dump(name: str, stage: str, gm: torch.fx.GraphModule) -> None:
        path = folder / f"{next(count):02d}_{name}_{stage}.py"
        text = gm.code
        if name == "select" and stage == "after":
            lines = [
                f"# {n.name:32s} {n.meta.get(PATH_KEY, ''):40s} {n.meta[RECOMPUTE_KEY].name:16s} {n.meta.get(REASON_KEY, '')}"
                for n in gm.graph.nodes
                if RECOMPUTE_KEY in n.meta
            ]
            text = "# decisions: node, module path, decision, reason\n" + "\n".join(lines) + "\n\n" + text
        path.write_text(text)

    return dump


def ckpt(gm: torch.fx.GraphModule, example_inputs: list[Any], *, options: dict[str, Any] | None = None, **unused: Any):
    """The backend registered as "ckpt" (entry point torch_dynamo_backends)."""
    if unused:
        raise ValueError(
            f"backend='ckpt' takes its settings through options={{...}}, not {sorted(unused)} "
            f"(mode= is not supported); valid option keys: {', '.join(OPTION_KEYS)}"
        )
    return CkptBackend(Options.from_mapping(options))(gm, example_inputs)
