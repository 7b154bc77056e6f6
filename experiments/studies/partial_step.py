"""Training part of a model: the step with the top 2 of 8 layers trainable (embedding frozen) against the full step,
every layer streamed (a benchmark, not a test).

    python -m experiments.studies.partial_step --pairs 12 --out results/partial/top2of8.json

Both engines live in one process and step in turns (the order alternated each pair), so the machine's load drifts
over both alike; the figure is the median of the paired ratios. FP32, residency "stream", fused AdamW, clipping 1.0.
What the part saves (engine/model/trainable.py): no backward below layer 6 (nothing there or before trains), no
weight gradients below it, no slab or Adam state for the frozen layers or the embedding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.metrics.provenance import provenance


def model(trainable: int, layers: int, hidden: int, vocab: int) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=1024, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg)
    if trainable < layers:
        for n, p in m.named_parameters():
            low = n.startswith("model.embed_tokens") or any(n.startswith(f"model.layers.{i}.")
                                                             for i in range(layers - trainable))
            p.requires_grad_(not low)
    return m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--trainable", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    cfg = EngineConfig(device="cpu", compute_dtype="float32", residency="stream", optimizer_overlap=False,
                       parity_probe=False)
    engines = {"part": Engine(model(a.trainable, a.layers, a.hidden, a.vocab), cfg, clip_every_step=1.0),
               "full": Engine(model(a.layers, a.layers, a.hidden, a.vocab), cfg, clip_every_step=1.0)}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}

    def step(name: str) -> float:
        eng = engines[name]
        t0 = time.perf_counter()
        eng.backward(eng(**batch).loss)
        eng.step()
        eng.zero_grad()
        return time.perf_counter() - t0

    for _ in range(a.warmup):
        step("part"), step("full")
    for eng in engines.values():
        eng.reset_stats()
    times: dict[str, list[float]] = {"part": [], "full": []}
    for k in range(a.pairs):
        for name in (("part", "full") if k % 2 == 0 else ("full", "part")):
            times[name].append(step(name))
    ratios = [p / f for p, f in zip(times["part"], times["full"])]
    stats = {n: e.collect_stats() for n, e in engines.items()}
    out = {
        "what": f"top {a.trainable} of {a.layers} layers trainable (embedding frozen) vs every parameter trainable, "
                "every layer streamed, FP32, paired steps in one process",
        "shape": {"layers": a.layers, "hidden": a.hidden, "vocab": a.vocab, "seq": a.seq, "batch": a.batch},
        "median_paired_step_ratio": statistics.median(ratios),
        "ratio_of_median_steps": statistics.median(times["part"]) / statistics.median(times["full"]),
        "paired_ratios": ratios,
        "step_s": times,
        "host_store_bytes": {n: s["host_store_bytes"] for n, s in stats.items()},
        "host_store_ratio": stats["part"]["host_store_bytes"] / stats["full"]["host_store_bytes"],
        "recomputed_layers_per_step": {n: s["recomputed_layers"] / a.pairs for n, s in stats.items()},
        "backward_s_per_step": {n: s["backward_s"] / a.pairs for n, s in stats.items()},
        "forward_s_per_step": {n: s["forward_s"] / a.pairs for n, s in stats.items()},
        "optimizer_s_per_step": {n: s["optimizer_s"] / a.pairs for n, s in stats.items()},
        "provenance": {**provenance(), "threads": torch.get_num_threads()},
    }
    text = json.dumps(out, indent=1)
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
