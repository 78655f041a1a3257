"""partition: joint graph + per-node decisions -> forward and backward graphs."""

from __future__ import annotations

import torch

from passes._compat import default_partition


def partition_pass(
    joint: torch.fx.GraphModule,
    joint_inputs: object,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Split the joint graph by the decisions select_pass wrote into node.meta["recompute"].

    The forward saves every forward value the backward needs unless it is marked for recompute;
    the backward receives copies of the recomputed nodes (same names, same meta). This is the
    contract of torch's default partitioner for recompute tags, which we reuse rather than
    duplicate. Torch orders the backward it returns much as schedule_pass does; schedule_pass
    still runs after it, so the just-in-time order is ours to guarantee and test whatever a torch
    release does here. Does not mutate the joint graph's nodes beyond torch's own tag clean-up;
    deterministic.
    """
    return default_partition(
        joint,
        joint_inputs,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_indices=static_lifetime_input_indices,
    )
