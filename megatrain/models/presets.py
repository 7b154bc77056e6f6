"""Model shapes used by sweeps, the planner and the tests (public shapes; random weights)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelPreset:
    name: str
    family: str  # "llama" | "qwen2" | "mistral": which HF config class builds it
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    max_positions: int = 4096
    tie_embeddings: bool = False
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, SwiGLU MLP, two RMSNorms)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h
        if self.family == "qwen2":
            attn += h + 2 * kv  # q/k/v biases
        return attn + 3 * h * self.intermediate + 2 * h

    def nonembed_params(self) -> int:
        return self.num_layers * self.layer_params() + self.hidden  # + final norm

    def embed_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    def param_count(self) -> int:
        return self.nonembed_params() + self.embed_params()

    def with_(self, **changes) -> ModelPreset:
        return replace(self, **changes)

    def hf_config(self, **overrides):
        """A transformers config for this shape (no download; the model is built with random weights)."""
        import transformers

        cls = {
            "llama": transformers.LlamaConfig,
            "qwen2": transformers.Qwen2Config,
            "mistral": transformers.MistralConfig,
        }[self.family]
        kw = dict(
            num_hidden_layers=self.num_layers,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            vocab_size=self.vocab,
            max_position_embeddings=self.max_positions,
            tie_word_embeddings=self.tie_embeddings,
            rope_theta=self.rope_theta,
            attn_implementation="sdpa",
        )
        kw.update(overrides)
        attn = kw.pop("attn_implementation")
        cfg = cls(**kw)
        cfg._attn_implementation = attn
        return cfg


_P = ModelPreset
PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in [
        # CPU-sized shapes for tests and the quick sweep.
        _P("tiny", "llama", 2, 64, 176, 4, 2, 256, 2048),
        _P("tiny-qwen2", "qwen2", 2, 64, 176, 4, 2, 256, 2048, tie_embeddings=True),
        _P("small-7m", "llama", 4, 256, 688, 8, 4, 8192, 4096),
        # SmolLM-135M's published shape (deep, narrow, GQA, 49k vocabulary): the long-context bench's model.
        _P("smollm-135m", "llama", 30, 576, 1536, 9, 3, 49152, 2048, tie_embeddings=True),
        _P("llama-100m", "llama", 8, 1024, 2752, 16, 16, 8192, 4096),
        _P("llama-0.6b", "llama", 16, 1536, 4096, 16, 8, 32000, 4096),
        # GPU shapes that fit 128 GiB of host memory (an H200 machine of that size).
        _P("qwen2.5-1.5b", "qwen2", 28, 1536, 8960, 12, 2, 151936, 32768, tie_embeddings=True, rope_theta=1e6),
        _P("qwen2.5-3b", "qwen2", 36, 2048, 11008, 16, 2, 151936, 32768, tie_embeddings=True, rope_theta=1e6),
        # The paper's dense shapes (DESIGN.md table).
        _P("llama2-7b", "llama", 32, 4096, 11008, 32, 32, 32000, 4096),
        _P("qwen2.5-7b", "qwen2", 28, 3584, 18944, 28, 4, 152064, 32768, rope_theta=1e6),
        _P("llama3.1-8b", "llama", 32, 4096, 14336, 32, 8, 128256, 131072, rope_theta=5e5),
        _P("qwen2.5-14b", "qwen2", 48, 5120, 13824, 40, 8, 152064, 32768, rope_theta=1e6),
        _P("qwen2.5-32b", "qwen2", 64, 5120, 27648, 40, 8, 152064, 32768, rope_theta=1e6),
        _P("llama3.1-70b", "llama", 80, 8192, 28672, 64, 8, 128256, 131072, rope_theta=5e5),
        _P("qwen2.5-72b", "qwen2", 80, 8192, 29568, 64, 8, 152064, 32768, rope_theta=1e6),
        # Hidden x depth from the MegaTrain calculator's 120B entry; MLP, heads and vocab are our choice.
        _P("dense-120b", "llama", 96, 10240, 27648, 80, 80, 32000, 4096),
    ]
}
ALIASES = {"7b": "llama2-7b", "8b": "llama3.1-8b", "14b": "qwen2.5-14b", "32b": "qwen2.5-32b",
           "70b": "llama3.1-70b", "72b": "qwen2.5-72b", "120b": "dense-120b"}


def get_preset(name: str) -> ModelPreset:
    key = ALIASES.get(name, name)
    if key in PRESETS:
        return PRESETS[key]
    close = difflib.get_close_matches(name, list(PRESETS) + list(ALIASES), n=3)
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    raise ValueError(f"unknown model preset {name!r}.{hint} Known presets: {', '.join(PRESETS)}.")
