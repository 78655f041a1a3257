"""A recurrent model over a long sequence, checkpointed in segments of time steps (the
torch.utils.checkpoint_sequential use case). The cell is shared; each Segment module runs a
window of steps, so the segments form the stack of units.

    python examples/rnn.py
"""

import copy

import torch
from torch import nn

import ckpt_fx

STEPS, SEGMENTS = 96, 6


class Segment(nn.Module):
    def __init__(self, cell, start, length):
        super().__init__()
        self.cell, self.start, self.length = cell, start, length

    def forward(self, x, h):
        for t in range(self.start, self.start + self.length):
            h = self.cell(x[:, t], h)
        return h


class RNN(nn.Module):
    def __init__(self, dim=64, hidden=256):
        super().__init__()
        self.cell = nn.GRUCell(dim, hidden)
        size = STEPS // SEGMENTS
        self.segments = nn.ModuleList(Segment(self.cell, i * size, size) for i in range(SEGMENTS))
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], self.cell.hidden_size)
        for segment in self.segments:
            h = segment(x, h)
        return self.head(h).pow(2).mean()


torch.manual_seed(0)
model = RNN().train()
x = torch.randn(32, STEPS, 64)

for name, policy in [("eager", None), ("ckpt, one segment per unit", "blocks:every=1,skip_first=0")]:
    m = copy.deepcopy(model)
    backend = ckpt_fx.backend(policy=policy) if policy else None
    fn = m if backend is None else torch.compile(m, backend=backend)
    fn(x).backward()  # warm-up: compiles
    for p in m.parameters():
        p.grad = None
    losses = []
    peak = ckpt_fx.peak_bytes(lambda: losses.append(fn(x)) or losses[-1].backward())
    grad = m.cell.weight_hh.grad.norm().item()
    print(f"{name:28s} loss {losses[0].item():.6f}  |grad W_hh| {grad:.6f}  peak {peak / 2**20:6.1f} MB")
