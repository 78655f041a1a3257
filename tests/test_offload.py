"""Offload, the third decision (Note [Offload] in passes/offload.py): the planner on hand-built
problems and on a small model, the device peak it predicts, and what it says about bad input.
Gradients: tests/test_parity.py (offload plans train bitwise as the same plans without)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ckpt_fx
from ckpt_fx.bench.models import build
from passes.solve import Problem, milp, solve

IDS = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(0))


def _plans(policy: str, *, layers: int = 4, strict: bool = True) -> list[ckpt_fx.Plan]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build("llama", layers=layers, dim=64, heads=2)
    # The head whole: chunked, this small model's peak is the head's own, where no block output is
    # on the device to offload.
    backend = ckpt_fx.backend(policy=policy, compiler="eager", strict=strict, head="whole")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on a CPU offloading saves nothing: said once, not the point here
        torch.compile(model, backend=backend)(IDS, IDS).backward()
    return backend.plans


def _chain_of_units(count: int, *, transfer: float) -> Problem:
    """`count` units, each: an input (16 bytes, not recomputable), then two values of 64 bytes
    the backward reads (cost 1 each), recomputable from the input."""
    rows = [(16, 0.5, False), (64, 1.0, True), (64, 1.0, True)]
    n = count * len(rows)
    return Problem(
        names=tuple(f"u{u}.{k}" for u in range(count) for k in range(len(rows))),
        nbytes=tuple(nb for _ in range(count) for nb, _, _ in rows),
        cost=tuple(c for _ in range(count) for _, c, _ in rows),
        inputs=tuple(() if k == 0 else (u * len(rows) + k - 1,) for u in range(count) for k in range(len(rows))),
        needed=(True,) * n,
        recomputable=tuple(r for _ in range(count) for _, _, r in rows),
        offloadable=(True,) * n, transfer=(transfer,) * n,
        group=tuple(u for u in range(count) for _ in rows),
    )


def test_copies_without_cost_offload_everything_the_budget_needs_and_copies_without_end_nothing():
    """Infinite bandwidth (copies take no time): at the smallest device budget every value is
    offloaded and nothing recomputed. Zero bandwidth (copies never end): wherever a plan without
    offloading fits, nothing is offloaded; where none fits, only what cannot be recomputed is."""
    free, endless = _chain_of_units(3, transfer=0.0), _chain_of_units(3, transfer=1e12)
    least = milp(free, 0)
    assert least.offloaded == frozenset(range(len(free))) and not least.recomputed
    smallest_without = sum(16 for _ in range(3))  # the inputs, which cannot be recomputed
    for budget in (smallest_without, 200, sum(free.nbytes)):
        assert milp(endless, budget).offloaded == frozenset()
        assert solve(endless, budget).offloaded == frozenset()
    assert milp(endless, 0).offloaded == {0, 3, 6}


def test_offload_keeps_values_off_the_device_and_the_prediction_counts_only_what_stays():
    """The same units checkpointed with and without offload recompute the same nodes; the
    offload plan keeps every unit's output in host memory: its device saved bytes are lower by
    exactly the host bytes, each offloaded value is listed (in forward order) with its bytes,
    and its predicted device peak is lower."""
    (kept,), (moved,) = _plans("blocks:every=1,skip_first=0"), _plans("offload:every=1,skip_first=0")
    assert moved.recomputed == kept.recomputed
    assert len(moved.offloaded) == 4  # one output per block
    host = [s for s in moved.saved if s.offloaded]
    assert [s.name for s in host] == list(moved.offloaded)
    assert moved.offloaded_bytes == sum(s.nbytes for s in host) > 0
    assert kept.saved_bytes - moved.saved_bytes == moved.offloaded_bytes
    assert moved.peak_bytes < kept.peak_bytes
    assert sum(b.offloaded_bytes for b in moved.blocks) == moved.offloaded_bytes


@pytest.mark.slow
def test_offload_under_dynamic_shapes_moves_tensors_and_keeps_sizes():
    """A transformers Llama traced with a dynamic batch: a block's boundary values include sizes
    (SymInts) the policy asks to offload; they stay, the tensors move, gradients equal eager's."""
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 128, (4, 16))
    backend = ckpt_fx.backend(policy="offload", compiler="eager", strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on a CPU offloading saves nothing
        torch.compile(model, backend=backend, dynamic=True)(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    twin(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    (plan,) = backend.plans
    assert plan.symbols and len(plan.offloaded) >= 3
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)


@pytest.mark.slow
def test_a_budget_with_offload_falls_with_the_limit_and_plans_alike_every_time():
    """budget(x, offload=True): the predicted device peak never rises as the limit falls; with
    fast copies a low limit offloads; two compiles of the same graph give the same plan."""
    peaks = []
    for limit in (0.9, 0.5, 0.3, 0.1):
        (plan,) = _plans(f"budget:{limit},offload,bandwidth=1000", strict=False)
        peaks.append(plan.peak_bytes)
    assert peaks == sorted(peaks, reverse=True), peaks
    (first,), (again,) = (_plans("budget:0.1,offload,bandwidth=1000", strict=False) for _ in range(2))
    assert first.offloaded and (first.offloaded, first.recomputed) == (again.offloaded, again.recomputed)


def test_offload_on_a_cpu_runs_and_says_once_that_it_saves_nothing():
    """On a CPU there is no device to leave: the plan runs, one warning says so."""
    torch._dynamo.reset()
    model = build("llama", layers=2, dim=64, heads=2)
    backend = ckpt_fx.backend(policy="offload:every=1,skip_first=0", compiler="eager")
    with pytest.warns(UserWarning, match="runs on the CPU: there is no device memory to free") as record:
        fn = torch.compile(model, backend=backend)
        fn(IDS, IDS).backward()
        fn(IDS, IDS).backward()
    assert sum("there is no device memory" in str(w.message) for w in record) == 1
    assert backend.plans[0].offloaded


def test_offload_asked_of_values_that_cannot_move_says_which_stay():
    """A block whose output is the graph's own output cannot be offloaded (the user holds it):
    the plan saves it on the device and says so once."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

        def forward(self, x):
            h = self.layers[0](x).relu()
            return self.layers[1](h).relu(), h

    torch._dynamo.reset()
    backend = ckpt_fx.backend(policy=lambda info: ckpt_fx.CheckpointPolicy.MUST_CPU_OFFLOAD, compiler="eager")
    x = torch.randn(4, 16)
    net = Net()
    with pytest.warns(UserWarning, match=r"stay on the device, as torch's offload pass moves only values"):
        out, h = torch.compile(net, backend=backend)(x)
        (out.sum() + h.sum()).backward()
    plan = backend.plans[0]
    assert "relu" not in plan.offloaded  # h, returned to the user


@pytest.mark.parametrize("bandwidth, fragment", [(0, "must be a finite number of GB/s > 0"),
                                                 (-3.0, "must be a finite number of GB/s > 0"),
                                                 ("1 km/s", "cannot read '1 km/s'")])
def test_a_bad_bandwidth_is_refused_naming_what_is_allowed(bandwidth, fragment):
    with pytest.raises(ValueError, match=fragment):
        ckpt_fx.policies.budget(0.5, offload=True, bandwidth=bandwidth)
    with pytest.raises(ValueError, match="needs offload=True"):
        ckpt_fx.policies.budget(0.5, bandwidth=25)


@pytest.mark.slow
def test_offload_plans_under_inductor_train_like_eager(fresh_inductor_cache):
    """Under Inductor (min-cut partition) the offload pass runs on the graphs Inductor compiles:
    gradients allclose to eager's, the boundaries offloaded, the peak predicted by the walk."""
    from passes.plan import PeakModel

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build("llama", layers=2, dim=64, heads=2)
    eager = copy.deepcopy(model)
    eager(IDS, IDS).backward()
    backend = ckpt_fx.backend(policy="offload:every=1,skip_first=0", compiler="inductor", strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(model, backend=backend)(IDS, IDS).backward()
    for got, want in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)
    (plan,) = backend.plans
    assert len(plan.offloaded) == 2 and plan.peak_model == PeakModel.WALK
