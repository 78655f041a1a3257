"""partition pass: min-cut's CSE of the joint graph, done once."""

from __future__ import annotations

import torch

import ckpt_fx
from passes.targets import INDUCTOR


def test_a_joint_graph_min_cut_merged_is_partitioned_alike_without_merging_again(monkeypatch):
    """A budget plans Inductor's own partition first, which lets min-cut merge the joint graph's
    identical nodes (its CSE), then torch's plan at the same budget: that second partition skips
    the CSE, which finds nothing more to merge, and gives the same forward and backward as one
    that merges again."""
    import torch._functorch.partitioners as partitioners

    from ckpt_fx.bench.models import build
    from passes._compat import activation_memory_budget
    from passes.graphs import copy_graph_module
    from passes.partition import MERGED_KEY, partition_pass

    joints = []
    backend = ckpt_fx.backend(policy="none", compiler="eager", strict=True)
    backend.on_joint.append(lambda joint, joint_inputs, kw: joints.append((copy_graph_module(joint), joint_inputs, kw)))
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 32))
    torch.compile(build("gpt", layers=2, dim=64, heads=2), backend=backend)(ids, ids).backward()
    joint, joint_inputs, kw = joints[0]
    merges = []
    real = partitioners.fx_graph_cse
    monkeypatch.setattr(partitioners, "fx_graph_cse", lambda graph, **kw: merges.append(1) or real(graph, **kw))

    def torch_plan_after_inductors_own(merge_again: bool) -> tuple[str, str, int]:
        gm = copy_graph_module(joint)
        partition = lambda: partition_pass(gm, joint_inputs, num_fwd_outputs=kw["num_fwd_outputs"], target=INDUCTOR)  # noqa: E731
        assert len(real(gm.graph).nodes) < len(gm.graph.nodes)  # the CSE has nodes to merge here
        partition()
        assert gm.meta[MERGED_KEY]
        if merge_again:
            del gm.meta[MERGED_KEY]
        merges.clear()
        with activation_memory_budget(0.3):
            fw, bw = partition()
        return fw.code, bw.code, len(merges)

    skipped, merged = torch_plan_after_inductors_own(False), torch_plan_after_inductors_own(True)
    assert (skipped[2], merged[2]) == (0, 1)
    assert skipped[:2] == merged[:2]
