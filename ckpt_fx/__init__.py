"""ckpt-fx: activation checkpointing as a torch.compile backend and an FX graph rewrite.

    ckpt_fx.enable(model)                                                  # in place, training steps only
    compiled = torch.compile(model, backend="ckpt")                        # entry point, no import
    compiled = torch.compile(model, backend=ckpt_fx.backend(policy="segments:4"))
    gm2 = ckpt_fx.rewrite_graph(torch.fx.symbolic_trace(model), "sqrt", example_inputs=(x,))
"""

import importlib
import logging

# Note [A package that imports torch when used]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# `python -m ckpt_fx --help` imports this package first; importing torch costs seconds, so the
# names below are loaded on first use (PEP 562). No exported name is also a submodule's name
# (the backend factory lives in ckpt_fx.dynamo_backend, explain in ckpt_fx.report), so importing a
# submodule never rebinds one of them.
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
    "disable": "ckpt_fx.in_place",
    "enable": "ckpt_fx.in_place",
    "enabled": "ckpt_fx.in_place",
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
