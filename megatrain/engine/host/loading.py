"""Build a model skeleton without weights, and stream a local safetensors checkpoint into the host store."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ...files.tensor_file import TensorFile
from .store import HostStore


def skeleton_from_dir(path: Path) -> nn.Module:
    """The model's modules on the `meta` device (buffers real), from a local directory — never a download."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    if not path.is_dir():
        raise ValueError(f"{path} is not a directory; pass a model object or a local checkpoint directory")
    if not (path / "config.json").exists():
        raise ValueError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()  # from_config leaves meta weights untied; the checkpoint stores tied ones once
    return model


def _shards(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise ValueError(f"{path} has no *.safetensors weights (only safetensors checkpoints are supported)")
    return found


def load_checkpoint_into(store: HostStore, path: Path, layers_prefix: str, aliases: dict[str, str]) -> None:
    """Copy every tensor straight into its slot, one tensor at a time (peak memory ~ the store itself).

    Each tensor is read with plain reads (tensor_file.py), not through a mapping of the file whose touched
    pages would stay resident: an FP32 master of the file's dtype is read into its place in the store, any
    other (a bf16 file, a hilo or bf16 master) through one reused buffer converted by the store's write_slot.
    """
    where: dict[str, tuple] = {}
    for i, group in enumerate(store.layers):
        for slot in group.slots:
            where[f"{layers_prefix}.{i}.{slot.name}"] = (group, slot)
    for slot in store.globals.slots:
        where[slot.name] = (store.globals, slot)
    seen: set[str] = set()
    for shard in _shards(path):
        with TensorFile(shard) as f:
            for key in f.keys():
                name = aliases.get(key, key)
                if name not in where or name in seen:
                    continue
                group, slot = where[name]
                if tuple(f.shape(key)) != tuple(slot.shape):
                    raise ValueError(f"{shard.name}: {key} has shape {tuple(f.shape(key))}, the model expects "
                                     f"{tuple(slot.shape)}")
                with torch.no_grad():
                    if not group.owned:
                        pass  # a layer of the node's shared store: its owner writes it (once, with its tie list)
                    elif group.master is not None and f.dtype(key) == group.master.dtype:
                        f.read_into(key, group.view(group.master, slot))  # an FP32 master: in place
                    else:
                        group.write_slot(slot, f.read_transient(key))
                seen.add(name)
    missing = sorted(set(where) - seen)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
