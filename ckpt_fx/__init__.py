"""ckpt-fx: activation checkpointing as a torch.compile backend and an FX graph rewrite.

    compiled = torch.compile(model, backend="ckpt")                        # entry point, no import
    compiled = torch.compile(model, backend=ckpt_fx.backend(policy="segments:4"))
    gm2 = ckpt_fx.rewrite_graph(torch.fx.symbolic_trace(model), "sqrt", example_inputs=(x,))
"""

import logging

from ckpt_fx import policies
from ckpt_fx.backend import CkptBackend, Options, backend
from ckpt_fx.explain import Report, explain
from ckpt_fx.measure import peak_bytes
from ckpt_fx.rewrite import RewrittenGraphModule, rewrite_graph
from passes import BlockPlan, NodeInfo, Plan, SavedTensor, step_peak_bytes
from passes._compat import CheckpointPolicy

logging.getLogger("ckpt_fx").addHandler(logging.NullHandler())

__all__ = [
    "BlockPlan",
    "CheckpointPolicy",
    "CkptBackend",
    "NodeInfo",
    "Options",
    "Plan",
    "Report",
    "RewrittenGraphModule",
    "SavedTensor",
    "backend",
    "explain",
    "peak_bytes",
    "policies",
    "rewrite_graph",
    "step_peak_bytes",
]
__version__ = "0.1.0"
