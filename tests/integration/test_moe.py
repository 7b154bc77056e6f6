"""Mixture-of-experts models train exactly through both faces: Mixtral, Qwen3-MoE, GPT-OSS, DeepSeek-V3.

The router auxiliary loss couples every layer's router logits; the engine records them per layer, computes the
model's own loss term on leaves of them and backpropagates each leaf's gradient through its layer's recompute
(engine/layer/router.py). The comparison below is the dense parity tests': per-micro-batch losses within 1e-5 of
PyTorch over 12 micro-batches (AdamW, accumulation 2, clipping that triggers) and first-step gradients within
1e-6 relative; the negative controls break the engine three ways and each must fail that same comparison.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from conftest import make_batches

from megatrain.engine.layer.templates import TemplateBank
from megatrain.engine.pipeline.schedule import LayerPipeline

LR, WD, CLIP, ACCUM, MICRO_BATCHES = 1e-3, 0.01, 0.5, 2, 12
_COMMON = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
               max_position_embeddings=512, tie_word_embeddings=False)
# Aux loss on where the family has one (DeepSeek-V3 balances its experts with e_score_correction_bias instead).
_FAMILIES = {
    "mixtral": dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                    router_aux_loss_coef=0.1),
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                      output_router_logits=True, router_aux_loss_coef=0.1, mlp_only_layers=[1], head_dim=16),
    "gpt_oss": dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                    router_aux_loss_coef=0.1, head_dim=16, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "deepseek_v3": dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                        n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        num_key_value_heads=4),
}


def moe_model(family: str) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(family, **{**_COMMON, **_FAMILIES[family]})
    cfg._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"  # GPT-OSS has no SDPA path
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    if family == "deepseek_v3":
        # A different selection bias per MoE layer: a layer bound to another layer's bias routes differently.
        with torch.no_grad():
            for layer in model.model.layers[cfg.first_k_dense_replace:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return model


def _batches() -> list[dict[str, torch.Tensor]]:
    return make_batches(MICRO_BATCHES)


def _run(model, batches, micro_step, grads_of, clip_and_step) -> dict:
    losses, norms, first = [], [], None
    for k, batch in enumerate(batches):
        losses.append(micro_step(batch))
        if (k + 1) % ACCUM == 0:
            if first is None:
                first = grads_of()
            norms.append(clip_and_step())
    return {"losses": losses, "norms": norms, "grads": first}


def torch_run(model, batches) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)

    def micro_step(batch):
        loss = model(**batch).loss
        (loss / ACCUM).backward()
        return loss.item()

    def clip_and_step():
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        opt.step()
        opt.zero_grad()
        return norm

    return _run(model, batches, micro_step,
                lambda: {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, clip_and_step)


def _engine_grads(eng) -> dict[str, torch.Tensor]:
    eng.synchronize()
    named = dict(eng.named_parameters())
    named.update({a: named[n] for a, n in eng._aliases.items()})
    return {n: p.grad.clone() for n, p in named.items() if p.grad is not None}


def deepspeed_run(model, batches) -> dict:
    import megatrain

    cfg = {"train_batch_size": 2 * ACCUM, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACCUM,
           "gradient_clipping": CLIP, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = megatrain.initialize(model=model, config=cfg)

    norms: list[float] = []
    grads: list[dict] = []

    def micro_step(batch):
        out = engine(**batch)
        engine.backward(out.loss)
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary and not grads:
            grads.append(_engine_grads(engine.engine))  # the first step's, before clipping scales them
        engine.step()  # every micro-batch, as in DeepSpeed: the engine counts them and steps at the boundary
        if boundary:
            norms.append(engine.get_global_grad_norm())
        return out.loss.item()

    return _run(model, batches, micro_step, lambda: grads[0], lambda: norms[-1])


def accelerator_run(model, batches) -> dict:
    from megatrain.accelerate import Accelerator

    acc = Accelerator(backend="megatrain", gradient_accumulation_steps=ACCUM)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD))
    model.train()
    norms: list[float] = []
    grads: list[dict] = []

    def micro_step(batch):
        with acc.accumulate(model):
            out = model(**batch)
            acc.backward(out.loss)
            if acc.sync_gradients:
                if not grads:  # the first step's gradients, before clipping scales them
                    grads.append(_engine_grads(acc.backend.engine))
                norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
        return out.loss.item()

    return _run(model, batches, micro_step, lambda: grads[0], lambda: norms[-1])


FACES = {"initialize": deepspeed_run, "accelerator": accelerator_run}


def parity(ref: dict, got: dict) -> tuple[float, float]:
    """The comparison: (max loss difference, max first-step gradient error relative to each tensor's largest)."""
    assert len(got["losses"]) == len(ref["losses"]) == MICRO_BATCHES
    loss_diff = max(abs(a - b) for a, b in zip(ref["losses"], got["losses"]))
    missing = sorted(set(ref["grads"]) - set(got["grads"]))
    assert not missing, f"no gradient for {missing[:3]}"
    rel = {n: ((got["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
           for n, g in ref["grads"].items()}
    worst = max(rel, key=rel.get)
    assert rel[worst] <= 1e-6, f"first-step gradient of {worst}: relative error {rel[worst]:.2e}"
    assert loss_diff <= 1e-5, f"losses differ by {loss_diff:.2e}: {ref['losses']} vs {got['losses']}"
    assert max(abs(a - b) for a, b in zip(ref["norms"], got["norms"])) <= 1e-5 * max(ref["norms"])
    return loss_diff, rel[worst]


_REFERENCE: dict[str, dict] = {}


def reference(family: str) -> dict:
    """PyTorch's run of `family`, computed once for every test that compares against it."""
    if family not in _REFERENCE:
        _REFERENCE[family] = torch_run(moe_model(family), _batches())
        assert min(_REFERENCE[family]["norms"]) > CLIP, "clipping never triggered: the test would not cover it"
    return _REFERENCE[family]


@pytest.mark.parametrize("face", list(FACES))
@pytest.mark.parametrize("family", list(_FAMILIES))
def test_moe_trains_like_pytorch(family, face):
    got = FACES[face](moe_model(family), _batches())
    parity(reference(family), got)


def test_the_aux_loss_is_in_the_reference():
    # The aux term is really part of what the parity tests compare: dropping it changes PyTorch's own loss.
    model = moe_model("mixtral")
    batch = _batches()[0]
    with_aux = model(**batch).loss.item()
    without = model(**batch, output_router_logits=False).loss.item()
    assert abs(with_aux - without) > 1e-3


def _drop_aux(monkeypatch):
    import megatrain.engine.engine as engine_module

    real = engine_module.model_router_loss

    def dropped(*args, **kwargs):
        extra, aux = real(*args, **kwargs)
        return extra.detach() * 0, aux

    monkeypatch.setattr(engine_module, "model_router_loss", dropped)


def _lose_one_expert(monkeypatch):
    real = LayerPipeline._grads  # every layer's weight gradients, recomputed or from a kept graph

    def lossy(self, outs, x, weights, gouts):
        gx, gw = real(self, outs, x, weights, gouts)
        for name, w in zip(weights, gw):
            if name.endswith("experts.gate_up_proj") and w is not None:
                w[1].zero_()  # expert 1's gradient never reaches the host
        return gx, gw

    monkeypatch.setattr(LayerPipeline, "_grads", lossy)


def _detach_router(monkeypatch):
    monkeypatch.setattr(TemplateBank, "with_router_grads", lambda self, i, y, g, logits=None: ((y,), (g,)))


@pytest.mark.parametrize("breakage", [_drop_aux, _lose_one_expert, _detach_router],
                         ids=["aux-term-dropped", "one-expert-gradient-lost", "router-gradient-detached"])
def test_each_negative_control_is_caught(monkeypatch, breakage):
    breakage(monkeypatch)
    got = deepspeed_run(moe_model("mixtral"), _batches())
    with pytest.raises(AssertionError):
        parity(reference("mixtral"), got)


@pytest.mark.parametrize("family", list(_FAMILIES))
def test_generate_and_evaluation_match_hugging_face(family):
    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine

    ref = moe_model(family).eval()
    eng = Engine(moe_model(family), EngineConfig(parity_probe=False))
    model = eng.module.eval()
    prompt = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    # output_router_logits off while generating: transformers' own aux loss fails on a cached step's mask.
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_router_logits=False)
    expect = ref.generate(prompt, **greedy)
    assert torch.equal(model.generate(prompt, **greedy), expect)
    batch = _batches()[0]
    with torch.no_grad():
        want, got = ref(**batch), model(**batch)
    assert abs(want.loss.item() - got.loss.item()) <= 1e-5  # the router term included, as in the model's eval loss
    with torch.no_grad():  # transformers' accumulation fix divides the token loss only, never the router term
        want_n, got_n = ref(**batch, num_items_in_batch=97), model(**batch, num_items_in_batch=97)
    assert abs(want_n.loss.item() - got_n.loss.item()) <= 1e-5 and abs(want_n.loss.item() - want.loss.item()) > 1e-3
    if family != "deepseek_v3":
        assert abs(want.aux_loss.item() - got.aux_loss.item()) <= 1e-6 and want.aux_loss.item() > 0


def test_trls_fused_head_on_a_mixture_of_experts_adds_the_router_term_as_trl_does():
    """TRL's fused LM head (SFTTrainer's path) on Mixtral with the router loss on: the engine-served head's loss,
    aux_loss and first-step gradients equal TRL's own patch on the plain model; without the router term the
    same comparison fails."""
    import copy

    from trl.trainer.utils import add_fused_lm_head

    import megatrain

    model = moe_model("mixtral")
    ours = copy.deepcopy(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    add_fused_lm_head(ours, outputs=("log_probs", "entropy"))
    batch = _batches()[0]
    ref = model(**batch, fused_lm_head=True)
    ref.loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = megatrain.initialize(model=ours, config=cfg)
    out = engine(**batch, fused_lm_head=True)
    assert out.aux_loss is not None and abs(out.aux_loss.item() - ref.aux_loss.item()) <= 1e-6
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-6
    engine.backward(out.loss)
    grads = _engine_grads(engine.engine)
    err = max(float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)) for n, g in ref_grads.items())
    assert err <= 1e-5, err
    # Control: the router term is what the loss adds beyond the tokens' log-probabilities.
    token_only = -(out.log_probs.sum() / out.label_mask.sum())
    assert abs(token_only.item() - ref.loss.item()) > 1e-4


@pytest.mark.parametrize("family", [f for f in _FAMILIES if f != "gpt_oss"])  # GPT-OSS: eager attention only, so
def test_moe_in_the_gpu_defaults_within_the_bf16_floor(family):  # sdpa's two kernels give it no floor to measure
    """bf16 compute, optimizer overlap, hilo (tests/gpu_defaults.py): the router term's bf16 logits, the
    experts' bf16 weights, against the plain-PyTorch reference of the same mixed-precision scheme."""
    import copy

    from gpu_defaults import GPU_DEFAULTS, bf16_reference, lag_updates, train

    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine

    model, batches, steps = moe_model(family), _batches(), 3  # 3 steps: each run here costs a reference pair
    floor = bf16_reference(model, batches, steps, ACCUM, CLIP,
                           optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, fused=True))
    eng = lag_updates(Engine(copy.deepcopy(model), EngineConfig(**GPU_DEFAULTS),
                             optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=LR, weight_decay=WD)))
    floor.check(train(eng, batches, steps, ACCUM, CLIP), eng.state_dict())
