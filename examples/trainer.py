"""Hugging Face Trainer with ckpt-fx: compile the model in place, hand it over as usual, save it,
reload it. Prints the losses and checks that the reloaded weights are the trained ones.

    python examples/trainer.py

`model.compile(backend="ckpt")` compiles the model's forward in place: the Trainer sees the model
itself (no `remove_unused_columns=False` needed), and `save_model` writes the usual keys. A
wrapper from `torch.compile(model, ...)` would save every key as `_orig_mod.*`, which
`from_pretrained` does not recognise (it then returns freshly initialised weights).
"""

import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
model = LlamaForCausalLM(config)
model.compile(backend="ckpt")  # in place: blocks checkpointed, embeddings and the first block kept

data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (32, 64))]
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
    print("losses:", losses)
    trainer.save_model(f"{out}/model")
    reloaded = LlamaForCausalLM.from_pretrained(f"{out}/model")
    same = all(torch.equal(v, model.state_dict()[k]) for k, v in reloaded.state_dict().items())
    print("reloaded weights equal the trained ones:", same)
    if not same:
        raise SystemExit("the saved checkpoint does not hold the trained weights")
