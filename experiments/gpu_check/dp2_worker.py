"""One rank (or the lone reference process) of the dp2 phase (dp2.py): a tiny Llama with every layer streamed on
the node path, rank r of W taking rows [(s*W + r)*b, (s*W + r + 1)*b) of global batch s, which the lone process
(world 1, micro W*b) takes whole. Writes OUT_DIR/rank{r}.json: each step's loss (averaged over the ranks: the global
batch's), the step's stats (h2d/d2h, gathered/scattered bytes) and the data path the engine ran.

    python experiments/gpu_check/dp2_worker.py OUT_DIR '{"device": "cuda", "micro": 2, "world": 2, ...}'
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine

VOCAB, SEQ, LR = 128, 16, 1e-3


def main() -> None:
    out, args = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(rank)  # differing inits: the engine starts every rank from rank 0's weights
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=88, num_hidden_layers=args["layers"],
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    engine = Engine(model, EngineConfig(
        device=args["device"], parity_probe=False, residency="stream", watchdog_s=120.0, speculative_step=False,
        compute_dtype=args.get("dtype", "float32"), data_parallel_path=args["path"]),
        optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=LR))
    micro, steps = args["micro"], args["steps"]
    rows = torch.randint(0, VOCAB, (args["world"] * micro * steps, SEQ), generator=torch.Generator().manual_seed(1))
    losses, stats = [], []
    for s in range(steps):
        engine.reset_stats()
        at = (s * args["world"] + rank) * micro
        ids = rows[at: at + micro].to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        got = loss.detach().float().clone()
        if world > 1:
            dist.all_reduce(got)  # the global batch's mean loss: every rank's rows have equal label tokens
            got /= world
        losses.append(float(got))
        engine.step()
        engine.zero_grad()
        engine.synchronize()
        st = engine.collect_stats()
        stats.append({k: float(st.get(k, 0)) for k in ("h2d_bytes", "d2h_bytes", "gathered_bytes",
                                                       "scattered_bytes")} | {"data_path": st["data_path"]})
    path = getattr(engine, "data_path", None)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "losses": losses, "stats": stats, "data_path": path.describe() if path is not None else None,
        "backend": str(dist.get_backend()) if dist.is_initialized() else None}))


if __name__ == "__main__":
    main()
