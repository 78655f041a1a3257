"""Checkpoint policies: callables `policy(node_info) -> CheckpointPolicy`, and their string forms.

    blocks(every=1, skip_first=auto) "blocks", "blocks:4", "blocks:every=2,skip_first=1"
    segments(size, skip_first=0)    "segments:4"
    sqrt(skip_first=0)              "sqrt"
    none()                          "none"
    graph()                         "graph"
    blocks(offload=True)            "offload", "offload:every=2,skip_first=0"
    budget(0.3), budget("2GiB")     "budget:0.3", "budget:2GiB", "budget:20GiB,offload"
    selective(save=...)             "selective", "selective:save=matmul+attention"
    only_in(patterns, policy)       checkpoint only inside module paths matching the patterns

A checkpointed unit (a block, or a segment of consecutive blocks) saves only what leaves it (its
output, which is the next unit's input) and recomputes its insides in the backward. Embeddings and
anything outside the stacks of repeated blocks are never recomputed by these policies.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from passes._compat import CheckpointPolicy
from passes.costs import OP_CLASSES, op_class
from passes.policy import BudgetSpec, NamedPolicy, NodeInfo, Policy, matches_path, uses_blocks
from passes.regions import Block, RegionKind
from passes.sizes import UNITS, parse_size
from passes.solve import NODE_LIMIT

__all__ = ["CheckpointPolicy", "NodeInfo", "Policy", "blocks", "budget", "graph", "none", "selective", "only_in", "parse", "segments", "sqrt"]

SAVE = CheckpointPolicy.PREFER_SAVE
BOUNDARY = CheckpointPolicy.MUST_SAVE
RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE
OFFLOAD = CheckpointPolicy.MUST_CPU_OFFLOAD



def _int(name: str, value: object, *, minimum: int, factory: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{factory}: {name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{factory}: {name} must be >= {minimum}, got {value}")
    return value


def _named(policy: Policy, spec: str, *, uses_blocks: bool = True, patterns: tuple[str, ...] = (),
           alike_per_block: bool = False, whole_units: bool = False) -> NamedPolicy:
    return NamedPolicy(decide=policy, spec=spec, uses_blocks=uses_blocks, patterns=patterns,
                       alike_per_block=alike_per_block, whole_units=whole_units)


def _units(unit_of: Callable[[Block], Hashable | None], *, offload: bool = False) -> Callable[[NodeInfo], CheckpointPolicy]:
    """A policy that recomputes the insides of every unit for which unit_of returns a key;
    `offload`: what leaves such a unit is kept in host memory (Note [Offload] in passes/offload.py)."""
    boundary = OFFLOAD if offload else BOUNDARY

    def policy(info: NodeInfo) -> CheckpointPolicy:
        if info.region != RegionKind.BLOCK or info.block is None:
            return SAVE
        unit = unit_of(info.block)
        if unit is None:
            return SAVE
        for user in info.user_blocks:
            if user is None or unit_of(user) != unit:
                return boundary  # leaves the unit: the next unit's input
        return RECOMPUTE

    return policy


AUTO = "auto"


def _skipped(block: Block, skip_first: int | str) -> bool:
    """One of the first skip_first units, and not a heavy one; under skip_first="auto", a leading
    unit whose checkpointing keeps out little (Note [What skip_first skips])."""
    if skip_first == AUTO:
        return block.leading_light
    return block.number < skip_first and not block.heavy


def _skip(name: str, value: object, *, factory: str) -> int | str:
    """skip_first: "auto" or an int >= 0."""
    return AUTO if value == AUTO else _int(name, value, minimum=0, factory=factory)


def blocks(*, every: int = 1, skip_first: int | str = AUTO, offload: bool = False) -> Policy:
    """Checkpoint block i when i % every == 0, except the first skip_first blocks (i counts all
    blocks from 0); skip_first="auto" (the default) leaves whole only leading units that hold
    little (a small stem), none in a stack of alike blocks, as Hugging Face's per-block
    checkpointing recomputes every block (Note [What skip_first skips] in passes/regions.py).
    `offload=True` keeps what the checkpointed blocks save (their outputs, the next block's
    inputs) in host memory between the forward and the backward: the blocks are recomputed from
    host copies (Unsloth's recipe; Note [Offload] in passes/offload.py).

    every=4 is the familiar `if i > 0 and i % 4 == 0: checkpoint(layer)` loop with skip_first=1.
    A block skipped by count that computes more than twice the median block's activations (a
    vision model's first stage, at full resolution) is checkpointed all the same.
    """
    every = _int("every", every, minimum=1, factory="blocks")
    skip_first = _skip("skip_first", skip_first, factory="blocks")

    def unit_of(block: Block) -> Hashable | None:
        i = block.number
        return i if not _skipped(block, skip_first) and i % every == 0 else None

    if not isinstance(offload, bool):
        raise ValueError(f"blocks: offload must be True or False, got {offload!r}")
    extra = ", offload=True" if offload else ""
    # skip_first="auto" skips no block of a stack of alike blocks.
    return _named(_units(unit_of, offload=offload), f"blocks(every={every}, skip_first={skip_first}{extra})",
                  alike_per_block=every == 1 and skip_first in (AUTO, 0), whole_units=True)


def segments(*, size: int, skip_first: int = 0) -> Policy:
    """Group consecutive blocks of a stack into segments of `size`; save only each segment's input.

    32 blocks with size=4 make 8 segments. The first skip_first blocks are never recomputed.
    """
    size = _int("size", size, minimum=1, factory="segments")
    skip_first = _int("skip_first", skip_first, minimum=0, factory="segments")

    def unit_of(block: Block) -> Hashable | None:
        if _skipped(block, skip_first):
            return None
        return (block.stack, (block.index - min(skip_first, block.index)) // size)

    return _named(_units(unit_of), f"segments(size={size}, skip_first={skip_first})", whole_units=True)


def sqrt(*, skip_first: int = 0) -> Policy:
    """Segments of about sqrt(L) blocks, L being the length of each stack (Chen et al. 2016)."""
    skip_first = _int("skip_first", skip_first, minimum=0, factory="sqrt")

    def unit_of(block: Block) -> Hashable | None:
        if _skipped(block, skip_first):
            return None
        size = max(1, round(math.sqrt(block.stack_len)))
        return (block.stack, (block.index - min(skip_first, block.index)) // size)

    return _named(_units(unit_of), f"sqrt(skip_first={skip_first})", whole_units=True)


def none() -> Policy:
    """No checkpointing: save what the backward needs, as AOTAutograd's default partition does."""

    def policy(info: NodeInfo) -> CheckpointPolicy:
        return SAVE

    return _named(policy, "none()", uses_blocks=False, alike_per_block=True)


def graph() -> Policy:
    """Checkpoint each compiled graph as one unit: save its inputs, recompute the rest (embeddings
    excepted) in the backward.

    For models whose blocks are compiled one by one, so that each graph is one block: FSDP2 with
    `fully_shard` on every block (dynamo compiles each FSDP module on its own), or torch.compile
    applied per block. One compiled graph then serves every block, so `every` and `skip_first`
    cannot tell blocks apart: to leave a block out, do not compile it (per-block compile).
    """

    def policy(info: NodeInfo) -> CheckpointPolicy:
        return SAVE if info.region == RegionKind.EMBEDDING else RECOMPUTE

    return _named(policy, "graph()", uses_blocks=False)


def selective(*, save: Sequence[str] = ("matmul", "conv", "attention"), skip_first: int = 0) -> Policy:
    """Op-level recompute inside blocks (Megatron's selective recompute, JAX's dots_saveable):
    keep the outputs of expensive ops, recompute the cheap pointwise and normalisation ops.

    `save` lists op classes ("matmul", "conv", "attention"), aten op names ("aten.mm"), or module
    path patterns (fnmatch, e.g. "*.attn.c_proj"): values they produce are saved. What leaves a
    block is saved; blocks numbered below skip_first and everything outside blocks are saved.
    """
    if isinstance(save, str):
        save = (save,)
    save = tuple(save)
    if not save or not all(isinstance(x, str) and x for x in save):
        raise ValueError(f"selective: save must be a non-empty list of strings, got {save!r}; op classes: {', '.join(OP_CLASSES)}")
    skip_first = _int("skip_first", skip_first, minimum=0, factory="selective")
    for item in save:
        close = difflib.get_close_matches(item, list(OP_CLASSES), n=1, cutoff=0.75)
        if item not in OP_CLASSES and close:
            raise ValueError(f"selective: save item {item!r} is not an op class (did you mean {close[0]!r}?); op classes: "
                             f"{', '.join(OP_CLASSES)}, or aten op names (aten.mm) or module path patterns (*.mlp.*)")
        # A bare word names no op class and matches only a top-level module's exact path: a typo,
        # not a pattern (a pattern has a dot or a wildcard).
        if item not in OP_CLASSES and not item.startswith("aten.") and not any(c in item for c in ".*?["):
            raise ValueError(f"selective: save item {item!r} is not an op class; op classes: {', '.join(OP_CLASSES)}, "
                             f"or aten op names (aten.mm), or module path patterns with a dot or wildcard (*.{item}, *.mlp.*)")
        if item.startswith("aten.") and not hasattr(torch.ops.aten, item.split(".")[1]):
            raise ValueError(f"selective: save item {item!r} names no aten op (aten.mm, aten.bmm, aten.convolution, ...)")
    classes = {item for item in save if item in OP_CLASSES}
    ops = {item for item in save if item not in classes and item.startswith("aten.")}
    patterns = [item for item in save if item not in classes and item not in ops]

    def kept(info: NodeInfo) -> bool:
        source = info.producer or info.op
        packet = source.rsplit(".", 1)[0] if source.count(".") >= 2 else source
        return packet in ops or op_class(packet) in classes or matches_path(info.module_path, patterns)

    def policy(info: NodeInfo) -> CheckpointPolicy:
        if info.region != RegionKind.BLOCK or info.block is None or _skipped(info.block, skip_first):
            return SAVE
        for user in info.user_blocks:
            if user is None or user != info.block:
                return BOUNDARY
        return BOUNDARY if kept(info) else RECOMPUTE

    shown = ", ".join(repr(x) for x in save)
    return _named(policy, f"selective(save=({shown}), skip_first={skip_first})", alike_per_block=skip_first == 0)


def _budget_value(limit: float | str) -> tuple[float | None, int | None]:
    """(fraction, None) or (None, bytes) from 0.3, "0.3", "2GiB", "512MB"."""
    if isinstance(limit, bool):
        raise ValueError(f"budget: limit must be a fraction in (0, 1] or a size like '2GiB', got {limit!r}")
    if isinstance(limit, str):
        number = _number(limit)
        if number is not None:
            return _budget_value(number)
        size = parse_size(limit)
        if size is not None:
            return None, size
        if limit.strip() == "fit":
            raise ValueError("budget: 'fit' is a form fit plans (what a memory size leaves for the step); a backend "
                             "takes the budget fit recommends in bytes, e.g. 'budget:8.96GiB' (fit's report prints it "
                             "as written for enable)")
    elif isinstance(limit, (int, float)):
        if not 0 < limit <= 1:
            raise ValueError(
                f"budget: a fraction must lie in (0, 1] (of the activation memory without checkpointing), "
                f"got {limit!r}; for an absolute size write e.g. '2GiB'"
            )
        return float(limit), None
    raise ValueError(
        f"budget: cannot read {limit!r}; write a fraction in (0, 1] like 0.3, or a size like '2GiB', "
        f"'512MB' (units: {', '.join(UNITS)})"
    )


def _number(text: str) -> float | None:
    """The number a string holds ("0.3", "1e-1"), or None when it holds something else."""
    try:
        return float(text)
    except ValueError:
        return None


COSTS = ("roofline", "measured")


def budget(limit: float | str, *, solver: str = "auto", node_limit: int = NODE_LIMIT, costs: str = "roofline",
           offload: bool = False, bandwidth: float | str | None = None) -> BudgetSpec:
    """The cheapest plan whose predicted peak fits `limit`.

    `limit` is a fraction of the activation memory of the step without checkpointing (0.3 keeps
    the predicted peak at gradients + 30% of the rest), or a size for the step's predicted peak
    of the graph ("2GiB", "512MB"). Candidate plans come from passes.solve (Note [The recompute
    problem]: least recompute cost for a number of saved bytes; exact MILP within `node_limit`
    branch-and-bound nodes, the exact chain DP for chains, exact through alike blocks, greedy on large graphs;
    `solver` picks one), each one's peak is predicted from the joint graph, and the cheapest that
    fits is partitioned (Note [Peak-aware budget]). Embeddings and hard-ruled ops are never
    recomputed; what crosses a block's edge is kept.
    A limit no candidate fits raises passes.solve.Infeasible naming the smallest feasible one.
    `costs` is how a recompute is priced: "roofline" (FLOPs and bytes on the device's roofline) or
    "measured" (each distinct op timed once on random tensors of its shapes while planning).
    `offload=True` lets the plan keep saved values in host memory too: per value, save, recompute
    or offload, a copy priced by `bandwidth` (a number in GB/s, or a text like "25GB/s", "24GiB/s";
    default torch's activation_offload_cpu_gpu_bw) where compute does not hide it (Note [Offload
    in the recompute problem] in passes/solve.py). The limit is then the device's.
    """
    from passes.solve import SOLVERS

    fraction, nbytes = _budget_value(limit)
    if solver != "auto" and solver not in SOLVERS:
        raise ValueError(f"budget: unknown solver {solver!r}; valid: auto, {', '.join(SOLVERS)}")
    if isinstance(node_limit, bool) or not isinstance(node_limit, int) or node_limit < 1:
        raise ValueError(f"budget: node_limit must be a whole number >= 1, got {node_limit!r}")
    if costs not in COSTS:
        raise ValueError(f"budget: unknown costs {costs!r}; valid: {', '.join(COSTS)}")
    if not isinstance(offload, bool):
        raise ValueError(f"budget: offload must be True or False, got {offload!r}")
    if bandwidth is not None and not offload:
        raise ValueError("budget: bandwidth prices host copies; it needs offload=True (\"budget:0.3,offload,bandwidth=25GB/s\")")
    speed = parse_bandwidth(bandwidth) if bandwidth is not None else None
    shown = f"{fraction:g}" if fraction is not None else f"{limit.strip()!r}"  # type: ignore[union-attr]
    extra = ("" if solver == "auto" else f", solver={solver!r}") + ("" if costs == "roofline" else f", costs={costs!r}")
    extra += (", offload=True" if offload else "") + (f", bandwidth={bandwidth!r}" if bandwidth is not None else "")
    return BudgetSpec(spec=f"budget({shown}{extra})", fraction=fraction, nbytes=nbytes, shown=shown, solver=solver,
                      node_limit=node_limit, costs=costs, offload=offload, bandwidth=speed)


def parse_bandwidth(value: float | str) -> float:
    """Bytes per second from a number of GB/s (25 means 25e9 bytes/s) or a text such as "25GB/s",
    "24GiB/s", "25" (GB/s); ValueError naming what is allowed otherwise."""
    if isinstance(value, str):
        text = value.strip()
        number = _number(text)
        if number is not None:
            return parse_bandwidth(number)
        size = parse_size(text[:-2]) if text.lower().endswith("/s") else None
        if size is None:
            raise ValueError(f"bandwidth: cannot read {value!r}; write a number of GB/s like 25, or a rate like "
                             f"'25GB/s', '24GiB/s' (units: {', '.join(UNITS)})")
        return float(size)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(f"bandwidth: must be a finite number of GB/s > 0, or a rate like '25GB/s', got {value!r}")
    return float(value) * 1e9


def only_in(patterns: str | Sequence[str], policy: Policy | str) -> Policy:
    """Apply `policy` to nodes whose module path matches a pattern (fnmatch, e.g. "model.layers.*"),
    save everything else. A pattern also matches everything beneath the path it names."""
    if isinstance(patterns, str):
        patterns = (patterns,)
    patterns = tuple(patterns)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"only_in: patterns must be non-empty strings, got {patterns!r}")
    inner = parse(policy)
    if isinstance(inner, BudgetSpec):
        raise ValueError(
            f"only_in cannot wrap {policy_name(inner)}: a memory budget plans the whole graph at once "
            "(it would be called per node and fail); use the budget alone, or only_in with a per-node policy "
            f"such as 'blocks' or 'selective'; valid forms: {', '.join(FORMS)}"
        )

    def combined(info: NodeInfo) -> CheckpointPolicy:
        return inner(info) if matches_path(info.module_path, patterns) else SAVE

    return _named(combined, f"only_in({list(patterns)!r}, {policy_name(inner)})",
                  uses_blocks=uses_blocks(inner), patterns=patterns)  # only_in(graph): no block warning


def policy_name(policy: Policy) -> str:
    """A stable description of a policy (used in logs, plans and cache keys)."""
    if isinstance(policy, (NamedPolicy, BudgetSpec)):
        return policy.spec
    return getattr(policy, "__qualname__", None) or repr(policy)


@dataclass(frozen=True, kw_only=True)
class _Form:
    """How a policy is written as text: its factory, the keyword a bare value stands for, and the
    keywords it takes with how each is read."""

    factory: Callable[..., Policy]
    shown: str
    """The forms, e.g. '"blocks", "blocks:N", "blocks:every=N,skip_first=K"'."""
    positional: str | None = None
    keywords: dict[str, Callable[[str], object]] = field(default_factory=dict)
    required: str | None = None


def _whole(text: str) -> int:
    return int(text)


def _auto_or_whole(text: str) -> int | str:
    return AUTO if text.strip().lower() == AUTO else int(text)


def _names(text: str) -> tuple[str, ...]:
    """'matmul+attention' -> ("matmul", "attention")."""
    return tuple(x.strip() for x in text.split("+") if x.strip())


_TEXT_FORMS = {
    "blocks": _Form(factory=lambda **k: blocks(**k), positional="every", keywords={"every": _whole, "skip_first": _auto_or_whole},
                    shown='"blocks", "blocks:N", "blocks:every=N,skip_first=K|auto"'),
    "offload": _Form(factory=lambda **k: blocks(offload=True, **k), positional="every",
                     keywords={"every": _whole, "skip_first": _auto_or_whole},
                     shown='"offload", "offload:every=N,skip_first=K|auto"'),
    "segments": _Form(factory=lambda **k: segments(**k), positional="size", keywords={"size": _whole, "skip_first": _whole},
                      required="size", shown='"segments:N", "segments:size=N,skip_first=K"'),
    "sqrt": _Form(factory=lambda **k: sqrt(**k), keywords={"skip_first": _whole}, shown='"sqrt", "sqrt:skip_first=K"'),
    "none": _Form(factory=lambda: none(), shown='"none"'),
    "graph": _Form(factory=lambda: graph(), shown='"graph"'),
    "selective": _Form(factory=lambda **k: selective(**k), keywords={"save": _names, "skip_first": _whole},
                       shown='"selective", "selective:save=matmul+attention,skip_first=K" (save: op classes '
                             + ", ".join(OP_CLASSES) + ", aten op names or module path patterns, joined by +)"),
}


_BUDGET_SHOWN = ('"budget:0.3", "budget:2GiB", "budget:0.3,costs=measured|roofline,solver=auto|milp|greedy|parts", '
                 '"budget:20GiB,offload,bandwidth=25GB/s"')
FORMS = (*(form.shown for form in _TEXT_FORMS.values()), _BUDGET_SHOWN, "a callable (node_info) -> CheckpointPolicy")
"""Every way a policy is written, as error messages and the command line's help show them: a new
text form is added to _TEXT_FORMS (and the module's docstring) only."""


def _parse_budget(spec: str, args: str) -> BudgetSpec:
    shown = _BUDGET_SHOWN
    limit, *options = [a.strip() for a in args.split(",")]
    if not limit:
        raise ValueError(f"policy {spec!r}: budget needs a limit; budget is written {shown}")
    settings: dict[str, object] = {}
    for option in options:
        key, sep, value = (part.strip() for part in option.partition("="))
        if key == "offload" and not sep:
            settings["offload"] = True
        elif sep and key in ("costs", "solver", "bandwidth"):
            settings[key] = value
        else:
            raise ValueError(f"policy {spec!r}: budget takes a limit, then costs=..., solver=..., offload, bandwidth=...; "
                             f"got {option!r}; budget is written {shown}")
    try:
        return budget(limit, **settings)
    except ValueError as error:
        raise ValueError(f"policy {spec!r}: {error}; budget is written {shown}") from None


def parse(spec: str | Policy | None) -> Policy:
    """A policy from a string, a callable or None (the default, "blocks").

    Raises ValueError naming the bad value and the form it expected (or, for an unknown name,
    every valid form).
    """
    if spec is None:
        return blocks()
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"policy must be a string or a callable, got {spec!r}; valid forms: {', '.join(FORMS)}")
    name, _, args = spec.strip().partition(":")
    name, args = name.strip().lower(), args.strip()
    if name == "budget":
        return _parse_budget(spec, args)
    form = _TEXT_FORMS.get(name)
    if form is None:
        close = difflib.get_close_matches(name, [*_TEXT_FORMS, "budget"], n=1)
        did = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown policy {spec!r}{did}; policies: {', '.join([*_TEXT_FORMS, 'budget'])} "
                         f"(forms such as \"blocks:every=2\", \"budget:0.3\": README, Policies), or a callable")
    kwargs: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in args.split(","))):
        key, eq, value = (x.strip() for x in part.partition("="))
        if not eq:
            key, value = form.positional, key
            if key is None:
                raise ValueError(f"policy {spec!r}: {name} takes no bare value, got {part!r}; {name} is written {form.shown}")
        if key not in form.keywords:
            valid = ", ".join(form.keywords) or "none"
            raise ValueError(f"policy {spec!r}: {name} has no setting {key!r} (its settings: {valid}); "
                             f"{name} is written {form.shown}")
        try:
            kwargs[key] = form.keywords[key](value)
        except ValueError:
            what = {_whole: "a whole number", _auto_or_whole: "a whole number or auto"}.get(form.keywords[key], "readable")
            raise ValueError(f"policy {spec!r}: {key}={value!r} is not {what}; {name} is written {form.shown}") from None
    if form.required is not None and form.required not in kwargs:
        raise ValueError(f"policy {spec!r}: {name} needs {form.required}; {name} is written {form.shown}")
    try:
        return form.factory(**kwargs)
    except ValueError as error:
        raise ValueError(f"policy {spec!r}: {error}; {name} is written {form.shown}") from None
