"""Hugging Face Trainer with ckpt-fx switched on in place: train, evaluate, generate, save, reload.

    python examples/trainer.py

`ckpt_fx.enable(model)` checkpoints the model's training steps, as `gradient_checkpointing_enable()`
does, and leaves the rest alone: evaluation and `generate` run the model as it was (no compile),
`save_model` writes the usual keys, and `ckpt_fx.disable(model)` switches it off again. (A wrapper
from `torch.compile(model, ...)` would save every key as `_orig_mod.*`, which `from_pretrained`
does not recognise: it then returns freshly initialised weights.)
"""

import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import ckpt_fx

torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
model = LlamaForCausalLM(config)
backend = ckpt_fx.enable(model)  # in place; every block checkpointed in training steps

data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (32, 64))]
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, max_steps=4, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8])
    trainer.train()
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
    print("losses:", losses)
    graphs = len(backend.plans)
    print(f"planned graphs: {graphs}, {backend.plans[0].policy}, {len(backend.plans[0].recomputed)} ops recomputed")
    print("eval loss:", round(trainer.evaluate()["eval_loss"], 4))
    start = time.perf_counter()
    model.generate(torch.randint(0, 256, (1, 8)), max_new_tokens=16, do_sample=False, use_cache=True)
    print(f"generate: {time.perf_counter() - start:.2f} s; graphs planned since training: {len(backend.plans) - graphs}")
    if len(backend.plans) != graphs:
        raise SystemExit("evaluate or generate compiled the model: they must run it as it was")
    trainer.save_model(f"{out}/model")
    reloaded = LlamaForCausalLM.from_pretrained(f"{out}/model")
    same = all(torch.equal(v, model.state_dict()[k]) for k, v in reloaded.state_dict().items())
    print("reloaded weights equal the trained ones:", same)
    if not same:
        raise SystemExit("the saved checkpoint does not hold the trained weights")
ckpt_fx.disable(model)
print("disabled:", ckpt_fx.enabled(model) is None)
