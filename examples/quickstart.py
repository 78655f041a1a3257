"""torch.compile(model, backend="ckpt") on a small LLaMA-style model: same loss, lower peak memory.

    python examples/quickstart.py
"""

import copy

import torch

import ckpt_fx
from ckpt_fx.bench.models import build

torch.manual_seed(0)
model = build("llama", layers=6, dim=128, heads=4).train()
ids = torch.randint(0, 1000, (4, 128))

for name, backend in [("eager", None), ("ckpt (blocks)", "ckpt"), ("ckpt (segments:2)", ckpt_fx.backend(policy="segments:2"))]:
    m = copy.deepcopy(model)
    fn = m if backend is None else torch.compile(m, backend=backend)
    fn(ids, ids).backward()  # warm-up: compiles
    for p in m.parameters():
        p.grad = None
    losses = []
    peak = ckpt_fx.peak_bytes(lambda: losses.append(fn(ids, ids)) or losses[-1].backward())
    print(f"{name:18s} loss {losses[0].item():.6f}  peak {peak / 2**20:6.1f} MB")
