"""Side-by-side benchmark: peak memory and step time of one training step, every setup in one
process so the ratios compare (`python -m ckpt_fx bench --help`); the rows as a table, a
dominance list and a plot. The workloads are in ckpt_fx.bench.workloads, the setups in ckpt_fx.bench.setups."""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ckpt_fx.measure import peak_bytes
from ckpt_fx.bench.setups import CPU_EAGER_SETUPS, Setup, parse_setups
from ckpt_fx.bench.workloads import Workload
from passes._compat import dynamo_recompile_limit, inductor_random_as_eager, no_fx_graph_cache
from passes.plan import step_peak_bytes


@dataclass(frozen=True, kw_only=True)
class Row:
    """One setup's measurements."""

    setup: str
    ours: bool
    """A ckpt setup (ours), not a peer's."""
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


def run(workload: Workload, setups: tuple[str, ...] = CPU_EAGER_SETUPS, *, steps: int = 5, amp: bool = False,
        progress: bool = False, fallback_random: bool = False) -> list[Row]:
    """Measure every setup on the same model (fresh copy each) and batch; the first is the reference.

    amp=True runs every step under bf16 autocast. fallback_random=True has Inductor draw random
    numbers as eager does (torch._inductor.config.fallback_random), so the gradient column compares
    Inductor setups with dropout too. A setup that fails (an infeasible budget) gets a row with its
    error; the first setup must run. progress=True draws a progress bar on stderr. A bad setup name
    is refused (ValueError naming the valid forms) before anything runs.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    parsed = parse_setups(setups)
    held: list[Held | Measured] = []
    bar = _bar(len(parsed) + 1) if progress else None  # on stderr: elapsed time and what is left
    # Every setup is compiled and kept (Dynamo compiles the model once per setup: its cache tells
    # backends apart), then all are timed together (Note [Timing the setups together]).
    with dynamo_recompile_limit(8 + 2 * len(parsed)):
        try:
            for k, setup in enumerate(parsed, 1):
                if bar is not None:
                    bar.set_postfix_str(setup.name)
                try:
                    # Cold compiles: a plan served from Inductor's FX graph cache (an earlier run of
                    # the same setup) would report no plan and a compile time that measures nothing.
                    with no_fx_graph_cache(), inductor_random_as_eager(fallback_random):
                        held.append(_compile_and_measure_peak(workload, setup, amp=amp))
                except Exception as error:  # noqa: BLE001 - reported in the row, the other setups still run
                    if k == 1:
                        raise
                    message = str(getattr(error, "inner_exception", None) or error).strip().splitlines()[-1]
                    held.append(Measured(setup=setup, error=message[:300]))
                if bar is not None:
                    bar.update(1)
            if bar is not None:
                bar.set_postfix_str(f"timing {steps} rounds")
            with no_fx_graph_cache(), inductor_random_as_eager(fallback_random):
                _time_together([h for h in held if isinstance(h, Held)], steps=steps)
        finally:
            torch.compiler.reset()
    if bar is not None:
        bar.update(1)
        bar.close()
    results = [h.measured() if isinstance(h, Held) else h for h in held]
    ref = results[0]
    dropout = workload.model.training and any(
        isinstance(m, torch.nn.Dropout) and m.p > 0 for m in workload.model.modules())
    rows = []
    for m in results:
        other_numbers = dropout and not fallback_random and m.setup.inductor_draws != ref.setup.inductor_draws
        rows.append(Row(
            setup=m.setup.name, ours=m.setup.ours, peak_mb=m.peak / 2**20, peak_ratio=m.peak / ref.peak, step_s=m.step_s,
            step_ratio=m.step_s / ref.step_s, grad_rel_diff=math.nan if other_numbers else _rel_diff(m.grads, ref.grads),
            predicted_mb=m.predicted_mb, compile_s=m.compile_s, recompute_gflop=m.recompute_gflop, error=m.error,
            grad_note=RNG_NOTE if other_numbers and m.error is None else None,
        ))
    return rows


def _rel_diff(grads: list[torch.Tensor | None] | None, ref: list[torch.Tensor | None]) -> float:
    """||grads - ref|| / ||ref|| over the parameters both have; NaN without gradients."""
    if grads is None:
        return math.nan
    num = den = 0.0
    for g, r in zip(grads, ref):
        if g is not None and r is not None:
            num += (g.double() - r.double()).pow(2).sum().item()
            den += r.double().pow(2).sum().item()
    return (num / den) ** 0.5 if den else 0.0


RNG_NOTE = ("n/a: dropout drawn by Inductor's own random numbers, not eager's; --fallback-random compares "
            "them (torch._inductor.config.fallback_random=True)")


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What one setup's run measured (NaN and None where it failed: see error)."""

    setup: Setup
    peak: float = math.nan
    """Bytes, the peak of one training step above what was allocated before it."""
    step_s: float = math.nan
    """Median seconds of a step."""
    grads: list[torch.Tensor | None] | None = None
    predicted_mb: float | None = None
    compile_s: float = math.nan
    recompute_gflop: float | None = None
    error: str | None = None


def _bar(total: int):
    """A progress bar over the setups on stderr, with elapsed time and an estimate of what is left."""
    from tqdm import tqdm

    return tqdm(total=total, unit="setup", file=sys.stderr, dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} setups [{elapsed} elapsed, {remaining} left]{postfix}")


@dataclass(kw_only=True)
class Held:
    """A compiled setup, its peak and gradients measured, kept for timing."""

    setup: Setup
    step: Callable[[], None]
    """One training step, the gradients cleared first and the device synchronized after."""
    peak: float
    grads: list[torch.Tensor | None]
    predicted_mb: float | None
    compile_s: float
    recompute_gflop: float | None
    times: list[float] = field(default_factory=list)

    def measured(self) -> Measured:
        return Measured(setup=self.setup, peak=self.peak, step_s=statistics.median(self.times), grads=self.grads,
                        predicted_mb=self.predicted_mb, compile_s=self.compile_s, recompute_gflop=self.recompute_gflop)


def _compile_and_measure_peak(workload: Workload, setup: Setup, *, amp: bool) -> Held:
    """A fresh copy of the model set up and compiled by its first step; the peak of the next step
    and its gradients measured."""
    model = copy.deepcopy(workload.model)
    fn, b, patch = setup.prepare(model)
    cast = (lambda: torch.autocast(_device(model), dtype=torch.bfloat16)) if amp else contextlib.nullcontext
    device = _device(model)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step() -> None:
        torch.manual_seed(1234)
        with patch(), cast():
            loss = workload.loss(fn)
        loss.backward()

    def clear() -> None:
        for p in model.parameters():
            p.grad = None

    start = time.perf_counter()
    step()
    sync()
    compile_s = time.perf_counter() - start
    clear()
    if b is not None:
        b.runs.clear()  # from here on: the graphs the measured step runs
    peak = peak_bytes(step, device=device)
    ran = b.plans_as_run() if b is not None else []
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    clear()

    def timed_step() -> None:
        clear()
        sync()
        step()
        sync()

    predicted = step_peak_bytes(ran) / 2**20 if ran else None
    flops = sum(p.recompute_flops for p in ran) / 1e9 if ran else None
    return Held(setup=setup, step=timed_step, peak=peak, grads=grads, predicted_mb=predicted, compile_s=compile_s,
                recompute_gflop=flops)


def _time_together(held: list[Held], *, steps: int) -> None:
    """`steps` rounds, each one step of every setup, forward and backward through the list in
    turn (Note [Timing the setups together]); each step's seconds appended to its setup's times."""
    for r in range(steps):
        for h in held if r % 2 == 0 else reversed(held):
            start = time.perf_counter()
            h.step()
            h.times.append(time.perf_counter() - start)


# Note [Timing the setups together]
# A shared machine's speed drifts over minutes: on the 2-core CPU this project runs on, Inductor
# alone on GPT-2 6x384 took a median 0.650 s a step at first and 0.791 s a few minutes later, the
# same compiled code. Timed one setup after another, two setups with the same plan (Inductor
# alone and ckpt:none) came out 15% apart. So the bench compiles every setup first and keeps them
# all (the model once per setup: mind a large model on a small device), then times them in
# rounds, one step of each setup per round, the order reversed every other round: drift slows
# every setup alike, and each setup's median compares.


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
    ours = [r for r in rows if r.error is None and r.ours]
    out: dict[str, str | None] = {}
    for r in rows:
        if r.error is not None or r.ours:
            continue
        better = [o for o in ours if o.peak_mb <= r.peak_mb and o.step_s <= r.step_s]
        out[r.setup] = min(better, key=lambda o: (o.peak_mb, o.step_s)).setup if better else None
    return out


TIE = 0.02
"""A ckpt setup at a peak at or below a peer's whose step time is within this fraction above the
peer's ties with it: setups with the same plan differ by 2-3% in one run."""


def ties(rows: list[Row]) -> dict[str, str]:
    """For every peer no ckpt row dominates, the ckpt row of least peak among those at or below
    its peak and within TIE of its step time, where there is one."""
    ours = [r for r in rows if r.error is None and r.ours]
    by_setup = {r.setup: r for r in rows}
    out: dict[str, str] = {}
    for peer, by in dominators(rows).items():
        r = by_setup[peer]
        near = [o for o in ours if o.peak_mb <= r.peak_mb and o.step_s <= (1 + TIE) * r.step_s]
        if by is None and near:
            out[peer] = min(near, key=lambda o: (o.peak_mb, o.step_s)).setup
    return out


def dominance_markdown(rows: list[Row]) -> str:
    """One line per peer: the ckpt setup that dominates it, one that ties with it (TIE), or that
    none does."""
    by_setup = {r.setup: r for r in rows}
    tied = ties(rows)
    out = []
    for peer, by in dominators(rows).items():
        if by:
            out.append(f"- {peer}: dominated by {by}")
        elif peer in tied:
            r, o = by_setup[peer], by_setup[tied[peer]]
            out.append(f"- {peer}: tied with {o.setup} ({o.peak_mb:.1f} vs {r.peak_mb:.1f} MB, "
                       f"{100 * (o.step_s / r.step_s - 1):+.1f}% step time: within {TIE:.0%})")
        else:
            out.append(f"- {peer}: no ckpt setup has both peak and step time <= it")
    return "\n".join(out)


def as_dicts(rows: list[Row]) -> list[dict]:
    """The rows as plain dicts for strict JSON: a number a failed setup did not measure is None."""
    return [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(r).items()} for r in rows]
