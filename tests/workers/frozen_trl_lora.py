"""TRL's SFTTrainer(peft_config=LoRA r 8 on q/v), examples/trl_sft.py's model and data, 8 steps clipped, on plain TRL
or on MegaTrain (tests/integration/test_frozen_faces.py). Run as `frozen_trl_lora.py OUT_DIR plain|megatrain`;
prints `REPORT {json}`: which engine trained, per-step losses and grad norms, the files save_model wrote."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import peft  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402
from trl_sft import ds_config, texts, tiny_llama, tiny_tokenizer  # noqa: E402

out, on_megatrain = sys.argv[1], sys.argv[2] == "megatrain"
if on_megatrain:
    import megatrain.integrations.hf  # noqa: F401  Trainer's DeepSpeed path runs MegaTrain
tok = tiny_tokenizer()
args = SFTConfig(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=8,
                 learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=0.3, weight_decay=0.01,
                 logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True, max_length=32, bf16=False,
                 deepspeed=ds_config() if on_megatrain else None)
lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
trainer = SFTTrainer(model=tiny_llama(len(tok)), args=args, processing_class=tok, train_dataset=texts(64, seed=1),
                     peft_config=lora)
trainer.train()
trainer.save_model(out + "/final")
logs = [h for h in trainer.state.log_history if "loss" in h]
print("REPORT " + json.dumps({"engine": type(trainer.model_wrapped).__name__, "losses": [h["loss"] for h in logs],
                              "grad_norms": [h["grad_norm"] for h in logs],
                              "files": sorted(os.listdir(out + "/final"))}))
