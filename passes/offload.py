"""offload: keep chosen saved values in host memory between the forward and the backward, with
torch's own offload pass and ops (Note [Offload]); the third decision beside save and recompute."""

from __future__ import annotations

import operator

import torch

from passes._compat import (
    CPU_OFFLOAD_PREFIX,
    OFFLOAD_OPS,
    insert_offloads,
)
from passes.costs import is_view
from passes.regions import region_of

OFFLOAD_KEY = "ckpt_fx.offload"
"""On a joint graph's forward node: the plan keeps its value in host memory (select_pass)."""

# Note [Offload]
# A saved value may stay on the device until the backward reads it (save), be rebuilt there
# (recompute), or leave for host memory once the forward is done with it and come back before the
# backward needs it (offload): the device holds it only around its uses, the host holds a copy,
# and the copies cost time unless compute hides them. torch has the mechanics and no planner: its
# partitioners' offload pass (torch/_functorch/_activation_offloading) turns forward nodes marked
# "should_offload" into a copy to the host after their last forward use and a copy back before
# their first backward use (prims.device_put; on a GPU, ao.offload / ao.reload / ao.wait_tensor on
# a transfer stream with a pinned-memory pool). The passes decide (select_pass marks OFFLOAD_KEY);
# offload_pass hands the marks to torch's pass on the partitioned graphs, after the schedule pass
# ordered the backward, so each copy back lands before its first use in the order that runs.
# On a GPU the waits are placed by us, not by torch's sink_wait and prefetch: sink_wait holds
# every offloaded value on the device until the forward's end (the peak offloading exists to
# lower), and prefetch times nodes at compile time. A unit's copies out are waited for where the
# next unit's copies begin (they run beside that unit's forward; the device holds one unit's
# offloaded values longer), and its copies back start where the next unit's are first needed
# (they run beside that unit's backward). The planner prices copies by that model (Note [Offload
# in the recompute problem] in passes/solve.py). On a CPU there is no device to leave: the copies
# run synchronously from host to host, the plan runs and its gradients are exact, and it saves
# nothing (the backend says so once).


def offloadable(node: torch.fx.Node, *, user_outputs: set[torch.fx.Node] | frozenset[torch.fx.Node] = frozenset()) -> bool:
    """Whether torch's offload pass can move a node's value: a tensor computed by an op, not a
    view or a tuple's element (torch refuses those), contiguous (a strided copy changes strides
    twice), and not returned to the user (who holds it anyway)."""
    value = node.meta.get("val")
    if node.op != "call_function" or node.target is operator.getitem or node in user_outputs:
        return False
    return isinstance(value, torch.Tensor) and value.is_contiguous() and not is_view(node)


def offload_pass(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, *, num_fwd_outputs: int,
                 static_lifetime_input_indices: list[int] | None) -> tuple[str, ...]:
    """Move the saved values whose joint-graph node the plan marked (OFFLOAD_KEY) to host memory
    between the forward and the backward, with torch's offload pass (Note [Offload]): copies on a
    transfer stream, waits placed by unit, on a GPU; synchronous copies elsewhere. Mutates both
    graphs in place (torch's node names: cpu_offload_<name>, gpu_reload_<name>); deterministic.
    Returns the names offloaded (those torch could move), in forward order."""
    saved = [a for a in fw.graph.output_node().args[0][num_fwd_outputs:] if isinstance(a, torch.fx.Node)]
    marked = [n for n in saved if n.meta.get(OFFLOAD_KEY)]
    if not marked:
        return ()
    for node in marked:
        node.meta["should_offload"] = True
    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    static = [placeholders[i] for i in static_lifetime_input_indices or () if i < len(placeholders)]
    device = next((n.meta["val"].device for n in marked if isinstance(n.meta.get("val"), torch.Tensor)), None)
    streams = device is not None and device.type == "cuda"
    insert_offloads(fw, bw, num_fwd_outputs=num_fwd_outputs, static_inputs=static, streams=streams)
    offloaded = tuple(n.name for n in marked if any(u.name.endswith(CPU_OFFLOAD_PREFIX + n.name) for u in n.users))
    if streams:
        _place_waits(fw)
        _place_reloads(bw, units={n.name: _unit(n) for n in marked})
    return offloaded


def copy_seconds(plan, *, flops_per_second: float, bandwidth: float) -> float:
    """Seconds a plan's copies to host memory and back add to a training step, compute hiding
    what it can: per unit, the copies out beside one unit's forward and back beside its backward
    (twice the forward), the rest added; copies outside every unit added in full (Note [Offload in
    the recompute problem] in passes/solve.py)."""
    total = 0.0
    for block in plan.blocks:
        copies, window = block.offloaded_bytes / bandwidth, block.forward_flops / flops_per_second
        total += max(0.0, copies - window) + max(0.0, copies - 2 * window)
    outside = plan.offloaded_bytes - sum(b.offloaded_bytes for b in plan.blocks)
    return total + 2 * outside / bandwidth


def on_host(node: torch.fx.Node) -> bool:
    """A value that lives in host memory: a copy out of the device, or a backward's input holding
    one (torch names them cpu_offload_<name>)."""
    return node.name.startswith((CPU_OFFLOAD_PREFIX, "async_" + CPU_OFFLOAD_PREFIX))


def _unit(node: torch.fx.Node) -> int:
    region = region_of(node)
    block = getattr(region, "block", None)
    return block.number if block is not None else -1


def _place_waits(fw: torch.fx.GraphModule) -> None:
    """A unit's copies out are waited for where the next unit's copies begin, the last unit's at the
    forward's end (Note [Offload])."""
    offload, wait = OFFLOAD_OPS["offload"], OFFLOAD_OPS["wait"]
    copies = [n for n in fw.graph.nodes if n.target is offload]
    output = fw.graph.output_node()
    for copy in copies:
        waits = [u for u in copy.users if u.target is wait]
        unit = _unit(copy.args[0])
        later = next((c for c in copies if _unit(c.args[0]) > unit >= 0), None)
        for w in waits:
            (later or output).prepend(w)


def _place_reloads(bw: torch.fx.GraphModule, *, units: dict[str, int]) -> None:
    """A unit's copies back start where the next unit's copied values are first needed (the next
    unit's backward runs first), so they run beside it (Note [Offload]). `units`: the unit of each
    offloaded value, by its forward name."""
    reload, wait = OFFLOAD_OPS["reload"], OFFLOAD_OPS["wait"]
    reloads = [n for n in bw.graph.nodes if n.target is reload]
    units = {r: units.get(r.args[0].name.removeprefix(CPU_OFFLOAD_PREFIX), -1) for r in reloads}
    waits = {r: next(u for u in r.users if u.target is wait) for r in reloads}
    for r in reloads:
        if units[r] < 0:
            continue
        following = [waits[o] for o in reloads if units[o] == units[r] + 1]
        if following:
            first = min(following, key=list(bw.graph.nodes).index)
            first.prepend(r)
