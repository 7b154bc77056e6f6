"""HF Trainer on a part of a model, once on plain PyTorch and once on MegaTrain (a DeepSpeed config with a "megatrain"
section), in this one process (tests/integration/test_frozen_faces.py): the embedding frozen, and a PEFT LoRA model
(r 8 on q/v), each asked for in this one process. Prints `REPORT {json}`: per case, each run's per-step losses and grad norms,
whether the frozen embedding moved, the flags after training, and the files save_model wrote."""

import json
import os
import sys

import torch
import transformers


def run(out: str, megatrain: bool, lora: bool = False) -> dict:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.model.embed_tokens.weight.requires_grad_(False)
    before = model.model.embed_tokens.weight.detach().clone()
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.0))
    ids = torch.randint(0, 128, (10, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "zero_optimization": {"stage": 2}, "zero_force_ds_cpu_optimizer": False,
          "megatrain": {"compute_dtype": "float32"}}
    args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=5,
                                          learning_rate=1e-2 if lora else 1e-3, max_grad_norm=0.25 if lora else 1.0,
                                          logging_steps=1, save_strategy="no",
                                          report_to=[], use_cpu=True, lr_scheduler_type="constant",
                                          deepspeed=ds if megatrain else None)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    trainer.save_model(out + "/final")
    embed = model.get_input_embeddings().weight
    return {"files": sorted(os.listdir(out + "/final")), "embedding_moved": not torch.equal(embed.detach().cpu(), before),
            "engine": type(trainer.model_wrapped).__name__, "losses": [h["loss"] for h in logs],
            "grad_norms": [h["grad_norm"] for h in logs],
            "frozen_flags": sorted(n for n, p in model.named_parameters() if not p.requires_grad)}


# argv: OUT_DIR and what to run, one or more of "embedding" (frozen) and "lora", each in OUT_DIR/<what>
report = {what: {"plain": run(f"{sys.argv[1]}/{what}/plain", False, what == "lora"),
                 "megatrain": run(f"{sys.argv[1]}/{what}/megatrain", True, what == "lora")} for what in sys.argv[2:]}
print("REPORT " + json.dumps(report))
