"""`megatrain train --config sft.yaml`: the example config (a local model directory, a local alpaca file) trains
on MegaTrain with plain SFTTrainer's losses; sharegpt with packing too; bad configs are refused by name."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from kit import finish, start_python, worker_env

from megatrain.commands.sft import detect_format, load_run, to_conversation

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sft" / "sft.yaml"
TOL = 1e-5


def _start(tmp_path: Path, name: str, *sets: str) -> tuple[subprocess.Popen, Path]:
    """`megatrain train --config` in its own process, its output to a file (a run started beside another never
    blocks on a full pipe)."""
    out = tmp_path / name
    args = ["train", "--config", str(EXAMPLE), "--set", f"output_dir={out}", "--set", f"report={out}/report.json",
            *(a for s in sets for a in ("--set", s))]
    proc = start_python(["-m", "megatrain.commands.cli", *args], cwd=tmp_path, env=worker_env(threads=2),
                        log=tmp_path / f"{name}.log")
    return proc, out


def _report(run: tuple[subprocess.Popen, Path]) -> dict:
    proc, out = run
    finish(proc, timeout=900, log=out.parent / f"{out.name}.log")
    return json.loads((out / "report.json").read_text())


def _train_both(tmp_path: Path, *sets: str) -> tuple[dict, dict]:
    """The MegaTrain run and the plain SFTTrainer run (backend=torch) of the same settings, side by side: each
    is mostly the single-threaded start-up of torch, transformers and TRL, and neither reads the other's files."""
    runs = [_start(tmp_path, "mt", *sets), _start(tmp_path, "plain", *sets, "backend=torch")]
    try:
        return _report(runs[0]), _report(runs[1])
    finally:
        for proc, _ in runs:
            proc.kill()


def _assert_same_losses(mt: dict, plain: dict) -> None:
    assert mt["engine"] == "MegaTrainEngine" and plain["engine"] != "MegaTrainEngine"
    assert mt["losses"].keys() == plain["losses"].keys() and len(plain["losses"]) >= 4
    diffs = [abs(mt["losses"][k] - plain["losses"][k]) for k in plain["losses"]]
    assert max(diffs) <= TOL, (mt, plain)
    first, last = plain["losses"][min(plain["losses"], key=int)], plain["losses"][max(plain["losses"], key=int)]
    assert last < first - 0.1  # it learns: equal losses of a run that does nothing would prove little


@pytest.mark.slow
def test_the_example_config_trains_on_megatrain_with_plain_sft_losses(tmp_path):
    mt, plain = _train_both(tmp_path)
    _assert_same_losses(mt, plain)
    assert abs(mt["eval_loss"] - plain["eval_loss"]) <= TOL
    assert (tmp_path / "mt" / "final" / "config.json").is_file()


@pytest.mark.slow
def test_sharegpt_with_packing_and_loss_on_every_token(tmp_path):
    sets = ("data=" + str(ROOT / "examples" / "sft" / "sharegpt.jsonl"), "eval_data=null", "packing=true",
            "train_on=all", "max_steps=4", "max_length=64")
    mt, plain = _train_both(tmp_path, *sets)
    _assert_same_losses(mt, plain)


def test_records_become_trl_conversations():
    alpaca = {"instruction": "Add.", "input": "2 and 3", "output": "5", "system": "Be brief."}
    assert detect_format(alpaca) == "alpaca"
    assert to_conversation(alpaca, "alpaca") == {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add.\n\n2 and 3"}],
        "completion": [{"role": "assistant", "content": "5"}]}
    share = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"},
                               {"from": "human", "value": "again"}, {"from": "gpt", "value": "yo yo"}]}
    assert detect_format(share) == "sharegpt"
    assert to_conversation(share, "sharegpt", "all")["messages"][1] == {"role": "assistant", "content": "yo"}
    assert to_conversation(share, "sharegpt")["completion"] == [{"role": "assistant", "content": "yo yo"}]
    with pytest.raises(ValueError, match="from \"robot\" is not a known role"):
        to_conversation({"conversations": [{"from": "robot", "value": "x"}]}, "sharegpt")
    with pytest.raises(ValueError, match="must end with the assistant's reply"):
        to_conversation({"conversations": [{"from": "human", "value": "x"}]}, "sharegpt")
    with pytest.raises(ValueError, match="cannot tell the dataset's format"):
        detect_format({"question": "x"})


def test_bad_configs_are_refused_by_name(tmp_path):
    assert load_run(EXAMPLE).model == str(EXAMPLE.parent / "tiny-llama")  # paths read relative to the file
    with pytest.raises(ValueError, match="unknown key 'learning_rte' \\(did you mean 'learning_rate'"):
        load_run(EXAMPLE, ["learning_rte=1"])
    with pytest.raises(ValueError, match="has no weights.*random_init: true"):
        load_run(EXAMPLE, ["random_init=false"])
    with pytest.raises(ValueError, match="format: 'csv' is not one of"):
        load_run(EXAMPLE, ["format=csv"])
    with pytest.raises(ValueError, match="data='.*/examples/sft/nowhere.json': no such file"):
        load_run(EXAMPLE, ["data=nowhere.json"])
    with pytest.raises(ValueError, match="not a model directory"):
        load_run(EXAMPLE, [f"model={tmp_path}"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\n")
    with pytest.raises(ValueError, match="must be given"):
        load_run(bad)


def test_packing_boundaries_are_checked_against_position_ids():
    import torch

    from megatrain.engine.model.model_object import _drop_packing_kwargs

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    kw = {"cu_seq_lens_q": torch.tensor([0, 3, 5, 9]), "cu_seq_lens_k": torch.tensor([0, 3, 5, 9]),
          "max_length_q": 4, "max_length_k": 4}
    _drop_packing_kwargs(kw, pos)
    assert kw == {}  # the same boundaries as position_ids: dropped
    with pytest.raises(ValueError, match="cu_seq_lens_q does not match"):
        _drop_packing_kwargs({"cu_seq_lens_q": torch.tensor([0, 4, 9])}, pos)
    with pytest.raises(ValueError, match="without position_ids"):
        _drop_packing_kwargs({"cu_seq_lens_q": torch.tensor([0, 9])}, None)
    kept = {"seq_idx": torch.zeros(9)}
    _drop_packing_kwargs(kept, pos)
    assert "seq_idx" in kept  # without cu_seq_lens nothing can be checked: left for forward() to refuse by name
