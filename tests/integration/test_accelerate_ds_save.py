"""accelerate's DeepSpeed road, trained on MegaTrain (a "megatrain" section), saves the trained model as an
Accelerate script does: `unwrap_model` is the user's model (accelerate unwraps a DeepSpeedEngine by isinstance;
MegaTrain's engine is recognised too), `save_pretrained(..., is_main_process, save_function, state_dict=
get_state_dict(model))` and `save_model` write the engine's trained weights, at stage 2 and at stage 3 (where
accelerate asks the engine for its consolidated state dict), and with every deepspeed import redirected to MegaTrain."""

from __future__ import annotations

import json

import pytest
import torch
from kit import finish, start_python, worker_env
from safetensors.torch import load_file

pytest.importorskip("deepspeed")
WORKER = "tests/workers/accelerate_ds_save.py"


@pytest.mark.slow
def test_unwrap_model_and_save_on_accelerates_deepspeed_road_write_the_trained_weights(tmp_path):
    from baselines.zero3 import default_extensions_dir

    shim = tmp_path / "shim" / "deepspeed"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("import megatrain.deepspeed.redirect  # noqa: F401\n")
    # stages 2 and 3 on real DeepSpeed's name; stage 2 with every deepspeed import redirected (accelerate's own
    # `import deepspeed`, `from deepspeed.checkpoint.utils import ...` included). The three runs side by side:
    # each is mostly its single-threaded start-up (torch, accelerate, DeepSpeed), and none reads another's files.
    runs = []
    try:
        for stage, path in ((2, ()), (3, ()), (2, (shim.parent,))):
            env = worker_env(world_size=1, threads=1, path=path, TORCH_EXTENSIONS_DIR=default_extensions_dir())
            out = tmp_path / f"stage{stage}{'-redirected' if path else ''}"
            out.mkdir()
            runs.append((start_python([WORKER, out, str(stage)], env=env, log=out.with_suffix(".log")), out))
        for proc, out in runs:
            finish(proc, timeout=600, log=out.with_suffix(".log"))
    finally:
        for proc, _ in runs:
            proc.kill()
    for _, out in runs:
        report = json.loads((out / "report.json").read_text())
        assert report == {**report, "engine": "MegaTrainEngine", "unwrapped": "LlamaForCausalLM",
                          "extract_is_unwrapped": True}
        assert report["moved"] > 1e-3  # control: training moved the weights, so a save of the initial ones shows
        engine = torch.load(out / "engine.pt")
        for folder in ("pretrained", "save_model"):
            saved = load_file(out / folder / "model.safetensors")
            assert set(saved) <= set(engine) and len(saved) >= len(engine) - 1, folder  # a tied head once
            assert all(torch.equal(saved[k], engine[k]) for k in saved), folder
