"""A plain Trainer script with a DeepSpeed config that has a "megatrain" section and nothing of megatrain
imported (tests/integration/test_hf_integration.py). Prints which engine trained and its losses as `REPORT {json}`."""

import json
import sys

import torch
import transformers

torch.manual_seed(0)
cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
model = transformers.AutoModelForCausalLM.from_config(cfg)
ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": x, "labels": x} for x in ids]
ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "gradient_clipping": "auto", "zero_optimization": {"stage": 2}, "zero_force_ds_cpu_optimizer": False,
      "megatrain": {}}
args = transformers.TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=2, max_steps=2,
                                      learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                                      use_cpu=True, deepspeed=ds)
imported_before = "megatrain" in sys.modules
trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
trainer.train()
print("REPORT " + json.dumps({"engine": type(trainer.model_wrapped).__name__, "imported_before": imported_before,
                              "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}))
