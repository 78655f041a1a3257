"""FX graph passes for activation checkpointing. Imports torch, never ckpt_fx.

The pipeline (passes.pipeline.run) prepares a joint forward/backward graph traced by AOTAutograd
(dropout -> batchnorm -> regions -> costs), then plans it: under a per-node policy with
passes.planner (select -> partition -> fold twins -> schedule -> memory), under a memory budget
with passes.budget's search over such plans (solvers in passes.solve). schedule and memory share
one just-in-time order and one liveness walk (passes.liveness); Inductor's memory is read by
passes.inductor_memory; what was decided is a Plan (passes.plan); what a policy is and sees,
passes.policy.
"""

from passes.plan import BlockPlan, Plan, SavedTensor, step_peak_bytes
from passes.policy import NodeInfo, Policy

__all__ = ["BlockPlan", "NodeInfo", "Plan", "Policy", "SavedTensor", "step_peak_bytes"]
