"""A DeepSpeed script that builds its model under a stage-3 config (`HfDeepSpeedConfig` active at `from_pretrained`,
as DeepSpeed-Chat does), then trains it. Run by tests/integration/test_ds_clients.py under `megatrain launch`
(transformers builds the model whole) and with `import megatrain as deepspeed` (real DeepSpeed partitions it;
`initialize` gathers it once).

usage: ds_stage3_main.py MODEL_DIR OUT.json
"""

from __future__ import annotations

import json
import sys

import deepspeed
import torch
import transformers
from transformers.integrations import HfDeepSpeedConfig

model_dir, out = sys.argv[1], sys.argv[2]
ds_config = {
    "train_batch_size": 2,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
}
deepspeed.init_distributed(dist_backend="gloo")
dschf = HfDeepSpeedConfig(ds_config)  # kept alive: transformers asks it while building
model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
g = torch.Generator().manual_seed(5)
losses = []
for _ in range(6):
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
with open(out, "w") as f:
    json.dump({"engine": type(engine).__name__, "partitioned_at_build": partitioned, "losses": losses}, f)
