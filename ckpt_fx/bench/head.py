"""The loss head, measured: a transformers Llama trained through `enable` with the head chunked and
with it whole, beside Hugging Face's own checkpointing, and beside HF's checkpointing with a peer's
loss head where it is installed (torchtune's chunked-output cross-entropy; cut-cross-entropy's
PyTorch implementation, the one that runs on a CPU); peaks of a real step, step times taken
interleaved (one step of each setup in turn, rounds of them), printed as ratios to HF's.

    python -m ckpt_fx.bench.head                      # Llama 8 x 256, vocabulary 32000, batch 4 x 512
    python -m ckpt_fx.bench.head --compiler inductor --rounds 5
    python -m ckpt_fx bench --head --model hf:Qwen3Config --config vocab_size=151936 --batch 2 --seq 512

The last form takes any transformers causal LM the bench's --model names (a config file, gpt2,
hf:<ConfigClass>). The peers are given the backbone's hidden states and the model's output
embedding: a model whose own loss does more than a cross-entropy over that projection (a logit
soft-cap) is compared on its peak, not its loss.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import ckpt_fx
from ckpt_fx.bench.workloads import hf_workload


def _hf(model: torch.nn.Module) -> torch.nn.Module:
    hf = copy.deepcopy(model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return hf


def _torchtune_loss() -> Any | None:
    """torchtune's CEWithChunkedOutputLoss class, read from its own file (the package's __init__
    asks for torchao, which the loss does not use); None where torchtune is not installed."""
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "modules" / "loss" / "ce_chunked_output_loss.py"
    module_spec = importlib.util.spec_from_file_location("torchtune_ce_chunked_output_loss", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.CEWithChunkedOutputLoss


def _peer_steps(model: torch.nn.Module, kwargs: dict[str, Any], *,
                device: str = "cpu") -> dict[str, tuple[torch.nn.Module, Callable[[], None]]]:
    """HF's checkpointing on the blocks with a peer's loss head in place of the model's, for each
    peer installed: the backbone's hidden states, shifted as the model's own loss shifts, then the
    peer's loss over the head's weight. On a GPU cut-cross-entropy runs its own kernel and
    Liger's fused linear cross-entropy joins (both are GPU kernels; on a CPU cut-cross-entropy's
    PyTorch implementation runs)."""
    peers = {}
    ids, labels = kwargs["input_ids"], kwargs["labels"]
    chunked_loss = _torchtune_loss()
    if chunked_loss is not None:
        tt = _hf(model)
        loss_fn = chunked_loss(num_output_chunks=8)

        def torchtune_step() -> None:
            h = tt.base_model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
            head = tt.get_output_embeddings()
            logits = [head(c) for c in h.chunk(loss_fn.num_output_chunks, dim=1)]
            target = labels[:, 1:]
            (loss_fn(logits, target) / (target != -100).sum()).backward()

        peers["HF checkpointing + torchtune chunked CE (8)"] = (tt, torchtune_step)
    if importlib.util.find_spec("cut_cross_entropy") is not None:
        from cut_cross_entropy import linear_cross_entropy

        cce = _hf(model)

        impl = "cce" if device == "cuda" else "torch_compile"

        def cce_step() -> None:
            h = cce.base_model(input_ids=ids, use_cache=False).last_hidden_state
            linear_cross_entropy(h, cce.get_output_embeddings().weight, labels, shift=True, impl=impl).backward()

        peers[f"HF checkpointing + cut-cross-entropy ({impl})"] = (cce, cce_step)
    if device == "cuda" and importlib.util.find_spec("liger_kernel") is not None:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger, fused = _hf(model), LigerFusedLinearCrossEntropyLoss()

        def liger_step() -> None:
            h = liger.base_model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
            fused(liger.get_output_embeddings().weight, h.reshape(-1, h.shape[-1]),
                  labels[:, 1:].reshape(-1)).backward()

        peers["HF checkpointing + Liger fused linear cross-entropy"] = (liger, liger_step)
    return peers


def require_causal_lm(model: torch.nn.Module, kwargs: dict[str, Any], name: str) -> None:
    """ValueError unless the workload is a transformers causal LM fed token ids and labels."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not hasattr(model, "base_model") or "labels" not in kwargs or "input_ids" not in kwargs:
        raise ValueError(f"the head bench needs a transformers causal LM fed input_ids and labels (a config file, "
                         f"gpt2 or hf:<ConfigClass>), got {name}")


def setups(model: torch.nn.Module, kwargs: dict[str, Any], *, compiler: str,
           device: str = "cpu") -> dict[str, Callable[[], None]]:
    """HF's checkpointing, enable's default policy with the head whole and chunked, and the peers
    installed: each a training step."""
    whole, chunked = copy.deepcopy(model), copy.deepcopy(model)
    ckpt_fx.enable(whole, compiler=compiler, head="whole")
    ckpt_fx.enable(chunked, compiler=compiler)

    def step(m: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            m(**kwargs).loss.backward()
        return run

    steps = {"HF checkpointing": step(_hf(model)), "ckpt-fx, head whole": step(whole),
             "ckpt-fx, head chunked": step(chunked)}
    steps.update({name: run for name, (_, run) in _peer_steps(model, kwargs, device=device).items()})
    return steps


def table(work: Any, *, compiler: str, rounds: int, device: str = "cpu") -> str:
    """Each setup's measured peak and interleaved median step time on `work` (a causal LM
    Workload) on `device` ("cpu" or "cuda"), as a markdown table headed by what ran."""
    require_causal_lm(work.model, work.kwargs, work.name)
    model = work.model.to(device)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in work.kwargs.items()
              if k != "use_cache"}  # each setup's own switch decides
    steps = setups(model, kwargs, compiler=compiler, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    peaks = {}
    for name, run in steps.items():
        run()  # compiles, and the gradients exist before the measured step, as in training
        peaks[name] = ckpt_fx.peak_bytes(run, device=device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, run in steps.items():
            sync()
            start = time.perf_counter()
            run()
            sync()
            times[name].append(time.perf_counter() - start)
    base = "HF checkpointing"
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    lines = [f"{work.name}, {where}, torch {torch.__version__}, inner compiler {compiler}, {rounds} interleaved rounds",
             "| setup | peak MB | peak vs HF | step s (median) | step vs HF | step vs head whole |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in steps:
        t = statistics.median(times[name])
        lines.append(f"| {name} | {peaks[name] / 2**20:.1f} | {peaks[name] / peaks[base]:.3f} | {t:.3f} | "
                     f"{t / statistics.median(times[base]):.3f} | "
                     f"{t / statistics.median(times['ckpt-fx, head whole']):.3f} |")
    return "\n".join(lines)


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
    print(table(work, compiler=args.compiler, rounds=args.rounds))


if __name__ == "__main__":
    main()
