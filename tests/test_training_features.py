"""Training features under backend="ckpt": autocast, accumulation with optimizer steps, dynamic
shapes, retain_graph, double backward. Each test fails when its feature breaks."""

from __future__ import annotations

import copy

import pytest
import torch

import ckpt_fx
from tests._models import REQUIRES_CUDA, Spec, inputs, make

SPEC = Spec(depth=3, width=16, dropout=0.1)
EVERY = "blocks:every=1,skip_first=0"


AUTOCAST = [("cpu", torch.bfloat16), pytest.param("cuda", torch.bfloat16, marks=REQUIRES_CUDA),
            pytest.param("cuda", torch.float16, marks=REQUIRES_CUDA)]


@pytest.mark.parametrize(("device", "dtype"), AUTOCAST, ids=["cpu-bf16", "cuda-bf16", "cuda-fp16"])
def test_autocast_matches_aot_eager_and_recomputes_casts(device, dtype):
    model, x = make(SPEC, device=device), inputs(SPEC, 2, 8, device=device)

    def run(backend):
        m = copy.deepcopy(model)
        fn = torch.compile(m, backend=backend)
        torch.manual_seed(0)
        with torch.autocast(device, dtype=dtype):
            out = fn(x)
        out.float().sin().sum().backward()
        return out, [p.grad for p in m.parameters()]

    b = ckpt_fx.backend(policy=EVERY, strict=True)
    out, grads = run(b)
    ref_out, ref_grads = run("aot_eager")
    assert out.dtype == dtype
    assert torch.equal(out, ref_out)
    if device == "cpu" or all(torch.equal(a, r) for a, r in zip(run("aot_eager")[1], ref_grads)):
        assert all(torch.equal(a, r) for a, r in zip(grads, ref_grads))
    else:  # CUDA kernels that accumulate with atomics: equal to rounding
        assert all(torch.allclose(a, r, rtol=1e-5, atol=1e-6) for a, r in zip(grads, ref_grads))
    recomputed = set(b.plans[0].recomputed)
    casts = [n for n in recomputed if "_to_copy" in n or "convert" in n]
    assert casts, "the casts inside checkpointed blocks should be recomputed with them"


def test_gradient_accumulation_and_optimizer_steps_match_eager():
    model, xs = make(SPEC), [inputs(SPEC, 2, 8, seed=s) for s in range(3)]

    def train(compiled):
        m = copy.deepcopy(model)
        fn = torch.compile(m, backend=ckpt_fx.backend(policy=EVERY, strict=True)) if compiled else m
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for step in range(2):
            for i, x in enumerate(xs):
                torch.manual_seed(10 * step + i)
                (fn(x).sin().mean() / len(xs)).backward()
            opt.step()
            opt.zero_grad()
        return list(m.parameters())

    for a, b in zip(train(True), train(False)):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # dynamic=True from the first call; a graph turned dynamic by a recompile is checked in the default run
def test_dynamic_sequence_length_compiles_once_and_keeps_the_saving():
    model = make(SPEC)
    b = ckpt_fx.backend(policy=EVERY, strict=True)
    m = copy.deepcopy(model)
    fn = torch.compile(m, backend=b, dynamic=True)
    none_model = copy.deepcopy(model)
    none = torch.compile(none_model, backend=ckpt_fx.backend(policy="none"), dynamic=True)
    measured = {}
    for seq in (16, 24, 40):
        x = inputs(SPEC, 4, seq)
        eager = copy.deepcopy(model)
        torch.manual_seed(0)
        expected = eager(x)
        torch.manual_seed(0)
        got = fn(x)
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
        got.sin().sum().backward()

        def step(f):
            torch.manual_seed(0)
            f(x).sin().sum().backward()

        step(none)
        for p in list(m.parameters()) + list(none_model.parameters()):
            p.grad = None
        measured[seq] = ckpt_fx.peak_bytes(lambda: step(fn))
        assert measured[seq] < ckpt_fx.peak_bytes(lambda: step(none)), seq
    assert len(b.plans) == 1  # one graph for every length: no recompile per length
    plan = b.plans[0]
    # The plan's figures at each length, from its symbolic sizes: within 15% of the measured peak.
    (length,) = [name for name, hint in plan.symbols.items() if hint == 16]
    assert plan.at(**{length: 16}).peak_bytes == plan.peak_bytes
    predicted = {seq: plan.at(**{length: seq}).peak_bytes for seq in measured}
    assert predicted[16] < predicted[24] < predicted[40]
    for seq in measured:
        assert abs(predicted[seq] - measured[seq]) <= 0.15 * measured[seq], (seq, predicted, measured)
    with pytest.raises(ValueError, match=rf"unknown size symbol\(s\) \['seq'\]; this plan's symbols: .*{length} \(now 16\)"):
        plan.at(seq=32)


def test_the_recompile_that_makes_a_graph_dynamic_takes_the_first_plans_place():
    """Note [A recompile's plan]: a second length recompiles the function with symbolic sizes, and
    that graph alone runs from then on: its plan replaces the first length's in `plans`, and
    step_peak_bytes(plans) predicts the step from it, not from both as two graphs of one step."""
    model = make(SPEC)
    b = ckpt_fx.backend(policy=EVERY, strict=True)
    fn = torch.compile(copy.deepcopy(model), backend=b)

    def step(x):
        fn(x).sin().sum().backward()

    step(inputs(SPEC, 4, 16))
    (first,) = b.plans
    assert not first.symbols
    for seq in (24, 40):
        x = inputs(SPEC, 4, seq)
        step(x)
        (plan,) = b.plans
        assert plan.symbols and b.superseded == [first]
    x = inputs(SPEC, 4, 24)
    measured = ckpt_fx.peak_bytes(lambda: step(x))
    (length,) = plan.symbols
    predicted = ckpt_fx.step_peak_bytes([plan.at(**{length: 24})])
    assert ckpt_fx.step_peak_bytes(b.plans) == ckpt_fx.step_peak_bytes([plan])
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)

    # With fixed sizes each length keeps its own graph (the first one runs again at its length).
    static = ckpt_fx.backend(policy=EVERY, strict=True)
    fn = torch.compile(copy.deepcopy(model), backend=static, dynamic=False)
    for seq in (16, 24):
        step(inputs(SPEC, 4, seq))
    assert len(static.plans) == 2 and not static.superseded


@pytest.mark.slow  # a guard against a reset's renumbering; the recompile's replacement itself is checked in the default run
def test_after_a_dynamo_reset_another_function_keeps_its_own_plan():
    """Note [A recompile's plan]: Dynamo numbers functions afresh after a reset; a backend used on
    before it keeps the earlier function's plan when another function, numbered as it was, turns
    dynamic."""

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = make(SPEC)

        def forward(self, x):
            return self.inner(x)

    b = ckpt_fx.backend(policy=EVERY, strict=True)
    torch.compile(make(SPEC), backend=b)(inputs(SPEC, 4, 16)).sin().sum().backward()
    (first,) = b.plans
    torch._dynamo.reset()
    other = torch.compile(Wrapped(), backend=b)
    with torch.no_grad():
        other(inputs(SPEC, 4, 16))  # compiled without a plan: nothing records gradients
    other(inputs(SPEC, 4, 24)).sin().sum().backward()  # a recompile, dynamic
    assert len(b.plans) == 2 and b.plans[0] is first and b.plans[1].symbols and not b.superseded


def test_retain_graph_and_a_second_backward():
    model, x = make(SPEC), inputs(SPEC, 2, 8)
    m = copy.deepcopy(model)
    fn = torch.compile(m, backend=ckpt_fx.backend(policy=EVERY, strict=True))
    torch.manual_seed(0)
    loss = fn(x).sin().sum()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in m.parameters()]
    loss.backward()
    assert all(torch.allclose(p.grad, 2 * g) for p, g in zip(m.parameters(), first))


def test_double_backward_fails_with_a_clear_message():
    m = make(SPEC)
    fn = torch.compile(m, backend=ckpt_fx.backend(policy=EVERY))
    loss = fn(inputs(SPEC, 2, 8)).sin().sum()
    grads = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        sum(g.pow(2).sum() for g in grads).backward()


@pytest.mark.slow  # Inductor over many lengths: tests/test_user_path.py's slow checks run the same path on a transformers Llama
def test_under_inductor_one_graph_and_one_plan_serve_every_sequence_length():
    """Note [Predicting adds no guards] in passes/inductor_memory.py: Inductor's memory prediction
    lowers graphs that never run; a guard it added specialized the sequence length, and dynamo
    compiled a static graph per length. Planned as Inductor plans (no kernels generated), a dynamic
    compile serves every length with one plan."""
    from ckpt_fx.dynamo_backend import CkptBackend, Options
    from passes._compat import has_inductor_partitioner_hook
    from passes.plan import PeakModel

    if not has_inductor_partitioner_hook():
        pytest.skip("no custom_partitioner_fn in this torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).train()
    b = CkptBackend(Options(policy=ckpt_fx.policies.parse(EVERY), compiler="inductor"), kernels=False)
    fn = torch.compile(model, backend=b, dynamic=True)
    for length in (16, 24, 40):
        ids = torch.randint(0, 128, (2, length))
        fn(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert len(b.plans) == 1 and b.plans[0].symbols and b.plans[0].peak_model == PeakModel.INDUCTOR
