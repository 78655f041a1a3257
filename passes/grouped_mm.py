"""grouped_mm: a grouped matmul's backward that computes only the gradient somebody reads.

Note [A grouped matmul's unread weight gradient]
transformers' mixture-of-experts layers run their experts as grouped matmuls. Under torch.compile
with weights that are not bfloat16 (and on torches without a grouped-matmul kernel) it calls its
own custom op, transformers::grouped_mm_fallback, whose backward is one opaque op,
grouped_mm_fallback_backward(input, weight, offs, grad_output) -> (grad_input, grad_weight): it
always computes the weight's gradient, so the backward always reads the forward's input. When the
experts are frozen (LoRA, adapters) nobody reads that gradient, and yet the input (the routed
tokens, the gated activations) is saved or recomputed for it: eager autograd, which runs torch's
own grouped matmul there, keeps neither (the README's table beside HF's checkpointing gives what
a Mixtral LoRA block kept). The input's gradient alone is the forward op again, on the gradient and
the transposed weight: grouped_mm_fallback(grad_output, weight.transpose(1, 2), offs) runs, per
expert, the same torch.mm on the same views into a zero-filled buffer of the same size and dtype,
so it is bitwise what the backward op returns as grad_input. grouped_mm_pass puts it in the
backward op's place where the weight's gradient is unread; the input is then no longer needed by
the backward, and the partition drops it.
"""

from __future__ import annotations

import operator

import torch

_BACKWARD = "transformers.grouped_mm_fallback_backward.default"


def grouped_mm_pass(gm: torch.fx.GraphModule) -> int:
    """Replace each transformers grouped_mm_fallback_backward whose weight gradient is unread by
    the forward op computing the input's gradient alone (Note [A grouped matmul's unread weight
    gradient]).

    Mutates the graph in place (per rewrite: adds the weight transposed (a permute) and the
    grouped matmul, with the backward op's meta, before it; removes the backward op and its
    getitem; other nodes keep their names); deterministic. Returns the number rewritten.
    """
    forward = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if forward is None:  # transformers' ops are not registered: nothing of theirs in the graph
        return 0
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or str(node.target) != _BACKWARD or len(node.args) != 4 or node.kwargs:
            continue
        reads = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if len(reads) != len(node.users) or 1 in reads or 0 not in reads:
            continue  # the weight's gradient is read, or the tuple is used whole
        grad_input = reads[0]
        _, weight, offs, grad_output = node.args
        weight_value, grad_value = weight.meta.get("val"), grad_input.meta.get("val")
        if not isinstance(weight_value, torch.Tensor) or not isinstance(grad_value, torch.Tensor):
            continue
        with graph.inserting_before(node):
            # A permute, not a transpose: the joint graph holds decomposed ops, as Inductor lowers them.
            transposed = graph.call_function(torch.ops.aten.permute.default, (weight, [0, 2, 1]))
            product = graph.call_function(forward.default, (grad_output, transposed, offs))
        for new in (transposed, product):
            new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "eager_input_vals")})
        transposed.meta["val"] = weight_value.permute(0, 2, 1)
        product.meta["val"] = grad_value
        traced = node.meta.get("eager_input_vals")  # the values Inductor lays a custom op's inputs out by
        if isinstance(traced, tuple) and len(traced) == 2 and len(traced[0]) == 4 and not traced[1]:
            _, weight_in, offs_in, grad_in = traced[0]
            product.meta["eager_input_vals"] = ((grad_in, weight_in.permute(0, 2, 1), offs_in), {})
        grad_input.replace_all_uses_with(product)
        graph.erase_node(grad_input)
        graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count
