"""fit(): a training step's memory planned on fake tensors, against the measured step."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pytest
import torch

import ckpt_fx
from ckpt_fx.fit import fit, measured_step_peak, parse_memory
from ckpt_fx.bench.models import build
from passes import step_peak_bytes
from tests._models import lora

POLICIES = ("none", "blocks:every=1,skip_first=0")


def tiny_llama():
    torch.manual_seed(0)
    model = build("llama", layers=2, dim=64, heads=4)
    ids = torch.randint(0, model.head.out_features, (4, 32))
    return model, ids


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_predicted_peak_is_within_ten_percent_of_the_measured_step(precision):
    """Forward, backward and AdamW's step (its state allocated), measured on this CPU."""
    model, ids = tiny_llama()
    report = fit(model, ids, ids, memory="1GiB", policies=POLICIES, precision=precision, device="cpu")
    for row, policy in zip(report.rows, POLICIES):
        torch._dynamo.reset()
        measured = measured_step_peak(model, (ids, ids), {}, policy=policy, precision=precision)
        assert abs(row.peak_bytes - measured) <= 0.10 * measured, (policy, row.peak_bytes, measured)


@pytest.mark.slow  # LoRA's prediction: the half-precision test below, in the default run
def test_lora_trains_only_the_adapters_and_the_prediction_holds():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=32, bos_token_id=0, eos_token_id=0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    model = lora(transformers.GPT2LMHeadModel(cfg))
    ids = torch.randint(0, 500, (4, 32))
    kwargs = {"input_ids": ids, "labels": ids, "use_cache": False}
    report = fit(model, memory="1GiB", policies=POLICIES, precision="bf16-mixed", device="cpu", **kwargs)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert report.trainable_parameters == trainable < report.parameters / 10
    for row, policy in zip(report.rows, POLICIES):
        assert row.grads_bytes == 4 * trainable and row.optimizer_bytes == 8 * trainable
        torch._dynamo.reset()
        measured = measured_step_peak(model, (), kwargs, policy=policy, precision="bf16-mixed")
        assert abs(row.peak_bytes - measured) <= 0.10 * measured, (policy, row.peak_bytes, measured)


@pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp16", marks=pytest.mark.slow)])
def test_a_half_precision_base_under_lora_is_predicted_within_ten_percent(dtype):
    """--dtype bf16 (the recipe people fine-tune with): the frozen base cast to bf16, the LoRA
    adapters kept in fp32 as peft keeps them; the prediction against a real step of the model so
    cast, within 10%."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from ckpt_fx.fit import DTYPES

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=500, max_position_embeddings=64)
    model = lora(transformers.LlamaForCausalLM(cfg))
    ids = torch.randint(0, 500, (4, 32))
    kwargs = {"input_ids": ids, "labels": ids, "use_cache": False}
    report = fit(model, memory="1GiB", policies=POLICIES, precision="bf16-mixed", device="cpu", dtype=dtype, **kwargs)
    assert report.weights_dtype == dtype and f"{dtype} weights" in str(report)
    cast = model
    for module in cast.modules():  # as model.to(dtype) before peft: the base and its buffers
        for name, p in list(module.named_parameters(recurse=False)):
            if not p.requires_grad:
                setattr(module, name, torch.nn.Parameter(p.detach().to(DTYPES[dtype]), requires_grad=False))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, b.to(DTYPES[dtype]))
    frozen = sum(p.numel() for p in cast.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in cast.parameters() if p.requires_grad)
    buffers = sum(b.numel() for b in cast.buffers())
    for row, policy in zip(report.rows, POLICIES):
        assert row.weights_bytes == 2 * (frozen + buffers) + 4 * trainable
        torch._dynamo.reset()
        measured = measured_step_peak(cast, (), kwargs, policy=policy, precision="bf16-mixed")
        assert abs(row.peak_bytes - measured) <= 0.10 * measured, (policy, row.peak_bytes, measured)


def test_lora_as_people_set_it_every_linear_layer_with_dropout_is_predicted_within_ten_percent():
    """--lora with peft's own settings: adapters on every linear layer but the output head,
    dropout on their inputs; the prediction against a real step of the same model."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from ckpt_fx.fit import parse_lora, with_lora

    settings = parse_lora("r=8,alpha=16,dropout=0.1,target_modules=all-linear")
    assert settings == {"r": 8, "lora_alpha": 16, "lora_dropout": 0.1, "target_modules": "all-linear"}
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=500, max_position_embeddings=64)
    model = with_lora(transformers.LlamaForCausalLM(cfg), **settings)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert len(adapted) == 2 * 7 and not any("lm_head" in n for n in adapted)  # q, k, v, o, gate, up, down
    ids = torch.randint(0, 500, (4, 32))
    kwargs = {"input_ids": ids, "labels": ids, "use_cache": False}
    policy = "blocks:every=1,skip_first=0"
    row = fit(model, memory="1GiB", policies=(policy,), device="cpu", **kwargs).rows[0]
    measured = measured_step_peak(model, (), kwargs, policy=policy, precision="fp32")
    assert abs(row.peak_bytes - measured) <= 0.10 * measured, (row.peak_bytes, measured)


@pytest.mark.parametrize("text, message", [
    ("alpha=32", "the rank r=N is required"),
    ("r=16,dropout=1.5", "dropout must be a probability in [0, 1)"),
    ("r=16,rank=4", "cannot read 'rank=4'"),
    ("r=16,target_modules=[]", "target_modules must be all-linear"),
])
def test_bad_lora_settings_are_named(text, message):
    from ckpt_fx.fit import parse_lora

    with pytest.raises(ValueError, match=re.escape(message)):
        parse_lora(text)


def test_when_nothing_fits_the_report_names_what_would():
    """A full fine-tune too large for the memory: the report suggests LoRA and a bf16 base, and
    offload rows give the host bytes they take."""
    model, ids = tiny_llama()
    report = fit(model, ids, ids, memory="1MiB", policies=("blocks", "offload"), device="cpu")
    assert report.best is None
    text = str(report)
    assert "would fit: train LoRA adapters" in text and "would fit: a bf16 base (--dtype bf16)" not in text
    assert report.rows[1].offloaded_bytes > 0 == report.rows[0].offloaded_bytes
    with pytest.raises(ValueError, match="dtype: expected one of fp32, bf16, fp16"):
        fit(model, ids, ids, policies=("blocks",), dtype="bf17")


class _BreakingBlock(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))

    def forward(self, h):
        h = h + self.mlp(h)
        torch._dynamo.graph_break()
        return h * 1.0


class _BrokenLoop(torch.nn.Module):
    """A graph break inside each block: dynamo runs the loop over blocks eagerly and compiles the
    block's forward, one graph run once per block."""

    def __init__(self, blocks: int = 4, width: int = 64):
        super().__init__()
        self.embed = torch.nn.Embedding(100, width)
        self.layers = torch.nn.ModuleList(_BreakingBlock(width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 100)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def test_a_graph_that_runs_once_per_block_counts_as_often_as_it_runs():
    """A graph break inside the loop over blocks: the same compiled graph runs once per block, and
    the predicted peak counts it as often (within 10% of the measured step)."""
    torch.manual_seed(0)
    model, ids = _BrokenLoop(), torch.randint(0, 100, (4, 64))
    report = fit(model, ids, memory="1GiB", policies=POLICIES, device="cpu")
    for row, policy in zip(report.rows, POLICIES):
        torch._dynamo.reset()
        measured = measured_step_peak(model, (ids,), {}, policy=policy, precision="fp32")
        assert abs(row.peak_bytes - measured) <= 0.10 * measured, (policy, row.peak_bytes, measured)


def test_a_model_far_larger_than_this_machine_is_planned_without_allocating_it():
    """About 400 GB of fp32 weights: built on the meta device, traced on fake tensors. Full
    fine-tuning with AdamW holds 16 bytes per parameter in weights, gradients and state."""
    report = fit(lambda: build("llama", layers=2, dim=65536, heads=64, vocab=256), torch.zeros(2, 16, dtype=torch.long),
                 memory="80GiB", policies=("blocks",))
    row = report.rows[0]
    assert report.parameters > 10**11
    assert row.weights_bytes == 4 * report.parameters  # no buffers in this model
    assert row.grads_bytes == row.weights_bytes and row.optimizer_bytes == 2 * row.weights_bytes
    assert row.peak_bytes >= 16 * report.parameters
    assert not row.fits and row.max_batch == 0 and report.best is None
    assert "no policy fits" in str(report) and "weights, gradients and optimizer state alone" in str(report)


def test_largest_batch_is_where_the_peak_crosses_the_memory():
    model, ids = tiny_llama()
    report = fit(model, ids, ids, policies=("blocks",), device="cpu")
    peak = report.rows[0].peak_bytes
    at_peak, below = report.for_memory(peak).rows[0], report.for_memory(peak - 1).rows[0]
    assert at_peak.fits and at_peak.max_batch >= 4
    assert not below.fits and 1 <= below.max_batch < 4
    assert report.for_memory(4 * peak).rows[0].max_batch > 4


@pytest.mark.parametrize("peak", [
    lambda b: 1000 + 37 * b,  # a batch: affine
    lambda b: 5000 + 20 * b + b * b // 3,  # a sequence under attention that stores its scores: convex
    lambda b: 1000 + 512 * ((b + 63) // 64),  # allocations rounded up to blocks
    lambda b: 1000 + (3 * b if b < 500 else 1500 + 50 * (b - 500)),  # a peak moving to another phase
    lambda b: 100,  # nothing grows with it
], ids=["affine", "convex", "steps", "kink", "flat"])
def test_the_largest_batch_search_finds_the_crossing_in_a_few_walks(peak):
    """_largest returns exactly the largest b with peak(b) <= limit (a bisection over every b says
    which), from any traced batch, in few evaluations: 4 where the peak is affine."""
    from ckpt_fx.fit import MAX_BATCH, _largest

    for limit in (50, 1037, 1074, 5000, 10**5, 3 * 10**6, 10**13):
        low, high = 0, MAX_BATCH + 1
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if peak(middle) <= limit else (low, middle)
        for traced in (1, 2, 128, 4000):
            calls = []
            assert _largest(lambda b: calls.append(b) or peak(b), limit, traced, dynamic=True) == low, (limit, traced)
            assert len(calls) <= (4 if peak(2) - peak(1) == 37 else 14), (limit, traced, calls)


def test_the_plan_at_another_batch_equals_a_trace_at_that_batch():
    model, ids = tiny_llama()
    four = fit(model, ids, ids, policies=("blocks",), device="cpu")
    eight = fit(model, torch.cat([ids, ids]), torch.cat([ids, ids]), policies=("blocks",), device="cpu")
    assert four._traced[0].peak_at(four._step, 8) == eight.rows[0].peak_bytes


def test_each_memory_size_is_planned_as_if_asked_alone():
    """budget:fit leaves a different budget at each size: one trace, each size's plan its own."""
    model, ids = tiny_llama()
    kw = dict(policies=("budget:fit",), device="cpu", optimizer="sgd")
    both = fit(model, ids, ids, memory=["4MiB", "1GiB"], **kw)
    for size in ("4MiB", "1GiB"):
        assert both.for_memory(size).rows == fit(model, ids, ids, memory=size, **kw).rows
    tight, loose = both.for_memory("4MiB").rows[0], both.for_memory("1GiB").rows[0]
    assert tight.fits and tight.recompute_flops_fraction > 0 == loose.recompute_flops_fraction
    with pytest.raises(ValueError, match="budget:fit was planned for 4MiB, 1GiB, not 2GiB"):
        both.for_memory("2GiB")


def test_the_recommended_policy_pasted_into_the_backend_plans_what_fit_predicted():
    model, ids = tiny_llama()
    report = fit(model, ids, ids, memory="4MiB", policies=("none", "budget:fit"), device="cpu", optimizer="sgd")
    row = report.rows[1]
    assert report.best == row.policy and row.policy_text == "budget:2.27MiB"
    assert f"as written for enable: policy='{row.policy_text}'" in str(report)
    backend = ckpt_fx.backend(policy=row.policy_text, compiler="eager", logits="drop")
    torch.compile(copy.deepcopy(model), backend=backend)(ids, ids).backward()
    assert step_peak_bytes(backend.plans) == step_peak_bytes(report._traced[1].plans)
    # The same ops recomputed (the fake trace names its nodes apart: it carries the batch's symbol).
    assert [(len(p.recomputed), p.recompute_flops) for p in backend.plans] == [
        (len(p.recomputed), p.recompute_flops) for p in report._traced[1].plans]


@pytest.mark.parametrize("bad, message", [
    (dict(memory="24 gigs"), "memory: expected a positive size"),
    (dict(memory=0), "memory: expected a positive size"),
    (dict(precision="fp16"), "precision: expected one of fp32, bf16-mixed"),
    (dict(optimizer="lion"), "optimizer: expected one of"),
    (dict(trainable=["no.such.*"]), "no parameter requires grad"),
    (dict(policies=("blocks:x",)), "blocks"),
])
def test_bad_input_is_named(bad, message):
    model, ids = tiny_llama()
    with pytest.raises(ValueError, match=message):
        fit(model, ids, ids, **bad)


def test_a_batch_of_one_is_refused_with_the_reason():
    model, ids = tiny_llama()
    with pytest.raises(ValueError, match="batch of at least 2"):
        fit(model, ids[:1], ids[:1])


def test_memory_units():
    assert parse_memory("24GiB") == 24 * 2**30 and parse_memory("80GB") == 80 * 10**9
    assert parse_memory("512 MiB") == 512 * 2**20 and parse_memory(1000) == 1000


@pytest.mark.slow
def test_cli_writes_one_json_row_per_memory_and_policy(tmp_path):
    out = tmp_path / "fit.json"
    done = subprocess.run(
        [sys.executable, "-m", "ckpt_fx", "fit", "--model", "llama", "--layers", "2", "--dim", "64", "--batch", "2",
         "--seq", "32", "--memory", "8MiB,1GiB", "--policies", "none;blocks", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [(r["memory_bytes"], r["policy"].split("(")[0]) for r in rows] == [
        (8 * 2**20, "none"), (8 * 2**20, "blocks"), (2**30, "none"), (2**30, "blocks")]
    for r in rows:
        assert {"policy", "peak_bytes", "weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                "max_batch", "recompute_flops_fraction"} <= r.keys()
        assert r["peak_bytes"] >= r["weights_bytes"] + r["grads_bytes"] + r["optimizer_bytes"]
    assert "fastest policy that fits" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "ckpt_fx", "fit", "--memory", "lots"], capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode == 2 and "memory: expected a positive size" in bad.stderr


def _llama_config(tmp_path, **fields):
    """A config.json as a hub repository holds one: a small Llama-3 (grouped-query attention, its
    rope theta, bf16 as the stored dtype)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 224, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 512, "max_position_embeddings": 256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", **fields}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_a_config_json_plans_the_model_it_describes(tmp_path):
    """--model takes a config.json (or its directory): the model built is the one those fields
    describe, planned as the same model built from its config class."""
    pytest.importorskip("transformers")
    from ckpt_fx.bench.workloads import hf_workload, workload

    path = _llama_config(tmp_path)
    from_file, from_dir = workload(str(path), batch=2, seq=32), workload(str(tmp_path), batch=2, seq=32)
    by_class = hf_workload("LlamaConfig", layers=2, dim=64, heads=4, vocab=512, batch=2, seq=32,
                           overrides={"intermediate_size": 224, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": False})
    shapes = lambda w: [(n, p.shape) for n, p in w.model.named_parameters()]  # noqa: E731
    assert shapes(from_file) == shapes(from_dir) == shapes(by_class)
    assert type(from_file.model).__name__ == "LlamaForCausalLM"
    policies = ("blocks:every=1,skip_first=0",)
    planned = [fit(w.model, memory="1GiB", policies=policies, device="cpu", **w.kwargs).rows[0].peak_bytes
               for w in (from_file, by_class)]
    assert planned[0] == planned[1]
    smaller = workload(str(path), layers=1, batch=2, seq=32)  # --layers overrides the file's
    assert smaller.model.config.num_hidden_layers == 1


@pytest.mark.parametrize("config, kind", [
    pytest.param({"model_type": "t5", "d_model": 64, "d_ff": 128, "num_layers": 2, "num_heads": 4, "d_kv": 16,
                  "vocab_size": 300, "decoder_start_token_id": 0, "pad_token_id": 0},
                 "T5ForConditionalGeneration", marks=pytest.mark.slow),
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "vocab_size": 300}, "BertForMaskedLM"),
])
def test_a_seq2seq_or_encoder_config_is_built_as_its_language_model(tmp_path, config, kind):
    pytest.importorskip("transformers")
    from ckpt_fx.bench.workloads import workload

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    built = workload(str(path), batch=2, seq=16)
    assert type(built.model).__name__ == kind
    report = fit(built.model, memory="1GiB", policies=("blocks",), device="cpu", **built.kwargs)
    assert report.rows[0].fits and report.parameters == sum(p.numel() for p in built.model.parameters())


def test_a_bad_config_is_named_in_one_line(tmp_path, capsys):
    pytest.importorskip("transformers")
    from ckpt_fx.__main__ import main

    (tmp_path / "empty").mkdir()
    (tmp_path / "other.json").write_text(json.dumps({"not": "a config"}))
    path = _llama_config(tmp_path)
    for model, extra, message in [
        (str(tmp_path / "missing.json"), [], "no such file"),
        (str(tmp_path / "empty"), [], "the directory holds no config.json"),
        (str(tmp_path / "other.json"), [], "transformers cannot read it as a model config"),
        (str(path), ["--config", "no_such_key=1"], "has no attribute 'no_such_key'"),
        (str(path), ["--seq", "512"], "longer than the config's max_position_embeddings (256)"),
        # checked before the model is built: a misspelt policy or LoRA option, whatever the model
        (str(tmp_path / "missing.json"), ["--policies", "blocks;sqr"], "unknown policy 'sqr' (did you mean 'sqrt'?)"),
        (str(tmp_path / "missing.json"), ["--lora", "r=x"], "--lora: r must be a whole number"),
    ]:
        with pytest.raises(SystemExit) as stopped:
            main(["fit", "--model", model, "--batch", "2", *extra])
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if "error" in line]
        assert stopped.value.code == 2 and len(errors) == 1 and message in errors[0], err
        assert ("building the model" in err) is (model != str(tmp_path / "missing.json") or not extra), err


@pytest.mark.slow
def test_the_longest_sequence_is_where_the_peak_crosses_the_memory(tmp_path, capsys):
    """--max-seq: the sequence traced as dynamic; each row's longest sequence fits, one token more
    does not, and the plan's peak there equals a trace at that length."""
    pytest.importorskip("transformers")
    from ckpt_fx.__main__ import main
    from ckpt_fx.bench.workloads import workload

    path = _llama_config(tmp_path, max_position_embeddings=4096)
    at = lambda seq: workload(str(path), batch=2, seq=seq)  # noqa: E731
    traced = at(64)
    report = fit(traced.model, memory="6MiB", policies=("none", "blocks"), device="cpu", seq_dim=1, **traced.kwargs)
    assert all(64 < row.max_seq < 4096 for row in report.rows), report.rows
    row, plans = report.rows[1], report._traced[1]
    for seq, fits in ((row.max_seq, True), (row.max_seq + 1, False)):
        alone = at(seq)
        again = fit(alone.model, memory="6MiB", policies=(row.policy_text,), device="cpu", **alone.kwargs).rows[0]
        assert again.fits is fits and again.peak_bytes == plans.peak_at(report._step, 2, seq)
    assert report.rows[1].max_seq > report.rows[0].max_seq
    assert main(["fit", "--model", str(path), "--batch", "2", "--seq", "64", "--memory", "6MiB", "--policies", "blocks",
                 "--device", "cpu", "--max-seq"]) == 0
    assert "| longest sequence at batch 2 |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="differs from the batch"):
        fit(traced.model, torch.zeros(4, 4, dtype=torch.long), policies=("none",), seq_dim=1)


def test_several_gpus_under_fsdp2_hold_a_shard_each_and_the_fewest_that_fit_is_found():
    """Per rank: 1/N of every parameter, gradient and optimizer state (dim 0 padded to a multiple
    of N); the unsharded root and blocks while the step runs; the fewest GPUs that fit. (The
    prediction against two measured ranks: tests/test_distributed.py.)"""
    model, ids = tiny_llama()
    policies = ("blocks:every=1,skip_first=0",)
    one = fit(model, ids, ids, memory="1GiB", policies=policies, device="cpu").rows[0]
    four = fit(model, ids, ids, memory="1GiB", policies=policies, device="cpu", gpus=4)
    row = four.rows[0]
    shards = sum(-(-p.shape[0] // 4) * (p.numel() // p.shape[0]) * p.element_size() if p.dim() else p.element_size()
                 for p in model.parameters())
    assert row.weights_bytes == shards < one.weights_bytes / 3 and row.optimizer_bytes == 2 * row.grads_bytes
    assert row.gathered_bytes > 0 == one.gathered_bytes and row.min_gpus == 1 and one.min_gpus is None
    assert "per rank of 4 GPUs, FSDP2 full shard" in str(four)
    tight = four.for_memory(row.peak_bytes - 1)  # one byte short on 4 GPUs: more of them fit
    assert not tight.rows[0].fits and tight.rows[0].min_gpus > 4
    assert f"would fit: {tight.rows[0].min_gpus} GPUs under FSDP2 (--gpus {tight.rows[0].min_gpus})" in str(tight)
    for bad, message in ((dict(gpus=0), "gpus: expected a whole number >= 1"), (dict(gpus=2, shard="zero3"), "shard:")):
        with pytest.raises(ValueError, match=message):
            fit(model, ids, ids, policies=policies, **bad)


@pytest.mark.slow  # fit's step against a measured one: the default run keeps fp32, bf16-mixed and a bf16 LoRA base
def test_gradient_accumulation_is_predicted_within_ten_percent_and_suggested():
    """--grad-accum 2: the first micro-batch's gradients are held through the second's forward and
    backward; against a measured step of two micro-batches. When a batch does not fit, accumulating
    smaller ones is suggested with its figures."""
    from ckpt_fx.measure import peak_bytes

    model, ids = tiny_llama()
    policy = "blocks:every=1,skip_first=0"
    report = fit(model, ids, ids, memory="1GiB", policies=(policy,), device="cpu", grad_accum=2)
    single = fit(model, ids, ids, memory="1GiB", policies=(policy,), device="cpu").rows[0]
    assert report.rows[0].peak_bytes > single.peak_bytes and "2 micro-batches accumulated" in str(report)
    measuring = copy.deepcopy(model).train()
    compiled = torch.compile(measuring, backend="ckpt", options={"policy": policy, "compiler": "eager", "logits": "drop"})
    optimizer = torch.optim.AdamW(measuring.parameters(), foreach=False)

    def step() -> None:
        for _ in range(2):
            compiled(ids, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    held = [*measuring.parameters(), *(v for s in optimizer.state.values() for v in s.values() if v.dim())]
    measured = sum(t.untyped_storage().nbytes() for t in held) + peak_bytes(step)
    assert abs(report.rows[0].peak_bytes - measured) <= 0.10 * measured, (report.rows[0].peak_bytes, measured)
    tight = fit(model, torch.cat([ids] * 4), torch.cat([ids] * 4), memory=single.peak_bytes + single.grads_bytes + 2**16,
                policies=(policy,), device="cpu")
    assert tight.best is None and re.search(r"would fit: \d+ micro-batches of \d+ accumulated \(--batch \d+ --grad-accum \d+",
                                            str(tight)), str(tight)


CUT_POLICIES = ("none", "blocks", "selective", "offload")


def _row_figures(row):
    return (row.peak_bytes, row.activations_bytes, row.offloaded_bytes, row.max_batch, row.max_seq, row.min_gpus,
            row.recomputed_ops, round(row.recompute_flops_fraction, 9), row.fits)


@pytest.mark.slow
@pytest.mark.parametrize("lora_adapters", [False, True])
def test_alike_blocks_planned_on_a_cut_model_give_the_whole_models_figures(lora_adapters):
    """Note [Planning from a few alike blocks]: a transformers Llama of 7 blocks planned from cuts
    of 2, 3 and 4 blocks gives every figure of every row that planning all 7 gives (peak,
    activations, offload, largest batch, longest sequence, fewest GPUs, recompute)."""
    from ckpt_fx.bench.workloads import hf_workload
    from ckpt_fx.fit import with_lora

    with torch.device("meta"):
        work = hf_workload("LlamaConfig", layers=7, dim=64, heads=4, vocab=2000, batch=2, seq=128)
        model = with_lora(work.model, r=4) if lora_adapters else work.model
    kwargs = dict(memory="256MiB", policies=CUT_POLICIES, device="cuda", seq_dim=1, gpus=2, **work.kwargs)
    cut, whole = fit(model, **kwargs), fit(model, every_block=True, **kwargs)
    assert (cut.planned_from, whole.planned_from) == (7, 0)
    assert "cut to 2, 3 and 4 of its 7 alike blocks" in str(cut) and "cut to" not in str(whole)
    assert [_row_figures(r) for r in cut.rows] == [_row_figures(r) for r in whole.rows]
    assert len(work.model.model.layers) == work.model.config.num_hidden_layers == 7  # the cuts leave it whole


@pytest.mark.slow
def test_a_policy_that_depends_on_the_whole_stack_or_blocks_that_differ_plan_every_block(monkeypatch):
    """Only policies that treat each block alike are planned from cuts (sqrt's segments follow
    the stack's length; a budget is one for the whole graph); only a stack of alike blocks, long
    enough, with no per-layer types in its config is cut; a cut whose figures do not lie on a
    line (here: any, by a negative slack) is planned again on every block."""
    import ckpt_fx.fit as fit_module
    from ckpt_fx import policies

    alike = ("none", "blocks", "offload", "selective", "blocks:every=1,skip_first=0")
    whole = ("sqrt", "segments:2", "blocks:2", "budget:0.5", "blocks:every=1,skip_first=2", "selective:skip_first=1")
    assert [fit_module._alike_per_block(policies.parse(p)) for p in alike + whole] == [True] * 5 + [False] * 6
    assert not fit_module._alike_per_block(lambda info: policies.parse("blocks")(info))  # a user's own: not known
    deep = build("llama", layers=6, dim=64, heads=4)
    assert fit_module._alike_stack(deep) is deep.layers
    assert fit_module._alike_stack(build("llama", layers=5, dim=64, heads=4)) is None  # too few to cut
    deep.config = type("Config", (), {"layer_types": ["sliding_attention", "full_attention"] * 3})()
    assert fit_module._alike_stack(deep) is None
    del deep.config
    ids = torch.randint(0, deep.head.out_features, (4, 32))
    both = fit(deep, ids, ids, memory="1GiB", policies=("blocks", "sqrt"), device="cpu")
    assert (both.planned_from, both.planned_whole_for) == (0, ("sqrt",))
    assert fit(deep, ids, ids, memory="1GiB", policies=("blocks", "sqrt"), device="cpu",
               every_block=True).planned_whole_for == ()  # asked for, not forced by a policy
    monkeypatch.setattr(fit_module, "LINEAR_SLACK", -1.0)
    off_the_line = fit(deep, ids, ids, memory="1GiB", policies=("blocks",), device="cpu")
    assert (off_the_line.planned_from, off_the_line.planned_whole_for) == (0, ())
