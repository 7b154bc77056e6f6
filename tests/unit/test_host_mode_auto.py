"""Host mode "auto" (the default): the fastest exact mode that fits, by one rule (costs/host_mode.py) for the
engine's preflight and for `megatrain plan`."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from megatrain.config.schema import EngineConfig
from megatrain.costs.host_mode import HostMode, candidates, choose_host_mode
from megatrain.costs.modes import GradSlab, HostMaster
from megatrain.engine.host.preflight import auto_host_mode, host_store_bytes

F32, HILO = HostMaster.FP32, HostMaster.HILO
S32, S16 = GradSlab.FLOAT32, GradSlab.BFLOAT16


def test_candidates_fastest_first_and_only_exact():
    assert candidates(True, True, False) == [HostMode(F32, S32), HostMode(HILO, S32), HostMode(HILO, S16)]
    assert candidates(True, False, False) == [HostMode(F32, S32), HostMode(HILO, S32)]  # accumulation: FP32 slabs
    assert candidates(False, True, True) == [HostMode(F32, S32), HostMode(F32, S32, True)]  # FP32 compute
    with_disk = candidates(True, True, True)
    assert with_disk[3:] == [HostMode(HILO, S16, True), HostMode(HILO, S32, True), HostMode(F32, S32, True)]
    assert all(m.master is not HostMaster.BF16 for m in with_disk)  # the paper's master is not exact
    assert candidates(True, True, True, optimizer_in_backward=True) == [HostMode(F32, S32), HostMode(HILO, S32)]


def test_choose_takes_the_first_that_fits_else_the_smallest():
    order = []

    def fits(m):
        order.append(m)
        return m == HostMode(HILO, S16)

    assert choose_host_mode(fits, True, True, False) == (HostMode(HILO, S16), True)
    assert order == candidates(True, True, False)  # tried in order, stopped at the fit
    assert choose_host_mode(lambda m: False, True, True, False) == (HostMode(HILO, S16), False)
    assert choose_host_mode(lambda m: False, True, True, True) == (HostMode(HILO, S16, True), False)


def test_the_default_is_auto_and_fp32_compute_settles_at_once():
    assert EngineConfig(device="cpu", compute_dtype="bfloat16").host_master == "auto"
    cfg = EngineConfig(device="cpu", compute_dtype="float32")
    assert (cfg.host_master, cfg.host_grad_dtype, cfg.written["host_master"]) == ("fp32", "float32", "auto")
    explicit = EngineConfig(device="cpu", compute_dtype="bfloat16", host_master="hilo")
    assert (explicit.host_master, explicit.host_grad_dtype) == ("hilo", "float32")  # explicit modes unchanged
    with pytest.raises(ValueError, match="host_master"):
        EngineConfig(device="cpu", compute_dtype="bfloat16", host_master="fp16")


def _tiny():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _store(model, master, grad):
    n = sum(p.numel() for p in model.parameters())
    n_layer = sum(p.numel() for p in model.model.layers.parameters())
    return sum(host_store_bytes(n, torch.bfloat16, n_layer, master, grad).values())


@pytest.mark.parametrize("master,grad", [(F32, S32), (HILO, S32), (HILO, S16)])
def test_the_engine_picks_the_fastest_mode_the_host_holds(master, grad):
    """Room for exactly mode X's store (the model's own bytes counted as freed): X, and not a faster one."""
    model = _tiny()
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = EngineConfig(device="cpu", compute_dtype="bfloat16")
    got = auto_host_mode(cfg, model, model.model.layers, available=_store(model, master, grad) - own)
    assert (got.host_master, got.host_grad_dtype) == (master.value, grad.value)
    assert got.written["host_master"] == "auto"
    # Control: one byte less and that mode no longer fits: the next, smaller one is chosen (or the smallest).
    less = auto_host_mode(cfg, model, model.model.layers, available=_store(model, master, grad) - own - 1)
    assert (less.host_master, less.host_grad_dtype) != (master.value, grad.value) or master is HILO and grad is S16


def test_accumulation_settles_fp32_slabs_through_the_faces():
    from megatrain.config.resolve import resolve

    one = resolve({"bf16": {"enabled": True}, "megatrain": {"device": "cpu"}}, gradient_accumulation_steps=1)
    two = resolve({"bf16": {"enabled": True}, "megatrain": {"device": "cpu"}}, gradient_accumulation_steps=2)
    assert one.engine.host_grad_dtype == "auto" and two.engine.host_grad_dtype == "float32"


def test_the_engine_resolves_auto_and_the_start_line_names_it():
    from megatrain.engine import Engine
    from megatrain.run.start_line import describe

    eng = Engine(_tiny(), EngineConfig(device="cpu", compute_dtype="bfloat16", parity_probe=False))
    assert eng.config.host_master == "fp32" and eng.config.host_grad_dtype == "float32"  # a small model: fastest
    assert 'host mode "auto" chose fp32 master' in describe("accelerate", eng)
    pinned = Engine(_tiny(), EngineConfig(device="cpu", compute_dtype="bfloat16", parity_probe=False,
                                          host_master="hilo"))
    assert "chose" not in describe("accelerate", pinned) and pinned.config.host_master == "hilo"
    json.dumps(eng.config.to_dict())  # a resolved config records as plain values


HEADLINE = ["plan", "--model", "120b", "--context", "2048", "--batch", "8", "--hardware", "h200-pcie", "--compare",
            "", "--no-search"]


def test_the_readmes_headline_fits_in_an_exact_mode_it_names(capsys):
    from plan_cli import main  # --details: the tables these tests read

    assert main(HEADLINE) == 0
    out = capsys.readouterr().out
    fits = next(line for line in out.splitlines() if line.startswith("  fits: "))
    assert fits.startswith("  fits: yes, exact, hilo + bf16 slabs + NVMe ")  # the tier's disk bytes follow
    assert main([*HEADLINE, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] and d["host_mode"]["mode"] == "hilo + bf16 slabs + NVMe" and d["host_mode"]["nvme"]["spilled"]
    # Control: the explicit default of before (fp32 master) does not fit this host, with or without its rows
    assert main([*HEADLINE, "--master", "fp32", "--host-grad-dtype", "float32"]) == 0
    assert "  fits: NO" in capsys.readouterr().out


def test_the_engine_chooses_the_plans_mode_for_the_headline_point(tmp_path):
    """EngineConfig()'s host mode ("auto") for dense-120b on a 1.5 TiB host with an NVMe path, by the engine's own
    byte model (the preflight's), is the mode `plan` names for the README's point."""
    from megatrain.models.presets import get_preset
    from megatrain.planner import plan

    assert EngineConfig().host_master == "auto" or EngineConfig().compute_dtype == "float32"
    pl = plan("120b", 2048, batch=8, hardware="h200-pcie")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(get_preset("120b").hf_config())
    cfg = EngineConfig(device="cpu", compute_dtype="bfloat16", nvme_path=str(tmp_path))
    got = auto_host_mode(cfg, model, model.model.layers, available=1536 * 2**30)
    assert (got.host_master, got.host_grad_dtype) == (pl.auto.mode.master.value, pl.auto.mode.grad.value)
    assert pl.auto.mode.nvme and got.host_budget_bytes is None  # the tier spills as written
    # Control: with room for the whole hilo + bf16-slab store, neither spills (the engine as the planner)
    roomy = auto_host_mode(cfg, model, model.model.layers, available=4 * 1536 * 2**30)
    assert (roomy.host_master, roomy.host_grad_dtype) == ("fp32", "float32")
    assert plan("120b", 2048, batch=8, hardware="h200-pcie", host_memory_gib=4 * 1536).auto.mode == HostMode(F32, S32)


def test_ranks_agree_on_the_latest_mode_any_of_them_chose():
    """Data-parallel ranks read their own free memory; `agree` (the largest across ranks) makes them hold one mode."""
    model = _tiny()
    cfg = EngineConfig(device="cpu", compute_dtype="bfloat16")
    seen = []

    def other_rank_chose_hilo(i):
        seen.append(i)
        return max(i, candidates(True, True, False).index(HostMode(HILO, S32)))

    got = auto_host_mode(cfg, model, model.model.layers, available=2**40, agree=other_rank_chose_hilo)
    assert seen == [0] and (got.host_master, got.host_grad_dtype) == ("hilo", "float32")
    alone = auto_host_mode(cfg, model, model.model.layers, available=2**40)
    assert (alone.host_master, alone.host_grad_dtype) == ("fp32", "float32")  # control: this rank alone
