"""select pass: hard rules beat any policy, what a policy returns, what it marks."""

from __future__ import annotations

import operator

import pytest
import torch

import ckpt_fx
from ckpt_fx import CheckpointPolicy
from passes._compat import RECOMPUTE_KEY
from passes.graphs import forward_nodes
from passes.select import BY_POLICY, REASON_KEY, HardRule, Reason
from tests._models import Recorder, Spec, bitwise_equal, hand_built, inputs, make, train_step


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

    gm = hand_built(build)
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
        gm = hand_built(build)
        select_pass(gm, policy=policy)
        assert {n.name for n in gm.graph.nodes if n.meta.get(WHOLE_UNIT_KEY)} == marked
