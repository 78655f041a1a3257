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


CHECKED = {"cnn.py", "trainer.py", "trl_sft.py", "lightning_module.py"}
# The longest of the rest run with the slow checks (CI runs both): the README's command stays
# under 10 minutes.
# ddp.py and fsdp2.py run under torchrun there too (tests/test_distributed.py).
SLOW = {"finetune_causal_lm.py", "rnn.py", "custom_policy.py", "ddp.py", "fsdp2.py"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW else p
                                  for p in EXAMPLES if p.name not in CHECKED], ids=lambda p: p.name)
def test_example_runs(path):
    """Every example but those whose own tests below run and read them."""
    done = run(str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"quickstart.py", "rewrite_fx.py", "custom_policy.py", "finetune_causal_lm.py",
                                         "cnn.py", "rnn.py", "trainer.py", "trl_sft.py", "lightning_module.py"}


@pytest.mark.parametrize("name, lines", [
    ("trainer.py", ["graphs planned since training: 0", "reloaded weights equal the trained ones: True", "disabled: True"]),
    # The other trainers in the slow checks (TRL's also in tests/test_user_path.py, under Inductor).
    pytest.param("trl_sft.py", ["gradient checkpointing (TRL's default): True",
                                "the model's own checkpointing covered 4 blocks; recomputed in 4", "equals the trained one: True"],
                 marks=pytest.mark.slow),
    pytest.param("lightning_module.py", ["trained 3 steps", "checkpoint keys are the module's own: True",
                                         "reloaded weights equal the trained ones: True"], marks=pytest.mark.slow),
])
def test_trainers_train_save_and_reload_an_enabled_model(name, lines):
    """ckpt_fx.enable with the trainers people use: Hugging Face's (evaluate and generate without
    compiling), TRL's SFTTrainer with LoRA (its own checkpointing replaced, every block recomputed),
    Lightning; each saves what reloads to the trained weights."""
    done = run(str(ROOT / "examples" / name))
    assert done.returncode == 0, done.stderr[-3000:]
    for line in lines:
        assert line in done.stdout, (line, done.stdout[-2000:])


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
        (["demo", "--layers", "0"], "argument --layers: must be >= 1, got 0"),
        (["bench", "--sweep", "0.5,2"], "argument --sweep: every value must be in (0, 1], got 2"),
        (["solvers", "--budgets", "0.5,a"], "argument --budgets: expected ','-separated numbers like 0.7,0.5,0.3"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_print_one_line(args, message, capsys):
    from ckpt_fx.__main__ import main

    with pytest.raises(SystemExit) as exit:
        main(args)
    assert exit.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and message in errors[0], errors


def test_help_answers_without_importing_torch():
    """`python -m ckpt_fx <command> --help` shows the defaults and the policy forms, and imports no
    torch (the package loads its names on first use)."""
    code = ("import os, sys\nos.environ['COLUMNS'] = '1000'\nfrom ckpt_fx.__main__ import main\ntry:\n    main(['bench', '--help'])\n"
            "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'\n")
    done = run("-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(default: a config file's own, else 12)" in done.stdout and "ckpt-eager:<policy>" in done.stdout
    from ckpt_fx.bench import setups

    assert ";".join(setups.CPU_SETUPS) in done.stdout and ";".join(setups.CPU_EAGER_SETUPS) in done.stdout


def test_explain_command():
    done = run("-m", "ckpt_fx", "explain", "--model", "llama", "--layers", "3", "--dim", "64", "--seq", "32", "--batch", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| layers.1 |" in done.stdout and "predicted peak:" in done.stdout
