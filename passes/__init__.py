"""FX graph passes for activation checkpointing. Imports torch, never ckpt_fx.

The pipeline (passes.pipeline.run) runs dropout -> batchnorm -> regions -> costs -> select ->
partition -> schedule -> memory over a joint forward/backward graph traced by AOTAutograd; the
budget's candidates come from passes.budget and passes.solve. schedule and memory share one
just-in-time order and one liveness walk (passes.liveness); what was decided is a Plan (passes.plan).
"""

from passes.plan import BlockPlan, Plan, SavedTensor, step_peak_bytes
from passes.select import NodeInfo, Policy

__all__ = ["BlockPlan", "NodeInfo", "Plan", "Policy", "SavedTensor", "step_peak_bytes"]
