"""ckpt-fx: activation checkpointing as a torch.compile backend and an FX graph rewrite.

    compiled = torch.compile(model, backend="ckpt")                        # entry point, no import
    compiled = torch.compile(model, backend=ckpt_fx.backend(policy="segments:4"))
    gm2 = ckpt_fx.rewrite_graph(torch.fx.symbolic_trace(model), "sqrt", example_inputs=(x,))
"""

import importlib
import logging

# Note [A package that imports torch when used]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `python -m ckpt_fx --help` imports this package first; importing torch costs seconds, so the
# names below are loaded on first use (PEP 562). Two of them, `backend` and `explain`, are both a
# function here and a submodule: the import system binds a submodule onto its package when it is
# first imported, which would replace the function, so the package keeps its own binding for
# those names (`_Package.__setattr__`); `import ckpt_fx.dynamo_backend` and `from ckpt_fx.dynamo_backend import
# ...` still find the module in sys.modules.
_EXPORTS = {
    "BlockPlan": "passes",
    "CheckpointPolicy": "passes._compat",
    "CkptBackend": "ckpt_fx.dynamo_backend",
    "NodeInfo": "passes",
    "Options": "ckpt_fx.dynamo_backend",
    "Plan": "passes",
    "Report": "ckpt_fx.report",
    "RewrittenGraphModule": "ckpt_fx.rewrite",
    "SavedTensor": "passes",
    "backend": "ckpt_fx.dynamo_backend",
    "explain": "ckpt_fx.report",
    "peak_bytes": "ckpt_fx.measure",
    "policies": None,
    "rewrite_graph": "ckpt_fx.rewrite",
    "step_peak_bytes": "passes",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ckpt_fx' has no attribute {name!r}")
    source = _EXPORTS[name]
    value = importlib.import_module(f"ckpt_fx.{name}") if source is None else getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


logging.getLogger("ckpt_fx").addHandler(logging.NullHandler())

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"
