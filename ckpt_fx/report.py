"""explain(): what a policy saves and recomputes in a model, in words a user reads."""

from __future__ import annotations

import copy
import itertools
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt_fx import policies
from ckpt_fx.dynamo_backend import CkptBackend, Options, advisory_logging
from ckpt_fx.in_place import own_forwards
from ckpt_fx.measure import peak_bytes
from passes._compat import logging_calls_ignored, no_fx_graph_cache, pytree
from passes import Plan, step_peak_bytes
from passes.plan import PeakModel, SavedTensor
from passes.sizes import format_size
from passes.graphs import copy_graph_module
from passes.policy import uses_blocks
from passes.select import HardRule
from passes.targets import EAGER, INDUCTOR, Target

# A checkpointed block whose recompute keeps out less than this is not worth its recompute.
SMALL_REGION_BYTES = 64 * 1024


@dataclass(frozen=True, kw_only=True)
class Report:
    """The plans of every graph of a model under one policy; prints as tables."""

    policy: str
    plans: tuple[Plan, ...]
    predicted_peak_bytes: int
    compiler: str = "eager"
    """The inner compiler the plans were made for."""
    measured_peak_bytes: int | None = None
    eager_peak_bytes: int | None = None
    no_checkpoint_peak_bytes: int | None = None
    """The predicted peak of the same graphs planned without checkpointing (policy none, every
    value the backward reads saved): the baseline without measuring."""
    warnings: tuple[str, ...] = field(default_factory=tuple)
    units: tuple[str, ...] = field(default_factory=tuple)
    """How the units were found: blocks nested in stages, calls of a shared module, heavy units."""

    def __str__(self) -> str:
        return self.format()

    def format(self, *, top: int | None = None) -> str:
        """The report as text; `top` lists only the largest `top` saved tensors."""
        mb = 2**20
        out = [f"ckpt_fx plan: {self.policy}, {len(self.plans)} graph(s), inner compiler {self.compiler}", ""]
        out.append("| unit | saved MB | offloaded MB | recomputed ops | recomputed MB | recompute GFLOP |")
        out.append("|---|---:|---:|---:|---:|---:|")
        in_units = in_units_host = 0
        for plan in self.plans:
            for b in plan.blocks:
                in_units += b.saved_bytes
                in_units_host += b.offloaded_bytes
                out.append(f"| {b.path} | {b.saved_bytes / mb:.2f} | {b.offloaded_bytes / mb:.2f} | {b.recomputed_ops} | "
                           f"{b.recomputed_bytes / mb:.2f} | {b.recompute_flops / 1e9:.3f} |")
        saved = [s for plan in self.plans for s in plan.saved if not s.is_input]
        total = sum(p.saved_bytes for p in self.plans)  # views share their base's bytes
        host = sum(p.offloaded_bytes for p in self.plans)
        out.append(f"| (outside the units) | {max(0, total - in_units) / mb:.2f} | {max(0, host - in_units_host) / mb:.2f} "
                   "| - | - | - |")
        out.append("")
        inputs = sum(1 for plan in self.plans for s in plan.saved if s.is_input)
        moved = sum(1 for s in saved if s.offloaded)
        out.append(f"saved activations: {len(saved) - moved} tensors, {total / mb:.2f} MB on the device"
                   + (f"; {moved} tensors, {host / mb:.2f} MB in host memory (offloaded)" if moved else "")
                   + f" (plus {inputs} parameters/inputs kept by reference)")
        names = {s.name for s in saved}
        shared = lambda s: s.view_of is not None and s.view_of in names  # noqa: E731 - its bytes are its base's row
        listed = sorted(saved, key=lambda s: -(0 if shared(s) else s.nbytes))[:top] if top is not None else saved
        for s in listed:
            shape = "x".join(map(str, s.shape)) or "scalar"
            dtype = str(s.dtype).replace("torch.", "")
            size = f"view of {s.view_of}" if shared(s) else f"{s.nbytes / mb:8.3f} MB" + (" (host)" if s.offloaded else "")
            out.append(f"  {s.module_path or '<top>':40s} {_described(s):40s} {shape:>18s} {dtype:8s} {size}")
        if top is not None and len(saved) > top:
            out.append(f"  ... and {len(saved) - top} smaller ones")
        out.extend(_head_lines(self.plans))
        out.append("")
        line = f"predicted {'device ' if host else ''}peak: {self.predicted_peak_bytes / mb:.1f} MB"
        if any(p.peak_model == PeakModel.INDUCTOR for p in self.plans):
            line += " from Inductor's own schedule"
        if self.no_checkpoint_peak_bytes:
            line += (f" ({self.predicted_peak_bytes / self.no_checkpoint_peak_bytes:.2f}x the "
                     f"{self.no_checkpoint_peak_bytes / mb:.1f} MB predicted without checkpointing)")
        if self.measured_peak_bytes is not None:
            line += f"; measured: {self.measured_peak_bytes / mb:.1f} MB"
        if self.eager_peak_bytes is not None:
            line += f"; eager without checkpointing: {self.eager_peak_bytes / mb:.1f} MB"
        out.append(line)
        if self.units:
            out.append("")
            out.extend(f"units: {u}" for u in self.units)
        if self.warnings:
            out.append("")
            out.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(out)


def _described(saved: SavedTensor) -> str:
    """A saved value's op, with what it is when it is no activation: random-number state, a
    dropout mask."""
    return saved.op if saved.kind == "activation" else f"{saved.op} ({saved.kind})"


def training_loss(out: Any) -> torch.Tensor:
    """A scalar to differentiate: the output itself, its .loss, or the sum of its float tensors."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [x for x in pytree.tree_leaves(out if not hasattr(out, "to_tuple") else out.to_tuple())
              if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad]
    if not leaves:
        raise ValueError("explain: the model's output has no floating-point tensor that requires grad")
    return sum(x.float().sum() for x in leaves)


def _head_lines(plans: tuple[Plan, ...]) -> list[str]:
    """The loss head's row: bytes the whole head would keep and the chunked one keeps, chunks,
    FLOPs; or why a cross-entropy was left whole (Note [The loss head in chunks])."""
    mb = 2**20
    out = []
    for plan in plans:
        for h in plan.heads:
            out.append(
                f"loss head: {h.tokens} tokens x {h.vocab} vocabulary in {h.chunks} chunks of {h.chunk_rows} rows: keeps "
                f"{h.kept_bytes / mb:.2f} MB for the backward where the whole head keeps {h.whole_bytes / mb:.2f} MB "
                f"(one chunk's temporaries {h.chunk_bytes / mb:.2f} MB); 0 FLOPs recomputed (its gradients are formed "
                f"in the forward){'; the logits are returned whole as the caller asked' if h.logits_kept else ''}")
        out.extend(f"loss head left whole: {reason}" for reason in plan.head_reasons)
    return out


def explain(model: torch.nn.Module, *args: Any, policy: policies.Policy | str | None = None,
            measure: bool = False, compiler: str | None = None, **kwargs: Any) -> Report:
    """Compile a copy of `model` with `policy`, run one training step's forward on (args, kwargs)
    (each graph is planned as its forward compiles), and report per block the saved bytes, the
    recomputed ops and FLOPs, every saved tensor, the predicted peak (and, when `measure=True`, the
    measured peak of a whole step, with eager's beside it). `compiler` is the inner compiler to
    plan for (default: the backend's, CKPT_FX_COMPILER or Inductor); the plans differ (under
    Inductor torch's min-cut decides what the policy leaves open). Under Inductor the plans are
    made as Inductor makes them, but no kernel is generated unless `measure=True` (the forward
    runs its graphs op by op): no code generation or C++ build, though dynamo's trace and the
    plans (with their Inductor schedules) still take their time (the README's figures). A graph
    that runs several times in the step (a graph break inside the loop over blocks) counts as
    often as it runs in the predicted peak. transformers' `warning_once` is traced as a call that
    does nothing (Note [Logging calls under explain]).

    The model is not changed, and the process is left as it was: the random number generators'
    states are restored, and no compiled model is reset (explain compiles a fresh function of its
    own, so dynamo's caches for the user's models are untouched)."""
    options = Options(policy=policies.parse(policy), progress=False, **Options.merged({"compiler": compiler} if compiler else {}))
    name = policies.policy_name(options.policy)
    backend = CkptBackend(options, kernels=measure, count_runs=True)
    unplanned = []  # each joint graph as it came, to plan again without checkpointing
    backend.on_joint.append(lambda joint, joint_inputs, kw: unplanned.append((copy_graph_module(joint), joint_inputs, kw)))
    with own_forwards(model):  # an enabled model is explained as the plain model it wraps
        work = copy.deepcopy(model)
    compiled = torch.compile(_fresh_function(lambda *a, **k: work(*a, **k)), backend=backend)

    def step(fn, *, backward: bool = True) -> None:
        torch.manual_seed(0)
        loss = training_loss(fn(*args, **kwargs))
        if backward:
            loss.backward()

    device = next((p.device for p in work.parameters()), torch.device("cpu"))
    cuda = [device.index or 0] if device.type == "cuda" else []
    # A plan served from Inductor's FX graph cache would not be made again: nothing to report.
    with torch.random.fork_rng(devices=cuda), no_fx_graph_cache(), logging_calls_ignored(advisory_logging()):
        # Every graph's plan is made when its forward compiles: the backward is run only to be
        # measured (a warm step first).
        step(compiled, backward=measure)
        runs = list(backend.runs)  # the first step's: each graph as often as it ran
        measured = eager = None
        if measure:
            for p in work.parameters():
                p.grad = None
            measured = peak_bytes(lambda: step(compiled), device=device)
            with own_forwards(model):
                plain = copy.deepcopy(model)
            step(plain)
            for p in plain.parameters():
                p.grad = None
            eager = peak_bytes(lambda: step(plain), device=device)
    plans = tuple(backend.plans)
    baseline = CkptBackend(Options(policy=policies.parse("none"), compiler="eager", progress=False))
    for joint, joint_inputs, kw in unplanned:
        baseline.partition(joint, joint_inputs, **kw)
    as_run = (lambda ps: [ps[i] for i in runs]) if runs and len(baseline.plans) == len(plans) else list  # noqa: E731
    return Report(
        policy=name,
        plans=plans,
        predicted_peak_bytes=step_peak_bytes(as_run(plans)),
        compiler=options.compiler,
        measured_peak_bytes=measured,
        eager_peak_bytes=eager,
        no_checkpoint_peak_bytes=step_peak_bytes(as_run(baseline.plans)) if baseline.plans else None,
        warnings=tuple(_pitfalls(options.policy, name, plans, target=options.target)),
        units=tuple(_units(plans)),
    )


# Note [Logging calls under explain]
# transformers' models call `logger.warning_once` in their forward (GPT-2's loss_function does on
# every call: its class name maps to no loss type), and Dynamo breaks the graph at a logging call:
# the step traces as two graphs (the blocks, the loss) and Dynamo traces the frame a second time
# to place the break. The call computes nothing, so explain traces it as a call that does
# nothing: the step is one graph, as a model whose forward logs nothing traces, and is traced
# once (the README's explain timings). Its message is not printed by explain's compiled step.
# `enable` compiles the backbone, whose layers such calls are rarely in, and traces a causal LM's
# training calls with labels (GPT-2's loss among them) the same way; torch.compile(model, backend="ckpt") traces
# the model as Dynamo's own settings say (the README's Known limits).


_calls = itertools.count()


def _fresh_function(fn):
    """`fn` with a code object of its own: dynamo keeps its compiled graphs per code object, so
    explain's compiles neither add to a user's model's cache (and its recompile limit) nor need a
    torch._dynamo.reset() that would discard the user's compiled models."""
    code = fn.__code__.replace(co_name=f"ckpt_fx_explain_{next(_calls)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _units(plans: tuple[Plan, ...]) -> list[str]:
    """In words: which level of nested stacks gave the units, which modules ran as several units,
    and which units skip_first does not skip (Notes [Nested stacks], [Calls as units], [What
    skip_first skips] in passes/regions.py)."""
    blocks = {}
    for plan in plans:
        for block in plan.units:
            blocks.setdefault(block.name, block)
    out = []
    nested = list(dict.fromkeys(b.stack for b in blocks.values() if b.in_stage))
    if nested:
        out.append(f"the blocks inside stages are the units ({', '.join(nested)}): they run in sequence")
    repeated = dict.fromkeys(b.path for b in blocks.values() if b.calls > 1)
    for path in repeated:
        calls = max(b.calls for b in blocks.values() if b.path == path)
        out.append(f"{path} runs {calls} times: each call is a unit ({path} #0 .. #{calls - 1})")
    heavy = [b.name for b in blocks.values() if b.heavy]
    if heavy:
        out.append(f"{len(heavy)} heavy unit(s), over twice the median unit's activations, that skip_first does "
                   f"not skip: {', '.join(heavy[:4])}{' ...' if len(heavy) > 4 else ''}")
    return out


def _pitfalls(policy: policies.Policy, name: str, plans: tuple[Plan, ...], *, target: Target = EAGER) -> list[str]:
    """The pitfalls of checkpointing that a plan shows (see the README's FAQ)."""
    out = []
    if not plans:
        out.append("no graph was planned (was the model run without gradients, or did every graph fall back?)")
        return out
    random = any(rule == HardRule.RANDOM for p in plans for rule in p.hard_rules.values()) or any(
        s.kind in ("dropout mask", "random-number state") and not s.draws_nothing for p in plans for s in p.saved)
    if random and target is INDUCTOR:
        out.append("dropout under Inductor draws Inductor's own random numbers, as Inductor alone does: statistically "
                   "eager's masks, not bitwise, so gradients differ from an eager step's; "
                   "torch._inductor.config.fallback_random = True, or compiler='eager', draws eager's")
    if any(p.top_level_units for p in plans):
        out.append("no stack of repeated blocks was found: top-level children served as units")
    if uses_blocks(policy) and not any(p.recomputed for p in plans):
        out.append(f"policy {name} recomputes nothing: no node matched it "
                   f"(blocks found: {', '.join(b.path for p in plans for b in p.blocks) or 'none'})")
    asked = sum(p.recomputed_embedding_ops for p in plans)
    if asked:
        out.append(f"the policy recomputes {asked} embedding op(s): this saves nothing, an embedding's "
                   "output is kept anyway as the next unit's input")
    for plan in plans:
        for b in plan.blocks:
            if b.recomputed_ops and b.recomputed_bytes < SMALL_REGION_BYTES:
                out.append(f"{b.path} recomputes {b.recomputed_ops} ops to keep out only "
                           f"{format_size(b.recomputed_bytes, digits=0)}: the recompute likely costs more than it saves")
    return out
