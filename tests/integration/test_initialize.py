"""The DeepSpeed-compatible face: DeepSpeed's training-loop semantics, checkpoints, export, bad configs.

The end-to-end checks run tests/workers/ds_style_train.py, an ordinary DeepSpeed script, in subprocesses:
once under real DeepSpeed ZeRO-3 CPU offload and once under `import megatrain as deepspeed`.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from conftest import make_batches, tiny_model
from gpu_defaults import CONFIGS, bf16_reference, deepspeed_keys, engine_grads, is_bf16, lag_updates
from kit import finish, start_python, worker_env

import megatrain
from baselines.zero3 import default_extensions_dir
from megatrain.config.deepspeed import DeepSpeedConfigError
from megatrain.deepspeed import MegaTrainEngine, initialize
from megatrain.run import checkpoint as ck

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parents[1] / "workers" / "ds_style_train.py"


def _cfg(**over):
    cfg = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    }
    cfg.update(over)
    return cfg


def _init(model=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return initialize(model=model if model is not None else tiny_model("llama"), **kw)


# ---------------------------------------------------------------------------------------------------
# the package namespace


def test_package_exposes_the_deepspeed_names():
    from megatrain import deepspeed as face

    assert megatrain.initialize is face.initialize  # the package attribute is the function, never a module
    missing = [n for n in ("initialize", "init_distributed", "add_config_arguments", "zero")
               if not hasattr(megatrain, n)]
    assert not missing, f"megatrain/__init__.py must export {missing} for `import megatrain as deepspeed`"
    assert face.initialize is initialize


def test_helpers_for_scripts():
    import argparse

    from megatrain.deepspeed import add_config_arguments, init_distributed, zero

    args = add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed", "--deepspeed_config", "x.json"])
    assert args.deepspeed and args.deepspeed_config == "x.json"
    init_distributed(dist_backend="gloo", dist_init_required=False)  # the process group itself: see the script
    with pytest.raises(ValueError, match="launch every rank"):
        init_distributed(world_size=2)  # WORLD_SIZE says 1: a group of 2 would wait for a rank that never comes
    with zero.Init(remote_device="cpu", config_dict_or_path={}):
        m = torch.nn.Linear(2, 2)
    assert m.weight.numel() == 4


# ---------------------------------------------------------------------------------------------------
# training-loop semantics


def test_accumulation_counters_and_lr_follow_deepspeed():
    from deepspeed.runtime import lr_schedules as ds_sched

    sched_params = {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 2, "total_num_steps": 6,
                    "warmup_type": "linear"}
    engine, opt, _, sched = _init(config=_cfg(gradient_accumulation_steps=2, train_batch_size=4,
                                              scheduler={"type": "WarmupDecayLR", "params": sched_params}))
    # DeepSpeed's engine steps its schedule once per boundary; replay that on DeepSpeed's own class.
    ref_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    ref = ds_sched.WarmupDecayLR(ref_opt, **sched_params)
    batches = make_batches(12)
    boundaries, lrs, expected = [], [], []
    for i, batch in enumerate(batches):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(**batch).loss)
        engine.step()
        if (i + 1) % 2 == 0:
            ref.step()
        lrs.append(engine.get_lr()[0])
        expected.append(ref_opt.param_groups[0]["lr"])
    assert boundaries == [False, True] * 6
    assert lrs == expected
    assert len(set(lrs)) > 3
    assert (engine.micro_steps, engine.global_steps, engine.global_samples) == (12, 6, 24)
    assert sched.last_batch_iteration == 5


def _reference_run(model, batches, gas, clip, lr, wd, warmup):
    from megatrain.lr_schedules import WarmupLR

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    sched = WarmupLR(opt, warmup_min_lr=lr / 10, warmup_max_lr=lr, warmup_num_steps=warmup, warmup_type="linear")
    losses, norms = [], []
    for i, b in enumerate(batches):
        loss = model(**b).loss
        (loss / gas).backward()
        losses.append(loss.item())
        if (i + 1) % gas == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            opt.zero_grad()
            sched.step()
    return losses, norms


@pytest.mark.parametrize("mode", CONFIGS)
def test_boundary_step_matches_plain_pytorch(mode):
    lr, wd, clip, gas, warmup = 1e-3, 0.01, 0.3, 2, 3
    model = tiny_model("llama", seed=3)
    ref_model = copy.deepcopy(model)
    batches = make_batches(8, seed=5)
    cfg = _cfg(gradient_accumulation_steps=gas, gradient_clipping=clip,
               optimizer={"type": "AdamW", "params": {"lr": lr, "weight_decay": wd}},
               scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": lr / 10, "warmup_max_lr": lr,
                                                         "warmup_num_steps": warmup, "warmup_type": "linear"}},
               **deepspeed_keys(mode))
    engine, *_ = _init(model, config=cfg)
    lag_updates(engine.engine)
    losses, norms, first = [], [], None
    for b in batches:
        out = engine(**b)
        scaled = engine.backward(out.loss)
        assert math.isclose(scaled.item(), out.loss.item() / gas, rel_tol=1e-6)  # DeepSpeed returns loss / gas
        if engine.is_gradient_accumulation_boundary():
            first = engine_grads(engine.engine) if first is None else first
            engine.step()
            norms.append(engine.get_global_grad_norm())
        else:
            engine.step()
        losses.append(out.loss.item())
    if is_bf16(mode):
        from megatrain.lr_schedules import WarmupLR

        floor = bf16_reference(
            ref_model, batches, len(batches) // gas, gas, clip,
            optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd, fused=True),
            scheduler=lambda o: WarmupLR(o, warmup_min_lr=lr / 10, warmup_max_lr=lr, warmup_num_steps=warmup,
                                         warmup_type="linear"))
        assert min(floor.out[1]) > clip  # clipping was active in every step
        floor.check((losses, norms, first), engine.state_dict())
        return
    ref_losses, ref_norms = _reference_run(ref_model, batches, gas, clip, lr, wd, warmup)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
    assert max(abs(a - b) for a, b in zip(norms, ref_norms)) < 1e-5
    assert min(ref_norms) > clip  # clipping was active in every step
    ours, ref = engine.state_dict(), {n: p.detach() for n, p in ref_model.named_parameters()}
    assert max(float((ours[n] - ref[n]).abs().max()) for n in ref) < 1e-5


def test_set_gradient_accumulation_boundary_and_nonfinite_skip():
    engine, opt, _, sched = _init(config=_cfg(gradient_accumulation_steps=2, train_batch_size=4,
                                              scheduler={"type": "WarmupLR", "params": {
                                                  "warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 4,
                                                  "warmup_type": "linear"}}))
    batch = make_batches(1)[0]
    engine.set_gradient_accumulation_boundary(True)  # the caller owns the boundary from here on
    engine.backward(engine(**batch).loss)
    engine.step()
    assert engine.global_steps == 1 and engine.was_step_applied()
    lr = engine.get_lr()
    before = engine.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.backward(engine(**batch).loss * float("nan"))
        engine.step()
    # Like DeepSpeed's overflow handling: counted, parameters and schedule untouched, global_steps advances.
    assert not engine.was_step_applied() and engine.skipped_steps == 1 and engine.global_steps == 2
    assert engine.get_lr() == lr == [1e-4] and sched.last_batch_iteration == 0
    assert all(torch.equal(before[n], t) for n, t in engine.state_dict().items())


def test_steps_per_print_and_wall_clock_breakdown_log(caplog):
    import logging

    caplog.set_level(logging.INFO, logger="megatrain")
    engine, *_ = _init(config=_cfg(train_batch_size=2, steps_per_print=2, wall_clock_breakdown=True))
    for b in make_batches(4):
        engine.backward(engine(**b).loss)
        engine.step()
    msgs = [r.getMessage() for r in caplog.records if r.name == "megatrain"]
    assert [m.split(",")[0] for m in msgs if m.startswith("step=")] == ["step=2", "step=4"]
    assert sum(m.startswith("time (ms) | forward:") for m in msgs) == 4


def test_wall_clock_breakdown_adds_no_sync(caplog, monkeypatch):
    """The per-step breakdown reads what each call took on this thread and the copy waits as they finish
    (accounting.take_phases): no Engine.synchronize (a device sync and a wait for every host thread)."""
    import logging

    from megatrain.engine.engine import Engine

    caplog.set_level(logging.INFO, logger="megatrain")
    count = [0]
    real = Engine.synchronize

    def counted(self) -> None:
        count[0] += 1
        real(self)

    syncs: dict[bool, int] = {}
    for wall in (False, True):
        engine, *_ = _init(config=_cfg(train_batch_size=2, wall_clock_breakdown=wall))
        count[0] = 0
        monkeypatch.setattr(Engine, "synchronize", counted)
        for b in make_batches(3):
            engine.backward(engine(**b).loss)
            engine.step()
        syncs[wall] = count[0]
        monkeypatch.setattr(Engine, "synchronize", real)
    assert syncs[True] == syncs[False]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("time (ms) | forward:")]
    assert len(lines) == 3
    forward = [float(m.split("forward: ")[1].split(" ")[0]) for m in lines]
    assert all(f > 0 for f in forward)  # each step's own forward, not a running total: none is zero, none sums
    # Negative control: the old breakdown read engine.stats, which synchronizes.
    count[0] = 0
    monkeypatch.setattr(Engine, "synchronize", counted)
    _ = engine.engine.stats
    assert count[0] == 1


def test_backward_and_step_need_an_optimizer_and_a_scalar():
    engine, opt, _, _ = _init(config={"train_batch_size": 1})
    assert opt is None and engine.get_lr() == []
    out = engine(**make_batches(1)[0])
    with pytest.raises(RuntimeError, match="needs an optimizer"):
        engine.backward(out.loss)
    with pytest.raises(RuntimeError, match="needs an optimizer"):
        engine.step()
    engine, *_ = _init(config=_cfg())
    with pytest.raises(ValueError, match="scalar loss"):
        engine.backward(torch.ones(2))


def test_forward_returns_logits_on_request():
    model = tiny_model("llama", seed=4)
    ref = copy.deepcopy(model).eval()
    engine, *_ = _init(model, config=_cfg())
    assert isinstance(engine, MegaTrainEngine)
    b = make_batches(1, pad=False)[0]
    out = engine(**b)
    assert out.loss is not None and out.logits is None  # training: the full logits are never built
    engine.eval()
    with torch.no_grad():
        both = engine(**b, return_logits=True, use_cache=False)
        only = engine(input_ids=b["input_ids"])
        want = ref(**b)
    assert only.loss is None and only.logits.shape == (2, 24, 256)
    assert torch.allclose(both.logits, want.logits, atol=1e-5)
    assert abs(both.loss.item() - want.loss.item()) < 1e-5
    with torch.no_grad():  # outside training, per-layer outputs are served by the model's own forward
        hs = engine(**b, output_hidden_states=True).hidden_states
        want_hs = ref(**b, output_hidden_states=True).hidden_states
    assert len(hs) == len(want_hs) and all(torch.allclose(a, w, atol=1e-5) for a, w in zip(hs, want_hs))
    engine.train()
    with pytest.raises(ValueError, match="output_hidden_states"):  # the training path keeps none
        engine(**b, output_hidden_states=True)
    assert engine.config["train_batch_size"] == 4 and engine.vocab_size == 256  # passthrough to the model


def test_client_optimizer_scheduler_and_param_groups():
    model = tiny_model("llama")
    user_opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    user_sched = torch.optim.lr_scheduler.LambdaLR(user_opt, lambda s: 1.0 / (s + 1))
    engine, opt, _, sched = _init(model, optimizer=user_opt, lr_scheduler=user_sched, config={"train_batch_size": 2})
    assert opt is user_opt and sched is user_sched
    engine.backward(engine(**make_batches(1)[0]).loss)
    engine.step()
    assert engine.get_lr() == [0.25]

    model = tiny_model("llama")
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    engine, opt, _, _ = _init(model, model_parameters=groups, config=_cfg())
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in opt.param_groups] == [len(decay), len(no_decay)]
    assert all(g["lr"] == 1e-3 for g in opt.param_groups)
    host = {id(p) for _, p in engine.engine.named_parameters()}
    assert all(id(p) in host for g in opt.param_groups for p in g["params"])

    model = tiny_model("llama")
    engine, opt, _, sched = _init(model, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                                  lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5),
                                  config={"train_batch_size": 2})
    assert isinstance(opt, torch.optim.SGD) and isinstance(sched, torch.optim.lr_scheduler.StepLR)
    assert sched.optimizer is opt


def test_training_data_becomes_a_dataloader_in_deepspeed_order():
    from torch.utils.data import DistributedSampler, TensorDataset

    data = TensorDataset(torch.arange(11))
    _, _, loader, _ = _init(training_data=data, config=_cfg(train_batch_size=3, train_micro_batch_size_per_gpu=3))
    got = [b[0].tolist() for b in loader]
    order = list(DistributedSampler(data, num_replicas=1, rank=0))
    assert [len(b) for b in got] == [3, 3, 3, 2]
    assert sum(got, []) == order and order != sorted(order)
    _, _, loader, _ = _init(training_data=data, config=_cfg(train_batch_size=3, train_micro_batch_size_per_gpu=3,
                                                             dataloader_drop_last=True))
    assert len(list(loader)) == 3


# ---------------------------------------------------------------------------------------------------
# checkpoints and export


@pytest.mark.parametrize("mode", CONFIGS)
def test_checkpoint_roundtrip_in_process(tmp_path, mode):
    cfg = _cfg(gradient_accumulation_steps=2, train_batch_size=4,
               scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}},
               **deepspeed_keys(mode))
    engine, opt, _, sched = _init(tiny_model("llama", seed=1), config=cfg)
    lag_updates(engine.engine)
    for b in make_batches(4):
        engine.backward(engine(**b).loss)
        engine.step()
    engine.save_checkpoint(tmp_path, client_state={"epoch": 3, "ids": torch.arange(4), "name": "x"})
    assert ck.latest_tag(tmp_path) == "global_step2"

    other, opt2, _, sched2 = _init(tiny_model("llama", seed=2), config=cfg)
    lag_updates(other.engine)
    assert not torch.equal(other.state_dict()["model.embed_tokens.weight"],
                           engine.state_dict()["model.embed_tokens.weight"])
    path, client = other.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "global_step2")
    assert client["epoch"] == 3 and client["name"] == "x" and torch.equal(client["ids"], torch.arange(4))
    a, b = engine.state_dict(), other.state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    sa, sb = opt.state_dict(), opt2.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for k, v in sa["state"][i].items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)
    assert sched2.last_batch_iteration == sched.last_batch_iteration == 1
    assert (other.global_steps, other.micro_steps, other.global_samples) == (2, 4, 8)
    assert other.get_lr() == engine.get_lr()
    # One more identical micro-batch pair gives bit-identical losses.
    for b in make_batches(2, seed=9):
        la, lb = engine(**b).loss, other(**b).loss
        assert la.item() == lb.item()
        engine.backward(la), other.backward(lb)
        engine.step(), other.step()
    assert all(torch.equal(x, y) for x, y in zip(engine.state_dict().values(), other.state_dict().values()))


def test_checkpoint_errors_and_retention(tmp_path):
    engine, *_ = _init(config=_cfg())
    with pytest.warns(UserWarning, match="Unable to find latest"):
        assert engine.load_checkpoint(tmp_path) == (None, None)
    for i in range(3):
        engine.save_checkpoint(tmp_path, tag=f"t{i}", keep_last=2)
    assert [t for _, t in ck.list_checkpoints(tmp_path)] == ["t1", "t2"]
    data = tmp_path / "t2" / ck.TENSORS_FILE
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ck.CheckpointError, match=rf"t2/{ck.TENSORS_FILE}: corrupt"):
        engine.load_checkpoint(tmp_path)
    engine.load_checkpoint(tmp_path, tag="t1")
    with pytest.raises(TypeError, match=r"client_state\['f'\].*picklable"):
        engine.save_checkpoint(tmp_path, client_state={"f": lambda: 0})


def test_client_state_takes_any_picklable_object(tmp_path):
    import argparse

    engine, *_ = _init(config=_cfg())
    state = {"args": argparse.Namespace(lr=0.1, name="x"), "pair": (1, 2), "ids": torch.arange(3), "nested": {"t": (3,)}}
    engine.save_checkpoint(tmp_path, client_state=state)
    _, back = engine.load_checkpoint(tmp_path)
    assert back["args"] == state["args"] and back["pair"] == (1, 2) and isinstance(back["pair"], tuple)
    assert torch.equal(back["ids"], state["ids"]) and back["nested"] == {"t": (3,)}


@pytest.mark.parametrize("tied", [False, True])
def test_exports_reload_with_automodel(tmp_path, tied):
    engine, *_ = _init(tiny_model("llama", tied=tied), config=_cfg())
    for b in make_batches(2):
        engine.backward(engine(**b).loss)
        engine.step()
    b = make_batches(1, seed=7, pad=False)[0]
    engine.eval()
    with torch.no_grad():
        want = engine(**b, return_logits=True).logits
    engine.save_pretrained(tmp_path / "hf")
    engine.save_16bit_model(tmp_path / "bin")
    engine.save_16bit_model(tmp_path / "st", "model.safetensors")
    engine.save_pretrained(tmp_path / "sharded", max_shard_size=100_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    for sub in ("hf", "bin", "st", "sharded"):
        m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / sub, local_files_only=True).eval()
        assert m.config.tie_word_embeddings == tied
        with torch.no_grad():
            got = m(**b).logits
        assert torch.allclose(got, want, atol=1e-5), (sub, float((got - want).abs().max()))
    sd = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert "lm_head.weight" in sd and sd["lm_head.weight"].dtype == torch.float32


def test_bf16_config_computes_and_saves_bf16(tmp_path):
    engine, *_ = _init(config=_cfg(bf16={"enabled": True}))
    assert engine.bfloat16_enabled() and engine.engine.compute_dtype == torch.bfloat16
    engine.save_16bit_model(tmp_path, "model.safetensors")
    m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert m.config.dtype == torch.bfloat16 and m.model.embed_tokens.weight.dtype == torch.bfloat16
    want = engine.state_dict()["model.embed_tokens.weight"].to(torch.bfloat16)
    assert torch.equal(m.model.embed_tokens.weight, want)


# ---------------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "cfg,match",
    [
        ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 3}, r"train_batch_size \(4\) must equal"),
        ({"train_batch_size": 1, "fp16": {"enabled": True}}, r"fp16 is not supported"),
        ({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": -1}}}, r"lr' must be >= 0"),
        ({"train_batch_size": 1, "gradient_acumulation_steps": 1}, r"did you mean 'gradient_accumulation_steps'"),
        ({"train_batch_size": 1, "scheduler": {"type": "WarmupLR"}}, r"'scheduler' section needs an optimizer"),
    ],
)
def test_bad_configs_fail_before_model_work(cfg, match):
    model = tiny_model("llama")
    w = model.model.layers[0].self_attn.q_proj.weight
    before = w.detach().clone()
    with pytest.raises(ValueError, match=match):
        initialize(model=model, config=cfg)
    assert w.numel() == before.numel() and torch.equal(w, before)  # the engine never took the model


def test_other_bad_arguments(tmp_path, monkeypatch):
    with pytest.raises(DeepSpeedConfigError, match="train_batch_size"):
        initialize(model=None, config={"train_batch_size": 0})  # config first, before anything else
    with pytest.raises(ValueError, match="needs a model"):
        initialize(config={"train_batch_size": 1})
    with pytest.raises(ValueError, match="needs a DeepSpeed config"):
        initialize(model=tiny_model("llama"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        initialize(model=tiny_model("llama"), config=tmp_path / "missing.json")
    import argparse

    args = argparse.Namespace(deepspeed_config=str(tmp_path / "c.json"))
    (tmp_path / "c.json").write_text(json.dumps(_cfg()))
    with pytest.raises(ValueError, match="both in args.deepspeed_config"):
        initialize(args=args, model=tiny_model("llama"), config=_cfg())
    engine, *_ = _init(args=args)
    assert engine.train_batch_size() == 4
    model = tiny_model("llama")
    stray = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="not a parameter of `model`"):
        initialize(model=model, optimizer=stray, config=_cfg())
    assert model.model.layers[0].mlp.up_proj.weight.numel() > 0  # refused before the engine took the model
    with pytest.raises(ValueError, match="not a parameter of `model`"):
        initialize(model=model, model_parameters=[torch.nn.Parameter(torch.zeros(2))], config=_cfg())
    with pytest.raises(ValueError, match="mpu / mesh_param"):
        initialize(model=tiny_model("llama"), config=_cfg(), mpu=object())
    monkeypatch.setenv("WORLD_SIZE", "2")  # a launch with no RANK: refused before the model is touched
    with pytest.raises(ValueError, match="RANK is not set"):
        initialize(model=tiny_model("llama"), config=_cfg())


# ---------------------------------------------------------------------------------------------------
# the same DeepSpeed script, in fresh processes


def _start_script(backend: str, out: Path, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    """The script in a fresh process, its output to a file beside `out` (a process left running while another
    starts never blocks on a full pipe)."""
    env = worker_env(world_size=1, DS_ACCELERATOR="cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())
    log = out.with_suffix(".log")
    return start_python([SCRIPT, backend, out, *extra], env=env, log=log), out, log


def _script_result(run: tuple[subprocess.Popen, Path, Path], backend: str, timeout: int = 300) -> dict:
    proc, out, log = run
    finish(proc, timeout=timeout, log=log)
    return json.loads(out.read_text())


def _run_script(backend: str, out: Path, *extra: str, timeout: int = 300) -> dict:
    return _script_result(_start_script(backend, out, *extra), backend, timeout)


@pytest.fixture(scope="module")
def _uninterrupted(tmp_path_factory):
    """The script under `import megatrain as deepspeed`, 10 steps, saving a checkpoint after step 5: in FP32
    and in the GPU's defaults (bf16 compute, optimizer overlap, hilo); and, where DeepSpeed is installed, the same
    script on real DeepSpeed ZeRO-3 offload. The three started side by side: each is mostly its single-threaded
    start-up, and none reads another's files."""
    runs = {}
    for name, extra in (("fp32", ()), ("gpu-defaults", ("--gpu-defaults",))):
        d = tmp_path_factory.mktemp(f"mt_run_{name}")
        runs[name] = (_start_script("megatrain", d / "out.json", "--save-at", "5", "--ckpt", str(d / "ckpt"),
                                    *extra), d / "ckpt")
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        pass  # the comparison with it is skipped (its deepspeed mark); nothing to start
    else:
        runs["deepspeed"] = (_start_script("deepspeed", tmp_path_factory.mktemp("ds_run") / "ds.json"), None)
    yield runs
    for run, _ in runs.values():
        run[0].kill()


@pytest.fixture(scope="module")
def megatrain_run(_uninterrupted):
    """The script under `import megatrain as deepspeed`, 10 steps, saving a checkpoint after step 5."""
    run, ckpt = _uninterrupted["fp32"]
    return _script_result(run, "megatrain"), ckpt


@pytest.fixture(scope="module")
def megatrain_gpu_run(_uninterrupted):
    """megatrain_run in the GPU's defaults (bf16 compute, optimizer overlap, hilo)."""
    run, ckpt = _uninterrupted["gpu-defaults"]
    return _script_result(run, "megatrain"), ckpt


@pytest.fixture(scope="module")
def _resumed_runs(megatrain_run, megatrain_gpu_run, tmp_path_factory):
    """Each mode's run resumed in a new process from its checkpoint after step 5, the two side by side."""
    started = {}
    try:
        for name, (_, ckpt_dir), extra in (("fp32", megatrain_run, ()),
                                           ("gpu-defaults", megatrain_gpu_run, ("--gpu-defaults",))):
            out = tmp_path_factory.mktemp(f"resumed_{name}") / "resumed.json"
            started[name] = _start_script("megatrain", out, "--resume", str(ckpt_dir), *extra)
        return {name: _script_result(run, "megatrain") for name, run in started.items()}
    finally:
        for run in started.values():
            run[0].kill()


@pytest.mark.slow
@pytest.mark.parametrize("mode", CONFIGS)
def test_resume_in_a_new_process_is_bit_identical(mode, request, _resumed_runs):
    full, _ = request.getfixturevalue("megatrain_gpu_run" if is_bf16(mode) else "megatrain_run")
    assert len(full["losses"]) == 20 and (full["global_steps"], full["micro_steps"]) == (10, 20)
    resumed = _resumed_runs["gpu-defaults" if is_bf16(mode) else "fp32"]
    assert resumed["start"] == 5 and resumed["client"] == {"note": "mid-run", "step": 5}
    assert resumed["losses"] == full["losses"][10:]  # exact float equality, every micro-step
    assert resumed["lrs"] == full["lrs"][5:]
    assert (resumed["global_steps"], resumed["micro_steps"]) == (10, 20)


@pytest.mark.deepspeed
@pytest.mark.slow
def test_losses_match_real_deepspeed_zero3_offload(megatrain_run, _uninterrupted):
    ours, _ = megatrain_run
    # First use on a machine JIT-builds DeepSpeed's C++ ops (~85 s); later runs reuse the cache.
    theirs = _script_result(_uninterrupted["deepspeed"][0], "deepspeed", timeout=900)
    assert len(ours["losses"]) == len(theirs["losses"]) == 20
    diffs = [abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])]
    print("max |loss diff| vs DeepSpeed ZeRO-3 offload:", max(diffs))
    assert max(diffs) <= 1e-4, diffs
    assert ours["lrs"] == theirs["lrs"]  # the schedule agrees exactly, first steps included
    assert len(set(theirs["lrs"])) > 3
    # The data repeat every 4 micro-batches: the same batch's loss must have dropped (training moved).
    assert ours["losses"][16] < ours["losses"][0] - 0.05
