"""schedule pass: each block recomputed just before its gradients need it."""

from __future__ import annotations

import torch

from passes.memory import _walk
from passes.schedule import schedule_pass
from tests._models import Recorder, Spec, inputs, make, train_step


def first_use_distance(bw: torch.fx.GraphModule, *, recomputed: set[str]) -> int:
    """Largest gap, in nodes, between a recomputed node and its first user."""
    nodes = list(bw.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    gap = 0
    for node in nodes:
        if node.name in recomputed and node.users:
            gap = max(gap, min(index[u] for u in node.users) - index[node])
    return gap


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
