"""Settings resolved once: DeepSpeed's face keys are read in one module, the compute dtype is settled by one rule
for every face, and an EngineConfig keeps what the user wrote next to what it resolved."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

import megatrain
from megatrain.accelerate import Accelerator
from megatrain.config.deepspeed import parse_config
from megatrain.config.schema import EngineConfig
from megatrain.config.settings import read_config

ROOT = Path(__file__).resolve().parents[2]


def modules_naming(package: Path, key: str) -> list[str]:
    """The modules under `package` holding the string `key` itself (a key read, written or listed), not in a message."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        if any(isinstance(node, ast.Constant) and node.value == key for node in ast.walk(tree)):
            found.append(path.relative_to(package.parent).as_posix())
    return found


def test_gradient_clipping_is_read_in_one_module():
    # Before: the settings reader and megatrain/config/deepspeed.py each read it with DeepSpeed's default of 1.0,
    # and the `train` command wrote it out.
    assert modules_naming(ROOT / "megatrain", "gradient_clipping") == ["megatrain/config/settings.py"]


def test_the_module_count_sees_a_second_reader(tmp_path):
    # Control: a planted module that reads the key by name is counted.
    pkg = tmp_path / "megatrain"
    (pkg / "config").mkdir(parents=True)
    (pkg / "config" / "settings.py").write_text((ROOT / "megatrain/config/settings.py").read_text())
    (pkg / "reader.py").write_text('def clip(d):\n    return d.get("gradient_clipping", 1.0)\n')
    (pkg / "message.py").write_text('E = "\'gradient_clipping\' must be >= 0"\n')  # a message only: not counted
    assert modules_naming(pkg, "gradient_clipping") == ["megatrain/config/settings.py", "megatrain/reader.py"]


@pytest.fixture
def cuda(monkeypatch):
    """A machine with a bf16-capable CUDA device, as far as "auto" can tell (nothing here runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


@pytest.fixture
def settle_calls(monkeypatch):
    """Every call of the one compute-dtype rule: (what it was given, what it settled)."""
    calls = []
    rule = EngineConfig.settle_compute_dtype

    def spy(**kw):
        out = rule(**kw)
        calls.append((kw, out))
        return out

    monkeypatch.setattr(EngineConfig, "settle_compute_dtype", staticmethod(spy))
    return calls


def _given(calls, **want) -> bool:
    return any(all(kw.get(k) == v for k, v in want.items()) for kw, _ in calls)


def test_every_face_settles_the_compute_dtype_through_one_rule(cuda, settle_calls):
    section = {"parity_probe": False}
    on_cpu = {**section, "device": "cpu"}  # the two faces that build an engine here build it on the CPU
    engine, *_ = megatrain.initialize(model=tiny_model(layers=1), config={
        "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "megatrain": on_cpu})
    assert _given(settle_calls, bf16=True)
    settle_calls.clear()
    acc = Accelerator(mixed_precision="bf16", config={"megatrain": on_cpu})
    assert _given(settle_calls, mixed_precision="bf16")
    settle_calls.clear()
    plain = EngineConfig(compute_dtype="auto", **section)
    assert _given(settle_calls, written="auto")

    faces = [engine.backend.engine_config, acc.backend.engine_config, plain]
    assert [c.compute_dtype for c in faces] == ["bfloat16"] * 3
    assert engine.engine.compute_dtype == torch.bfloat16
    # Apart from the device the engines were put on, the three resolve to the same settings.
    resolved = [{k: v for k, v in c.to_dict().items() if k != "device"} for c in faces]
    assert resolved[0] == resolved[1] == resolved[2]
    assert acc.mixed_precision == "bf16"


@pytest.mark.parametrize("given,settled", [
    (dict(), "auto"),
    (dict(unsaid="float32"), "float32"),  # a DeepSpeed config trains in FP32 unless bf16 is enabled
    (dict(bf16=True, unsaid="float32"), "bfloat16"),
    (dict(written="bfloat16", unsaid="float32"), "bfloat16"),
    (dict(written="auto", bf16=True), "bfloat16"),  # "auto" gives way
    (dict(written="auto", mixed_precision="bf16"), "bfloat16"),
    (dict(bf16=True, mixed_precision="no"), "bfloat16"),  # the argument's default gives way to the config
    (dict(mixed_precision="no"), "float32"),
])
def test_the_compute_dtype_rule(given, settled):
    assert EngineConfig.settle_compute_dtype(**given) == settled


@pytest.mark.parametrize("given,match", [
    (dict(written="float32", bf16=True), "'megatrain.compute_dtype' is 'float32' but bf16.enabled is true"),
    (dict(bf16=False, mixed_precision="bf16"), "contradicts the config, which disables bf16"),
    (dict(written="float32", mixed_precision="bf16"), "contradicts the engine's compute_dtype='float32'"),
    (dict(mixed_precision="fp16"), "mixed_precision='fp16' is not supported"),
])
def test_contradicting_settings_are_refused_by_name(given, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.settle_compute_dtype(**given)


def test_an_engine_config_keeps_what_was_written(cuda):
    cfg = EngineConfig(num_buffers=3)
    assert cfg.compute_dtype == "bfloat16" and cfg.written["compute_dtype"] == "auto"
    assert cfg.written["num_buffers"] == 3 and "_written" not in cfg.to_dict()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_buffers = 4
    copy = dataclasses.replace(cfg, pin_memory=False)  # a resolved copy: what was written travels with it
    assert copy.pin_memory is False and copy.written == cfg.written
    on_cpu = cfg.rewrite(device="cpu")  # written again: "auto" resolved afresh for the new device
    assert on_cpu.compute_dtype == "float32" and on_cpu.written["compute_dtype"] == "auto"
    assert EngineConfig.from_dict(cfg.written) == cfg


def test_cpu_true_resolves_auto_for_the_cpu(cuda):
    # Before, the EngineConfig's "auto" was resolved for the machine's GPU and that bf16 carried to the CPU.
    acc = Accelerator(cpu=True, config=EngineConfig())
    assert acc.backend.engine_config.device == "cpu" and acc.backend.engine_config.compute_dtype == "float32"
    assert Accelerator(cpu=True).settings.gradient_clipping == 0.0  # no DeepSpeed config: the script clips


def test_both_faces_read_gradient_clipping_by_the_same_rules():
    assert read_config({}).gradient_clipping == parse_config({"train_batch_size": 1}).gradient_clipping == 1.0
    assert read_config({"gradient_clipping": 0.5}).gradient_clipping == 0.5
    for bad, match in (("1.0", "must be a finite number"), (-1, "gradient_clipping=-1.0 must be >= 0")):
        with pytest.raises(ValueError, match=match):
            read_config({"gradient_clipping": bad})  # before: the Accelerate face took the string "1.0" as 1.0
        with pytest.raises(ValueError, match=match):
            parse_config({"train_batch_size": 1, "gradient_clipping": bad})
    # "auto": the script's clip_grad_norm_ calls under Accelerate; TrainingArguments.max_grad_norm under DeepSpeed.
    assert read_config({"gradient_clipping": "auto"}).gradient_clipping == 0.0
    args = type("Args", (), {"max_grad_norm": 0.3})()
    assert parse_config({"train_batch_size": 1, "gradient_clipping": "auto"}, args=args).gradient_clipping == 0.3


def test_resolve_gives_each_face_its_settings_and_one_engine_config():
    from megatrain.config.resolve import resolve

    args = type("Args", (), {"max_grad_norm": 0.3, "bf16": True, "per_device_train_batch_size": 2,
                             "gradient_accumulation_steps": 4})()
    ds = resolve({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                  "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "megatrain": {"device": "cpu"}},
                 face="deepspeed", args=args)
    assert (ds.mixed_precision, ds.gradient_clipping, ds.gradient_accumulation_steps) == ("bf16", 0.3, 4)
    assert ds.deepspeed.train_batch_size == 8 and ds.engine.written["compute_dtype"] == "bfloat16"
    acc = resolve({"bf16": {"enabled": True}, "gradient_accumulation_steps": 4, "megatrain": {"device": "cpu"}})
    assert (acc.mixed_precision, acc.gradient_clipping, acc.gradient_accumulation_steps) == ("bf16", 1.0, 4)
    assert acc.engine == ds.engine and acc.deepspeed is None
    bare = resolve({"bf16": {"enabled": True}}, engine=False)  # a backend that reads no EngineConfig
    assert bare.engine is None and bare.mixed_precision == "bf16"
    with pytest.raises(ValueError, match="face='zero'"):
        resolve(None, face="zero")
