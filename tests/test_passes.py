"""select, schedule and memory passes: hard rules, just-in-time order, predicted vs measured peak."""

from __future__ import annotations

import copy
import operator

import pytest
import torch

import ckpt_fx
from ckpt_fx import CheckpointPolicy
from passes._compat import RECOMPUTE_KEY, has_inductor_partitioner_hook
from passes.memory import _walk
from passes.regions import forward_nodes
from passes.schedule import schedule_pass
from passes.select import BY_POLICY, REASON_KEY, HardRule, Reason
from passes.targets import INDUCTOR
from tests._models import Recorder, Spec, bitwise_equal, inputs, make, train_step


def first_use_distance(bw: torch.fx.GraphModule, *, recomputed: set[str]) -> int:
    """Largest gap, in nodes, between a recomputed node and its first user."""
    nodes = list(bw.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    gap = 0
    for node in nodes:
        if node.name in recomputed and node.users:
            gap = max(gap, min(index[u] for u in node.users) - index[node])
    return gap


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
    assert Reason(HardRule.RANDOM, tuple_element=True) in reasons  # native_dropout's mask
    assert Reason(HardRule.MUTATION_SOURCE, tuple_element=True) in reasons  # BatchNorm's new running stats, copied into the buffers
    assert all(n.meta.get(REASON_KEY) != BY_POLICY or n.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
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
    from ckpt_fx.bench.models import build

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
    """Measured peak: none > blocks:4 > blocks:every=1,skip_first=1 > blocks (the default: no block
    of a stack of alike blocks skipped), and blocks keeps what skip_first=0 keeps."""
    from ckpt_fx.bench.models import build

    torch.manual_seed(0)
    model = build("llama", layers=8, dim=64, heads=2).to(device).train()
    ids = torch.randint(0, 1000, (4, 128), device=device)
    peaks = {}
    for policy in ("none", "blocks:4", "blocks:every=1,skip_first=1", "blocks", "blocks:every=1,skip_first=0"):
        m = copy.deepcopy(model)
        fn = torch.compile(m, backend=ckpt_fx.backend(policy=policy, strict=True))
        fn(ids, ids).backward()
        for p in m.parameters():
            p.grad = None
        peaks[policy] = ckpt_fx.peak_bytes(lambda: fn(ids, ids).backward(), device=device)
        torch._dynamo.reset()
    values = list(peaks.values())[:4]
    assert all(a > b for a, b in zip(values, values[1:])), peaks
    assert peaks["blocks"] == peaks["blocks:every=1,skip_first=0"] < 0.5 * peaks["none"], peaks


@pytest.mark.parametrize("model_name", [pytest.param("gpt", marks=pytest.mark.slow), "llama"])
def test_joint_liveness_predicts_the_partitioned_peak(model_name):
    """The budget policy compares candidates by a walk over the joint graph (Note [Peak from the
    joint graph]); it must predict what the memory pass predicts on the partitioned graphs, for
    every kind of plan (segments rebuild several blocks at once; SDPA recompute goes through
    torch's RNG functionalization; offloaded values leave the device and come back)."""
    from ckpt_fx.bench.models import build
    from passes.memory import JointLiveness
    from passes.select import RECOMPUTE

    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 64))
    for policy in ["none", "blocks", "blocks:every=1,skip_first=0", "selective", "sqrt", "segments:3", "budget:0.3",
                   "offload", "budget:0.1,offload,bandwidth=1000"]:
        torch._dynamo.reset()
        model = build(model_name, layers=4, dim=64, heads=2)
        recorder = Recorder(policy)
        torch.compile(model, backend=recorder.backend)(ids, ids).backward()
        assert len(recorder.graphs) == len(recorder.backend.plans) >= 1
        for (joint, _), kwargs, plan in zip(recorder.graphs, recorder.kwargs, recorder.backend.plans):
            liveness = JointLiveness(joint, num_fwd_outputs=kwargs["num_fwd_outputs"],
                                     static_input_indices=kwargs.get("static_lifetime_input_indices"))
            recomputed = {n.name for n in forward_nodes(joint.graph) if n.meta.get("recompute") in RECOMPUTE}
            estimate = liveness.estimate(recomputed, frozenset(plan.offloaded))
            assert (estimate.peak_bytes, estimate.gradient_bytes) == (plan.peak_bytes, plan.gradient_bytes), policy
            assert bool(plan.offloaded) == ("offload" in policy), policy


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
    from passes.inductor_memory import Schedule
    from passes.inductor_memory import schedule_peak as _schedule_peak

    schedule = Schedule(4, [(0, 2, 40), (2, None, 10)], {"saved_1": 3}, [], [])
    assert _schedule_peak(schedule, entry={"key": 100}, freed={"key": 3}) == 150
    # Without the in-place write the value is freed after step 1 and buf1 needs storage of its own.
    plain = Schedule(4, [(0, 2, 40), (1, 3, 100), (2, None, 10)], {"saved_1": 1}, [], [])
    assert _schedule_peak(plain, entry={"key": 100}, freed={"key": 1}) == 240
    # A value nobody frees (held by the caller) stays on top of the rest; one not named goes at once.
    assert _schedule_peak(plain, entry={"key": 100}, freed={"key": None}) == 250
    assert _schedule_peak(plain, entry={"key": 100}, freed={}) == 150


def test_fused_costs_price_a_pointwise_recompute_as_its_reads_and_a_matmul_as_before():
    """Under Inductor a recomputed pointwise op costs its extra reads (no launch, no write); a
    matmul costs its roofline time either way."""
    from passes.costs import roofline_cost

    nodes = _traced(lambda x, w: torch.mm(torch.relu(x), w), torch.randn(64, 64), torch.randn(64, 64))
    relu, mm = nodes[torch.ops.aten.relu.default], nodes[torch.ops.aten.mm.default]
    assert 0 < roofline_cost(relu, "cpu", fused=True) < roofline_cost(relu, "cpu") / 2
    assert roofline_cost(mm, "cpu", fused=True) == roofline_cost(mm, "cpu")


def _graph(build) -> torch.fx.GraphModule:
    """A hand-built graph: `build(graph, value)` adds nodes; `value(node, *shape)` gives a node a
    float32 meta tensor of that shape (its meta "val") and returns it."""
    graph = torch.fx.Graph()

    def value(node, *shape):
        node.meta["val"] = torch.empty(shape, device="meta")
        return node

    build(graph, value)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_memory_pass_counts_a_saved_view_once_and_walks_both_graphs():
    """memory_pass on hand-built graphs (4x4 float32 = 64 bytes): a saved value and a saved view
    of it are one storage (64 saved bytes, the view says whose); the forward peaks at its two
    values; the backward holds the saved value, the forward's output and the incoming gradient,
    then allocates two gradients."""
    from passes.memory import memory_pass

    aten = torch.ops.aten

    def forward(g, value):
        x = value(g.placeholder("primals_1"), 4, 4)
        a = value(g.create_node("call_function", aten.relu.default, (x,), name="relu"), 4, 4)
        v = value(g.create_node("call_function", aten.view.default, (a, [4, 4]), name="view"), 4, 4)
        b = value(g.create_node("call_function", aten.mul.Tensor, (a, a), name="mul"), 4, 4)
        g.output((b, a, v))

    def backward(g, value):
        a = value(g.placeholder("relu"), 4, 4)
        v = value(g.placeholder("view"), 4, 4)
        t = value(g.placeholder("tangents_1"), 4, 4)
        c = value(g.create_node("call_function", aten.mul.Tensor, (t, a), name="grad_mul"), 4, 4)
        d = value(g.create_node("call_function", aten.add.Tensor, (c, v), name="grad_add"), 4, 4)
        g.output((d,))

    fw, bw = _graph(forward), _graph(backward)
    predicted = memory_pass(fw, bw, num_fwd_outputs=1, forward_names={"relu", "view", "mul"})
    assert predicted.saved_bytes == 64
    assert [(s.name, s.nbytes, s.view_of) for s in predicted.saved] == [("relu", 64, None), ("view", 64, "relu")]
    assert predicted.forward_peak_bytes == 128  # relu and mul
    assert predicted.forward_end_bytes == 128  # mul returned, relu saved
    assert predicted.backward_peak_bytes == 256  # relu, mul (held by the caller), the gradient, then two more
    assert predicted.gradient_bytes == 64
    assert predicted.recomputed == ()


def test_select_pass_saves_a_random_op_and_its_tuple_elements_whatever_the_policy():
    """select_pass on a hand-built graph: a policy that recomputes everything gets native_dropout
    (random) and both its getitems saved, each with the rule that forced it; the relu after it is
    the policy's to recompute."""
    from passes.select import select_pass

    aten = torch.ops.aten

    def build(g, value):
        x = g.placeholder("primals_1")
        drop = g.create_node("call_function", aten.native_dropout.default, (x, 0.5, True), name="native_dropout")
        out = g.call_function(operator.getitem, (drop, 0))
        mask = g.call_function(operator.getitem, (drop, 1))
        relu = g.create_node("call_function", aten.relu.default, (out,), name="relu")
        g.output((relu, mask))

    gm = _graph(build)
    forced = select_pass(gm, policy=lambda info: CheckpointPolicy.MUST_RECOMPUTE)
    decided = {n.name: (n.meta[RECOMPUTE_KEY], n.meta[REASON_KEY]) for n in gm.graph.nodes if RECOMPUTE_KEY in n.meta}
    assert decided == {
        "native_dropout": (CheckpointPolicy.MUST_SAVE, Reason(HardRule.RANDOM)),
        "getitem": (CheckpointPolicy.MUST_SAVE, Reason(HardRule.RANDOM, tuple_element=True)),
        "getitem_1": (CheckpointPolicy.MUST_SAVE, Reason(HardRule.RANDOM, tuple_element=True)),
        "relu": (CheckpointPolicy.MUST_RECOMPUTE, BY_POLICY),
    }
    assert set(forced) == {"native_dropout", "getitem", "getitem_1"}
    assert str(forced["getitem"]) == "random (tuple element)"


def test_select_pass_marks_what_a_policy_of_whole_units_recomputes():
    """Note [A backward's blocks kept apart]: blocks, offload, segments and sqrt recompute whole
    units, and select_pass marks what they recompute (the backward is lowered with no horizontal
    fusion of it); a budget, selective, none or a user's callable mark nothing."""
    from passes.policy import NamedPolicy
    from passes.regions import WHOLE_UNIT_KEY
    from passes.select import select_pass

    whole = [ckpt_fx.policies.parse(p) for p in ("blocks", "blocks:2", "offload", "segments:2", "sqrt")]
    partial = [ckpt_fx.policies.parse(p) for p in ("selective", "none", "budget:0.5")]
    assert [getattr(p, "whole_units", False) for p in whole + partial] == [True] * 5 + [False] * 3
    aten = torch.ops.aten

    def build(g, value):
        x = g.placeholder("primals_1")
        drop = g.create_node("call_function", aten.native_dropout.default, (x, 0.5, True), name="native_dropout")
        out = g.call_function(operator.getitem, (drop, 0))
        relu = g.create_node("call_function", aten.relu.default, (out,), name="relu")
        g.output((relu,))

    recompute = lambda info: CheckpointPolicy.MUST_RECOMPUTE  # noqa: E731
    for policy, marked in ((NamedPolicy(decide=recompute, spec="w", whole_units=True), {"relu"}), (recompute, set())):
        gm = _graph(build)
        select_pass(gm, policy=policy)
        assert {n.name for n in gm.graph.nodes if n.meta.get(WHOLE_UNIT_KEY)} == marked


def test_joint_liveness_frees_a_recomputed_value_in_the_forward_and_rebuilds_it_when_needed():
    """JointLiveness on a hand-built joint graph (4x4 float32 = 64 bytes): saved, `a` lives from
    the forward into the backward (forward peak a+b+c = 192 bytes); recomputed, it dies after its
    last forward use (forward peak 128) and is rebuilt just before the backward reads it (peak
    136: the output, the gradient, a, and a's gradient)."""
    from passes.memory import JointLiveness

    aten = torch.ops.aten

    def build(g, value):
        x = value(g.placeholder("primals_1"), 4, 4)
        t = value(g.placeholder("tangents_1"))
        a = value(g.create_node("call_function", aten.relu.default, (x,), name="relu"), 4, 4)
        b = value(g.create_node("call_function", aten.mul.Tensor, (a, a), name="mul"), 4, 4)
        c = value(g.create_node("call_function", aten.mul.Tensor, (b, b), name="mul"), 4, 4)
        d = value(g.create_node("call_function", aten.sum.default, (c,), name="sum"))
        for node in (a, b, c, d):
            node.meta["partitioner_tag"] = "is_forward"
        grad = value(g.create_node("call_function", aten.mul.Tensor, (a, t), name="mul"), 4, 4)
        g.output((d, grad))

    liveness = JointLiveness(_graph(build), num_fwd_outputs=1)
    saved, recomputed = liveness.estimate(set()), liveness.estimate({"relu"})
    assert (saved.peak_bytes, saved.gradient_bytes) == (192, 64)
    assert (recomputed.peak_bytes, recomputed.gradient_bytes) == (136, 64)


def test_a_plan_at_other_sizes_keeps_what_planning_decided():
    """Plan.at predicts the memory again at other symbolic sizes and keeps everything else the
    plan recorded: under min-cut, whether it merged the joint graph (joint_cse), its units, its
    policy."""
    import passes.pipeline
    from passes.graphs import copy_graph_module

    spec = Spec(depth=2, width=8)
    joints = []
    backend = ckpt_fx.backend(policy="none", compiler="eager", strict=True)
    backend.on_joint.append(lambda joint, joint_inputs, kw: joints.append((copy_graph_module(joint), joint_inputs, kw)))
    x = inputs(spec, 2, 6)
    torch._dynamo.mark_dynamic(x, 1)
    train_step(make(spec), x, backend)
    joint, joint_inputs, kw = joints[0]
    _, _, plan = passes.pipeline.run(
        joint, joint_inputs, policy=ckpt_fx.policies.parse("blocks:every=1,skip_first=0"), policy_name="blocks",
        num_fwd_outputs=kw["num_fwd_outputs"], static_lifetime_input_indices=kw.get("static_lifetime_input_indices"),
        target=INDUCTOR)
    assert plan.joint_cse is not None and plan.symbols and plan.recomputed
    symbol, hint = next(iter(plan.symbols.items()))
    longer = plan.at(**{symbol: 4 * hint})
    assert longer.peak_bytes > plan.peak_bytes
    assert (longer.joint_cse, longer.units, longer.policy, longer.recomputed) == (plan.joint_cse, plan.units, plan.policy, plan.recomputed)


def test_alike_blocks_share_a_schedule_whatever_seed_their_dropout_reads():
    """Note [A schedule per block]: two blocks whose dropout reads another of the step's seeds
    (an index into one tensor) are lowered once; a block of another shape is not."""
    import torch._inductor.lowering  # noqa: F401 - registers Inductor's random prims
    from passes.inductor_memory import _segment_key

    def block(index: int, rows: int):
        nodes = {}

        def build(graph, value):
            seeds = graph.placeholder("seeds")
            seeds.meta["val"] = torch.empty(2, dtype=torch.int64, device="meta")
            x = value(graph.placeholder("x"), rows, 8)
            seed = graph.call_function(torch.ops.prims.inductor_lookup_seed.default, (seeds, index))
            seed.meta["val"] = torch.empty((), dtype=torch.int64, device="meta")
            mask = value(graph.call_function(torch.ops.prims.inductor_random.default, ([rows, 8], seed, "rand")), rows, 8)
            out = value(graph.call_function(torch.ops.aten.mul.Tensor, (x, mask)), rows, 8)
            graph.output(out)
            nodes.update(inputs=[seeds, x], members=[seed, mask, out], outs=[out])

        _graph(build)
        return _segment_key(nodes["members"], nodes["inputs"], nodes["outs"], is_backward=False, donated=())

    assert block(0, 4) == block(1, 4)
    assert block(0, 4) != block(0, 6)


@pytest.mark.skipif(not has_inductor_partitioner_hook(), reason="no custom_partitioner_fn in this torch")
def test_a_kernel_computed_into_a_slice_of_a_cat_is_one_storage_with_the_cat(fresh_inductor_cache):
    """Note [Inductor's own schedule]: a cat whose inputs other ops read too has them computed
    straight into its slices (NonOwningLayout); they hold no storage of their own. Counting them
    apart predicted 20.0 MB against 12.0 measured here (an MoE's gate and up halves: +12%)."""

    class Gated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(256, 256)

        def forward(self, x):
            h = self.lin(x)
            a, b = h.sigmoid() * h, h.exp() * h
            return (torch.cat([a, b], dim=-1).sum(-1) + a.mean(-1) * b.mean(-1)).sum()

    torch.manual_seed(0)
    x = torch.randn(4096, 256, requires_grad=True)
    backend = ckpt_fx.backend(policy="none", compiler="inductor", strict=True)
    fn = torch.compile(Gated(), backend=backend)
    fn(x).backward()
    measured = ckpt_fx.peak_bytes(lambda: fn(x).backward())
    predicted = ckpt_fx.step_peak_bytes(backend.plans)
    assert backend.plans[0].peak_model.name == "INDUCTOR"
    assert abs(predicted / measured - 1) < 0.02, (predicted, measured)


def test_a_joint_graph_min_cut_merged_is_partitioned_alike_without_merging_again(monkeypatch):
    """A budget plans Inductor's own partition first, which lets min-cut merge the joint graph's
    identical nodes (its CSE), then torch's plan at the same budget: that second partition skips
    the CSE, which finds nothing more to merge, and gives the same forward and backward as one
    that merges again."""
    import torch._functorch.partitioners as partitioners

    from ckpt_fx.bench.models import build
    from passes._compat import activation_memory_budget
    from passes.graphs import copy_graph_module
    from passes.partition import MERGED_KEY, partition_pass

    joints = []
    backend = ckpt_fx.backend(policy="none", compiler="eager", strict=True)
    backend.on_joint.append(lambda joint, joint_inputs, kw: joints.append((copy_graph_module(joint), joint_inputs, kw)))
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 32))
    torch.compile(build("gpt", layers=2, dim=64, heads=2), backend=backend)(ids, ids).backward()
    joint, joint_inputs, kw = joints[0]
    merges = []
    real = partitioners.fx_graph_cse
    monkeypatch.setattr(partitioners, "fx_graph_cse", lambda graph, **kw: merges.append(1) or real(graph, **kw))

    def torch_plan_after_inductors_own(merge_again: bool) -> tuple[str, str, int]:
        gm = copy_graph_module(joint)
        partition = lambda: partition_pass(gm, joint_inputs, num_fwd_outputs=kw["num_fwd_outputs"], target=INDUCTOR)  # noqa: E731
        assert len(real(gm.graph).nodes) < len(gm.graph.nodes)  # the CSE has nodes to merge here
        partition()
        assert gm.meta[MERGED_KEY]
        if merge_again:
            del gm.meta[MERGED_KEY]
        merges.clear()
        with activation_memory_budget(0.3):
            fw, bw = partition()
        return fw.code, bw.code, len(merges)

    skipped, merged = torch_plan_after_inductors_own(False), torch_plan_after_inductors_own(True)
    assert (skipped[2], merged[2]) == (0, 1)
    assert skipped[:2] == merged[:2]


def test_planning_holds_full_collections_and_gives_the_thresholds_back():
    """Note [Collections while planning]: inside, the oldest generation waits; after, even after an
    error, the collector's thresholds are the process's own; with the collector off, nothing changes."""
    import gc

    from passes.steps import FULL_COLLECTIONS_HELD, without_full_collections

    before = gc.get_threshold()
    with pytest.raises(ValueError, match="planning failed"), without_full_collections():
        assert gc.get_threshold() == (*before[:2], FULL_COLLECTIONS_HELD)
        raise ValueError("planning failed")
    assert gc.get_threshold() == before
    gc.disable()
    try:
        with without_full_collections():
            assert gc.get_threshold() == before
    finally:
        gc.enable()


def _page_faults(fn) -> int:
    """The minor page faults the process takes while fn() runs."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_loop_on_a_fresh_stack_chunk_crosses_no_chunk_edge():
    """Note [Compiling on a fresh stack chunk]: called from some depth, a loop's calls cross an
    edge of the interpreter's frame stack, each call mapping a chunk and faulting on it; run
    through on_a_fresh_stack, the same loop takes almost no page faults from any depth. Its result
    and its errors come through unchanged."""
    pytest.importorskip("resource")
    from passes.steps import on_a_fresh_stack

    calls = 5_000

    def leaf(i: int) -> int:
        return i & 1

    def loop() -> int:
        return sum(leaf(i) for i in range(calls))

    def at(depth: int, fn):
        return fn() if depth == 0 else at(depth - 1, fn)

    depths = range(400)  # the edges of three chunks or more
    plain = [_page_faults(lambda: at(d, loop)) for d in depths]
    if max(plain) < calls // 2:
        pytest.skip("no depth here at which each call maps a chunk (CPython 3.13+ caches one; before 3.11 no chunks)")
    fresh = [_page_faults(lambda: at(d, lambda: on_a_fresh_stack(loop))) for d in depths]
    assert max(fresh) < calls // 50, [(d, f) for d, f in zip(depths, fresh) if f >= calls // 50][:5]
    assert at(plain.index(max(plain)), lambda: on_a_fresh_stack(loop)) == calls // 2
    with pytest.raises(ValueError, match="compile failed"):
        on_a_fresh_stack(lambda: (_ for _ in ()).throw(ValueError("compile failed")))
