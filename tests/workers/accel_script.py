"""One Accelerate-style training script, run unchanged through every `megatrain.Accelerator` backend.

Imported by the tests for the in-process backends, and run as `python tests/workers/accel_script.py
train|checkpoint BACKEND OUT.json [JSON kwargs]` for DeepSpeed, which may initialise torch.distributed
only once per process.
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
from typing import Any

import torch
import transformers

VOCAB = 256


def llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB,
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(llama_config())


class TokenData(torch.utils.data.Dataset):
    """Random token rows; every other row left-padded, a few labels masked with -100."""

    def __init__(self, n: int, seq: int = 24, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=g)
        self.mask = torch.ones_like(self.ids)
        self.mask[1::2, : seq // 4] = 0
        self.labels = self.ids.clone()
        self.labels[self.mask == 0] = -100
        self.labels[::3, seq // 2] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def warmup(step: int, warmup_steps: int = 4) -> float:
    return min(1.0, (step + 1) / warmup_steps)


def train(
    backend: str,
    *,
    steps: int = 10,
    accum: int = 2,
    micro_batch: int = 2,
    lr: float = 1e-3,
    clip: float | None = 1.0,
    seed: int = 0,
    gradient_checkpointing: bool = False,
    config: dict[str, Any] | None = None,
) -> dict[str, list[float]]:
    """Train `steps` optimizer steps; return per-micro-batch losses, per-step norms and LRs, and
    whether HF gradient checkpointing was on (None where the backend has no such switch)."""
    from megatrain.accelerate import Accelerator

    model = build_model(seed)
    accelerator = Accelerator(backend=backend, config=config, gradient_accumulation_steps=accum,
                              gradient_checkpointing=gradient_checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    loader = torch.utils.data.DataLoader(TokenData(steps * accum * micro_batch), batch_size=micro_batch)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    losses: list[float] = []
    norms: list[float] = []
    lrs: list[float] = []
    for batch in loader:
        with accelerator.accumulate(model):
            out = model(**batch)
            accelerator.backward(out.loss)
            losses.append(out.loss.item())
            if accelerator.sync_gradients:
                lrs.append(optimizer.param_groups[0]["lr"])  # the LR this step is taken with
                if clip is not None:
                    norm = accelerator.clip_grad_norm_(model.parameters(), clip)
                    norms.append(float("nan") if norm is None else float(norm))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    gc = getattr(accelerator.unwrap_model(model), "is_gradient_checkpointing", None)
    return {"losses": losses, "norms": norms, "lrs": lrs, "gradient_checkpointing": gc}


def _steps(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, batches: list[dict[str, torch.Tensor]],
           clip: float) -> list[float]:
    losses = []
    for batch in batches:
        with accelerator.accumulate(model):
            out = model(**{k: v.to(accelerator.device) for k, v in batch.items()})
            accelerator.backward(out.loss)
            losses.append(out.loss.item())
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return losses


def _roundtrip_batches(accum: int) -> list[dict[str, torch.Tensor]]:
    data = TokenData(8 * accum * 2, seed=7)
    return [{k: v[i:i + 2] for k, v in data[:].items()} for i in range(0, len(data), 2)]


def probe_batch(accum: int = 2) -> dict[str, torch.Tensor]:
    return _roundtrip_batches(accum)[-1]


def checkpoint_roundtrip(backend: str, workdir: str, *, clip: float = 1.0, accum: int = 2, seed: int = 0,
                         config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train 2 steps, save_state, train 2 more; load_state and redo those 2; save_model to workdir/hf.

    Returns the losses of the first 4 steps, of the redone 2, and the trained model's eval loss on
    `probe_batch()`, which a model reloaded from workdir/hf must reproduce. (Reload it in another
    process for zero3: under Accelerate's DeepSpeed integration, HF models built after prepare in the
    same process are constructed partitioned.)
    """
    from megatrain.accelerate import Accelerator

    batches = _roundtrip_batches(accum)
    model = build_model(seed)
    accelerator = Accelerator(backend=backend, config=config, gradient_accumulation_steps=accum)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    model.train()
    n = 2 * accum
    first = _steps(accelerator, model, optimizer, scheduler, batches[:n], clip)
    accelerator.save_state(f"{workdir}/state")
    after = _steps(accelerator, model, optimizer, scheduler, batches[n:2 * n], clip)
    accelerator.load_state(f"{workdir}/state")
    redo = _steps(accelerator, model, optimizer, scheduler, batches[n:2 * n], clip)

    accelerator.save_model(model, f"{workdir}/hf")
    model.eval()
    with torch.no_grad():
        probe = {k: v.to(accelerator.device) for k, v in probe_batch(accum).items()}
        model_loss = model(**probe).loss.item()
    return {"losses": first + after, "redo": redo, "model_loss": model_loss}


@functools.cache
def _torch_reference(task: str, kwargs_json: str) -> str:
    kwargs = json.loads(kwargs_json)
    if task == "train":
        return json.dumps(train("torch", **kwargs))
    with tempfile.TemporaryDirectory() as tmp:
        return json.dumps(checkpoint_roundtrip("torch", tmp, **kwargs))


def torch_reference(task: str, **kwargs: Any) -> dict[str, Any]:
    """The plain-PyTorch result of `train` or `checkpoint_roundtrip`, computed once per process."""
    return json.loads(_torch_reference(task, json.dumps(kwargs, sort_keys=True)))


if __name__ == "__main__":
    task, backend, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    kwargs = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    torch.set_num_threads(2)
    result = train(backend, **kwargs) if task == "train" else checkpoint_roundtrip(backend, **kwargs)
    with open(out_path, "w") as f:
        json.dump(result, f)
