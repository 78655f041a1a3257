"""dropout: let a dropout's output be recomputed from its saved mask instead of being saved.

Note [Dropout under checkpointing]
Random ops are never recomputed (their masks must equal the forward's), so select_pass saves
every element of native_dropout's result. Its mask is one byte an element; its output is a full
activation (an attention-probability tensor per block). The output is x * mask * scale, a
deterministic function of the input and the mask; rewriting its users to read that product lets a
checkpointed block save the mask alone and rebuild the output in the backward. On CPU and CUDA the
product is computed as native_dropout computes it (input.mul(mask).mul_(scale)), so values are
bitwise equal; the tests check this against AOTAutograd without checkpointing.
"""

from __future__ import annotations

import operator

import torch

from passes.regions import forward_nodes


def dropout_pass(gm: torch.fx.GraphModule) -> int:
    """Rewrite readers of native_dropout's output to read input * mask * scale.

    Mutates the graph in place (adds two nodes per dropout, keeps existing names, copies the
    original output's meta onto the new nodes); deterministic. Returns the number rewritten.
    """
    graph = gm.graph
    count = 0
    for node in forward_nodes(graph):
        if node.target is not torch.ops.aten.native_dropout.default:
            continue
        x, p = node.args[0], node.args[1]
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
        outs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if train is False or not isinstance(p, float) or not 0.0 < p < 1.0 or 0 not in outs or 1 not in outs:
            continue
        out, mask = outs[0], outs[1]
        scale = 1.0 / (1.0 - p)
        with graph.inserting_after(mask):
            masked = graph.call_function(torch.ops.aten.mul.Tensor, (x, mask))
        with graph.inserting_after(masked):
            scaled = graph.call_function(torch.ops.aten.mul.Tensor, (masked, scale))
        for new in (masked, scaled):
            new.meta.update({k: v for k, v in out.meta.items()})
        out.replace_all_uses_with(scaled)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count
