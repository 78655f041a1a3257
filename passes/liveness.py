"""liveness: the one walk that predicts live bytes, and the one just-in-time order. The memory pass
walks partitioned graphs with them, the schedule pass orders backwards with them, and the budget's
estimator (memory.JointLiveness) walks the joint graph with them; they take any hashable nodes, so
each caller says what a node reads and allocates."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence


def walk(
    order: Sequence[Hashable],
    *,
    key: Callable[[Hashable], Hashable],
    reads: Callable[[Hashable], Iterable[Hashable]],
    allocates: Callable[[Hashable], int | None],
    live: dict[Hashable, int],
    pinned: Iterable[Hashable] = (),
    held: Iterable[Hashable] = (),
) -> int:
    """Run `order`; return the peak of live bytes (Note [What the predicted peak counts]).

    Each node allocates `allocates(n)` bytes under its storage key `key(n)` (None: it allocates
    nothing, as a view, an input or a getitem does; 0: it is stored nowhere, as a fused op). A
    storage is freed after the last node whose `reads(n)` (the storage keys it reads or writes)
    names it, unless it is `pinned` (never freed: held by the caller) or `held` (read after the
    walk, by the graph's output). `live` maps storage keys to bytes at entry and is updated in
    place to the state at exit.
    """
    pinned = set(pinned)
    last: dict[Hashable, int] = {}
    for t, node in enumerate(order):
        for k in reads(node):
            last[k] = t
    for k in held:
        last[k] = len(order)
    total = sum(live.values())
    peak = total
    for t, node in enumerate(order):
        nbytes = allocates(node)
        if nbytes is not None:
            live[key(node)] = nbytes
            total += nbytes
            peak = max(peak, total)
        for k in reads(node):
            if last[k] == t and k in live and k not in pinned:
                total -= live.pop(k)
    return peak


def just_in_time(
    roots: Iterable[Hashable],
    *,
    inputs: Callable[[Hashable], Iterable[Hashable]],
    rank: Callable[[Hashable], int],
    ready: Callable[[Hashable], bool],
    followers: Callable[[Hashable], Iterable[Hashable]] = lambda node: (),
) -> list[Hashable]:
    """Each root in turn, preceded by the nodes it needs that are not yet placed (its inputs,
    transitively, short of those `ready` from the start), those in `rank` order; every placed node
    followed at once by its `followers` not yet placed (a multi-output node's getitems). Note
    [Just-in-time recompute] in passes/schedule.py."""
    placed: set[Hashable] = set()
    order: list[Hashable] = []
    for root in roots:
        todo, batch, seen = [root], [], set()
        while todo:
            node = todo.pop()
            if node in placed or node in seen or ready(node):
                continue
            seen.add(node)
            batch.append(node)
            todo.extend(inputs(node))
        for node in sorted(batch, key=rank):
            if node in placed:  # a follower placed after its node
                continue
            placed.add(node)
            order.append(node)
            for follower in followers(node):
                if follower not in placed:
                    placed.add(follower)
                    order.append(follower)
    return order
