"""Side-by-side benchmark: peak memory and step time of one training step, every setup in one
process so the ratios compare. `python -m ckpt_fx bench --help`."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ckpt_fx.backend import backend as ckpt_backend
from ckpt_fx.explain import training_loss
from ckpt_fx.measure import peak_bytes
from passes.memory import step_peak_bytes

DEFAULT_SETUPS = ("eager", "checkpoint", "aot_eager", "ckpt:none", "ckpt:blocks", "ckpt:blocks:every=1,skip_first=0", "ckpt:segments:4", "ckpt:sqrt")


@dataclass(frozen=True, kw_only=True)
class Row:
    """One setup's measurements."""

    setup: str
    peak_mb: float
    peak_ratio: float
    step_s: float
    step_ratio: float
    grad_rel_diff: float
    predicted_mb: float | None
    compile_s: float


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


def _block_stack(model: torch.nn.Module) -> torch.nn.ModuleList:
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    if not lists:
        raise ValueError("setup 'checkpoint' needs a model with a ModuleList of blocks")
    return max(lists, key=len)


def _checkpoint_every_block(model: torch.nn.Module) -> torch.nn.Module:
    """What HF's gradient_checkpointing_enable does: torch.utils.checkpoint around every block."""
    if getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    for block in _block_stack(model):
        forward = block.forward
        block.forward = lambda *a, _f=forward, **k: torch.utils.checkpoint.checkpoint(_f, *a, use_reentrant=False, **k)
    return model


def _prepare(setup: str, model: torch.nn.Module):
    """(callable model, ckpt backend or None) for a setup name."""
    if setup == "eager":
        return model, None
    if setup == "checkpoint":
        return _checkpoint_every_block(model), None
    if setup in ("aot_eager", "inductor"):
        return torch.compile(model, backend=setup), None
    if setup.startswith("ckpt:"):
        b = ckpt_backend(policy=setup[len("ckpt:"):])
        return torch.compile(model, backend=b), b
    raise ValueError(f"unknown setup {setup!r}; valid: eager, checkpoint, aot_eager, inductor, ckpt:<policy>")


def run(workload: Workload, setups: tuple[str, ...] = DEFAULT_SETUPS, *, steps: int = 5,
        progress: Callable[[str], None] | None = None) -> list[Row]:
    """Measure every setup on the same model (fresh copy each) and batch; the first is the reference."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    results = []
    for k, setup in enumerate(setups, 1):
        if progress:
            progress(f"[{k}/{len(setups)}] {setup}")
        model = copy.deepcopy(workload.model)
        fn, b = _prepare(setup, model)

        def step() -> None:
            torch.manual_seed(1234)
            workload.loss(fn).backward()

        def clear() -> None:
            for p in model.parameters():
                p.grad = None

        start = time.perf_counter()
        step()
        compile_s = time.perf_counter() - start
        clear()
        peak = peak_bytes(step)
        grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
        times = []
        for _ in range(steps):
            clear()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        clear()
        torch._dynamo.reset()
        predicted = step_peak_bytes(b.plans) / 2**20 if b is not None and b.plans else None
        results.append((setup, peak, statistics.median(times), grads, predicted, compile_s))
    ref_peak, ref_time, ref_grads = results[0][1], results[0][2], results[0][3]
    rows = []
    for setup, peak, t, grads, predicted, compile_s in results:
        num = den = 0.0
        for g, r in zip(grads, ref_grads):
            if g is not None and r is not None:
                num += (g.double() - r.double()).pow(2).sum().item()
                den += r.double().pow(2).sum().item()
        rows.append(Row(setup=setup, peak_mb=peak / 2**20, peak_ratio=peak / ref_peak, step_s=t, step_ratio=t / ref_time,
                        grad_rel_diff=(num / den) ** 0.5 if den else 0.0, predicted_mb=predicted, compile_s=compile_s))
    return rows


def markdown(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    out = ["| setup | peak MB | x ref | step s | x ref | grad rel diff | predicted MB | compile s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        pred = f"{r.predicted_mb:.1f}" if r.predicted_mb is not None else "-"
        out.append(f"| {r.setup} | {r.peak_mb:.1f} | {r.peak_ratio:.3f} | {r.step_s:.3f} | {r.step_ratio:.2f} | "
                   f"{r.grad_rel_diff:.1e} | {pred} | {r.compile_s:.1f} |")
    return "\n".join(out)


def as_dicts(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]
