"""A 4-bit NF4 base as bitsandbytes holds it, for fit to plan (`fit(dtype="nf4")`, `--dtype nf4`).

Note [Planning a 4-bit base]
QLoRA trains LoRA adapters on a frozen base whose linear layers bitsandbytes keeps in NF4: per
weight matrix a packed uint8 tensor (two 4-bit codes per byte) and its quantisation state, one
absmax per block of 64 values; with double quantisation (QLoRA's recipe) those absmax are
themselves quantised to uint8 in blocks of 256, with one fp32 absmax per such block, a 256-entry
fp32 code and an fp32 offset. Its matrix product (bitsandbytes' MatMul4Bit) dequantises the whole
matrix to the compute dtype, multiplies, and keeps nothing but the packed weight for the backward,
which dequantises it again for the input's gradient.

fit cannot trace bitsandbytes' own layers on fake tensors (its Params4bit is a tensor subclass that
fake tensors cannot stand for), so `NF4Linear` stands in: the same tensors at the same sizes,
and a matrix product that allocates what bitsandbytes' does: one matrix in the compute dtype per
dequantisation, in the forward and again in the backward. Its numbers are bitsandbytes' too
(`dequantize` gives what bitsandbytes.functional.dequantize_4bit gives for the same state;
tests/test_nf4.py checks both against bitsandbytes where it is installed), so a step of it can be
run and measured on any device. Other frozen weights (embeddings, norms, the output head, which
transformers leaves unquantised) are cast to the compute dtype, as loading with
`torch_dtype=torch.bfloat16` does.
"""

from __future__ import annotations

import math

import torch

BLOCK = 64
"""Values per absmax (bitsandbytes' default 4-bit blocksize)."""
NESTED_BLOCK = 256
"""Absmax values per fp32 absmax under double quantisation."""
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0)
"""The 16 NF4 levels (the QLoRA paper's normal-float quantiles, as bitsandbytes stores them)."""


@torch.library.custom_op("ckpt_fx::dequantize_nf4", mutates_args=())
def _dequantize(packed: torch.Tensor, code: torch.Tensor, absmax: torch.Tensor, nested_code: torch.Tensor,
                nested_absmax: torch.Tensor, offset: torch.Tensor, rows: int, columns: int, dtype: torch.dtype,
                phase: int) -> torch.Tensor:
    """The (rows, columns) matrix in `dtype` from its NF4 codes and double-quantised absmax.
    `phase` (0 forward, 1 backward) only keeps the backward's dequantisation a node of its own,
    so that no common-subexpression pass merges it with the forward's and saves the matrix."""
    codes = torch.stack([packed.reshape(-1) >> 4, packed.reshape(-1) & 15], 1).reshape(-1)[: rows * columns]
    scales = nested_code[absmax.long()] * nested_absmax.repeat_interleave(NESTED_BLOCK)[: absmax.numel()] + offset
    values = code[codes.long()].reshape(-1, BLOCK) * scales[:, None]
    return values.reshape(rows, columns).to(dtype)


@_dequantize.register_fake
def _(packed, code, absmax, nested_code, nested_absmax, offset, rows, columns, dtype, phase):
    return packed.new_empty((rows, columns), dtype=dtype)


class _MatMulNF4(torch.autograd.Function):
    """x @ W.T + bias with W dequantised from NF4 in the forward and again in the backward; only
    the packed weight is kept between them (Note [Planning a 4-bit base])."""

    @staticmethod
    def forward(ctx, x, bias, layer_state, packed, code, absmax, nested_code, nested_absmax, offset):
        rows, columns, dtype = layer_state
        weight = _dequantize(packed, code, absmax, nested_code, nested_absmax, offset, rows, columns, dtype, 0)
        ctx.save_for_backward(packed, code, absmax, nested_code, nested_absmax, offset)
        ctx.layer_state = layer_state
        return torch.nn.functional.linear(x, weight.to(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        rows, columns, dtype = ctx.layer_state
        weight = _dequantize(*ctx.saved_tensors, rows, columns, dtype, 1)
        return grad @ weight.to(grad.dtype), None, None, None, None, None, None, None, None


class NF4Linear(torch.nn.Linear):
    """A frozen linear layer in NF4 with double-quantised absmax, as bitsandbytes' Linear4bit
    holds it (Note [Planning a 4-bit base]); a torch.nn.Linear, so that peft adds adapters to it.
    `weight` is the packed uint8 codes, shaped (n / 2, 1) as bitsandbytes shapes them."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 compute_dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, compute_dtype
        n = in_features * out_features
        blocks = math.ceil(n / BLOCK)
        self.weight = torch.nn.Parameter(torch.zeros((n + 1) // 2, 1, dtype=torch.uint8, device=device),
                                         requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device),
                                        requires_grad=False) if bias else None)
        self.register_buffer("code", torch.tensor(NF4_CODE, device=device))
        self.register_buffer("absmax", torch.zeros(blocks, dtype=torch.uint8, device=device))
        self.register_buffer("nested_code", torch.zeros(256, device=device))
        self.register_buffer("nested_absmax", torch.zeros(math.ceil(blocks / NESTED_BLOCK), device=device))
        self.register_buffer("offset", torch.zeros((), device=device))

    @classmethod
    def like(cls, linear: torch.nn.Linear, compute_dtype: torch.dtype) -> NF4Linear:
        """A layer of `linear`'s shape and device (its values are not quantised: fit reads shapes)."""
        return cls(linear.in_features, linear.out_features, bias=linear.bias is not None, compute_dtype=compute_dtype,
                   device=linear.weight.device)

    def dequantize(self) -> torch.Tensor:
        return _dequantize(self.weight, self.code, self.absmax, self.nested_code, self.nested_absmax, self.offset,
                           self.out_features, self.in_features, self.compute_dtype, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return _MatMulNF4.apply(x, bias, (self.out_features, self.in_features, self.compute_dtype), self.weight,
                                self.code, self.absmax, self.nested_code, self.nested_absmax, self.offset)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4, compute {self.compute_dtype}"


def quantize_frozen(model: torch.nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """Swap, in place, every frozen torch.nn.Linear but the output head for an NF4Linear of its
    shape, and cast the other frozen floating weights and buffers to `compute_dtype`. Returns
    how many layers were swapped; ValueError when none was (nothing a 4-bit base would hold)."""
    heads = _output_heads(model)
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if (type(child) is torch.nn.Linear and child not in heads and not child.weight.requires_grad
                    and child.weight.is_floating_point()):
                setattr(module, name, NF4Linear.like(child, compute_dtype))
                swapped += 1
    if not swapped:
        raise ValueError("dtype nf4: the model has no frozen torch.nn.Linear layer to hold in 4 bits (the base's "
                         "linear layers are quantised; trained ones and the output head stay as they are)")
    cast_frozen(model, compute_dtype)
    return swapped


def cast_frozen(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point parameters that are not trained, and the buffers, to `dtype`, in
    place; a 4-bit layer's quantisation state keeps bitsandbytes' dtypes."""
    for module in model.modules():
        if isinstance(module, NF4Linear):
            continue
        for name, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
                setattr(module, name, torch.nn.Parameter(p.detach().to(dtype), requires_grad=False))
        for name, b in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            if b.is_floating_point() and b.dtype != dtype:
                setattr(module, name, b.to(dtype))


def weights_as_4bit(model: torch.nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the model's parameters and buffers were quantize_frozen applied (nothing is
    changed: shapes are read)."""
    heads = _output_heads(model)
    four_bit = {id(m.weight): m for m in model.modules()
                if type(m) is torch.nn.Linear and m not in heads and not m.weight.requires_grad
                and m.weight.is_floating_point()}
    size = torch.empty((), dtype=compute_dtype).element_size()
    total = 0
    for tensor in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values():
        if id(tensor) in four_bit:
            layer = four_bit[id(tensor)]
            total += held_bytes(layer.in_features, layer.out_features)
        elif tensor.is_floating_point() and not (isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad):
            total += tensor.numel() * size
        else:
            total += tensor.numel() * tensor.element_size()
    return total


def held_bytes(in_features: int, out_features: int) -> int:
    """Bytes a 4-bit matrix takes with its quantisation state (NF4Linear's, bitsandbytes')."""
    n = in_features * out_features
    blocks = math.ceil(n / BLOCK)
    return (n + 1) // 2 + blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + 4 * (len(NF4_CODE) + 256 + 1)


def _output_heads(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The output projections transformers leaves unquantised: a model's get_output_embeddings(),
    else a Linear named head or lm_head."""
    heads = []
    for module in model.modules():
        get = getattr(module, "get_output_embeddings", None)
        if callable(get):
            try:
                head = get()
            except (AttributeError, NotImplementedError):
                head = None
            if isinstance(head, torch.nn.Module):
                heads.append(head)
                heads.extend(head.modules())  # a head peft wrapped: its base layer too
    if not heads:
        heads = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in ("head", "lm_head")]
    return heads
