"""accelerate's DeepSpeed road with a "megatrain" section, as an Accelerate example ends: train, then
`unwrap_model(model).save_pretrained(..., is_main_process=..., save_function=accelerator.save,
state_dict=accelerator.get_state_dict(model))` and `accelerator.save_model(model, ...)`.

usage: accelerate_ds_save.py OUT STAGE    (writes OUT/report.json, OUT/engine.pt, OUT/pretrained/, OUT/save_model/)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, extract_model_from_parallel

out, stage = Path(sys.argv[1]), int(sys.argv[2])
ds = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
      "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}, "megatrain": {}}
accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds))
torch.manual_seed(0)
config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
model = transformers.LlamaForCausalLM(config)
initial = {k: v.clone() for k, v in model.state_dict().items()}
model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
g = torch.Generator().manual_seed(1)
for _ in range(3):
    ids = torch.randint(0, 256, (2, 16), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()

unwrapped = accelerator.unwrap_model(model)
unwrapped.save_pretrained(out / "pretrained", is_main_process=accelerator.is_main_process,
                          save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
accelerator.save_model(model, out / "save_model")
trained = model.state_dict()
torch.save(trained, out / "engine.pt")
(out / "report.json").write_text(json.dumps({
    "engine": type(model).__name__, "unwrapped": type(unwrapped).__name__,
    "extract_is_unwrapped": extract_model_from_parallel(model) is unwrapped,
    "moved": max((trained[k] - initial[k]).abs().max().item() for k in initial)}))
