"""Compile time under Inductor: each setup's first training step minus a warm one, with the FX
graph and autograd caches off, on transformers' Llama (SDPA attention, grouped-query) of LAYERS
blocks 256 wide, batch 2 x 512; setups one after another in one process (Inductor alone, then ckpt
policies with Inductor as the inner compiler), the memory pass's schedules of alike blocks
forgotten between setups (a later setup would find the blocks an earlier one scheduled).

    python tests/compile_time.py LAYERS [SETUPS]      e.g. python tests/compile_time.py 6 inductor,budget:0.5,blocks

The ckpt setups also print the time of each planning pass (the ckpt_fx logger at DEBUG).
"""
import logging
import sys
import time

import torch

import ckpt_fx
import passes.inductor_memory
from ckpt_fx.bench.workloads import hf_workload

torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False
logging.basicConfig(level=logging.WARNING)
logging.getLogger("ckpt_fx").setLevel(logging.DEBUG)


def main() -> None:
    if len(sys.argv) > 1 and not sys.argv[1].isdigit():
        sys.exit(f"compile_time.py: LAYERS must be a whole number of blocks, got {sys.argv[1]!r}; "
                 "usage: python tests/compile_time.py LAYERS [SETUPS], e.g. 6 inductor,budget:0.5,blocks")
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    setups = (sys.argv[2] if len(sys.argv) > 2 else "inductor,budget:0.5,blocks").split(",")
    torch.manual_seed(0)
    for name in setups:
        torch._dynamo.reset()
        passes.inductor_memory._SEGMENT_SCHEDULES.clear()
        workload = hf_workload("LlamaConfig", layers=layers, dim=256, heads=4, batch=2, seq=512)  # 2 key/value heads
        backend = "inductor" if name == "inductor" else ckpt_fx.backend(policy=name, compiler="inductor")
        compiled = torch.compile(workload.model, backend=backend)
        start = time.perf_counter()
        workload.loss(compiled).backward()
        first = time.perf_counter() - start
        start = time.perf_counter()
        workload.loss(compiled).backward()
        warm = time.perf_counter() - start
        print(f"{name:14s} layers={layers} compile={first - warm:6.1f}s warm step={warm:.2f}s", flush=True)


if __name__ == "__main__":
    main()
