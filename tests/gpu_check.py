"""GPU check, for a machine with CUDA: `python tests/gpu_check.py` (a few minutes).

Runs the CUDA-parametrized parity and memory tests, then prints one table: per policy, on the
built-in LLaMA-style model, the gradients' max relative difference from eager and the measured
`max_memory_allocated` of a training step (fp32 and bf16 autocast). Exits non-zero when a test
fails or a policy's gradients differ.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
POLICIES = ("none", "blocks", "blocks:every=1,skip_first=0", "sqrt", "selective", "budget:0.3")


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check", file=sys.stderr)
        return 2
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-k", "cuda", "tests/test_parity.py", "tests/test_training_features.py"],
        cwd=ROOT,
    )
    sys.path.insert(0, str(ROOT))
    import ckpt_fx
    from ckpt_fx.models import build

    device = torch.device("cuda")
    torch.manual_seed(0)
    base = build("llama", layers=8, dim=512, heads=8).to(device)
    ids = torch.randint(0, 1000, (8, 512), device=device)
    rows, bad = [], False
    for amp in (False, True):
        cast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp)
        ref = None
        for policy in ("eager", *POLICIES):
            model = build("llama", layers=8, dim=512, heads=8).to(device)
            model.load_state_dict(base.state_dict())
            fn = model if policy == "eager" else torch.compile(model, backend=ckpt_fx.backend(policy=policy, strict=True))
            with cast:
                fn(ids, ids).backward()  # compile
            model.zero_grad(set_to_none=True)
            peak = ckpt_fx.peak_bytes(lambda: _step(fn, ids, cast), device=device)
            grads = [p.grad.float() for p in model.parameters()]
            ref = grads if ref is None else ref
            diff = max(((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item() for g, r in zip(grads, ref))
            bad |= diff > (2e-2 if amp else 1e-4)
            rows.append((("bf16 " if amp else "fp32 ") + policy, peak / 2**20, diff))
            torch._dynamo.reset()
    print(f"\n{torch.cuda.get_device_name()}; torch {torch.__version__}; llama 8x512, batch 8x512")
    print("| setup | max_memory_allocated MB | grad max rel diff vs eager |\n|---|---:|---:|")
    for name, mb, diff in rows:
        print(f"| {name} | {mb:.1f} | {diff:.1e} |")
    return 1 if tests.returncode or bad else 0


def _step(fn, ids, cast) -> None:
    with cast:
        loss = fn(ids, ids)
    loss.backward()


if __name__ == "__main__":
    raise SystemExit(main())
