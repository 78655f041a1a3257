"""dropout: let a dropout's output be recomputed from its saved mask instead of being saved.

Note [Dropout under checkpointing]
A random op is not recomputed unless it can be drawn again from a saved generator state (Note
[Dropout replayed] in passes/select.py), so select_pass saves every element of a native_dropout
whose mask is small or off the CPU. Its mask is one byte an element; its output is a full
activation (an attention-probability tensor per block). The output is x * mask * scale, a
deterministic function of the input and the mask; rewriting its users to read that product lets a
checkpointed block save the mask alone and rebuild the output in the backward. The product must
be bitwise what native_dropout returns, and its rounding differs by dtype: in float32 and float64,
x * (mask * scale) and (x * mask) * scale agree; in bfloat16 and float16, the CPU kernel rounds the
scaled mask to the input's dtype first (x * to(mask, dtype) * scale differs in the last bit), and
CUDA's fused kernel is not checked here. So half-precision dropouts are rewritten on CPU only, with
the CPU rounding; elsewhere they keep their output saved. Tests compare against AOTAutograd without
checkpointing, bitwise, in float32 and under bfloat16 autocast.
"""

from __future__ import annotations

import operator

import torch

from passes.graphs import forward_nodes


def dropout_pass(gm: torch.fx.GraphModule) -> int:
    """Rewrite readers of native_dropout's output to read input * (mask * scale).

    Mutates the graph in place (adds three nodes per dropout, keeps existing names, copies the
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
        value = out.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        half = value.dtype in (torch.float16, torch.bfloat16)
        if half and value.device.type != "cpu":
            continue  # Note [Dropout under checkpointing]: rounding not verified off the CPU
        scale = 1.0 / (1.0 - p)
        with graph.inserting_after(mask):
            # prims' cast, not aten._to_copy: Inductor lowers the prim and expects _to_copy decomposed.
            noise = graph.call_function(torch.ops.prims.convert_element_type.default, (mask, value.dtype))
        with graph.inserting_after(noise):
            scaled = graph.call_function(torch.ops.aten.mul.Tensor, (noise, scale))
        with graph.inserting_after(scaled):
            product = graph.call_function(torch.ops.aten.mul.Tensor, (x, scaled))
        for new in (noise, scaled, product):
            new.meta.update(out.meta)
        out.replace_all_uses_with(product)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count
