"""A frozen base loaded in bf16: what the host store holds for it (a measurement, not a test).

    python -m experiments.studies.frozen_bf16_store --out results/partial/frozen_bf16_store.json

Two models loaded in bf16 (a tiny Llama, 8 layers): the top 2 layers trainable in FP32 with the embedding and the 6
layers below frozen (layer-wise fine-tuning), and a PEFT LoRA (r 8 on q/v; PEFT keeps its adapters in FP32 over a
bf16 base). 3 steps each, FP32 compute, every layer streamed, AdamW lr 1e-3, clipping 1.0: the host store's bytes
(collect_stats()["host_store_bytes"]: masters, shadows, slabs, Adam m/v), per parameter, the host-to-device bytes
per step and the losses (bit for bit the same wherever the frozen weights are held: their values do not change).
Run it on two trees with the same interpreter to compare them (PYTHONPATH names the tree).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import transformers

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.metrics.provenance import provenance

STEPS = 3


def base(layers: int = 8) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)  # loaded in bf16


def top2of8() -> torch.nn.Module:
    m = base()
    for n, p in m.named_parameters():
        low = n.startswith("model.embed_tokens") or any(n.startswith(f"model.layers.{i}.") for i in range(6))
        if low:
            p.requires_grad_(False)
        else:
            p.data = p.data.float()  # what trains, in FP32
    return m


def lora() -> torch.nn.Module:
    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(base(), peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                           target_modules=["q_proj", "v_proj"]))


def measure(model: torch.nn.Module) -> dict:
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    eng = Engine(model, EngineConfig(compute_dtype="float32", optimizer_overlap=False, residency="stream",
                                     parity_probe=False),
                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), clip_every_step=1.0)
    g = torch.Generator().manual_seed(1)
    losses, h2d = [], []
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (2, 64), generator=g)
        eng.reset_stats()
        loss = model(input_ids=ids, labels=ids).loss
        eng.backward(loss)
        eng.step()
        eng.zero_grad()
        losses.append(loss.item())
        h2d.append(eng.collect_stats()["h2d_bytes"])
    host = eng.collect_stats()["host_store_bytes"]
    layer_dtypes = sorted({str(grp.stream_source.dtype) for grp in eng.store.layers})
    return {"params": params, "trainable": trainable, "host_store_bytes": host, "bytes_per_param": host / params,
            "h2d_bytes_per_step": h2d[-1], "losses": losses, "layer_stream_dtypes": layer_dtypes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = {"cases": {"top2of8": measure(top2of8()), "lora": measure(lora())},
           "provenance": {**provenance(), "threads": torch.get_num_threads()}}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
