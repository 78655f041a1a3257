"""Compile time under Inductor: each setup's first training step minus a warm one, with the FX
graph and autograd caches off, on transformers' Llama (SDPA attention, grouped-query) of LAYERS
blocks 256 wide, batch 2 x 512 (Inductor alone, then ckpt policies with Inductor as the inner
compiler).

    python tests/compile_time.py [LAYERS [SETUPS]] [--cold | --warm]    LAYERS 6 and the three SETUPS if not given
    e.g. python tests/compile_time.py 6 inductor,budget:0.5,blocks --cold

By default the setups run one after another in one process. Inductor's compiled C++ kernels are
then shared: a later setup reuses the kernels an earlier one compiled (Inductor's own cache, in
memory and on disk), so the first setup pays for kernels the later ones find ready. The memory
pass's schedules of alike blocks are forgotten between setups (a later setup would find the blocks
an earlier one scheduled). With --cold each setup runs in a process of its own with an empty
Inductor cache directory: every setup compiles all its kernels, as on a first run. With --warm
each setup runs twice, each time in a process of its own, with a cache directory of its own: the
first run compiles its kernels, the second, timed, finds all of them on disk and pays for the rest
of compiling (tracing, planning, lowering, code generation).

The ckpt setups also print the time of each planning pass (the ckpt_fx logger at DEBUG), and the
last line gives each setup's compile time over Inductor alone's where that setup ran.
"""
import logging
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

import ckpt_fx
import passes.inductor_memory
from ckpt_fx.bench.workloads import hf_workload

USAGE = ("usage: python tests/compile_time.py [LAYERS [SETUPS]] [--cold | --warm], "
         "e.g. 6 inductor,budget:0.5,blocks --cold")
RESULT = re.compile(r"^(\S+)\s+layers=\d+ compile=\s*([0-9.]+)s", re.MULTILINE)


def compile_seconds(name: str, layers: int) -> float:
    """One setup's compile time in this process: its first step minus a warm one."""
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
    return first - warm


def own_process_seconds(name: str, layers: int, runs: int) -> float:
    """One setup's compile time in a process of its own, with an Inductor cache directory of its
    own, empty before the first of `runs` runs; the last run's time."""
    with tempfile.TemporaryDirectory(prefix="ckpt-fx-inductor-cache-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        for _ in range(runs):
            done = subprocess.run([sys.executable, __file__, str(layers), name], env=env,
                                  stdout=subprocess.PIPE, text=True)
            if done.returncode != 0:
                break
    sys.stdout.write(done.stdout)
    found = RESULT.search(done.stdout)
    if done.returncode != 0 or found is None:
        sys.exit(f"compile_time.py: the setup {name!r} failed in its own process (exit {done.returncode})")
    return float(found.group(2))


def main() -> None:
    modes = [a for a in sys.argv[1:] if a in ("--cold", "--warm")]
    args = [a for a in sys.argv[1:] if a not in modes]
    if len(modes) > 1:
        sys.exit(f"compile_time.py: --cold and --warm exclude each other, got {' '.join(modes)}; {USAGE}")
    if len(args) > 2 or (args and not args[0].isdigit()):
        sys.exit(f"compile_time.py: expected LAYERS (a whole number of blocks) and at most one comma-separated list of SETUPS, got {' '.join(sys.argv[1:])!r}; {USAGE}")
    layers = int(args[0]) if args else 6
    setups = (args[1] if len(args) > 1 else "inductor,budget:0.5,blocks").split(",")
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("ckpt_fx").setLevel(logging.DEBUG)
    torch.manual_seed(0)
    mode = modes[0] if modes else None
    seconds = {name: own_process_seconds(name, layers, runs=1 if mode == "--cold" else 2) if mode
               else compile_seconds(name, layers) for name in setups}
    if "inductor" in seconds and len(seconds) > 1:
        ratios = ", ".join(f"{name} {s / seconds['inductor']:.2f}x" for name, s in seconds.items() if name != "inductor")
        how = {"--cold": "each setup in its own process, its kernels compiled",
               "--warm": "each setup in its own process, its kernels on disk",
               None: "one process, kernels shared"}[mode]
        print(f"over Inductor alone ({how}): {ratios}")


if __name__ == "__main__":
    main()
