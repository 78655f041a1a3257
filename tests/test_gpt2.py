"""transformers' GPT-2 (12 blocks, n_embd 256, batch 8 x 256, train mode, its default dropout):
exact gradients, measured peak against eager and HF's per-block checkpointing, and the predicted
peak against the measured one. Memory is measured, not timed."""

from __future__ import annotations

import copy

import pytest
import torch

import ckpt_fx
from ckpt_fx.bench.setups import hf_checkpointing_enable

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gpt2():
    from ckpt_fx.bench.workloads import gpt2_workload

    return gpt2_workload()


def measure(workload, fn, model):
    """(peak bytes of the second step, parameter gradients of that step)."""

    def step():
        torch.manual_seed(1234)
        workload.loss(fn).backward()

    step()
    for p in model.parameters():
        p.grad = None
    peak = ckpt_fx.peak_bytes(step)
    return peak, [p.grad.clone() for p in model.parameters()]


def rel_diff(a, b):
    num = sum((x.double() - y.double()).pow(2).sum() for x, y in zip(a, b))
    den = sum(y.double().pow(2).sum() for y in b)
    return float((num / den) ** 0.5)


def test_gpt2_memory_and_gradients(gpt2):
    model = copy.deepcopy(gpt2.model)
    eager_peak, eager_grads = measure(gpt2, model, model)

    hf = copy.deepcopy(gpt2.model)
    hf_checkpointing_enable(hf, use_reentrant=False)
    hf_peak, _ = measure(gpt2, hf, hf)

    results = {}
    for policy in ("blocks", "blocks:every=1,skip_first=0"):
        m = copy.deepcopy(gpt2.model)
        b = ckpt_fx.backend(policy=policy, strict=True)
        peak, grads = measure(gpt2, torch.compile(m, backend=b), m)
        results[policy] = (peak, ckpt_fx.step_peak_bytes(b.plans))
        assert rel_diff(grads, eager_grads) < 1e-4, policy
        torch._dynamo.reset()

    default_peak, default_predicted = results["blocks"]
    assert default_peak <= 0.25 * eager_peak, (default_peak, eager_peak)
    every_peak, every_predicted = results["blocks:every=1,skip_first=0"]
    assert max(every_peak, default_peak) <= 1.15 * hf_peak, (every_peak, default_peak, hf_peak)
    for peak, predicted in results.values():
        assert abs(predicted - peak) <= 0.15 * peak, (predicted, peak)


def test_explain_names_each_of_the_12_blocks_with_its_saved_bytes(gpt2):
    report = ckpt_fx.explain(gpt2.model, *gpt2.args, policy="blocks:every=1,skip_first=1", **gpt2.kwargs)
    blocks = [b for plan in report.plans for b in plan.blocks]
    assert [b.path for b in blocks] == [f"transformer.h.{i}" for i in range(12)]
    text = str(report)
    for b in blocks:
        assert f"| {b.path} | {b.saved_bytes / 2**20:.2f} |" in text
    assert blocks[0].saved_bytes > 5 * blocks[1].saved_bytes  # block 0 is kept whole (skip_first=1)
