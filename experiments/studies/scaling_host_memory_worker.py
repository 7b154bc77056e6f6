"""One rank of the host-memory measurement: train a layer-heavy Llama two steps (TRAIN_STEPS), then report this process's
proportional set size (PSS: shared pages split between the processes mapping them, so the ranks' PSS add up
to what the machine holds for them; RSS would count the node's shared store once per rank).

Run as `python experiments/studies/scaling_host_memory_worker.py OUT_DIR DATA_PARALLEL_HOST` (alone, or with torchrun's variables).
LAYERS in the environment: the model's depth (default 32); HOST_MODES: JSON of host-mode engine settings;
TRAIN_STEPS: the steps trained before measuring (default 2; the first step allocates every buffer and Adam state).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import transformers


def main() -> None:
    out, host = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    # Many narrow layers: the per-rank layer-sized buffers (gradient staging) stay a small part of the store.
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=int(os.environ.get("LAYERS", "32")), num_attention_heads=8,
                                   num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    import megatrain

    modes = json.loads(os.environ.get("HOST_MODES", "{}"))
    clip = {"gradient_clipping": 0} if modes.get("optimizer_in_backward") else {}  # it refuses clipping
    engine, _, _, _ = megatrain.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, **clip,
        "megatrain": {"parity_probe": False, "device": "cpu", "data_parallel_host": host, "watchdog_s": 300.0,
                      # the store's bytes, not a CPU device's copies of kept layers (each rank's own)
                      "residency": "stream",
                      "host_mmap_threshold_bytes": 1 << 17, **modes}})
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(rank))
    for _ in range(int(os.environ.get("TRAIN_STEPS", "2"))):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    engine.engine.synchronize()
    if engine.world_size > 1:
        torch.distributed.barrier()  # every rank's store is whole before anyone measures
    from megatrain.metrics.pss import memory_rollup

    mem = memory_rollup()
    store = engine.engine.store
    adam = sum(t.numel() * t.element_size() for st in engine.optimizer.state.values() for t in st.values()
               if torch.is_tensor(t) and t.dim() > 0)
    report = {"pss": mem["Pss"], "rss": mem["Rss"], "state_bytes": store.host_bytes() + adam,
              "shared": store.ranks_sharing > 1}
    (out / f"mem{rank}.json").write_text(json.dumps(report))
    if engine.world_size > 1:
        torch.distributed.barrier()  # no rank unmaps the shared store while another still measures


if __name__ == "__main__":
    main()
