"""regions: map each forward node of a joint graph to its module path and to a region.

A region is an embedding, block k of a stack of repeated blocks, or other. See Note [Stacks].
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import torch

from passes._compat import is_primal, is_tangent
from passes.warn import warn_user

REGION_KEY = "ckpt_fx.region"
PATH_KEY = "ckpt_fx.module_path"

# Note [Stacks]
# A stack is a container (ModuleList, Sequential, or any module) whose children are named by
# integers and are instances of one class: HF's model.layers.N, transformer.h.N, encoder.layer.N,
# blocks.N, or a plain nn.Sequential at the top. A model may have several stacks (an encoder and a
# decoder). One member seen is enough: a graph that DDP split at a bucket boundary, or that a
# graph break cut, may hold a single block of a stack. A stack nested inside a member of another
# (experts inside a block) is not a stack of its own. Blocks are numbered by their index in the
# path, stacks following each other in the order the forward first reaches them.
# A model with no stack uses its top-level children as units, and says so once.


@dataclass(frozen=True, kw_only=True)
class Block:
    """One checkpointable unit: a member of a stack, or a top-level child when there is no stack."""

    path: str
    """Module path of the unit, e.g. "transformer.h.3"."""
    stack: str
    """Module path of the stack it belongs to ("" for the model itself)."""
    index: int
    """Position within its stack, from 0."""
    stack_len: int
    """Number of members of its stack seen in this graph."""
    number: int
    """Position among all units of the model, from 0: its index plus the lengths of the stacks
    before it in this graph."""


@dataclass(frozen=True, kw_only=True)
class Region:
    """Where a forward node belongs."""

    kind: str
    """"embedding", "block" or "other"."""
    block: Block | None = None
    """The unit, when kind is "block"."""


@dataclass(frozen=True, kw_only=True)
class RegionMap:
    """What regions_pass found in a graph."""

    blocks: tuple[Block, ...]
    """All units in forward order (Block.number indexes this tuple)."""
    stacks: tuple[str, ...]
    """Module paths of the detected stacks, in forward order."""
    top_level_units: bool
    """True when no stack was found and top-level children serve as units."""


_GETATTR = re.compile(r"getattr\(([^()]*), ['\"]([^'\"]+)['\"]\)")
_MODULES = re.compile(r"(?:^|\.)_modules\[['\"]([^'\"]+)['\"]\]")
_INDEX = re.compile(r"\[(\d+)\]")
# The frame's module: L['self'], or L['args'][0] when a decorator takes (*args, **kwargs).
_ROOT = re.compile(r"^(L\[['\"][^'\"]+['\"]\](\[\d+\])*|self)(\.|$)")


def normalize_module_path(path: str) -> str:
    """Turn a dynamo source string ("L['self'].layers[0]") into a module path ("layers.0")."""
    previous = None
    while previous != path:
        previous, path = path, _GETATTR.sub(r"\1.\2", path)
    path = _ROOT.sub("", path)
    path = _MODULES.sub(r".\1", path)
    path = _INDEX.sub(r".\1", path)
    return path.strip(".")


def module_stack(node: torch.fx.Node) -> list[tuple[str, type | str]]:
    """The (path, class) pairs enclosing a node, outermost first; empty when unknown."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for value in stack.values():
        path, cls = value if isinstance(value, tuple) else (value, "")
        out.append((normalize_module_path(str(path)), cls))
    return out


def _class_name(cls: type | str) -> str:
    return cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"


def _is_embedding(cls: type | str) -> bool:
    if isinstance(cls, type):
        return issubclass(cls, torch.nn.Embedding) or cls.__name__.endswith("Embedding")
    return str(cls).rsplit(".", 1)[-1].rstrip("'>").endswith("Embedding")


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


def regions_pass(gm: torch.fx.GraphModule, *, warn: bool = True) -> RegionMap:
    """Write a Region and a module path into node.meta of every forward node of a joint graph.

    warn=False keeps quiet when no stack is found (for policies that do not use blocks).

    Mutates node.meta only (keys REGION_KEY, PATH_KEY); keeps nodes and names; deterministic.
    """
    fwd = forward_nodes(gm.graph)
    stacks_of = {node: module_stack(node) for node in fwd}

    # Children named by integers, grouped by parent path, with their classes (Note [Stacks]).
    children: dict[str, dict[int, set[str]]] = {}
    first_seen: dict[str, int] = {}
    for order, node in enumerate(fwd):
        for path, cls in stacks_of[node]:
            parent, _, last = path.rpartition(".")
            if last.isdigit():
                children.setdefault(parent, {}).setdefault(int(last), set()).add(_class_name(cls))
                first_seen.setdefault(path, order)
    candidates = []
    for parent, members in children.items():
        classes = {c for cs in members.values() for c in cs}
        if len(classes) == 1:  # one member is enough: a graph split by DDP or a break may hold one
            candidates.append(parent)
    # Drop stacks nested inside a member of another stack.
    stacks = [s for s in candidates if not any(o != s and _inside_member(s, o) for o in candidates)]

    def unit_path(path_stack: list[tuple[str, type | str]]) -> str | None:
        for path, _ in path_stack:
            parent, _, last = path.rpartition(".")
            if last.isdigit() and parent in stacks:
                return path
        return None

    top_level = False
    if not stacks:
        tops = []
        for node in fwd:
            st = stacks_of[node]
            if st and st[0][0] and not _is_embedding(st[0][1]):
                top = st[0][0].split(".")[0]
                if top not in tops:
                    tops.append(top)
        top_level = bool(tops)
        if top_level and warn:
            warn_user(
                "ckpt_fx: no stack of repeated blocks found in this graph; using its top-level "
                f"children ({', '.join(tops)}) as checkpoint units; if each block is compiled on its own "
                "(FSDP2's fully_shard per block, torch.compile per block), use policy=\"graph\""
            )

    # Number units in forward order.
    order: list[str] = []
    unit_of: dict[torch.fx.Node, str | None] = {}
    for node in fwd:
        st = stacks_of[node]
        if top_level:
            unit = st[0][0].split(".")[0] if st and st[0][0] and not _is_embedding(st[0][1]) else None
        else:
            unit = unit_path(st)
        unit_of[node] = unit
        if unit is not None and unit not in order:
            order.append(unit)
    # A member's index comes from its path, so a graph that starts mid-stack (after a graph
    # break) still numbers its blocks as the model does.
    index_of: dict[str, int] = {}
    stack_len: dict[str, int] = {}
    for position, unit in enumerate(order):
        stack, _, last = unit.rpartition(".")
        stack = "" if top_level else stack
        index_of[unit] = position if top_level else int(last)
        stack_len[stack] = max(stack_len.get(stack, 0), index_of[unit] + 1)
    offsets: dict[str, int] = {}
    for stack in stack_len:
        offsets[stack] = sum(stack_len[s] for s in offsets)
    blocks = {}
    for unit in order:
        stack = "" if top_level else unit.rpartition(".")[0]
        blocks[unit] = Block(
            path=unit,
            stack=stack,
            index=index_of[unit],
            stack_len=stack_len[stack],
            number=offsets[stack] + index_of[unit],
        )

    for node in gm.graph.nodes:
        node.meta.pop(REGION_KEY, None)
        node.meta.pop(PATH_KEY, None)
    for node in fwd:
        st = stacks_of[node]
        node.meta[PATH_KEY] = st[-1][0] if st else ""
        if node.op == "placeholder":
            continue
        if _touches_embedding(node, st):
            region = Region(kind="embedding")
        elif unit_of[node] is not None:
            region = Region(kind="block", block=blocks[unit_of[node]])
        else:
            region = Region(kind="other")
        node.meta[REGION_KEY] = region
    return RegionMap(
        blocks=tuple(blocks[u] for u in order),
        stacks=tuple(dict.fromkeys(b.stack for b in blocks.values())) if not top_level else (),
        top_level_units=top_level,
    )


def _inside_member(inner: str, outer: str) -> bool:
    """True when stack path `inner` lies inside a numbered member of stack `outer`."""
    prefix = outer + "." if outer else ""
    if not inner.startswith(prefix):
        return False
    rest = inner[len(prefix):]
    return rest.split(".")[0].isdigit() and "." in rest


def _touches_embedding(node: torch.fx.Node, stack: list[tuple[str, type | str]]) -> bool:
    if node.target is torch.ops.aten.embedding.default:
        return True
    return bool(stack) and _is_embedding(stack[-1][1])
