"""DeepSpeed-Chat's reward-model step in DeepSpeed's own style (step 2 of its RLHF recipe): a `RewardModel` wrapping a
causal LM's base model and a `v_head`, the pairwise loss of chosen over rejected at each row's last non-pad token,
the config dict in code, the user's AdamW to `deepspeed.initialize`, `model.backward` / `model.step`. Run by
tests/integration/test_ds_clients.py unchanged under `megatrain launch` and on real DeepSpeed.

usage: main.py --out DIR [--steps N]      writes DIR/rank{R}.json: the engine's class, its losses, its pre-clip norms
"""

from __future__ import annotations

import argparse
import json
import os

import deepspeed
import torch
import torch.nn.functional as F
import transformers
from deepspeed.accelerator import get_accelerator

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=12)
args = parser.parse_args()

deepspeed.init_distributed(dist_backend="gloo")
get_accelerator().set_device(args.local_rank)
device = torch.device(get_accelerator().device_name())
rank = deepspeed.comm.get_rank()
PAD, MICRO, SEQ, VOCAB = 0, 4, 20, 256


class RewardModel(torch.nn.Module):
    """DeepSpeed-Chat's dschat/utils/model/reward_model.py, trimmed to its loss."""

    def __init__(self, base_model: torch.nn.Module, pad_id: int) -> None:
        super().__init__()
        self.config = base_model.config
        self.v_head = torch.nn.Linear(self.config.hidden_size, 1, bias=False)
        self.rwtranrsformer = base_model
        self.PAD_ID = pad_id

    def forward(self, input_ids=None, attention_mask=None, use_cache=False):
        hidden = self.rwtranrsformer(input_ids, attention_mask=attention_mask, use_cache=use_cache)[0]
        rewards = self.v_head(hidden).squeeze(-1)
        bs = input_ids.shape[0] // 2
        last = (torch.arange(input_ids.shape[1], device=input_ids.device) * (input_ids != self.PAD_ID)).argmax(-1)
        end = rewards[torch.arange(input_ids.shape[0], device=input_ids.device), last]
        return {"loss": -F.logsigmoid(end[:bs] - end[bs:]).mean(), "chosen_mean_scores": end[:bs],
                "rejected_mean_scores": end[bs:]}


ds_config = {"train_batch_size": MICRO, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 100,
             "zero_optimization": {"stage": 0}, "bf16": {"enabled": False}, "gradient_clipping": 1.0}
torch.manual_seed(0)
config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=PAD)
model = RewardModel(transformers.AutoModelForCausalLM.from_config(config).model, PAD)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

g = torch.Generator().manual_seed(1234)
batches = []
for _ in range(4):
    ids = torch.randint(3, VOCAB, (MICRO, SEQ), generator=g)
    for row, length in enumerate(torch.randint(8, SEQ + 1, (MICRO,), generator=g).tolist()):
        ids[row, length:] = PAD
    batches.append({"input_ids": ids, "attention_mask": (ids != PAD).long()})

losses, norms = [], []
model.train()
for step in range(args.steps):
    batch = {k: v.to(device) for k, v in batches[step % len(batches)].items()}
    loss = model(**batch, use_cache=False)["loss"]
    model.backward(loss)
    model.step()
    losses.append(loss.item())
    norms.append(model.get_global_grad_norm())  # None on DeepSpeed at stage 0 in FP32 (it keeps none)

with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump({"engine": type(model).__name__, "losses": losses, "norms": norms}, f)
