"""Gradients are the contract: checkpointed training steps equal the un-checkpointed ones."""

from __future__ import annotations

import copy
import zlib

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import ckpt_fx
from ckpt_fx import CheckpointPolicy, policies
from passes._compat import PARTITIONER_KNOWS_SDPA_WITHOUT_DROPOUT
from passes.graphs import forward_nodes
from passes.select import hard_rule
from tests._models import REQUIRES_CUDA, Recorder, Spec, bitwise_equal, close, inputs, make, train_step


def coin_policy(info: ckpt_fx.NodeInfo) -> CheckpointPolicy:
    """Arbitrary per-node decisions: any mix of save and recompute must keep gradients exact."""
    if zlib.crc32(info.name.encode()) % 2:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


def no_matmul_saved(info: ckpt_fx.NodeInfo) -> CheckpointPolicy:
    """A custom policy: inside blocks recompute everything but matrix products."""
    if info.region == "block" and "mm" not in info.op:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


POLICIES = [
    "blocks",
    "blocks:every=1,skip_first=0",
    "blocks:2",
    "segments:2",
    "sqrt",
    "none",
    coin_policy,
    no_matmul_saved,
    policies.only_in("layers.1", "blocks:every=1,skip_first=0"),
    "selective",
    "graph",
]

specs = st.builds(
    Spec,
    depth=st.integers(1, 4),
    width=st.sampled_from([8, 16]),
    heads=st.sampled_from([1, 2]),
    embedding=st.booleans(),
    attention=st.sampled_from(["manual", "sdpa", "none"]),
    mlp=st.booleans(),
    norm=st.booleans(),
    residual=st.booleans(),
    dropout=st.sampled_from([0.0, 0.1, 0.5]),
    batchnorm=st.booleans(),
    conv=st.booleans(),
    shared=st.booleans(),
    tied=st.booleans(),
    frozen=st.booleans(),
    recurrent=st.booleans(),
    stages=st.sampled_from([1, 1, 2, 3]),
    calls=st.sampled_from([1, 1, 1, 2]),
)


def functional_reference(model: torch.nn.Module, x: torch.Tensor, seed: int = 7):
    """Output and parameter gradients computed with torch.func (functional_call + vjp)."""
    m = copy.deepcopy(model)
    # torch.func's way with BatchNorm: in train mode outputs use batch statistics either way; this
    # stops the running-stat updates, which a transform may not apply to captured buffers.
    torch.func.replace_all_batch_norm_modules_(m)
    params = {k: v.detach() for k, v in m.named_parameters()}
    buffers = {k: v.clone() for k, v in m.named_buffers()}

    def f(p):
        torch.manual_seed(seed)
        return torch.func.functional_call(m, (p, buffers), (x,))

    out, vjp = torch.func.vjp(f, params)
    (grads,) = vjp(out.cos())  # d/d out of out.sin().sum()
    return out, [grads[k] for k, _ in m.named_parameters()]


# The profile's examples are split between the default run and the slow checks (CI runs both):
# the two tests are two functions, so derandomized Hypothesis draws other examples for each.
DEFAULT_RUN_EXAMPLES = max(6, settings.default.max_examples // 2)


@settings(max_examples=DEFAULT_RUN_EXAMPLES)
@given(spec=specs, policy=st.sampled_from(POLICIES), batch=st.integers(1, 3), seq=st.integers(2, 6))
@example(spec=Spec(depth=1, width=8, heads=1, embedding=False, attention="sdpa", mlp=False, norm=False, residual=False),
         policy=coin_policy, batch=1, seq=2)  # found by the large profile: attention recomputed
def test_gradients_equal_the_uncheckpointed_run(spec, policy, batch, seq):
    """Bitwise equal to aot_eager without checkpointing, allclose to eager and to torch.func;
    the backward recomputes only forward, non-random nodes; buffers change exactly as in eager."""
    check_parity(spec, policy, batch, seq, "cpu")


@pytest.mark.slow
@settings(max_examples=max(6, settings.default.max_examples - DEFAULT_RUN_EXAMPLES))
@given(spec=specs, policy=st.sampled_from(POLICIES), batch=st.integers(1, 3), seq=st.integers(2, 6))
def test_gradients_equal_the_uncheckpointed_run_on_the_profiles_other_examples(spec, policy, batch, seq):
    """The property above on the rest of the profile's examples."""
    check_parity(spec, policy, batch, seq, "cpu")


@REQUIRES_CUDA
@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(spec=specs, policy=st.sampled_from(POLICIES), batch=st.integers(1, 3), seq=st.integers(2, 6))
def test_gradients_equal_the_uncheckpointed_run_on_cuda(spec, policy, batch, seq):
    """The same property on CUDA (a third of the examples: each compiles three times)."""
    check_parity(spec, policy, batch, seq, "cuda")


def check_parity(spec: Spec, policy, batch: int, seq: int, device: str) -> None:
    """The parity property for one example.

    On CUDA a kernel may accumulate in a varying order (atomics): bitwise equality with aot_eager
    is required where two un-checkpointed runs agree bitwise, otherwise agreement to float32
    rounding. Eager CUDA runs other kernels than the compiled graph (cuDNN's BatchNorm, fused
    ops), and a gradient that is mathematically zero (a bias before a BatchNorm) comes out as
    rounding noise on the scale of the step's largest values, so against eager and torch.func the
    absolute tolerance there is 1e-4 of that scale (measured on an H200: 1.3e-5 where the scale
    is ~0.7, between aot_eager and eager without any checkpointing).
    """
    torch._dynamo.reset()
    model = make(spec, device=device)
    x = inputs(spec, batch, seq, device=device)
    recorder = Recorder(policy)
    got = train_step(model, x, recorder.backend)
    ref = train_step(model, x, "aot_eager")
    eager = train_step(model, x)
    if device == "cpu" or bitwise_equal(train_step(model, x, "aot_eager"), ref):
        assert bitwise_equal(got, ref)
    else:
        assert close(got, ref, rtol=1e-5, atol=1e-6)
    scale = max(t.abs().max().item() for t in [eager.out, *eager.grads] if t is not None and t.numel())
    atol = 1e-5 if device == "cpu" else 1e-4 * scale
    assert close(got, eager, atol=atol)
    out, grads = functional_reference(model, x)
    assert torch.allclose(got.out, out, rtol=1e-4, atol=atol)
    trainable = [p.requires_grad for p in model.parameters()]
    for g, r, needs in zip(got.grads, grads, trainable):
        assert (g is not None) == needs
        if needs:
            assert torch.allclose(g, r, rtol=1e-4, atol=atol)

    assert recorder.graphs, "the ckpt backend partitioned no graph"
    for joint, bw in recorder.graphs:
        forward = {n.name: n for n in forward_nodes(joint.graph)}
        recomputed = [n for n in bw.graph.nodes if n.op == "call_function" and n.name in forward]
        for node in recomputed:
            original = forward[node.name]
            assert original.meta.get("partitioner_tag") == "is_forward", node.name
            assert hard_rule(original) is None, f"{node.name} ({original.target}) must not be recomputed"
        for node in bw.graph.nodes:  # random ops never run in the backward (attention with dropout_p=0 may)
            assert hard_rule(node) != "random", f"random op {node} in backward"
    for plan, (joint, bw) in zip(recorder.backend.plans, recorder.graphs):
        forward = {n.name for n in forward_nodes(joint.graph) if n.op == "call_function"}
        assert set(plan.recomputed) == {n.name for n in bw.graph.nodes if n.op == "call_function" and n.name in forward}


# Found by the large profile: one segment over two tiny Conv+BatchNorm blocks measured 1 KB above
# no checkpointing. The backward held each recomputed multi-output node's whole tuple (LayerNorm's
# mean and rstd, max-pool's indices) until its last getitem, emitted just in time much later;
# getitems now follow their node (passes/schedule.py).
FROZEN_CONV_SEGMENT = Spec(depth=2, width=8, heads=1, embedding=False, attention="manual", mlp=False, norm=True,
                           residual=False, conv=True, frozen=True)


@pytest.mark.slow
# Two compiles and two measured steps per example: half the profile's examples (the gradient
# property above, the contract, runs them all; the "large" profile runs 125 here).
@settings(max_examples=max(8, settings.default.max_examples // 2))
@given(spec=specs.filter(lambda s: s.width >> (min(s.stages, s.depth) - 1) >= 8), policy=st.sampled_from(POLICIES[:6]),
       batch=st.integers(2, 4), seq=st.integers(16, 32))
@example(spec=FROZEN_CONV_SEGMENT, policy="segments:2", batch=2, seq=16)
def test_measured_peak_no_higher_than_without_checkpointing(spec, policy, batch, seq):
    """The peak of a measured training step never rises above the un-checkpointed partition's.

    Sizes keep activations a real share of the step: in a model of a few hundred parameters the
    order of gradient ops alone moves the peak by a few dozen bytes either way, and no stage is
    narrower than 8 (a recurrent cell 4 wide, recomputed op by op, measured 62.6 KB against 59.0 KB
    without checkpointing: a few bytes held per recomputed op that the prediction does not see).
    """
    _peak_no_higher(spec, policy, batch, seq)


def _peak_no_higher(spec, policy, batch, seq) -> None:
    torch._dynamo.reset()
    model = make(spec)
    x = inputs(spec, batch, seq)

    def peak(policy):
        m = copy.deepcopy(model)
        fn = torch.compile(m, backend=ckpt_fx.backend(policy=policy, strict=True))

        def step():
            torch.manual_seed(7)
            fn(x).float().sin().sum().backward()

        step()
        for p in m.parameters():
            p.grad = None
        return ckpt_fx.peak_bytes(step)

    assert peak(policy) <= peak("none")


@pytest.mark.xfail(not PARTITIONER_KNOWS_SDPA_WITHOUT_DROPOUT, strict=True,
                   reason="known on torch 2.13 (found by the large profile): to recompute SDPA, torch's partition "
                   "saves the CPU generator state (5056 bytes; the op is tagged random even at dropout_p=0); this "
                   "block's activations are fewer bytes than that: the plan keeps 832 bytes more at the forward's "
                   "end (predicted and measured) in a 31 KB step. torch 2.15 saves no state there "
                   "(Note [Versions of torch] in passes/_compat.py)")
def test_regression_sdpa_block_smaller_than_the_cpu_rng_state():
    spec = Spec(depth=2, width=8, heads=1, embedding=False, attention="sdpa", mlp=False, norm=False, residual=False)
    _peak_no_higher(spec, "blocks", 2, 16)


def test_batchnorm_running_stats_update_exactly_once(device):
    """BatchNorm's running stats and num_batches_tracked equal eager's after two steps."""
    spec = Spec(depth=3, width=8, batchnorm=True, dropout=0.1)
    model = make(spec, device=device)
    x = inputs(spec, 2, 5, device=device)
    eager = copy.deepcopy(model)
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend=ckpt_fx.backend(policy="blocks:every=1,skip_first=0", strict=True))
    for step in range(2):
        torch.manual_seed(step)
        eager(x).sum().backward()
        torch.manual_seed(step)
        compiled(x).sum().backward()
    for (name, a), (_, b) in zip(eager.named_buffers(), compiled_model.named_buffers()):
        assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6), name
    tracked = [b for n, b in compiled_model.named_buffers() if n.endswith("num_batches_tracked")]
    assert tracked and all(int(t) == 2 for t in tracked)
    for a, b in zip(eager.parameters(), compiled_model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_masks_equal_eager(device, p):
    """With the same seed, checkpointed blocks see eager's dropout masks: outputs and gradients match."""
    spec = Spec(depth=3, width=16, dropout=p)
    model = make(spec, device=device)
    x = inputs(spec, 2, 6, device=device)
    eager = train_step(model, x)
    got = train_step(model, x, ckpt_fx.backend(policy="blocks:every=1,skip_first=0", strict=True))
    assert torch.equal(got.out, eager.out) if device == "cpu" else close(got, eager)
    assert close(got, eager)
    other_seed = train_step(model, x, ckpt_fx.backend(policy="blocks:every=1,skip_first=0"), seed=8)
    assert not torch.equal(other_seed.out, eager.out)  # the masks really are random


def test_a_dropout_whose_mask_outweighs_the_generator_state_is_drawn_again_not_saved(monkeypatch):
    """Note [Dropout replayed]: masks of 16 KB (batch 4 x 64, width 64) are drawn again in the
    backward from a saved CPU generator state: gradients bitwise those of aot_eager, no mask among
    the blocks' saved tensors, and a lower measured peak than saving the masks."""
    import passes.select as select
    from ckpt_fx.bench.models import build

    torch.manual_seed(0)
    model = build("gpt", layers=3, dim=64, heads=2, dropout=0.1)
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(1))

    def step(fn):
        torch.manual_seed(7)
        fn(ids, ids).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        peak = ckpt_fx.peak_bytes(lambda: fn(ids, ids).backward())
        model.zero_grad(set_to_none=True)
        return grads, peak

    def planned(fn, backend):
        torch._dynamo.reset()
        grads, peak = step(torch.compile(model, backend=backend))
        return grads, peak, backend.plans[0]

    ref, _ = step(torch.compile(model, backend="aot_eager"))
    policy = "blocks:every=1,skip_first=0"
    # The head whole: bitwise is this test's contract, and a chunked head's is a bound (test_head.py).
    grads, replayed_peak, replayed = planned(model, ckpt_fx.backend(policy=policy, compiler="eager", strict=True,
                                                                    head="whole"))
    assert all(torch.equal(a, b) for a, b in zip(grads, ref, strict=True))
    masks = [s.name for s in replayed.saved if s.kind == "dropout mask" and s.block is not None]
    assert not masks and any(s.kind == "random-number state" for s in replayed.saved), masks  # the embedding's dropout is no block's
    monkeypatch.setattr(select, "CPU_RNG_STATE_BYTES", 1 << 40)  # nothing replayable: every mask saved
    grads, saved_peak, masked = planned(model, ckpt_fx.backend(policy=policy, compiler="eager", strict=True,
                                                               head="whole"))
    assert all(torch.equal(a, b) for a, b in zip(grads, ref, strict=True))
    assert "dropout mask" in [s.kind for s in masked.saved]
    assert replayed.saved_bytes < masked.saved_bytes and replayed_peak < saved_peak, (replayed_peak, saved_peak)


def test_parity_on_device(device):
    """The property test's core check on each available device."""
    spec = Spec(depth=3, width=16, dropout=0.1, attention="sdpa" if device == "cuda" else "manual")
    model = make(spec, device=device)
    x = inputs(spec, 2, 6, device=device)
    for policy in ("blocks", "segments:2", "sqrt"):
        got = train_step(model, x, ckpt_fx.backend(policy=policy, strict=True))
        ref = train_step(model, x, "aot_eager")
        assert bitwise_equal(got, ref), policy


@pytest.mark.slow
@given(spec=specs, batch=st.integers(1, 3), seq=st.integers(2, 6))
def test_budget_plans_are_exact_and_the_smallest_budget_named_fits(spec, batch, seq):
    """budget(0.3) either plans (gradients bitwise those of the un-checkpointed run) or fails
    naming the smallest feasible budget; that one then plans, exactly as well."""
    from passes.solve import Infeasible

    model = make(spec)
    x = inputs(spec, batch, seq)
    base = train_step(model, x, "aot_eager")
    try:
        got = train_step(model, x, ckpt_fx.backend(policy="budget:0.3", strict=True))
    except Exception as error:  # noqa: BLE001 - dynamo wraps the backend's error
        cause = error
        while cause is not None and not isinstance(cause, Infeasible):
            cause = getattr(cause, "inner_exception", None) or cause.__cause__
        assert cause is not None, error
        smallest = round(cause.reached, 3)  # as the message shows it
        torch._dynamo.reset()
        got = train_step(model, x, ckpt_fx.backend(policy=f"budget:{min(1.0, smallest + 0.002):.3f}", strict=True))
    assert bitwise_equal(got, base)


def offload_coin_policy(info: ckpt_fx.NodeInfo) -> CheckpointPolicy:
    """Arbitrary per-node decisions among all three: save, recompute, offload."""
    return (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_SAVE,
            CheckpointPolicy.MUST_CPU_OFFLOAD)[zlib.crc32(info.name.encode()) % 3]


OFFLOADING = ["offload", "offload:every=1,skip_first=0", "budget:0.05,offload,bandwidth=1000", offload_coin_policy]


@pytest.mark.slow
@settings(max_examples=max(8, settings.default.max_examples // 3))  # each example compiles three times
@given(spec=specs, policy=st.sampled_from(OFFLOADING), batch=st.integers(1, 3), seq=st.integers(2, 6))
def test_offload_plans_train_as_the_same_plan_without_offload(spec, policy, batch, seq):
    """Note [Offload] in passes/offload.py: keeping saved values in host memory changes where
    they wait, not what is computed. An offload plan's outputs, gradients and buffers are bitwise
    those of the same decisions with every offload a save (replayed from its joint graph), and of
    aot_eager without checkpointing (eager inner compiler). (A budget no plan reaches plans its
    lowest, offloading most.)"""
    import warnings

    from passes.offload import OFFLOAD_KEY
    from passes.select import REASON_KEY, BY_POLICY

    torch._dynamo.reset()
    model = make(spec)
    x = inputs(spec, batch, seq)
    recorder = Recorder(policy, strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on a CPU offloading saves nothing; a budget may not be reached: not the point here
        got = train_step(model, x, recorder.backend)
    decided = {}
    for joint, _ in recorder.graphs:
        for n in forward_nodes(joint.graph):
            if n.meta.get(REASON_KEY) == BY_POLICY:
                keep = n.meta.get(OFFLOAD_KEY) and n.meta["recompute"] == CheckpointPolicy.MUST_SAVE
                decided[n.name] = CheckpointPolicy.MUST_SAVE if keep else n.meta["recompute"]
    torch._dynamo.reset()
    without = train_step(model, x, ckpt_fx.backend(policy=lambda info: decided.get(info.name, CheckpointPolicy.PREFER_SAVE),
                                                   compiler="eager", strict=True))
    torch._dynamo.reset()
    base = train_step(model, x, "aot_eager")
    assert len(recorder.backend.plans) == len(recorder.graphs)  # every graph planned, none fell back
    assert bitwise_equal(got, without)
    assert bitwise_equal(got, base)
