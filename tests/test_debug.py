"""Debug mode: pass dumps, the pass list, and checks of recomputed tensors that name the culprit."""

from __future__ import annotations

import logging

import pytest
import torch

import ckpt_fx
from passes.debug import check_recomputed
from tests._models import Spec, close, inputs, make, train_step

SPEC = Spec(depth=3, width=16, dropout=0.1)
EVERY = "blocks:every=1,skip_first=0"


def test_debug_run_dumps_every_pass_and_keeps_gradients(tmp_path, caplog):
    b = ckpt_fx.backend(policy=EVERY, debug="values", debug_dir=str(tmp_path), strict=True)
    model, x = make(SPEC), inputs(SPEC, 2, 6)
    with caplog.at_level(logging.INFO, logger="ckpt_fx"):
        got = train_step(model, x, b)
    assert close(got, train_step(model, x))
    files = sorted(p.name for p in (tmp_path / "graph_001").iterdir())
    for name in ("dropout_before", "regions_before", "select_before", "select_after", "partition_before",
                 "schedule_before", "schedule_after", "partition_forward"):
        assert any(name in f for f in files), (name, files)
    decisions = next((tmp_path / "graph_001").glob("*select_after.py")).read_text()
    assert "MUST_RECOMPUTE" in decisions and "layers.1" in decisions and "random (tuple element)" in decisions
    assert any("ckpt_fx passes: dropout" in r.getMessage() and "memory" in r.getMessage() for r in caplog.records)


def test_environment_turns_debug_on(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_FX_DEBUG", "1")
    monkeypatch.setenv("CKPT_FX_DEBUG_DIR", str(tmp_path))
    assert ckpt_fx.backend().options.debug is True
    assert ckpt_fx.Options.from_mapping({}).debug_dir == str(tmp_path)
    monkeypatch.setenv("CKPT_FX_DEBUG", "maybe")
    with pytest.raises(ValueError, match="CKPT_FX_DEBUG must be 1, values or 0, got 'maybe'"):
        ckpt_fx.backend()


def test_check_names_the_first_mismatch():
    expected = ((2, 3), (3, 1), torch.float32)
    check_recomputed(torch.zeros(2, 3), "mm_1", "layers.1.fc", expected)
    with pytest.raises(RuntimeError, match=r"recomputed mm_1 \(module layers.1.fc\) has shape \(3, 2\)"):
        check_recomputed(torch.zeros(3, 2), "mm_1", "layers.1.fc", expected)
    with pytest.raises(RuntimeError, match="has dtype torch.float64"):
        check_recomputed(torch.zeros(2, 3, dtype=torch.float64), "mm_1", "layers.1.fc", expected)
    with pytest.raises(RuntimeError, match=r"has strides \(1, 2\)"):
        check_recomputed(torch.zeros(3, 2).t(), "mm_1", "layers.1.fc", expected)
    with pytest.raises(RuntimeError, match="differs from the forward's value"):
        check_recomputed(torch.zeros(2, 3), "mm_1", "layers.1.fc", expected, original=torch.ones(2, 3))


def test_a_recompute_that_differs_is_caught_in_the_backward(tmp_path):
    """Corrupt one recomputed op after planning: the values check names it and its module."""
    b = ckpt_fx.backend(policy=EVERY, debug="values", debug_dir=str(tmp_path), strict=True)
    corrupted = {}

    def corrupt(done) -> None:
        recomputed = set(done.plan.recomputed)
        for node in done.backward.graph.nodes:
            if node.name in recomputed and node.target is torch.ops.aten.gelu.default:
                node.kwargs = {"approximate": "tanh"}  # a different function than the forward ran
                corrupted["name"] = node.name
                break
        done.backward.recompile()

    b.on_partitioned.append(corrupt)
    spec = Spec(depth=3, width=16, attention="none")
    with pytest.raises(RuntimeError, match=r"ckpt_fx debug: recomputed gelu_\d+ \(module layers\.\d\) differs"):
        train_step(make(spec), inputs(spec, 2, 6), b)
    assert corrupted
