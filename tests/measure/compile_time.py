"""Compile time under Inductor: each setup's first training step minus a warm one, with the FX
graph and autograd caches off, on transformers' Llama (SDPA attention, grouped-query) of LAYERS
blocks 256 wide, batch 2 x 512 (Inductor alone, then ckpt policies with Inductor as the inner
compiler).

    python tests/measure/compile_time.py [LAYERS [SETUPS]] [--cold | --warm] [--rounds N] [--kv-heads K]
    e.g. python tests/measure/compile_time.py 6 inductor,budget:0.5,blocks --cold --rounds 3 --kv-heads 4

LAYERS 6 and the three SETUPS if not given; --kv-heads 4 is multi-head attention (the default, 2,
grouped-query). With --cold or --warm, --rounds N runs the setups in turn N times (round 1: each
setup once, then round 2, ...), so that a machine's drift falls on every setup alike; the ratios
printed are the medians over the rounds of each round's ratio.

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
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import ckpt_fx
import passes.inductor_memory
from ckpt_fx.bench.workloads import hf_workload

USAGE = ("usage: python tests/measure/compile_time.py [LAYERS [SETUPS]] [--cold | --warm] [--rounds N] [--kv-heads K], "
         "e.g. 6 inductor,budget:0.5,blocks --cold --rounds 3")
RESULT = re.compile(r"^(\S+)\s+layers=\d+ compile=\s*([0-9.]+)s", re.MULTILINE)


def compile_seconds(name: str, layers: int, kv_heads: int = 2) -> float:
    """One setup's compile time in this process: its first step minus a warm one."""
    torch._dynamo.reset()
    passes.inductor_memory._SEGMENT_SCHEDULES.clear()
    workload = hf_workload("LlamaConfig", layers=layers, dim=256, heads=4, batch=2, seq=512,
                           overrides={"num_key_value_heads": kv_heads})
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


def own_process_seconds(name: str, layers: int, runs: int, kv_heads: int = 2) -> float:
    """One setup's compile time in a process of its own, with an Inductor cache directory of its
    own, empty before the first of `runs` runs; the last run's time."""
    with tempfile.TemporaryDirectory(prefix="ckpt-fx-inductor-cache-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        for _ in range(runs):
            done = subprocess.run([sys.executable, __file__, str(layers), name, "--kv-heads", str(kv_heads)], env=env,
                                  stdout=subprocess.PIPE, text=True)
            if done.returncode != 0:
                break
    sys.stdout.write(done.stdout)
    found = RESULT.search(done.stdout)
    if done.returncode != 0 or found is None:
        sys.exit(f"compile_time.py: the setup {name!r} failed in its own process (exit {done.returncode})")
    return float(found.group(2))


def main() -> None:
    argv = sys.argv[1:]
    modes = [a for a in argv if a in ("--cold", "--warm")]
    options = {"--rounds": 1, "--kv-heads": 2}
    args = []
    while argv:
        a = argv.pop(0)
        if a in options:
            if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
                sys.exit(f"compile_time.py: {a} takes a whole number >= 1; {USAGE}")
            options[a] = int(argv.pop(0))
        elif a not in modes:
            args.append(a)
    if len(modes) > 1:
        sys.exit(f"compile_time.py: --cold and --warm exclude each other, got {' '.join(modes)}; {USAGE}")
    if len(args) > 2 or (args and not args[0].isdigit()):
        sys.exit(f"compile_time.py: expected LAYERS (a whole number of blocks) and at most one comma-separated list of SETUPS, got {' '.join(sys.argv[1:])!r}; {USAGE}")
    mode, rounds, kv_heads = (modes[0] if modes else None), options["--rounds"], options["--kv-heads"]
    if rounds > 1 and mode is None:
        sys.exit(f"compile_time.py: --rounds needs --cold or --warm (in one process the setups share kernels); {USAGE}")
    layers = int(args[0]) if args else 6
    setups = (args[1] if len(args) > 1 else "inductor,budget:0.5,blocks").split(",")
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("ckpt_fx").setLevel(logging.DEBUG)
    torch.manual_seed(0)
    per_round = []
    for _ in range(rounds):
        per_round.append({name: own_process_seconds(name, layers, runs=1 if mode == "--cold" else 2, kv_heads=kv_heads)
                          if mode else compile_seconds(name, layers, kv_heads) for name in setups})
    if "inductor" in setups and len(setups) > 1:
        def ratio(name: str) -> str:
            each = [r[name] / r["inductor"] for r in per_round]
            rounds_shown = f" (rounds: {', '.join(f'{x:.2f}' for x in each)})" if rounds > 1 else ""
            return f"{name} {statistics.median(each):.2f}x{rounds_shown}"

        ratios = ", ".join(ratio(name) for name in setups if name != "inductor")
        how = {"--cold": "each setup in its own process, its kernels compiled",
               "--warm": "each setup in its own process, its kernels on disk",
               None: "one process, kernels shared"}[mode]
        print(f"over Inductor alone ({how}; {kv_heads} key/value heads of 4; {rounds} round(s)): {ratios}")


if __name__ == "__main__":
    main()
