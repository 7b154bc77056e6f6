"""The helpers beside the example's main.py, in the style of DeepSpeed-Chat's `dschat/utils`: they import deepspeed
themselves, so `import megatrain as deepspeed` in main.py alone leaves these on the `deepspeed` name."""

from __future__ import annotations

import os

import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.compression.helper import recursive_getattr
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus


def print_rank_0(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def _z3_params_to_fetch(param_list: list) -> list:
    return [p for p in param_list if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def save_hf_format(model, output_dir: str, gather) -> None:
    """DeepSpeed-Chat's save: the state dict as pytorch_model.bin and the config as config.json, each parameter read
    under GatheredParameters (a no-op unless partitioned)."""
    model_to_save = model.module if hasattr(model, "module") else model
    os.makedirs(output_dir, exist_ok=True)
    state = {}
    for name, param in model_to_save.named_parameters():
        with gather(_z3_params_to_fetch([param]), enabled=True):
            if dist.get_rank() == 0:
                state[name] = param.data.detach().to("cpu", copy=True)
    if dist.get_rank() == 0:
        torch.save(state, os.path.join(output_dir, "pytorch_model.bin"))
        model_to_save.config.to_json_file(os.path.join(output_dir, "config.json"))


def embedding_of(model) -> torch.nn.Module:
    return recursive_getattr(model, "model.embed_tokens")


def device_name() -> str:
    return get_accelerator().device_name()
