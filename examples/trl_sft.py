"""TRL's SFTTrainer with peft LoRA and ckpt-fx: train, save the adapter, reload it.

    python examples/trl_sft.py

TRL's SFTConfig turns Hugging Face's gradient checkpointing on by default; with ckpt-fx enabled,
its plan replaces that checkpointing (nothing is recomputed twice), and the backend says so if it
recomputes fewer blocks than the model's own switch did. The tokenizer is built here from a small
word list, so nothing is downloaded.
"""

import tempfile

import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

import ckpt_fx

words = ["the", "cat", "dog", "sat", "ran", "on", "a", "mat", "log", "and", "then", "slept"]
vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *words])}
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
    pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
generator = torch.Generator().manual_seed(0)
texts = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (24,), generator=generator)) for _ in range(16)]

torch.manual_seed(0)
config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     pad_token_id=0, eos_token_id=1, bos_token_id=None)
model = LlamaForCausalLM(config)
backend = ckpt_fx.enable(model)  # before the trainer: its LoRA layers and checkpointing are traced with the model

with tempfile.TemporaryDirectory() as out:
    args = SFTConfig(output_dir=out, max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
                     save_strategy="no", report_to=[], use_cpu=True, max_length=32, dataset_text_field="text")
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tokenizer, peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
    print("gradient checkpointing (TRL's default):", args.gradient_checkpointing)
    print("losses:", losses)
    plan = backend.plans[0]
    print(f"plan: {plan.policy}; the model's own checkpointing covered {len(plan.checkpointed_by_model)} blocks; "
          f"recomputed in {sum(1 for b in plan.blocks if b.recomputed_ops)}")
    trainer.save_model(f"{out}/adapter")
    trained = {k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}
    ckpt_fx.disable(model)
    reloaded = PeftModel.from_pretrained(LlamaForCausalLM(config), f"{out}/adapter")
    again = {k: v for k, v in reloaded.state_dict().items() if "lora_" in k}
    same = trained.keys() == again.keys() and all(torch.equal(trained[k], again[k]) for k in trained)
    print(f"reloaded adapter ({len(again)} tensors) equals the trained one:", same)
    if not same or not losses:
        raise SystemExit("the saved adapter does not hold the trained weights")
