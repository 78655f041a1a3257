"""Checkpoint policies: callables `policy(node_info) -> CheckpointPolicy`, and their string forms.

    blocks(every=1, skip_first=1)   "blocks", "blocks:4", "blocks:every=2,skip_first=0"
    segments(size, skip_first=0)    "segments:4"
    sqrt(skip_first=0)              "sqrt"
    none()                          "none"
    graph()                         "graph"
    budget(0.3), budget("2GiB")     "budget:0.3", "budget:2GiB"
    selective(save=...)             "selective"
    only_in(patterns, policy)       checkpoint only inside module paths matching the patterns

A checkpointed unit (a block, or a segment of consecutive blocks) saves only what leaves it (its
output, which is the next unit's input) and recomputes its insides in the backward. Embeddings and
anything outside the stacks of repeated blocks are never recomputed by these policies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

from passes._compat import CheckpointPolicy
from passes.policy import BudgetSpec, NamedPolicy, NodeInfo, Policy, matches_path, uses_blocks
from passes.regions import Block, RegionKind
from passes.sizes import UNITS, parse_size
from passes.solve import NODE_LIMIT

__all__ = ["CheckpointPolicy", "NodeInfo", "Policy", "blocks", "budget", "graph", "none", "selective", "only_in", "parse", "segments", "sqrt"]

SAVE = CheckpointPolicy.PREFER_SAVE
BOUNDARY = CheckpointPolicy.MUST_SAVE
RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE

FORMS = (
    '"blocks"',
    '"blocks:N"',
    '"blocks:every=N,skip_first=K"',
    '"segments:N"',
    '"segments:size=N,skip_first=K"',
    '"sqrt"',
    '"none"',
    '"graph"',
    '"budget:0.3"',
    '"budget:2GiB"',
    '"budget:0.3,costs=measured"',
    '"selective"',
    '"selective:skip_first=K"',
    "a callable (node_info) -> CheckpointPolicy",
)


def _int(name: str, value: object, *, minimum: int, factory: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{factory}: {name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{factory}: {name} must be >= {minimum}, got {value}")
    return value


def _named(policy: Policy, spec: str, *, uses_blocks: bool = True, patterns: tuple[str, ...] = ()) -> NamedPolicy:
    return NamedPolicy(decide=policy, spec=spec, uses_blocks=uses_blocks, patterns=patterns)


def _units(unit_of: Callable[[Block], Hashable | None]) -> Callable[[NodeInfo], CheckpointPolicy]:
    """A policy that recomputes the insides of every unit for which unit_of returns a key."""

    def policy(info: NodeInfo) -> CheckpointPolicy:
        if info.region != RegionKind.BLOCK or info.block is None:
            return SAVE
        unit = unit_of(info.block)
        if unit is None:
            return SAVE
        for user in info.user_blocks:
            if user is None or unit_of(user) != unit:
                return BOUNDARY  # leaves the unit: the next unit's input
        return RECOMPUTE

    return policy


def _skipped(block: Block, skip_first: int) -> bool:
    """One of the first skip_first units, and not a heavy one (Note [What skip_first skips])."""
    return block.number < skip_first and not block.heavy


def blocks(*, every: int = 1, skip_first: int = 1) -> Policy:
    """Checkpoint block i when i % every == 0, except the first skip_first blocks (i counts all
    blocks from 0).

    every=1 checkpoints every block after the first skip_first; every=4 is the familiar
    `if i > 0 and i % 4 == 0: checkpoint(layer)` loop. A skipped block that computes more than
    twice the median block's activations (a vision model's first stage, at full resolution) is
    checkpointed all the same (Note [What skip_first skips] in passes/regions.py).
    """
    every = _int("every", every, minimum=1, factory="blocks")
    skip_first = _int("skip_first", skip_first, minimum=0, factory="blocks")

    def unit_of(block: Block) -> Hashable | None:
        i = block.number
        return i if not _skipped(block, skip_first) and i % every == 0 else None

    return _named(_units(unit_of), f"blocks(every={every}, skip_first={skip_first})")


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

    return _named(_units(unit_of), f"segments(size={size}, skip_first={skip_first})")


def sqrt(*, skip_first: int = 0) -> Policy:
    """Segments of about sqrt(L) blocks, L being the length of each stack (Chen et al. 2016)."""
    skip_first = _int("skip_first", skip_first, minimum=0, factory="sqrt")

    def unit_of(block: Block) -> Hashable | None:
        if _skipped(block, skip_first):
            return None
        size = max(1, round(math.sqrt(block.stack_len)))
        return (block.stack, (block.index - min(skip_first, block.index)) // size)

    return _named(_units(unit_of), f"sqrt(skip_first={skip_first})")


def none() -> Policy:
    """No checkpointing: save what the backward needs, as AOTAutograd's default partition does."""

    def policy(info: NodeInfo) -> CheckpointPolicy:
        return SAVE

    return _named(policy, "none()", uses_blocks=False)


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


# Op classes selective() saves by name: aten overload packets, matched on the producing op.
OP_CLASSES = {
    "matmul": ("aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten._int_mm"),
    "conv": ("aten.convolution", "aten.cudnn_convolution", "aten.mkldnn_convolution", "aten._convolution"),
    "attention": (
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention",
        "aten._scaled_dot_product_fused_attention_overrideable",
        "aten._flash_attention_forward",
        "aten._efficient_attention_forward",
    ),
}


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
    ops: set[str] = set()
    patterns = []
    for item in save:
        if item in OP_CLASSES:
            ops.update(OP_CLASSES[item])
        elif item.startswith("aten."):
            ops.add(item)
        else:
            patterns.append(item)

    def kept(info: NodeInfo) -> bool:
        source = info.producer or info.op
        packet = source.rsplit(".", 1)[0] if source.count(".") >= 2 else source
        return packet in ops or matches_path(info.module_path, patterns)

    def policy(info: NodeInfo) -> CheckpointPolicy:
        if info.region != RegionKind.BLOCK or info.block is None or _skipped(info.block, skip_first):
            return SAVE
        for user in info.user_blocks:
            if user is None or user != info.block:
                return BOUNDARY
        return BOUNDARY if kept(info) else RECOMPUTE

    shown = ", ".join(repr(x) for x in save)
    return _named(policy, f"selective(save=({shown}), skip_first={skip_first})")


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


def budget(limit: float | str, *, solver: str = "auto", node_limit: int = NODE_LIMIT, costs: str = "roofline") -> BudgetSpec:
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
    """
    from passes.solve import SOLVERS

    fraction, nbytes = _budget_value(limit)
    if solver != "auto" and solver not in SOLVERS:
        raise ValueError(f"budget: unknown solver {solver!r}; valid: auto, {', '.join(SOLVERS)}")
    if isinstance(node_limit, bool) or not isinstance(node_limit, int) or node_limit < 1:
        raise ValueError(f"budget: node_limit must be a whole number >= 1, got {node_limit!r}")
    if costs not in COSTS:
        raise ValueError(f"budget: unknown costs {costs!r}; valid: {', '.join(COSTS)}")
    shown = f"{fraction:g}" if fraction is not None else f"{limit.strip()!r}"  # type: ignore[union-attr]
    extra = ("" if solver == "auto" else f", solver={solver!r}") + ("" if costs == "roofline" else f", costs={costs!r}")
    return BudgetSpec(spec=f"budget({shown}{extra})", fraction=fraction, nbytes=nbytes, shown=shown, solver=solver,
                      node_limit=node_limit, costs=costs)


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


def _kwargs(factory: str, text: str, positional: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        key, value = (key.strip(), value.strip()) if eq else (positional, key.strip())
        try:
            out[key] = int(value)
        except ValueError:
            raise ValueError(f"policy {factory!r}: {key}={value!r} is not an integer") from None
    return out


def parse(spec: str | Policy | None) -> Policy:
    """A policy from a string, a callable or None (the default, "blocks").

    Raises ValueError naming the bad value and listing the valid forms.
    """
    if spec is None:
        return blocks()
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"policy must be a string or a callable, got {spec!r}; valid forms: {', '.join(FORMS)}")
    name, _, args = spec.strip().partition(":")
    name = name.strip().lower()
    if name == "budget":
        if not args.strip():
            raise ValueError(f"policy 'budget' needs a limit, e.g. \"budget:0.3\" or \"budget:2GiB\"; valid forms: {', '.join(FORMS)}")
        limit, *options = [a.strip() for a in args.split(",")]
        settings = {}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key.strip() not in ("costs", "solver"):
                raise ValueError(f"policy {spec!r}: budget takes a limit then costs=... or solver=..., got {option!r}; "
                                 f"valid forms: {', '.join(FORMS)}")
            settings[key.strip()] = value.strip()
        return budget(limit, **settings)
    factories = {"blocks": (blocks, "every"), "segments": (segments, "size"), "sqrt": (sqrt, None), "none": (none, None),
                 "graph": (graph, None), "selective": (selective, None)}
    if name not in factories:
        hint = [k for k in (*factories, "budget") if k.startswith(name[:2])] if name else []
        did = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ValueError(f"unknown policy {spec!r}{did}; valid forms: {', '.join(FORMS)}")
    factory, positional = factories[name]
    if not args:
        if name == "segments":
            raise ValueError(f"policy 'segments' needs a size, e.g. \"segments:4\"; valid forms: {', '.join(FORMS)}")
        return factory()
    if positional is None and "=" not in args:
        raise ValueError(f"policy {name!r} takes no positional argument, got {spec!r}; valid forms: {', '.join(FORMS)}")
    kwargs = _kwargs(name, args, positional or "")
    try:
        return factory(**kwargs)
    except TypeError:
        raise ValueError(f"policy {spec!r}: unknown argument in {sorted(kwargs)}; valid forms: {', '.join(FORMS)}") from None
