"""A plain DeepSpeed training script, run by tests/integration/test_initialize.py under real DeepSpeed and under
`import megatrain as deepspeed`. Only the import line differs between the two runs.

usage: ds_style_train.py {deepspeed,megatrain} OUT.json [--steps N] [--save-at K --ckpt DIR] [--resume DIR]
                         [--gpu-defaults]

--save-at K saves a checkpoint after optimizer step K and carries on, so one run gives both the
uninterrupted losses and the checkpoint a second process resumes from. --gpu-defaults trains in the
configuration a GPU run gets (bf16 compute, optimizer overlap, hilo; tests/gpu_defaults.py).
"""

from __future__ import annotations

import argparse
import json
import sys

parser = argparse.ArgumentParser()
parser.add_argument("backend", choices=["deepspeed", "megatrain"])
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--save-at", type=int, default=None)
parser.add_argument("--ckpt", default=None)
parser.add_argument("--resume", default=None)
parser.add_argument("--gpu-defaults", action="store_true")
cli = parser.parse_args()

if cli.backend == "deepspeed":
    import deepspeed
else:
    import megatrain as deepspeed

import torch  # noqa: E402
import transformers  # noqa: E402

GAS, MICRO, SEQ, VOCAB = 2, 2, 16, 256
DS_CONFIG = {
    "train_batch_size": GAS * MICRO,
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": GAS,
    "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3,
                                                      "warmup_num_steps": 3, "total_num_steps": 10,
                                                      "warmup_type": "linear"}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                          "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "steps_per_print": 1000,
}
if cli.gpu_defaults:
    DS_CONFIG.update(bf16={"enabled": True}, megatrain={"optimizer_overlap": True, "host_master": "hilo"})

deepspeed.init_distributed(dist_backend="gloo")
assert torch.distributed.get_rank() == 0 and torch.distributed.get_world_size() == 1
torch.manual_seed(0 if cli.resume is None else 123)  # a resumed run must get its weights from the checkpoint
config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
model = transformers.LlamaForCausalLM(config)
engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       config=DS_CONFIG)

g = torch.Generator().manual_seed(1234)
distinct = []
for _ in range(4):
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    distinct.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
batches = [distinct[i % len(distinct)] for i in range(cli.steps * GAS)]  # a repeating set the model can learn

start = 0
client = None
if cli.resume:
    _, client = engine.load_checkpoint(cli.resume)
    start = engine.global_steps

losses, lrs = [], []
engine.train()
for step in range(start, cli.steps):
    for micro in range(GAS):
        out = engine(**batches[step * GAS + micro])
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    lrs.append(engine.get_lr()[0])
    if cli.save_at is not None and engine.global_steps == cli.save_at:
        engine.save_checkpoint(cli.ckpt, client_state={"note": "mid-run", "step": engine.global_steps})

with open(cli.out, "w") as f:
    json.dump({"losses": losses, "lrs": lrs, "start": start, "global_steps": engine.global_steps,
               "micro_steps": engine.micro_steps, "client": client}, f)
sys.exit(0)
