"""regions: map each forward node of a joint graph to its module path and to a region.

A region is an embedding, block k of a stack of repeated blocks, or other. See Note [Stacks].
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from dataclasses import dataclass

import torch

from passes.costs import is_view, tensor_bytes
from passes.graphs import forward_nodes
from passes.warn import warn_user

REGION_KEY = "ckpt_fx.region"
PATH_KEY = "ckpt_fx.module_path"
WHOLE_UNIT_KEY = "ckpt_fx.whole_unit"
"""Set (True) on a node the policy recomputes as part of a whole unit (NamedPolicy.whole_units)."""

# Note [Stacks]
# A stack is a container (ModuleList, Sequential, or any module) whose children are named by
# integers and are instances of one class: HF's model.layers.N, transformer.h.N, encoder.layer.N,
# blocks.N, or a plain nn.Sequential at the top. A model may have several stacks (an encoder and a
# decoder). One member seen is enough: a graph that DDP split at a bucket boundary, or that a
# graph break cut, may hold a single block of a stack. Blocks are numbered by their index in the
# path, stacks following each other in the order the forward first reaches them.
# A model with no stack uses its top-level children as units, and says so once.
#
# Note [Nested stacks]
# A stack inside a member of another is one of two things. Experts inside a block run side by side:
# each reads the block's routed input, none reads another's output; they belong to their block. The
# blocks inside a vision model's stages (Swin's encoder.layers.N.blocks.M, ConvNeXt's and ResNet's
# encoder.stages.N.layers.M) run in sequence: block M+1 reads block M's output. Taking the stages
# as units would leave a whole stage (the first at full resolution, skipped by skip_first) with
# everything saved; so an inner stack whose members run in sequence replaces the outer one, and its
# members are the units. What a stage runs outside its blocks (a downsampling layer) joins the
# unit before it in the same stage, or the one after when it comes first. This goes one level
# down only: the layers inside a block (ResNet's block.layer.K, its convolutions) run in sequence
# too, and are not units.
#
# Note [Calls as units]
# A module called several times in one forward (ALBERT's shared layer group run N times, an
# unrolled RNN cell, a weight-tied layer) is several units: one per call. Dynamo marks the k-th call
# of a module in nn_module_stack's key with "@k"; a unit is (module path, call). The units of a
# stack with a repeated member are numbered in forward order (the path alone cannot tell them
# apart); otherwise by the index in the path, as above.


def block_stacks(model: torch.nn.Module) -> list[str]:
    """The paths of a model's stacks of repeated blocks, read from its modules as the graph's are
    read from its nodes (Note [Stacks]): modules with more than one child, named 0, 1, ... and of
    one class. `enable`, `fit` and the bench find blocks with it."""
    stacks = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if len(children) > 1 and all(k.isdigit() for k in children) and len({type(c) for c in children.values()}) == 1:
            stacks.append(name)
    return stacks


@dataclass(frozen=True, kw_only=True)
class Block:
    """One checkpointable unit: a member of a stack (one call of it), or a top-level child when
    there is no stack."""

    path: str
    """Module path of the unit, e.g. "transformer.h.3"."""
    stack: str
    """Module path of the stack it belongs to ("" for the model itself)."""
    index: int
    """Position within its stack, from 0."""
    stack_len: int
    """One more than the highest index among its stack's members in this graph: the stack's
    length as far as this graph shows it (a graph that starts mid-stack, after a graph break,
    counts the members before it too)."""
    number: int
    """Position among all units of the model, from 0: its index plus the lengths of the stacks
    before it in this graph."""
    call: int = 0
    """Which call of the module at `path` this unit is, from 0 (Note [Calls as units])."""
    calls: int = 1
    """How many times the module at `path` is called in this graph."""
    activation_bytes: int = 0
    """Bytes of the values the unit computes (views excluded): what checkpointing it can keep out."""
    in_stage: bool = False
    """Its stack lies inside a member of an outer stack (a stage) that it replaced as the units
    (Note [Nested stacks])."""
    heavy: bool = False
    """The unit computes more than HEAVY_RATIO times the median unit's activation bytes (a first
    stage at full resolution); skip_first does not skip it (Note [What skip_first skips])."""
    leading_light: bool = False
    """It and every unit before it compute less than LIGHT_RATIO times the median unit's
    activation bytes: checkpointing them keeps out little (skip_first="auto" leaves them whole)."""

    @property
    def name(self) -> str:
        """The unit's name in plans and reports: its path, with "#k" when the module runs more than once."""
        return f"{self.path} #{self.call}" if self.calls > 1 else self.path


# Note [What skip_first skips]
# The advice to leave the first layer (and the embedding) unrecomputed is about units whose
# recompute keeps out little next to the time it costs. A unit that computes several times what a
# typical unit does (the first stage of a vision model, at full resolution) is the opposite: it
# holds most of the activations. So skip_first leaves out the first units except the heavy ones.
# Counting units to skip is the wrong measure anyway: a transformer's first block holds as many
# activations as any other, and skipping it kept a block's worth more than per-block
# checkpointing (Hugging Face's, which the default must not lose to). So the default,
# skip_first="auto", decides by what skipping keeps: it leaves whole only the leading units that
# compute under LIGHT_RATIO times the median unit's activation bytes (a small stem), none in a
# stack of alike blocks.
HEAVY_RATIO = 2.0
LIGHT_RATIO = 0.25


class RegionKind(str, enum.Enum):
    """Where a forward node belongs; equal to its value as a string ("block" == RegionKind.BLOCK),
    so a policy written against the strings keeps working."""

    EMBEDDING = "embedding"
    BLOCK = "block"
    """Inside a unit (Block)."""
    OTHER = "other"
    """Outside every unit and not an embedding (a final norm, a head, a loss)."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class Region:
    """Where a forward node belongs."""

    kind: RegionKind
    block: Block | None = None
    """The unit, when kind is RegionKind.BLOCK."""


@dataclass(frozen=True, kw_only=True)
class RegionMap:
    """What regions_pass found in a graph."""

    blocks: tuple[Block, ...]
    """All units in forward order (Block.number indexes this tuple)."""
    stacks: tuple[str, ...]
    """Module paths of the detected stacks, in forward order."""
    top_level_units: bool
    """True when no stack was found and top-level children serve as units (False for a graph of
    one leaf module, which has no blocks to find: nothing to warn of)."""
    nested_in: tuple[str, ...] = ()
    """Stacks whose members hold stacks of blocks run in sequence: their inner blocks are the
    units (Note [Nested stacks])."""


_GETATTR = re.compile(r"getattr\(([^()]*), ['\"]([^'\"]+)['\"]\)")
_MODULES = re.compile(r"(?:^|\.)_modules\[['\"]([^'\"]+)['\"]\]")
_INDEX = re.compile(r"\[(\d+)\]")
# The frame's module: L['self'], or L['args'][0] when a decorator takes (*args, **kwargs).
_ROOT = re.compile(r"^(L\[['\"][^'\"]+['\"]\](\[\d+\])*|self)(\.|$)")
_CALL = re.compile(r"@(\d+)$")


def normalize_module_path(path: str) -> str:
    """Turn a dynamo source string ("L['self'].layers[0]") into a module path ("layers.0")."""
    previous = None
    while previous != path:
        previous, path = path, _GETATTR.sub(r"\1.\2", path)
    path = _ROOT.sub("", path)
    path = _MODULES.sub(r".\1", path)
    path = _INDEX.sub(r".\1", path)
    return path.strip(".")


def module_calls(node: torch.fx.Node) -> list[tuple[str, type | str, int]]:
    """The (path, class, call) triples enclosing a node, outermost first: `call` counts the calls
    of that module before this one in the graph (Note [Calls as units])."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for key, value in stack.items():
        path, cls = value if isinstance(value, tuple) else (value, "")
        match = _CALL.search(str(key))
        out.append((normalize_module_path(str(path)), cls, int(match.group(1)) if match else 0))
    return out


def _class_name(cls: type | str) -> str:
    return cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"


def _is_embedding(cls: type | str) -> bool:
    if isinstance(cls, type):
        return issubclass(cls, torch.nn.Embedding) or cls.__name__.endswith("Embedding")
    return str(cls).rsplit(".", 1)[-1].rstrip("'>").endswith("Embedding")


Unit = tuple[str, int]  # (module path, call)


def regions_pass(gm: torch.fx.GraphModule, *, warn: bool = True) -> RegionMap:
    """Write a Region and a module path into node.meta of every forward node of a joint graph.

    warn=False keeps quiet when no stack is found (for policies that do not use blocks).

    Mutates node.meta only (keys REGION_KEY, PATH_KEY); keeps nodes and names; deterministic.
    """
    fwd = forward_nodes(gm.graph)
    calls_of = {node: module_calls(node) for node in fwd}

    # Children named by integers, grouped by parent path, with their classes (Note [Stacks]).
    children: dict[str, dict[int, set[str]]] = {}
    for node in fwd:
        for path, cls, _ in calls_of[node]:
            parent, _, last = path.rpartition(".")
            if last.isdigit():
                children.setdefault(parent, {}).setdefault(int(last), set()).add(_class_name(cls))
    candidates = [parent for parent, members in children.items()
                  if len({c for cs in members.values() for c in cs}) == 1]  # one member is enough
    stacks, nested_in = _unit_stacks(candidates, fwd, calls_of)

    def unit_of_stack(triples: list[tuple[str, type | str, int]]) -> Unit | None:
        for path, _, call in reversed(triples):  # innermost: a kept stack may sit inside another's member
            parent, _, last = path.rpartition(".")
            if last.isdigit() and parent in stacks:
                return path, call
        return None

    top_level = lone_leaf = False
    if not stacks:
        tops = []
        for node in fwd:
            st = calls_of[node]
            if st and st[0][0] and not _is_embedding(st[0][1]):
                top = st[0][0].split(".")[0]
                if top not in tops:
                    tops.append(top)
        top_level = bool(tops)
        # One leaf module and functions around it (the loss head's own graph, where dynamo broke
        # the model's graph before it: peft's hook on the embedding) hold no block to name.
        lone_leaf = len(tops) == 1 and all(len(calls_of[node]) <= 1 for node in fwd)
        if top_level and warn and not lone_leaf:
            warn_user(
                "ckpt_fx: no stack of repeated blocks found in this graph; using its top-level "
                f"children ({', '.join(tops)}) as checkpoint units; if each block is compiled on its own "
                "(FSDP2's fully_shard per block, torch.compile per block), use policy=\"graph\""
            )

    unit_of: dict[torch.fx.Node, Unit | None] = {}
    for node in fwd:
        st = calls_of[node]
        if top_level:
            unit_of[node] = (st[0][0].split(".")[0], 0) if st and st[0][0] and not _is_embedding(st[0][1]) else None
        else:
            unit_of[node] = unit_of_stack(st)
    _join_stage_leftovers(fwd, calls_of, unit_of, nested_in)

    order = list(dict.fromkeys(u for node in fwd if (u := unit_of[node]) is not None))
    calls = Counter(path for path, _ in order)
    stack_of = {u: "" if top_level else u[0].rpartition(".")[0] for u in order}
    repeated = {stack_of[u] for u in order if calls[u[0]] > 1}
    # A member's index comes from its path, so a graph that starts mid-stack (after a graph
    # break) still numbers its blocks as the model does; a stack with a repeated member counts
    # its units in forward order (Note [Calls as units]).
    index_of: dict[Unit, int] = {}
    stack_len: dict[str, int] = {}
    for position, unit in enumerate(order):
        stack = stack_of[unit]
        if top_level:
            index_of[unit] = position
        elif stack in repeated:
            index_of[unit] = sum(1 for u in order[:position] if stack_of[u] == stack)
        else:
            index_of[unit] = int(unit[0].rpartition(".")[2])
        stack_len[stack] = max(stack_len.get(stack, 0), index_of[unit] + 1)
    offsets: dict[str, int] = {}
    for stack in stack_len:
        offsets[stack] = sum(stack_len[s] for s in offsets)

    weight: Counter[Unit] = Counter()
    for node in fwd:
        value = node.meta.get("val")
        if unit_of[node] is not None and node.op == "call_function" and not is_view(node):
            weight[unit_of[node]] += tensor_bytes(value)
    weights = sorted(weight[u] for u in order)
    median = weights[len(weights) // 2] if weights else 0
    blocks = {
        unit: Block(
            path=unit[0],
            stack=stack_of[unit],
            index=index_of[unit],
            stack_len=stack_len[stack_of[unit]],
            number=offsets[stack_of[unit]] + index_of[unit],
            call=unit[1],
            calls=calls[unit[0]],
            activation_bytes=weight[unit],
            in_stage=any(_inside_member(stack_of[unit], outer) for outer in nested_in),
            heavy=len(order) > 2 and weight[unit] > HEAVY_RATIO * median,
            leading_light=all(weight[u] < LIGHT_RATIO * median for u in order[: position + 1]),
        )
        for position, unit in enumerate(order)
    }

    for node in gm.graph.nodes:
        node.meta.pop(REGION_KEY, None)
        node.meta.pop(PATH_KEY, None)
    for node in fwd:
        st = calls_of[node]
        node.meta[PATH_KEY] = st[-1][0] if st else ""
        if node.op == "placeholder":
            continue
        if _touches_embedding(node, st):
            region = Region(kind=RegionKind.EMBEDDING)
        elif unit_of[node] is not None:
            region = Region(kind=RegionKind.BLOCK, block=blocks[unit_of[node]])
        else:
            region = Region(kind=RegionKind.OTHER)
        node.meta[REGION_KEY] = region
    return RegionMap(
        blocks=tuple(blocks[u] for u in order),
        stacks=tuple(dict.fromkeys(b.stack for b in blocks.values())) if not top_level else (),
        top_level_units=top_level and not lone_leaf,
        nested_in=nested_in,
    )


def _unit_stacks(
    candidates: list[str], fwd: list[torch.fx.Node], calls_of: dict[torch.fx.Node, list[tuple[str, type | str, int]]]
) -> tuple[list[str], tuple[str, ...]]:
    """The stacks whose members are units, and the outer stacks they replaced (Note [Nested stacks])."""

    def parent_of(stack: str) -> str | None:
        outer = [o for o in candidates if o != stack and _inside_member(stack, o)]
        return max(outer, key=len) if outer else None

    parent = {s: parent_of(s) for s in candidates}
    # One level down: the blocks of a stage, not the layers inside a block (ResNet's
    # stages.N.layers.M.layer.K are a block's convolutions, run in sequence too).
    sequential = {s for s in candidates if (p := parent[s]) is not None and parent[p] is None and _in_sequence(s, fwd, calls_of)}

    def active(stack: str) -> bool:
        p = parent[stack]
        return p is None or (stack in sequential and active(p))

    descended = {p for s in candidates if active(s) and (p := parent[s]) is not None}
    kept = [s for s in candidates if active(s) and s not in descended]
    return kept, tuple(s for s in candidates if s in descended)


def _in_sequence(stack: str, fwd: list[torch.fx.Node], calls_of: dict[torch.fx.Node, list[tuple[str, type | str, int]]]) -> bool:
    """True when a member of `stack` reads a value computed by the member before it in the same
    call of the enclosing module: blocks run in sequence, not experts side by side."""
    prefix = stack + "."
    member_of: dict[torch.fx.Node, tuple[tuple[str, int], int]] = {}
    for node in fwd:
        enclosing = None
        for path, _, call in calls_of[node]:
            if path.startswith(prefix) and path[len(prefix):].isdigit():
                member_of[node] = (enclosing or ("", 0), int(path[len(prefix):]))
                break
            enclosing = (path, call)
    for node, (outer, index) in member_of.items():
        for arg in node.all_input_nodes:
            if member_of.get(arg) == (outer, index - 1):
                return True
    return False


def _join_stage_leftovers(
    fwd: list[torch.fx.Node],
    calls_of: dict[torch.fx.Node, list[tuple[str, type | str, int]]],
    unit_of: dict[torch.fx.Node, Unit | None],
    nested_in: tuple[str, ...],
) -> None:
    """Give the nodes of a stage outside its blocks (a downsampling layer) to the unit before them
    in the same stage, or after them when they come first (Note [Nested stacks])."""
    if not nested_in:
        return

    def stage(node: torch.fx.Node) -> Unit | None:
        for path, _, call in calls_of[node]:
            parent, _, last = path.rpartition(".")
            if last.isdigit() and parent in nested_in:
                return path, call
        return None

    stage_of = {node: stage(node) for node in fwd}
    for sweep in (fwd, list(reversed(fwd))):
        last: dict[Unit, Unit] = {}
        for node in sweep:
            s = stage_of[node]
            if s is None or node.op == "placeholder":
                continue
            if unit_of[node] is not None:
                last[s] = unit_of[node]
            elif s in last:
                unit_of[node] = last[s]


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


def region_of(node: torch.fx.Node) -> Region | None:
    """The region regions_pass gave a node (None: a node it did not see, such as a backward's own)."""
    return node.meta.get(REGION_KEY)


def block_of(node: torch.fx.Node) -> Block | None:
    """The unit a node belongs to (None: outside every unit, or a node regions_pass did not see)."""
    region = region_of(node)
    return region.block if region is not None else None


def recomputed_block(node: torch.fx.Node) -> str | None:
    """The name of the block a node of a backward recomputes (None: the node is no recomputation
    the policy asked for, or belongs to no block)."""
    from passes._compat import RECOMPUTE_KEY, CheckpointPolicy

    if node.meta.get(RECOMPUTE_KEY) not in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE):
        return None
    block = block_of(node)
    return block.name if block is not None else None


def recomputed_whole(node: torch.fx.Node) -> bool:
    """Whether a node of a backward recomputes part of a unit the policy recomputes whole."""
    return recomputed_block(node) is not None and bool(node.meta.get(WHOLE_UNIT_KEY))
