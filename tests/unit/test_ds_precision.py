"""Precision stated and consistent on the DeepSpeed face (issue 60, item 5), and writes under GatheredParameters in
the host modes without FP32 layer masters.

- After a bf16 run the model object reports every parameter as its state dict has it: `named_parameters()` serves
  the FP32 masters' values for the resident parameters too (their compute copies are bf16), on the engine's device.
- `engine.save_pretrained` writes the dtype the config asks for (bf16 config -> bf16 files, as DeepSpeed saves),
  and the files reload with transformers to the masters rounded to bf16.
- With host_master 'hilo' a `GatheredParameters(modifier_rank=0)` write reaches the host store, through a layer's
  own Parameter (one layer at a time), the copies `named_parameters()` serves, or a resident parameter.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import transformers
from conftest import make_batches, tiny_model
from safetensors.torch import load_file

import megatrain

BF16 = {"bf16": {"enabled": True}}
MODES = [pytest.param({}, id="fp32-master"), pytest.param({"host_master": "hilo"}, id="hilo")]


def _trained(mode: dict, bf16: bool = True, steps: int = 2):
    cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **(BF16 if bf16 else {}), "megatrain": mode}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = megatrain.initialize(model=tiny_model("llama", layers=3), config=cfg)[0]
    for b in make_batches(steps):
        engine.backward(engine(**b).loss)
        engine.step()
    return engine


@pytest.mark.parametrize("mode", MODES)
def test_after_a_bf16_run_the_model_reports_its_parameters_as_its_state_dict(mode):
    engine = _trained(mode)
    model = engine.module
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16  # what it computes with: the bf16 copy
    named, sd = dict(model.named_parameters()), model.state_dict()
    assert {p.dtype for p in named.values()} == {torch.float32} == {t.dtype for t in sd.values()}
    assert all(torch.equal(p.detach().cpu(), sd[n]) for n, p in named.items())
    assert model.device == engine.engine.device
    # the copies stand for the parameters they name: a clip over model.parameters() is the engine's own
    b = make_batches(1, seed=4)[0]
    engine.backward(engine(**b).loss)
    want = engine.engine.grad_norm()
    assert engine.engine.clip_grad_norm_of(list(model.parameters()), 1e9) == want


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-config", "fp32-config"])
def test_save_pretrained_writes_the_dtype_the_config_asks_for(tmp_path, bf16):
    engine = _trained({}, bf16=bf16)
    engine.save_pretrained(tmp_path)
    dtype = torch.bfloat16 if bf16 else torch.float32
    files = load_file(tmp_path / "model.safetensors")
    assert {t.dtype for t in files.values()} == {dtype}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert back.model.embed_tokens.weight.dtype == dtype
    masters = engine.state_dict()
    for n, p in back.named_parameters():
        assert torch.equal(p, masters[n].to(dtype)), n
    if bf16:  # control: the masters are not bf16 values, so a save of them would differ
        assert any(not torch.equal(masters[n], masters[n].to(dtype).float()) for n in masters)


def _plain_bf16(state: dict) -> torch.nn.Module:
    ref = tiny_model("llama", layers=3)
    ref.load_state_dict(state)
    return copy.deepcopy(ref).to(torch.bfloat16).eval()


def test_gathered_writes_reach_the_host_store_with_hilo_masters():
    engine = _trained({"host_master": "hilo"})
    model = engine.module
    layer = model.model.layers[1].mlp.up_proj.weight  # a view of the shared FP32 scratch
    old = engine.state_dict()
    want = old["model.layers.1.mlp.up_proj.weight"]
    with megatrain.zero.GatheredParameters([layer], modifier_rank=0):
        assert torch.equal(layer.detach(), want)  # read inside the block: the layer's weight
        with torch.no_grad():
            layer[0].fill_(0.5)
    copies = dict(model.named_parameters())
    with megatrain.zero.GatheredParameters([copies["model.layers.2.self_attn.q_proj.weight"],
                                            copies["model.norm.weight"]], modifier_rank=0), torch.no_grad():
        copies["model.layers.2.self_attn.q_proj.weight"][1].fill_(0.25)
        copies["model.norm.weight"].fill_(2.0)
    emb = model.model.embed_tokens.weight  # the resident bf16 compute copy itself
    with megatrain.zero.GatheredParameters([emb], modifier_rank=0), torch.no_grad():
        emb[3].fill_(0.125)
    sd = engine.state_dict()
    assert torch.equal(sd["model.layers.1.mlp.up_proj.weight"][0], torch.full_like(want[0], 0.5))
    assert torch.equal(sd["model.layers.1.mlp.up_proj.weight"][1:], want[1:])
    assert torch.equal(sd["model.layers.2.self_attn.q_proj.weight"][1], torch.full((64,), 0.25))
    assert torch.equal(sd["model.norm.weight"], torch.full((64,), 2.0))
    assert torch.equal(sd["model.embed_tokens.weight"][3], torch.full((64,), 0.125))
    # the streamed bf16 weights follow: the engine computes what a plain bf16 model with these weights computes,
    # far closer than to one with the weights before the writes (the control)
    b = make_batches(1, seed=8, pad=False)[0]
    engine.eval()
    with torch.no_grad():
        got = engine(**b).loss.item()
        plain, before = (_plain_bf16(state)(**b).loss.item() for state in (sd, old))
    assert abs(got - plain) < 0.1 * abs(got - before), (got, plain, before)
    two = [model.model.layers[0].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight]
    with pytest.raises(RuntimeError, match="one layer's at a time"), megatrain.zero.GatheredParameters(two):
        pass
