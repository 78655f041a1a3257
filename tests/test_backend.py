"""backend="ckpt": the entry point, options, logging, inference, and the fallback."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest
import torch

import ckpt_fx
from tests._models import Spec, close, inputs, make, train_step

SPEC = Spec(depth=3, width=16, dropout=0.1)


class BrokenBetweenBlocks(torch.nn.Module):
    """Four blocks with a graph break between the second and the third."""

    def __init__(self):
        super().__init__()
        self.net = make(Spec(depth=4, width=16))

    def forward(self, x):
        h = self.net.embed(x)
        for layer in self.net.layers[:2]:
            h = layer(h)
        torch._dynamo.graph_break()
        for layer in self.net.layers[2:]:
            h = layer(h)
        return self.net.head(h)


def test_entry_point_is_registered_once():
    eps = [ep for ep in entry_points(group="torch_dynamo_backends") if ep.name == "ckpt"]
    assert [ep.value for ep in eps] == ["ckpt_fx.dynamo_backend:ckpt"]


def test_backend_string_works_without_importing_ckpt_fx():
    """A fresh interpreter finds backend="ckpt" through the entry point alone."""
    code = textwrap.dedent("""
        import sys, torch
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)])
        x = torch.randn(4, 8)
        out = torch.compile(model, backend="ckpt", options={"policy": "blocks:every=1,skip_first=0"})(x)
        out.sum().backward()
        assert "ckpt_fx" in sys.modules
        print("ok", model[0][0].weight.grad.shape)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ok torch.Size([8, 8])" in done.stdout


def test_options_through_torch_compile():
    model, x = make(SPEC), inputs(SPEC, 2, 6)
    got = train_step(model, x, "ckpt")  # default options
    assert close(got, train_step(model, x))
    torch._dynamo.reset()
    fn = torch.compile(make(SPEC), backend="ckpt", options={"policy": "segments:2", "compiler": "eager", "strict": True})
    fn(x).sum().backward()


def test_bad_option_through_torch_compile_names_it():
    fn = torch.compile(make(SPEC), backend="ckpt", options={"policy": "blocks:0"})
    with pytest.raises(Exception, match="every must be >= 1, got 0"):
        fn(inputs(SPEC, 2, 6))


def test_failing_pass_falls_back_with_one_warning_and_exact_gradients():
    """A policy that breaks makes the graph compile with the default partition and one warning."""

    def broken(info):
        raise KeyError("no such thing")

    model, x = make(SPEC), inputs(SPEC, 2, 6)
    b = ckpt_fx.backend(policy=broken)
    with pytest.warns(UserWarning, match="falling back to AOTAutograd's default partition.*pass 'select' failed.*no such thing"):
        got = train_step(model, x, b)
    assert not b.plans
    assert close(got, train_step(model, x))


def test_strict_raises_naming_the_pass():
    def broken(info):
        raise KeyError("no such thing")

    with pytest.raises(Exception, match="ckpt_fx pass 'select' failed: KeyError: 'no such thing'"):
        train_step(make(SPEC), inputs(SPEC, 2, 6), ckpt_fx.backend(policy=broken, strict=True))


def test_inference_does_no_partitioning():
    b = ckpt_fx.backend()
    fn = torch.compile(make(SPEC).eval(), backend=b)
    with torch.no_grad():
        fn(inputs(SPEC, 2, 6))
    assert b.plans == []


def test_one_info_line_per_compiled_graph(caplog):
    b = ckpt_fx.backend(policy="blocks")
    with caplog.at_level(logging.INFO, logger="ckpt_fx"):
        train_step(make(SPEC), inputs(SPEC, 2, 6), b)
    lines = [r.getMessage() for r in caplog.records if r.name == "ckpt_fx" and r.levelno == logging.INFO]
    assert len(lines) == len(b.plans) == 1
    assert "blocks(every=1, skip_first=auto): saved" in lines[0] and "predicted peak" in lines[0]


def test_the_first_step_says_what_it_compiles_and_how_long_it_took(caplog):
    """Note [The first step's lines]: per training graph, a line as it starts (ops, policy, inner
    compiler) and one when done (time, planning's share, the plan); progress=False keeps them at
    debug level; an inference graph says nothing; with no logging configured they reach stderr."""
    def lines(**kwargs):
        caplog.clear()
        torch._dynamo.reset()
        b = ckpt_fx.backend(policy="blocks", compiler="eager", **kwargs)
        with caplog.at_level(logging.INFO, logger="ckpt_fx"):
            train_step(make(SPEC), inputs(SPEC, 2, 6), b)
        return [r.getMessage() for r in caplog.records if r.name == "ckpt_fx.progress" and r.levelno == logging.INFO]

    start, done = lines()
    assert "graph 1:" in start and "ops traced; planning (blocks(every=1, skip_first=auto)) and compiling with the eager" in start
    assert "graph 1 planned and its forward compiled in" in done and "(planning" in done and "3 blocks" in done
    assert lines(progress=False) == []
    with pytest.raises(ValueError, match="progress must be True or False, got 'no'"):
        ckpt_fx.backend(progress="no")
    code = textwrap.dedent("""
        import os, torch, ckpt_fx
        from tests._models import Spec, inputs, make, train_step
        spec = Spec(depth=2, width=8)
        train_step(make(spec), inputs(spec, 2, 4), ckpt_fx.backend(compiler="eager"))
        fn = torch.compile(make(spec).eval(), backend=ckpt_fx.backend(compiler="eager"))
        with torch.no_grad():
            fn(inputs(spec, 2, 4))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("ckpt_fx: graph")]
    assert len(said) == 2 and "planned and its forward compiled" in said[1], done.stderr[-2000:]


def test_step_peak_bytes_of_no_plans_is_refused():
    with pytest.raises(ValueError, match="step_peak_bytes: no plans to predict from"):
        ckpt_fx.step_peak_bytes([])


def test_graph_breaks_plan_every_graph_with_right_block_numbers():
    """A graph break in the middle of the stack: each graph is planned, block paths stay absolute."""

    model = BrokenBetweenBlocks()
    x = inputs(Spec(), 2, 6)
    b = ckpt_fx.backend(policy="blocks:every=1,skip_first=0", strict=True)
    got = train_step(model, x, b)
    assert close(got, train_step(model, x))
    paths = [[bp.path for bp in plan.blocks if bp.recomputed_ops] for plan in b.plans]
    assert paths == [["net.layers.0", "net.layers.1"], ["net.layers.2", "net.layers.3"]]


def test_skip_first_counts_blocks_of_the_model_not_of_the_graph():
    """After a graph break, the second graph's first block is block 2, and blocks(skip_first=1)
    checkpoints it."""

    b = ckpt_fx.backend(policy="blocks:every=1,skip_first=1", strict=True)
    train_step(BrokenBetweenBlocks(), inputs(Spec(), 2, 6), b)
    paths = [[bp.path for bp in plan.blocks if bp.recomputed_ops] for plan in b.plans]
    assert paths == [["net.layers.1"], ["net.layers.2", "net.layers.3"]]


def test_unknown_module_pattern_says_which_paths_exist():
    b = ckpt_fx.backend(policy=ckpt_fx.policies.only_in("model.layers.*", "blocks"))
    with pytest.warns(UserWarning, match=r"only_in pattern 'model.layers.\*' matches no module of this graph; "
                                         r"its units are layers.0, layers.1, layers.2"):
        train_step(make(SPEC), inputs(SPEC, 2, 6), b)


def test_policy_that_matches_nothing_warns_once():
    b = ckpt_fx.backend(policy="blocks:skip_first=9")
    with pytest.warns(UserWarning, match=r"policy blocks\(every=1, skip_first=9\) recomputes nothing") as record:
        train_step(make(SPEC), inputs(SPEC, 2, 6), b)
        torch._dynamo.reset()
        train_step(make(SPEC), inputs(SPEC, 2, 6), b)
    assert sum("recomputes nothing" in str(w.message) for w in record) == 1


def test_observers_see_each_graph_before_the_passes_and_after_its_plan():
    """CkptBackend.on_joint sees a joint graph as AOTAutograd hands it over (no decision in its
    meta yet); on_partitioned the same graph with its decisions, the graphs returned and the plan."""
    from passes.select import REASON_KEY

    b = ckpt_fx.backend(policy="blocks", compiler="eager", strict=True)
    before, after = [], []
    b.on_joint.append(lambda joint, joint_inputs, kw: before.append(
        (joint, any(REASON_KEY in n.meta for n in joint.graph.nodes), kw["num_fwd_outputs"])))
    b.on_partitioned.append(after.append)
    train_step(make(SPEC), inputs(SPEC, 2, 4), b)
    assert len(before) == len(after) == len(b.plans) == 1
    joint, decided, outputs = before[0]
    assert not decided and outputs >= 1
    done = after[0]
    assert done.joint is joint and done.plan is b.plans[0] and done.kwargs["num_fwd_outputs"] == outputs
    assert any(REASON_KEY in n.meta for n in joint.graph.nodes)
    assert {n.name for n in done.backward.graph.nodes} >= set(done.plan.recomputed) and done.plan.recomputed


def test_the_fallback_is_what_the_inner_compiler_does_without_us():
    """A graph the passes fail on is partitioned as the inner compiler would have partitioned it
    alone, from the joint graph as AOTAutograd handed it over: under Inductor, min-cut's own plan
    (not the default partition, and not of a graph our passes already rewrote: BatchNorm's twin
    would make its forward normalise twice)."""
    from passes._compat import min_cut_partition
    from passes.graphs import copy_graph_module

    spec = Spec(depth=2, width=8, batchnorm=True)
    joints = []
    recorder = ckpt_fx.backend(policy="none", compiler="eager", strict=True)
    recorder.on_joint.append(lambda joint, joint_inputs, kw: joints.append((copy_graph_module(joint), joint_inputs, kw)))
    train_step(make(spec), inputs(spec, 2, 4), recorder)
    joint, joint_inputs, kwargs = joints[0]

    def broken(info):
        raise RuntimeError("a policy that cannot decide")

    inductor = ckpt_fx.CkptBackend(ckpt_fx.Options(policy=broken, compiler="inductor"))
    with pytest.warns(UserWarning, match=r"falling back to Inductor's own partition .* a policy that cannot decide"):
        fw, bw = inductor.partition(copy_graph_module(joint), joint_inputs, **kwargs)
    alone_fw, alone_bw = min_cut_partition(copy_graph_module(joint), joint_inputs, **kwargs)
    twins = [n for n in fw.graph.nodes if n.target is torch.ops.aten._native_batch_norm_legit.no_stats]
    assert twins == []
    assert [n.name for n in fw.graph.output_node().all_input_nodes] == [n.name for n in alone_fw.graph.output_node().all_input_nodes]
    assert not inductor.plans
