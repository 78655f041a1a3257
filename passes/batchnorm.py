"""batchnorm: let BatchNorm's normalised output be recomputed while its running statistics move once.

Note [BatchNorm under checkpointing]
In training, a BatchNorm is one node of the joint graph, _native_batch_norm_legit_functional,
returning (out, batch mean, inverse std, new running mean, new running var); the last two are
copied into the module's buffers. select_pass never recomputes the source of such a copy (the
statistics must move exactly once), so the normalised output `out`, a full activation, was always
saved: 22.0 of 33.3 MB saved on a ResNet-50 layout. Rebuilding `out` from the saved batch mean and
inverse std with pointwise ops is not bitwise what the kernel returns (its vectorised loop rounds
differently), but _native_batch_norm_legit.no_stats (the same normalisation without running
statistics) is: the same kernel on the same input, checked in float32, float64 and bfloat16 on CPU.
So batchnorm_pass adds that op beside each training BatchNorm (its "twin") and points the readers
of `out` at the twin's output. The twin touches no buffer, so the policy may recompute it in the
backward like any other op. The forward would now normalise twice; after partitioning,
fold_twins makes the forward's reader of the twin's output read the original's instead, under
the twin's name (the memory pass matches saved values by name), and drops the twin from the
forward. In eval mode BatchNorm is _native_batch_norm_legit_no_training, which moves nothing and
needs none of this.
"""

from __future__ import annotations

import operator

import torch

from passes.graphs import forward_nodes

TWIN_KEY = "ckpt_fx.batchnorm_twin"
"""On a twin and its output: the name of the BatchNorm node it stands beside."""

_FUNCTIONAL = torch.ops.aten._native_batch_norm_legit_functional.default
_NO_STATS = torch.ops.aten._native_batch_norm_legit.no_stats


def batchnorm_pass(gm: torch.fx.GraphModule) -> int:
    """Point the readers of each training BatchNorm's output at a twin that moves no statistics.

    Mutates the graph in place (adds two nodes per BatchNorm: the twin and its output, with the
    original's meta; removes the original's unread output); deterministic. Returns the number
    rewritten.
    """
    graph = gm.graph
    count = 0
    for node in forward_nodes(graph):
        if node.target is not _FUNCTIONAL:
            continue
        x, weight, bias, _, _, training, momentum, eps = node.args
        outs = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
        value = node.meta.get("val")
        if training is not True or len(outs) != 1 or not isinstance(value, (tuple, list)):
            continue
        out = outs[0]
        with graph.inserting_after(node):
            twin = graph.call_function(_NO_STATS, (x, weight, bias, True, momentum, eps))
        with graph.inserting_after(twin):
            twin_out = graph.call_function(operator.getitem, (twin, 0))
        twin.meta.update(node.meta)
        twin.meta["val"] = tuple(value[:3])
        twin_out.meta.update(out.meta)
        twin.meta[TWIN_KEY] = twin_out.meta[TWIN_KEY] = node.name
        out.replace_all_uses_with(twin_out)
        graph.erase_node(out)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


def fold_twins(fw: torch.fx.GraphModule) -> int:
    """In a partitioned forward graph, make each twin's output read its BatchNorm's output instead
    (keeping the twin output's name) and drop the twin. Returns the number folded."""
    graph = fw.graph
    by_name = {n.name: n for n in graph.nodes}
    count = 0
    for node in list(graph.nodes):
        if node.target is not _NO_STATS or TWIN_KEY not in node.meta:
            continue
        original = by_name.get(node.meta[TWIN_KEY])
        if original is None:
            continue
        for user in list(node.users):
            if user.target is operator.getitem and user.args[1] == 0:
                user.args = (original, 0)
        if not node.users:
            graph.erase_node(node)
            count += 1
    if count:
        graph.lint()
        fw.recompile()
    return count
