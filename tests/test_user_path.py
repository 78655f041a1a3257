"""The path users take: `ckpt_fx.enable(model)` with its default inner compiler (Inductor) on
transformers models whose own checkpointing was switched on first (as TRL and Trainer do), batches
of varying length, LoRA on every linear layer, the trainer examples. The rest of the suite plans
with the eager inner compiler (tests/conftest.py); these run as users do, and slowly (Inductor
compiles for tens of seconds per graph on a CPU)."""

from __future__ import annotations

import copy
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import ckpt_fx
from ckpt_fx.bench.setups import hf_checkpointing_enable
from passes._compat import has_inductor_partitioner_hook

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.skipif(not has_inductor_partitioner_hook(), reason="no custom_partitioner_fn in this torch"),
              pytest.mark.slow]
ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _default_compiler(monkeypatch):
    monkeypatch.delenv("CKPT_FX_COMPILER", raising=False)


def _llama(layers: int, width: int, vocab: int = 2000) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=width, intermediate_size=176, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=vocab,
                                   max_position_embeddings=512, use_cache=False)
    return transformers.LlamaForCausalLM(cfg).train()


def _step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    for p in model.parameters():
        p.grad = None


def test_every_sequence_length_keeps_the_plan_under_inductor():
    """Llama 4 x 64 with HF's switch on, then enable (Inductor), batches of 4 at lengths 64 to 144:
    after one recompile a dynamic graph serves every length (no recompile limit reached, no call
    uncompiled) and each step's peak stays at or below HF's checkpointing alone at that length."""
    hf = _llama(4, 64)
    hf_checkpointing_enable(hf, use_reentrant=False)
    model = copy.deepcopy(hf)
    backend = ckpt_fx.enable(model)
    assert backend.options.compiler == "inductor"
    ratios, plans = {}, {}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for length in range(64, 145, 8):
            ids = torch.randint(0, 2000, (4, length))
            _step(model, ids)  # compiles where the length is new
            _step(hf, ids)
            measured = ckpt_fx.peak_bytes(lambda: _step(model, ids))
            ratios[length] = measured / ckpt_fx.peak_bytes(lambda: _step(hf, ids))
            plans[length] = len(backend.plans)
            if length == 72:  # Note [A recompile's plan]: the dynamic graph's plan in the first one's place
                assert backend.superseded and abs(ckpt_fx.step_peak_bytes(backend.plans) / measured - 1) < 0.05, (
                    ckpt_fx.step_peak_bytes(backend.plans), measured)
    assert not [w for w in record if "ran uncompiled" in str(w.message)]
    assert plans[64] == plans[144] <= 3, plans
    assert all(r <= 1.05 for r in ratios.values()), ratios



@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
def test_enable_under_inductor_peaks_at_or_below_hfs_checkpointing(family):
    """Note [A backward's blocks kept apart]: 4 blocks of 128 with grouped-query attention, HF's
    switch on, then enable (Inductor): a step's peak within 1% of HF's checkpointing alone (it
    was 1.03x to 1.12x while Inductor fused the two RMSNorm weight gradients of a block into one
    kernel after its attention backward)."""
    torch.manual_seed(0)
    config, model, extra = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
                            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
                            "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0})}[family]
    cfg = getattr(transformers, config)(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        use_cache=False, **extra)
    hf = getattr(transformers, model)(cfg).train()
    hf_checkpointing_enable(hf, use_reentrant=False)
    ours = copy.deepcopy(hf)
    ckpt_fx.enable(ours, progress=False)
    ids = torch.randint(0, 1000, (4, 128))
    for model in (hf, ours, ours):  # ours: compiled, then once more (a second step may recompile)
        _step(model, ids)
    ratio = ckpt_fx.peak_bytes(lambda: _step(ours, ids)) / ckpt_fx.peak_bytes(lambda: _step(hf, ids))
    assert ratio <= 1.01, ratio

def test_lora_on_every_linear_layer_trains_as_hfs_checkpointing_does():
    """peft LoRA r=16 on every linear layer of a Llama whose HF switch is on, then enable (Inductor):
    every block the model checkpointed is recomputed, and the adapters' gradients equal those of
    HF's checkpointing alone to Inductor's rounding. (Its peak is not yet within HF's line under
    Inductor: README, Known limits.)"""
    peft = pytest.importorskip("peft")
    base = _llama(3, 64)
    ids = torch.randint(0, 2000, (2, 64))

    def lora(enabled: bool):
        model = copy.deepcopy(base)
        hf_checkpointing_enable(model, use_reentrant=False)
        torch.manual_seed(1)  # the adapters' initial weights
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                           target_modules="all-linear"))
        model.enable_input_require_grads()
        backend = ckpt_fx.enable(model) if enabled else None
        model(input_ids=ids, labels=ids).loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        return grads, backend

    expected, _ = lora(False)
    got, backend = lora(True)
    assert got.keys() == expected.keys() and len(got) == 3 * 7 * 2
    for name in got:
        assert torch.allclose(got[name], expected[name], rtol=1e-3, atol=1e-5), name
    plan = next(p for p in backend.plans if p.checkpointed_by_model)  # peft's input hook breaks the graph
    recomputed = [b.path for b in plan.blocks if b.recomputed_ops]
    assert len(plan.checkpointed_by_model) == 3 and len(recomputed) == 3


def test_a_graph_inductor_serves_from_its_cache_keeps_its_plan(tmp_path):
    """Note [Plans of cached graphs]: a second process served the graph from Inductor's on-disk
    cache (nothing partitioned) still has its plan, as recorded by the first."""
    code = textwrap.dedent("""
        import torch, ckpt_fx
        from ckpt_fx.bench.models import build
        torch.manual_seed(0)
        model = build("llama", layers=2, dim=64, heads=2).train()
        ids = torch.randint(0, model.head.out_features, (2, 32))
        backend = ckpt_fx.backend()
        torch.compile(model, backend=backend)(ids, ids).backward()
        (plan,) = backend.plans
        print("plan", plan.from_cache, len(plan.blocks), plan.peak_bytes, ckpt_fx.step_peak_bytes(backend.plans))
    """)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}

    def run() -> list[str]:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        (line,) = [line for line in done.stdout.splitlines() if line.startswith("plan ")]
        return line.split()[1:], done.stderr

    (cached, blocks, peak, step), said = run()
    assert cached == "False" and blocks == "2" and int(peak) > 0 and said.count("planned and its forward compiled") == 1
    again, said = run()
    assert again == ["True", blocks, peak, step], (again, said[-2000:])
    assert "served from Inductor's cache" in said


@pytest.mark.parametrize("name, lines", [
    ("trainer.py", ["reloaded weights equal the trained ones: True", "disabled: True"]),
    ("trl_sft.py", ["the model's own checkpointing covered 4 blocks; recomputed in 4", "equals the trained one: True"]),
])
def test_the_trainer_examples_under_the_default_inner_compiler(name, lines):
    env = {k: v for k, v in os.environ.items() if k != "CKPT_FX_COMPILER"}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name)], capture_output=True, text=True,
                          timeout=900, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in lines:
        assert line in done.stdout, (line, done.stdout[-2000:])
    assert "ran uncompiled" not in done.stderr
