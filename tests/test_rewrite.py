"""rewrite_graph: the transformation on an FX GraphModule, run under plain eager autograd."""

from __future__ import annotations

import copy

import pytest
import torch

import ckpt_fx
from tests._models import Spec, inputs, make

SPEC = Spec(depth=3, width=16, dropout=0.1, attention="none")  # symbolic_trace cannot unpack shapes


class DictOut(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        y = self.net(x)
        return {"logits": y, "aux": (y.mean(), None)}


def grads_of(module, fn, x, seed=3):
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    out = fn(x)
    (out["logits"].sin().sum() + out["aux"][0]).backward()
    return out, [p.grad.clone() for p in module.parameters()]


def test_symbolic_trace_graph_keeps_outputs_gradients_and_parameters():
    """Same output structure and values, same gradients, the same parameter objects, and the
    block stack is still found in a symbolic_trace graph."""
    model = DictOut(make(SPEC))
    x = inputs(SPEC, 2, 8)
    gm = torch.fx.symbolic_trace(model)
    gm2 = ckpt_fx.rewrite_graph(gm, "blocks:every=1,skip_first=0", example_inputs=(x,))
    assert [b.path for b in gm2.plan.blocks] == ["net.layers.0", "net.layers.1", "net.layers.2"]
    assert all(b.recomputed_ops > 0 for b in gm2.plan.blocks)
    assert dict(gm2.named_parameters()).keys() == dict(gm.named_parameters()).keys()
    assert all(a is b for a, b in zip(gm.parameters(), gm2.parameters()))

    reference = copy.deepcopy(model)
    out_ref, g_ref = grads_of(reference, reference, x)
    out, g = grads_of(gm, gm2, x)
    assert set(out) == {"logits", "aux"} and out["aux"][1] is None
    assert torch.allclose(out["logits"], out_ref["logits"], rtol=1e-5, atol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(g, g_ref))


def test_optimizer_on_the_original_keeps_working():
    """An optimizer built on the original module trains the rewritten one."""
    model = DictOut(make(SPEC))
    x = inputs(SPEC, 2, 8)
    gm = torch.fx.symbolic_trace(model)
    gm2 = ckpt_fx.rewrite_graph(gm, "blocks", example_inputs=(x,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        torch.manual_seed(0)
        loss = gm2(x)["logits"].pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[2] < losses[0]


def test_code_shows_where_recompute_happens():
    model = DictOut(make(SPEC))
    x = inputs(SPEC, 2, 8)
    gm2 = ckpt_fx.rewrite_graph(torch.fx.symbolic_trace(model), "blocks", example_inputs=(x,))
    code = gm2.code
    assert "ckpt_fx plan: blocks(every=1, skip_first=auto)" in code
    assert code.count("# <- recompute") == len(gm2.plan.recomputed) > 0


def test_other_shapes_raise_instead_of_running_wrong():
    model = make(SPEC)
    x = inputs(SPEC, 2, 8)
    gm2 = ckpt_fx.rewrite_graph(torch.fx.symbolic_trace(model), "blocks", example_inputs=(x,))
    with pytest.raises(ValueError, match=r"specialised to input 0 of shape \(2, 8\), got \(2, 9\)"):
        gm2(inputs(SPEC, 2, 9))


def test_bad_arguments_are_named():
    model = make(SPEC)
    gm = torch.fx.symbolic_trace(model)
    with pytest.raises(ValueError, match="takes a torch.fx.GraphModule, got Net"):
        ckpt_fx.rewrite_graph(model, "blocks", example_inputs=(inputs(SPEC, 2, 8),))
    with pytest.raises(ValueError, match=r"takes 1 input\(s\) \(x\), got 0"):
        ckpt_fx.rewrite_graph(gm, "blocks", example_inputs=())
    with pytest.raises(ValueError, match="unknown policy 'sqr'"):
        ckpt_fx.rewrite_graph(gm, "sqr", example_inputs=(inputs(SPEC, 2, 8),))


def test_torch_export_graph():
    """A graph from torch.export (its unlifted module) rewrites and trains the same."""
    spec = Spec(depth=3, width=16, dropout=0.0)
    model = make(spec)
    x = inputs(spec, 2, 8)
    exported = torch.export.export(model, (x,)).module()
    gm2 = ckpt_fx.rewrite_graph(exported, "blocks:every=1,skip_first=0", example_inputs=(x,))
    assert len(gm2.plan.blocks) == 3 and gm2.plan.recomputed
    gm2(x).sin().sum().backward()
    reference = copy.deepcopy(model)
    reference(x).sin().sum().backward()
    for a, b in zip(exported.parameters(), reference.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6)


def test_dynamo_graph():
    """A graph captured by dynamo (parameters arrive as inputs) rewrites too."""
    spec = Spec(depth=3, width=16, dropout=0.0)
    model = make(spec)
    x = inputs(spec, 2, 8)
    captured = {}

    def capture(gm, example_inputs):
        captured["gm"], captured["inputs"] = gm, example_inputs
        return gm.forward

    torch.compile(model, backend=capture)(x)
    gm, example = captured["gm"], [t for t in captured["inputs"]]
    gm2 = ckpt_fx.rewrite_graph(gm, "blocks:every=1,skip_first=0", example_inputs=example)
    assert gm2.plan.recomputed
    outs = gm2(*example)
    outs[0].sin().sum().backward()
    reference = copy.deepcopy(model)
    reference(x).sin().sum().backward()
    params = [t for t in example if isinstance(t, torch.nn.Parameter)]
    assert params and all(p.grad is not None for p in params)
    for p, r in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, r.grad, rtol=1e-4, atol=1e-6)


def test_rewrite_graph_plans_for_the_eager_graphs_it_runs():
    """rewrite_graph runs its graphs under plain autograd, so it plans them with AOTAutograd's
    default partition, as the eager inner compiler does, not with Inductor's min-cut (whatever
    CKPT_FX_COMPILER says): the plan records no min-cut CSE decision."""
    import os

    model = make(SPEC)
    x = inputs(SPEC, 2, 8)
    before = os.environ.get("CKPT_FX_COMPILER")
    os.environ["CKPT_FX_COMPILER"] = "inductor"
    try:
        rewritten = ckpt_fx.rewrite_graph(torch.fx.symbolic_trace(model), "blocks:every=1,skip_first=0", (x,))
    finally:
        os.environ.pop("CKPT_FX_COMPILER") if before is None else os.environ.__setitem__("CKPT_FX_COMPILER", before)
    assert rewritten.plan.recomputed
    assert rewritten.plan.joint_cse is None
