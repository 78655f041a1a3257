"""head: the loss head of a language model (a projection to the vocabulary, then its cross-entropy)
found in a torch-level graph and rewritten so that no tokens x vocabulary tensor is kept or built
whole (Note [The loss head in chunks]).

`head_pass(gm)` rewrites a graph as dynamo hands it to a backend (or as torch.fx.symbolic_trace
makes it, after fake-tensor propagation: `propagate_values`), in place; node names of what it leaves are kept; deterministic.
`linear_cross_entropy` is the op a rewritten graph calls: AOTAutograd sees it as one forward node,
and its backward as a few products by the loss's incoming gradient.

Note [The loss head in chunks]
With every block checkpointed, what a language model keeps between the forward and the backward is
mostly its head: the logits (tokens x vocabulary, in the compute dtype), their fp32 copy, the
log-softmax, and in the backward the gradient of each, all whole. The rewrite replaces the
projection and its cross-entropy by one op that walks the tokens in chunks of `chunk_rows`: a
chunk's logits are formed, reduced to the chunk's loss, turned at once into the chunk's gradient
with respect to the logits (softmax minus the target's one-hot), and multiplied out into the
gradients of the hidden states, the weight and the bias; then the chunk is dropped. The gradients
are formed in the forward, for a loss whose gradient is 1, and the backward only scales them by the
incoming gradient (a scalar: the loss is a sum, or a sum divided by a count). Rebuilding each
chunk's logits in the backward instead would cost one more projection of every token, a third of
the head's work again, and save nothing: the gradients formed early are the hidden states' size
and the weight's, which the backward would allocate anyway. So the op keeps what the head's
backward needs and no more: the gradients, and neither the logits nor the hidden states. A head
is rewritten only where that, with one chunk's temporaries, is less than the whole head keeps (a
head whose tokens fit in one chunk gains nothing, and stays whole).

Exactness: a chunk's rows are computed as the whole head computes them (the same projection, the
same fp32 log-softmax when the model upcasts), so the loss per token and the hidden states'
gradient match the whole head's to rounding; the weight's gradient and the loss's sum add the
chunks' partial sums in a different order (in fp32, where the whole head adds in the compute
dtype's product). tests/test_head.py bounds both against a float64 step.

What is recognised: `F.cross_entropy(x, target, ignore_index=..., reduction="mean"|"sum")` with
no class weights and no label smoothing, where x is `F.linear(h, W, b)` through any of: an upcast
(`.float()`, `.to(dtype)`), slicing of the token dimensions (`logits[:, :-1]`), and reshapes that
keep the vocabulary last (`view(-1, V)`), with a vocabulary at least `WIDE` times the hidden size.
That covers transformers' causal-LM loss (label shift, -100 padding, `num_items_in_batch`) and a
plain cross-entropy over a model's logits, tied embeddings, frozen heads and autocast. Anything
else (label smoothing, a z-loss, logit soft-capping or scaling, a custom loss) keeps its head as
it is, and the reason is recorded (HeadReport.reasons).
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from passes._compat import size_at, size_hint

WIDE = 4
"""A projection counts as a vocabulary head when its output is at least this many times wider than
its input: a classifier over a few classes is left as it is (nothing to gain)."""
CHUNK_BYTES = 32 * 2**20
"""What one chunk's temporaries may take (row_bytes per row), unless MIN_ROWS rows take more:
small beside what a checkpointed step keeps."""
SMALLER_ONLY = True
"""Rewrite a head only where its chunks keep less than the whole head (Note [The loss head in
chunks]); the tests of the op's exactness turn it off to chunk heads of any size."""
MIN_ROWS = 256
"""Rows per chunk at least: each chunk's projection reads the whole weight, so a chunk of fewer
rows than this does too little work per byte of weight read for a matrix unit to be busy (on
Llama-3's vocabulary, 256 rows take 320 MB of temporaries in bf16)."""


@torch.library.custom_op("ckpt_fx::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    ignore_index: int, chunk_rows: int, upcast: bool, grads: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The summed cross-entropy of `F.linear(hidden, weight, bias)` (upcast to fp32 first when
    `upcast`) against `target`, over the rows whose target is not `ignore_index`, with its
    gradients for a loss gradient of 1: (loss fp32 scalar, d hidden fp32, d weight fp32, d bias
    fp32); a gradient not asked for by `grads` (hidden, weight, bias) is an empty tensor."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    want_hidden, want_weight, want_bias = grads
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    d_hidden = torch.zeros(rows, hidden.shape[1], dtype=torch.float32, device=hidden.device) if want_hidden \
        else hidden.new_empty(0, dtype=torch.float32)
    d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight \
        else weight.new_empty(0, dtype=torch.float32)
    d_bias = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if want_bias and bias is not None \
        else weight.new_empty(0, dtype=torch.float32)
    with torch.autocast(hidden.device.type, enabled=False):  # the rewrite cast the inputs as autocast would
        for start in range(0, rows, chunk_rows):
            h = hidden[start:start + chunk_rows]
            t = target[start:start + chunk_rows]
            logits = F.linear(h, weight, bias)
            wide = logits.float() if upcast or logits.dtype != torch.float32 else logits
            lse = torch.logsumexp(wide, dim=-1)
            kept = t != ignore_index
            safe = torch.where(kept, t, 0)
            picked = wide.gather(1, safe.unsqueeze(1)).squeeze(1)
            loss += torch.where(kept, lse - picked, 0.0).sum()
            if not (want_hidden or want_weight or want_bias):
                del logits, wide
                continue
            # d loss / d logits of this chunk: softmax minus the target's one-hot, zero where ignored.
            grad = wide.sub_(lse.unsqueeze(1)).exp_() if wide is not logits else (wide - lse.unsqueeze(1)).exp_()
            grad.scatter_add_(1, safe.unsqueeze(1), torch.full_like(picked, -1.0).unsqueeze(1))
            grad.mul_(kept.unsqueeze(1))
            if want_bias and bias is not None:
                d_bias += grad.sum(0)
            if logits.dtype == torch.float32:  # the products straight into the fp32 gradients
                if want_hidden:
                    torch.mm(grad, weight, out=d_hidden[start:start + chunk_rows])
                if want_weight:
                    d_weight.addmm_(grad.t(), h)
                del logits, wide, grad
                continue
            grad_low = grad.to(logits.dtype)  # as the whole head's backward casts before its products
            if want_hidden:
                d_hidden[start:start + chunk_rows] = grad_low @ weight
            if want_weight:
                d_weight += (grad_low.t() @ h).float()
            del grad_low
            # The chunk's temporaries go before the next chunk's are made (row_bytes counts one chunk's).
            del logits, wide, grad
    return loss, d_hidden, d_weight, d_bias


@linear_cross_entropy.register_fake
def _(hidden, weight, bias, target, ignore_index, chunk_rows, upcast, grads):
    want_hidden, want_weight, want_bias = grads
    f32 = torch.float32
    return (hidden.new_empty((), dtype=f32),
            hidden.new_empty(hidden.shape, dtype=f32) if want_hidden else hidden.new_empty(0, dtype=f32),
            weight.new_empty(weight.shape, dtype=f32) if want_weight else weight.new_empty(0, dtype=f32),
            weight.new_empty(weight.shape[0], dtype=f32) if want_bias and bias is not None
            else weight.new_empty(0, dtype=f32))


def _setup(ctx, inputs, output):
    hidden, weight, bias = inputs[0], inputs[1], inputs[2]
    ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
    ctx.save_for_backward(*output[1:])
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, grad_loss, *unused):
    d_hidden, d_weight, d_bias = ctx.saved_tensors
    hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
    scaled = lambda d, dtype: (d * grad_loss).to(dtype) if d.numel() else None  # noqa: E731
    return (scaled(d_hidden, hidden_dtype), scaled(d_weight, weight_dtype),
            scaled(d_bias, bias_dtype) if bias_dtype is not None else None, None, None, None, None, None)


linear_cross_entropy.register_autograd(_backward, setup_context=_setup)


@dataclass(frozen=True, kw_only=True)
class Head:
    """One head the pass rewrote."""

    tokens: int
    """Rows of the projection at the traced shape (a hint where the batch is dynamic)."""
    vocab: int
    hidden: int
    chunk_rows: int
    dtype: torch.dtype
    """The projection's compute dtype."""
    upcast: bool
    weight_grad: bool
    """Whether the head's weight is trained (and its gradient is formed)."""
    logits_kept: bool
    """Whether the graph still returns the whole logits (the caller asked for them)."""

    @property
    def chunks(self) -> int:
        return -(-self.tokens // self.chunk_rows)

    @property
    def whole_bytes(self) -> int:
        """What the whole head keeps for its backward: the logits in the compute dtype, their fp32
        log-softmax (and the fp32 copy where the model upcasts a lower-precision projection)."""
        low = self.tokens * self.vocab * self.dtype.itemsize
        fp32 = self.tokens * self.vocab * 4
        return low + fp32 + (fp32 if self.dtype != torch.float32 else 0)

    @property
    def kept_bytes(self) -> int:
        """What the chunked head keeps for its backward: its gradients, formed in the forward."""
        return 4 * (self.tokens * self.hidden + (self.vocab * self.hidden if self.weight_grad else 0))

    @property
    def chunk_bytes(self) -> int:
        """One chunk's temporaries at their peak (row_bytes)."""
        return min(self.chunk_rows, self.tokens) * row_bytes(vocab=self.vocab, dtype=self.dtype)


@dataclass(kw_only=True)
class HeadReport:
    """What head_pass found: the heads it rewrote, and why each cross-entropy it left was left."""

    heads: list[Head] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    dropped_outputs: tuple[int, ...] = ()
    """Indices of graph outputs (the logits) the pass removed, when asked to: the caller puts None
    in their place."""


def row_bytes(*, vocab: int, dtype: torch.dtype) -> int:
    """One row's share of a chunk's temporaries at their peak, in linear_cross_entropy's order: the
    logits in the compute dtype, their fp32 copy where that dtype is lower, and logsumexp's fp32
    temporary (later the fp32 gradient, in the copy's place or the temporary's)."""
    return vocab * (dtype.itemsize + 4 + (4 if dtype.itemsize < 4 else 0))


def chunk_rows_for(*, vocab: int, dtype: torch.dtype, chunk_bytes: int, min_rows: int) -> int:
    """Rows per chunk: as many as fit in `chunk_bytes` of one chunk's temporaries, at least
    `min_rows` (and 1)."""
    return max(1, min_rows, chunk_bytes // row_bytes(vocab=vocab, dtype=dtype))


def keeps_less_in_chunks(*, tokens: int, vocab: int, hidden: int, dtype: torch.dtype, weight_grad: bool,
                         chunk_bytes: int | None = None) -> bool:
    """Whether head_pass would put a head of these sizes in chunks: a vocabulary head (WIDE) that
    keeps less so (SMALLER_ONLY)."""
    if vocab < WIDE * hidden:
        return False
    chunk = chunk_rows_for(vocab=vocab, dtype=dtype, chunk_bytes=CHUNK_BYTES if chunk_bytes is None else chunk_bytes,
                           min_rows=MIN_ROWS)
    head = Head(tokens=tokens, vocab=vocab, hidden=hidden, chunk_rows=chunk, dtype=dtype, upcast=False,
                weight_grad=weight_grad, logits_kept=True)
    return not SMALLER_ONLY or head.kept_bytes + head.chunk_bytes < head.whole_bytes


def workspace_bytes(node: torch.fx.Node, sizes: dict[str, int] | None = None) -> int:
    """Bytes a linear_cross_entropy node holds while it runs beyond its outputs: one chunk's
    temporaries (Head.chunk_bytes); 0 for any other node. What the memory passes add at its step."""
    if node.op != "call_function" or node.target is not torch.ops.ckpt_fx.linear_cross_entropy.default:
        return 0
    hidden, weight = node.args[0], node.args[1]
    hv, wv = hidden.meta.get("val"), weight.meta.get("val")
    if not isinstance(hv, torch.Tensor) or not isinstance(wv, torch.Tensor):
        return 0
    chunk = min(int(node.args[5]), size_at(hv.shape[0], sizes or {}))
    vocab, width = int(wv.shape[0]), int(wv.shape[1])
    # Below fp32, the weight gradient's chunk product is made in the compute dtype, then widened.
    product = vocab * width * (hv.dtype.itemsize + 4) if hv.dtype.itemsize < 4 and node.args[7][1] else 0
    return chunk * row_bytes(vocab=vocab, dtype=hv.dtype) + product


_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_UPCASTS = ("float", "to", "type")
_RESHAPES = ("view", "reshape", "flatten", "contiguous")


def _value(node: object) -> object:
    """A node's traced value (dynamo's example value, or shape propagation's tensor meta)."""
    if not isinstance(node, torch.fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def _is_linear(node: torch.fx.Node) -> bool:
    """F.linear, or a call of an nn.Linear module (torch.fx.symbolic_trace leaves those as calls)."""
    if node.op == "call_function":
        return node.target is F.linear
    return node.op == "call_module" and type(_submodule(node)) is torch.nn.Linear


def _submodule(node: torch.fx.Node) -> torch.nn.Module | None:
    root = getattr(node.graph, "owning_module", None)
    try:
        return root.get_submodule(node.target) if root is not None else None
    except AttributeError:
        return None


def _projection(linear: torch.fx.Node) -> tuple[torch.fx.Node, object, object, object, object]:
    """A projection's (input, weight, bias, weight's value, bias's value); for a module call the
    weight and bias are its parameters (get_attr nodes are made for them where the rewrite uses them)."""
    if linear.op == "call_module":
        module = _submodule(linear)
        return linear.args[0], f"{linear.target}.weight", \
            f"{linear.target}.bias" if module.bias is not None else None, module.weight, module.bias
    w = linear.args[1]
    b = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    return linear.args[0], w, b, _value(w), _value(b) if b is not None else None


def _is_cross_entropy(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.cross_entropy


def _ce_arguments(node: torch.fx.Node) -> dict[str, object]:
    bound = _CE_SIGNATURE.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _unwind(logits: torch.fx.Node) -> tuple[torch.fx.Node | None, list[torch.fx.Node], bool, str]:
    """From a cross-entropy's input back to the projection: (linear node, the token-dimension
    slicings to replay on its input in order, upcast, why not when the linear is None)."""
    chain, node, upcast = [], logits, False
    while True:
        if not isinstance(node, torch.fx.Node):
            return None, [], False, "its input is not a traced value"
        if _is_linear(node):
            return node, [n for n in reversed(chain) if n.target is operator.getitem], upcast, ""
        value = _value(node)
        if node.op == "call_method" and node.target in _UPCASTS:
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                return None, [], False, f"{node.name}: a cast to a non-float type"
            extra = [a for a in (*node.args[1:], *node.kwargs.values()) if not isinstance(a, torch.dtype)]
            if extra and not all(isinstance(a, (str, torch.device)) for a in extra):
                return None, [], False, f"{node.name}: a cast with arguments the rewrite does not replay"
            upcast = upcast or value.dtype == torch.float32
        elif node.op == "call_method" and node.target in _RESHAPES:
            source = _value(node.args[0])
            if not (isinstance(value, torch.Tensor) and isinstance(source, torch.Tensor)
                    and value.shape[-1] == source.shape[-1]):
                return None, [], False, f"{node.name}: a reshape that moves the vocabulary dimension"
        elif node.op == "call_function" and node.target is operator.getitem:
            index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            source = _value(node.args[0])
            if not isinstance(source, torch.Tensor) or any(isinstance(i, torch.fx.Node) for i in index):
                return None, [], False, f"{node.name}: indexing by a traced value"
            if index and index[-1] is Ellipsis or len(index) >= source.dim() and index[-1] != slice(None):
                return None, [], False, f"{node.name}: indexing that reaches the vocabulary dimension"
        else:
            what = node.target if node.op == "call_method" else getattr(node.target, "__name__", node.target)
            return None, [], False, f"its input passes through {what} ({node.name}), which the rewrite does not replay"
        chain.append(node)
        node = node.args[0]


def head_pass(gm: torch.fx.GraphModule, *, keep_logits: bool = True, chunk_bytes: int | None = None) -> HeadReport:
    """Rewrite each recognised loss head of `gm` (Note [The loss head in chunks]) in place; returns
    what was rewritten and why anything else was not. `keep_logits=False`: graph outputs that are
    a rewritten head's logits are removed (HeadReport.dropped_outputs), so nothing builds them.
    Graphs whose nodes carry no traced values are left as they are."""
    report = HeadReport()
    graph = gm.graph
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    for ce in [n for n in graph.nodes if _is_cross_entropy(n)]:
        reason = _rewrite(gm, ce, chunk_bytes=chunk_bytes, report=report)
        if reason:
            report.reasons.append(f"{ce.name}: {reason}")
    if report.heads and not keep_logits:
        report.dropped_outputs = _drop_logits(graph)
    if report.heads:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
        kept = bool(_logits_outputs(graph))
        report.heads = [dataclasses.replace(h, logits_kept=kept) for h in report.heads]
    return report


def _rewrite(gm: torch.fx.GraphModule, ce: torch.fx.Node, *, chunk_bytes: int, report: HeadReport) -> str:
    """Replace one cross-entropy and its projection; the reason it was left, or ""."""
    args = _ce_arguments(ce)
    if args["weight"] is not None:
        return "class weights"
    if args["label_smoothing"] not in (0, 0.0):
        return "label smoothing"
    if args["size_average"] is not None or args["reduce"] is not None:
        return "the deprecated size_average/reduce arguments"
    if args["reduction"] not in ("mean", "sum"):
        return f"reduction={args['reduction']!r} (per-token losses are kept whole)"
    if not isinstance(args["ignore_index"], int):
        return "an ignore_index that is a traced value"
    x, target = args["input"], args["target"]
    xv, tv = _value(x), _value(target)
    if not isinstance(xv, torch.Tensor) or not isinstance(tv, torch.Tensor):
        return "no traced shapes (run shape propagation first)"
    if xv.dim() != 2 or tv.dim() != 1 or tv.is_floating_point():
        return "not a (tokens, classes) input with integer targets"
    linear, slicings, upcast, why = _unwind(x)
    if linear is None:
        return why
    h, w, b, wv, bv = _projection(linear)
    hv, lv = _value(h), _value(linear)
    if not all(isinstance(v, torch.Tensor) for v in (hv, wv, lv)) or wv.dim() != 2:
        return "a projection without traced shapes"
    vocab, width = wv.shape
    if vocab < WIDE * width:
        return f"a projection from {width} to {vocab} is no vocabulary head (under {WIDE}x wider)"
    dtype = lv.dtype
    grads = [bool(hv.requires_grad), bool(wv.requires_grad), bool(b is not None and bv.requires_grad)]
    chunk = chunk_rows_for(vocab=vocab, dtype=dtype, chunk_bytes=chunk_bytes, min_rows=MIN_ROWS)
    head = Head(tokens=size_hint(xv.shape[0]), vocab=int(vocab), hidden=int(width), chunk_rows=int(chunk),
                dtype=dtype, upcast=upcast, weight_grad=grads[1], logits_kept=True)
    if SMALLER_ONLY and head.kept_bytes + head.chunk_bytes >= head.whole_bytes:
        # Note [The loss head in chunks]: only where it keeps less.
        return (f"in chunks of {chunk} rows it would keep {head.kept_bytes + head.chunk_bytes} bytes at once, "
                f"no fewer than the {head.whole_bytes} the whole head keeps ({head.tokens} tokens)")
    graph = gm.graph
    with graph.inserting_before(ce):
        if isinstance(w, str):  # a module call's parameters
            w, b = graph.get_attr(w), graph.get_attr(b) if b is not None else None
        for s in slicings:
            h = graph.call_function(operator.getitem, (h, s.args[1]))
        rows = graph.call_method("reshape", (h, -1, width))
        cast = lambda v, vv: graph.call_method("to", (v, dtype)) if vv.dtype != dtype else v  # noqa: E731
        rows, w_in = cast(rows, hv), cast(w, wv)
        b_in = cast(b, bv) if b is not None else None
        op = graph.call_function(torch.ops.ckpt_fx.linear_cross_entropy.default,
                                 (rows, w_in, b_in, target, args["ignore_index"], chunk, upcast, grads))
        total = graph.call_function(operator.getitem, (op, 0))
        if args["reduction"] == "mean":
            kept = graph.call_function(torch.ne, (target, args["ignore_index"]))
            count = graph.call_method("sum", (kept,))
            total = graph.call_function(operator.truediv, (total, count))
        loss = graph.call_method("to", (total, _value(ce).dtype)) if _value(ce).dtype != torch.float32 else total
    ce.replace_all_uses_with(loss)
    graph.erase_node(ce)
    report.heads.append(head)
    return ""


def _logits_outputs(graph: torch.fx.Graph) -> list[int]:
    """Indices of graph outputs that are a vocabulary projection or an upcast of one."""
    outputs = graph.output_node().args[0]
    if not isinstance(outputs, (tuple, list)):
        return []
    found = []
    for i, out in enumerate(outputs):
        node = out
        while isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target in _UPCASTS:
            node = node.args[0]
        if isinstance(node, torch.fx.Node) and _is_linear(node):
            wv = _projection(node)[3]
            if isinstance(wv, torch.Tensor) and wv.dim() == 2 and wv.shape[0] >= WIDE * wv.shape[1]:
                found.append(i)
    return found


def _drop_logits(graph: torch.fx.Graph) -> tuple[int, ...]:
    """Remove the logits from the graph's outputs; their indices in the original outputs."""
    dropped = _logits_outputs(graph)
    if dropped:
        out = graph.output_node()
        outputs = out.args[0]
        out.args = (type(outputs)(o for i, o in enumerate(outputs) if i not in dropped),)
    return tuple(dropped)
