"""rewrite_graph on a torch.fx.symbolic_trace'd model, trained under plain eager autograd.

    python examples/rewrite_fx.py
"""

import torch
from torch import nn

import ckpt_fx


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


model = nn.Sequential(*[Block(64) for _ in range(6)])
x = torch.randn(8, 128, 64)

gm = torch.fx.symbolic_trace(model)
gm2 = ckpt_fx.rewrite_graph(gm, "sqrt", example_inputs=(x,))
print(gm2.code[:1500], "...\n")
for block in gm2.plan.blocks:
    print(f"{block.path:4s} saved {block.saved_bytes / 2**20:5.2f} MB, recomputes {block.recomputed_ops} ops")

opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built on the original: parameters are shared
for step in range(3):
    opt.zero_grad()
    loss = gm2(x).pow(2).mean()
    loss.backward()
    opt.step()
    print(f"step {step}: loss {loss.item():.5f}")
