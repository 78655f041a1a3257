"""GPU check, for a machine with CUDA: `python tests/measure/gpu_check.py [--out DIR]` (about 7 minutes).

1. The CUDA-parametrized tests (parity property, dropout, BatchNorm, autocast fp16/bf16, measured
   memory ordering).
2. `python -m ckpt_fx bench --device cuda` on the built-in LLaMA-style model with the eager inner
   compiler, fp32 and bf16 autocast: per policy, `max_memory_allocated` of a training step, step
   time, and the gradients' relative difference from eager.
3. transformers' GPT-2 with Inductor: `bench --sweep 0.7,0.5,0.3`, our budget line beside torch's
   activation memory budget at each budget, Inductor alone beside `ckpt:none`, torch's op-level
   selective checkpointing beside `ckpt:selective`, and HF per-block checkpointing; each peer
   marked with the ckpt setup that dominates it.
4. Offload on the built-in LLaMA-style model (bf16 autocast, Inductor): `offload` and a budget with
   offload beside `blocks`, torch's knob and torch's offload of hand-tagged matmul outputs
   (`inductor-offload`): device peak, step time, and each offload plan's measured device peak
   against its prediction (within 10% expected).
5. The loss head (`bench --head`, Inductor): a Llama of 2 blocks 2048 wide with Llama-3's
   vocabulary (128256), batch 4 x 1024: HF's checkpointing, ours with the head whole and chunked,
   and the peers installed (torchtune's chunked cross-entropy, cut-cross-entropy's kernel, Liger's
   fused linear cross-entropy: `pip install torchtune cut-cross-entropy liger-kernel`).

Prints the tables; exits non-zero when a test fails, a section fails or times out, or a ckpt
setup's gradients differ from eager's by more than rounding (1e-4 relative in fp32, 2e-2 in bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
POLICIES = ("none", "blocks", "blocks:every=1,skip_first=0", "sqrt", "selective", "budget:0.5", "budget:0.3")
LLAMA = ["--model", "llama", "--layers", "8", "--dim", "512", "--heads", "8", "--batch", "8", "--seq", "512"]
# Dropout off: Inductor draws its own random numbers, so with dropout no compiled setup's
# gradients would compare with eager's.
GPT2 = ["--model", "gpt2", "--config", "resid_pdrop=0,embd_pdrop=0,attn_pdrop=0",
        "--layers", "6", "--dim", "768", "--heads", "12", "--batch", "8", "--seq", "1024"]
SWEEP = "0.7,0.5,0.3"
HEAD = ["--model", "hf:LlamaConfig", "--layers", "2", "--dim", "2048", "--heads", "16", "--config",
        "vocab_size=128256,intermediate_size=8192", "--batch", "4", "--seq", "1024"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for the logs and JSON (default: a temporary one)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a rehearsal of the script itself (with --quick), not a GPU check")
    parser.add_argument("--quick", action="store_true", help="tiny models (a rehearsal)")
    args = parser.parse_args()
    import tempfile

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (rehearsal)"
    print(f"{where}; torch {torch.__version__}; logs in {out}", flush=True)
    failures = []

    def section(name: str, command: list[str], timeout: float, extra_env: dict | None = None) -> bool:
        start = time.perf_counter()
        with open(out / f"{name}.log", "w") as log:
            try:
                done = subprocess.run(command, cwd=ROOT, env={**env, **(extra_env or {})}, stdout=log,
                                      stderr=subprocess.STDOUT, timeout=timeout)
                ok = done.returncode == 0
                why = f"exit {done.returncode}"
            except subprocess.TimeoutExpired:
                ok, why = False, f"timed out after {timeout:.0f} s"
        print(f"\n## {name}: {'ok' if ok else why} ({time.perf_counter() - start:.0f} s)", flush=True)
        if not ok:
            failures.append(f"{name}: {why}")
        return ok

    if not args.skip_tests:
        section("tests", [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-k", "cuda",
                          "tests/test_parity.py", "tests/test_training_features.py", "tests/test_memory.py"], 150)
        print(_tail(out / "tests.log", 25))

    runs = [  # name, model, setups, bf16 autocast, gradient tolerance, seconds allowed
        ("llama-fp32", LLAMA, [f"ckpt-eager:{p}" for p in POLICIES], False, 1e-4, 100),
        ("llama-bf16", LLAMA, [f"ckpt-eager:{p}" for p in POLICIES], True, 2e-2, 100),
        ("gpt2-inductor", GPT2, None, False, 1e-4, 420),
        ("llama-offload", LLAMA, ["ckpt:blocks:every=1,skip_first=0", "ckpt:offload:every=1,skip_first=0",
                                  "ckpt:offload", "ckpt:budget:0.3", "ckpt:budget:0.3,offload", "inductor-budget:0.3",
                                  "inductor-offload"], True, 2e-2, 240),
    ]
    for name, model, setups, amp, tolerance, seconds in runs:
        if args.quick:
            model = [*model[:-10], "--layers", "3", "--dim", "64", "--heads", "2", "--batch", "2", "--seq", "64"]
        if setups is None:
            selection, shown = ["--sweep", SWEEP], 7 + 2 * len(SWEEP.split(",")) + 14
        else:
            selection, shown = ["--setups", ";".join(["eager", "checkpoint", *setups])], len(setups) + 6
        command = [sys.executable, "-m", "ckpt_fx", "bench", "--device", args.device, *model, "--steps", "5",
                   *selection, "--json", str(out / f"{name}.json"), *(["--amp"] if amp else [])]
        if section(name, command, seconds if args.device == "cuda" else 10 * seconds):
            print(_tail(out / f"{name}.log", shown))
            for row in json.loads((out / f"{name}.json").read_text()):
                if row["error"] and "infeasible" in row["error"]:
                    print(f"note: {row['setup']}: {row['error']}")
                elif row["error"]:
                    failures.append(f"{name} {row['setup']}: {row['error']}")
                elif row["setup"].startswith("ckpt") and not row["grad_rel_diff"] <= tolerance:
                    failures.append(f"{name} {row['setup']}: gradients differ from eager by {row['grad_rel_diff']:.1e}")
                elif "offload" in row["setup"] and row["setup"].startswith("ckpt") and row["predicted_mb"]:
                    ratio = row["peak_mb"] / row["predicted_mb"]
                    print(f"offload prediction: {row['setup']}: measured {row['peak_mb']:.1f} MB, predicted "
                          f"{row['predicted_mb']:.1f} MB ({ratio:.3f}x){'' if abs(ratio - 1) <= 0.1 else '  OUTSIDE 10%'}")
        else:
            print(_tail(out / f"{name}.log", 30))
    head = HEAD if not args.quick else [*HEAD[:4], "--dim", "64", "--heads", "2", "--config", "vocab_size=4000",
                                         "--batch", "2", "--seq", "128"]
    if section("head", [sys.executable, "-m", "ckpt_fx", "bench", "--head", "--device", args.device, *head,
                        "--steps", "5"], 300 if args.device == "cuda" else 3000):
        print(_tail(out / "head.log", 10))
    else:
        print(_tail(out / "head.log", 30))
    for failure in failures:
        print(f"FAILED {failure}")
    print("gpu_check:", "all checks passed" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


def _tail(path: pathlib.Path, lines: int) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(line for line in text[-lines:] if not line.startswith("USDT"))


if __name__ == "__main__":
    raise SystemExit(main())
