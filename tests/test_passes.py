"""select, schedule and memory passes: hard rules, just-in-time order, predicted vs measured peak."""

from __future__ import annotations

import copy

import pytest
import torch

import ckpt_fx
from ckpt_fx import CheckpointPolicy
from passes.memory import _walk
from passes.regions import forward_nodes
from passes.schedule import first_use_distance, schedule_pass
from passes.select import REASON_KEY
from tests._models import Recorder, Spec, bitwise_equal, inputs, make, train_step


def recompute_everything(info):
    return CheckpointPolicy.MUST_RECOMPUTE


def test_hard_rules_beat_a_policy_that_recomputes_everything():
    """Dropout masks and BatchNorm's running-stat updates are saved whatever the policy says,
    and the gradients stay equal to eager's."""
    spec = Spec(depth=2, width=8, dropout=0.5, batchnorm=True)
    model, x = make(spec), inputs(spec, 2, 4)
    cap = Recorder(recompute_everything)
    got = train_step(model, x, cap.backend)
    eager = train_step(model, x)
    reasons = {n.meta.get(REASON_KEY) for n in cap.graphs[0][0].graph.nodes}
    assert "random (tuple element)" in reasons  # native_dropout's mask
    assert "mutation source (tuple element)" in reasons  # BatchNorm's new running stats, copied into the buffers
    assert all(n.meta.get(REASON_KEY) != "policy" or n.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
               for n in cap.graphs[0][0].graph.nodes if n.op == "call_function" and n in set(forward_nodes(cap.graphs[0][0].graph)))
    for n in cap.graphs[0][1].graph.nodes:
        if isinstance(n.target, torch._ops.OpOverload):
            assert torch.Tag.nondeterministic_seeded not in n.target.tags
            assert n.target is not torch.ops.aten._native_batch_norm_legit_functional.default
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(got.grads, eager.grads))
    assert all(torch.equal(a, b) for a, b in zip(got.buffers, eager.buffers))


def test_batchnorm_outputs_are_recomputed_and_its_statistics_move_once():
    """Note [BatchNorm under checkpointing]: inside checkpointed blocks no BatchNorm output is
    saved; the backward rebuilds it with the op that moves no statistics, the forward normalises
    each input once, and outputs, gradients and running statistics are bitwise those of the
    un-checkpointed run."""
    spec = Spec(depth=3, width=16, batchnorm=True, conv=True, dropout=0.1)
    model, x = make(spec), inputs(spec, 2, 6)
    cap = Recorder("blocks:every=1,skip_first=0")
    got = train_step(model, x, cap.backend)
    assert bitwise_equal(got, train_step(model, x, "aot_eager"))
    (_, bw), fw, plan = cap.graphs[0], cap.forwards[0], cap.backend.plans[0]
    functional, no_stats = torch.ops.aten._native_batch_norm_legit_functional.default, torch.ops.aten._native_batch_norm_legit.no_stats
    count = lambda gm, op: sum(n.target is op for n in gm.graph.nodes)  # noqa: E731
    assert count(fw, functional) == 2 * spec.depth and count(fw, no_stats) == 0
    assert count(bw, no_stats) == 2 * spec.depth and count(bw, functional) == 0
    saved_outputs = [s for s in plan.saved if ".bn" in s.module_path or "conv_bn" in s.module_path]
    assert saved_outputs and all(s.nbytes < 16 * 4 * 4 for s in saved_outputs)  # statistics only, not activations


def test_a_policy_returning_garbage_is_named():
    spec = Spec(depth=2, width=8)
    model, x = make(spec), inputs(spec, 2, 4)
    with pytest.raises(Exception, match="must return a torch.utils.checkpoint.CheckpointPolicy"):
        train_step(model, x, ckpt_fx.backend(policy=lambda info: True, strict=True))


def _recompute_first(bw: torch.fx.GraphModule, recomputed: set[str]) -> torch.fx.GraphModule:
    """The naive order: every recomputed node before any gradient node."""
    nodes = list(bw.graph.nodes)
    graph = torch.fx.Graph()
    env = {}
    order = [n for n in nodes if n.op == "placeholder"] + [n for n in nodes if n.name in recomputed] + [
        n for n in nodes if n.op != "placeholder" and n.name not in recomputed]
    for n in order:
        env[n] = graph.node_copy(n, env.__getitem__)
    return torch.fx.GraphModule(bw, graph)


def test_schedule_recomputes_each_block_just_before_its_gradients():
    """From the recompute-first order, schedule_pass brings each recomputed value next to its
    first use and the simulated backward peak falls (Note [Just-in-time recompute])."""
    spec = Spec(depth=6, width=32)
    model, x = make(spec), inputs(spec, 4, 32)
    cap = Recorder("blocks:every=1,skip_first=0")
    train_step(model, x, cap.backend)
    bw = cap.graphs[0][1]
    recomputed = set(cap.backend.plans[0].recomputed)
    assert len(recomputed) > 20
    naive = _recompute_first(bw, recomputed)
    scheduled = schedule_pass(naive, recomputed=recomputed)

    def peak(gm):
        live = {n: 0 for n in gm.graph.nodes if n.op == "placeholder"}
        return _walk(gm.graph, live=dict(live), key_of={}, pinned=set())

    assert first_use_distance(scheduled, recomputed=recomputed) < first_use_distance(naive, recomputed=recomputed) // 4
    assert peak(scheduled) < 0.5 * peak(naive)
    assert [n.name for n in scheduled.graph.nodes if n.name not in recomputed] == [
        n.name for n in naive.graph.nodes if n.name not in recomputed]


@pytest.mark.parametrize("policy", ["none", "blocks", "blocks:every=1,skip_first=0", "segments:2"])
def test_predicted_peak_is_close_to_the_measured_one(policy):
    """The memory pass's prediction is within 15% of the profiler's measured peak."""
    from ckpt_fx.models import build

    torch.manual_seed(0)
    model = build("gpt", layers=4, dim=64, heads=2, dropout=0.1).train()
    ids = torch.randint(0, 1000, (4, 64))
    b = ckpt_fx.backend(policy=policy, strict=True)
    fn = torch.compile(model, backend=b)

    def step():
        torch.manual_seed(0)
        fn(ids, ids).backward()

    step()
    for p in model.parameters():
        p.grad = None
    measured = ckpt_fx.peak_bytes(step)
    predicted = ckpt_fx.step_peak_bytes(b.plans)
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)


def test_memory_falls_as_policies_checkpoint_more(device):
    """Measured peak: none > blocks:4 > blocks > blocks(skip_first=0)."""
    from ckpt_fx.models import build

    torch.manual_seed(0)
    model = build("llama", layers=8, dim=64, heads=2).to(device).train()
    ids = torch.randint(0, 1000, (4, 128), device=device)
    peaks = {}
    for policy in ("none", "blocks:4", "blocks", "blocks:every=1,skip_first=0"):
        m = copy.deepcopy(model)
        fn = torch.compile(m, backend=ckpt_fx.backend(policy=policy, strict=True))
        fn(ids, ids).backward()
        for p in m.parameters():
            p.grad = None
        peaks[policy] = ckpt_fx.peak_bytes(lambda: fn(ids, ids).backward(), device=device)
        torch._dynamo.reset()
    values = list(peaks.values())
    assert all(a > b for a, b in zip(values, values[1:])), peaks
    assert peaks["blocks:every=1,skip_first=0"] < 0.5 * peaks["none"], peaks


@pytest.mark.parametrize("model_name", ["gpt", "llama"])
def test_joint_liveness_predicts_the_partitioned_peak(model_name):
    """The budget policy compares candidates by a walk over the joint graph (Note [Peak from the
    joint graph]); it must predict what the memory pass predicts on the partitioned graphs, for
    every kind of plan (segments rebuild several blocks at once; SDPA recompute goes through
    torch's RNG functionalization)."""
    from ckpt_fx.models import build
    from passes.memory import JointLiveness
    from passes.select import RECOMPUTE

    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 64))
    for policy in ["none", "blocks", "blocks:every=1,skip_first=0", "selective", "sqrt", "segments:3", "budget:0.3"]:
        torch._dynamo.reset()
        model = build(model_name, layers=4, dim=64, heads=2)
        recorder = Recorder(policy)
        torch.compile(model, backend=recorder.backend)(ids, ids).backward()
        assert len(recorder.graphs) == len(recorder.backend.plans) >= 1
        for (joint, _), kwargs, plan in zip(recorder.graphs, recorder.kwargs, recorder.backend.plans):
            liveness = JointLiveness(joint, num_fwd_outputs=kwargs["num_fwd_outputs"],
                                     static_input_indices=kwargs.get("static_lifetime_input_indices"))
            recomputed = {n.name for n in forward_nodes(joint.graph) if n.meta.get("recompute") in RECOMPUTE}
            estimate = liveness.estimate(recomputed)
            assert (estimate.peak_bytes, estimate.gradient_bytes) == (plan.peak_bytes, plan.gradient_bytes), policy


def _traced(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn)(*args)
    return {n.target: n for n in gm.graph.nodes if n.op == "call_function"}


def test_a_fusible_op_feeding_only_fusible_ops_is_not_stored_under_inductor():
    """Note [Predicting a fused graph]: mul feeds add (fused away); add feeds mm (stored); mm is
    not fusible (stored)."""
    from passes.memory import fused_away

    nodes = _traced(lambda x, w: torch.mm((x * 2) + 1, w), torch.randn(4, 4), torch.randn(4, 4))
    aten = torch.ops.aten
    assert fused_away(nodes[aten.mul.Tensor])
    assert not fused_away(nodes[aten.add.Tensor])
    assert not fused_away(nodes[aten.mm.default])


def test_a_schedules_peak_counts_its_storages_and_its_entry_until_freed():
    """Note [Inductor's own schedule], on a hand-made schedule of four steps: an incoming value
    (100 bytes) whose storage a kernel writes into at step 1, so it lives through step 3; buf0
    (40) from step 0 to 2; buf2 (10) returned (never freed). Live bytes: 140 at step 0, 140 at 1,
    150 at 2, 110 at 3."""
    from passes.memory import _schedule_peak

    schedule = (4, [(0, 2, 40), (2, None, 10)], {"saved_1": 3})
    assert _schedule_peak(schedule, entry={"key": 100}, freed={"key": 3}) == 150
    # Without the in-place write the value is freed after step 1 and buf1 needs storage of its own.
    plain = (4, [(0, 2, 40), (1, 3, 100), (2, None, 10)], {"saved_1": 1})
    assert _schedule_peak(plain, entry={"key": 100}, freed={"key": 1}) == 240
    # A value nobody frees (held by the caller) stays on top of the rest; one not named goes at once.
    assert _schedule_peak(plain, entry={"key": 100}, freed={"key": None}) == 250
    assert _schedule_peak(plain, entry={"key": 100}, freed={}) == 150


def test_fused_costs_price_a_pointwise_recompute_as_its_reads_and_a_matmul_as_before():
    """Under Inductor a recomputed pointwise op costs its extra reads (no launch, no write); a
    matmul costs its roofline time either way."""
    from passes.budget import roofline_cost

    nodes = _traced(lambda x, w: torch.mm(torch.relu(x), w), torch.randn(64, 64), torch.randn(64, 64))
    relu, mm = nodes[torch.ops.aten.relu.default], nodes[torch.ops.aten.mm.default]
    assert 0 < roofline_cost(relu, "cpu", fused=True) < roofline_cost(relu, "cpu") / 2
    assert roofline_cost(mm, "cpu", fused=True) == roofline_cost(mm, "cpu")


def _dotted(node) -> str | None:
    import ast

    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def test_private_torch_modules_only_through_compat():
    """README: every private torch module the code imports is reached through passes/_compat.py
    (aten ops under torch.ops are named where they are matched); and the floors import one way:
    passes/ never imports ckpt_fx."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    private = lambda name: any(p.startswith("_") and not p.startswith("__") for p in name.split(".")[1:])  # noqa: E731
    found, upward = [], []
    for path in sorted([*root.glob("ckpt_fx/*.py"), *root.glob("passes/*.py"), *root.glob("examples/*.py")]):
        if path.name == "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Attribute) and (name := _dotted(node)) and not name.startswith("torch.ops."):
                names = [name]
            found += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names if n.startswith("torch.") and private(n)]
            upward += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names
                       if path.parent.name == "passes" and n.split(".")[0] == "ckpt_fx"]
    assert not found, found
    assert not upward, upward
