"""The loss head, measured: a transformers Llama trained through `enable` with the head chunked and
with it whole, beside Hugging Face's own checkpointing; peaks of a real step, step times taken
interleaved (one step of each setup in turn, rounds of them), printed as ratios to HF's.

    python -m ckpt_fx.bench.head                      # Llama 8 x 256, vocabulary 32000, batch 4 x 512
    python -m ckpt_fx.bench.head --compiler inductor --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch

import ckpt_fx
from ckpt_fx.bench.workloads import hf_workload


def setups(model: torch.nn.Module, *, compiler: str) -> dict[str, torch.nn.Module]:
    """HF's checkpointing, and enable's default policy with the head whole and chunked."""
    hf = copy.deepcopy(model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    whole, chunked = copy.deepcopy(model), copy.deepcopy(model)
    ckpt_fx.enable(whole, compiler=compiler, head="whole")
    ckpt_fx.enable(chunked, compiler=compiler)
    return {"HF checkpointing": hf, "ckpt-fx, head whole": whole, "ckpt-fx, head chunked": chunked}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ckpt_fx.bench.head", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--compiler", choices=("eager", "inductor"), default="eager")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    work = hf_workload("LlamaConfig", layers=args.layers, dim=args.dim, vocab=args.vocab, batch=args.batch, seq=args.seq)
    kwargs = {k: v for k, v in work.kwargs.items() if k != "use_cache"}  # each setup's own switch decides
    models = setups(work.model, compiler=args.compiler)

    def step(m: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            m(**kwargs).loss.backward()
        return run

    peaks = {}
    for name, m in models.items():
        step(m)()  # compiles, and the gradients exist before the measured step, as in training
        peaks[name] = ckpt_fx.peak_bytes(step(m))
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, m in models.items():
            start = time.perf_counter()
            step(m)()
            times[name].append(time.perf_counter() - start)
    base = "HF checkpointing"
    print(f"{work.name}, torch {torch.__version__}, inner compiler {args.compiler}, {args.rounds} interleaved rounds")
    print("| setup | peak MB | peak vs HF | step s (median) | step vs HF | step vs head whole |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in models:
        t = statistics.median(times[name])
        print(f"| {name} | {peaks[name] / 2**20:.1f} | {peaks[name] / peaks[base]:.3f} | {t:.3f} | "
              f"{t / statistics.median(times[base]):.3f} | {t / statistics.median(times['ckpt-fx, head whole']):.3f} |")


if __name__ == "__main__":
    main()
