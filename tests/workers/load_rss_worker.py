"""Peak host RSS growth of a load, in a process of its own (tests/integration/test_streaming_load.py, and the figures of
experiments/studies/bytes_at_depth.py's load rows).

    python tests/workers/load_rss_worker.py save DIR MODE LAYERS HIDDEN VOCAB   # one step, save_checkpoint + save_pretrained
    python tests/workers/load_rss_worker.py ckpt DIR MODE LAYERS HIDDEN VOCAB   # load_checkpoint: fresh, reload, mapped
    python tests/workers/load_rss_worker.py hf DIR MODE LAYERS HIDDEN VOCAB     # the HF directory: streamed, mapped

Each measurement resets the kernel's high-water mark (/proc/self/clear_refs) and reports (peak RSS growth,
RSS growth that stays), in bytes, in one JSON line with the optimizer state bytes a fresh load must create
(a resumed run holds them whatever the reader), the FP32 masters' bytes, and digests of every weight and
optimizer tensor (bit-identity with the saving process). The `*_mapped` rows load through the readers used
before loads streamed (safetensors' mmap-backed load_file / safe_open): the negative controls.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

MODES = {
    "fp32": {"compute_dtype": "bfloat16"},
    "hilo": {"compute_dtype": "bfloat16", "host_master": "hilo"},
    "bf16": {"compute_dtype": "bfloat16", "host_master": "bf16"},
    "bf16_slabs": {"compute_dtype": "bfloat16", "host_master": "hilo", "host_grad_dtype": "bfloat16"},
}


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _config(layers: int, hidden: int, vocab: int):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def _ds_config(mode: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
            "megatrain": {k: v for k, v in MODES[mode].items() if k != "compute_dtype"}}


def _digest(eng) -> str:
    h = hashlib.sha256()
    for name, t in sorted(eng.engine.state_dict().items()):
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    state = eng.optimizer.state_dict()["state"]
    for idx in sorted(state):
        for k in sorted(state[idx]):
            v = state[idx][k]
            h.update(f"{idx}.{k}".encode())
            h.update(v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()


def _optimizer_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))


def _trim() -> None:
    """Give the C heap's free memory back first, so a load cannot hide its allocations in it."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _measure(load, touch=list) -> tuple[int, int]:
    """(peak RSS growth, RSS growth that stays) of `load()`, after reading every tensor of `touch()`: what the
    first step reads (a tensor still backed by a mapping of the file joins the resident set then)."""
    _trim()
    _reset_hwm()
    before = _rss()
    load()
    for t in touch():
        t.sum()
    return _hwm() - before, _rss() - before


def _state_tensors(opt):
    return [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]


def _materialized_ckpt_load() -> None:
    """Make checkpoint.load the reader before streaming: safetensors' load_file, every tensor mapped at once."""
    from safetensors.torch import load_file

    import megatrain.run.checkpoint as ckpt

    original = ckpt.load

    def materialized(directory, tag=None, *, check=True):
        _, meta, path = original(directory, tag, check=check)
        return load_file(str(path / ckpt.TENSORS_FILE)), meta, path

    ckpt.load = materialized


def main() -> None:
    import transformers

    from megatrain.config.schema import EngineConfig
    from megatrain.deepspeed import initialize
    from megatrain.engine import Engine
    from megatrain.engine.host.loading import load_checkpoint_into

    action, directory, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    layers, hidden, vocab = (int(x) for x in sys.argv[4:7])
    torch.manual_seed(0)
    if action == "save":
        model = transformers.AutoModelForCausalLM.from_config(_config(layers, hidden, vocab))
        eng, *_ = initialize(model=model, config=_ds_config(mode))
        ids = torch.randint(0, vocab, (1, 16))
        eng.backward(eng(input_ids=ids, labels=ids).loss)
        eng.step()
        eng.save_checkpoint(directory / "ckpt")
        eng.save_pretrained(directory / "hf", dtype=torch.float32)  # the masters, for a bit-identical load
        print(json.dumps({"digest": _digest(eng), "weights_digest": _weights_digest(eng)}))
        return
    out: dict = {}
    if action == "hf":
        # The engine built from the directory holds its store; the load is then repeated into that store, so
        # all a load adds is growth.
        eng = Engine(directory / "hf", EngineConfig(**MODES[mode]))
        n = sum(g.numel for g in eng.store.groups())
        out["weights_digest"] = _weights_digest(eng)
        for name, load in (("hf", load_checkpoint_into), ("hf_mapped", _mapped_load)):
            out[name] = _measure(lambda load=load: load(eng.store, directory / "hf", eng.parts.layers_prefix,
                                                        eng.placement.aliases))
            out[name + "_weights_digest"] = _weights_digest(eng)
    else:
        model = transformers.AutoModelForCausalLM.from_config(_config(layers, hidden, vocab))
        eng, *_ = initialize(model=model, config=_ds_config(mode))
        del model
        n = sum(g.numel for g in eng.engine.store.groups())
        eng.zero_grad()  # the gradient slabs' pages are touched here, not by the load: a first step touches them too
        eng.engine.synchronize()  # (the zeroing is queued on the optimizer's thread)
        touch = lambda: _state_tensors(eng.optimizer)  # noqa: E731
        # A resuming process: the optimizer state the load creates is what training holds anyway.
        out["fresh"] = _measure(lambda: eng.load_checkpoint(directory / "ckpt"), touch)
        out["needed"] = _optimizer_bytes(eng.optimizer)
        out["digest"] = _digest(eng)
        # A reload into a live engine (its state exists): nothing is needed.
        out["reload"] = _measure(lambda: eng.load_checkpoint(directory / "ckpt"), touch)
        out["reload_digest"] = _digest(eng)
        _materialized_ckpt_load()
        out["reload_mapped"] = _measure(lambda: eng.load_checkpoint(directory / "ckpt"), touch)
    out.update(masters_fp32=4 * n, params=n)
    print(json.dumps(out))


def _mapped_load(store, path: Path, prefix: str, aliases: dict) -> None:
    """The reader before streaming: safetensors' safe_open, whose mapping of the file keeps every page a copy
    touched resident until it is closed."""
    from safetensors import safe_open

    where = {f"{prefix}.{i}.{s.name}": (g, s) for i, g in enumerate(store.layers) for s in g.slots}
    where.update({s.name: (store.globals, s) for s in store.globals.slots})
    with safe_open(str(path / "model.safetensors"), framework="pt") as f, torch.no_grad():
        for key in f.keys():
            name = aliases.get(key, key)
            if name in where:
                group, slot = where[name]
                group.write_slot(slot, f.get_tensor(key))


def _weights_digest(eng) -> str:
    h = hashlib.sha256()
    for name, t in sorted(getattr(eng, "engine", eng).state_dict().items()):
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    main()
