"""DeepSpeed config parsing: resolution as DeepSpeed/HF do it, and clear errors for what cannot run."""

from __future__ import annotations

import json
import types
import warnings

import pytest
import torch

from megatrain.config.deepspeed import DeepSpeedConfigError, OptimizerSpec, parse_config
from megatrain.config.schema import EngineConfig
from megatrain.lr_schedules import WarmupCosineLR, WarmupDecayLR


def _parse(d, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a config with nothing ignored must not warn
        return parse_config(d, **kw)


FULL = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10,
                             "total_num_steps": 100}},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                          "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "steps_per_print": 5,
    "wall_clock_breakdown": True,
    "megatrain": {"num_buffers": 3, "loss_chunk_tokens": 512},
}


def test_full_config_and_from_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(FULL))
    for src in (FULL, path, str(path)):
        c = _parse(src)
        assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (8, 2, 4)
        assert c.gradient_clipping == 0.5
        assert c.optimizer == OptimizerSpec("AdamW", 3e-4, (0.8, 0.95), 1e-6, 0.1)
        assert c.scheduler.type == "WarmupDecayLR" and c.scheduler.params["total_num_steps"] == 100
        assert c.bf16 and c.zero.stage == 3 and c.zero.pin_memory is True
        assert c.engine == EngineConfig(compute_dtype="bfloat16", num_buffers=3, loss_chunk_tokens=512,
                                        pin_memory=True)
        assert c.steps_per_print == 5 and c.wall_clock_breakdown
    assert FULL["megatrain"] == {"num_buffers": 3, "loss_chunk_tokens": 512}  # input not mutated


def test_defaults_match_deepspeed():
    c = _parse({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "adam"}})
    assert (c.train_batch_size, c.gradient_accumulation_steps) == (4, 1)
    assert c.gradient_clipping == 1.0  # DeepSpeed clips at 1.0 unless told otherwise
    assert c.optimizer == OptimizerSpec("Adam", lr=1e-3, weight_decay=0.0, adam_w_mode=True)
    assert c.scheduler is None and not c.bf16 and c.engine == EngineConfig()
    assert c.steps_per_print is None and not c.wall_clock_breakdown


@pytest.mark.parametrize(
    "given,expect",
    [
        ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3}, (12, 3, 4)),
        ({"train_batch_size": 12, "gradient_accumulation_steps": 2}, (12, 6, 2)),
        ({"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 3}, (15, 5, 3)),
        ({"train_batch_size": 7}, (7, 7, 1)),
        ({"train_micro_batch_size_per_gpu": 2}, (2, 2, 1)),
        ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
         (6, 2, 3)),
        ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
         (8, 8, 1)),
        ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"},
         (8, 4, 2)),
    ],
)
def test_batch_resolution(given, expect):
    c = _parse(given)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == expect


def test_batch_resolution_agrees_with_deepspeed():
    import deepspeed.runtime.config as dsc

    class Probe(dsc.DeepSpeedConfig):
        def __init__(self, d):  # only the batch logic, without a distributed init
            self.world_size = 1
            self.train_batch_size = d.get("train_batch_size")
            self.train_micro_batch_size_per_gpu = d.get("train_micro_batch_size_per_gpu")
            self.gradient_accumulation_steps = d.get("gradient_accumulation_steps")
            self._configure_train_batch_size()

    for d in ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3},
              {"train_batch_size": 12, "gradient_accumulation_steps": 2},
              {"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 3},
              {"train_batch_size": 7}, {"train_micro_batch_size_per_gpu": 2}):
        p, c = Probe(d), _parse(d)
        assert (p.train_batch_size, p.train_micro_batch_size_per_gpu, p.gradient_accumulation_steps) == (
            c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps)


def test_auto_from_training_arguments():
    args = types.SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=2e-5,
                                 adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-7, weight_decay=0.01,
                                 max_grad_norm=0.7, warmup_steps=3, max_steps=50, bf16=True)
    d = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
         "optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}},
         "scheduler": {"type": "WarmupDecayLR", "params": {k: "auto" for k in (
             "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")}}}
    c = _parse(d, args=args)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (8, 4, 2)
    assert c.gradient_clipping == 0.7 and c.bf16
    assert c.optimizer == OptimizerSpec("AdamW", 2e-5, (0.9, 0.98), 1e-7, 0.01)
    assert c.scheduler.params == {"warmup_min_lr": 0, "warmup_max_lr": 2e-5, "warmup_num_steps": 3,
                                  "total_num_steps": 50}
    assert c.resolved["optimizer"]["params"]["lr"] == 2e-5 and c.resolved["train_batch_size"] == 8


def test_auto_warmup_max_lr_comes_from_optimizer():
    c = _parse({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 5e-4}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_min_lr": "auto"}}})
    assert c.scheduler.params == {"warmup_max_lr": 5e-4, "warmup_min_lr": 0}


@pytest.mark.parametrize(
    "d,match",
    [
        ({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
         r"optimizer.params.lr.*auto.*learning_rate"),
        ({"train_batch_size": 1, "gradient_clipping": "auto"}, r"gradient_clipping.*max_grad_norm"),
        ({"train_batch_size": 1, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
         r"total_num_steps.*auto.*max_steps"),
        ({"train_batch_size": "auto"}, r"either 'train_batch_size' or 'train_micro_batch_size_per_gpu'"),
    ],
)
def test_unresolvable_auto(d, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        parse_config(d)


@pytest.mark.parametrize(
    "d,match",
    [
        ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
         r"train_batch_size \(8\) must equal train_micro_batch_size_per_gpu \(3\) x gradient_accumulation_steps "
         r"\(2\)"),
        ({"train_batch_size": 5, "train_micro_batch_size_per_gpu": 2}, r"train_batch_size \(5\) must equal"),
        ({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 4}, r"cannot be split"),
        ({"train_batch_size": 0}, r"'train_batch_size' must be >= 1"),
        ({"gradient_accumulation_steps": 2}, r"either 'train_batch_size'"),
        ({"train_batch_size": "8"}, r"'train_batch_size' must be an integer, got str"),
        ({"train_batch_size": True}, r"'train_batch_size' must be an integer, got bool"),
        ({"train_batch_size": 1, "train_batch_szie": 1}, r"unknown key 'train_batch_szie'; did you mean 'train_batch_size'"),
        ({"train_batch_size": 1, "gradient_cliping": 1.0}, r"did you mean 'gradient_clipping'"),
        ({"train_batch_size": 1, "zero_optimisation": {}}, r"did you mean 'zero_optimization'"),
        ({"train_batch_size": 1, "gradient_clipping": -1}, r"gradient_clipping=-1.0 must be >= 0"),
        ({"train_batch_size": 1, "gradient_clipping": "1.0"}, r"'gradient_clipping' must be a finite number"),
        ({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": -1e-3}}},
         r"'optimizer.params.lr' must be >= 0"),
        ({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e30}}},
         r"'optimizer.params.lr' = 1e\+30 is far beyond.*<= 1"),
        ({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"eps": 0}}},
         r"'optimizer.params.eps' = 0 is 0 in FP32 and divides 0 by 0.*e.g. 1e-8"),
        ({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"eps": 1e-135}}},
         r"'optimizer.params.eps' = 1e-135 is 0 in FP32"),
        ({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 3e41}}},
         r"'optimizer.params.weight_decay' = 3e\+41 with lr 0.01 .* keep lr x weight_decay <= 1"),
        ({"train_batch_size": 1, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 5.0}}},
         r"'scheduler.params.warmup_max_lr' = 5.0 is far beyond"),
        ({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, r"betas"),
        ({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"weight_decya": 0.1}}},
         r"unknown key optimizer.params.'weight_decya'; did you mean 'weight_decay'"),
        ({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}},
         r"use the top-level 'gradient_clipping'"),
        ({"train_batch_size": 1, "optimizer": {"type": "Lamb"}}, r"optimizer type 'Lamb' is not supported"),
        ({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"bias_correction": False}}},
         r"bias_correction"),
        ({"train_batch_size": 1, "scheduler": {"type": "WarmupDecay"}}, r"did you mean 'WarmupDecayLR'"),
        ({"train_batch_size": 1, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3}}},
         r"WarmupDecayLR needs 'scheduler.params.total_num_steps'"),
        ({"train_batch_size": 1, "scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}}},
         r"did you mean 'warmup_num_steps'"),
        ({"train_batch_size": 1, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2.5}}},
         r"warmup_num_steps' must be an integer"),
        ({"train_batch_size": 1, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
         r"warmup_type"),
        ({"train_batch_size": 1, "scheduler": {"type": "StepLR", "params": {}}}, r"StepLR needs 'scheduler.params.step_size'"),
        ({"train_batch_size": 1, "fp16": {"enabled": True}}, r"fp16 is not supported.*bf16"),
        ({"train_batch_size": 1, "bf16": {"enabled": "yes"}}, r"'bf16.enabled' must be true or false"),
        ({"train_batch_size": 1, "bf16": True}, r"'bf16' must be an object"),
        ({"train_batch_size": 1, "zero_optimization": {"stage": 4}}, r"stage' must be 0, 1, 2 or 3"),
        ({"train_batch_size": 1, "zero_optimization": {"offload_param": {"device": "gpu"}}},
         r"offload_param.device' must be one of"),
        ({"train_batch_size": 1, "zero_optimization": {"offload_optimizer": {"pin_memroy": True}}},
         r"did you mean 'pin_memory'"),
        ({"train_batch_size": 1, "zero_optimization": {"stage3_prefetch_bucket_sise": 1}},
         r"did you mean 'stage3_prefetch_bucket_size'"),
        ({"train_batch_size": 1, "megatrain": {"num_bufers": 2}}, r"did you mean 'num_buffers'"),
        ({"train_batch_size": 1, "megatrain": {"num_buffers": 0}}, r"'megatrain' section: num_buffers"),
        ({"train_batch_size": 1, "bf16": {"enabled": False}, "megatrain": {"compute_dtype": "bfloat16"}},
         r"compute_dtype.*bf16.enabled is false"),
        ({"train_batch_size": 1, "steps_per_print": 0}, r"steps_per_print' must be >= 1"),
        ({"train_batch_size": 1, "managed_gradient_accumulation": False}, r"managed_gradient_accumulation"),
    ],
)
def test_bad_configs_are_named(d, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        parse_config(d)


def test_weight_decay_bound_is_for_decoupled_decay_only():
    # lr x wd > 1 flips and grows every weight under AdamW's decoupled decay; as Adam's L2 term it is
    # normalized by the second moment, so the same values are a (strange) valid choice there.
    adam_l2 = {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 200.0, "adam_w_mode": False}}
    spec = _parse({"train_batch_size": 1, "optimizer": adam_l2}).optimizer
    assert (spec.weight_decay, spec.adam_w_mode) == (200.0, False)
    with pytest.raises(DeepSpeedConfigError, match=r"lr 0.01 multiplies every weight by .* = -1 each step"):
        parse_config({"train_batch_size": 1, "optimizer": {**adam_l2, "type": "AdamW"}})


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        parse_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 1,}')  # a trailing comma is hjson, which DeepSpeed reads too
    assert parse_config(bad).train_batch_size == 1
    bad.write_text('{"train_batch_size": [1,')
    with pytest.raises(ValueError, match="neither valid JSON nor valid hjson"):
        parse_config(bad)
    with pytest.raises(TypeError, match="dict or a path"):
        parse_config(42)


def test_ignored_settings_in_one_warning():
    d = {"train_batch_size": 1,
         "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_prefetch_bucket_size": "auto",
                               "offload_optimizer": {"device": "cpu", "pin_memory": False, "buffer_count": 4}},
         "bf16": {"enabled": False, "immediate_grad_update": True},
         "communication_data_type": "fp32", "flops_profiler": {"enabled": False}}
    with pytest.warns(UserWarning) as rec:
        c = parse_config(d)
    assert len(rec) == 1
    msg = str(rec[0].message)
    for key in ("zero_optimization.overlap_comm", "zero_optimization.stage3_prefetch_bucket_size",
                "zero_optimization.offload_optimizer.buffer_count", "bf16.immediate_grad_update",
                "communication_data_type", "flops_profiler"):
        assert key in msg and key in c.ignored
    assert "pin_memory" not in msg and "stage," not in msg
    assert c.engine.pin_memory is False


# What TRL's prepare_deepspeed adds to a ZeRO-3 trainer's config for a DPO reference model (h = hidden size).
TRL_REF_KEYS = {"zero_optimization.reduce_bucket_size": 64 * 64,
                "zero_optimization.stage3_param_persistence_threshold": 10 * 64,
                "zero_optimization.stage3_prefetch_bucket_size": 0.9 * 64 * 64}


def test_keys_trainers_write_are_accepted_and_named_as_ignored():
    d = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, **TRL_REF_KEYS}
    with pytest.warns(UserWarning) as rec:
        c = parse_config(d)
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert "\n" not in msg and "ignores" in msg
    for key in TRL_REF_KEYS:
        assert key in msg and key in c.ignored
    assert c.zero.stage == 3 and c.engine == parse_config({"train_micro_batch_size_per_gpu": 1}).engine


@pytest.mark.parametrize("key, match", [
    # A user's typo in the same form is still refused, with the dotted spelling it resembles.
    ("zero_optimization.reduce_bucket_sise", r"unknown key 'zero_optimization.reduce_bucket_sise'; did you mean "
                                             r"'zero_optimization.reduce_bucket_size'"),
    ("zero_optimisation.stage", r"did you mean 'zero_optimization.stage'"),
    ("my_setting.value", r"unknown key 'my_setting.value'$"),
])
def test_unknown_dotted_keys_are_refused(key, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        parse_config({"train_micro_batch_size_per_gpu": 1, key: 1})


def test_nvme_offload_of_the_optimizer_is_the_nvme_tier_and_of_the_parameters_refused():
    nvme = {"device": "nvme", "nvme_path": "/local_nvme"}

    def parse(zero, **extra):
        return parse_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, **zero}, **extra})

    # ZeRO-Infinity's optimizer section is the engine's NVMe tier, at the path it names.
    assert parse({"offload_optimizer": nvme}).engine.nvme_path == "/local_nvme"
    assert parse({"offload_optimizer": {**nvme, "device": "cpu"}}).engine.nvme_path is None  # the control
    # The weights are read by every pass: the tier does not hold them, and says what to set instead.
    with pytest.raises(DeepSpeedConfigError, match=r"'zero_optimization.offload_param.device' is \"nvme\", but "
                                                   r"MegaTrain's NVMe tier holds the optimizer state only.*"
                                                   r"Set \"device\": \"cpu\" here"):
        parse({"offload_param": nvme})
    with pytest.raises(DeepSpeedConfigError, match=r"'nvme_path' is None; give the directory"):
        parse({"offload_optimizer": {"device": "nvme"}})
    with pytest.raises(DeepSpeedConfigError, match=r"'megatrain.nvme_path' is '/elsewhere' but .* is '/local_nvme'"):
        parse({"offload_optimizer": nvme}, megatrain={"nvme_path": "/elsewhere"})
    assert parse({"offload_optimizer": nvme}, megatrain={"nvme_path": "/local_nvme"}).engine.nvme_path == "/local_nvme"
    # On the CPU its NVMe path is one more ignored setting.
    with pytest.warns(UserWarning, match=r"zero_optimization.offload_param.nvme_path"):
        c = parse({"offload_param": {**nvme, "device": "cpu"}})
    assert c.zero.offload_param_device == "cpu"


def test_builds_optimizer_and_scheduler():
    c = _parse({"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.1, "adam_w_mode": False,
                                                                                 "weight_decay": 0.01}},
                "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}}})
    p = torch.nn.Parameter(torch.ones(3))
    opt = c.optimizer.build([p])
    assert type(opt) is torch.optim.Adam and opt.defaults["weight_decay"] == 0.01  # L2 Adam, as DeepSpeed
    sched = c.scheduler.build(opt)
    assert isinstance(sched, WarmupCosineLR) and opt.param_groups[0]["lr"] == 0.0
    c = _parse({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
                "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}})
    opt = c.optimizer.build([p])
    assert type(opt) is torch.optim.AdamW and opt.defaults["weight_decay"] == 0.0
    assert isinstance(c.scheduler.build(opt), WarmupDecayLR)
    c = _parse({"train_batch_size": 1, "scheduler": {"type": "StepLR", "params": {"step_size": 2}}})
    assert isinstance(c.scheduler.build(torch.optim.SGD([p], lr=1.0)), torch.optim.lr_scheduler.StepLR)


@pytest.mark.parametrize("kw,match", [
    (dict(link_gbps=7.7e-182), r"link_gbps=7.7e-182 must be a finite rate >= 0.001 GB/s"),  # slept past time_t
    (dict(link_gbps=float("inf")), r"link_gbps=inf must be a finite rate"),
    (dict(watchdog_s=5.9e-53), r"watchdog_s=5.9e-53 must be from 0.1 s"),  # fired on healthy work
    (dict(watchdog_s=1e30), r"watchdog_s=1e\+30 must be from 0.1 s .* to 9223372036 s"),  # overflowed the wait
])
def test_engine_rates_and_timeouts_outside_what_threads_can_do_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)
    EngineConfig(link_gbps=1e-3, watchdog_s=0.1)  # the bounds themselves are fine
