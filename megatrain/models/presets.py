"""Model shapes used by sweeps, the planner and the tests (public shapes; random weights)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class MoEShape:
    """The mixture-of-experts MLP of a preset's sparse layers. Every routed expert is stored (and streamed),
    only `top_k` of them compute per token; a shared expert computes for every token."""

    experts: int  # routed experts per sparse layer
    top_k: int  # routed experts each token computes
    expert_intermediate: int  # each routed expert's SwiGLU width
    shared_intermediate: int = 0  # the always-on shared expert(s), total width (DeepSeek: n_shared x moe width)
    shared_gate: bool = False  # Qwen-MoE: a sigmoid gate (hidden -> 1) on the shared expert's output
    expert_bias: bool = False  # GPT-OSS: biases on every expert's projections
    router_bias: bool = False  # GPT-OSS: a bias on the router's logits
    dense_layers: int = 0  # layers with a dense MLP of the preset's `intermediate` (first_k_dense_replace)


@dataclass(frozen=True)
class MLAShape:
    """DeepSeek's multi-head latent attention: queries and keys/values through low-rank projections."""

    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class LinearAttnShape:
    """A gated DeltaNet block (Qwen3-Next, Qwen3.5) in place of attention in `layers` of the decoder layers."""

    layers: int
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4


@dataclass(frozen=True)
class AttnShape:
    """Attention details beyond Llama's (all defaults: Llama's attention, head_dim = hidden / heads)."""

    head_dim: int = 0  # 0: hidden // heads
    qkv_bias: bool = False  # biases on q/k/v (always in the qwen2 family)
    o_bias: bool = False  # a bias on o_proj (GPT-OSS)
    qk_norm: bool = False  # RMSNorm over each head's q and k (Qwen3)
    sinks: bool = False  # a learned softmax sink per head (GPT-OSS)
    output_gate: bool = False  # q_proj also yields a sigmoid gate on the output (Qwen3.5: q_proj doubled)
    sliding_window: int = 0  # tokens a sliding-window layer attends to
    sliding_layers: int = 0  # how many layers use that window
    mla: MLAShape | None = None
    linear: LinearAttnShape | None = None


@dataclass(frozen=True)
class ModelPreset:
    name: str
    # which HF config class builds it: "llama" | "qwen2" | "mistral" (dense); "mixtral" | "qwen3_moe" |
    # "gpt_oss" | "deepseek_v3" | "qwen3_5_moe" (mixture of experts)
    family: str
    num_layers: int
    hidden: int
    intermediate: int  # the dense MLP's width (in a MoE preset: its dense layers', if any)
    heads: int
    kv_heads: int
    vocab: int
    max_positions: int = 4096
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    moe: MoEShape | None = None
    attn: AttnShape = AttnShape()
    # Hidden-wide residual streams passed between decoder layers (hyper-connections: DeepSeek-V4's hc_mult): a layer
    # boundary's activation is this many hidden vectors per token (costs/memory.py LayerDims.streams).
    residual_streams: int = 1
    # Parameters beside the decoder layers, the embedding, the head and the final norm (Gemma 3n/4's per-layer input
    # table and its projection, hyper-connections' head mixing): the engine keeps them on the device with the
    # embedding, in the compute dtype, and each backward gives them a dense gradient there (counted in
    # nonembed_params, which a preset's formulas leave at the final norm).
    side_params: int = 0

    @property
    def boundary_width(self) -> int:
        """Elements per token of one layer boundary's activation: every residual stream."""
        return self.hidden * self.residual_streams

    @property
    def head_dim(self) -> int:
        return self.attn.head_dim or self.hidden // self.heads

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    # -- parameters per part of a decoder layer --------------------------------------------------------

    def _attention_params(self, linear: bool) -> int:
        h, a = self.hidden, self.attn
        if linear:
            la = a.linear
            kd, vd = la.key_heads * la.key_head_dim, la.value_heads * la.value_head_dim
            conv = (2 * kd + vd) * la.conv_kernel
            # in_proj_qkv, in_proj_z, in_proj_b/a, the depthwise conv, dt_bias + A_log, gated norm, out_proj
            return h * (2 * kd + vd) + h * vd + 2 * h * la.value_heads + conv + 2 * la.value_heads \
                + la.value_head_dim + vd * h
        if a.mla is not None:
            m, nh = a.mla, self.heads
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            q = h * nh * qk if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * nh * qk
            kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank \
                + m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv + nh * m.v_head_dim * h
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        n = h * q * (2 if a.output_gate else 1) + 2 * h * kv + q * h
        if self.family == "qwen2" or a.qkv_bias:
            n += q + 2 * kv  # q/k/v biases
        n += (h if a.o_bias else 0) + (2 * self.head_dim if a.qk_norm else 0) + (self.heads if a.sinks else 0)
        return n

    def _mlp_params(self, sparse: bool, active: bool) -> int:
        """A layer's MLP: stored (active=False) or computed per token (active=True: top-k experts)."""
        h = self.hidden
        if not sparse:
            return 3 * h * self.intermediate
        e = self.moe
        per_expert = 3 * h * e.expert_intermediate + ((2 * e.expert_intermediate + h) if e.expert_bias else 0)
        routed = (e.top_k if active else e.experts) * per_expert
        router = e.experts * h + (e.experts if e.router_bias else 0)
        shared = 3 * h * e.shared_intermediate + (h if e.shared_gate else 0)
        return routed + router + shared

    def _layer_mix(self) -> tuple[int, int, int, int]:
        """(dense-MLP layers, sparse-MLP layers, full-attention layers, linear-attention layers)."""
        dense = self.num_layers if self.moe is None else self.moe.dense_layers
        linear = self.attn.linear.layers if self.attn.linear is not None else 0
        return dense, self.num_layers - dense, self.num_layers - linear, linear

    def _layers_sum(self, active: bool) -> int:
        dense, sparse, full, linear = self._layer_mix()
        attn = full * self._attention_params(False) + (linear * self._attention_params(True) if linear else 0)
        mlp = dense * self._mlp_params(False, active) + (sparse * self._mlp_params(True, active) if sparse else 0)
        return attn + mlp + self.num_layers * 2 * self.hidden  # + two RMSNorms per layer

    # -- the counts the planner uses --------------------------------------------------------------------

    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, MLP, two RMSNorms): the mean over the layers, stored
        and streamed (every expert of a MoE layer). The layers' sum is nonembed_params() less the final norm."""
        return self._layers_sum(active=False) // self.num_layers

    def largest_layer_params(self) -> int:
        """The largest decoder layer (what one device layer buffer holds): the largest attention block plus
        the largest MLP present (an upper bound where layers mix kinds)."""
        dense, sparse, full, linear = self._layer_mix()
        attn = max(([self._attention_params(False)] if full else []) + ([self._attention_params(True)] if linear else []))
        mlp = max(([self._mlp_params(False, False)] if dense else []) + ([self._mlp_params(True, False)] if sparse else []))
        return attn + mlp + 2 * self.hidden

    def layer_sizes(self) -> list[int]:
        """Each decoder layer's stored parameters (their sum is nonembed_params() less the final norm): dense-MLP
        layers first (first_k_dense_replace), linear-attention layers last (only the sum and the sizes count)."""
        dense, _, full, _ = self._layer_mix()
        return [self._attention_params(i >= full) + self._mlp_params(i >= dense, False) + 2 * self.hidden
                for i in range(self.num_layers)]

    def active_layer_params(self) -> int:
        """Parameters one token computes with in a decoder layer (mean over the layers): the router and only
        top-k routed experts of a MoE layer. What the FLOPs count; equal to layer_params() in a dense model."""
        return self._layers_sum(active=True) // self.num_layers

    def mlp_width(self, active: bool = True) -> int:
        """The MLP's SwiGLU width per token (mean over the layers): top-k experts + shared (active) or every
        expert (stored). The activations' and elementwise traffic's width; `intermediate` in a dense model."""
        if self.moe is None:
            return self.intermediate
        dense, sparse, _, _ = self._layer_mix()
        e = self.moe
        width = (e.top_k if active else e.experts) * e.expert_intermediate + e.shared_intermediate
        return (dense * self.intermediate + sparse * width) // self.num_layers

    def attention_score_width(self) -> int:
        """Per token, the query-key width of the attention scores (heads x head_dim; MLA: its q/k head width)."""
        if self.attn.mla is not None:
            m = self.attn.mla
            return self.heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) // 2  # QK^T and AV
        return self.heads * self.head_dim

    def attention_context(self, context: int) -> float:
        """The context the attention FLOPs see, averaged over the layers (causal attention over `context`
        counts as `context`): a sliding-window layer as at most twice its window (each query attends to
        `window` keys, not half the context on average), a linear-attention layer as none."""
        _, _, full, _ = self._layer_mix()
        win = min(2 * self.attn.sliding_window, context) if self.attn.sliding_window else context
        slide = min(self.attn.sliding_layers, full)
        return ((full - slide) * context + slide * win) / self.num_layers

    def nonembed_params(self) -> int:
        return self._layers_sum(active=False) + self.hidden + self.side_params  # + final norm

    def active_nonembed_params(self) -> int:
        return self._layers_sum(active=True) + self.hidden + self.side_params

    def embed_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    def param_count(self) -> int:
        """Every parameter stored (total): what host memory, streaming and the optimizer count."""
        return self.nonembed_params() + self.embed_params()

    def global_params(self) -> int:
        """Every parameter outside the decoder layers: the embedding, head and final norm, and the side parameters
        (what the engine keeps on the device beside the layers, its device globals)."""
        return self.param_count() - sum(self.layer_sizes())

    def active_param_count(self) -> int:
        """Parameters one token computes with (MoE: top-k experts), embedding and head included."""
        return self.active_nonembed_params() + self.embed_params()

    def with_(self, **changes) -> ModelPreset:
        return replace(self, **changes)

    def hf_config(self, **overrides):
        """A transformers config for this shape (no download; the model is built with random weights)."""
        from .preset_configs import hf_config

        return hf_config(self, **overrides)


_P = ModelPreset
PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in [
        # CPU-sized shapes for tests and the quick sweep.
        _P("tiny", "llama", 2, 64, 176, 4, 2, 256, 2048),
        _P("tiny-qwen2", "qwen2", 2, 64, 176, 4, 2, 256, 2048, tie_embeddings=True),
        # a CPU-sized mixture of experts (Mixtral's layer: 4 experts, top-2) for a MoE sweep point
        _P("tiny-mixtral", "mixtral", 2, 64, 96, 4, 2, 256, 2048, moe=MoEShape(4, 2, 96)),
        _P("small-7m", "llama", 4, 256, 688, 8, 4, 8192, 4096),
        # small-7m's attention with 16 experts of half its MLP width, top-2: small-7m's per-token compute
        # (plus the router), three times its stored parameters. The MoE sweep's CPU-sized comparison.
        _P("small-moe", "mixtral", 4, 256, 688, 8, 4, 8192, 4096, moe=MoEShape(16, 2, 344)),
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
        # Mixtures of experts, public shapes (tests/unit/test_planner_moe.py checks each count against the
        # transformers model class built on the meta device). FLOPs count the active parameters, bytes the total.
        # openai/gpt-oss-20b and -120b config.json: 24 / 36 layers, 32 / 128 experts, top-4, biases on
        # attention, experts and router, a sink per head, sliding window 128 in every other layer.
        *[_P(f"gpt-oss-{size}", "gpt_oss", layers, 2880, 2880, 64, 8, 201088, 131072, rope_theta=150000.0,
             moe=MoEShape(experts, 4, 2880, expert_bias=True, router_bias=True),
             attn=AttnShape(head_dim=64, qkv_bias=True, o_bias=True, sinks=True, sliding_window=128,
                            sliding_layers=layers // 2))
          for size, layers, experts in (("20b", 24, 32), ("120b", 36, 128))],
        # Qwen/Qwen3-30B-A3B config.json: 48 layers, 128 experts of width 768, top-8, q/k norms, head_dim 128.
        _P("qwen3-30b-a3b", "qwen3_moe", 48, 2048, 6144, 32, 4, 151936, 40960, rope_theta=1e6,
           moe=MoEShape(128, 8, 768), attn=AttnShape(head_dim=128, qk_norm=True)),
        # mistral-community/Mixtral-8x22B-v0.1 config.json: 56 layers, 8 experts of width 16384, top-2.
        _P("mixtral-8x22b", "mixtral", 56, 6144, 16384, 48, 8, 32768, 65536, rope_theta=1e6,
           moe=MoEShape(8, 2, 16384)),
        # Qwen/Qwen3.5-122B-A10B (text model): hidden 3072, 48 layers (36 gated-DeltaNet, 12 gated attention
        # with 32 query / 2 key-value heads of 256), 256 experts of width 1024, top-8, one gated shared expert
        # of 1024, vocabulary 248320 (as published training recipes list them). The DeltaNet heads are
        # ASSUMED (no public config.json found): 16 key / 64 value heads of 128, kernel 4, which puts the total
        # at the published 122B; the vision tower and the MTP layer are not counted (not in the causal LM).
        _P("qwen3.5-122b-a10b", "qwen3_5_moe", 48, 3072, 1024, 32, 2, 248320, 262144, rope_theta=1e7,
           moe=MoEShape(256, 8, 1024, shared_intermediate=1024, shared_gate=True),
           attn=AttnShape(head_dim=256, qk_norm=True, output_gate=True,
                          linear=LinearAttnShape(36, 16, 64, 128, 128, 4))),
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
