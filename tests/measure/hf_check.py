"""The default policy beside Hugging Face's per-block checkpointing on transformers models:
measured peak of a training step and the median step time, steps of every setup interleaved round
by round (one machine's drift slows them alike).

    python tests/measure/hf_check.py [--rounds 7] [--only llama,qwen3] [--sizes tiny] [--compiler eager|inductor]
        (a few minutes on 2 cores with the eager inner compiler; Inductor compiles each setup for tens of seconds)

Setups, each with HF's switch on first (activation_checkpointing_enable, use_reentrant=False), as
TRL and Trainer leave it: hf (HF alone), ckpt (then ckpt_fx.enable(model, compiler=...): the
default policy), compile (then torch.compile(model, backend=ckpt_fx.backend(compiler=...))),
hf/2 (HF's every_n_layers=2, where the installed transformers has it) beside ckpt/2 (ckpt_fx.enable
with policy "blocks:2"), and with peft LoRA r=16 on every linear layer, no dropout: hf+lora,
hf+lora+ckpt. HF's offload=True holds the saved values in host memory, which on a CPU is the same
memory: it is left to the GPU check.
"""
from __future__ import annotations

import argparse
import copy
import inspect
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
    "qwen3": lambda layers, width: _causal("Qwen3Config", "Qwen3ForCausalLM", layers, width, num_key_value_heads=2,
                                           head_dim=width // 4),
    "phi3": lambda layers, width: _causal("Phi3Config", "Phi3ForCausalLM", layers, width, num_key_value_heads=2,
                                          pad_token_id=0),
    "gemma2": lambda layers, width: _causal("Gemma2Config", "Gemma2ForCausalLM", layers, width, num_key_value_heads=2,
                                            head_dim=width // 4),
    "mixtral": lambda layers, width: _causal("MixtralConfig", "MixtralForCausalLM", layers, width, num_key_value_heads=2,
                                             num_local_experts=4, num_experts_per_tok=2),
    "bert": lambda layers, width: _causal("BertConfig", "BertForMaskedLM", layers, width),
    "gpt2": lambda layers, width: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=1000, n_embd=width, n_layer=layers, n_head=4, n_positions=256)),
}
SIZES = {"tiny": (3, 32), "small": (4, 128), "12-block": (12, 128)}


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))


def _every_n_supported(model) -> bool:
    enable = getattr(model, "activation_checkpointing_enable", None)
    return enable is not None and "every_n_layers" in inspect.signature(enable).parameters


def setups(base, compiler: str, only: set[str] | None = None) -> dict:
    def make(ckpt: str | None = None, with_lora: bool = False, every: int = 1):
        model = copy.deepcopy(base).train()
        if every == 1:
            hf_checkpointing_enable(model, use_reentrant=False)
        else:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                                  every_n_layers=every)
        if with_lora:
            model = _lora(model)
            model.enable_input_require_grads()
        if ckpt == "compile":
            return torch.compile(model, backend=ckpt_fx.backend(compiler=compiler, progress=False)), model
        if ckpt is not None:
            ckpt_fx.enable(model, None if ckpt == "default" else ckpt, compiler=compiler, progress=False)
        return model, model

    made = {"hf": lambda: make(), "ckpt": lambda: make("default"), "compile": lambda: make("compile"),
            "hf/2": lambda: make(every=2), "ckpt/2": lambda: make("blocks:2", every=2),
            "hf+lora": lambda: make(with_lora=True), "hf+lora+ckpt": lambda: make("default", with_lora=True)}
    every_n = _every_n_supported(base)
    return {name: build() for name, build in made.items()
            if (only is None or name in only) and (every_n or not name.endswith("/2"))}


PAIRS = (("ckpt", "hf"), ("compile", "hf"), ("ckpt/2", "hf/2"), ("hf+lora+ckpt", "hf+lora"))


def measure(models: dict, batch: dict, rounds: int) -> dict[str, tuple[int, float]]:
    def step(fn, model):
        fn(**batch).loss.backward()
        for p in model.parameters():
            p.grad = None

    for fn, model in models.values():
        step(fn, model)  # compiles
        step(fn, model)  # a second shape of requires_grad recompiles once (peft's input hook)
    peaks = {name: ckpt_fx.peak_bytes(lambda f=fn, m=model: step(f, m)) for name, (fn, model) in models.items()}
    times = {name: [] for name in models}
    order = list(models)
    for k in range(rounds):
        for name in order if k % 2 == 0 else reversed(order):
            start = time.perf_counter()
            step(*models[name])
            times[name].append(time.perf_counter() - start)
    return {name: (peaks[name], statistics.median(times[name])) for name in models}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", default=",".join(MODELS))
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--compiler", choices=("eager", "inductor"), default="eager")
    parser.add_argument("--setups", help="','-separated subset of hf, ckpt, compile, hf/2, ckpt/2, hf+lora, hf+lora+ckpt")
    args = parser.parse_args()
    # Seven copies of one model compile the same forward: past dynamo's limit of 8 graphs per
    # function, later setups would run uncompiled (enable says so; this check keeps them compiled).
    torch._dynamo.config.recompile_limit = 64
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; inner compiler {args.compiler}; "
          "batch 4 x 128; each setup's measured peak over its HF counterpart's (and step time)")
    print("| model | size | hf peak MB | " + " | ".join(f"{a} / {b}" for a, b in PAIRS) + " |")
    print("|---|---|---:|" + "---:|" * len(PAIRS))
    for name in args.only.split(","):
        for size in args.sizes.split(","):
            layers, width = SIZES[size]
            torch.manual_seed(0)
            torch._dynamo.reset()
            base = MODELS[name](layers, width)
            ids = torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(1))
            batch = dict(input_ids=ids, labels=ids) if name == "bert" else dict(input_ids=ids, labels=ids, use_cache=False)
            only = set(args.setups.split(",")) if args.setups else None
            got = measure(setups(base, args.compiler, only), batch, args.rounds)

            def ratio(a: str, b: str) -> str:
                if a not in got or b not in got:
                    return "n/a"
                return f"{got[a][0] / got[b][0]:.3f} ({got[a][1] / got[b][1]:.2f}x time)"

            hf = f"{got['hf'][0] / 2**20:.2f}" if "hf" in got else "n/a"
            print(f"| {name} | {size} | {hf} | " + " | ".join(ratio(a, b) for a, b in PAIRS) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
