"""What a DeepSpeed script touches beyond the training loop, on MegaTrain: every public name of DeepSpeed 0.19.8's
DeepSpeedEngine is answered by MegaTrain's engine or refused by name with the reason; `get_accelerator()` has
DeepSpeed's accelerator verbs; `tput_timer` counts as DeepSpeed's; a write under `GatheredParameters(...,
modifier_rank=0)` reaches the engine's host masters and trains on."""

from __future__ import annotations

import ast
import copy
import inspect
import warnings

import pytest
import torch
from conftest import make_batches, tiny_model

import megatrain as deepspeed
from megatrain.deepspeed import accelerator as mt_accelerator
from megatrain.deepspeed.surface import REFUSED


def _engine(model, **over):
    cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
           "steps_per_print": 10**6, **over}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                                 config=cfg)
    return engine, opt


def _deepspeed_public_names() -> set[str]:
    """DeepSpeedEngine's public methods and properties (beyond nn.Module's) and the public attributes its
    __init__ sets."""
    ds_engine = pytest.importorskip("deepspeed.runtime.engine")
    cls = ds_engine.DeepSpeedEngine
    names = {n for n in dir(cls) if not n.startswith("_")} - set(dir(torch.nn.Module))
    init = next(f for f in ast.parse(inspect.getsource(cls)).body[0].body
                if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    names |= {n.attr for n in ast.walk(init) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
              and isinstance(n.value, ast.Name) and n.value.id == "self" and not n.attr.startswith("_")}
    return names


def test_every_public_name_of_deepspeeds_engine_is_answered_or_refused_by_name():
    engine, _ = _engine(tiny_model(layers=2))
    names = _deepspeed_public_names()
    assert len(names) > 200  # control: the listing found DeepSpeed's surface
    ours = set(dir(type(engine))) | set(vars(engine))
    missing = sorted(n for n in names if n not in ours and n not in REFUSED)
    assert not missing, f"DeepSpeedEngine names neither answered nor refused: {missing}"
    assert not sorted(n for n in REFUSED if n in ours), "a refused name is also answered"
    assert not sorted(set(REFUSED) - names), "a refusal names no DeepSpeedEngine attribute"
    # A refused name says why, even where the wrapped model has an attribute of that name.
    engine.module.flatten = "the model's own"
    with pytest.raises(AttributeError, match=r"DeepSpeedEngine.flatten is not available on MegaTrain's engine: "):
        engine.flatten  # noqa: B018
    with pytest.raises(AttributeError, match="ZeRO's partitioning"):
        engine.zero_offload_param()
    assert not hasattr(engine, "has_moe_layers")
    # The names answered here answer as DeepSpeed's would for this config.
    assert engine.get_batch_info() == (2, 2, 1) and engine.get_data_parallel_rank() == 0
    assert engine.get_data_types() == (torch.float32, torch.float32) and engine.mp_world_size == 1
    assert engine.optimizer_name() is None and engine.scheduler_name() is None and not engine.is_compiled
    assert engine.param_names[engine.module.lm_head.weight] == "lm_head.weight"
    assert engine.save_fp16_model == engine.save_16bit_model and not engine.monitor.enabled


def test_tput_timer_counts_steps_epochs_and_samples_per_second_as_deepspeeds():
    engine, _ = _engine(tiny_model(layers=2))
    for batch in make_batches(5):
        engine.backward(engine(**batch).loss)
        engine.step()
    timer = engine.tput_timer
    assert (timer.global_step_count, timer.micro_step_count, timer.batch_size) == (5, 5, 2)
    assert timer.avg_samples_per_sec() > 0 and timer.total_elapsed_time > 0  # 3 steps timed after 2 of warm-up
    timer.update_epoch_count()
    assert (timer.epoch_count, timer.micro_step_count) == (1, 0)


def test_get_accelerator_has_deepspeeds_accelerator_verbs():
    abstract = pytest.importorskip("deepspeed.accelerator.abstract_accelerator")
    acc = deepspeed.get_accelerator()
    assert acc is mt_accelerator.get_accelerator() and acc is deepspeed.accelerator.get_accelerator()
    verbs = abstract.DeepSpeedAccelerator.__abstractmethods__
    missing = sorted(v for v in verbs if v not in mt_accelerator.REFUSED and not hasattr(type(acc), v))
    assert not missing, f"DeepSpeed accelerator verbs neither answered nor refused: {missing}"
    with pytest.raises(AttributeError, match="op builders"):
        acc.create_op_builder  # noqa: B018
    # On this CPU machine: as DeepSpeed's CPU accelerator (the device MegaTrain computes on).
    if acc.device_name() != "cpu":
        pytest.skip("the checks below are the CPU accelerator's")
    acc.set_device(0)
    acc.synchronize()
    acc.empty_cache()
    assert (acc.current_device_name(), acc.device_count(), acc.is_synchronized_device()) == ("cpu", 1, True)
    assert torch.equal(acc.FloatTensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    acc.manual_seed(3)
    a = torch.rand(2)
    acc.manual_seed(3)
    assert torch.equal(a, torch.rand(2)) and acc.total_memory() >= acc.available_memory() > 0


def test_a_write_under_gathered_parameters_reaches_the_host_masters_and_trains_on():
    model = tiny_model(layers=2)
    plain = copy.deepcopy(model)
    engine, _ = _engine(model)
    batches = make_batches(3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for m in (plain, engine):
        loss = m(**batches[0]).loss
        (m.backward if m is engine else lambda x: x.backward())(loss)
        (m.step if m is engine else plain_opt.step)()
        plain_opt.zero_grad()
    written = [engine.module.model.embed_tokens.weight, engine.module.model.layers[1].mlp.up_proj.weight]
    from megatrain.deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

    assert GatheredParameters is deepspeed.zero.GatheredParameters and ZeroParamStatus.AVAILABLE.value == 1
    before = engine.state_dict()
    with deepspeed.zero.GatheredParameters(written, modifier_rank=0):
        for p in written:
            p.data.mul_(0.5)
    with torch.no_grad():
        plain.model.embed_tokens.weight.mul_(0.5)
        plain.model.layers[1].mlp.up_proj.weight.mul_(0.5)
    after = engine.state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.up_proj.weight"):
        assert torch.equal(after[name], before[name] * 0.5)
    assert torch.equal(after["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"])
    for batch in batches[1:]:
        ref = plain(**batch).loss
        ref.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        assert abs(loss.item() - ref.item()) <= 1e-5


@pytest.mark.slow
def test_the_stage3_save_gives_the_dtype_the_config_asks_for():
    """accelerate and Trainer save a stage-3 run through `_zero3_consolidated_16bit_state_dict`: bf16 when the config
    says bf16 (as DeepSpeed gives it), the FP32 masters otherwise; copies, never views of the engine's buffers."""
    for bf16 in (False, True):
        engine, _ = _engine(tiny_model(layers=2), bf16={"enabled": bf16})
        batch = make_batches(1)[0]
        engine.backward(engine(**batch).loss)
        engine.step()
        masters = engine.state_dict()
        sd = engine._zero3_consolidated_16bit_state_dict()
        want = torch.bfloat16 if bf16 else torch.float32
        assert {v.dtype for v in sd.values()} == {want} and set(masters) <= set(sd)
        assert all(torch.equal(sd[k], masters[k].to(want)) for k in masters)
        storages = {v.untyped_storage().data_ptr() for v in sd.values()}
        assert len(storages) == len(sd) - (1 if engine.module.config.tie_word_embeddings else 0)


def test_a_decoder_with_a_classification_or_reward_head_is_taken_naming_the_head():
    """transformers' sequence classification and a user's reward wrapper (base model + v_head): the decoder base
    streamed, the head named (trained exactly: tests/unit/test_reward_heads.py)."""
    import transformers

    from megatrain.models.adapter import find_parts

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, num_labels=1, pad_token_id=0)

    class RewardModel(torch.nn.Module):
        def __init__(self, base: torch.nn.Module) -> None:
            super().__init__()
            self.config = base.config
            self.v_head = torch.nn.Linear(64, 1, bias=False)
            self.rwtransformer = base

    for model, head, base in ((transformers.LlamaForSequenceClassification(cfg), "score", "model"),
                              (RewardModel(transformers.LlamaModel(cfg)), "v_head", "rwtransformer")):
        parts = find_parts(model)
        assert (parts.head_name, parts.base_prefix, parts.layers_prefix) == (head, base, f"{base}.layers")
        assert parts.lm_head is model.get_submodule(head) and parts.norm is model.get_submodule(base).norm
    assert find_parts(transformers.LlamaForCausalLM(cfg)).head_name is None  # control: a causal LM's head
