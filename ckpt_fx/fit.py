"""fit: will a training step fit in a given memory, and with which policy? Planned without the
hardware and without allocating the model.

Note [Planning on fake tensors]
The model's parameters become fake tensors (torch's FakeTensorMode): they carry shapes, dtypes and
devices but no storage (planning LLaMA-7B's shapes peaked at 2.0 GB resident on a CPU, most of it
the traced graphs). A factory is called on the meta device and its tensors swapped for fake CPU
ones (so that peft, which moves new adapters to their base layer's device, works too); a real
module is copied onto fake tensors. Dynamo and AOTAutograd trace fake tensors as they trace real
ones, and the step then runs on them (nothing is computed). The step is traced once: each joint
graph is copied to the backend of every policy, whose passes plan it as for any compile. The
batch dimension is marked dynamic, so the same plans serve every batch size (Plan.at). Mixed
precision traces under CPU autocast (fake tensors are CPU tensors; meta tensors get no autocast);
CUDA's autocast casts the same matrix products to bfloat16 but keeps a few other ops in other
dtypes. Plans are made for the eager inner compiler (AOTAutograd's default partition); under
Inductor, torch's min-cut partition usually saves less, which fit does not predict.

Note [What fit adds to the plan]
A plan predicts the bytes a forward and backward allocate above what exists before them
(Note [What the predicted peak counts]): activations, temporaries, and the parameter gradients
the backward makes. A training step also holds the weights and buffers, the optimizer's state
(AdamW: two tensors per trainable parameter, in its dtype), and, in optimizer.step(), the
gradients together with the optimizer's temporaries: torch's AdamW on CUDA updates all parameters
at once (foreach), holding one more tensor per trainable parameter; on CPU it loops over them,
holding two tensors the size of the largest. Gradients are freed before each forward
(zero_grad(set_to_none=True), torch's default). So the step's peak is the larger of
weights + optimizer state + the plan's peak, and weights + gradients + optimizer state + the
optimizer's temporaries. `activations_bytes` is what that peak holds besides weights, gradients
and optimizer state. The model's outputs (an HF model's logits) are taken as held until the
backward ends, as in `outputs = model(**batch); outputs.loss.backward()`; a loop that keeps only
the loss (HF's Trainer) peaks lower by up to their size.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import warnings
import dataclasses
import math
import fnmatch
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ckpt_fx import policies as policy_forms
from ckpt_fx.dynamo_backend import CkptBackend, Options
from ckpt_fx.nf4 import NF4Linear, cast_frozen, quantize_frozen, weights_as_4bit
from ckpt_fx.measure import peak_bytes
from ckpt_fx.report import _fresh_function, training_loss
from passes import Plan, step_peak_bytes
from passes.graphs import copy_graph_module
from passes.sizes import UNITS_SHOWN, format_size, parse_size
from passes.warn import BudgetWarning
from passes.sizes import size_literal as _size_text
from passes._compat import FakeCopyMode, FakeTensor, FakeTensorMode, mark_dynamic, offload_bandwidth, pytree
from passes.costs import ROOFLINES
from passes.offload import copy_seconds

DEFAULT_POLICIES = ("none", "blocks", "selective", "sqrt", "offload", "budget:fit",
                    "budget:fit,offload")
BUDGET_AT_THE_CAP = "budget:fit"
"""In `policies`: a memory budget set to what the memory leaves after weights and optimizer state
("budget:fit,offload": one that may keep saved values in host memory too)."""
PRECISIONS = ("fp32", "bf16-mixed")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The weights' dtypes fit takes by name (`dtype`, --dtype), and NF4."""
NF4 = "nf4"
"""`dtype`: the frozen base's linear layers in 4-bit NF4 as bitsandbytes holds them for QLoRA, the
rest of it in bf16 (Note [Planning a 4-bit base] in ckpt_fx/nf4.py)."""
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}
"""Tensors of state per trainable parameter (SGD: its momentum buffer)."""
DEVICES = ("cuda", "cpu")
SHARDS = ("fsdp", "none")
"""How several GPUs hold the model: FSDP2's full shard, or a replica each (DDP)."""


def parse_memory(memory: int | str) -> int:
    """Bytes from a positive int or a size like "24GiB", "80GB", "512MiB" (GiB = 2**30, GB = 10**9)."""
    if isinstance(memory, int) and not isinstance(memory, bool) and memory > 0:
        return memory
    size = parse_size(memory) if isinstance(memory, str) else None
    if size is None:
        raise ValueError(f"memory: expected a positive size such as '24GiB', '80GB' or 512000000 (bytes), "
                         f"got {memory!r}; units: {UNITS_SHOWN}")
    return size


@dataclass(frozen=True)
class FitRow:
    """One policy's predicted training step."""

    policy: str
    policy_text: str | None
    """The policy written as `enable(model, policy=...)` and the backend's options take it (a
    budget:fit row: its budget in bytes at this memory); None for a policy given as a function."""
    peak_bytes: int
    """Predicted device peak of a training step at the traced batch: weights, gradients, optimizer
    state and activations (Note [What fit adds to the plan])."""
    peak_in: str
    """Where the step peaks: "forward/backward" or "optimizer step"."""
    weights_bytes: int
    """Parameters and buffers."""
    grads_bytes: int
    """Gradients of the trainable parameters."""
    optimizer_bytes: int
    """The optimizer's state."""
    optimizer_temporary_bytes: int
    """What optimizer.step() allocates while it runs (foreach AdamW on a GPU: one tensor per
    trainable parameter); counted in the peak when the step peaks there."""
    gathered_bytes: int
    """Several GPUs: what a rank holds besides during the forward and backward (FSDP2's unsharded
    parameters and gradients, DDP's gradient buckets; Note [A sharded step]); 0 on one."""
    activations_bytes: int
    """At the forward/backward's peak, what it holds besides weights, optimizer state and
    parameter gradients: activations and temporaries."""
    offloaded_bytes: int
    """Host memory the plan's offloaded values take."""
    compute_s: float
    """Seconds of the step's forward, backward and recompute at the device's peak FLOP/s (a
    roofline: a lower bound, for comparing policies)."""
    copy_s: float
    """Seconds the copies to host memory and back add, compute hiding what it can (Note [Offload]
    in passes/offload.py)."""
    recompute_flops_fraction: float
    """FLOPs recomputed in the backward over the FLOPs of a step's forward and backward."""
    recomputed_ops: int
    """Ops the backward recomputes (pointwise ops count no FLOPs)."""
    max_batch: int
    """The largest batch whose step fits in the memory given; 0 when none does."""
    min_gpus: int | None
    """Under FSDP2: the fewest GPUs whose per-rank step fits at the batch per rank (0: none up to
    MAX_GPUS); None on one GPU or under DDP."""
    max_seq: int | None
    """With `seq_dim`: the longest sequence whose step fits at the traced batch; 0 when none
    does; None when not asked."""
    fits: bool
    """The traced batch fits."""


@dataclass(frozen=True)
class FitReport:
    """fit()'s answer: one row per policy, the fastest policy that fits, and when none does,
    what would make the step fit."""

    rows: tuple[FitRow, ...]
    memory_bytes: int
    batch: int
    precision: str
    optimizer: str
    parameters: int
    trainable_parameters: int
    best: str | None
    """The policy that fits at the traced batch with the fastest predicted step (compute and
    copies not hidden), then the lowest peak; None if none fits."""
    weights_dtype: str = "fp32"
    """The dtype of the weights that are not trained, and of trained ones when they share it."""
    suggestions: tuple[str, ...] = ()
    """When nothing fits: the smallest changes that would, each in words."""
    planned_from: int = 0
    """Where the step was planned on the model cut to a few of its alike blocks and extrapolated
    (Note [Planning from a few alike blocks]), the blocks of its stack; 0 where every block was
    planned."""
    planned_whole_for: tuple[str, ...] = ()
    """The policies, as given, that made every block be planned where the model's stack could
    have been cut (each depends on the whole stack); empty otherwise."""
    _step: _Step | None = field(default=None, repr=False, compare=False)
    _traced: tuple[_Traced, ...] = field(default=(), repr=False, compare=False)

    def for_memory(self, memory: int | str) -> FitReport:
        """The same plans judged against another memory size (nothing is traced again)."""
        limit = parse_memory(memory)
        sizes = sorted({t.memory for t in self._traced if t.memory is not None})
        if sizes and limit not in sizes:
            raise ValueError(f"for_memory: budget:fit was planned for {', '.join(_size_text(s) for s in sizes)}, "
                             f"not {_size_text(limit)}; ask fit for it (memory=[...] plans several sizes at once)")
        rows = tuple(t.row(self._step, limit) for t in self._traced if t.memory in (None, limit))
        fitting = [r for r in rows if r.fits]
        best = min(fitting, key=lambda r: (r.compute_s + r.copy_s, r.recomputed_ops, r.peak_bytes)) if fitting else None
        report = dataclasses.replace(self, rows=rows, memory_bytes=limit, best=best.policy if best else None)
        return dataclasses.replace(report, suggestions=() if best else tuple(report._suggest()))

    def to_json(self) -> list[dict[str, Any]]:
        return [asdict(row) for row in self.rows]

    def _suggest(self) -> list[str]:
        """The smallest changes that would make the step fit (Note [What fit adds to the plan])."""
        step, limit = self._step, self.memory_bytes
        out = []
        batch = max(self.rows, key=lambda r: r.max_batch)
        if batch.max_batch:
            out.append(f"a batch of {batch.max_batch} fits with {batch.policy}")
            if step.grad_accum == 1:
                traced = next(t for t in self._traced if t.policy == batch.policy)
                accumulating = dataclasses.replace(step, grad_accum=2)
                micro = _largest(lambda b: traced.peak_at(accumulating, b), limit, step.batch,
                                 dynamic=any(traced.batch_symbols.values()))
                if micro:
                    k = -(-self.batch // micro)
                    out.append(f"{k} micro-batches of {micro} accumulated (--batch {micro} --grad-accum {k}: "
                               f"{k * micro} sequences per optimizer step) with {batch.policy}")
        fixed = step.weights + step.states + step.grads
        if fixed > limit or not batch.max_batch:
            if step.trainable_share > 0.5:
                out.append("train LoRA adapters on a frozen base (--lora r=16): gradients and optimizer state only for them")
            if step.frozen_fp32:
                half = step.weights - step.frozen_fp32 // 2
                out.append(f"a bf16 base (--dtype bf16): weights {format_size(half)} instead of {format_size(step.weights)}")
            if step.weights_4bit < step.weights:
                lowest = min(r.peak_bytes for r in self.rows) - step.weights + step.weights_4bit
                out.append(f"a 4-bit base (--dtype nf4, QLoRA): weights {format_size(step.weights_4bit)} instead of "
                           f"{format_size(step.weights)}, the lowest plan's peak about {format_size(lowest)}")
        if not any(r.offloaded_bytes for r in self.rows):
            out.append("offload (policy offload, or budget:fit,offload): saved activations in host memory")
        sharded = [r for r in self.rows if r.min_gpus]
        if sharded:
            fewest = min(sharded, key=lambda r: r.min_gpus)
            out.append(f"{fewest.min_gpus} GPUs under FSDP2 (--gpus {fewest.min_gpus}) with {fewest.policy}")
        return out

    def __str__(self) -> str:
        unit, gib = ("GiB", 2**30) if self.memory_bytes >= 2**32 else ("MiB", 2**20)
        seq = any(r.max_seq is not None for r in self.rows)
        gpus = any(r.min_gpus is not None for r in self.rows)
        weights = f"{self.weights_dtype} weights" + ("" if self.precision == "fp32" else f", {self.precision} autocast")
        ranks = self._step.ranks if self._step is not None else 1
        if self._step is not None and self._step.grad_accum > 1:
            weights += f"; {self._step.grad_accum} micro-batches accumulated per optimizer step"
        if ranks > 1:
            weights += (f"; per rank of {ranks} GPUs, " + ("FSDP2 full shard" if self._step.shard == "fsdp" else "replicas (DDP)")
                        + f", batch {self.batch} per rank")
        out = [
            f"ckpt_fx fit: {_count(self.parameters)} parameters ({_count(self.trainable_parameters)} trainable), "
            f"batch {self.batch}, {weights}, optimizer {self.optimizer}, device memory {_size_text(self.memory_bytes)}",
            "",
            f"| policy | peak {unit} | peaks in | weights | grads | optimizer state | optimizer step | "
            + ("unsharded (gathered) | " if ranks > 1 else "") + "activations | "
            "host (offloaded) | recompute FLOPs | step time (compute + copies) | max batch | "
            + (f"longest sequence at batch {self.batch} | " if seq else "") + ("fewest GPUs | " if gpus else "") + "fits |",
            "|---|---:|---|---:|---:|---:|---:|" + ("---:|" if ranks > 1 else "") + "---:|---:|---:|---:|---:|"
            + ("---:|" if seq else "") + ("---:|" if gpus else "") + "---|",
        ]
        for r in self.rows:
            out.append(
                f"| {r.policy} | {r.peak_bytes / gib:.2f} | {r.peak_in} | {r.weights_bytes / gib:.2f} | "
                f"{r.grads_bytes / gib:.2f} | {r.optimizer_bytes / gib:.2f} | {r.optimizer_temporary_bytes / gib:.2f} | "
                + (f"{r.gathered_bytes / gib:.2f} | " if ranks > 1 else "")
                + f"{r.activations_bytes / gib:.2f} | {r.offloaded_bytes / gib:.2f} | {r.recompute_flops_fraction:.1%} | "
                f"{_seconds(r.compute_s)} + {_seconds(r.copy_s)} | {r.max_batch if r.max_batch else 'none fits'} | "
                + (f"{r.max_seq if r.max_seq else 'none fits'} | " if seq else "")
                + (f"{r.min_gpus or f'over {MAX_GPUS}'} | " if gpus else "")
                + f"{'yes' if r.fits else 'no'} |"
            )
        out.append("")
        if self.best is not None:
            text = next(r.policy_text for r in self.rows if r.policy == self.best)
            out.append(f"fastest policy that fits at batch {self.batch}: {self.best}"
                       + (f"; as written for enable: policy={text!r}" if text and text != self.best else ""))
        else:
            fixed = min(r.weights_bytes + r.grads_bytes + r.optimizer_bytes for r in self.rows)
            out.append(f"no policy fits at batch {self.batch}"
                       + (f": weights, gradients and optimizer state alone need {fixed / gib:.2f} {unit}"
                          if fixed > self.memory_bytes else ""))
            out.extend(f"  would fit: {s}" for s in self.suggestions)
        if self.planned_from:
            out.append(f"planned on the model cut to {', '.join(map(str, CUT_BLOCKS[:-1]))} and {CUT_BLOCKS[-1]} of its "
                       f"{self.planned_from} alike blocks, each figure extrapolated to all of them (every_block=True, "
                       "--every-block: plan every block)")
        out.append("planned for the eager inner compiler; step times are a roofline (peak FLOP/s, the copies at "
                   "torch's host bandwidth); peaks exclude the CUDA context and allocator fragmentation; "
                   "as under ckpt_fx.enable, the loss head runs in chunks and a call with labels returns no logits")
        return "\n".join(out)


def fit(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    *args: Any,
    memory: int | str | Sequence[int | str] = "24GiB",
    policies: Sequence[policy_forms.Policy | str] = DEFAULT_POLICIES,
    optimizer: str = "adamw",
    precision: str = "fp32",
    trainable: Iterable[str] | None = None,
    device: str = "cuda",
    batch_dim: int = 0,
    seq_dim: int | None = None,
    dtype: str | torch.dtype | None = None,
    gpus: int = 1,
    shard: str | None = None,
    grad_accum: int = 1,
    every_block: bool = False,
    progress: bool = False,
    **kwargs: Any,
) -> FitReport:
    """Predict a training step's peak memory per policy, without running it or allocating the model.

    `model`: a module (copied onto fake tensors), one built on the meta device (`with
    torch.device("meta"):`), or a function building one (called on the meta device): a 7B model is
    never allocated. `args`/`kwargs`: one batch as the model takes it (real, meta or fake tensors;
    only their shapes and dtypes are read). `trainable`: parameter-name patterns (fnmatch) to train,
    the rest frozen; default: the model's own requires_grad. `device`: where the step would run
    ("cuda" or "cpu": how the optimizer holds its temporaries). `dtype` ("bf16", "fp16", "fp32" or
    a torch dtype): the weights' dtype; the parameters that are not trained (a frozen base under
    LoRA) and the buffers are cast to it, the trained ones keep theirs (fp32 master weights and
    adapters, as mixed-precision training and peft keep them); "nf4": the frozen linear layers in
    4-bit NF4 as bitsandbytes holds them for QLoRA, the rest of the base in bf16 (Note [Planning a
    4-bit base] in ckpt_fx/nf4.py). `policies` may hold "budget:fit",
    a memory budget of what `memory` leaves after weights and optimizer state ("budget:fit,offload"
    one that may offload). `memory` may list several sizes: the step is traced once, budget:fit is
    planned for each size as if it were asked alone, and the report is the first size's
    (`for_memory` gives the others'). Rows with offload give the host bytes and the time the copies add
    (torch's activation_offload_cpu_gpu_bw). `progress`: a bar on stderr while planning. Returns a
    FitReport; the largest batch each policy fits is found by evaluating its plan at other batch
    sizes (dimension `batch_dim` of every input that has it is traced as dynamic). `seq_dim`
    (e.g. 1 for token ids): the sequence dimension is traced as dynamic too, and each row gives
    the longest sequence that fits at the traced batch (`max_seq`). `gpus` > 1: one rank's step,
    the inputs being that rank's batch, under `shard` "fsdp" (FSDP2 full shard, the default) or
    "none" (DDP replicas) (Note [A sharded step]); rows give the fewest GPUs that fit under FSDP2.
    `grad_accum` > 1: micro-batches accumulated per optimizer step, their gradients held through
    the later ones' forward and backward. Where every policy asked treats each block alike (none,
    blocks, offload, selective) and the model's blocks are alike, the step is planned on the model
    cut to a few of its blocks and each figure extrapolated to all of them (Note [Planning from a
    few alike blocks]); `every_block=True` traces and plans every block instead.
    """
    limits = [parse_memory(m) for m in memory] if isinstance(memory, (list, tuple)) else [parse_memory(memory)]
    if not limits:
        raise ValueError("memory: give at least one size, e.g. '24GiB'")
    limit = limits[0]
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}")
    if device not in DEVICES:
        raise ValueError(f"device: expected one of {', '.join(DEVICES)}, got {device!r}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus: expected a whole number >= 1, got {gpus!r}")
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum: expected a whole number >= 1, got {grad_accum!r}")
    shard = shard if shard is not None else ("fsdp" if gpus > 1 else "none")
    if shard not in SHARDS:
        raise ValueError(f"shard: expected one of {', '.join(SHARDS)}, got {shard!r}")
    four_bit = isinstance(dtype, str) and dtype.strip().lower() == NF4
    cast = None if four_bit else _dtype(dtype)
    parsed = parse_policies(policies)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    if not isinstance(model, torch.nn.Module):
        if not callable(model):
            raise ValueError(f"fit: expected a torch.nn.Module or a function returning one, got {type(model).__name__}")
        with torch.device("meta"):
            model = model()
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"fit: the model factory returned {type(model).__name__}, not a torch.nn.Module")
    else:
        model = copy.deepcopy(model) if _on_meta(model) else model
    if _on_meta(model):
        fake = _meta_to_fake(model, mode)
    else:
        with mode, FakeCopyMode(mode):
            fake = copy.deepcopy(model)
    fake.train()
    if trainable is not None:
        patterns = [trainable] if isinstance(trainable, str) else list(trainable)
        for name, p in fake.named_parameters():
            p.requires_grad_(any(fnmatch.fnmatchcase(name, pat) for pat in patterns))
    if cast is not None:
        cast_frozen(fake, cast)
    if four_bit:
        with mode:  # the 4-bit layers' tensors fake too: nothing allocated
            quantize_frozen(fake, torch.bfloat16)
    args, kwargs = pytree.tree_map(lambda x: _fake(mode, x), (args, kwargs))
    batch = _mark_batch(args, kwargs, batch_dim)
    seq = _mark_seq(args, kwargs, seq_dim, batch) if seq_dim is not None else None

    params = list(fake.parameters())
    train = [p for p in params if p.requires_grad]
    if not train:
        raise ValueError("fit: no parameter requires grad; nothing would be trained (check `trainable`)")
    def on_ranks(k: int) -> _Step:
        return dataclasses.replace(step, **_rank_bytes(fake, train, optimizer=optimizer, device=device, gpus=k,
                                                       shard=shard))

    step = _Step(
        **_rank_bytes(fake, train, optimizer=optimizer, device=device, gpus=gpus, shard=shard),
        on_ranks=on_ranks,
        grad_accum=grad_accum,
        batch=batch,
        seq=seq,
        trainable_share=sum(p.numel() for p in train) / max(1, sum(p.numel() for p in params)),
        frozen_fp32=sum(_nbytes(p) for p in params if not p.requires_grad and p.dtype == torch.float32),
        weights_4bit=weights_as_4bit(fake),
        flops_per_second=ROOFLINES[device][0],
        bandwidth=offload_bandwidth(),
    )
    # Each budget:fit is planned once per memory size, as if that size were asked alone: what it
    # leaves for the step differs (the step is traced once for all of them).
    wanted: list[tuple[int, int | None, policy_forms.Policy]] = []  # (given policy's index, memory, policy)
    lenient = []  # the budget:fit policies: they may not be reached (warn, not raise)
    for k, given in enumerate(policies):
        if not _at_the_cap(given):
            wanted.append((k, None, parsed[k]))
            continue
        offload = given.partition(",")[2].strip() == "offload"
        for size in limits:
            at_cap = policy_forms.budget(_size_text(max(size - step.weights - step.states, 1)), offload=offload)
            lenient.append(at_cap)
            wanted.append((k, size, at_cap))

    def name(k: int, size: int | None, policy: policy_forms.Policy) -> tuple[str, str | None]:
        """A row's policy as shown, and as text enable and the backend accept as written."""
        given = policies[k]
        if size is None:
            return policy_forms.policy_name(policy), given.strip() if isinstance(given, str) else None
        cap = size - step.weights - step.states
        text = f"budget:{_size_text(max(cap, 1))}" + (",offload" if policy.offload else "")  # the limit it was made with
        return ((f"{given} ({_size_text(cap)} for the step at {_size_text(size)})" if cap > 0
                 else f"{given} (the lowest plan: nothing left at {_size_text(size)})"), text)

    plan = functools.partial(_plan, args=args, kwargs=kwargs, policies=[w[2] for w in wanted], precision=precision,
                             lenient=lenient, device=device, progress=progress)
    stack = None if every_block else _alike_stack(fake)
    whole_for = () if stack is None else tuple(dict.fromkeys(
        policies[k] if isinstance(policies[k], str) else policy_forms.policy_name(policy)
        for k, _, policy in wanted if not _alike_per_block(policy)))
    if whole_for:
        stack = None
    traced = _from_cuts(fake, stack, plan, [name(k, size, policy) for k, size, policy in wanted],
                        [size for _, size, _ in wanted], batch, seq) if stack is not None else None
    if traced is None:
        planned = plan(fake)
        traced = [_Traced(*name(k, size, policy), tuple(plans), step_flops, _batch_symbols(plans, batch), size,
                          _batch_symbols(plans, seq) if seq is not None else None)
                  for (k, size, policy), (plans, step_flops) in zip(wanted, planned)]
    weights_dtype = (NF4 if four_bit else {DTYPES[k]: k for k in DTYPES}.get(cast, str(cast)) if cast is not None
                     else _dtype_name(params))
    report = FitReport(rows=(), memory_bytes=limit, batch=batch, precision=precision, optimizer=optimizer,
                       parameters=_parameter_count(fake), trainable_parameters=sum(p.numel() for p in train),
                       best=None, weights_dtype=weights_dtype, _step=step, _traced=tuple(traced),
                       planned_from=traced[0].blocks,
                       planned_whole_for=whole_for)
    return report.for_memory(limit)


def parse_policies(policies: Sequence[object]) -> list[object]:
    """The policies fit plans, each read as `enable` reads it ("budget:fit" forms kept as written);
    a ValueError names the first that is none (`fit --policies` checks them before building the
    model)."""
    parsed = [p if _at_the_cap(p) else policy_forms.parse(p) for p in policies]
    if not parsed:
        raise ValueError("policies: give at least one policy, e.g. ('none', 'blocks')")
    return parsed


def _at_the_cap(policy: object) -> bool:
    """A "budget:fit" form: a budget at what the memory leaves (optionally ",offload")."""
    return isinstance(policy, str) and policy.replace(" ", "") in (BUDGET_AT_THE_CAP, BUDGET_AT_THE_CAP + ",offload")


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A weights' dtype by name or as a torch dtype; ValueError naming the names otherwise."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.strip().lower() in DTYPES:
        return DTYPES[dtype.strip().lower()]
    raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, {NF4} (or a floating torch dtype), got {dtype!r}")


def _parameter_count(model: torch.nn.Module) -> int:
    """The model's parameters, a 4-bit layer's counted as its matrix's values, not its packed bytes."""
    packed = [m for m in model.modules() if isinstance(m, NF4Linear)]
    return (sum(p.numel() for p in model.parameters()) - sum(m.weight.numel() for m in packed)
            + sum(m.in_features * m.out_features for m in packed))


def _dtype_name(params: list[torch.Tensor]) -> str:
    """The dtype most of the parameters have, by name."""
    sizes: dict[torch.dtype, int] = {}
    for p in params:
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    common = max(sizes, key=sizes.get)
    return {v: k for k, v in DTYPES.items()}.get(common, str(common).replace("torch.", ""))


# Note [A sharded step]
# Under FSDP2 as people apply it (fully_shard on every block, then on the root; examples/fsdp2.py)
# each rank holds 1/N of every parameter (dim 0, padded to a multiple of N), of its gradient and
# of the optimizer's state. While the forward and backward run it also holds, unsharded: the
# root's parameters (embeddings, head, final norm: the root is not resharded after the forward)
# and their gradients until the root's reduce-scatter at the backward's end; two blocks'
# parameters (the one computing and the one FSDP2 prefetches); and the gradients of the block
# whose backward runs (their copy into the reduce-scatter's input is made at the block's end,
# once its recomputed activations are gone). The plan's walk keeps 1/N of each parameter
# gradient as it is made (Plan.at's gradient_shards).
# The activations are those of a rank's own batch. DDP (shard "none") holds a replica, and its
# gradient buckets hold the gradients once more (gradient_as_bucket_view=False, its default).
# Hybrid sharding (HSDP: shards within a group of M GPUs, replicas across groups) places on each
# rank what full sharding over M GPUs does, so --gpus M plans it (not measured). Sharding with
# reshard_after_forward=False (ZeRO-2's placement) is not planned: it keeps blocks unsharded from
# their forward to their backward, and counting every block whole through the step overshot
# measured gloo ranks by more than the 10% fit holds; when FSDP2 frees them is not yet modelled.


def _rank_bytes(model: torch.nn.Module, train: list[torch.Tensor], *, optimizer: str, device: str, gpus: int,
                shard: str) -> dict[str, Any]:
    """A rank's weights, gradients, optimizer state and temporaries, and what it holds besides
    during the forward and backward (Note [A sharded step])."""
    n = gpus if shard == "fsdp" else 1
    local = {id(p): _shard_bytes(p, n) for p in model.parameters()}
    trainable = {id(p) for p in train}
    weights = sum(local.values()) + sum(_nbytes(b) for b in model.buffers())
    grads = sum(local[i] for i in trainable)
    largest = max(local[i] for i in trainable)
    gathered = 0
    if shard == "fsdp" and n > 1:
        blocks = _blocks(model)
        in_blocks = {id(p) for block in blocks for p in block.parameters()}
        root = [p for p in model.parameters() if id(p) not in in_blocks]
        full = lambda ps: sum(_nbytes(p) for p in ps)  # noqa: E731
        trained = lambda ps: [p for p in ps if id(p) in trainable]  # noqa: E731
        biggest = max(blocks, key=lambda b: full(b.parameters()), default=None)
        gathered = (full(root) + full(trained(root))
                    + (2 * full(biggest.parameters()) + full(trained(biggest.parameters())) if biggest else 0))
    elif shard == "none" and gpus > 1:
        gathered = grads
    return dict(weights=weights, grads=grads, states=OPTIMIZER_STATES[optimizer] * grads,
                temporaries=0 if optimizer == "none" else grads if device == "cuda" else 2 * largest,
                ranks=gpus, shard=shard, gathered=gathered)


def _shard_bytes(p: torch.Tensor, ranks: int) -> int:
    """One rank's bytes of a parameter FSDP2 shards on dimension 0 (padded to a multiple of the ranks)."""
    if ranks == 1 or p.dim() == 0:
        return _nbytes(p)
    rows = -(-p.shape[0] // ranks)
    return rows * (p.numel() // max(1, p.shape[0])) * p.element_size()


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks FSDP2 is applied to one by one: the children of every stack of repeated blocks."""
    from passes.regions import block_stacks

    return [child for name in block_stacks(model) for child in model.get_submodule(name).children()]


@dataclass(frozen=True)
class _Step:
    """A step's bytes besides the plan's (Note [What fit adds to the plan]), and the device's speeds."""

    weights: int
    grads: int
    states: int
    temporaries: int
    batch: int
    seq: int | None = None
    """The traced sequence length, where fit was asked for the longest (`seq_dim`)."""
    trainable_share: float = 1.0
    """Trainable parameters over all parameters."""
    frozen_fp32: int = 0
    """Bytes of the fp32 parameters that are not trained (what a bf16 base halves)."""
    weights_4bit: int = 0
    """What the weights and buffers would take with the frozen base in 4 bits (--dtype nf4)."""
    ranks: int = 1
    """GPUs the step runs on; above 1, the bytes above are one rank's."""
    shard: str = "none"
    """How the ranks hold the model: "fsdp" (FSDP2, fully_shard per block and at the root) or
    "none" (each rank a replica, as under DDP)."""
    gathered: int = 0
    """What a rank holds besides during the forward and backward: under FSDP2 the unsharded
    parameters and gradients (Note [A sharded step]); under DDP its gradient buckets."""
    grad_accum: int = 1
    """Micro-batches per optimizer step: from the second on, the accumulated gradients are held
    through the forward and backward."""
    on_ranks: Callable[[int], _Step] | None = field(default=None, compare=False, repr=False)
    """The same step on another number of GPUs."""
    flops_per_second: float = 4e14
    bandwidth: float = 50 * 2**30
    """Bytes per second of a copy to host memory and back."""


@dataclass(frozen=True)
class _Traced:
    """One policy's plans, its step's FLOPs, and per plan (by id) the symbols of the batch."""

    policy: str
    text: str | None
    """The policy as enable and the backend take it (FitRow.policy_text)."""
    plans: tuple[Plan, ...]
    step_flops: int
    batch_symbols: dict[int, tuple[str, ...]]
    memory: int | None = None
    """The memory size a budget:fit policy was made for; None for the others."""
    seq_symbols: dict[int, tuple[str, ...]] | None = None
    """Per plan (by id), the size symbols that stand for the sequence length, where asked."""
    cuts: tuple[_Cut, ...] = ()
    """Where the step was planned on the model cut to a few of its alike blocks (Note [Planning
    from a few alike blocks]): the cuts' plans, every figure extrapolated to `blocks`; `plans` is
    then empty."""
    blocks: int = 0
    """The blocks of the whole model's stack, where `cuts` are given."""
    _planned: dict[tuple[int, int | None, int], int] = field(default_factory=dict, repr=False, compare=False)
    """The plans' peak per (batch, sequence, gradient shards) evaluated so far (each is a walk
    over the graphs)."""

    def peak_at(self, step: _Step, batch: int, seq: int | None = None) -> int:
        return max(self._phases(step, batch, seq))

    def _total(self, of: Callable[[Plan], float]) -> float:
        """The sum of `of` over the step's plans (extrapolated from the cuts where planned so)."""
        if not self.cuts:
            return sum(of(p) for p in self.plans)
        return _extrapolated([(c.blocks, sum(of(p) for p in c.plans)) for c in self.cuts], self.blocks)

    def _at(self, plans: Sequence[Plan], batch: int, seq: int | None, shards: int) -> list[Plan]:
        at = []
        for p in plans:
            sizes = {s: batch for s in self.batch_symbols.get(id(p), ())}
            if seq is not None and self.seq_symbols:
                sizes.update({s: seq for s in self.seq_symbols.get(id(p), ())})
            at.append(p.at(**sizes, gradient_shards=shards))
        return at

    def _phases(self, step: _Step, batch: int, seq: int | None = None) -> tuple[int, int]:
        """(peak of the forward and backward, peak of optimizer.step()) with the step's other bytes,
        at `batch` and (where the sequence was traced as dynamic) `seq`."""
        shards = step.ranks if step.shard == "fsdp" else 1
        if (batch, seq, shards) not in self._planned:
            if self.cuts:
                at = _extrapolated_figures([(c.blocks, self._at(c.plans, batch, seq, shards)) for c in self.cuts],
                                           self.blocks)
            else:
                at = self._at(self.plans, batch, seq, shards)
            self._planned[batch, seq, shards] = step_peak_bytes(at)
        held = step.grads if step.grad_accum > 1 else 0  # gradients accumulated by the earlier micro-batches
        return (step.weights + step.states + step.gathered + held + self._planned[batch, seq, shards],
                step.weights + step.grads + step.states + step.temporaries)

    def row(self, step: _Step, limit: int) -> FitRow:
        passes, optimizer = self._phases(step, step.batch)
        peak = max(passes, optimizer)
        recompute_flops = self._total(lambda p: p.recompute_flops)
        flops = self.step_flops + recompute_flops
        return FitRow(
            policy=self.policy,
            policy_text=self.text,
            peak_bytes=peak,
            peak_in="forward/backward" if passes >= optimizer else "optimizer step",
            weights_bytes=step.weights,
            grads_bytes=step.grads,
            optimizer_bytes=step.states,
            optimizer_temporary_bytes=step.temporaries,
            gathered_bytes=step.gathered,
            activations_bytes=max(0, passes - step.weights - step.states - step.grads - step.gathered),
            offloaded_bytes=round(self._total(lambda p: p.offloaded_bytes)),
            compute_s=flops / step.flops_per_second,
            copy_s=self._total(lambda p: copy_seconds(p, flops_per_second=step.flops_per_second,
                                                      bandwidth=step.bandwidth)),
            recompute_flops_fraction=recompute_flops / self.step_flops if self.step_flops else 0.0,
            recomputed_ops=round(self._total(lambda p: len(p.recomputed))),
            max_batch=_largest(lambda b: self.peak_at(step, b), limit, step.batch,
                               dynamic=any(self.batch_symbols.values())),
            min_gpus=None if step.shard != "fsdp" or step.on_ranks is None else _fewest(
                lambda k: self.peak_at(step.on_ranks(k), step.batch), limit),
            max_seq=None if step.seq is None else _largest(
                lambda s: self.peak_at(step, step.batch, s), limit, step.seq, dynamic=any(self.seq_symbols.values())),
            fits=peak <= limit,
        )


# Note [Planning from a few alike blocks]
# A model's blocks are mostly alike (one class, the same parameter shapes), and under a policy
# that treats each block alike (none, blocks, offload, selective) every figure of a plan grows by
# the same amount per block: the saved values, the recompute, the gradients, the peaks of the
# forward and of the backward. So fit traces and plans the model cut to CUT_BLOCKS[0], [1] and
# [2] of its blocks (the stack's list shortened, the config's layer count with it) and
# extrapolates each figure along the line through the last two cuts; the first cut checks that
# the figures lie on a line (LINEAR_SLACK), else the whole model is planned. Three small traces
# take seconds where one of 32 or 80 blocks takes minutes. The forward's and the backward's peaks
# are extrapolated apart, so a step's peak that moves from one to the other past the cuts is
# found; one that moves within the backward (at its start while the saved activations outweigh
# the gradients it makes, at its end beyond the cuts) is not. Policies whose choice depends on the
# whole stack (sqrt, segments, every Nth block, a budget, a function) and stacks whose blocks
# differ (Gemma's sliding and global attention layers, per-layer types) are planned whole;
# `every_block=True` asks for that always.
CUT_BLOCKS = (2, 3, 4)
"""The cuts' block counts (consecutive: each figure's step per block is read off the last two)."""
LINEAR_SLACK = 1e-3
"""How far from the line through the last two cuts (a share of the figure) the first cut may lie."""
_FIGURES = ("forward_peak_bytes", "backward_peak_bytes", "forward_end_bytes", "gradient_bytes")
"""The figures of a plan a step's peak is made of (step_peak_bytes)."""


@dataclass(frozen=True)
class _Cut:
    """A policy's plans and step FLOPs on the model cut to `blocks` of its stack's blocks."""

    blocks: int
    plans: tuple[Plan, ...]
    step_flops: int


@dataclass(frozen=True)
class _Figures:
    """A plan's figures extrapolated to the whole stack (what step_peak_bytes reads of a Plan)."""

    forward_peak_bytes: int
    backward_peak_bytes: int
    forward_end_bytes: int
    gradient_bytes: int


def _extrapolated(points: Sequence[tuple[int, float]], blocks: int) -> float:
    """The value at `blocks` on the line through the last two (block count, value) points."""
    (k1, v1), (k2, v2) = points[-2:]
    return v2 + (blocks - k2) * (v2 - v1) / (k2 - k1)


def _extrapolated_figures(cuts: Sequence[tuple[int, Sequence[Plan]]], blocks: int) -> list[_Figures]:
    return [_Figures(**{f: round(_extrapolated([(k, getattr(plans[i], f)) for k, plans in cuts], blocks))
                        for f in _FIGURES})
            for i in range(len(cuts[0][1]))]


def _on_a_line(points: Sequence[tuple[int, float]]) -> bool:
    """Whether the first point lies on the line through the others (within LINEAR_SLACK)."""
    (k0, v0) = points[0]
    expected = _extrapolated(points[1:], k0)
    return abs(v0 - expected) <= LINEAR_SLACK * max(abs(v0), abs(expected), 1.0)


def _alike_per_block(policy: policy_forms.Policy) -> bool:
    """A policy that treats every block of a stack of alike blocks alike, whatever the stack's
    length (Note [Planning from a few alike blocks]): the built-in factories say so themselves."""
    return bool(getattr(policy, "alike_per_block", False))


def _alike_stack(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's one outermost stack of blocks where its blocks are alike and many enough to
    cut (one class, the same parameter and buffer shapes, dtypes and requires_grad; no per-layer
    types in the config); None otherwise."""
    from passes.regions import block_stacks

    stacks = block_stacks(model)
    outer = [s for s in stacks if not any(s.startswith(f"{o}.") for o in stacks if o and o != s)]
    if len(outer) != 1:
        return None
    stack = model.get_submodule(outer[0])
    if not isinstance(stack, torch.nn.ModuleList) or len(stack) < CUT_BLOCKS[-1] + 2:
        return None
    layer_types = getattr(getattr(model, "config", None), "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and len(set(layer_types)) > 1:
        return None

    def signature(block: torch.nn.Module) -> tuple:
        return (type(block),
                tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()),
                tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()))

    first = signature(stack[0])
    return stack if all(signature(b) == first for b in stack) else None


@contextlib.contextmanager
def _cut(model: torch.nn.Module, stack: torch.nn.ModuleList, blocks: int):
    """The model with its stack cut to its first `blocks` blocks (and its config's layer count, which
    transformers' models loop over), as it was afterwards."""
    config = getattr(model, "config", None)
    counts = {key: getattr(config, key) for key in ("num_hidden_layers", "n_layer", "num_layers")
              if getattr(config, key, None) == len(stack)}
    rest = list(stack[blocks:])
    del stack[blocks:]
    for key in counts:
        setattr(config, key, blocks)
    try:
        yield
    finally:
        stack.extend(rest)
        for key, value in counts.items():
            setattr(config, key, value)


def _from_cuts(model: torch.nn.Module, stack: torch.nn.ModuleList, plan: Callable[[torch.nn.Module], list],
               names: list[tuple[str, str | None]], memories: list[int | None], batch: int,
               seq: int | None) -> list[_Traced] | None:
    """Each policy's _Traced planned on the model cut to CUT_BLOCKS of `stack`'s blocks, or None
    where a figure does not grow along a line with the blocks (the whole model is planned then)."""
    planned = {}
    for k in CUT_BLOCKS:
        with _cut(model, stack, k):
            planned[k] = plan(model)
    traced = []
    for i, ((shown, text), memory) in enumerate(zip(names, memories)):
        cuts = tuple(_Cut(k, tuple(planned[k][i][0]), planned[k][i][1]) for k in CUT_BLOCKS)
        if len({len(c.plans) for c in cuts}) != 1:
            return None
        points = [[(c.blocks, getattr(c.plans[g], f)) for c in cuts] for g in range(len(cuts[0].plans))
                  for f in _FIGURES]
        points += [[(c.blocks, c.step_flops) for c in cuts],
                   [(c.blocks, sum(p.recompute_flops for p in c.plans)) for c in cuts]]
        if not all(_on_a_line(p) for p in points):
            return None
        plans = [p for c in cuts for p in c.plans]
        traced.append(_Traced(shown, text, (), round(_extrapolated([(c.blocks, c.step_flops) for c in cuts],
                                                                   len(stack))),
                              _batch_symbols(plans, batch), memory,
                              _batch_symbols(plans, seq) if seq is not None else None, cuts=cuts, blocks=len(stack)))
    return traced


def measured_step_peak(model: torch.nn.Module, args: tuple, kwargs: dict, *, policy: str, precision: str) -> int:
    """Bytes live at the peak of a real training step on the CPU, what fit() predicts: what exists
    before it (weights, buffers, AdamW's state) plus the peak the step allocates above that
    (ckpt_fx.measure.peak_bytes); the model (a copy) compiled with `policy` under the eager inner
    compiler, `precision` "fp32" or "bf16-mixed" (CPU autocast). The model's outputs are held
    until the backward ends, and a chunked head's logits are not returned, as fit() assumes (as
    enable runs a training call with labels)."""
    model = copy.deepcopy(model).train()
    compiled = torch.compile(model, backend="ckpt", options={"policy": policy, "compiler": "eager", "logits": "drop"})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()

    def step() -> None:  # outputs held through the backward, as in `outputs = model(**batch); outputs.loss.backward()`
        with cast:
            outputs = compiled(*args, **kwargs)
        training_loss(outputs).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # compiles, and allocates the optimizer's state
    before = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
              for t in [*model.parameters(), *model.buffers(),
                        *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))]}
    return sum(before.values()) + peak_bytes(step)


LORA_KEYS = {"r": "r", "alpha": "lora_alpha", "lora_alpha": "lora_alpha", "dropout": "lora_dropout",
             "lora_dropout": "lora_dropout", "target_modules": "target_modules"}
"""--lora's keys (peft's LoraConfig names, and r, alpha, dropout for short) to LoraConfig's."""
LORA_FORM = ("r=N[,alpha=M][,dropout=P][,target_modules=all-linear|NAME|[NAME,NAME,...]] "
             "(peft's names lora_alpha and lora_dropout too)")


def parse_lora(text: str) -> dict[str, Any]:
    """--lora's text to keyword arguments of with_lora, e.g. 'r=16,alpha=32,dropout=0.05,
    target_modules=all-linear' or 'r=8,target_modules=[q_proj,v_proj]'."""
    items, depth, current = [], 0, ""
    for ch in text:  # split on commas outside brackets
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    items.append(current)
    out: dict[str, Any] = {}
    for item in filter(None, (t.strip() for t in items)):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in LORA_KEYS or not value:
            raise ValueError(f"--lora: cannot read {item!r}; expected {LORA_FORM}")
        name = LORA_KEYS[key]
        if name in out:
            raise ValueError(f"--lora: {key} given twice in {text!r}")
        if name == "r" or name == "lora_alpha":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"--lora: {key} must be a whole number >= 1, got {value!r}")
            out[name] = int(value)
        elif name == "lora_dropout":
            try:
                probability: float | None = float(value)
            except ValueError:
                probability = None
            if probability is None or not 0 <= probability < 1:
                raise ValueError(f"--lora: {key} must be a probability in [0, 1), got {value!r}")
            out[name] = probability
        else:
            names = value[1:-1].split(",") if value.startswith("[") and value.endswith("]") else [value]
            names = [n.strip() for n in names if n.strip()]
            if not names or "[" in value[1:] or "]" in value[:-1]:
                raise ValueError(f"--lora: target_modules must be all-linear, a module name or [NAME,NAME,...], "
                                 f"got {value!r}")
            out[name] = names[0] if value == names[0] else names
    if "r" not in out:
        raise ValueError(f"--lora: the rank r=N is required, got {text!r}; expected {LORA_FORM}")
    return out


def with_lora(model: torch.nn.Module, *, r: int, lora_alpha: int | None = None, lora_dropout: float = 0.0,
              target_modules: str | list[str] | None = None, alpha: int | None = None) -> torch.nn.Module:
    """`model` with peft's LoRA adapters of rank r, the base frozen: on `target_modules` (peft's
    forms: "all-linear", a name, or a list of names; default peft's targets for the model's type),
    `lora_alpha` (default 2r; `alpha` is the same) and `lora_dropout` (default 0). Needs peft
    (pip install peft)."""
    try:
        import peft
    except ImportError:
        raise ImportError("LoRA planning needs peft: pip install peft (or the project's [test] extra)") from None
    try:
        config = peft.LoraConfig(r=r, lora_alpha=lora_alpha or alpha or 2 * r, lora_dropout=lora_dropout,
                                 target_modules=target_modules)
        with warnings.catch_warnings():
            # peft asks transformers under a name transformers 5 deprecates (is_gradient_checkpointing):
            # theirs to change, not the user's.
            warnings.simplefilter("ignore", FutureWarning)
            return peft.get_peft_model(model, config)
    except ValueError as error:
        raise ValueError(f"--lora: peft could not add adapters to {type(model).__name__}: {error}") from None


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def _fake(mode, x: Any) -> Any:
    """A fake CPU tensor for an input: meta tensors (shapes only) become CPU fakes."""
    if isinstance(x, FakeTensor) or not isinstance(x, torch.Tensor):
        return x
    if x.is_meta:
        return FakeTensor(mode, x, torch.device("cpu"))
    return mode.from_tensor(x)


def _on_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _meta_to_fake(model: torch.nn.Module, mode) -> torch.nn.Module:
    """Swap a meta-device module's parameters and buffers for fake CPU tensors of the same shapes
    and dtypes, in place (shared parameters stay shared). CPU, so that CPU autocast applies."""
    swapped: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(p) not in swapped:
                swapped[id(p)] = torch.nn.Parameter(_fake(mode, p.detach()), requires_grad=p.requires_grad)
            setattr(module, name, swapped[id(p)])
        for name, b in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            swapped.setdefault(id(b), _fake(mode, b))
            setattr(module, name, swapped[id(b)])  # a buffer stays a buffer, persistent or not
    return model


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _mark_seq(args: Any, kwargs: Any, seq_dim: int, batch: int) -> int:
    """Mark dimension `seq_dim` of every tensor input that has it dynamic; returns the sequence
    length. It must differ from the batch: torch gives equal sizes one symbol, and the two could
    not then be told apart."""
    return _mark_dimension(args, kwargs, seq_dim, "seq_dim", "the sequence length", lambda seq: (
        f"fit: to find the longest sequence, trace one of at least 2 that differs from the batch (got sequence "
        f"{seq}, batch {batch}): torch gives equal sizes one symbol" if seq < 2 or seq == batch else None))


def _mark_batch(args: Any, kwargs: Any, batch_dim: int) -> int:
    """Mark dimension `batch_dim` of every tensor input dynamic; returns the batch size."""
    return _mark_dimension(args, kwargs, batch_dim, "batch_dim", "the batch", lambda batch: (
        "fit: trace with a batch of at least 2 (torch specialises a dimension of size 1, so the plan could not be "
        "evaluated at other batch sizes)" if batch < 2 else None))


def _mark_dimension(args: Any, kwargs: Any, dim: int, option: str, what: str,
                    refused: Callable[[int], str | None]) -> int:
    """Mark dimension `dim` of every tensor input that has it dynamic, once every such input has
    the same size there and `refused(size)` names no reason against it; returns the size."""
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.dim() > dim]
    if not tensors:
        raise ValueError(f"fit: no input tensor has a dimension {dim} ({option}) to scale")
    size = tensors[0].shape[dim]
    if any(t.shape[dim] != size for t in tensors):
        raise ValueError(f"fit: inputs disagree on {what} (dimension {dim}): {sorted({t.shape[dim] for t in tensors})}")
    reason = refused(size)
    if reason is not None:
        raise ValueError(reason)
    for t in tensors:
        mark_dynamic(t, dim)
    return size


def _plan(model: torch.nn.Module, *, args: Any, kwargs: Any, policies: list[policy_forms.Policy],
          precision: str, lenient: list[policy_forms.Policy], device: str = "cuda",
          progress: bool = False) -> list[tuple[list[Plan], int]]:
    """Trace one training step on fake tensors and plan it with each policy; per policy, its plans
    and the step's FLOPs. The step is traced once: each joint graph AOTAutograd hands to the first
    policy's backend is copied to every other policy's first. A policy in `lenient` (a budget at
    the cap) plans its lowest where no plan reaches it, quietly (its row shows it does not fit);
    the others raise. `progress`: a bar on stderr, one step per policy and graph."""
    # The head chunked and the logits of a training call with labels dropped, as enable does (Note
    # [Logits in training calls] in ckpt_fx/in_place.py).
    backends = [CkptBackend(Options(policy=p, compiler="eager", strict=p not in lenient, logits="drop", progress=False), device=device,
                            count_runs=k == 0) for k, p in enumerate(policies)]
    first = backends[0]
    bar = _bar(len(backends)) if progress else None

    def partition(backend: CkptBackend, joint: torch.fx.GraphModule, joint_inputs: Any, kw: dict[str, Any]):
        if bar is not None:
            bar.set_postfix_str(policy_forms.policy_name(backend.options.policy)[:40])
        planned = backend.partition(joint, joint_inputs, **kw)
        if bar is not None:
            bar.update(1)
        return planned

    def plan_others(joint: torch.fx.GraphModule, joint_inputs: Any, kw: dict[str, Any]) -> None:
        copies = [copy_graph_module(joint) for _ in backends[1:]]  # before any pass changes the joint graph
        if bar is not None:
            bar.total += len(backends) if bar.n else 0  # a graph break: another round of policies
        for backend, joint_copy in zip(backends[1:], copies):
            backend.head_report = first.head_report  # the graph the first backend's head pass rewrote: its heads
            partition(backend, joint_copy, joint_inputs, kw)

    first.on_joint.append(plan_others)
    first.on_partitioned.append(lambda done: bar.update(1) if bar is not None else None)
    for p in model.parameters():
        p.grad = None
    compiled = torch.compile(_fresh_function(lambda *a, **k: model(*a, **k)), backend=first)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()
    with cast, warnings.catch_warnings():
        warnings.simplefilter("ignore", BudgetWarning)  # budget:fit's row says what it reaches
        loss = training_loss(compiled(*args, **kwargs))
        loss.backward()
    if bar is not None:
        bar.close()
    for p in model.parameters():
        p.grad = None
    out = []
    for policy, backend in zip(policies, backends):
        if not backend.plans:
            raise RuntimeError(f"fit: {policy_forms.policy_name(policy)} planned no graph (see the warning above)")
        # Every policy's graphs are the first's, planned in the same order: they ran as the first's did.
        runs = first.runs if len(backend.plans) == len(first.plans) else range(len(backend.plans))
        out.append(([backend.plans[i] for i in runs], sum(backend.plans[i].step_flops for i in runs)))
    return out


def _bar(total: int):
    """A progress bar on stderr over the policies' plans, with elapsed time and what is left."""
    from tqdm import tqdm

    return tqdm(total=total, unit="plan", file=sys.stderr, dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} plans [{elapsed} elapsed, {remaining} left]{postfix}")


def _batch_symbols(plans: list[Plan], batch: int) -> dict[int, tuple[str, ...]]:
    """Per plan (by id), the size symbols that stand for the batch (their hint is the batch)."""
    return {id(p): tuple(s for s, hint in p.symbols.items() if hint == batch) for p in plans}


def _largest(peak_at: Callable[[int], int], limit: int, batch: int, *, dynamic: bool) -> int:
    """The largest batch b >= 1 with peak_at(b) <= limit, 0 if none (peaks grow with the batch).
    Until a batch too large is found, each probe is where the line through the two largest that
    fit (or through a zero peak at 0 and the one) crosses the limit (a step's peak is close to
    affine in the batch); then it is where the line through the bracket's ends does, the end kept
    twice in a row weighted down (the Illinois rule: the sequence's peaks, convex in it, would
    move one end only). Each evaluation is a walk over the step's graphs, so the search asks for
    as few as the peaks' shape allows."""
    if not dynamic:
        return batch if peak_at(batch) <= limit else 0
    fits: dict[int, float] = {}  # batch -> its peak less the limit (<= 0)
    low, over = 0, 0.0
    high, under = MAX_BATCH + 1, 0.0  # the smallest batch known not to fit (past MAX_BATCH: none yet)
    kept = 0  # the end the last probe kept (1: high, -1: low); kept twice running, its excess is halved

    def probe(b: int) -> None:
        nonlocal low, high, over, under, kept
        excess = peak_at(b) - limit
        if excess <= 0:
            fits[b], low, over = excess, b, excess
            under, kept = (under / 2, 1) if kept == 1 else (under, 1)
        else:
            high, under = b, excess
            over, kept = (over / 2, -1) if kept == -1 else (over, -1)

    probe(1)
    if low == 0:
        return 0
    if 1 < batch <= MAX_BATCH:
        probe(batch)
    while high - low > 1:
        if high > MAX_BATCH:
            (b0, e0), (b1, e1) = sorted(fits.items())[-2:] if len(fits) > 1 else ((0, -limit), (low, over))
            guess = MAX_BATCH if e1 <= e0 else b1 + math.floor(-e1 * (b1 - b0) / (e1 - e0))
        else:
            guess = low + math.floor(-over * (high - low) / (under - over))
        probe(min(max(guess, low + 1), high - 1))
    return low


MAX_BATCH = 2**20
"""The largest batch fit looks for."""
MAX_GPUS = 1024
"""The most GPUs fit looks for."""


def _fewest(peak_on: Callable[[int], int], limit: int) -> int:
    """The fewest GPUs k >= 1 with peak_on(k) <= limit (a rank's peak falls as they grow), 0 if
    none up to MAX_GPUS."""
    if peak_on(1) <= limit:
        return 1
    low, high = 1, 2
    while peak_on(high) > limit:
        if high >= MAX_GPUS:
            return 0
        low, high = high, min(2 * high, MAX_GPUS)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if peak_on(middle) <= limit else (middle, high)
    return high
