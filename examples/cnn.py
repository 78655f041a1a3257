"""A ResNet-style CNN with BatchNorm and pooling, checkpointed stage by stage; the stem is not.

    python examples/cnn.py
"""

import copy

import torch
from torch import nn

import ckpt_fx


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))


class Stage(nn.Module):
    def __init__(self, cin, cout, stride, depth=2):
        super().__init__()
        self.blocks = nn.Sequential(BasicBlock(cin, cout, stride), *[BasicBlock(cout, cout, 1) for _ in range(depth - 1)])

    def forward(self, x):
        return self.blocks(x)


class ResNet(nn.Module):
    def __init__(self, widths=(32, 64, 128, 256), classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU(), nn.MaxPool2d(2))
        cins = (widths[0],) + widths[:-1]
        # One class for every stage: the stages form the stack of units; the stem stays outside it.
        self.stages = nn.ModuleList(Stage(cin, cout, 1 if i == 0 else 2) for i, (cin, cout) in enumerate(zip(cins, widths)))
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x, labels):
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        logits = self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))
        return nn.functional.cross_entropy(logits, labels)


torch.manual_seed(0)
model = ResNet().train()
images, labels = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))

results = {}
for name, backend in [("eager", None), ("ckpt blocks:every=1,skip_first=0", ckpt_fx.backend(policy="blocks:every=1,skip_first=0"))]:
    m = copy.deepcopy(model)
    fn = m if backend is None else torch.compile(m, backend=backend)
    fn(images, labels).backward()  # warm-up (compiles); BatchNorm stats move once here
    for p in m.parameters():
        p.grad = None
    losses = []
    peak = ckpt_fx.peak_bytes(lambda: losses.append(fn(images, labels)) or losses[-1].backward())
    results[name] = m
    units = [b.path for b in backend.plans[0].blocks if b.recomputed_ops] if backend else []
    print(f"{name:34s} loss {losses[0].item():.5f}  peak {peak / 2**20:6.1f} MB  checkpointed: {units or '-'}")

eager, ckpt = results.values()
same_stats = all(torch.allclose(a.float(), b.float(), atol=1e-6) for a, b in zip(eager.buffers(), ckpt.buffers()))
print(f"BatchNorm running stats equal eager's: {same_stats}")
