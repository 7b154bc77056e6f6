"""The rest of the `deepspeed` namespace under `import megatrain as deepspeed`: comm, utils, checkpointing,
ops.adam, accelerator, DeepSpeedEngine; hjson configs; the SGD optimizer section."""

from __future__ import annotations

import copy
import json
import logging
import warnings

import pytest
import torch
from conftest import make_batches, tiny_model

import megatrain as deepspeed
from megatrain.config.deepspeed import DeepSpeedConfigError, parse_config

TOL = 1e-5


def test_namespace_pieces():
    assert deepspeed.comm.get_rank() == 0 and deepspeed.comm.get_world_size() == 1
    t = torch.arange(3.0)
    deepspeed.comm.all_reduce(t)
    assert torch.equal(t, torch.arange(3.0))
    with pytest.raises(ValueError, match="rank 1"):
        deepspeed.comm.broadcast(t, src=1)
    from megatrain.deepspeed.deepspeed_engine import MegaTrainEngine

    assert deepspeed.DeepSpeedEngine is MegaTrainEngine
    acc = deepspeed.accelerator.get_accelerator()
    assert acc.device_name() in ("cpu", "cuda") and acc.device_count() >= 1
    assert isinstance(deepspeed.utils.logger, logging.Logger)
    x = torch.randn(4, requires_grad=True)
    y = deepspeed.checkpointing.checkpoint(lambda a: (a.sin() * 2).sum(), x)
    y.backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())
    with pytest.raises(ValueError, match="partition_activations"):
        deepspeed.checkpointing.configure(None, partition_activations=True)


def test_log_dist_logs_for_rank_zero_only(caplog):
    with caplog.at_level(logging.INFO, logger="megatrain"):
        deepspeed.utils.log_dist("for rank 0", ranks=[0])
        deepspeed.utils.log_dist("for rank 3", ranks=[3])
    assert "for rank 0" in caplog.text and "for rank 3" not in caplog.text


def _losses(engine, batches):
    out = []
    for b in batches:
        loss = engine(**b).loss
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def _reference(model, opt, batches):
    out = []
    for b in batches:
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _cfg(**over):
    return {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, **over}


def _init(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return deepspeed.initialize(**kw)


def test_deepspeed_cpu_adam_passed_as_optimizer_trains_as_adamw():
    from megatrain.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    batches = make_batches(3)
    ref_model = tiny_model()
    ref = _reference(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-3, weight_decay=0.01), batches)
    model = tiny_model()
    engine, *_ = _init(model=model, optimizer=DeepSpeedCPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01),
                       config=_cfg())
    assert max(abs(a - b) for a, b in zip(_losses(engine, batches), ref)) <= TOL
    with pytest.raises(ValueError, match="adamw_mode=False"):
        DeepSpeedCPUAdam(tiny_model().parameters(), adamw_mode=False)
    with pytest.raises(ValueError, match="bias_correction=False"):
        FusedAdam(tiny_model().parameters(), bias_correction=False)


def test_sgd_section_trains_as_torch_sgd():
    batches = make_batches(4)
    sgd = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}}
    engine, opt, *_ = _init(model=tiny_model(), config=_cfg(optimizer=sgd))
    assert isinstance(opt, torch.optim.SGD)
    ours = _losses(engine, batches)
    ref_model = tiny_model()
    ref = _reference(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01),
                     batches)
    assert max(abs(a - b) for a, b in zip(ours, ref)) <= TOL
    # Control: momentum matters by far more than the tolerance over these steps.
    plain_model = tiny_model()
    plain = _reference(plain_model, torch.optim.SGD(plain_model.parameters(), lr=0.05, weight_decay=0.01), batches)
    assert max(abs(a - b) for a, b in zip(plain, ref)) > 10 * TOL
    with pytest.raises(DeepSpeedConfigError, match="SGD needs"):
        parse_config(_cfg(optimizer={"type": "SGD", "params": {}}))
    with pytest.raises(DeepSpeedConfigError, match="nesterov"):
        parse_config(_cfg(optimizer={"type": "SGD", "params": {"lr": 0.1, "nesterov": True}}))


def test_hjson_config_files(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("""{
      // comments, unquoted keys and trailing commas, as DeepSpeed's hjson reader takes them
      train_batch_size: 4,
      train_micro_batch_size_per_gpu: 2,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.001,},},
    }""")
    cfg = parse_config(str(path))
    assert cfg.gradient_accumulation_steps == 2 and cfg.optimizer.lr == 0.001
    path.write_text('{"train_batch_size": 4, "train_batch_size": 8}')
    with pytest.raises(DeepSpeedConfigError, match="'train_batch_size' appears twice"):
        parse_config(str(path))
    path.write_text("{ this is : [ not either")
    with pytest.raises(DeepSpeedConfigError, match="neither valid JSON nor valid hjson"):
        parse_config(str(path))
    path.write_text(json.dumps(_cfg()))  # control: plain JSON still reads
    assert parse_config(str(path)).train_batch_size == 2


def test_namespace_survives_deepcopy_of_the_config():
    cfg = _cfg(optimizer={"type": "SGD", "params": {"lr": 0.1}})
    assert parse_config(copy.deepcopy(cfg)).resolved["optimizer"]["type"] == "SGD"


def test_lr_range_test_from_a_config_section():
    sched = {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 2}}
    engine, opt, _, lr_scheduler = _init(model=tiny_model(), config=_cfg(
        optimizer={"type": "SGD", "params": {"lr": 0.1}}, scheduler=sched))
    seen = [opt.param_groups[0]["lr"]]
    for b in make_batches(3):
        engine.backward(engine(**b).loss)
        engine.step()
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([1e-4, 1.5e-4, 2e-4, 2.5e-4], rel=1e-12)


def test_one_cycle_from_a_config_section():
    sched = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2}}
    engine, opt, _, lr_scheduler = _init(model=tiny_model(), config=_cfg(
        optimizer={"type": "AdamW", "params": {"lr": 0.1}}, scheduler=sched))
    seen = [(opt.param_groups[0]["lr"], opt.param_groups[0]["betas"])]
    for b in make_batches(4):
        engine.backward(engine(**b).loss)
        engine.step()
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]))
    assert [lr for lr, _ in seen] == pytest.approx([1e-4, 5.5e-4, 1e-3, 5.5e-4, 1e-4], rel=1e-12)
    assert [b[0] for _, b in seen] == pytest.approx([0.8, 0.85, 0.8, 0.85, 0.9], rel=1e-12)
