"""The default policy beside Hugging Face's per-block checkpointing on transformers models, on the
same (eager) kernels: measured peak of a training step and the median step time, steps of every
setup interleaved round by round (one machine's drift slows them alike). And the TRL case: a peft
LoRA model with HF's checkpointing on (TRL's default), then ckpt-fx enabled on top of it.

    python tests/hf_check.py [--rounds 7] [--only llama,gpt2]      (a few minutes on 2 cores)

Setups: eager (no checkpointing), hf (activation_checkpointing_enable, use_reentrant=False),
ckpt (ckpt_fx.enable(model, compiler="eager"): the default policy), and with LoRA r=8 on q/v:
hf+lora, hf+lora+ckpt.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
import transformers

import ckpt_fx
from ckpt_fx.bench.setups import hf_checkpointing_enable


def _causal(config: str, model: str, layers: int, width: int, **extra):
    cfg = getattr(transformers, config)(vocab_size=1000, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                                        num_attention_heads=4, max_position_embeddings=256, **extra)
    return getattr(transformers, model)(cfg)


MODELS = {
    "llama": lambda layers, width: _causal("LlamaConfig", "LlamaForCausalLM", layers, width, num_key_value_heads=2),
    "mixtral": lambda layers, width: _causal("MixtralConfig", "MixtralForCausalLM", layers, width, num_key_value_heads=2,
                                             num_local_experts=4, num_experts_per_tok=2),
    "bert": lambda layers, width: _causal("BertConfig", "BertForMaskedLM", layers, width),
    "gpt2": lambda layers, width: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=1000, n_embd=width, n_layer=layers, n_head=4, n_positions=256)),
}
SIZES = {"tiny": (3, 32), "12-block": (12, 128)}


def _lora(model):
    from peft import LoraConfig, get_peft_model

    target = ["c_attn"] if isinstance(model, transformers.GPT2LMHeadModel) else (
        ["query", "value"] if isinstance(model, transformers.BertForMaskedLM) else ["q_proj", "v_proj"])
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=target))


def setups(base, lora: bool):
    def make(hf: bool, ckpt: bool, with_lora: bool):
        model = copy.deepcopy(base).train()
        if hf:
            hf_checkpointing_enable(model, use_reentrant=False)
        if with_lora:
            model = _lora(model)
            model.enable_input_require_grads()
        if ckpt:
            ckpt_fx.enable(model, compiler="eager")
        return model

    out = {"eager": make(False, False, False), "hf": make(True, False, False), "ckpt": make(False, True, False)}
    if lora:
        out["hf+lora"] = make(True, False, True)
        out["hf+lora+ckpt"] = make(True, True, True)
    return out


def measure(models: dict, batch: dict, rounds: int) -> dict[str, tuple[int, float]]:
    def step(model):
        model(**batch).loss.backward()
        for p in model.parameters():
            p.grad = None

    for model in models.values():
        step(model)  # compiles
        step(model)  # a second shape of requires_grad recompiles once (peft's input hook)
    peaks = {name: ckpt_fx.peak_bytes(lambda m=model: step(m)) for name, model in models.items()}
    times = {name: [] for name in models}
    order = list(models)
    for k in range(rounds):
        for name in order if k % 2 == 0 else reversed(order):
            start = time.perf_counter()
            step(models[name])
            times[name].append(time.perf_counter() - start)
    return {name: (peaks[name], statistics.median(times[name])) for name in models}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", default=",".join(MODELS))
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; batch 4 x 128; peak MB (x hf), step s (x hf)")
    print("| model | size | eager | hf per-block | ckpt default | default / hf peak | default / hf time | hf+LoRA | hf+LoRA+ckpt | peak ratio | time ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.only.split(","):
        for size, (layers, width) in SIZES.items():
            torch.manual_seed(0)
            torch._dynamo.reset()
            base = MODELS[name](layers, width)
            ids = torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(1))
            batch = dict(input_ids=ids, labels=ids) if name == "bert" else dict(input_ids=ids, labels=ids, use_cache=False)
            got = measure(setups(base, lora=True), batch, args.rounds)

            def cell(key):
                peak, seconds = got[key]
                return f"{peak / 2**20:.1f} MB, {seconds:.3f} s"

            def ratio(a, b, i):
                return f"{got[a][i] / got[b][i]:.3f}"

            print(f"| {name} | {size} | {cell('eager')} | {cell('hf')} | {cell('ckpt')} | {ratio('ckpt', 'hf', 0)} | "
                  f"{ratio('ckpt', 'hf', 1)} | {cell('hf+lora')} | {cell('hf+lora+ckpt')} | {ratio('hf+lora+ckpt', 'hf+lora', 0)} | "
                  f"{ratio('hf+lora+ckpt', 'hf+lora', 1)} |", flush=True)


if __name__ == "__main__":
    main()
