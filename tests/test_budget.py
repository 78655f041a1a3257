"""The memory-budget policy on real graphs: exact gradients, the predicted and measured peak
falling with the budget, the cheapest plan that fits, and a clear error when nothing fits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ckpt_fx
from ckpt_fx import policies
from passes import budget as budget_module
from ckpt_fx.bench.models import build
from passes.solve import Infeasible
from tests._models import Recorder

# The lowest stays clear of what a plan can reach: torch 2.15's partition saves less without
# checkpointing than 2.13's, so a fraction counts from a lower base (0.15 is reachable on 2.13 only).
BUDGETS = (1.0, 0.7, 0.5, 0.3, 0.25)


@pytest.fixture(scope="module")
def gpt_runs():
    """One GPT (4 blocks, width 128, batch 4x128) under each budget: grads, peaks, choices."""
    torch.manual_seed(0)
    model = build("gpt", layers=4, dim=128, heads=4, dropout=0.0)
    ids = torch.randint(0, 1000, (4, 128))
    model(ids, ids).backward()
    eager = [p.grad.clone() for p in model.parameters()]
    runs = {}
    for b in BUDGETS:
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        backend = ckpt_fx.backend(policy=f"budget:{b}", strict=True)
        fn = torch.compile(model, backend=backend)
        fn(ids, ids).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        measured = ckpt_fx.peak_bytes(lambda: fn(ids, ids).backward())
        runs[b] = dict(grads=grads, measured=measured, plan=backend.plans[0], choice=backend.plans[0].budget)
    return eager, runs


def test_budget_gradients_equal_eager(gpt_runs):
    eager, runs = gpt_runs
    for b, run in runs.items():
        for got, want in zip(run["grads"], eager, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"budget {b}")


def test_budget_peak_falls_with_the_budget_and_fits_it(gpt_runs):
    _, runs = gpt_runs
    predicted = [runs[b]["plan"].peak_bytes for b in BUDGETS]
    measured = [runs[b]["measured"] for b in BUDGETS]
    assert predicted == sorted(predicted, reverse=True), predicted
    for higher, lower in zip(measured, measured[1:]):
        assert lower <= higher * 1.02, measured
    assert measured[-1] < 0.5 * measured[0], measured  # the knob does something
    for b in BUDGETS:
        choice = runs[b]["choice"]
        assert choice.peak <= choice.limit_bytes
        assert runs[b]["plan"].peak_bytes == choice.peak
    assert runs[1.0]["choice"].cost == 0.0  # the whole budget: nothing recomputed that costs
    assert all(runs[b]["choice"].solver in ("milp", "parts") for b in BUDGETS)  # exact


def test_budget_recompute_cost_rises_as_the_budget_falls(gpt_runs):
    _, runs = gpt_runs
    costs = [runs[b]["choice"].cost for b in BUDGETS]
    assert costs == sorted(costs), costs


def test_an_unreachable_budget_plans_the_lowest_with_one_warning_and_strict_raises():
    """As torch's knob, a budget no plan reaches does not fail the compile: the lowest plan, one
    warning naming the budget it reaches; exact gradients. strict=True raises Infeasible instead."""
    torch.manual_seed(0)
    model = build("gpt", layers=2, dim=64, heads=2, dropout=0.0)
    ids = torch.randint(0, 1000, (2, 32))
    backend = ckpt_fx.backend(policy="budget:0.01")
    with pytest.warns(UserWarning, match=r"budget 0.01 is infeasible.*lowest any plan reaches.*budget 0\.\d+ as a fraction.*planned the lowest"):
        _train_compiled_like_eager(model, ids, backend)
    choice = backend.plans[0].budget
    assert choice.peak > choice.limit_bytes and choice.reached is not None and 0.01 < choice.reached < 1
    assert backend.plans[0].peak_bytes == choice.peak == choice.smallest_peak < choice.baseline_peak
    assert backend.plans[0].recomputed

    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    with pytest.raises(Exception, match=r"budget 0.01 is infeasible") as error:
        torch.compile(model, backend=ckpt_fx.backend(policy="budget:0.01", strict=True))(ids, ids).backward()
    cause = error.value
    while cause is not None and not isinstance(cause, Infeasible):
        cause = getattr(cause, "inner_exception", None) or cause.__cause__
    assert isinstance(cause, Infeasible) and cause.smallest > cause.budget


def test_absolute_budget_bounds_the_predicted_peak():
    model = build("gpt", layers=2, dim=64, heads=2, dropout=0.0)
    ids = torch.randint(0, 1000, (2, 64))
    base = ckpt_fx.backend(policy="none")
    torch.compile(model, backend=base)(ids, ids).backward()
    limit = int(0.8 * base.plans[0].peak_bytes)
    torch._dynamo.reset()
    backend = ckpt_fx.backend(policy=f"budget:{limit}B", strict=True)
    torch.compile(model, backend=backend)(ids, ids).backward()
    assert backend.plans[0].peak_bytes <= limit


@pytest.mark.parametrize(
    "spec, name",
    [("budget:0.3", "budget(0.3)"), ("budget: 2GiB", "budget('2GiB')"), ("budget:512MB", "budget('512MB')"), ("budget:1", "budget(1)"),
     ("budget:0.3,costs=measured", "budget(0.3, costs='measured')"), ("budget:0.3, solver=milp", "budget(0.3, solver='milp')"),
     ("budget:20GiB,offload", "budget('20GiB', offload=True)"),
     ("budget:0.3,offload,bandwidth=25GB/s", "budget(0.3, offload=True, bandwidth='25GB/s')")],
)
def test_budget_string_forms(spec, name):
    assert policies.policy_name(policies.parse(spec)) == name


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("budget", "needs a limit"),
        ("budget:0", r"fraction must lie in \(0, 1\]"),
        ("budget:1.5", r"fraction must lie in \(0, 1\]"),
        ("budget:2PB", "cannot read '2PB'"),
        ("budget:lots", "cannot read 'lots'"),
        ("budget:0.3,costs=guess", "unknown costs 'guess'; valid: roofline, measured"),
        ("budget:0.3,speed=9", "budget takes a limit, then costs=..., solver=..., offload, bandwidth=...; got 'speed=9'"),
        ("budget:0.3,bandwidth=5", "bandwidth prices host copies; it needs offload=True"),
        ("budget:0.3,offload,bandwidth=0", r"bandwidth: must be a finite number of GB/s > 0"),
        ("budget:0.3,offload,bandwidth=-2GB/s", r"bandwidth: cannot read '-2GB/s'"),
        ("budget:0.3,offload,bandwidth=fast", r"bandwidth: cannot read 'fast'; write a number of GB/s like 25"),
    ],
)
def test_bad_budgets_raise_naming_the_value(spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        policies.parse(spec)
    with pytest.raises(ValueError, match="unknown solver 'best'"):
        policies.budget(0.5, solver="best")


def test_a_graph_with_nothing_to_recompute_is_kept_not_refused():
    """A loss computed after a graph break has nothing a budget could drop: that graph is kept as
    it is, and the graph with the blocks still gets its budget."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = build("gpt", layers=2, dim=64, heads=2, dropout=0.0)

        def forward(self, ids):
            logits = self.body(ids)
            torch._dynamo.graph_break()
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())

    model = Model()
    ids = torch.randint(0, 1000, (2, 64))
    backend = ckpt_fx.backend(policy="budget:0.6", strict=True)
    torch.compile(model, backend=backend)(ids).backward()
    choices = [p.budget for p in backend.plans]
    assert len(backend.plans) == 2 and len(choices) == 2
    body, loss = choices
    assert body.peak <= body.limit_bytes < body.baseline_peak
    assert loss.peak == loss.baseline_peak == loss.smallest_peak  # kept as it is


def _train_compiled_like_eager(model, ids, backend) -> None:
    """One step eager, one compiled with `backend` from the same start: gradients allclose."""
    model(ids, ids).backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.compile(model, backend=backend)(ids, ids).backward()
    for got, want in zip((p.grad for p in model.parameters()), eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_deep_stack_is_planned_through_its_alike_blocks():
    """16 alike blocks: the candidates come from one front summed over the blocks (solver
    'parts', exact), and the plan trains like eager."""
    torch.manual_seed(0)
    model = build("llama", layers=16, dim=32, heads=2, vocab=128)
    ids = torch.randint(0, 128, (2, 16))
    backend = ckpt_fx.backend(policy="budget:0.3", strict=True)
    _train_compiled_like_eager(model, ids, backend)
    choice = backend.plans[0].budget
    assert choice.solver == "parts" and choice.peak <= choice.limit_bytes
    assert backend.plans[0].peak_bytes == choice.peak


def test_measured_costs_time_the_ops_and_plan_exact_gradients(monkeypatch):
    """costs="measured": each distinct op timed on random tensors of its shapes, real ones even
    though the partitioner runs under the tracer's fake mode; a matmul costs more than a view
    (free) and timing alike ops once; the plan trains like eager."""
    from torch._subclasses.fake_tensor import FakeTensor

    from passes.costs import measured_costs

    torch.manual_seed(0)
    model = build("gpt", layers=2, dim=64, heads=2, dropout=0.0)
    ids = torch.randint(0, 1000, (2, 32))
    recorder = Recorder("budget:0.3,costs=measured")
    made, randn = [], torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: made.append(randn(*a, **k)) or made[-1])
    _train_compiled_like_eager(model, ids, recorder.backend)
    monkeypatch.undo()
    assert made and not any(isinstance(t, FakeTensor) for t in made)  # timed on real tensors
    cost = measured_costs("cpu")
    joint = recorder.graphs[0][0]
    mms = [n for n in joint.graph.nodes if n.target is torch.ops.aten.mm.default]
    alike: dict[tuple, list] = {}
    for n in mms:  # the same projection in each block: same shapes
        alike.setdefault(tuple(tuple(a.meta["val"].shape) for a in n.args), []).append(n)
    first, second = next(nodes for nodes in alike.values() if len(nodes) >= 2)[:2]
    assert cost(first) > 0
    assert cost(second) == cost(first)  # served from the first timing: two timings of a matmul never agree to the bit


def test_warnings_point_at_the_users_line():
    """A warning names the caller's file and line (here, this test), not a line inside ckpt_fx or torch."""
    torch.manual_seed(0)
    model = build("gpt", layers=2, dim=32, heads=2, dropout=0.0)
    ids = torch.randint(0, 1000, (2, 16))
    with pytest.warns(UserWarning, match="budget 0.01 is infeasible") as record:
        torch.compile(model, backend=ckpt_fx.backend(policy="budget:0.01"))(ids, ids).backward()
    ours = [w for w in record if "ckpt_fx" in str(w.message)]
    assert ours and all(w.filename == __file__ for w in ours), [(w.filename, w.lineno) for w in ours]


def test_the_choice_lands_in_the_plan_not_on_the_policy():
    """One budget policy object shared by two backends: each graph's plan records its own choice
    (a BudgetSpec is a frozen record: there is nowhere else for it to go)."""
    from tests._models import Spec, inputs, make, train_step

    shared = ckpt_fx.policies.budget(0.5)
    plans = []
    for depth in (2, 4):
        spec = Spec(depth=depth, width=16)
        backend = ckpt_fx.backend(policy=shared, compiler="eager", strict=True)
        train_step(make(spec), inputs(spec, 2, 4), backend)
        plans += backend.plans
    assert [p.budget.limit_bytes < p.budget.baseline_peak for p in plans] == [True, True]
    assert plans[0].budget.baseline_peak < plans[1].budget.baseline_peak  # each its own graph's figures



@given(st.data())
def test_the_search_finds_the_first_candidate_that_fits_in_few_plans(data):
    """On peaks that fall along the candidates, the search under a min-cut partition returns what
    a scan would (the first that fits), planning each candidate at most once, and on a curve that
    falls linearly with the saved bytes it plans no more than a bisection would."""
    count = data.draw(st.integers(2, 40), label="candidates")
    saved = sorted(data.draw(st.lists(st.integers(1, 10**6), min_size=count, max_size=count, unique=True)), reverse=True)
    linear = data.draw(st.booleans(), label="linear")
    drops = data.draw(st.lists(st.integers(0, 10**5), min_size=count, max_size=count))
    peaks = [2 * s for s in saved] if linear else [sum(drops[i:]) for i in range(count)]
    base_saved = 2 * saved[0] + 1
    base_peak = 2 * base_saved if linear else peaks[0] + 1
    limit = data.draw(st.integers(peaks[-1], base_peak - 1), label="limit")
    planned = []

    def fits(i: int) -> bool:
        planned.append(i)
        return peaks[i] <= limit

    found = budget_module._cheapest_fitting(
        -1, count - 1, fits=fits, saved=lambda i: base_saved if i < 0 else saved[i],
        peak=lambda i: base_peak if i < 0 else peaks[i], limit=limit)
    assert found == next(i for i in range(count) if peaks[i] <= limit)
    assert len(planned) == len(set(planned))
    if linear:
        assert len(planned) <= max(1, math.ceil(math.log2(count + 1))) + 1


@given(st.data())
def test_the_search_aimed_by_torchs_plan_finds_the_first_affordable_candidate_that_fits(data):
    """With torch's plan's point known (on the curve or off it), the search returns the first of
    the affordable candidates that fits, or None when none of them does."""
    count = data.draw(st.integers(2, 30), label="candidates")
    saved = sorted(data.draw(st.lists(st.integers(1, 10**6), min_size=count, max_size=count, unique=True)), reverse=True)
    drops = data.draw(st.lists(st.integers(0, 10**5), min_size=count, max_size=count))
    peaks = [sum(drops[i:]) for i in range(count)]
    base_saved, base_peak = saved[0] + 1, peaks[0] + 1
    point = (data.draw(st.integers(0, base_saved), label="torch's saved"),
             data.draw(st.integers(0, base_peak + 10), label="torch's peak"))
    limit = data.draw(st.integers(0, base_peak - 1), label="limit")
    affordable = data.draw(st.integers(0, count), label="affordable")

    found = budget_module._search(
        count, affordable=affordable, fits=lambda i: peaks[i] <= limit, saved=lambda i: base_saved if i < 0 else saved[i],
        peak=lambda i: base_peak if i < 0 else peaks[i], same=lambda i, j: i == j, limit=limit, torch_point=point)
    assert found == next((i for i in range(affordable) if peaks[i] <= limit), None)


def _between(known: list[tuple[float, float]], s: float) -> float:
    """The peak at saved bytes `s` on the line between the measured (saved, peak) points around it."""
    (x0, y0), (x1, y1) = next((a, b) for a, b in zip(known, known[1:]) if a[0] <= s <= b[0])
    return y0 + (y1 - y0) * (s - x0) / (x1 - x0)


def test_torchs_plan_aims_the_search_at_the_limit():
    """Saved bytes (MB, as each candidate's solution counts them) and predicted peaks of the
    candidates `budget:0.5` offers on transformers' Llama 6 x 256 (SDPA, GQA, batch 2 x 512), and
    torch's plan at 0.5 (80.7 MB saved, 116.8 MB peak; the limit 99.0): peaks measured by the
    search there, the rest interpolated. Aimed by the line through the baseline and torch's plan,
    the search finds the first that fits (63.0 MB saved) in three plans; planning the candidate
    that saves least first, as without torch's plan, it takes four."""
    saved = [199.3, 168.9, 143.7, 121.7, 103.9, 88.1, 74.5, 63.0, 53.5, 45.8, 39.0, 33.2, 28.0, 23.8, 20.1,
             17.4, 14.8, 12.1, 10.6] + [10.5] * 11
    known = [(10.5, 79.6), (12.1, 79.6), (14.8, 81.7), (53.5, 92.3), (63.0, 97.5), (74.5, 107.5), (103.9, 124.8),
             (121.7, 130.0), (143.7, 139.5), (159.5, 167.6)]

    def peak_at(s: float) -> float:
        if s >= known[-1][0]:
            return known[-1][1]
        return _between(known, s)

    def search(torch_point: tuple[float, float] | None) -> tuple[int | None, list[int]]:
        planned = []

        def fits(i: int) -> bool:
            planned.append(i)
            return peak_at(saved[i]) <= 99.0

        found = budget_module._search(
            len(saved), affordable=len(saved), fits=fits, saved=lambda i: 159.5 if i < 0 else saved[i],
            peak=lambda i: 167.6 if i < 0 else peak_at(saved[i]), same=lambda i, j: saved[i] == saved[j],
            limit=99.0, torch_point=torch_point)
        return found, planned

    aimed, aimed_plans = search((80.7, 116.8))
    unaimed, unaimed_plans = search(None)
    assert saved[aimed] == saved[unaimed] == 63.0
    assert [saved[i] for i in aimed_plans] == [53.5, 63.0, 74.5]
    assert len(unaimed_plans) == 4 and saved[unaimed_plans[0]] == 10.5


def test_a_candidate_aimed_just_over_the_limit_is_followed_by_its_neighbour():
    """Saved bytes (MB) of the candidates `budget:0.7` offers on transformers' Qwen2 4 x 256 (SDPA,
    GQA, batch 2 x 512), peaks measured by the search there (8.1, 44.8 and 52.7 MB saved), the rest
    interpolated towards the baseline's (92.3 MB saved, 100.5 peak); torch's plan at 0.7: 61.9 MB
    saved, 82.5 peak; the limit 75.7. The line through the baseline and torch's plan aims at the
    candidate saving 52.7 MB, which peaks 1% over the limit: the one after it (44.8 MB, 67.8) is
    planned next, fits, and is the answer, in two plans (the candidate that saves least was
    planned second before, for three)."""
    saved = [119.3, 100.9, 85.7, 73.2, 62.1, 52.7, 44.8, 38.0, 32.3, 27.5, 23.4, 19.8, 16.6, 14.3, 12.2, 10.3, 8.7] + [8.1] * 13
    known = [(8.1, 58.6), (44.8, 67.8), (52.7, 76.5), (92.3, 100.5)]

    def peak_at(s: float) -> float:
        if s >= known[-1][0]:
            return known[-1][1] + s - known[-1][0]
        return _between(known, s)

    planned = []

    def fits(i: int) -> bool:
        planned.append(saved[i])
        return peak_at(saved[i]) <= 75.7

    found = budget_module._search(
        len(saved), affordable=len(saved), fits=fits, saved=lambda i: 92.3 if i < 0 else saved[i],
        peak=lambda i: 100.5 if i < 0 else peak_at(saved[i]), same=lambda i, j: saved[i] == saved[j],
        limit=75.7, torch_point=(61.9, 82.5))
    assert saved[found] == 44.8
    assert planned == [52.7, 44.8]


def test_the_search_plans_the_neighbour_of_a_candidate_near_the_limit():
    """Saved bytes (MiB) and predicted peaks of the candidates `budget:0.5` offers on transformers'
    Llama 6 x 256 (SDPA, GQA, batch 2 x 512; peaks measured by the search there, the rest
    interpolated). The first that fits is 60.1 MiB saved (93.0 MiB peak, limit 94.4): found in
    three plans after the lowest, where a bisection with interpolation planned six."""
    saved = [190.1, 161.1, 137.1, 116.1, 99.1, 84.1, 71.1, 60.1, 51.1, 43.7, 37.2, 31.7, 26.7, 22.7, 19.1, 16.6, 14.1, 11.6, 10.1, 10.0]
    known = [(10.0, 75.9), (43.7, 86.5), (51.1, 88.0), (60.1, 93.0), (71.1, 102.5), (84.1, 104.0), (116.1, 124.0), (190.1, 159.9)]

    def peak_at(s: float) -> float:
        return _between(known, s)

    peaks = [peak_at(s) for s in saved]
    planned = []

    def fits(i: int) -> bool:
        planned.append(i)
        return peaks[i] <= 94.4

    found = budget_module._cheapest_fitting(
        -1, len(saved) - 1, fits=fits, saved=lambda i: 190.1 if i < 0 else saved[i],
        peak=lambda i: 159.9 if i < 0 else peaks[i], limit=94.4)
    assert saved[found] == 60.1
    assert len(planned) <= 3, [saved[i] for i in planned]


@pytest.mark.parametrize("error", [-0.99, pytest.param(100.0, marks=pytest.mark.slow)])
def test_torchs_plan_beyond_reach_is_not_scheduled_whole(monkeypatch, error):
    """Note [Torch's plan beyond reach]: under Inductor, torch's plan's whole backward is scheduled
    only where its peak block by block is within BLOCKWISE_ERROR of the limit, or, when none of
    ours fits (a budget no plan reaches here), of our lowest plan; out of reach it is neither
    chosen nor the lowest. Made never within reach (-0.99) it is never scheduled whole and the
    lowest of ours is planned; always within (100) it is scheduled whole at once."""
    from ckpt_fx.dynamo_backend import CkptBackend
    from passes.plan import Source

    real, wholes = budget_module.scheduled_whole, []
    monkeypatch.setattr(budget_module, "scheduled_whole", lambda joint, planned: wholes.append(1) or real(joint, planned))
    monkeypatch.setattr(budget_module, "BLOCKWISE_ERROR", error)
    torch.manual_seed(0)
    model = build("gpt", layers=2, dim=128, heads=2, dropout=0.0)
    ids = torch.randint(0, 1000, (4, 128))
    backend = CkptBackend(ckpt_fx.backend(policy="budget:0.01", compiler="inductor").options, kernels=False)
    with pytest.warns(UserWarning, match="budget 0.01 is infeasible"):
        torch.compile(model, backend=backend)(ids, ids).backward()
    choice = backend.plans[0].budget
    assert choice.peak > choice.limit_bytes
    if error < 0:
        assert wholes == [] and choice.source == Source.SOLVER
    else:
        assert wholes == [1]
