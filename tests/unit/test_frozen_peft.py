"""A PEFT LoRA model (r 8 on q/v) on the engine trains exactly as plain PEFT does, clipped, and its adapters
saved by PEFT's save_pretrained reload through PeftModel.from_pretrained with the same logits."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import make_batches, tiny_model

import megatrain
from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine

peft = pytest.importorskip("peft")

STEPS, LR, CLIP = 5, 1e-3, 0.3
BATCHES = make_batches(STEPS)


def lora_model() -> torch.nn.Module:
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(tiny_model("llama"), cfg)


def plain_peft(model: torch.nn.Module) -> tuple[list[float], list[float], torch.nn.Module]:
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)
    losses, norms = [], []
    for b in BATCHES:
        loss = model(**b).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, model


def test_lora_trains_as_plain_peft_and_its_adapters_reload(tmp_path):
    model = lora_model()
    ref_losses, ref_norms, ref = plain_peft(model)
    assert max(ref_norms) > CLIP  # control: the clip bites
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    eng = Engine(model, EngineConfig(compute_dtype="float32", optimizer_overlap=False),
                 optimizer=torch.optim.AdamW(model.parameters(), lr=LR), clip_every_step=CLIP)
    assert eng.wrapper is model
    losses, norms = [], []
    for b in BATCHES:
        loss = model(**b).loss  # the PeftModel's own forward, routed to the engine
        eng.backward(loss)
        eng.step()
        norms.append(eng.clipping.last_norm)
        eng.zero_grad()
        losses.append(loss.item())
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(norms, ref_norms))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(n for n, p in ref.named_parameters() if p.requires_grad) and len(trainable) == 8
    state = model.state_dict()
    assert all(torch.equal(state[n], v) for n, v in base_before.items()), "a base weight moved"

    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = peft.PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "adapter")
    again.eval(), ref.eval(), model.eval()
    with torch.no_grad():
        ids = BATCHES[0]["input_ids"]
        got, want, ours = again(input_ids=ids).logits, ref(input_ids=ids).logits, model(input_ids=ids).logits
    assert (got - want).abs().max() <= 1e-5 and (ours - want).abs().max() <= 1e-5


def test_the_deepspeed_face_hands_back_the_peft_model():
    model = lora_model()
    ref_losses, ref_norms, _ = plain_peft(model)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "megatrain": {"compute_dtype": "float32", "optimizer_overlap": False}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = megatrain.initialize(model=model, config=cfg)
    losses = []
    for b in BATCHES:
        loss = engine(**b).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5


def test_a_quantized_base_is_refused_by_name():
    from megatrain.engine.model.peft_model import unwrap_peft

    model = lora_model()
    model.base_model.model.is_loaded_in_4bit = True
    with pytest.raises(ValueError, match="quantized base model"):
        unwrap_peft(model)


def test_lora_in_the_gpus_defaults():
    """bf16 compute, the update overlapped, hilo masters: within the bf16 floor of plain PEFT in the engine's
    mixed-precision scheme (the reference's names are the PeftModel's, the engine's its inner model's)."""
    from gpu_defaults import GPU_DEFAULTS, bf16_reference, lag_updates, train

    model = lora_model()
    floor = bf16_reference(model, BATCHES, STEPS, clip=CLIP, optimizer=lambda m: torch.optim.AdamW(
        [p for p in m.parameters() if p.requires_grad], lr=LR, fused=True))
    assert max(floor.out[1]) > CLIP  # control: the clip bites
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    eng = lag_updates(Engine(model, EngineConfig(loss_chunk_tokens=13, **GPU_DEFAULTS)))
    losses, norms, grads = train(eng, BATCHES, STEPS, clip=CLIP)
    outer = "base_model.model."
    floor.check((losses, norms, {outer + k: v for k, v in grads.items()}),
                {outer + k: v for k, v in eng.state_dict().items()})
    state = model.state_dict()
    assert all(torch.equal(state[n], v) for n, v in base.items()), "a base weight moved"
