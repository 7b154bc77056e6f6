"""The model object a user holds after MegaTrain takes it is a whole model, on both faces.

Each test here failed at 6bd59bc (the engine emptied the model's layers and swapped them for recorders):
saves and state dicts are whole and reload into a fresh HF model with identical logits, parameters()
counts all, module attributes are real modules, logits come back whenever they can be used, a loss
computed from logits trains exactly like PyTorch, generate matches HF token for token, and every
public path to the weights is walked against the engine's own parameter set.
"""

from __future__ import annotations

import copy
import inspect
import json
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import make_batches, tiny_model

import megatrain
from megatrain import Accelerator
from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.model.model_object import plain_class

LR = 1e-3
DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
             "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}  # torch AdamW's default


def _ds(model, **engine_keys):
    config = copy.deepcopy(DS_CONFIG)
    config.setdefault("megatrain", {}).update(engine_keys)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = megatrain.initialize(model=model, config=config)
    return engine


def _expected(engine: Engine) -> dict[str, torch.Tensor]:
    """The engine's own parameters (each tied weight under each of its names): what every path must serve."""
    engine.synchronize()
    out = {n: p.detach() for n, p in engine.named_parameters()}
    out.update({a: out[n] for a, n in engine._aliases.items()})
    return out


def assert_whole(tensors: dict[str, torch.Tensor], engine: Engine, what: str, tied_once: bool = False) -> None:
    """Every parameter the engine trains is present with its exact value; nothing else is a parameter."""
    want = _expected(engine)
    if tied_once:  # files store a tied weight once, under the name HF saves it by
        want = {n: t for n, t in want.items() if n not in engine._aliases}
    missing = sorted(set(want) - set(tensors))
    assert not missing, f"{what}: {len(missing)} of {len(want)} parameters missing, e.g. {missing[:3]}"
    extra = sorted(set(tensors) - set(want))
    assert not extra, f"{what}: unexpected keys {extra[:3]}"
    for n, t in want.items():
        assert torch.equal(tensors[n].detach().to("cpu", torch.float32), t), f"{what}: {n} differs from the master"


def _trained_engine(family: str = "llama", steps: int = 2, **kw) -> tuple[Engine, torch.nn.Module]:
    model = tiny_model(family, layers=3, **kw)
    eng = Engine(model, EngineConfig(), optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-2))
    for b in make_batches(steps):
        eng.backward(model(**b).loss)
        eng.step()
        eng.zero_grad()
    return eng, model


# ---------------------------------------------------------------------------------------------------
# saves, state dicts, parameters, module attributes


def test_assert_whole_fails_on_a_missing_or_stale_key():
    """Negative control: the checker the tests below rely on does fail."""
    eng, model = _trained_engine(steps=1)
    sd = model.state_dict()
    assert_whole(sd, eng, "state_dict")
    dropped = dict(sd)
    dropped.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(AssertionError, match="1 of"):
        assert_whole(dropped, eng, "dropped")
    stale = dict(sd)
    stale["model.norm.weight"] = stale["model.norm.weight"] + 1e-3
    with pytest.raises(AssertionError, match="differs"):
        assert_whole(stale, eng, "stale")


@pytest.mark.parametrize("family,kw", [("llama", {}), ("qwen2", {"tied": True})])
def test_state_dict_parameters_and_submodules_are_whole_and_are_the_store(family, kw):
    ref = tiny_model(family, layers=3, **kw)
    eng, model = _trained_engine(family, **kw)
    assert model is eng.module
    assert list(model.state_dict()) == list(ref.state_dict())
    assert_whole(model.state_dict(), eng, "module.state_dict()")
    assert_whole(dict(model.named_parameters(remove_duplicate=False)), eng, "module.named_parameters()")
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    # Same storage as the store (no second copy of the model): each parameter is a master view.
    masters = {id(p) for _, p in eng.named_parameters()}
    assert all(id(p) in masters for p in model.parameters())
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, type(ref.model.layers[0].self_attn))
    assert attn.q_proj.weight is dict(eng.named_parameters())["model.layers.0.self_attn.q_proj.weight"]


def test_module_save_pretrained_reloads_with_identical_logits(tmp_path):
    eng, model = _trained_engine()
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    batch = make_batches(1, seed=7)[0]
    model.eval()
    with torch.no_grad():
        want = model(**batch).logits
    for d in ("one", "sharded"):
        fresh = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / d)
        assert_whole(dict(fresh.named_parameters(remove_duplicate=False)), eng, f"reloaded {d}")
        with torch.no_grad():
            got = fresh(**batch).logits
        assert torch.equal(got, want) or (got - want).abs().max() <= 1e-5


def test_every_public_path_to_the_weights_is_whole(tmp_path):
    """Walk the paths a DeepSpeed or Accelerate user reads weights through; each serves every parameter."""
    from safetensors.torch import load_file

    ds = _ds(tiny_model("llama", layers=3, tied=True))
    b = make_batches(1)[0]
    ds.backward(ds(**b).loss)
    ds.step()
    eng = ds.engine
    assert_whole(ds.module.state_dict(), eng, "engine.module.state_dict()")
    assert_whole(ds.state_dict(), eng, "engine.state_dict()")
    assert_whole(ds.module_state_dict(), eng, "engine.module_state_dict()")
    assert_whole(dict(ds.named_parameters(remove_duplicate=False)), eng, "engine.named_parameters()")
    assert sum(p.numel() for p in ds.parameters()) == sum(p.numel() for _, p in eng.named_parameters())
    ds.save_pretrained(tmp_path / "ds")
    assert_whole(load_file(tmp_path / "ds" / "model.safetensors"), eng, "engine.save_pretrained", tied_once=True)
    ds.module.save_pretrained(tmp_path / "module")
    assert_whole(load_file(tmp_path / "module" / "model.safetensors"), eng, "module.save_pretrained", tied_once=True)
    ds.save_16bit_model(tmp_path / "16", "model.safetensors")
    assert_whole(load_file(tmp_path / "16" / "model.safetensors"), eng, "save_16bit_model", tied_once=True)
    ds.save_16bit_model(tmp_path / "16bin")
    assert_whole(torch.load(tmp_path / "16bin" / "pytorch_model.bin"), eng, "save_16bit_model(.bin)")

    acc = Accelerator(backend="megatrain")
    model = tiny_model("llama", layers=3)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    pm, opt = acc.prepare(model, opt)
    acc.backward(pm(**b).loss)
    opt.step()
    aeng = acc.backend.engine
    unwrapped = acc.unwrap_model(pm)
    assert isinstance(unwrapped, transformers.LlamaForCausalLM) and hasattr(unwrapped, "generate")
    assert_whole(acc.get_state_dict(pm), aeng, "accelerator.get_state_dict")
    assert_whole(unwrapped.state_dict(), aeng, "unwrap_model(model).state_dict()")
    acc.save_model(pm, tmp_path / "acc")
    assert_whole(load_file(tmp_path / "acc" / "model.safetensors"), aeng, "accelerator.save_model")
    unwrapped.save_pretrained(tmp_path / "unwrapped")
    assert_whole(load_file(tmp_path / "unwrapped" / "model.safetensors"), aeng, "unwrap_model().save_pretrained")


def test_paths_that_cannot_be_served_raise():
    eng, model = _trained_engine(steps=1)
    with pytest.raises(RuntimeError, match="host store"):
        model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="host store"):
        model.model.layers[0].half()
    assert model.to("cpu") is model and model.float() is model  # no-op conversions are fine
    with pytest.raises(ValueError, match="assign"):
        model.load_state_dict(model.state_dict(), assign=True)
    b = make_batches(1)[0]
    out = model(**b)
    with pytest.raises(RuntimeError, match="engine.backward"):
        out.loss.backward()  # would reach only the head: refused, not a silently partial gradient
    with pytest.raises(RuntimeError, match="zero_grad"):
        eng.step()  # the head's gradient may have landed before the refusal: no step on it
    eng.zero_grad()
    eng.backward(model(**b).loss)
    assert eng.step()
    with pytest.raises(ValueError, match="past_key_values"):
        model(**b, past_key_values=transformers.DynamicCache())
    with pytest.raises(ValueError, match="cache"):
        model(**b, cache=transformers.DynamicCache())
    with pytest.raises(ValueError, match="inputs_embeds"):
        model(inputs_embeds=torch.zeros(1, 4, 64))
    with pytest.raises(TypeError, match="token_type_ids"):
        model(**b, token_type_ids=torch.zeros_like(b["input_ids"]))


def test_a_loss_spanning_two_forwards_is_refused():
    eng, model = _trained_engine(steps=0)
    b1, b2 = make_batches(2)
    l1 = model(**b1).loss
    l2 = model(**b2).loss
    with pytest.raises(RuntimeError, match="earlier forward"):
        eng.backward(l1 + l2)


def test_load_state_dict_and_gathered_parameters_reach_the_store():
    ref = tiny_model("llama", layers=3, seed=3)
    # Streamed: the device copies are buffers of their own (a CPU device's kept layers would alias the masters,
    # and the last control below needs a copy the read-only gather leaves stale).
    ds = _ds(tiny_model("llama", layers=3), residency="stream")
    model = ds.module
    b = make_batches(1, seed=5)[0]
    model.load_state_dict(ref.state_dict())
    model.eval()
    ref.eval()
    with torch.no_grad():
        assert (model(**b).logits - ref(**b).logits).abs().max() <= 1e-5
    layer = model.model.layers[1]  # stays resident between forwards (3 layers, 2 buffers)
    with megatrain.zero.GatheredParameters(list(layer.parameters()), modifier_rank=0), torch.no_grad():
        assert layer.mlp.down_proj.weight.numel() > 0  # gathered: whole
        layer.mlp.down_proj.weight.mul_(0.5)
    with torch.no_grad():
        ref.model.layers[1].mlp.down_proj.weight.mul_(0.5)
        got, want = model(**b).logits, ref(**b).logits
    assert (got - want).abs().max() <= 1e-5
    with torch.no_grad():
        ref.model.layers[1].mlp.down_proj.weight.mul_(2.0)
        assert (got - ref(**b).logits).abs().max() > 1e-4  # the write changed the output: the check can fail
    # Negative control for the hand-over on exit: a write under modifier_rank=None (DeepSpeed's read-only
    # gather) is not handed to the engine, and the layer still resident on the device keeps its old weights.
    with megatrain.zero.GatheredParameters(list(layer.parameters())), torch.no_grad():
        layer.mlp.down_proj.weight.mul_(2.0)
    with torch.no_grad():
        assert (model(**b).logits - ref(**b).logits).abs().max() > 1e-4


def test_state_dict_waits_for_overlapped_layer_updates():
    """Read right after step(), while layer updates may still run on the host thread: the same bits as an
    engine that steps whole (the overlapped optimizer is bit-identical)."""
    base = tiny_model("llama", layers=4)
    b = make_batches(1)[0]
    out = []
    for overlap in (True, False):
        model = copy.deepcopy(base)
        eng = Engine(model, EngineConfig(optimizer_overlap=overlap),
                     optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-2))
        eng.backward(model(**b).loss)
        eng.step()
        out.append(model.state_dict())
    assert all(torch.equal(out[0][n], out[1][n]) for n in out[1])


# ---------------------------------------------------------------------------------------------------
# logits and losses from logits


def _ref_loss(logits, labels, kind):
    shift_logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    shift_labels = labels[:, 1:].reshape(-1)
    if kind == "smoothed":
        return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, label_smoothing=0.1)
    if kind == "custom":  # focal-style weighting plus a z-loss: not expressible through `labels`
        valid = shift_labels != -100
        lp = shift_logits[valid].log_softmax(-1)
        nll = -lp.gather(1, shift_labels[valid][:, None]).squeeze(1)
        focal = ((1 - (-nll).exp()) ** 2 * nll).mean()
        return focal + 1e-3 * (torch.logsumexp(shift_logits[valid], -1) ** 2).mean()
    if kind == "labels+aux":
        return None
    raise ValueError(kind)


def _train_from_logits(model, step_fn, batches, kind):
    losses, first = [], None
    for i, b in enumerate(batches):
        if kind == "labels+aux":
            out = model(**b, return_logits=True)
            loss = out.loss + 1e-3 * (out.logits.float() ** 2).mean()
        else:
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
            loss = _ref_loss(out.logits, b["labels"], kind)
        first = step_fn(loss, i == 0) or first
        losses.append(loss.item())
    return losses, first


def _torch_stepper(model):
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(loss, keep):
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()} if keep else None
        opt.step()
        opt.zero_grad()
        return grads
    return step


def _compare(ref_out, got_out, ref_model, got_sd):
    (rl, rg), (gl, gg) = ref_out, got_out
    for n, g in rg.items():
        rel = (gg[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)
        assert rel <= 1e-6, f"first-step gradient of {n}: relative error {rel:.2e}"
    assert max(abs(a - b) for a, b in zip(rl, gl)) <= 1e-5, (rl, gl)
    worst = max((got_sd[n] - p).abs().max().item() for n, p in ref_model.state_dict().items())
    assert worst <= 1e-5, f"parameters differ by {worst:.2e}"


def _engine_stepper(eng):
    def step(loss, keep):
        eng.backward(loss)
        grads = None
        if keep:
            eng.synchronize()
            grads = {n: p.grad.clone() for n, p in eng.named_parameters()}
        eng.step()
        eng.zero_grad()
        return grads

    return step


@pytest.mark.parametrize("kind", ["smoothed", "custom", "labels+aux"])
def test_loss_from_logits_trains_like_pytorch(kind):
    """6 steps, AdamW lr 1e-3, FP32, padded batches: first-step gradients, losses and parameters match."""
    ref = tiny_model("llama", layers=2)
    batches = make_batches(6)
    ref_out = _train_from_logits(ref, _torch_stepper(ref), batches, kind)

    model = tiny_model("llama", layers=2)
    eng = Engine(model, EngineConfig(), optimizer=torch.optim.AdamW(model.parameters(), lr=LR))

    got_out = _train_from_logits(model, _engine_stepper(eng), batches, kind)
    _compare(ref_out, got_out, ref, model.state_dict())


def test_loss_from_logits_parity_check_can_fail():
    """Negative control: a reference trained on a different loss fails the same comparison."""
    ref = tiny_model("llama", layers=2)
    batches = make_batches(2)
    ref_out = _train_from_logits(ref, _torch_stepper(ref), batches, "custom")
    model = tiny_model("llama", layers=2)
    eng = Engine(model, EngineConfig(), optimizer=torch.optim.AdamW(model.parameters(), lr=LR))

    got_out = _train_from_logits(model, _engine_stepper(eng), batches, "smoothed")
    with pytest.raises(AssertionError):
        _compare(ref_out, got_out, ref, model.state_dict())


def test_loss_from_logits_on_the_deepspeed_face():
    ref = tiny_model("llama", layers=2)
    batches = make_batches(6)
    ref_out = _train_from_logits(ref, _torch_stepper(ref), batches, "custom")
    ds = _ds(tiny_model("llama", layers=2))

    def step(loss, keep):
        ds.backward(loss)
        grads = None
        if keep:
            ds.engine.synchronize()
            grads = {n: p.grad.clone() for n, p in ds.engine.named_parameters()}
        ds.step()
        return grads

    _compare(ref_out, _train_from_logits(ds, step, batches, "custom"), ref, ds.module.state_dict())


def test_loss_from_logits_on_the_accelerate_face():
    ref = tiny_model("llama", layers=2)
    batches = make_batches(6)
    ref_out = _train_from_logits(ref, _torch_stepper(ref), batches, "smoothed")

    acc = Accelerator(backend="megatrain")
    model = tiny_model("llama", layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)

    def step(loss, keep):
        acc.backward(loss)
        grads = None
        if keep:
            acc.backend.synchronize()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        return grads

    _compare(ref_out, _train_from_logits(model, step, batches, "smoothed"), ref, acc.get_state_dict(model))
    model.eval()  # an evaluation loop gets loss and logits together (perplexity, accuracy)
    ref.eval()
    with torch.no_grad():
        out, want = model(**batches[0]), ref(**batches[0])
    assert out.logits is not None and (out.logits - want.logits).abs().max() <= 1e-5
    assert abs(out.loss - want.loss) <= 1e-5


def test_logits_whenever_usable_and_hf_kwargs_served():
    ref = tiny_model("llama", layers=2)
    model = copy.deepcopy(ref)
    Engine(model)
    b = make_batches(1)[0]
    assert model(**b).logits is None  # training with labels: the chunked loss, no logits unless asked
    train_logits = model(**b, return_logits=True).logits
    assert train_logits.shape == (2, 24, 256) and train_logits.requires_grad
    assert model(input_ids=b["input_ids"]).logits is not None  # no labels: logits
    model.eval()
    ref.eval()
    with torch.no_grad():
        out, want = model(**b), ref(**b)
        assert (out.logits - want.logits).abs().max() <= 1e-5 and abs(out.loss - want.loss) <= 1e-5
        n = int((b["labels"][:, 1:] != -100).sum()) + 7
        got = model(**b, num_items_in_batch=n).loss
        assert abs(got - ref(**b, num_items_in_batch=n).loss) <= 1e-6
        assert abs(got - want.loss) > 1e-3  # num_items_in_batch changed the reduction (the check can fail)
        last = model(**b, logits_to_keep=1).logits
        assert last.shape == (2, 1, 256) and (last - want.logits[:, -1:]).abs().max() <= 1e-5
        cached = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], cache=transformers.DynamicCache())
        want_cached = ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"], cache=transformers.DynamicCache())
        assert torch.equal(cached.logits, want_cached.logits) and cached.past_key_values is not None
        tup = model(**b, return_dict=False)
        assert isinstance(tup, tuple) and torch.equal(tup[1], out.logits)
        hs = model(**b, output_hidden_states=True).hidden_states
        ref_hs = ref(**b, output_hidden_states=True).hidden_states
        assert len(hs) == 3 and all((x - y).abs().max() <= 1e-5 for x, y in zip(hs, ref_hs))
    # Accuracy from logits, as an evaluation loop computes it.
    acc = (out.logits[:, :-1].argmax(-1) == b["input_ids"][:, 1:]).float().mean()
    assert 0.0 <= float(acc) <= 1.0


def test_num_items_in_batch_trains_like_hf():
    """Gradient accumulation with HF's sum / num_items_in_batch reduction: same first-step gradients."""
    ref = tiny_model("llama", layers=2)
    model = copy.deepcopy(ref)
    eng = Engine(model)
    batches = make_batches(2)
    n = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    for b in batches:
        ref(**b, num_items_in_batch=n).loss.backward()
        eng.backward(model(**b, num_items_in_batch=n).loss)
    eng.synchronize()
    got = dict(eng.named_parameters())
    for name, p in ref.named_parameters():
        rel = (got[name].grad - p.grad).abs().max() / p.grad.abs().max()
        assert rel <= 1e-6, (name, rel)


# ---------------------------------------------------------------------------------------------------
# generate and eval through the engine


@pytest.mark.parametrize("family,kw", [("llama", {}), ("qwen2", {"tied": True}), ("mistral", {"sliding_window": 8})])
def test_generate_matches_hf_token_for_token(family, kw):
    ref = tiny_model(family, layers=3, **kw).eval()
    model = copy.deepcopy(ref)
    eng = Engine(model, EngineConfig(trace=True))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    eng.reset_stats()
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want), (got, want)
    assert got.shape[1] == 18
    # The layers were streamed through the device buffers, one load per layer per forward at most.
    assert eng.stats["h2d_bytes"] > 0
    assert sum(r.kind == "infer" for r in eng.trace) == 3 * 12
    assert all(id(p) in {id(q) for _, q in eng.named_parameters()} for p in model.parameters())  # put back
    torch.manual_seed(11)
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20)
    torch.manual_seed(11)
    want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20)
    assert torch.equal(got, want)


def test_generate_after_training_matches_the_saved_model(tmp_path):
    eng, model = _trained_engine(steps=3)
    model.save_pretrained(tmp_path)
    fresh = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = make_batches(1, seed=9)[0]["input_ids"][:, :5]
    model.eval()
    got = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False)
    want = fresh.generate(input_ids=ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, want)
    # Generation leaves training intact: the next step still runs and the engine state is whole.
    model.train()
    eng.backward(model(**make_batches(1)[0]).loss)
    assert eng.step()
    assert_whole(model.state_dict(), eng, "after generate + step")


def test_generate_on_both_faces():
    ref = tiny_model("llama", layers=2).eval()
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(0))
    want = ref.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    ds = _ds(copy.deepcopy(ref))
    ds.eval()
    assert torch.equal(ds.generate(input_ids=ids, max_new_tokens=6, do_sample=False), want)
    assert torch.equal(ds.module.generate(input_ids=ids, max_new_tokens=6, do_sample=False), want)
    acc = Accelerator(backend="megatrain")
    model = acc.prepare(copy.deepcopy(ref))
    model.eval()
    assert torch.equal(acc.unwrap_model(model).generate(input_ids=ids, max_new_tokens=6, do_sample=False), want)


def test_bf16_compute_state_dict_serves_fp32_masters_and_generate_matches_hf_bf16():
    """Where the resident parameters are compute copies (bf16 here, the device on a GPU), state_dict() still
    serves the FP32 masters, writes to a copy reach its master, and generate equals HF in bf16."""
    ref = tiny_model("llama", layers=3)
    model = copy.deepcopy(ref)
    eng = Engine(model, EngineConfig(compute_dtype="bfloat16"))
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16  # the compute copy
    sd = model.state_dict()
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert_whole(sd, eng, "bf16 state_dict")
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    model.eval()
    got = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    for p in ref.parameters():  # parameters only: the rotary table stays FP32, as the engine keeps it
        p.data = p.data.to(torch.bfloat16)
    want = ref.eval().generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    emb = model.model.embed_tokens.weight
    with megatrain.zero.GatheredParameters([emb], modifier_rank=0), torch.no_grad():
        emb[3].fill_(0.25)
    master = dict(eng.named_parameters())["model.embed_tokens.weight"]
    assert torch.equal(master[3], torch.full((64,), 0.25))
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"][3], master[3])


def test_a_deepcopy_of_the_model_object_is_a_plain_independent_model():
    """A reference/EMA copy taken after prepare (DPO does this) must not route into the engine."""
    eng, model = _trained_engine(steps=1)
    frozen = copy.deepcopy(model)
    b = make_batches(1, seed=4)[0]
    model.eval()
    frozen.eval()
    with torch.no_grad():
        before = model(**b).logits
        assert (frozen(**b).logits - before).abs().max() <= 1e-5
    frozen.to(torch.float64)  # a plain model: conversions are its own business
    frozen.float()
    model.train()
    eng.backward(model(**b).loss)
    eng.step()
    model.eval()
    with torch.no_grad():
        after = model(**b).logits
        assert (after - before).abs().max() > 1e-4  # the engine trained on
        assert (frozen(**b).logits - before).abs().max() <= 1e-5  # the copy did not move with it
    assert_whole(model.state_dict(), eng, "original after the copy")
    ids = b["input_ids"][:1, :5]
    plain = copy.deepcopy(model).eval()  # the model's own attention again: generate runs as HF's
    assert torch.equal(plain.generate(input_ids=ids, max_new_tokens=5, do_sample=False),
                       model.generate(input_ids=ids, max_new_tokens=5, do_sample=False))


def test_hf_forward_is_the_models_own_forward_with_its_own_attention():
    """The reference path (generate's) runs HF's attention even where the engine trains with segment attention."""
    from megatrain.engine.model.model_object import hf_forward

    ref = tiny_model("llama", layers=2).eval()
    model = copy.deepcopy(ref)
    eng = Engine(model)
    assert eng.segment_attention and model.config._attn_implementation != ref.config._attn_implementation
    b = make_batches(1)[0]
    with torch.no_grad():
        got = hf_forward(eng, input_ids=b["input_ids"], attention_mask=b["attention_mask"])
        want = ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
    assert torch.equal(got.logits, want.logits)
    assert model.config._attn_implementation != ref.config._attn_implementation  # switched back afterwards


def test_an_engine_built_from_a_checkpoint_directory_serves_a_whole_model(tmp_path):
    ref = tiny_model("qwen2", layers=2, tied=True).eval()
    ref.save_pretrained(tmp_path)
    eng = Engine(str(tmp_path))
    assert_whole(eng.module.state_dict(), eng, "module of Engine(dir)")
    assert all(p.device.type != "meta" for p in eng.module.parameters())
    assert all(torch.equal(eng.module.state_dict()[n], t) for n, t in ref.state_dict().items())
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    eng.eval()
    got = eng.module.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, ref.generate(input_ids=ids, max_new_tokens=6, do_sample=False))


def test_a_parameter_or_module_replaced_after_the_engine_took_the_model_is_refused():
    b = make_batches(1)[0]
    for replace in ("param", "resize"):
        eng, model = _trained_engine(steps=0)
        if replace == "param":
            model.lm_head.weight = torch.nn.Parameter(torch.zeros_like(model.lm_head.weight))
            match = "lm_head.weight was replaced"
        else:
            model.resize_token_embeddings(300)
            match = "resize_token_embeddings"
        with pytest.raises(RuntimeError, match=match):
            model(**b)
        with pytest.raises(RuntimeError, match=match):
            model.state_dict()


# ---------------------------------------------------------------------------------------------------
# the binding is the class's: nothing on the instances

_ROUTED = ("forward", "state_dict", "named_parameters", "load_state_dict", "_apply", "__deepcopy__")


def _assert_class_bound(model: torch.nn.Module, plain: type) -> None:
    routed = [n for n in _ROUTED if n in vars(model)]
    assert not routed, f"{routed} set on the model instance: the binding must be its class's"
    patched = [f"{name or '<model>'}.{n}" for name, m in model.named_modules() for n in _ROUTED if n in vars(m)]
    assert not patched, f"methods set on submodule instances: {patched[:3]}"
    assert isinstance(model, plain) and type(model) is not plain
    # The route starts at the class: go to type(model).forward and you are in the model object's module
    assert type(model).forward.__module__ == "megatrain.engine.model.model_object"
    # HF saves type(model).__name__ as the architecture and picks the loss by it; Trainer, PEFT and TRL test it
    assert (type(model).__name__, type(model).__qualname__, type(model).__module__) == (
        plain.__name__, plain.__qualname__, plain.__module__)


def test_the_engine_binds_the_model_by_its_class_not_its_instance():
    """forward, state_dict, named_parameters, load_state_dict (and the conversion guard) are the class's."""
    model = tiny_model("qwen2", layers=2, tied=True)
    Engine(model)
    _assert_class_bound(model, transformers.Qwen2ForCausalLM)
    layer = model.model.layers[0]
    qwen2 = transformers.models.qwen2.modeling_qwen2
    assert type(layer).__name__ == "Qwen2DecoderLayer" and isinstance(layer, qwen2.Qwen2DecoderLayer)
    # Still routed, still guarded, from the class
    with pytest.raises(RuntimeError, match="host store"):
        layer.half()
    b = make_batches(1)[0]
    out = model(**b)
    assert out.loss is not None and out.logits is None  # the engine's chunked loss: no logits in training
    # HF's own signature: Trainer keeps the dataset columns it names, generate reads it
    assert inspect.signature(model.forward) == inspect.signature(qwen2.Qwen2ForCausalLM(model.config).forward)


def test_after_initialize_the_model_is_bound_by_its_class_not_its_instance():
    """Both faces: forward, state_dict, named_parameters and load_state_dict are not instance attributes."""
    acc = Accelerator(backend="megatrain")
    model = tiny_model("qwen2", layers=2, tied=True)
    pm, _ = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    _assert_class_bound(acc.unwrap_model(pm), transformers.Qwen2ForCausalLM)
    _assert_class_bound(_ds(tiny_model("llama", layers=2)).module, transformers.LlamaForCausalLM)


def test_a_bound_models_save_names_its_own_architecture(tmp_path):
    """A prefixed class name (FSDP2's) would be written into config.json's architectures."""
    eng, model = _trained_engine(steps=1)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert model.loss_type == "ForCausalLM"


def test_copies_and_pickles_are_plain_models_of_the_original_class():
    eng, model = _trained_engine(steps=1)
    model.eval()
    b = make_batches(1, seed=3)[0]
    with torch.no_grad():
        want = model(**b).logits
    frozen = copy.deepcopy(model)
    loaded = pickle.loads(pickle.dumps(model))  # torch.save(model) pickles too
    for what, m in (("deepcopy", frozen), ("pickle", loaded)):
        assert type(m) is transformers.LlamaForCausalLM, what
        bound = [name for name, sub in m.named_modules() if type(sub) is not plain_class(type(sub))]
        assert not bound, f"{what}: submodules of a generated class: {bound[:3]}"
        assert not [n for n in vars(m) if n.startswith("_megatrain") or n in _ROUTED], what
        assert m.config._attn_implementation == eng.hf_attention, what  # the model's own attention
        with torch.no_grad():
            assert (m(**b).logits - want).abs().max() <= 1e-5, what
        m.to(torch.float64)  # its own conversions: nothing refuses them
    lone = copy.deepcopy(model.model.layers[1])
    assert type(lone) is transformers.models.llama.modeling_llama.LlamaDecoderLayer
    lone.to(torch.float64)
    with pytest.raises(RuntimeError, match="host store"):
        model.model.layers[1].to(torch.float64)  # the original is still guarded


def test_a_model_of_the_bound_class_that_no_engine_serves_is_plain():
    """The probe and a user may build a model from type(model): it runs as the original class."""
    eng, model = _trained_engine(steps=0)
    ref = tiny_model("llama", layers=3, seed=5).eval()
    other = type(model)(ref.config)
    other.load_state_dict(ref.state_dict())
    other.eval()
    b = make_batches(1)[0]
    with torch.no_grad():
        assert torch.equal(other(**b).logits, ref(**b).logits)
    assert_whole(model.state_dict(), eng, "bound model beside an unbound one")
    assert set(other.state_dict()) == set(ref.state_dict())
    other.to(torch.float64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_cuda_the_model_object_is_whole_and_generates_like_hf(dtype):
    """GPU: resident parameters on the device, the layers' masters on the host; `model.device` is the GPU,
    state_dict serves the FP32 masters, generate equals HF on the GPU with the same (cast) weights."""
    ref = tiny_model("llama", layers=3)
    model = copy.deepcopy(ref)
    eng = Engine(model, EngineConfig(device="cuda", compute_dtype=dtype))
    assert model.device.type == "cuda" and model.model.layers[0].mlp.up_proj.weight.device.type == "cpu"
    assert model.to("cuda") is model  # the engine's own device: nothing moves
    with pytest.raises(RuntimeError, match="host store"):
        model.to("cpu")
    assert_whole(model.state_dict(), eng, f"cuda {dtype} state_dict")
    b = {k: v.cuda() for k, v in make_batches(1)[0].items()}
    eng.backward(model(**b).loss)
    eng.step()
    assert_whole(model.state_dict(), eng, f"cuda {dtype} state_dict after a step")
    sd = model.state_dict()
    ref.load_state_dict(sd)
    ref = ref.cuda().eval()
    if dtype == "bfloat16":
        for p in ref.parameters():  # parameters only: the rotary table stays FP32, as the engine keeps it
            p.data = p.data.to(torch.bfloat16)
    model.eval()
    ids = b["input_ids"][:, :6]
    got = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, ref.generate(input_ids=ids, max_new_tokens=8, do_sample=False))
    emb = model.model.embed_tokens.weight
    with megatrain.zero.GatheredParameters([emb], modifier_rank=0), torch.no_grad():
        emb[3].fill_(0.25)
    assert torch.equal(dict(eng.named_parameters())["model.embed_tokens.weight"][3], torch.full((64,), 0.25))
