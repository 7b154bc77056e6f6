"""Both faces prepare a model through one backend routine (MegatrainBackend.prepare_model), and the engine's
public API the faces use: replace_optimizer (every tensor a model's parameter may be held by), set_clipping."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine

PIN_OFF = "pin_memory (no CUDA device)"
HF_CKPT_OFF = "HF gradient checkpointing (the engine recomputes each streamed layer itself)"


def _trl_patched(seed: int = 0) -> torch.nn.Module:
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_model(seed=seed)
    model.gradient_checkpointing_enable()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model


def _accelerate_face(model: torch.nn.Module):
    from megatrain.accelerate import Accelerator

    acc = Accelerator(backend="megatrain", config={"megatrain": {"pin_memory": True}}, cpu=True)
    return acc.prepare(model), acc.backend


def _deepspeed_face(model: torch.nn.Module):
    import megatrain

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
              "megatrain": {"device": "cpu"}}
    engine, *_ = megatrain.initialize(model=model, config=config)
    return engine.module, engine.backend


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_both_faces_prepare_the_model_alike(clone):
    """Pinning off without CUDA, HF's checkpointing off, TRL's fused head served at its temperature: the same on
    the Accelerate face as on the DeepSpeed face (the Accelerate face once did none of it)."""
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    plain = _trl_patched()
    ref = plain(input_ids=ids, labels=ids, fused_lm_head=True)
    served = {}
    for name, face in (("accelerate", _accelerate_face), ("deepspeed", _deepspeed_face)):
        model, backend = face(_trl_patched())
        assert backend.turned_off == [PIN_OFF, HF_CKPT_OFF], name
        assert not model.is_gradient_checkpointing and backend.engine.config.pin_memory is False, name
        model.eval()
        with torch.no_grad():
            served[name] = model(input_ids=ids, labels=ids, fused_lm_head=True)
        for field in ("log_probs", "entropy"):
            torch.testing.assert_close(getattr(served[name], field), getattr(ref, field), rtol=0, atol=1e-5)
    assert torch.equal(served["accelerate"].log_probs, served["deepspeed"].log_probs)
    # Control: a model without checkpointing or TRL's patch, on a CUDA-less host with pinning unset: nothing off.
    _, backend = _accelerate_face(tiny_model())
    assert backend.turned_off == [PIN_OFF]


def _whole_step_engine(dtype: str) -> tuple[torch.nn.Module, Engine]:
    """An engine whose optimizer steps whole (not fused: no per-layer pass), so it may be replaced."""
    model = tiny_model()
    eng = Engine(model, EngineConfig(device="cpu", compute_dtype=dtype, parity_probe=False),
                 optimizer=lambda named: torch.optim.AdamW([p for _, p in named]))
    return model, eng


def test_replace_optimizer_maps_every_holder_of_a_parameter_to_its_master():
    """Built over model.parameters() after the engine took the model: with bf16 compute the resident parameters
    are the engine's device copies, which replace_optimizer knows by their masters."""
    model, eng = _whole_step_engine("bfloat16")
    held = list(model.parameters())
    masters = dict(eng.named_parameters())
    assert any(all(p is not m for m in masters.values()) for p in held)  # some are copies, not masters
    opt = torch.optim.SGD(held, lr=0.1)
    assert eng.replace_optimizer(opt) is opt and eng.optimizer is opt
    assert {id(p) for p in opt.param_groups[0]["params"]} <= {id(m) for m in masters.values()}
    assert len(opt.param_groups[0]["params"]) == len(held)
    # Control: a tensor the model does not hold is refused, naming the fix.
    _, eng = _whole_step_engine("float32")
    with pytest.raises(ValueError, match=r"not a parameter of the model; build it over model.parameters\(\)"):
        eng.replace_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1))


def test_replace_optimizer_takes_the_models_original_parameters_and_refuses_after_a_step():
    model = tiny_model()
    originals = list(model.parameters())
    eng = Engine(model, EngineConfig(device="cpu", parity_probe=False),
                 optimizer=lambda named: torch.optim.AdamW([p for _, p in named]))
    opt = torch.optim.AdamW(originals, lr=1e-3)  # over the tensors the engine emptied
    eng.replace_optimizer(opt)
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for _, p in eng.named_parameters()}
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    eng.backward(eng(input_ids=ids, labels=ids).loss)
    eng.step()
    with pytest.raises(RuntimeError, match="trained with its current optimizer already"):
        eng.replace_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))


def test_set_clipping_clips_the_next_step_and_refuses_a_bad_value():
    from megatrain.backend import MegatrainBackend

    backend = MegatrainBackend(cpu=True)
    backend.prepare(tiny_model(), None)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    backend.backward(backend.engine(input_ids=ids, labels=ids).loss, sync=True)
    backend.optimizer_step()
    assert backend.last_grad_norm is None  # built without clipping
    backend.set_clipping(1e-3)
    backend.zero_grad()
    backend.backward(backend.engine(input_ids=ids, labels=ids).loss, sync=True)
    backend.optimizer_step()
    assert backend.last_grad_norm is not None and backend.last_grad_norm > 1e-3
    with pytest.raises(ValueError, match="max_norm=-1.0"):
        backend.set_clipping(-1)
    assert backend.engine.local_rank == 0 and backend.engine.rank == 0 and backend.engine.world_size == 1
