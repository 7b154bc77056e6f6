"""A DeepSpeed training script in DeepSpeed's own example style (config dict in code, the user's AdamW handed to
`deepspeed.initialize`, `model.backward` / `model.step`, `get_accelerator().set_device`, GatheredParameters around
saving, `model.tput_timer`, `model.global_rank`, `deepspeed.comm.get_rank()`), run by tests/integration/
test_ds_clients.py unchanged under `megatrain launch`, with `import megatrain as deepspeed`, with every deepspeed
import redirected, and on real DeepSpeed.

usage: main.py --out DIR [--steps N] [--save_dir DIR] [--dist_backend gloo] [--bf16]
Each rank writes DIR/rank{R}.json: the engine's class, its losses, ranks and the logits of an eval batch.
"""

from __future__ import annotations

import argparse
import json
import os

import deepspeed
import torch
import transformers
from deepspeed.accelerator import get_accelerator
from utils import device_name, embedding_of, print_rank_0, save_hf_format, to_device

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
parser.add_argument("--out", required=True)
parser.add_argument("--save_dir", default=None)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--dist_backend", default="gloo")
parser.add_argument("--bf16", action="store_true")
args = parser.parse_args()

deepspeed.init_distributed(dist_backend=args.dist_backend)
get_accelerator().set_device(args.local_rank)
device = torch.device(device_name())
rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()

MICRO, SEQ, VOCAB = 2, 16, 256
ds_config = {
    "train_batch_size": MICRO * world,
    "train_micro_batch_size_per_gpu": MICRO,
    "steps_per_print": 10,
    "zero_optimization": {"stage": 0},
    "bf16": {"enabled": args.bf16},
    "gradient_clipping": 1.0,
    "wall_clock_breakdown": False,
}

torch.manual_seed(0)
config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
model = transformers.LlamaForCausalLM(config)
assert embedding_of(model) is model.model.embed_tokens
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

g = torch.Generator().manual_seed(1234 + rank)  # each rank its own data
batches = []
for _ in range(4):
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})

losses = []
model.train()
for step in range(args.steps):
    batch = to_device(batches[step % len(batches)], device)
    loss = model(**batch, use_cache=False).loss
    model.backward(loss)
    model.step()
    losses.append(loss.item())
model.tput_timer.update_epoch_count()
print_rank_0(f"epoch {model.tput_timer.epoch_count} done on rank {model.global_rank} of {world}")

model.eval()
probe = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(99)).to(device)
with torch.no_grad():
    logits = model(input_ids=probe).logits.float().cpu()
if args.save_dir is not None:
    save_hf_format(model, args.save_dir, deepspeed.zero.GatheredParameters)

with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump({"engine": type(model).__name__, "losses": losses, "global_rank": model.global_rank,
               "comm_rank": deepspeed.comm.get_rank(), "world": world, "epochs": model.tput_timer.epoch_count,
               "probe": probe.tolist(), "logits": logits.tolist()}, f)
