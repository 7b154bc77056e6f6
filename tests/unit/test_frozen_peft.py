"""A PEFT LoRA model (r 8 on q/v) on the engine trains exactly as plain PEFT does, clipped, and its adapters
saved by PEFT's save_pretrained reload through PeftModel.from_pretrained with the same logits; so do rsLoRA, DoRA
and `modules_to_save` (the head, the final norm, modules inside the layers), and a pass with the adapters disabled
(`disable_adapter()`, TRL DPO's reference) is the base model's as in plain PEFT."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_batches, tiny_model
from frozen_cases import lora_model, reference

import megatrain
from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine

peft = pytest.importorskip("peft")

STEPS, LR, CLIP = 5, 1e-3, 0.3
BATCHES = make_batches(STEPS)


def plain_peft(model: torch.nn.Module, clip: float = CLIP) -> tuple[list[float], list[float], torch.nn.Module]:
    return reference(model, BATCHES, STEPS, clip)


# The PEFT variants: LoraConfig's fields over the r 8 q/v LoRA, and how many tensors train.
VARIANTS = {
    "lora": ({}, 8),
    "rslora": ({"use_rslora": True}, 8),
    "dora": ({"use_dora": True}, 12),  # + a magnitude vector per adapted linear
    "head_saved": ({"modules_to_save": ["lm_head"]}, 9),
    "norm_saved": ({"modules_to_save": ["norm"]}, 9),  # the final norm (PEFT matches whole name parts)
    "layer_saved": ({"modules_to_save": ["input_layernorm", "down_proj"]}, 12),  # inside the streamed layers
}
def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=BATCHES[0]["input_ids"]).logits


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_peft_variants_train_as_plain_peft_and_their_adapters_reload(variant, tmp_path):
    """Clipping 1.0, AdamW lr 1e-3, FP32, 5 steps: losses within 1e-5 of plain PEFT, norms within 1e-5 relative, the
    same tensors trainable, the base bit-unchanged, the adapters reloaded by PeftModel.from_pretrained giving plain
    PEFT's logits, and with the adapters disabled the base model's logits as plain PEFT gives them."""
    config, trainable_count = VARIANTS[variant]
    model = lora_model(**config)
    ref_losses, ref_norms, ref = plain_peft(model, clip=1.0)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    eng = Engine(model, EngineConfig(compute_dtype="float32", optimizer_overlap=False),
                 optimizer=torch.optim.AdamW(model.parameters(), lr=LR), clip_every_step=1.0)
    losses, norms = [], []
    for b in BATCHES:
        loss = model(**b).loss  # the PeftModel's own forward, routed to the engine
        eng.backward(loss)
        eng.step()
        norms.append(eng.clipping.last_norm)
        eng.zero_grad()
        losses.append(loss.item())
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5, (losses, ref_losses)
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(norms, ref_norms)), (norms, ref_norms)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(n for n, p in ref.named_parameters() if p.requires_grad)
    assert len(trainable) == trainable_count, trainable
    state = model.state_dict()
    assert all(torch.equal(state[n], v) for n, v in base_before.items()), "a base weight moved"

    model.save_pretrained(tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = peft.PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "adapter")
    again.eval(), ref.eval(), model.eval()
    want = _logits(ref)
    assert (_logits(again) - want).abs().max() <= 1e-5 and (_logits(model) - want).abs().max() <= 1e-5
    with model.disable_adapter(), ref.disable_adapter():
        base_ours, base_ref = _logits(model), _logits(ref)
    assert (base_ref - want).abs().max() > 1e-3  # control: disabling the adapters changes the logits
    assert (base_ours - base_ref).abs().max() <= 1e-5
    assert (_logits(model) - want).abs().max() <= 1e-5  # enabled again


def test_lora_clipped_below_its_norm_trains_as_plain_peft():
    """The r 8 q/v LoRA clipped at 0.3, where the clip bites: norms and losses as plain PEFT's."""
    model = lora_model()
    ref_losses, ref_norms, _ = plain_peft(model)
    assert max(ref_norms) > CLIP  # control: the clip bites
    eng = Engine(model, EngineConfig(compute_dtype="float32", optimizer_overlap=False),
                 optimizer=torch.optim.AdamW(model.parameters(), lr=LR), clip_every_step=CLIP)
    assert eng.wrapper is model
    losses, norms = [], []
    for b in BATCHES:
        loss = model(**b).loss
        eng.backward(loss)
        eng.step()
        norms.append(eng.clipping.last_norm)
        eng.zero_grad()
        losses.append(loss.item())
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(norms, ref_norms))


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


def _trained_looking(model: torch.nn.Module) -> torch.nn.Module:
    """LoRA's B starts at zero (the adapter a no-op): random B so the adapter changes the logits."""
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)
    return model


def test_a_mixed_adapter_batch_in_eval_is_plain_peft():
    """`model(input_ids, adapter_names=[...])` (PEFT's per-row adapters, eval only): the hooks PEFT puts on its
    modules for the call reach the layer templates, so each row runs its own adapter (row 0 the base) as in PEFT."""
    import copy

    model = _trained_looking(lora_model())
    ref = copy.deepcopy(model)
    Engine(model, EngineConfig(compute_dtype="float32", optimizer_overlap=False),
           optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    model.eval(), ref.eval()
    ids = BATCHES[0]["input_ids"]
    with torch.no_grad():
        names = ["__base__", "default"]
        got, want = model(input_ids=ids, adapter_names=names).logits, ref(input_ids=ids, adapter_names=names).logits
        both = ref(input_ids=ids).logits
    assert (want[0] - both[0]).abs().max() > 1e-2  # control: row 0 without its adapter is another result
    assert (got - want).abs().max() <= 1e-5


def test_alora_trains_refused_by_name_and_runs_in_eval():
    """aLoRA (`alora_invocation_tokens`) hands PEFT's layers their offsets through hooks that live for one call:
    backward's recompute would run without them, so a training forward is refused by name; in eval, as PEFT."""
    import copy

    model = _trained_looking(lora_model(alora_invocation_tokens=[5, 6], task_type="CAUSAL_LM"))
    ref = copy.deepcopy(model)
    batch = {k: v.clone() for k, v in BATCHES[0].items()}
    batch["input_ids"][:, 3:5] = torch.tensor([5, 6])  # the invocation: the adapter acts from there on
    Engine(model, EngineConfig(compute_dtype="float32", optimizer_overlap=False),
           optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    with pytest.raises(ValueError, match="alora_offsets"):
        model(**batch)
    model.eval(), ref.eval()
    with torch.no_grad():
        got, want = model(input_ids=batch["input_ids"]).logits, ref(input_ids=batch["input_ids"]).logits
        with ref.disable_adapter():
            base = ref(input_ids=batch["input_ids"]).logits
    assert (want - base).abs().max() > 1e-2  # control: the adapter acts
    assert (got - want).abs().max() <= 1e-5
