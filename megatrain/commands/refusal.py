"""A model the engine refuses, said in one paragraph before anything is written: what (the model and its class),
why (the adapter's or the parity probe's reason), and a fix that works for that kind of refusal.

`megatrain train --config` checks the model this way before it records the run, so a refused run leaves no output
folder; the engine's own checks (engine/model/probe.py, models/adapter.py) are the ones that decide, run here on the
model built on the meta device (no weights), their verdict cached for the engine that trains next.
"""

from __future__ import annotations

from typing import Any

# What to do instead, by kind of refusal. A structural refusal is not lifted by turning the probe off (the engine
# itself cannot take the model), so only the probe's own verdicts offer that switch, and only a mismatch's with
# the warning that it trains something else.
_FIX = {
    "structure": "train it with `backend: torch` (plain SFTTrainer, the whole model on one device), or pick a model "
                 "docs/COMPATIBILITY.md lists as exact",
    "refused": "train it with `backend: torch` (plain SFTTrainer, the whole model on one device), or pick a model "
               "docs/COMPATIBILITY.md lists as exact",
    "mismatch": "train it with `backend: torch`; set `megatrain: {parity_probe: false}` only if you know the "
                "difference is harmless (the run would not match PyTorch)",
    "crashed": "run `megatrain check-model MODEL_DIR` for the probe's whole report, or train it with `backend: torch`",
}


class ModelRefused(ValueError):
    """The engine would refuse the model: `paragraph` says what, why and the fix."""

    def __init__(self, paragraph: str) -> None:
        super().__init__(paragraph)
        self.paragraph = paragraph


def paragraph(model: str, architecture: str, kind: str, why: str) -> str:
    """The one paragraph: what is refused, why, and what to do."""
    why = " ".join(why.split())
    if len(why) > 400:
        why = why[:400] + "..."
    return (f"MegaTrain cannot train {model} ({architecture}): {why}. Fix: {_FIX[kind]}.")


def check_trainable(model_dir: str, config: Any, engine_config: Any) -> None:
    """Raise ModelRefused when the engine would refuse the model `config` describes (at `model_dir`) with
    `engine_config`: its decoder layers not found, or the parity probe not exact."""
    import torch
    import transformers

    from ..engine import Engine, ModelMismatchError, run_probe, verify_model
    from ..models.adapter import find_parts

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    arch = type(model).__name__
    try:
        find_parts(model)
    except ValueError as e:
        raise ModelRefused(paragraph(model_dir, arch, "structure", str(e))) from None
    if not engine_config.parity_probe:
        return
    try:
        verify_model(model, Engine, engine_config)  # cached: the engine that trains next asks again for free
    except ModelMismatchError:
        verdict = run_probe(type(model), config, Engine, engine_config)  # the verdict itself, for its kind
        raise ModelRefused(paragraph(model_dir, arch, verdict.status, verdict.detail)) from None
