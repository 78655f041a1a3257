"""A user-written policy: recompute cheap ops inside blocks, keep every matrix product.

    python examples/custom_policy.py
"""

import copy

import torch

import ckpt_fx
from ckpt_fx import CheckpointPolicy, policies
from ckpt_fx.bench.models import build


def keep_matmuls(info: ckpt_fx.NodeInfo) -> CheckpointPolicy:
    """info carries op, module_path, region, block, shape, dtype, nbytes, flops."""
    if info.region == "block" and not any(op in info.op for op in ("mm", "addmm", "bmm", "attention")):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


torch.manual_seed(0)
model = build("gpt", layers=4, dim=128, heads=4, dropout=0.1).train()
ids = torch.randint(0, 1000, (4, 128))

for name, policy in [
    ("none", "none"),
    ("keep_matmuls", keep_matmuls),
    ("blocks only in blocks.2-3", policies.only_in(["blocks.2", "blocks.3"], policies.blocks(skip_first=0))),
]:
    m = copy.deepcopy(model)
    backend = ckpt_fx.backend(policy=policy)
    fn = torch.compile(m, backend=backend)
    fn(ids, ids).backward()
    for p in m.parameters():
        p.grad = None
    peak = ckpt_fx.peak_bytes(lambda: fn(ids, ids).backward())
    plan = backend.plans[0]
    print(f"{name:28s} peak {peak / 2**20:6.1f} MB, saved {plan.saved_bytes / 2**20:6.1f} MB, "
          f"recompute {plan.recompute_flops / 1e9:5.2f} GFLOP")
