"""A recomputing policy's plan under Inductor, partitioned as ckpt-fx does (without min-cut's CSE of
the joint graph) and, for comparison, after the CSE: the measured peak of a training step and the
predicted one, each compiled fresh (Note [CSE under recompute] in passes/partition.py; the
README's Known limits gives the measured pairs).

    python tests/measure/cse_check.py MODEL:LAYERS:DIM:BATCH:SEQ [POLICY]      POLICY "blocks" if not given
    e.g. python tests/measure/cse_check.py LlamaConfig:6:256:2:512 blocks

MODEL: gpt2 (transformers' GPT-2, its default dropout), gpt2-nodrop (dropout off), gpt or llama
(built-in), or a transformers config class (LlamaConfig, MixtralConfig, ...: SDPA, half as many
key/value heads); heads are DIM / 64.
"""
import sys

import torch

import ckpt_fx
import passes.inductor_memory
import passes.partition
import passes.planner
from ckpt_fx.bench import workloads
from passes import step_peak_bytes

USAGE = "usage: python tests/measure/cse_check.py MODEL:LAYERS:DIM:BATCH:SEQ [POLICY], e.g. LlamaConfig:6:256:2:512 blocks"


def workload(kind: str, layers: int, dim: int, batch: int, seq: int) -> workloads.Workload:
    sizes = dict(layers=layers, dim=dim, heads=dim // 64, batch=batch, seq=seq)
    if kind == "gpt2":
        return workloads.gpt2_workload(**sizes)
    if kind == "gpt2-nodrop":
        return workloads.workload("gpt2", **sizes, overrides=dict(resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    if kind in ("gpt", "llama"):
        return workloads.builtin_workload(kind, **sizes)
    return workloads.hf_workload(kind, **sizes)


def main() -> None:
    if len(sys.argv) not in (2, 3) or sys.argv[1].count(":") != 4:
        sys.exit(f"cse_check.py: expected MODEL:LAYERS:DIM:BATCH:SEQ and at most one POLICY, got {sys.argv[1:]!r}; {USAGE}")
    kind, *numbers = sys.argv[1].split(":")
    if not all(n.isdigit() for n in numbers):
        sys.exit(f"cse_check.py: LAYERS, DIM, BATCH and SEQ must be whole numbers, got {numbers!r}; {USAGE}")
    policy = sys.argv[2] if len(sys.argv) == 3 else "blocks"
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    real = passes.partition.merges_joint
    for merged in (False, True):
        merge = real if not merged else (lambda joint, *, partitioner: True)
        passes.partition.merges_joint = passes.planner.merges_joint = merge
        torch._dynamo.reset()
        passes.inductor_memory._SEGMENT_SCHEDULES.clear()
        torch.manual_seed(0)
        w = workload(kind, *map(int, numbers))
        backend = ckpt_fx.backend(policy=policy, compiler="inductor")
        compiled = torch.compile(w.model, backend=backend)
        w.loss(compiled).backward()
        w.loss(compiled).backward()
        peak = ckpt_fx.peak_bytes(lambda: w.loss(compiled).backward())
        predicted = step_peak_bytes(backend.plans)
        label = "after the CSE (for comparison)" if merged else "as ckpt-fx plans (no CSE)"
        print(f"{sys.argv[1]} {policy}, {label}: measured {peak / 2**20:.1f} MB, predicted {predicted / 2**20:.1f} MB "
              f"({predicted / peak - 1:+.1%}); joint_cse {[p.joint_cse for p in backend.plans]}", flush=True)
    passes.partition.merges_joint = passes.planner.merges_joint = real


if __name__ == "__main__":
    main()
