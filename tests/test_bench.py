"""The benchmark's rows on a tiny model: every column filled from a real run, failed setups
reported rather than aborting, bad setups refused before anything runs. No timing is asserted."""

from __future__ import annotations

import math

import pytest

from ckpt_fx import bench


@pytest.fixture(scope="module")
def rows():
    workload = bench.builtin_workload("gpt", layers=2, dim=64, heads=2, batch=2, seq=64)
    setups = ("eager", "aot_eager-budget:0.5", "ckpt:selective", "ckpt:budget:0.5", "ckpt:budget:0.01")
    return {r.setup: r for r in bench.run(workload, setups, steps=1)}


def test_rows_measure_every_setup(rows):
    assert rows["eager"].peak_ratio == 1.0 and rows["eager"].recompute_gflop is None
    for name in ("aot_eager-budget:0.5", "ckpt:selective", "ckpt:budget:0.5"):
        r = rows[name]
        assert r.error is None and 0 < r.peak_mb and r.grad_rel_diff < 1e-5, r
    assert rows["ckpt:budget:0.5"].recompute_gflop > 0
    assert rows["ckpt:budget:0.5"].peak_ratio < 1.0


def test_an_infeasible_budget_is_a_row_with_its_error(rows):
    r = rows["ckpt:budget:0.01"]
    assert "infeasible" in r.error and "lowest any plan reaches" in r.error
    assert math.isnan(r.peak_mb)
    table = bench.markdown(list(rows.values()))
    assert "| ckpt:budget:0.01 | failed |" in table and "- ckpt:budget:0.01: " in table


@pytest.mark.parametrize("setup, fragment", [("foo", "unknown setup 'foo'"), ("inductor-budget:x", "must be a number"),
                                            ("ckpt:blokcs", "unknown policy")])
def test_bad_setups_are_refused_before_running(setup, fragment):
    workload = bench.builtin_workload("gpt", layers=1, dim=32, heads=2, batch=1, seq=8)
    with pytest.raises(ValueError, match=fragment):
        bench.run(workload, ("eager", setup), steps=1)


def test_plot_draws_the_pareto_front(rows, tmp_path):
    pytest.importorskip("matplotlib")
    done = [r for r in rows.values() if r.error is None]
    front = bench.pareto_front(done)
    assert front and all(not (o.peak_mb < r.peak_mb and o.step_s < r.step_s) for r in front for o in done)
    assert min(done, key=lambda r: r.peak_mb) in front and min(done, key=lambda r: r.step_s) in front
    path = tmp_path / "bench.png"
    bench.plot(list(rows.values()), str(path), title="tiny")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
