"""`megatrain train --config` refuses a model the engine cannot train in one paragraph (what, why, a fix that
works for that kind of refusal), exit 2, no traceback unless --debug, and writes nothing: no output folder."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from kit import run_python, start_python, worker_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sft"


def _model_dir(tmp_path: Path, name: str, config) -> Path:
    d = tmp_path / name
    config.save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(EXAMPLE / "tiny-llama" / f, d / f)
    return d


def _train(model: Path, out: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """`megatrain train` of `model` into `out`, started: the process and the file its stderr goes to (stdout
    dropped)."""
    sets = (f"model={model}", f"output_dir={out}", "report=null", "max_steps=1", "eval_data=null")
    err = out.with_suffix(".err")
    with open(err, "w") as f:
        return start_python(["-m", "megatrain.commands.cli", "train", "--config", str(EXAMPLE / "sft.yaml"),
                             *(a for s in sets for a in ("--set", s)), *extra], env=worker_env(threads=2),
                            stdout=subprocess.DEVNULL, stderr=f, text=True), err


def _both(*runs: tuple[subprocess.Popen, Path]) -> list[SimpleNamespace]:
    """Runs started side by side (each mostly the single-threaded start-up of torch, transformers and TRL, none
    reading another's files), each to its end: its exit code and stderr."""
    try:
        for proc, _ in runs:
            proc.wait(timeout=600)
    finally:
        for proc, _ in runs:
            proc.kill()
    return [SimpleNamespace(returncode=proc.returncode, stderr=err.read_text()) for proc, err in runs]


@pytest.mark.slow
def test_a_structural_refusal_is_one_paragraph_and_writes_nothing(tmp_path):
    import transformers

    # GPT-1 applies no final norm after its layers (CTRL did too, until the structure detection found its norm)
    model = _model_dir(tmp_path, "openai-gpt", transformers.OpenAIGPTConfig(n_layer=2, n_embd=64, n_head=4,
                                                                            vocab_size=300))
    out, debug_out = tmp_path / "out", tmp_path / "out_debug"
    r, debug = _both(_train(model, out), _train(model, debug_out, "--debug"))  # the traceback, on request
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) <= 5 and "Traceback" not in r.stderr, r.stderr
    assert "cannot train" in r.stderr and "OpenAIGPTLMHeadModel" in r.stderr and "no final norm" in r.stderr
    assert "backend: torch" in r.stderr and "parity_probe" not in r.stderr  # the probe switch would not help
    assert not out.exists()
    assert debug.returncode != 0 and "Traceback" in debug.stderr and not debug_out.exists()


@pytest.mark.slow
def test_a_probe_refusal_is_one_paragraph_and_its_fix_trains(tmp_path):
    """Gemma-4 with keys and values shared across layers (num_kv_shared_layers > 0; its per-layer input embeddings
    now train): refused structurally, no probe switch offered; the fix it names, backend: torch, trains it."""
    import transformers

    cfg = transformers.AutoConfig.for_model("gemma4_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                                            hidden_size_per_layer_input=16, vocab_size_per_layer_input=300,
                                            num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 2)
    model, out, fixed_out = _model_dir(tmp_path, "gemma4", cfg), tmp_path / "out", tmp_path / "out_fixed"
    r, fixed = _both(_train(model, out), _train(model, fixed_out, "--set", "backend=torch"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) <= 5 and "Traceback" not in r.stderr, r.stderr
    assert "Gemma4ForCausalLM" in r.stderr and "backend: torch" in r.stderr and "parity_probe" not in r.stderr
    assert not out.exists()
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert (fixed_out / "final").is_dir()


@pytest.mark.slow
def test_a_host_memory_refusal_in_the_engine_undoes_what_the_run_wrote(tmp_path):
    """A refusal only the engine sees (its store does not fit the host): one paragraph, exit 2, and the output
    folder this run made is gone again (no megatrain_run.json left with finished false). In a process of its own:
    a train run sets up a process group and its environment."""
    out = tmp_path / "out"
    code = ("import sys; from types import SimpleNamespace\n"
            "from megatrain.costs import host_memory\n"
            "host_memory.host_memory_available = lambda *a, **k: SimpleNamespace(available_bytes=1024)\n"
            "from megatrain.commands.cli import main\n"
            f"sys.exit(main(['train', '--config', {str(EXAMPLE / 'sft.yaml')!r}, '--set', 'output_dir={out}', "
            "'--set', 'report=null', '--set', 'max_steps=1', '--set', 'eval_data=null']))\n")
    r = run_python(["-c", code], timeout=600)
    err = r.stderr
    assert r.returncode == 2 and "the host store needs" in err and "Traceback" not in err, err[-3000:]
    assert not out.exists()
