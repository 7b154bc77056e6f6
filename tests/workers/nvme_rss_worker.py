"""Peak host RSS growth of training with and without the NVMe tier, each in a forked child of one process that
imported torch once (tests/integration/test_nvme.py).

    python tests/workers/nvme_rss_worker.py NVME_DIR

Prints one JSON line: for the in-memory run and for the spilled one (host_budget_bytes at half of what the
in-memory store needs), the peak RSS growth over building the engine and training (hi/lo masters, bf16
compute, clipping, accumulation 2, AdamW), the digests of every weight and optimizer tensor after training, and
for the spilled run the files under NVME_DIR seen while it trained and what remained after the engine closed.
Then the parent trains a spilled engine itself and raises: it exits with the error, and removes its files.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from megatrain.config.schema import EngineConfig  # noqa: E402
from megatrain.engine import Engine  # noqa: E402
from megatrain.engine.host.spill import record_sizes, store_fixed_bytes  # noqa: E402

LAYERS, HIDDEN, VOCAB, SEQ, STEPS = 16, 256, 256, 32, 2


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _model():
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=HIDDEN * 11 // 4, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _digest(eng: Engine) -> str:
    h = hashlib.sha256()
    for k, t in sorted(eng.state_dict().items()):
        h.update(k.encode() + t.contiguous().view(torch.uint8).numpy().tobytes())
    for _, st in sorted(eng.optimizer.state_dict()["state"].items()):
        for n in ("exp_avg", "exp_avg_sq", "step"):
            h.update(st[n].reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run(nvme: str | None, budget: int | None) -> dict:
    model = _model()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (1, SEQ), generator=g) for _ in range(2 * STEPS)]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _rss()
    cfg = EngineConfig(compute_dtype="bfloat16", host_master="hilo", loss_chunk_tokens=16, parity_probe=False,
                       nvme_path=nvme, host_budget_bytes=budget)
    eng = Engine(model, cfg, optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-2, fused=True))
    out: dict = {"need": store_fixed_bytes(eng.store, eng.optimizer) + sum(record_sizes(eng.optimizer, eng.store))}
    for step in range(STEPS):
        for ids in batches[2 * step: 2 * step + 2]:
            eng.backward(eng(input_ids=ids, labels=ids).loss / 2)
        eng.clip_grad_norm_(0.5)
        eng.step()
        eng.zero_grad()
        if nvme and step == 0:
            out["files"] = {os.path.relpath(os.path.join(d, f), nvme): os.path.getsize(os.path.join(d, f))
                            for d, _, fs in os.walk(nvme) for f in fs}
    eng.synchronize()
    out["peak_growth"] = _hwm() - base
    out["digest"] = _digest(eng)
    if eng.spill is not None:
        out["plan"] = {"spilled": len(eng.spill.plan.spilled), "host": eng.spill.plan.resident_bytes,
                       "direct": eng.spill.file.direct}
        eng.spill.close()
        out["left"] = os.listdir(nvme)
    return out


def child(nvme: str | None, budget: int | None) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            payload = json.dumps(run(nvme, budget))
        except BaseException as e:  # noqa: BLE001 - reported to the parent as the result
            payload = json.dumps({"error": repr(e)})
        os.write(w, payload.encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.waitpid(pid, 0)
    return json.loads(data)


if __name__ == "__main__":
    mem = child(None, None)
    if "error" in mem:
        sys.exit(mem["error"])
    spilled = child(sys.argv[1], mem["need"] // 2)
    print(json.dumps({"memory": mem, "spilled": spilled}), flush=True)
    # Then an exception out of a training loop ends the process: nothing may be left under nvme_path.
    eng = Engine(_model(), EngineConfig(nvme_path=sys.argv[1], parity_probe=False, loss_chunk_tokens=16))
    ids = torch.randint(0, VOCAB, (1, SEQ))
    eng.backward(eng(input_ids=ids, labels=ids).loss)
    eng.step()
    print("files", len(os.listdir(sys.argv[1])), flush=True)
    raise RuntimeError("a deliberate failure mid-training")
