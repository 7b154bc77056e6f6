"""Runs examples/trl_grpo.py three times in one process (tests/integration/test_hf_integration.py): one start-up
of torch, transformers and TRL instead of three.

    grpo_runs.py OUT    plain GRPOTrainer, then MegaTrain, then MegaTrain with the temperature dropped from the
                        fused head (the bug the test exists for); each writes OUT/<name>.json (the example's report)

The temperature is dropped last, by replacing fused_head.fused_lm_head_forward, which the served head looks up
at every call: the two runs before it never see the replacement.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import trl_grpo  # noqa: E402  (from examples/, put on the path above)


def _run(out: Path, name: str, *argv: str) -> None:
    trl_grpo.main(["--output_dir", str(out / name), "--report", str(out / f"{name}.json"), *argv])


def _drop_the_temperature() -> None:
    import megatrain.backend.fused_head as fh

    real = fh.fused_lm_head_forward

    def at_temperature_one(model, input_ids, kwargs, options=None, **rest):
        options = options or fh.FusedHeadOptions()
        return real(model, input_ids, kwargs, dataclasses.replace(options, temperature=1.0), **rest)

    fh.fused_lm_head_forward = at_temperature_one


if __name__ == "__main__":
    out = Path(sys.argv[1])
    _run(out, "plain", "--backend", "torch")
    _run(out, "megatrain")
    _drop_the_temperature()
    _run(out, "wrong")
