"""Shared fixtures: tiny HF decoder models built from configs (random weights, no downloads)."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

# The scripts tests run as processes live apart (tests/workers/); some tests import their helpers too.
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))

import pytest
import torch
import transformers
from kit import LAUNCHER_VARS, fresh_accelerate_state

from baselines.zero3 import default_extensions_dir

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# DeepSpeed's C++ ops: every test, and every process a test starts, loads them from the one cache per venv that
# `scripts/setup.sh` builds them into. Left unset, a Trainer run with an offload config JIT-builds cpu_adam again
# (~85 s) into torch's own cache, shared by every venv of the machine, so one venv's build stales another's.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())
# ... with the ninja that built them (the venv's, as baselines.zero3.prepare_environment puts first on PATH): a
# system ninja of another version (1.11 beside the venv's 1.13) hashes the build commands differently, so each
# reads the other's log as "command line changed" and rebuilds every op; `.venv/bin/python -m pytest` without an
# activated venv would otherwise find the system one.
_BIN = os.path.dirname(sys.executable)
if _BIN not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = os.pathsep.join(filter(None, [_BIN, os.environ.get("PATH")]))


@pytest.fixture(autouse=True)
def _no_deepspeed_config_left_global():
    """A test that builds accelerate's DeepSpeedPlugin (or HF Trainer's) for a stage-3 config leaves transformers'
    global HfDeepSpeedConfig set while anything holds it (a failed test's frame does): every later model build in
    this process would then run under DeepSpeed's zero.Init. Each test starts without one."""
    yield
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    except ImportError:
        return
    unset_hf_deepspeed_config()


@pytest.fixture(autouse=True)
def _no_accelerate_state_left():
    """accelerate's AcceleratorState / GradientState are process-wide singletons (megatrain.Accelerator is an
    accelerate.Accelerator): a test's mixed precision or accumulation plugin would otherwise bind every later
    Accelerator of this process (accelerate raises "AcceleratorState has already been initialized")."""
    yield
    try:
        fresh_accelerate_state()
    except ImportError:
        return


@pytest.fixture(scope="module", autouse=True)
def _environment_restored_after_each_module():
    """An in-process HF Trainer on its DeepSpeed road sets ACCELERATE_USE_DEEPSPEED=true (and accelerate's mixed
    precision variables) in os.environ for good; a module-scoped fixture that trains one does it outside any test's
    own teardown check. Left set, every later `megatrain.Accelerator` of this process would take accelerate's
    DeepSpeed road. Each module ends with the environment it started with."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """A test leaves no torch.distributed process group and no launcher variable behind: every later test of this
    process would run as a rank of that job (a one-rank group turns a broadcast from rank 1 into gloo's "invalid
    root rank", and an engine built after joins it). Whatever a test leaves is undone, and the test errors
    naming it (in its teardown), so the leak is fixed where it starts rather than seen in a later test."""
    import torch.distributed as dist

    had_group = dist.is_available() and dist.is_initialized()
    env = {k: os.environ.get(k) for k in LAUNCHER_VARS}
    yield
    left = []
    if not had_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        left.append("a torch.distributed process group (destroy it in the test's teardown)")
    changed = sorted(k for k, v in env.items() if os.environ.get(k) != v)
    for k in changed:
        if env[k] is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = env[k]
    if changed:
        left.append(f"launcher variables {changed} changed in os.environ (monkeypatch.setenv, or a process of its "
                    "own: kit.run_python)")
    if left:
        pytest.fail("this test left behind " + "; ".join(left), pytrace=False)


def pytest_configure(config):
    # The parity probe's verdicts (and device peaks) go to a cache of this session's own, never a user's:
    # every run re-proves the architectures it builds.
    import tempfile

    os.environ["MEGATRAIN_CACHE"] = tempfile.mkdtemp(prefix="megatrain-test-cache-")

FAMILIES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "mistral": transformers.MistralConfig,
}


def tiny_config(family: str = "llama", layers: int = 2, hidden: int = 64, tied: bool = False, vocab: int = 256,
                heads: int = 4, kv_heads: int = 2, max_pos: int = 512, **extra):
    cfg = FAMILIES[family](
        hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
        max_position_embeddings=max_pos, tie_word_embeddings=tied, **extra,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def tiny_model(family: str = "llama", seed: int = 0, **kw):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(family, **kw))


def make_batches(n: int, batch: int = 2, seq: int = 24, vocab: int = 256, seed: int = 1, pad: bool = True):
    """Padded batches (left rows partly masked) with -100 labels on padding and on a few random tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        mask = torch.ones_like(ids)
        if pad and batch > 1:
            mask[1, : seq // 4] = 0  # left padding on the second row
        labels = ids.clone()
        labels[mask == 0] = -100
        labels[0, torch.randint(0, seq, (3,), generator=g)] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


@pytest.fixture(scope="session")
def node_launches(tmp_path_factory):
    """The node path's launches and their one-process reference, shared by test_node_path.py and
    test_node_residency.py (kit.NodeLaunches): each launch made once, when a test first reads it."""
    from kit import NodeLaunches

    return NodeLaunches(tmp_path_factory)


@pytest.fixture
def clone():
    return copy.deepcopy
