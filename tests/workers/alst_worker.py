"""Train the shared accel_script model (tied head) through `zero3` or `zero3-alst` and report what ran.

    python tests/workers/alst_worker.py BACKEND OUT.json [JSON DeepSpeed-style config]

For `zero3-alst` it also counts the calls of DeepSpeed's TiledMLP and TiledFusedLogitsLoss and the
checkpoint copies made to the host, so a parity result cannot come from the pieces being bypassed.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator

import accel_script
import torch
import transformers

STEPS = 4


def tied_llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**{**_untied().to_dict(), "tie_word_embeddings": True})


_untied = accel_script.llama_config

if __name__ == "__main__":
    backend, out_path = sys.argv[1], sys.argv[2]
    config = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    torch.set_num_threads(2)
    accel_script.llama_config = tied_llama_config  # smollm-135m, the benchmark's model, ties its head
    counts = {"tiled_mlp": 0, "tiled_loss": 0, "host_copies": 0}
    if backend == "zero3-alst":
        from deepspeed.runtime.sequence_parallel import ulysses_sp

        import baselines.alst as alst

        for key, fn in (("tiled_mlp", ulysses_sp.TiledMLP), ("tiled_loss", ulysses_sp.TiledFusedLogitsLoss)):
            forward = fn.forward

            def counted(*args, _forward=forward, _key=key, **kwargs):
                counts[_key] += 1
                return _forward(*args, **kwargs)

            fn.forward = staticmethod(counted)

        @contextlib.contextmanager
        def host_copy() -> Iterator[None]:
            counts["host_copies"] += 1
            yield

        alst.set_host_copy_context(host_copy)
    result = accel_script.train(backend, steps=STEPS, accum=1, gradient_checkpointing=True, config=config)
    with open(out_path, "w") as f:
        json.dump({**result, **counts, "steps": STEPS}, f)
