"""Fine-tuning a LLaMA-style causal LM (transformers, small config, random weights) the way the
checkpointing article does it: every 4th block checkpointed (`if i > 0 and i % 4 == 0`), bf16
autocast, gradient accumulation. Prints the loss and the measured peak beside a run without it.

    python examples/finetune_causal_lm.py
"""

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ckpt_fx

ACCUMULATE = 4

torch.manual_seed(0)
config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
base = LlamaForCausalLM(config).train()
batches = [torch.randint(0, 1000, (2, 128)) for _ in range(ACCUMULATE)]


def train(model, fn, steps=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []

    def one_step():
        for ids in batches:  # gradient accumulation over micro-batches
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = fn(input_ids=ids, labels=ids, use_cache=False).loss / ACCUMULATE
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step()  # warm-up: compiles
    peak = ckpt_fx.peak_bytes(one_step)
    for _ in range(steps - 2):
        one_step()
    return losses, peak


for name, policy in [("no checkpointing", None), ("every 4th block (blocks:4)", "blocks:4"), ("segments of 4", "segments:4")]:
    model = copy.deepcopy(base)
    fn = model if policy is None else torch.compile(model, backend="ckpt", options={"policy": policy})
    losses, peak = train(model, fn)
    print(f"{name:28s} first losses {', '.join(f'{v:.4f}' for v in losses[:4])}  peak {peak / 2**20:6.1f} MB")
    torch.compiler.reset()
