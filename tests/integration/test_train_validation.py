"""`megatrain train --config`: every key and value type of the config (the `megatrain:` section included) and every
record of the data, in every format, is checked before anything is written; each bad input is refused in one line
naming the file, the line and the fix, with no traceback and no output folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kit import run_python

from megatrain import __version__
from megatrain.commands.cli import main
from megatrain.commands.sft import load_run

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "sft" / "tiny-llama"
GOOD_ALPACA = {"instruction": "Add.", "input": "2 and 3", "output": "5"}


def _config(tmp_path: Path, data: str, **more: object) -> Path:
    cfg = tmp_path / "cfg" / "run.yaml"
    cfg.parent.mkdir(exist_ok=True)
    lines = [f"model: {MODEL}", "random_init: true", f"data: {data}", "output_dir: out", "max_steps: 2",
             *(f"{k}: {v}" for k, v in more.items())]
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


def _jsonl(tmp_path: Path, name: str, *records: object) -> str:
    path = tmp_path / "cfg" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return name


def _refused(capsys, tmp_path: Path, cfg: Path, *sets: str) -> str:
    rc = main(["train", "--config", str(cfg), *(a for s in sets for a in ("--set", s))])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("megatrain train: error: "), err
    assert not (tmp_path / "cfg" / "out").exists()  # nothing written
    return err


def test_a_messages_record_with_an_unknown_role_is_refused_like_sharegpt(capsys, tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad = {"messages": [{"role": "narrator", "content": "once"}, {"role": "assistant", "content": "yo"}]}
    cfg = _config(tmp_path, _jsonl(tmp_path, "m.jsonl", good, good, bad))
    err = _refused(capsys, tmp_path, cfg)
    assert f"{tmp_path / 'cfg' / 'm.jsonl'}:3: record 3: messages[1]: role \"narrator\" is not a known role" in err
    assert "use one of" in err
    share = {"conversations": [{"from": "narrator", "value": "once"}, {"from": "gpt", "value": "yo"}]}
    cfg = _config(tmp_path, _jsonl(tmp_path, "s.jsonl", share), format="sharegpt")
    assert "s.jsonl:1: record 1: conversations[1]: from \"narrator\" is not a known role" in _refused(
        capsys, tmp_path, cfg)


def test_an_alpaca_record_without_output_and_a_broken_jsonl_line(capsys, tmp_path):
    cfg = _config(tmp_path, _jsonl(tmp_path, "a.jsonl", GOOD_ALPACA, {"instruction": "x"}, GOOD_ALPACA,
                                   {"instruction": "y"}), format="alpaca")
    err = _refused(capsys, tmp_path, cfg)
    assert "a.jsonl:2: record 2: the alpaca field 'output' is missing" in err and "(2 of 4 alpaca records" in err
    cfg = _config(tmp_path, _jsonl(tmp_path, "b.jsonl", GOOD_ALPACA, '{"instruction": "x", "output": ', GOOD_ALPACA))
    assert "b.jsonl:2: not a JSON object" in _refused(capsys, tmp_path, cfg)
    (tmp_path / "cfg" / "c.json").write_text('[\n{"instruction": "a", "output": "b"},\n'
                                             '{"instruction": "a" "output": "b"}\n]')
    assert "c.json:3: not valid JSON (Expecting ',' delimiter) (record 2 of the JSON array)" in _refused(
        capsys, tmp_path, _config(tmp_path, "c.json"))
    (tmp_path / "cfg" / "d.json").write_text(json.dumps([GOOD_ALPACA, {**GOOD_ALPACA, "output": 5}], indent=1))
    assert "d.json:7: record 2: the alpaca field 'output' is int 5; write it as a string" in _refused(
        capsys, tmp_path, _config(tmp_path, "d.json"))


def test_keys_and_value_types_anywhere_in_the_config(capsys, tmp_path):
    cfg = _config(tmp_path, _jsonl(tmp_path, "a.jsonl", GOOD_ALPACA))
    err = _refused(capsys, tmp_path, cfg, "megatrain={host_mastr: fp32}")
    assert "unknown megatrain setting 'host_mastr' (did you mean 'host_master'?)" in err and "DeepSpeed" not in err
    assert "max_steps: 'ten' is not an integer; write e.g. max_steps: 10" in _refused(
        capsys, tmp_path, cfg, "max_steps=ten")
    assert "packing: 'yes please' is not true or false" in _refused(capsys, tmp_path, cfg, "packing=yes please")
    assert "lr_scheduler: 'cosin' is not one of" in _refused(capsys, tmp_path, cfg, "lr_scheduler=cosin")
    assert "host_master='fp33' is not a mode" in _refused(capsys, tmp_path, cfg, "megatrain={host_master: fp33}")


def test_set_paths_resolve_like_the_yaml_and_version(capsys, tmp_path, monkeypatch):
    cfg = _config(tmp_path, _jsonl(tmp_path, "a.jsonl", GOOD_ALPACA))
    monkeypatch.chdir(tmp_path)  # not the YAML's folder
    run = load_run(cfg, ["output_dir=elsewhere", "data=a.jsonl"])
    assert run.output_dir == str(tmp_path / "cfg" / "elsewhere") and run.data == str(tmp_path / "cfg" / "a.jsonl")
    assert load_run(cfg).output_dir == str(tmp_path / "cfg" / "out")
    assert load_run(cfg, ["learning_rate=1e-3"]).learning_rate == 0.001  # YAML's text, read as the number meant
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"megatrain {__version__}"


def test_refused_from_the_command_line_in_one_line(tmp_path):
    # as a user meets it: the process's whole stderr is the one line, exit 2, no folder
    cfg = _config(tmp_path, _jsonl(tmp_path, "a.jsonl", GOOD_ALPACA, {"instruction": "x"}))
    r = run_python(["-m", "megatrain.commands.cli", "train", "--config", cfg], timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "a.jsonl:2: record 2: the alpaca field 'output' is missing" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "cfg" / "out").exists()
