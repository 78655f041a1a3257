"""compiler="inductor": Inductor's joint-graph passes, our partition (through its custom
partitioner hook), Inductor's kernels. Gradients against eager with Inductor's random ops falling
back to aten's, the measured peak, and the FX graph cache never serving another policy's plan."""

from __future__ import annotations

import pytest
import torch

import ckpt_fx
from passes._compat import has_inductor_partitioner_hook, no_fx_graph_cache
from tests._models import seeded_step as _step, tiny_gpt as _model

pytestmark = [pytest.mark.skipif(not has_inductor_partitioner_hook(), reason="no custom_partitioner_fn in this torch"),
              pytest.mark.slow]


@pytest.mark.parametrize("batch, seq, replayed", [(2, 32, False), (4, 64, True)])
def test_inductor_gradients_equal_eager_with_dropout(fresh_inductor_cache, batch, seq, replayed):
    """With fallback_random (eager's dropout runs), gradients equal eager's; masks of 4 KB are
    saved, masks of 16 KB drawn again in the backward from a saved state (Note [Dropout replayed])."""
    model = _model(dropout=0.1)
    ids = torch.randint(0, 1000, (batch, seq))
    _step(model, ids)
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    backend = ckpt_fx.backend(policy="blocks:every=1,skip_first=0", compiler="inductor", strict=True)
    with torch._inductor.config.patch(fallback_random=True):
        _step(torch.compile(model, backend=backend), ids)
    for got, want in zip([p.grad for p in model.parameters()], eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    plan = backend.plans[0]
    assert plan.recomputed
    masks = [s.name for s in plan.saved if s.kind == "dropout mask" and s.block is not None]  # the embedding's is no block's
    states = [s.name for s in plan.saved if s.kind == "random-number state"]
    assert (not masks and states) if replayed else (masks and not states), (masks, states)


@pytest.mark.parametrize("batch, seq", [(2, 32), (4, 64)])  # masks of 4 KB (saved) and 16 KB (replayable)
def test_a_low_budget_draws_each_dropout_mask_once(fresh_inductor_cache, batch, seq):
    """Under Inductor the budget plans with torch's min-cut partitioner, whose own knob at a low
    budget recomputes dropout with new random numbers (pytorch/pytorch#190758); ours saves every
    mask or draws it again from its saved state (Note [Dropout replayed]), never leaving a dropout
    to min-cut: the bench's gradient column, under fallback_random, shows eager's gradients."""
    from ckpt_fx.bench import table as bench
    from ckpt_fx.bench import workloads

    workload = workloads.builtin_workload("gpt", layers=2, dim=64, heads=2, batch=batch, seq=seq, dropout=0.1)
    eager, ours = bench.run(workload, ("eager", "ckpt-inductor:budget:0.1"), steps=1, fallback_random=True)
    assert ours.error is None and ours.grad_note is None and ours.peak_ratio < 0.9, ours
    assert ours.grad_rel_diff < 1e-5, ours


def test_inductor_keeps_the_memory_savings_and_the_cache_keeps_policies_apart(fresh_inductor_cache):
    """Same model, same cache folder: `none` then per-block checkpointing. The second compile makes
    its own plan (the cache key holds the policy) and its measured peak is far lower."""
    model = _model()
    ids = torch.randint(0, 1000, (4, 128))
    peaks, plans = {}, {}
    for policy in ("none", "blocks:every=1,skip_first=0"):
        torch._dynamo.reset()
        backend = ckpt_fx.backend(policy=policy, compiler="inductor", strict=True)
        fn = torch.compile(model, backend=backend)
        _step(fn, ids)
        model.zero_grad(set_to_none=True)
        peaks[policy] = ckpt_fx.peak_bytes(lambda: _step(fn, ids))
        model.zero_grad(set_to_none=True)
        plans[policy] = backend.plans
    assert plans["blocks:every=1,skip_first=0"], "the cache served the other policy's plan"
    assert plans["blocks:every=1,skip_first=0"][0].recomputed
    assert peaks["blocks:every=1,skip_first=0"] < 0.75 * peaks["none"], peaks  # `none` is Inductor's own partition


def test_cache_key_names_policy_and_passes_and_skips_custom_callables():
    a = ckpt_fx.backend(policy="blocks", compiler="inductor")
    b = ckpt_fx.backend(policy="blocks:4", compiler="inductor")
    assert a.cache_key() != b.cache_key() and "blocks(every=1, skip_first=auto)" in a.cache_key()
    custom = ckpt_fx.backend(policy=lambda info: ckpt_fx.CheckpointPolicy.PREFER_SAVE, compiler="inductor")
    assert custom.cache_key() is None  # a function's name does not say what it decides: no caching


def test_debug_is_refused_with_inductor():
    with pytest.raises(ValueError, match="debug checks run Python in the graphs"):
        ckpt_fx.backend(compiler="inductor", debug=True)


def test_inductor_is_the_default_compiler_and_debug_picks_eager(monkeypatch):
    monkeypatch.delenv("CKPT_FX_COMPILER", raising=False)
    monkeypatch.delenv("CKPT_FX_DEBUG", raising=False)
    assert ckpt_fx.backend().options.compiler == "inductor"
    assert ckpt_fx.Options.from_mapping({}).compiler == "inductor"
    assert ckpt_fx.backend(debug=True).options.compiler == "eager"
    assert ckpt_fx.Options.from_mapping({"debug": True}).compiler == "eager"
    monkeypatch.setenv("CKPT_FX_COMPILER", "eager")
    assert ckpt_fx.backend().options.compiler == "eager"
    monkeypatch.setenv("CKPT_FX_COMPILER", "tvm")
    with pytest.raises(ValueError, match="unknown compiler 'tvm'"):
        ckpt_fx.backend()


@pytest.fixture(scope="module")
def inductor_rows(tmp_path_factory):
    """A small GPT under Inductor alone, torch's knob and our plans, measured side by side (in a
    kernel cache of its own: another process compiling the same kernels cannot interfere)."""
    import os

    from ckpt_fx.bench import table as bench
    from ckpt_fx.bench import workloads

    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    try:
        workload = workloads.builtin_workload("gpt", layers=3, dim=128, heads=4, batch=4, seq=256)
        setups = ("inductor", "ckpt-inductor:none", "ckpt-inductor:blocks:every=1,skip_first=0",
                  "inductor-budget:0.5", "ckpt-inductor:budget:0.5", "ckpt-inductor:selective")
        rows = {r.setup: r for r in bench.run(workload, setups, steps=1)}
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
    for r in rows.values():
        assert r.error is None, r  # a setup that failed to compile fails here, with its error
    return rows


def test_none_under_inductor_is_inductors_own_partition(inductor_rows):
    """Note [Min-cut under Inductor]: the decisions a policy leaves open go to torch's min-cut, so
    `none` measures what Inductor alone does, and every plan stacks its savings on top of it."""
    alone, none = inductor_rows["inductor"], inductor_rows["ckpt-inductor:none"]
    assert none.error is None and none.peak_mb <= 1.02 * alone.peak_mb, (none, alone)
    for name in ("ckpt-inductor:blocks:every=1,skip_first=0", "ckpt-inductor:budget:0.5", "ckpt-inductor:selective"):
        assert inductor_rows[name].peak_mb < none.peak_mb, inductor_rows[name]


def test_predicted_peak_under_inductor_is_within_10_percent(inductor_rows):
    """Note [Inductor's own schedule]: the memory pass predicts each plan as Inductor runs it,
    from Inductor's own lowering and scheduler."""
    for name, r in inductor_rows.items():
        if name.startswith("ckpt"):
            assert r.predicted_mb is not None and abs(r.predicted_mb / r.peak_mb - 1) < 0.10, r


def test_budget_under_inductor_keeps_no_more_than_torchs_knob(inductor_rows):
    """The same number, the same base: budget:0.5 counts from Inductor's own partition, like
    torch's activation_memory_budget=0.5, and its measured peak is no higher."""
    ours, knob = inductor_rows["ckpt-inductor:budget:0.5"], inductor_rows["inductor-budget:0.5"]
    assert ours.error is None and knob.error is None
    assert ours.peak_mb <= knob.peak_mb, (ours, knob)
    for r in inductor_rows.values():
        assert r.grad_rel_diff < 1e-5, r


def test_a_recomputing_plan_is_partitioned_once_without_cse_and_peaks_no_higher_than_with_it(fresh_inductor_cache, monkeypatch):
    """Note [CSE under recompute]: a policy that recomputes is partitioned once, without min-cut's
    CSE of the joint graph, and its backward is scheduled block by block; its gradients equal
    eager's, and its measured peak is no higher (within 3%) than the partition after the CSE, which
    on this model fuses neighbouring blocks' recomputes and peaks higher."""
    import passes.partition
    import passes.planner

    ids = torch.randint(0, 1000, (4, 128))
    policy = "blocks:every=1,skip_first=0"
    model = _model()
    _step(model, ids)
    eager = [p.grad.clone() for p in model.parameters()]
    partitions = []
    real = passes.partition.partition_pass
    monkeypatch.setattr(passes.planner, "partition_pass", lambda *a, **k: partitions.append(1) or real(*a, **k))

    def measured(backend):
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        fn = torch.compile(model, backend=backend)
        with no_fx_graph_cache():  # the second plan has the same cache key as the first
            _step(fn, ids)
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return ckpt_fx.peak_bytes(lambda: _step(fn, ids)), grads, backend.plans[0]

    ours, grads, plan = measured(ckpt_fx.backend(policy=policy, compiler="inductor", strict=True))
    for got, want in zip(grads, eager):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert plan.recomputed and plan.joint_cse is False and len(partitions) == 1, (plan.joint_cse, partitions)
    for module in (passes.partition, passes.planner):  # the CSE'd partition, for comparison
        monkeypatch.setattr(module, "merges_joint", lambda joint, *, target: True)
    merged, _, merged_plan = measured(ckpt_fx.backend(policy=policy, compiler="inductor", strict=True))
    assert merged_plan.joint_cse is True and merged_plan.recomputed
    assert ours <= 1.03 * merged, (ours, merged)
