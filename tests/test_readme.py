"""The README's Python blocks run as written, in order, in one namespace (as a reader pastes them),
on the eager inner compiler so that the test stays quick (the README's default is Inductor)."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from ckpt_fx.bench.models import build

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_the_blocks_this_test_runs():
    blocks = _blocks()
    assert len(blocks) >= 4
    assert any("ckpt_fx.enable(model)" in b for b in blocks) and any("fit(" in b for b in blocks)


def test_every_python_block_of_the_readme_runs(monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.setenv("CKPT_FX_COMPILER", "eager")
    torch.manual_seed(0)
    namespace = {"model": build("llama", layers=2, dim=32, heads=2)}  # the first block's "any nn.Module"
    for k, block in enumerate(_blocks()):
        torch._dynamo.reset()
        try:
            exec(compile(block, f"README.md python block {k + 1}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"README python block {k + 1} failed:\n{block}") from error
    printed = capsys.readouterr().out
    assert " MB" in printed and "policy" in printed  # the quick start's peak, explain's and fit's reports
