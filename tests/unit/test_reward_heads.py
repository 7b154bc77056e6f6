"""Decoders under a head of their own (sequence classification, reward, value) train exactly on MegaTrain: the
decoder base streamed, the head a resident parameter (its gradient, optimizer state and clip-norm share), the
model's own forward unchanged (pooling at the last non-pad token, its own loss).

Two models: transformers' AutoModelForSequenceClassification (Llama, num_labels=1: a reward model) and a user's
wrapper in DeepSpeed-Chat's style (`RewardModel`: the causal LM's base model, a `v_head`, the pairwise loss), each
through `megatrain.initialize` with a client AdamW and gradient_clipping 1.0, against plain PyTorch: FP32 within
1e-5, the GPU's defaults (bf16, hilo, overlap) within the reference's bf16 floor (tests/gpu_defaults.py). TRL's
RewardTrainer on MegaTrain against the same trainer on plain PyTorch; the parity probe on its own terms.
"""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import tiny_config
from gpu_defaults import CONFIGS, bf16_reference, deepspeed_keys, engine_grads, is_bf16, lag_updates
from kit import run_python, worker_env
from torch import nn
from transformers.utils import ModelOutput

import megatrain
from megatrain.engine import Engine
from megatrain.engine.model import model_object, probe
from megatrain.engine.model.probe_heads import head_subject

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
LR, WD, CLIP, STEPS = 3e-3, 0.01, 1.0, 6


@dataclass
class RewardOutput(ModelOutput):
    loss: torch.Tensor | None = None
    chosen_mean_scores: torch.Tensor | None = None
    rejected_mean_scores: torch.Tensor | None = None


class RewardModel(nn.Module):
    """DeepSpeed-Chat's RewardModel, trimmed: the first half of the batch chosen, the second rejected; each reward
    read at the row's last non-pad token; its forward is what runs, unchanged, on MegaTrain."""

    def __init__(self, base_model: nn.Module, pad_id: int = 0) -> None:
        super().__init__()
        self.config = base_model.config
        self.v_head = nn.Linear(self.config.hidden_size, 1, bias=False)
        self.rwtranrsformer = base_model
        self.PAD_ID = pad_id

    def forward(self, input_ids=None, past_key_values=None, attention_mask=None, position_ids=None, head_mask=None,
                inputs_embeds=None, use_cache=False):
        hidden = self.rwtranrsformer(input_ids, past_key_values=past_key_values, attention_mask=attention_mask,
                                     inputs_embeds=inputs_embeds, use_cache=use_cache)[0]
        rewards = self.v_head(hidden).squeeze(-1)
        bs = input_ids.shape[0] // 2
        last = (torch.arange(input_ids.shape[1]) * (input_ids != self.PAD_ID)).argmax(-1)
        end = rewards[torch.arange(input_ids.shape[0]), last]
        loss = -F.logsigmoid(end[:bs] - end[bs:]).mean()
        return RewardOutput(loss=loss, chosen_mean_scores=end[:bs], rejected_mean_scores=end[bs:])


def _seq_cls(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.AutoModelForSequenceClassification.from_config(tiny_config("llama", num_labels=1,
                                                                                   pad_token_id=0))


def _wrapper(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", pad_token_id=0)).model
    return RewardModel(base)


MODELS = {"seq-cls": _seq_cls, "wrapper": _wrapper}


def _batches(n: int, labels: bool, seed: int = 3) -> list[dict]:
    """Four rows each, right-padded to different lengths with the padding id (pooling reads each row's own last
    token); sequence labels for the classification model, none for the wrapper (its loss is pairwise)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 256, (4, 20), generator=g)
        mask = torch.ones_like(ids)
        for row, length in enumerate(torch.randint(8, 21, (4,), generator=g).tolist()):
            ids[row, length:] = 0
            mask[row, length:] = 0
        batch = {"input_ids": ids, "attention_mask": mask}
        if labels:
            batch["labels"] = torch.randn(4, generator=g)
        out.append(batch)
    return out


def _init(model: nn.Module, mode: dict):
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": CLIP,
           **deepspeed_keys(mode)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        return megatrain.initialize(model=model, optimizer=opt, config=cfg)[0]


def _plain(model: nn.Module, batches: list[dict]) -> tuple[list[float], list[float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms = [], []
    for b in batches:
        loss = model(**b).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


@pytest.mark.parametrize("mode", CONFIGS)
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_head_trains_like_plain_pytorch(kind, mode):
    model = MODELS[kind]()
    ref = copy.deepcopy(model)
    batches = _batches(STEPS, labels=kind == "seq-cls")
    engine = _init(model, mode)
    lag_updates(engine.engine)
    parts = engine.engine.parts
    assert parts.head_name == ("score" if kind == "seq-cls" else "v_head")
    head = model.get_submodule(parts.head_name).weight
    # the head is a resident parameter of the engine: in the optimizer, with a slot in the resident gradient slab
    assert any(p is engine.engine.store.globals.params[engine.engine.placement.global_index(parts.head_name +
               ".weight")] for g in engine.optimizer.param_groups for p in g["params"])
    losses, norms, first = [], [], None
    for b in batches:
        out = engine(**b)
        engine.backward(out.loss)
        first = engine_grads(engine.engine) if first is None else first
        engine.step()
        norms.append(engine.get_global_grad_norm())
        losses.append(out.loss.item())
    assert first[parts.head_name + ".weight"].abs().sum() > 0  # the head's gradient reached its slab
    if is_bf16(mode):
        assert head.dtype == torch.bfloat16  # the compute copy on the device; its FP32 master trains
        floor = bf16_reference(ref, batches, STEPS, 1, CLIP, optimizer=lambda m: torch.optim.AdamW(
            m.parameters(), lr=LR, weight_decay=WD, fused=True))
        assert min(floor.out[1]) > CLIP  # clipping was active in every step
        floor.check((losses, norms, first), engine.state_dict())
        return
    ref_losses, ref_norms = _plain(ref, batches)
    assert min(ref_norms) > CLIP  # clipping was active in every step, the head's gradient counted
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL, (losses, ref_losses)
    assert max(abs(a - b) for a, b in zip(norms, ref_norms)) < TOL * max(ref_norms), (norms, ref_norms)
    ours, want = engine.state_dict(), {n: p.detach() for n, p in ref.named_parameters()}
    assert ours.keys() == want.keys()
    assert max(float((ours[n] - want[n]).abs().max()) for n in want) < TOL
    # control: training moved the head and the layers well beyond the tolerance
    assert float((want[parts.head_name + ".weight"] - _fresh(kind)[parts.head_name + ".weight"]).abs().max()) > 1e-3


def _fresh(kind: str) -> dict[str, torch.Tensor]:
    return MODELS[kind]().state_dict()


def test_a_head_without_its_gradient_would_be_caught():
    """Control for the test above: the same FP32 run with the head's gradient dropped misses plain PyTorch by far
    more than the tolerance (so the comparison sees the head's training)."""
    model, ref = _seq_cls(), _seq_cls()
    batches = _batches(3, labels=True)
    engine = _init(model, dict(CONFIGS[0].values[0]))
    losses = []
    for b in batches:
        out = engine(**b)
        engine.backward(out.loss)
        engine.engine._all_grads()  # landed
        slab = engine.engine.store.globals
        slab.view(slab.grad, slab.slots[engine.engine.placement.global_index("score.weight")]).zero_()
        engine.engine.grads_written()
        engine.step()
        losses.append(out.loss.item())
    ref_losses, _ = _plain(ref, batches)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) > 100 * TOL


def test_trls_reward_trainer_matches_plain_trl(tmp_path):
    """TRL's RewardTrainer on AutoModelForSequenceClassification: MegaTrain (a "megatrain" section in the trainer's
    DeepSpeed config) against the same trainer on plain PyTorch, FP32, AdamW, max_grad_norm 1.0, 6 steps."""
    run_python([str(ROOT / "tests" / "workers" / "reward_trainer_runs.py"), str(tmp_path)], cwd=tmp_path,
               env=worker_env(world_size=1, threads=2), timeout=600, check=True)
    plain, mt = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("plain", "megatrain"))
    assert mt["engine"] == "MegaTrainEngine" and plain["engine"] != "MegaTrainEngine"
    steps = sorted(plain["losses"], key=int)
    assert len(steps) == 6 and sorted(mt["losses"], key=int) == steps
    assert max(abs(mt["losses"][s] - plain["losses"][s]) for s in steps) <= TOL
    assert max(abs(mt["grad_norms"][s] - plain["grad_norms"][s]) for s in steps) <= TOL * max(
        plain["grad_norms"].values())
    assert mt["accuracy"] == plain["accuracy"]
    assert max(abs(a - b) for a, b in zip(mt["score"], plain["score"])) <= TOL
    assert max(plain["grad_norms"].values()) > 1.0  # the clip was active
    moves = [abs(plain["losses"][a] - plain["losses"][b]) for a, b in zip(steps, steps[1:])]
    assert min(moves) > 10 * TOL, moves  # misaligned steps could not pass


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_the_probe_proves_the_base_under_a_head_and_catches_a_wrong_one(kind, monkeypatch):
    model = MODELS[kind]()
    subject = head_subject(model)
    assert subject is not None and subject.labelled == (kind == "seq-cls")
    verdict = probe.run_probe(subject.model_cls, model.config, Engine, None, subject)
    assert verdict.status == "exact", verdict
    real = model_object._route_base

    def off_by_a_tenth_of_a_percent(*args, **kwargs):
        out = real(*args, **kwargs)
        out.last_hidden_state.data.mul_(1.001)
        return out

    monkeypatch.setattr(model_object, "_route_base", off_by_a_tenth_of_a_percent)
    verdict = probe.run_probe(subject.model_cls, model.config, Engine, None, subject)
    assert verdict.status == "mismatch", verdict


def test_refusals_by_name():
    base = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))

    class NoConfig(nn.Module):
        def __init__(self):
            super().__init__()
            self.base, self.v_head = copy.deepcopy(base.model), nn.Linear(64, 1)

    with pytest.raises(ValueError, match=r"self.config = base.config"):
        Engine(NoConfig(), megatrain.EngineConfig(device="cpu", parity_probe=False))

    class OtherConfig(NoConfig):
        def __init__(self):
            super().__init__()
            self.config = copy.deepcopy(base.config)

    with pytest.raises(ValueError, match=r"is not its decoder base's config"):
        Engine(OtherConfig(), megatrain.EngineConfig(device="cpu", parity_probe=False))

    class WholeLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm, self.v_head = copy.deepcopy(base), nn.Linear(64, 1)
            self.config = self.lm.config

    with pytest.raises(ValueError, match=r"holds a causal LM's head `lm.lm_head`"):
        Engine(WholeLM(), megatrain.EngineConfig(device="cpu", parity_probe=False))

    eng = Engine(_seq_cls(), megatrain.EngineConfig(device="cpu", parity_probe=False))
    b = _batches(1, labels=True)[0]
    with pytest.raises(ValueError, match=r"has a head of its own \(`score`\)"):
        eng.forward(**b)
    assert eng(**b).loss.requires_grad  # the model's own forward: its pooling and regression loss


def test_a_trained_classifier_saves_and_reloads_with_transformers(tmp_path):
    engine = _init(_seq_cls(), dict(CONFIGS[0].values[0]))
    for b in _batches(2, labels=True):
        engine.backward(engine(**b).loss)
        engine.step()
    b = _batches(1, labels=False, seed=9)[0]
    engine.eval()
    with torch.no_grad():
        want = engine(**b).logits
    engine.save_pretrained(tmp_path)
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, local_files_only=True).eval()
    with torch.no_grad():
        got = back(**b).logits
    assert got.shape == (4, 1) and torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())


def test_the_accelerate_face_trains_a_reward_wrapper_like_plain_pytorch():
    """The same wrapper through `megatrain.Accelerator(backend="megatrain")`: prepare, accelerator.backward,
    clip_grad_norm_ over model.parameters(), optimizer.step (FP32, 4 steps)."""
    model, ref = _wrapper(), _wrapper()
    batches = _batches(4, labels=False)
    acc = megatrain.Accelerator(backend="megatrain")
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD))
    losses, norms = [], []
    for b in batches:
        loss = model(**b).loss
        acc.backward(loss)
        norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ref_losses, ref_norms = _plain(ref, batches)
    assert min(ref_norms) > CLIP
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL, (losses, ref_losses)
    assert max(abs(a - b) for a, b in zip(norms, ref_norms)) < TOL * max(ref_norms), (norms, ref_norms)
