"""Every example runs, and the command line answers as documented."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path):
    done = run(str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"quickstart.py", "rewrite_fx.py", "custom_policy.py", "finetune_causal_lm.py",
                                         "cnn.py", "rnn.py"}


def test_cnn_example_keeps_batchnorm_stats_and_lowers_the_peak():
    done = run(str(ROOT / "examples" / "cnn.py"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "BatchNorm running stats equal eager's: True" in done.stdout
    peaks = [float(line.split("peak")[1].split("MB")[0]) for line in done.stdout.splitlines() if "peak" in line]
    losses = [line.split("loss")[1].split()[0] for line in done.stdout.splitlines() if "loss" in line]
    assert peaks[1] < peaks[0] and losses[0] == losses[1]


def test_demo_prints_the_side_by_side_table():
    done = run("-m", "ckpt_fx", "demo", "--layers", "3", "--dim", "64", "--seq", "64", "--batch", "2", "--steps", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| setup | peak MB") and "| x aot_eager |" in lines[0]  # tests plan for the eager compiler
    eager, compiled, ckpt = (line.split("|") for line in lines[1:4])
    assert "aot_eager (no checkpointing)" in compiled[1] and "(eager)" in ckpt[1]
    assert eager[-2] == compiled[-2] == ckpt[-2]  # the same losses, step by step
    assert float(ckpt[2]) < float(eager[2])  # lower measured peak


@pytest.mark.parametrize(
    "args, message",
    [
        (["demo", "--policy", "blokcs"], "unknown policy 'blokcs'"),
        (["demo", "--layers", "0"], "--layers must be >= 1, got 0"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_print_one_line(args, message):
    done = run("-m", "ckpt_fx", *args)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("USDT")]
    assert len(errors) == 1 and message in errors[0], done.stderr


def test_explain_command():
    done = run("-m", "ckpt_fx", "explain", "--model", "llama", "--layers", "3", "--dim", "64", "--seq", "32", "--batch", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| layers.1 |" in done.stdout and "predicted peak:" in done.stdout
