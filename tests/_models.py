"""Small configurable models and a training-step harness shared by the tests."""

from __future__ import annotations

import copy
import math
import dataclasses
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

REQUIRES_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@dataclass(frozen=True, kw_only=True)
class Spec:
    """A random architecture: what each block contains and how big it is."""

    depth: int = 3
    width: int = 16
    heads: int = 2
    embedding: bool = True
    attention: str = "manual"  # "manual", "sdpa" or "none"
    mlp: bool = True
    norm: bool = True
    residual: bool = True
    dropout: float = 0.0
    batchnorm: bool = False
    conv: bool = False  # a Conv1d + BatchNorm1d stage with a residual
    shared: bool = False  # one Linear used twice in the same forward
    tied: bool = False  # the head reuses the embedding's weight
    frozen: bool = False  # the first block's parameters do not require grad (LoRA-style)
    recurrent: bool = False  # a tanh RNN cell unrolled over the time steps
    stages: int = 1  # blocks nested in stages (layers.N.blocks.M), each stage half as wide as the one before
    calls: int = 1  # each block applied this many times with its weights shared (ALBERT-style)


class Block(nn.Module):
    def __init__(self, s: Spec):
        super().__init__()
        self.s = s
        d = s.width
        self.norm = nn.LayerNorm(d) if s.norm else nn.Identity()
        if s.attention != "none":
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
        if s.mlp:
            self.fc = nn.Linear(d, 2 * d)
            self.fc2 = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(s.dropout)
        self.bn = nn.BatchNorm1d(d) if s.batchnorm else None
        if s.conv:
            self.conv = nn.Conv1d(d, d, 3, padding=1)
            self.conv_bn = nn.BatchNorm1d(d)
        if s.shared:
            self.twice = nn.Linear(d, d)
        if s.recurrent:
            self.cell_x = nn.Linear(d, d)
            self.cell_h = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.s
        b, t, d = x.shape
        h = self.norm(x)
        if s.attention != "none":
            q, k, v = (z.view(b, t, s.heads, d // s.heads).transpose(1, 2) for z in self.qkv(h).split(d, dim=2))
            if s.attention == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                w = (q @ k.transpose(-2, -1)) / math.sqrt(d // s.heads)
                w = self.drop(w.softmax(-1))
                y = w @ v
            h = self.proj(y.transpose(1, 2).reshape(b, t, d))
        if s.mlp:
            h = self.fc2(self.drop(F.gelu(self.fc(h))))
        if self.bn is not None:
            h = self.bn(h.reshape(b * t, d)).reshape(b, t, d)
        if s.conv:
            c = F.relu(self.conv_bn(self.conv(h.transpose(1, 2))))
            h = h + F.max_pool1d(F.pad(c, (0, 1)), 2, stride=1).transpose(1, 2)
        if s.shared:
            h = self.twice(torch.tanh(self.twice(h)))
        if s.recurrent:
            state = h.new_zeros(b, d)
            steps = []
            for i in range(t):
                state = torch.tanh(self.cell_x(h[:, i]) + self.cell_h(state))
                steps.append(state)
            h = torch.stack(steps, 1)
        return x + h if s.residual else h


class Stage(nn.Module):
    """Blocks at one width, entered through a projection from the previous stage's width."""

    def __init__(self, s: Spec, width: int, depth: int):
        super().__init__()
        self.down = nn.Linear(width * 2, width) if width != s.width else nn.Identity()
        inner = dataclasses.replace(s, width=width)
        self.blocks = nn.ModuleList(Block(inner) for _ in range(depth))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.down(h)
        for block in self.blocks:
            for _ in range(block.s.calls):
                h = block(h)
        return h


class Net(nn.Module):
    def __init__(self, s: Spec, vocab: int = 50):
        super().__init__()
        self.embed = nn.Embedding(vocab, s.width) if s.embedding else nn.Linear(s.width, s.width)
        stages = min(s.stages, s.depth)
        if stages > 1:  # stage i holds blocks i*depth//stages .. and is width >> i wide
            bounds = [i * s.depth // stages for i in range(stages + 1)]
            self.layers = nn.ModuleList(Stage(s, s.width >> i, bounds[i + 1] - bounds[i]) for i in range(stages))
        else:
            self.layers = nn.ModuleList(Block(s) for _ in range(s.depth))
        last = s.width >> (stages - 1)
        self.head = nn.Linear(last, vocab)
        if s.tied and s.embedding and last == s.width:
            self.head.weight = self.embed.weight
        if s.frozen:
            self.layers[0].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            for _ in range(1 if isinstance(layer, Stage) else layer.s.calls):  # a stage repeats its own blocks
                h = layer(h)
        return self.head(h)


def make(spec: Spec, *, seed: int = 0, device: str = "cpu") -> Net:
    torch.manual_seed(seed)
    return Net(spec).to(device).train()


def inputs(spec: Spec, batch: int, seq: int, *, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if spec.embedding:
        return torch.randint(0, 50, (batch, seq), generator=g).to(device)
    return torch.randn(batch, seq, spec.width, generator=g).to(device)


@dataclass
class Step:
    """What one training step produced."""

    out: torch.Tensor
    grads: list[torch.Tensor | None]
    buffers: list[torch.Tensor]
    model: nn.Module


def train_step(model: nn.Module, x: torch.Tensor, backend=None, *, seed: int = 7) -> Step:
    """One forward and backward on a fresh copy of `model` (compiled with `backend` if given)."""
    m = copy.deepcopy(model)
    fn = torch.compile(m, backend=backend) if backend is not None else m
    torch.manual_seed(seed)
    out = fn(x)
    (out.float().sin().sum()).backward()
    return Step(out=out.detach(), grads=[p.grad for p in m.parameters()], buffers=[b.clone() for b in m.buffers()], model=m)


def bitwise_equal(a: Step, b: Step) -> bool:
    return (
        torch.equal(a.out, b.out)
        and all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a.grads, b.grads))
        and all(torch.equal(x, y) for x, y in zip(a.buffers, b.buffers))
    )


def close(a: Step, b: Step, *, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    return (
        torch.allclose(a.out, b.out, rtol=rtol, atol=atol)
        and all(torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(a.grads, b.grads) if x is not None)
        and all(torch.allclose(x.float(), y.float(), rtol=rtol, atol=atol) for x, y in zip(a.buffers, b.buffers))
    )


class Recorder:
    """A ckpt backend that keeps, per partitioned graph, the joint graph (with its decisions) and
    the backward it produced (`graphs`), the forward (`forwards`), and the partitioner's keyword
    arguments (`kwargs`)."""

    def __init__(self, policy, *, strict: bool = True):
        import ckpt_fx

        self.backend = ckpt_fx.backend(policy=policy, strict=strict)
        self.graphs: list[tuple[torch.fx.GraphModule, torch.fx.GraphModule]] = []
        self.forwards: list[torch.fx.GraphModule] = []
        self.kwargs: list[dict] = []
        self.backend.on_partitioned.append(self._record)

    def _record(self, done) -> None:
        self.graphs.append((done.joint, done.backward))
        self.forwards.append(done.forward)
        self.kwargs.append(done.kwargs)


def tiny_gpt(dropout: float = 0.0) -> nn.Module:
    """The built-in GPT, 2 blocks of 64, seeded: the Inductor tests' model."""
    from ckpt_fx.bench.models import build

    torch.manual_seed(0)
    return build("gpt", layers=2, dim=64, heads=2, dropout=dropout)


def seeded_step(fn, ids: torch.Tensor) -> None:
    """A forward and backward of a (token ids, labels) model under a fixed seed."""
    torch.manual_seed(7)
    fn(ids, ids).backward()


def lora(model: torch.nn.Module) -> torch.nn.Module:
    """The model with peft's LoRA adapters (r=8) on its attention projections; the base frozen."""
    import peft

    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")}
    targets = sorted(names & {"q_proj", "v_proj", "query", "value", "wq", "wv", "qkv", "c_attn"})
    return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets, lora_dropout=0.0))


def hand_built(build) -> torch.fx.GraphModule:
    """A hand-built graph: `build(graph, value)` adds nodes; `value(node, *shape)` gives a node a
    float32 meta tensor of that shape (its meta "val") and returns it."""
    graph = torch.fx.Graph()

    def value(node, *shape):
        node.meta["val"] = torch.empty(shape, device="meta")
        return node

    build(graph, value)
    return torch.fx.GraphModule(torch.nn.Module(), graph)
