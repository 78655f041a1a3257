"""Side-by-side benchmark: peak memory and step time of one training step, every setup in one
process so the ratios compare. `python -m ckpt_fx bench --help`."""

from __future__ import annotations

import copy
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ckpt_fx.backend import backend as ckpt_backend
from ckpt_fx.explain import training_loss
from ckpt_fx.measure import peak_bytes
from passes._compat import activation_memory_budget, inductor_random_as_eager, no_fx_graph_cache, per_block_checkpointing, pytree
from passes.memory import step_peak_bytes

CPU_SETUPS = (
    "eager", "checkpoint", "aot_eager-budget:0.5", "ckpt-eager:blocks", "ckpt-eager:blocks:every=1,skip_first=0",
    "ckpt-eager:selective", "ckpt-eager:budget:0.5",
)
"""The default on a CPU: the peers and our plans on eager kernels (the eager inner compiler and
torch's knob under aot_eager), a few minutes in all; Inductor compiles a GPT-2 for a minute or two
per setup on a CPU, so its rows are asked for (--setups, --sweep)."""
CUDA_SETUPS = (
    "eager", "checkpoint", "inductor", "inductor-budget:0.5", "inductor-sac", "ckpt:none", "ckpt:blocks",
    "ckpt:blocks:every=1,skip_first=0", "ckpt:selective", "ckpt:budget:0.5", "ckpt:budget:0.3",
)
"""The default on a GPU: the ground users train on (Inductor alone, torch's knob, torch's op-level
selective checkpointing) beside our plans under Inductor."""
DEFAULT_SETUPS = CPU_SETUPS


def default_setups(device: str) -> tuple[str, ...]:
    """The setups a bench runs when none are named: CUDA_SETUPS on a GPU, CPU_SETUPS on a CPU."""
    return CUDA_SETUPS if device == "cuda" else CPU_SETUPS


SETUP_FORMS = (
    "eager, checkpoint, sac, inductor-sac, aot_eager, inductor, aot_eager-budget:<x>, inductor-budget:<x>, "
    "ckpt:<policy> (the default inner compiler), ckpt-eager:<policy>, ckpt-inductor:<policy>"
)
PEERS = ("eager", "checkpoint", "sac", "inductor-sac", "aot_eager", "inductor")


def sweep_setups(budgets: tuple[float, ...]) -> tuple[str, ...]:
    """Both budget lines at each budget, with the peers and our no-checkpoint and selective plans:
    torch's knob (inductor-budget:x) beside ckpt:budget:x, Inductor alone beside ckpt:none, torch's
    op-level selective checkpointing under Inductor beside ckpt:selective, HF per-block checkpointing
    beside ours on every block."""
    for x in budgets:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x <= 1:
            raise ValueError(f"--sweep: every budget must be a number in (0, 1], got {x!r}")
    lines = [s for x in budgets for s in (f"inductor-budget:{x:g}", f"ckpt:budget:{x:g}")]
    return ("eager", "checkpoint", "ckpt:blocks:every=1,skip_first=0", "inductor", "ckpt:none", "inductor-sac",
            "ckpt:selective", *lines)


@dataclass(frozen=True, kw_only=True)
class Row:
    """One setup's measurements."""

    setup: str
    peak_mb: float
    peak_ratio: float
    step_s: float
    step_ratio: float
    grad_rel_diff: float
    """Relative difference of the gradients from the first setup's; NaN when it would compare
    different random numbers (dropout drawn by Inductor: see grad_note)."""
    predicted_mb: float | None
    compile_s: float
    recompute_gflop: float | None = None
    """FLOPs the backward spends recomputing (ckpt setups; torch.utils.flop_counter's formulas)."""
    error: str | None = None
    """Why the setup did not run (an infeasible budget, say); its numbers are then NaN."""
    grad_note: str | None = None
    """Why grad_rel_diff is not given, when it is not."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model and one batch."""

    name: str
    model: torch.nn.Module
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def loss(self, fn: Callable[..., Any]) -> torch.Tensor:
        """Run a forward through fn (the model, compiled or not) and return the scalar loss."""
        return training_loss(fn(*self.args, **self.kwargs))

    def to(self, device: str | torch.device) -> Workload:
        """The same workload with its model and every tensor argument on `device`."""
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda': torch sees no CUDA device here; valid: cpu")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {str(device)!r}: valid: cpu, cuda")
        move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
        return Workload(name=self.name, model=self.model.to(device), args=pytree.tree_map(move, self.args),
                        kwargs=pytree.tree_map(move, self.kwargs))


def gpt2_workload(*, layers: int = 12, dim: int = 256, heads: int = 4, vocab: int = 1000, batch: int = 8, seq: int = 256) -> Workload:
    """transformers' GPT2LMHeadModel from a small config (random weights, eager attention, its default
    dropout, train mode), fed random token ids as input and labels."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=seq,
                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, vocab, (batch, seq))
    return Workload(
        name=f"GPT-2 {layers}x{dim}, batch {batch}x{seq}",
        model=model,
        kwargs={"input_ids": ids, "labels": ids, "use_cache": False},
    )


def builtin_workload(name: str = "llama", *, batch: int = 8, seq: int = 256, **config: object) -> Workload:
    """A built-in model (ckpt_fx.models) fed random token ids as input and labels."""
    from ckpt_fx.models import build

    torch.manual_seed(0)
    model = build(name, **config).train()
    vocab = model.head.out_features
    ids = torch.randint(0, vocab, (batch, seq))
    return Workload(name=f"built-in {name} {config}, batch {batch}x{seq}", model=model, args=(ids, ids))


MODEL_FORMS = (
    "gpt2 (transformers' GPT2LMHeadModel), llama or gpt (built-in), hf:<ConfigClass> (any transformers "
    "causal-LM config, e.g. hf:LlamaConfig), or <module>:<function> (a factory returning a Workload, "
    "(model, args) or (model, args, kwargs))"
)


def hf_workload(config_class: str, *, layers: int = 12, dim: int = 256, heads: int = 4, vocab: int = 1000,
                batch: int = 8, seq: int = 256, overrides: dict[str, Any] | None = None) -> Workload:
    """A transformers causal LM built from a config class by name (random weights, train mode):
    layers, width and heads set through the config's standard names (num_hidden_layers,
    hidden_size, num_attention_heads), a 4x MLP where the config has intermediate_size, then
    `overrides` (any config attribute) on top. Fed random token ids as input and labels."""
    import transformers

    cls = getattr(transformers, config_class, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig)):
        raise ValueError(f"model 'hf:{config_class}': transformers has no config class {config_class!r} "
                         "(e.g. hf:LlamaConfig, hf:GPT2Config, hf:MistralConfig)")
    torch.manual_seed(0)
    config = cls()
    settings: dict[str, Any] = {"num_hidden_layers": layers, "hidden_size": dim, "num_attention_heads": heads,
                                "vocab_size": vocab}
    if hasattr(config, "intermediate_size"):
        settings["intermediate_size"] = 4 * dim
    if hasattr(config, "num_key_value_heads"):
        settings["num_key_value_heads"] = heads
    if getattr(config, "max_position_embeddings", seq) < seq:
        settings["max_position_embeddings"] = seq
    settings.update(overrides or {})
    for key, value in settings.items():
        if key in (overrides or {}) and not hasattr(config, key):
            raise ValueError(f"model 'hf:{config_class}': the config has no attribute {key!r}")
        setattr(config, key, value)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(config, key, None) is not None and getattr(config, key) >= config.vocab_size:
            setattr(config, key, 0)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config).train()
    except ValueError as error:
        raise ValueError(f"model 'hf:{config_class}': not a causal LM transformers can build: {error}") from None
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    shown = ", ".join(f"{k}={v}" for k, v in (overrides or {}).items())
    return Workload(
        name=f"{type(model).__name__} {layers}x{dim}{f' ({shown})' if shown else ''}, batch {batch}x{seq}",
        model=model,
        kwargs={"input_ids": ids, "labels": ids, "use_cache": False},
    )


def factory_workload(spec: str) -> Workload:
    """The workload a `module:function` factory returns: a Workload, (model, args) or
    (model, args, kwargs); the model is put in train mode."""
    import pkgutil

    module_name, _, function_name = spec.partition(":")
    try:
        factory = pkgutil.resolve_name(spec)
    except ImportError as error:
        raise ValueError(f"model {spec!r}: cannot import module {module_name!r} ({error})") from None
    except AttributeError:
        raise ValueError(f"model {spec!r}: module {module_name!r} has no function {function_name!r}") from None
    if not callable(factory):
        raise ValueError(f"model {spec!r}: {type(factory).__name__} is not a function")
    torch.manual_seed(0)
    made = factory()
    if isinstance(made, Workload):
        made.model.train()
        return made
    if isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], torch.nn.Module):
        model, args, kwargs = (*made, {}) if len(made) == 2 else made
        args = args if isinstance(args, tuple) else (args,)
        return Workload(name=f"{spec} ({type(model).__name__})", model=model.train(), args=args, kwargs=dict(kwargs))
    raise ValueError(f"model {spec!r}: the factory returned {type(made).__name__}; "
                     "expected a Workload, (model, args) or (model, args, kwargs)")


def workload(model: str, *, layers: int = 12, dim: int = 256, heads: int = 4, batch: int = 8, seq: int = 256,
             overrides: dict[str, Any] | None = None) -> Workload:
    """A workload by name (MODEL_FORMS); `overrides` set config attributes (built-in and hf: models)."""
    if model == "gpt2" and not overrides:
        return gpt2_workload(layers=layers, dim=dim, heads=heads, batch=batch, seq=seq)
    if model == "gpt2":
        return hf_workload("GPT2Config", layers=layers, dim=dim, heads=heads, batch=batch, seq=seq, overrides=overrides)
    if model in ("llama", "gpt"):
        from ckpt_fx.models import ModelConfig

        valid = set(ModelConfig.__dataclass_fields__) - {"layers", "dim", "heads"}
        unknown = sorted(set(overrides or {}) - valid)
        if unknown:
            raise ValueError(f"model {model!r}: unknown config key(s) {unknown}; valid: {', '.join(sorted(valid))}")
        return builtin_workload(model, layers=layers, dim=dim, heads=heads, batch=batch, seq=seq, **(overrides or {}))
    prefix, sep, rest = model.partition(":")
    if sep and prefix == "hf":
        return hf_workload(rest, layers=layers, dim=dim, heads=heads, batch=batch, seq=seq, overrides=overrides)
    if sep and prefix and rest:
        if overrides:
            raise ValueError(f"model {model!r}: --config applies to built-in and hf: models, not to a factory")
        return factory_workload(model)
    raise ValueError(f"unknown model {model!r}; valid: {MODEL_FORMS}")


def parse_overrides(text: str | None) -> dict[str, Any]:
    """'key=value,key=value' to a dict; values are Python literals where they parse (4, 0.1, True,
    'silu'), else strings."""
    import ast

    out: dict[str, Any] = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"--config: expected key=value, got {item!r}")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def _block_stack(model: torch.nn.Module) -> torch.nn.ModuleList:
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    if not lists:
        raise ValueError("setup 'checkpoint' needs a model with a ModuleList of blocks")
    return max(lists, key=len)


def _checkpoint_every_block(model: torch.nn.Module, *, selective: bool = False) -> torch.nn.Module:
    """What HF's activation checkpointing does: torch.utils.checkpoint around every block (HF's own
    switch where the model has one, else torch's apply_activation_checkpointing on the largest
    ModuleList's members). `selective`: torch's op-level selective checkpointing inside each block
    instead (what torchtitan's op-level mode does): matmul and attention outputs saved, the rest
    recomputed."""
    options: dict[str, Any] = {}
    if selective:
        import functools

        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    if getattr(model, "supports_gradient_checkpointing", False):
        return hf_checkpointing_enable(model, use_reentrant=False, **options)
    blocks = {id(b) for b in _block_stack(model)}
    return per_block_checkpointing(model, lambda m: id(m) in blocks, **options)


def hf_checkpointing_enable(model: torch.nn.Module, **checkpoint_kwargs: Any) -> torch.nn.Module:
    """A transformers model's own per-block checkpointing, switched on under its current name
    (activation_checkpointing_enable; gradient_checkpointing_enable before transformers 5.x
    renamed it), `checkpoint_kwargs` passed to torch.utils.checkpoint."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
    return model


def _save_matmuls(ctx, op, *args, **kwargs):
    """torch's selective-checkpoint policy for the sac setups: save matmul and attention outputs."""
    from torch.utils.checkpoint import CheckpointPolicy

    from ckpt_fx.policies import OP_CLASSES

    packet = str(getattr(op, "_overloadpacket", op))
    saved = {name for cls in ("matmul", "attention") for name in OP_CLASSES[cls]}
    return CheckpointPolicy.MUST_SAVE if packet in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _prepare(setup: str, model: torch.nn.Module):
    """(callable model, ckpt backend or None, config patch) for a setup name."""
    import contextlib

    none = contextlib.nullcontext
    if setup == "eager":
        return model, None, none
    if setup == "checkpoint":
        return _checkpoint_every_block(model), None, none
    if setup == "sac":
        return _checkpoint_every_block(model, selective=True), None, none
    if setup == "inductor-sac":
        return torch.compile(_checkpoint_every_block(model, selective=True), backend="inductor"), None, none
    if setup in ("aot_eager", "inductor"):
        return torch.compile(model, backend=setup), None, none
    compiler, _, knob = setup.partition("-budget:")
    if knob and compiler in ("aot_eager", "inductor"):
        # torch's own knob: the min-cut partitioner under an activation memory budget.
        try:
            value = float(knob)
        except ValueError:
            raise ValueError(f"setup {setup!r}: the budget must be a number in (0, 1]") from None
        import functools

        patch = functools.partial(activation_memory_budget, value)
        return torch.compile(model, backend=compiler), None, patch
    if setup.startswith("ckpt:"):
        b = ckpt_backend(policy=setup[len("ckpt:"):])
        return torch.compile(model, backend=b), b, none
    for compiler in ("eager", "inductor"):
        if setup.startswith(f"ckpt-{compiler}:"):
            b = ckpt_backend(policy=setup.partition(":")[2], compiler=compiler)
            return torch.compile(model, backend=b), b, none
    raise ValueError(f"unknown setup {setup!r}; valid: {SETUP_FORMS}")


def run(workload: Workload, setups: tuple[str, ...] = DEFAULT_SETUPS, *, steps: int = 5, amp: bool = False,
        progress: bool = False, fallback_random: bool = False) -> list[Row]:
    """Measure every setup on the same model (fresh copy each) and batch; the first is the reference.

    amp=True runs every step under bf16 autocast. fallback_random=True has Inductor draw random
    numbers as eager does (torch._inductor.config.fallback_random), so the gradient column compares
    Inductor setups with dropout too. A setup that fails (an infeasible budget) gets a
    row with its error; the first setup must run. progress=True draws a progress bar on stderr.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    check_setups(setups)
    results = []
    bar = _bar(len(setups)) if progress else None  # on stderr: elapsed time and what is left
    for k, setup in enumerate(setups, 1):
        if bar is not None:
            bar.set_postfix_str(setup)
        try:
            # Cold compiles: a plan served from Inductor's FX graph cache (an earlier run of the
            # same setup) would report no plan and a compile time that measures nothing.
            with no_fx_graph_cache(), inductor_random_as_eager(fallback_random):
                results.append(_measure(workload, setup, steps=steps, amp=amp))
        except Exception as error:  # noqa: BLE001 - reported in the row, the other setups still run
            if k == 1:
                raise
            message = str(getattr(error, "inner_exception", None) or error).strip().splitlines()[-1]
            results.append((setup, math.nan, math.nan, None, None, math.nan, None, message[:300]))
            torch.compiler.reset()
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    ref_peak, ref_time, ref_grads = results[0][1], results[0][2], results[0][3]
    dropout = workload.model.training and any(
        isinstance(m, torch.nn.Dropout) and m.p > 0 for m in workload.model.modules())
    rows = []
    for setup, peak, t, grads, predicted, compile_s, flops, error in results:
        if dropout and not fallback_random and error is None and _inductor_draws(setup) != _inductor_draws(setups[0]):
            rows.append(Row(setup=setup, peak_mb=peak / 2**20, peak_ratio=peak / ref_peak, step_s=t,
                            step_ratio=t / ref_time, grad_rel_diff=math.nan, predicted_mb=predicted,
                            compile_s=compile_s, recompute_gflop=flops, grad_note=RNG_NOTE))
            continue
        num = den = 0.0
        for g, r in zip(grads or [], ref_grads):
            if g is not None and r is not None:
                num += (g.double() - r.double()).pow(2).sum().item()
                den += r.double().pow(2).sum().item()
        rows.append(Row(setup=setup, peak_mb=peak / 2**20, peak_ratio=peak / ref_peak, step_s=t, step_ratio=t / ref_time,
                        grad_rel_diff=(num / den) ** 0.5 if den else (math.nan if grads is None else 0.0),
                        predicted_mb=predicted, compile_s=compile_s, recompute_gflop=flops, error=error))
    return rows


RNG_NOTE = ("n/a: dropout drawn by Inductor's own random numbers, not eager's; --fallback-random compares "
            "them (torch._inductor.config.fallback_random=True)")


def _inductor_draws(setup: str) -> bool:
    """Whether the setup's random ops (dropout) run as Inductor's own kernels."""
    if setup in ("inductor", "inductor-sac") or setup.startswith(("inductor-budget:", "ckpt-inductor:")):
        return True
    return setup.startswith("ckpt:") and ckpt_backend(policy="none").options.compiler == "inductor"


def check_setups(setups: tuple[str, ...]) -> None:
    """Refuse a bad setup name (ValueError naming the valid forms) before any model is built."""
    for setup in setups:
        _prepare_check(setup)


def _bar(total: int):
    """A progress bar over the setups on stderr, with elapsed time and an estimate of what is left."""
    from tqdm import tqdm

    return tqdm(total=total, unit="setup", file=sys.stderr, dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} setups [{elapsed} elapsed, {remaining} left]{postfix}")


def _prepare_check(setup: str) -> None:
    """Refuse a bad setup name before anything runs."""
    if setup in PEERS:
        return
    compiler, _, knob = setup.partition("-budget:")
    if knob and compiler in ("aot_eager", "inductor"):
        try:
            value = float(knob)
        except ValueError:
            value = -1.0
        if not 0 < value <= 1:
            raise ValueError(f"setup {setup!r}: the budget must be a number in (0, 1]")
        return
    if setup.startswith(("ckpt:", "ckpt-eager:", "ckpt-inductor:")):
        from ckpt_fx import policies

        policies.parse(setup.partition(":")[2])
        return
    raise ValueError(f"unknown setup {setup!r}; valid: {SETUP_FORMS}")


def _measure(workload: Workload, setup: str, *, steps: int, amp: bool):
    import contextlib

    model = copy.deepcopy(workload.model)
    fn, b, patch = _prepare(setup, model)
    cast = (lambda: torch.autocast(_device(model), dtype=torch.bfloat16)) if amp else contextlib.nullcontext

    def step() -> None:
        torch.manual_seed(1234)
        with patch(), cast():
            loss = workload.loss(fn)
        loss.backward()

    def clear() -> None:
        for p in model.parameters():
            p.grad = None

    device = _device(model)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    start = time.perf_counter()
    step()
    sync()
    compile_s = time.perf_counter() - start
    clear()
    peak = peak_bytes(step, device=device)
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    times = []
    for _ in range(steps):
        clear()
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    clear()
    torch.compiler.reset()
    predicted = step_peak_bytes(b.plans) / 2**20 if b is not None and b.plans else None
    flops = sum(p.recompute_flops for p in b.plans) / 1e9 if b is not None and b.plans else None
    return (setup, peak, statistics.median(times), grads, predicted, compile_s, flops, None)


def _device(model: torch.nn.Module) -> str:
    first = next(model.parameters(), None)
    return first.device.type if first is not None else "cpu"


def markdown(rows: list[Row]) -> str:
    """The rows as a Markdown table (failed setups listed below it with their errors)."""
    out = ["| setup | peak MB | x ref | step s | x ref | recompute GFLOP | grad rel diff | predicted MB | compile s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    failed = []
    notes = sorted({r.grad_note for r in rows if r.grad_note})
    for r in rows:
        if r.error is not None:
            out.append(f"| {r.setup} | failed | | | | | | | |")
            failed.append(f"- {r.setup}: {r.error}")
            continue
        pred = f"{r.predicted_mb:.1f}" if r.predicted_mb is not None else "-"
        flops = f"{r.recompute_gflop:.2f}" if r.recompute_gflop is not None else "-"
        out.append(f"| {r.setup} | {r.peak_mb:.1f} | {r.peak_ratio:.3f} | {r.step_s:.3f} | {r.step_ratio:.2f} | "
                   f"{flops} | {'n/a' if r.grad_note else f'{r.grad_rel_diff:.1e}'} | {pred} | {r.compile_s:.1f} |")
    for r in rows:
        if r.error is None and not r.grad_note and "-budget:" in r.setup and r.grad_rel_diff > 1e-3:
            notes.append(f"{r.setup}: gradients differ from the first setup's ({r.grad_rel_diff:.1e}); torch's "
                         "activation_memory_budget can recompute dropout in the backward with new random numbers "
                         "(pytorch/pytorch#190758)")
    return "\n".join(out + ([""] + failed if failed else []) + ([""] + [f"- {n}" for n in notes] if notes else []))


def dominators(rows: list[Row]) -> dict[str, str | None]:
    """For every peer row (a setup not of ours), the ckpt row that dominates it: peak <= and step
    time <=, the one of least peak among those; None when no ckpt row does. Failed rows take no part."""
    ours = [r for r in rows if r.error is None and r.setup.startswith("ckpt")]
    out: dict[str, str | None] = {}
    for r in rows:
        if r.error is not None or r.setup.startswith("ckpt"):
            continue
        better = [o for o in ours if o.peak_mb <= r.peak_mb and o.step_s <= r.step_s]
        out[r.setup] = min(better, key=lambda o: (o.peak_mb, o.step_s)).setup if better else None
    return out


def dominance_markdown(rows: list[Row]) -> str:
    """One line per peer: the ckpt setup that dominates it, or that none does."""
    out = []
    for peer, by in dominators(rows).items():
        out.append(f"- {peer}: dominated by {by}" if by else f"- {peer}: no ckpt setup has both peak and step time <= it")
    return "\n".join(out)


def as_dicts(rows: list[Row]) -> list[dict]:
    """The rows as plain dicts for strict JSON: a number a failed setup did not measure is None."""
    return [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(r).items()} for r in rows]


def require_matplotlib() -> None:
    """Raise a ValueError naming the extra when matplotlib is missing (checked before any setup runs)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'ckpt-fx[plot]'")


def plot(rows: list[Row], path: str, *, title: str = "") -> None:
    """Peak memory (MB) against step time (ms), one labelled point per setup, each budget line
    (ours, torch's knob) drawn through its points and the Pareto front (no other setup both
    smaller and faster) drawn through; the ratios to the first setup on the opposite axes; failed
    setups listed under the plot. Saved as an image at `path`. Needs matplotlib."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r.error is None]
    failed = [r for r in rows if r.error is not None]
    front = pareto_front(done)
    ms = lambda r: 1e3 * r.step_s  # noqa: E731
    fig, ax = plt.subplots(figsize=(9, 6 + 0.22 * len(failed)))
    for r in done:
        ax.scatter(ms(r), r.peak_mb, color="tab:red" if r in front else "tab:gray", zorder=3)
    lines: dict[str, list[Row]] = {}
    for r in done:
        head, sep, _ = r.setup.rpartition("budget:")
        if sep:
            lines.setdefault(head + "budget", []).append(r)
    for name, members in lines.items():
        if len(members) < 2:
            continue
        members = sorted(members, key=lambda r: r.peak_mb)
        ax.plot([ms(r) for r in members], [r.peak_mb for r in members], alpha=0.6,
                linestyle="--" if name.startswith("ckpt") else ":", label=name)
    ordered = sorted(front, key=lambda r: r.step_s)
    ax.step([ms(r) for r in ordered], [r.peak_mb for r in ordered], where="post", color="tab:red", label="Pareto front")
    ref = rows[0] if rows and rows[0].error is None else None
    if ref is not None:  # ratios to the first setup on the top and right axes
        t0, m0 = ms(ref), ref.peak_mb
        ax.secondary_xaxis("top", functions=(lambda x: x / t0, lambda x: x * t0)).set_xlabel(f"step time / {ref.setup}'s")
        ax.secondary_yaxis("right", functions=(lambda y: y / m0, lambda y: y * m0)).set_ylabel(f"peak / {ref.setup}'s")
    ax.set_xlabel("step time (ms, median)")
    ax.set_ylabel("measured peak (MB)")
    fig.suptitle(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    if failed:
        fig.text(0.01, 0.01, "failed: " + "\n        ".join(f"{r.setup}: {r.error}"[:110] for r in failed),
                 fontsize=7, va="bottom", family="monospace")
    fig.tight_layout(rect=(0, 0.03 * len(failed), 1, 1))
    _label_points(fig, ax, [(r.setup, ms(r), r.peak_mb) for r in done])
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _label_points(fig, ax, points: list[tuple[str, float, float]]) -> list:
    """Label each point beside it where the label overlaps no label placed before it nor another
    point and stays inside the axes: the first free one of 32 positions beside it, nearest first
    (far ones with a line back to the point), else the least crowded of them. Returns the labels' boxes (display coordinates), in order."""
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    fig.canvas.draw()  # the axes' limits are settled at a draw: the points' places are final
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)  # a label inside the axes is not cut off
    offsets = [(dx, dy) for k in range(8) for dy in (3 + 8 * k, -9 - 8 * k) for dx in (5, -5)]
    marks = [Bbox.from_bounds(*(ax.transData.transform((x, y)) - 5), 10, 10) for _, x, y in points]
    taken: list = []
    for label, x, y in points:
        best = None
        for dx, dy in offsets:
            far = abs(dy) > 12  # a thin line back to its point
            text = ax.annotate(label, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=7,
                               ha="left" if dx > 0 else "right",
                               arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.5"} if far else None)
            text.update_positions(renderer)
            box = Text.get_window_extent(text, renderer).expanded(1.02, 1.1)  # the text, not its line
            outside = not (frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1)
            clash = sum(box.overlaps(t) for t in taken) + sum(box.overlaps(m) for m in marks) + outside
            if best is None or clash < best[0]:
                if best is not None:
                    best[1].remove()
                best = (clash, text, box)
            else:
                text.remove()
            if clash == 0:
                break
        taken.append(best[2])
    return taken


def pareto_front(rows: list[Row]) -> list[Row]:
    """The rows no other row beats on both peak and step time."""
    return [r for r in rows if not any(
        o is not r and o.peak_mb <= r.peak_mb and o.step_s <= r.step_s and (o.peak_mb < r.peak_mb or o.step_s < r.step_s)
        for o in rows)]


@dataclass(frozen=True, kw_only=True)
class SolverRow:
    """One solver at one budget on a model's recompute problem."""

    solver: str
    fraction: float
    cost_us: float | None
    """Recompute cost of its plan (microseconds on the roofline); None when it found none."""
    gap: float | None
    """cost / the proven optimum - 1 (0 when optimal; None without a proven optimum)."""
    seconds: float
    optimal: bool
    error: str | None = None


def joint_problem(workload: Workload):
    """The recompute problem (passes.solve.Problem) of the workload's first joint graph, as the
    budget policy builds it, and the number of nodes of that graph."""
    from passes.budget import build_problem
    from passes.select import hard_rules

    b = ckpt_backend(policy="none", compiler="eager")
    joints = []
    b.on_partitioned.append(lambda done: joints.append(done.joint))
    model = copy.deepcopy(workload.model)
    workload.loss(torch.compile(model, backend=b)).backward()
    torch.compiler.reset()
    joint = max(joints, key=lambda j: len(j.graph.nodes))
    return build_problem(joint, hard_rules=hard_rules(joint)).problem, len(joint.graph.nodes)


def solver_rows(problem, fractions: tuple[float, ...] = (0.7, 0.5, 0.3, 0.15), *,
                solvers: tuple[str, ...] = ("milp", "greedy", "parts", "auto"), node_limit: int = 100_000) -> list[SolverRow]:
    """Every solver at every budget (a fraction of the no-recompute saved bytes) on one problem;
    the gap is measured against the MILP's proven optimum."""
    from passes.budget import baseline_bytes
    from passes.solve import Infeasible, by_parts, greedy, milp, solve

    run = {
        "milp": lambda p, b: milp(p, b, node_limit=node_limit),
        "greedy": greedy,
        "parts": lambda p, b: by_parts(p, b, node_limit=node_limit),
        "auto": solve,
    }
    unknown = sorted(set(solvers) - set(run))
    if unknown:
        raise ValueError(f"unknown solver(s) {unknown}; valid: {', '.join(run)}")
    base = baseline_bytes(problem)
    rows = []
    for f in fractions:
        budget = int(f * base)
        results = {}
        for name in solvers:
            start = time.perf_counter()
            try:
                results[name] = (run[name](problem, budget), None)
            except Infeasible as error:
                results[name] = (None, str(error))
            results[name] += (time.perf_counter() - start,)
        best = results.get("milp", (None,))[0]
        optimum = best.cost if best is not None and best.optimal else None
        for name, (sol, error, seconds) in results.items():
            gap = None if sol is None or optimum is None else (sol.cost / optimum - 1 if optimum > 0 else float(sol.cost > 0))
            rows.append(SolverRow(solver=name, fraction=f, cost_us=None if sol is None else sol.cost * 1e6, gap=gap,
                                  seconds=seconds, optimal=bool(sol and sol.optimal), error=error))
    return rows


def solver_markdown(rows: list[SolverRow]) -> str:
    out = ["| budget | solver | recompute cost (us) | gap to optimum | proven optimal | seconds |",
           "|---:|---|---:|---:|---|---:|"]
    for r in rows:
        if r.error is not None:
            out.append(f"| {r.fraction} | {r.solver} | infeasible | | | {r.seconds:.2f} |")
            continue
        gap = f"{max(100 * r.gap, 0.0):.2f}%" if r.gap is not None else "-"  # no "-0.00%" from rounding
        out.append(f"| {r.fraction} | {r.solver} | {r.cost_us:.1f} | {gap} | {'yes' if r.optimal else 'no'} | {r.seconds:.2f} |")
    return "\n".join(out)
