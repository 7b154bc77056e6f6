"""TRL's fused head on a prepared model is served from the bound class (the binding's forward keyword): the
engine takes the model's forward, and the face sets none back on the instance."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model


def test_the_fused_head_leaves_the_forward_to_the_class():
    pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    from megatrain.accelerate import Accelerator

    model = tiny_model(layers=2)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs",))
    assert "forward" in vars(model)  # TRL's patch is on the instance
    prepared = Accelerator(backend="megatrain", config={"megatrain": {"compute_dtype": "float32"}}, cpu=True).prepare(
        model)
    assert prepared is model and "forward" not in vars(model)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert out.log_probs.shape == (2, 9) and torch.isfinite(out.loss)  # the next-token labels: one fewer
