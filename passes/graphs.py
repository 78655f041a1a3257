"""graphs: helpers on FX graph modules that several passes share."""

from __future__ import annotations

import copy
import types

import torch

from passes._compat import is_primal, is_tangent


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a graph module's graph (node names kept, each node's meta copied one level deep),
    to plan again after passes have changed the original."""
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output).meta = copy.copy(gm.graph.output_node().meta)
    return torch.fx.GraphModule(gm, graph)


def snapshot(gm: torch.fx.GraphModule) -> types.SimpleNamespace:
    """A copy of a graph's nodes (names and meta kept) that later passes of torch cannot change,
    for a prediction to walk again (Plan.at)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return types.SimpleNamespace(graph=graph)


def forward_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Nodes placed before the backward of a joint graph, tangents excluded (placement, not dataflow).

    A graph without tangents (a plain forward graph) returns all its nodes but the output.
    """
    nodes = list(graph.nodes)
    last = None
    for node in nodes:
        if node.meta.get("partitioner_tag") == "is_forward" or is_primal(node):
            last = node
    has_tangents = any(is_tangent(n) for n in nodes)
    out = []
    for node in nodes:
        if node.op == "output":
            break
        if not is_tangent(node):
            out.append(node)
        if has_tangents and node is last:
            break
    return out
