"""`megatrain train --config examples/sft/lora.yaml`: the `lora:` section turns the run into TRL's
SFTTrainer(peft_config=LoraConfig(...)); on MegaTrain it trains exactly as on plain SFTTrainer + PEFT, and the adapter
files it writes reload with PEFT's own loader to the plain run's logits. Bad `lora:` values are refused by name."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from gpu_defaults import FLOOR_FACTOR
from kit import finish, run_python, start_python, worker_env
from test_sft import ROOT, TOL, _assert_same_losses

from megatrain.commands.sft import load_run, lora_config

EXAMPLE = ROOT / "examples" / "sft" / "lora.yaml"


def _start(tmp_path: Path, name: str, *sets: str, ranks: int = 1) -> tuple[subprocess.Popen, Path]:
    """`megatrain train --config examples/sft/lora.yaml` in its own process (under torchrun with `ranks` > 1)."""
    out = tmp_path / name
    args = ["-m", "megatrain.commands.cli", "train", "--config", str(EXAMPLE), "--set", f"output_dir={out}",
            "--set", f"report={out}/report.json", *(a for s in sets for a in ("--set", s))]
    if ranks > 1:
        args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *args]
    return start_python(args, cwd=tmp_path, env=worker_env(threads=1 if ranks > 1 else 2),
                        log=tmp_path / f"{name}.log"), out


def _train(tmp_path: Path, runs: dict[str, tuple[str, ...]], ranks: int = 1) -> dict[str, dict]:
    """Each named run of the example (its --set items), side by side; their reports."""
    started = {name: _start(tmp_path, name, *sets, ranks=ranks) for name, sets in runs.items()}
    try:
        for proc, out in started.values():
            finish(proc, timeout=900, log=out.parent / f"{out.name}.log")
        return {name: json.loads((out / "report.json").read_text()) for name, (_, out) in started.items()}
    finally:
        for proc, _ in started.values():
            proc.kill()


def _max_diff(a: dict, b: dict) -> float:
    assert a["losses"].keys() == b["losses"].keys()
    return max(abs(a["losses"][k] - b["losses"][k]) for k in a["losses"])


def _reloaded_logits(run_dir: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the base model's logits, the base + the run's saved adapters' logits): the base rebuilt as `train` builds
    it (random_init from the run's seed), the adapters read by PeftModel.from_pretrained."""
    import peft
    import transformers

    run = load_run(EXAMPLE)
    torch.manual_seed(run.seed)
    base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(run.model)).eval()
    with torch.no_grad():
        plain = base(ids).logits
        tuned = peft.PeftModel.from_pretrained(base, str(run_dir / "final")).eval()
        return plain, tuned(ids).logits


@pytest.mark.slow
def test_lora_section_trains_as_plain_trl_with_peft_and_its_adapters_reload(tmp_path):
    pytest.importorskip("peft")
    r = _train(tmp_path, {"mt": (), "plain": ("backend=torch",), "mt_bf16": ("precision=bf16",),
                          "plain_bf16": ("backend=torch", "precision=bf16")})
    mt, plain = r["mt"], r["plain"]
    _assert_same_losses(mt, plain)
    assert abs(mt["eval_loss"] - plain["eval_loss"]) <= TOL
    final = tmp_path / "mt" / "final"
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()  # the adapters alone, as PEFT saves them
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    base, on_mt = _reloaded_logits(tmp_path / "mt", ids)
    _, on_plain = _reloaded_logits(tmp_path / "plain", ids)
    assert (on_mt - on_plain).abs().max() <= TOL * on_plain.abs().max()
    assert (on_mt - base).abs().max() > 1e-3  # the adapters learned something: equal logits would prove little
    # The GPU's defaults (bf16 compute; plain SFTTrainer autocasts to bf16 over its FP32 weights): held to
    # FLOOR_FACTOR times the distance bf16 rounding itself moves plain TRL from its FP32 run (per-step losses, the
    # largest difference); that distance is not zero, and MegaTrain's bf16 run is not its FP32 run (bf16 computed).
    floor = _max_diff(r["plain_bf16"], plain)
    assert r["mt_bf16"]["engine"] == "MegaTrainEngine" and floor > 1e-5 and _max_diff(r["mt_bf16"], mt) > 1e-5
    assert _max_diff(r["mt_bf16"], r["plain_bf16"]) <= FLOOR_FACTOR * floor, r


@pytest.mark.slow
def test_lora_section_on_two_ranks_under_torchrun_trains_as_plain_ddp(tmp_path):
    """torchrun --nproc-per-node 2: MegaTrain's logged losses (Trainer's mean over the ranks) and eval loss within
    1e-5 of plain SFTTrainer + PEFT on DistributedDataParallel."""
    pytest.importorskip("peft")
    r = _train(tmp_path, {"mt": (), "plain": ("backend=torch",)}, ranks=2)
    assert r["plain"]["engine"] == "DistributedDataParallel"
    _assert_same_losses(r["mt"], r["plain"])
    assert abs(r["mt"]["eval_loss"] - r["plain"]["eval_loss"]) <= TOL


def test_bad_lora_sections_are_refused_by_name():
    run = load_run(EXAMPLE, ["lora={rank: 4}"])
    assert run.lora == {"rank": 4, "alpha": 16, "targets": ["q_proj", "v_proj"], "dropout": 0.0}  # defaults filled
    pytest.importorskip("peft")
    cfg = lora_config(load_run(EXAMPLE))
    assert (cfg.r, cfg.lora_alpha, sorted(cfg.target_modules), cfg.lora_dropout) == (8, 16, ["q_proj", "v_proj"], 0)
    with pytest.raises(ValueError, match="lora: unknown key 'rnak' \\(did you mean 'rank'"):
        load_run(EXAMPLE, ["lora.rnak=4"])
    with pytest.raises(ValueError, match="lora.rank: 0 must be an integer >= 1"):
        load_run(EXAMPLE, ["lora.rank=0"])
    with pytest.raises(ValueError, match="lora.dropout: 1.5 must be a number in \\[0, 1\\)"):
        load_run(EXAMPLE, ["lora.dropout=1.5"])
    with pytest.raises(ValueError, match="lora.targets: \\[\\] must be a list of module names"):
        load_run(EXAMPLE, ["lora.targets=[]"])
    with pytest.raises(ValueError, match="lora: .* is not a mapping of LoRA settings"):
        load_run(EXAMPLE, ["lora=8"])
    assert load_run(ROOT / "examples" / "sft" / "sft.yaml").lora is None  # full fine-tuning without the section


@pytest.mark.slow
def test_a_lora_run_resumed_from_its_checkpoint_continues_bit_identically(tmp_path):
    """Trainer's checkpoint of a LoRA run on MegaTrain (the adapters, their Adam state, the schedule) resumes to the
    uninterrupted run's losses, bit for bit."""
    pytest.importorskip("peft")
    out = run_python([ROOT / "tests" / "workers" / "sft_lora_resume.py", tmp_path], cwd=tmp_path,
                     env=worker_env(threads=2), timeout=900, check=True).stdout
    r = json.loads(next(ln for ln in out.splitlines() if ln.startswith("REPORT "))[len("REPORT "):])
    whole, resumed = r["whole"], r["resumed"]
    assert whole["engine"] == resumed["engine"] == "MegaTrainEngine" and resumed["resumed_from"].endswith("checkpoint-4")
    assert resumed["global_step"] == whole["global_step"] == 8
    later = [str(s) for s in range(5, 9)]
    assert [resumed["losses"][s] for s in later] == [whole["losses"][s] for s in later]
