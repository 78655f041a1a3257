"""warn_user: a warning that points at the user's line, not at ours or torch's."""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import warnings

import torch

# Frames in these folders are on the way from the user's call to our passes: torch (dynamo,
# AOTAutograd, Inductor), this project, the standard library (functools, contextlib wrappers) and
# installed packages (transformers' forward wrappers, its Trainer): the user's script is past them.
_HERE = os.path.dirname(os.path.abspath(__file__))
_INTERNAL = tuple(
    folder + os.sep
    for folder in (
        os.path.dirname(os.path.abspath(torch.__file__)),
        _HERE,
        os.path.join(os.path.dirname(_HERE), "ckpt_fx"),
        os.path.dirname(os.path.abspath(contextlib.__file__)),
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["platlib"],
    )
)


class BudgetWarning(UserWarning):
    """A memory budget no plan of a graph reaches: the lowest was planned instead."""


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """warnings.warn with the stack level of the first caller outside torch, ckpt_fx, passes, the
    standard library and installed packages: the line in the user's script that ran the model."""
    frame, level = sys._getframe(1), 2  # stacklevel 2 is warn_user's caller
    while frame is not None and (frame.f_code.co_filename.startswith(_INTERNAL) or frame.f_code.co_filename.startswith("<")):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
