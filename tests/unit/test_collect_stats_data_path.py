"""collect_stats()["data_path"] (docs/DISTRIBUTED.md step 6): the data path the engine runs, in the docs' short names,
beside the rank's own h2d/d2h bytes. A lone process says "single"; the node path's ranks say "node" (the gloo pair
of tests/unit/test_gpu_check_dp2.py, whose check asks it of every step's stats)."""

from __future__ import annotations

import pytest
import torch
import transformers

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.accounting import path_label
from megatrain.engine.parallel.node_path import NODE, PER_RANK, DataPath
from megatrain.engine.parallel.shared_store import SHARED


@pytest.mark.parametrize(("name", "label"), [(NODE, "node"), (PER_RANK, "per_rank"), (SHARED, "shared_store"),
                                             ("one process", "single")])
def test_every_path_the_engine_can_run_has_its_label(name, label):
    assert path_label(DataPath(name, "why")) == label
    assert path_label(None) == "single"


def test_unknown_path_is_an_error_not_a_guess():
    with pytest.raises(KeyError):
        path_label(DataPath("somewhere else", "why"))


def test_lone_engine_reports_single_beside_its_link_bytes():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    engine = Engine(model, EngineConfig(device="cpu", parity_probe=False, residency="stream",
                                        speculative_step=False, compute_dtype="float32"),
                    optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-3))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    stats = engine.collect_stats()
    assert engine.data_path.name == "one process" and stats["data_path"] == "single"
    assert stats["h2d_bytes"] > 0 and stats["d2h_bytes"] > 0
