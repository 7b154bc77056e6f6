"""Part of a model, exactly: a parameter the user froze (requires_grad=False, or left out of model_parameters / the
optimizer's groups) is not trained, not counted in the clip norm, and keeps its flag, on every face.

The reference is plain PyTorch with DeepSpeed's rule (frozen_cases.reference): AdamW over the trainable parameters,
clip_grad_norm_ over them, frozen tensors untouched."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import tiny_model
from frozen_cases import BATCHES, CASES, CLIP, LR, STEPS, ds_config, frozen_model, reference, top_layers_model
from gpu_defaults import GPU_DEFAULTS, bf16_reference, lag_updates, train

import megatrain
from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine


def train_ds(engine, batches=BATCHES, steps: int = STEPS) -> tuple[list, list]:
    losses, norms = [], []
    for b in batches[:steps]:
        loss = engine(**b).loss
        engine.backward(loss)
        engine.step()
        norms.append(float(engine.get_global_grad_norm()))
        losses.append(loss.item())
    return losses, norms


def assert_exact(model, before: dict, flags: dict, got: tuple, want: tuple) -> None:
    (losses, norms), (ref_losses, ref_norms, ref) = got, want
    ref_weights = ref.state_dict()
    for a, b in zip(norms, ref_norms):
        assert abs(a - b) <= 1e-5 * b, f"clip norm {norms} vs PyTorch's {ref_norms}"
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5, (losses, ref_losses)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    frozen = [n for n, f in flags.items() if not f]
    assert frozen and all(torch.equal(state[n], before[n]) for n in frozen), "a frozen tensor moved"
    moved = max(float((state[k] - ref_weights[k]).abs().max()) for k in state)
    assert moved <= 1e-5, f"weights {moved} from PyTorch's"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("how", ["model_parameters", "model_only", "client_optimizer"])
def test_initialize_trains_only_what_the_user_left_trainable(case, how):
    model = frozen_model(case)
    want = reference(model)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    kw: dict = {"config": ds_config()}
    if how == "model_parameters":
        kw["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
    elif how == "client_optimizer":
        kw["config"].pop("optimizer")
        kw["optimizer"] = torch.optim.AdamW(model.parameters(), lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = megatrain.initialize(model=model, **kw)
    assert_exact(model, before, flags, train_ds(engine), want)


def train_accelerate(model, params: str, batches=BATCHES, steps: int = STEPS) -> tuple[list, list]:
    """The Accelerate face's loop on the megatrain backend, clipping over `params` ("trainable": the trainable
    parameters listed before prepare, as scripts list them for their optimizer; "all": model.parameters())."""
    acc = megatrain.Accelerator(backend="megatrain", config={"megatrain": {"compute_dtype": "float32",
                                                                          "optimizer_overlap": False}})
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    losses, norms = [], []
    for b in batches[:steps]:
        loss = model(**b).loss
        acc.backward(loss)
        norms.append(float(acc.clip_grad_norm_(trainable if params == "trainable" else model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("params", ["trainable", "all"])
def test_the_accelerate_face_clips_over_the_list_it_is_given(case, params):
    model = frozen_model(case)
    want = reference(model)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert_exact(model, before, flags, train_accelerate(model, params), want)


def test_a_clip_over_part_of_the_trainable_parameters_is_torchs():
    """accelerator.clip_grad_norm_(the head only): the norm over the head's gradient, only it scaled, as torch."""
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    acc = megatrain.Accelerator(backend="megatrain", config={"megatrain": {"compute_dtype": "float32",
                                                                          "optimizer_overlap": False}})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for b in BATCHES[:3]:
        loss = model(**b).loss
        acc.backward(loss)
        norm = float(acc.clip_grad_norm_([model.lm_head.weight], 0.1))
        opt.step()
        opt.zero_grad()
        ref_loss = ref(**b).loss
        ref_loss.backward()
        whole = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
        ref_norm = float(torch.nn.utils.clip_grad_norm_([ref.lm_head.weight], 0.1))
        ref_opt.step()
        ref_opt.zero_grad()
        assert ref_norm > 0.1 and whole > 1.01 * ref_norm  # control: a clip that bites, and not the whole norm
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm and abs(loss.item() - ref_loss.item()) <= 1e-5


@pytest.mark.parametrize("case", list(CASES))
def test_in_the_gpus_defaults_frozen_stays_frozen(case):
    """bf16 compute, the update overlapped, hilo masters: within the reference's bf16 floor of plain PyTorch in the
    engine's mixed-precision scheme (AdamW over the trainable parameters, clipped over them), frozen bit-unchanged."""
    model = frozen_model(case)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    floor = bf16_reference(model, BATCHES, STEPS, clip=CLIP, optimizer=lambda m: torch.optim.AdamW(
        [p for p in m.parameters() if p.requires_grad], lr=LR, fused=True))
    assert min(floor.out[1]) > CLIP  # control: every step's clip bites
    eng = lag_updates(Engine(model, EngineConfig(loss_chunk_tokens=13, **GPU_DEFAULTS)))
    floor.check(train(eng, BATCHES, STEPS, clip=CLIP), eng.state_dict())
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    state = eng.state_dict()
    assert all(torch.equal(state[n], before[n]) for n, f in flags.items() if not f), "a frozen tensor moved"


def _streamed(model: torch.nn.Module) -> Engine:
    return Engine(model, EngineConfig(compute_dtype="float32", optimizer_overlap=False, residency="stream",
                                      parity_probe=False))


def test_top_two_of_eight_layers_pay_only_for_what_trains():
    """Layer-wise fine-tuning, every layer streamed: no slab and no Adam state below the top two layers or for the
    embedding, host store <= 0.5x the full one; backward recomputes the top two layers only, and sends only their
    gradients; the step matches PyTorch's."""
    part, full = top_layers_model(), tiny_model("llama", layers=8)
    want = reference(part, steps=2)
    stats = {}
    for name, model in (("part", part), ("full", full)):
        eng = _streamed(model)
        for b in BATCHES[:2]:
            eng.reset_stats()
            loss = eng(**b).loss
            eng.backward(loss)
            if name == "part":
                assert abs(eng.clip_grad_norm_(CLIP) - want[1][len(stats.get("losses", []))]) <= 1e-5 * want[1][0]
                stats.setdefault("losses", []).append(loss.item())
            eng.step()
            eng.zero_grad()
        stats[name] = eng.collect_stats()
        if name == "part":
            assert [g.grad is None for g in eng.store.layers] == [True] * 6 + [False] * 2
            held = {id(p) for g in eng.optimizer.param_groups for p in g["params"]}
            frozen = [p for _, p in eng.named_parameters() if not p.requires_grad]
            assert frozen and not any(id(p) in held for p in frozen)
            assert all(not eng.optimizer.state.get(p) for p in frozen)
            layer_grad_bytes = sum(g.numel * 4 for g in eng.store.layers[6:])
    assert max(abs(a - b) for a, b in zip(stats["losses"], want[0])) <= 1e-5
    assert stats["part"]["recomputed_layers"] == 2 and stats["full"]["recomputed_layers"] == 8
    ratio = stats["part"]["host_store_bytes"] / stats["full"]["host_store_bytes"]
    assert ratio <= 0.5, ratio
    assert stats["part"]["d2h_bytes"] == layer_grad_bytes < stats["full"]["d2h_bytes"]


def _granular(case: str) -> torch.nn.Module:
    from kit import router_loss_moe

    model = router_loss_moe() if case == "expert_and_router" else tiny_model("llama", tied=case == "tied_head")
    frozen = {"head": lambda n: n == "lm_head.weight",
              "tied_head": lambda n: n == "model.embed_tokens.weight",  # the head is the same tensor
              "norms": lambda n: n.endswith("norm.weight"),
              "expert_and_router": lambda n: n in ("model.layers.1.mlp.experts.down_proj",
                                                   "model.layers.0.mlp.gate.weight")}[case]
    for n, p in model.named_parameters():
        if frozen(n):
            p.requires_grad_(False)
    return model


@pytest.mark.parametrize("case", ["head", "tied_head", "norms", "expert_and_router"])
def test_any_granularity_trains_as_pytorch(case):
    """The head (tied or not), the norms, a parameter of a mixture's experts and its router, frozen: an optimizer over
    model.parameters() steps the rest, exactly as PyTorch does with its trainable parameters."""
    from kit import train_steps

    model = _granular(case)
    want = reference(model, steps=3)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    eng = Engine(model, EngineConfig(compute_dtype="float32", optimizer_overlap=False, parity_probe=False),
                 optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    got = train_steps(eng, BATCHES, 3, clip=CLIP)
    assert_exact(model, before, flags, got, want)


@pytest.mark.parametrize("mode", [
    pytest.param({"speculative_step": True, "optimizer_overlap": True}, id="speculative"),
    pytest.param({"optimizer_in_backward": True}, id="in-backward"),
    pytest.param({"residency": "stream", "optimizer_overlap": True}, id="streamed-overlap"),
])
def test_every_update_path_leaves_the_frozen_alone(mode):
    """The update paths a layer at a time (speculated and rolled back, in backward, overlapped with the next forward)
    over a model whose layer 0 and embedding are frozen: PyTorch's losses and norms, frozen bit-unchanged."""
    from kit import train_steps

    model = top_layers_model(layers=3, trainable=2)
    clip = None if mode.get("optimizer_in_backward") else CLIP  # in backward refuses clipping
    ref = copy.deepcopy(model)
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)
    want = train_steps(_TorchRunner(ref, params, opt), BATCHES, 3, clip=clip)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    eng = Engine(model, EngineConfig(compute_dtype="float32", parity_probe=False, **mode),
                 optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    got = train_steps(eng, BATCHES, 3, clip=clip)
    assert max(abs(a - b) for a, b in zip(got[0], want[0])) <= 1e-5
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(got[1], want[1]))
    eng.synchronize()
    state = model.state_dict()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert len(frozen) == 10 and all(torch.equal(state[n], before[n]) for n in frozen)


class _TorchRunner:
    """Plain PyTorch driven like an Engine (kit.train_steps): clip_grad_norm_ over the trainable parameters."""

    def __init__(self, model, params, opt) -> None:
        self.model, self.params, self.opt = model, params, opt

    def __call__(self, **batch):
        return self.model(**batch)

    def backward(self, loss) -> None:
        loss.backward()

    def clip_grad_norm_(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad()


def test_a_frozen_layer_above_a_trainable_one_computes_only_its_input_gradient(monkeypatch):
    """Layer 1 frozen, layer 0 trained: layer 1's backward asks autograd for no weight gradient (its input's only)
    and sends none; the run matches PyTorch."""
    from megatrain.engine.pipeline.schedule import LayerPipeline

    model = tiny_model("llama", layers=2)
    for n, p in model.named_parameters():
        if n.startswith("model.layers.1."):
            p.requires_grad_(False)
    asked: dict[int, list[bool]] = {}
    leaves = LayerPipeline._leaves

    def spy(self, i, views):
        out = leaves(self, i, views)
        asked.setdefault(i, []).extend(w.requires_grad for w in out.values())
        return out

    monkeypatch.setattr(LayerPipeline, "_leaves", spy)
    want = reference(model, steps=2)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    eng = _streamed(model)
    from kit import train_steps

    got = train_steps(eng, BATCHES, 2, clip=CLIP)
    assert_exact(model, before, flags, got, want)
    assert asked[1] and not any(asked[1]) and all(asked[0])
    assert eng.store.layers[1].grad is None and eng.collect_stats()["recomputed_layers"] == 4  # 2 layers x 2 steps


def test_an_optimizer_prepared_after_the_model_keeps_the_frozen_out():
    """accelerator.prepare(model) then prepare(optimizer over model.parameters()): the engine's own AdamW replaced
    by the user's, which steps only the trainable parameters."""
    model = frozen_model("layer0")
    want = reference(model)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    acc = megatrain.Accelerator(backend="megatrain", config={"megatrain": {"compute_dtype": "float32",
                                                                          "optimizer_overlap": False}})
    model = acc.prepare(model)
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=LR))
    losses, norms = [], []
    for b in BATCHES:
        loss = model(**b).loss
        acc.backward(loss)
        norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert_exact(model, before, flags, (losses, norms), want)


def test_a_checkpoint_of_a_partly_frozen_model_resumes_bit_identically(tmp_path):
    """3 steps, save_checkpoint, a fresh engine over a freshly frozen model loads it and takes 2 more: the same
    losses, norms and weights as 5 steps straight."""
    def start():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = frozen_model("layer1_attention")
            return model, megatrain.initialize(model=model, config=ds_config())[0]

    straight_model, straight = start()
    full = train_ds(straight)
    first_model, first = start()
    head = train_ds(first, steps=3)
    first.save_checkpoint(tmp_path)
    resumed_model, resumed = start()
    resumed.load_checkpoint(tmp_path)
    tail = train_ds(resumed, BATCHES[3:], steps=2)
    assert head[0] + tail[0] == full[0] and head[1] + tail[1] == full[1]
    a, b = resumed_model.state_dict(), straight_model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_parameter_left_out_of_model_parameters_does_not_train():
    """DeepSpeed's rule: model_parameters without layer 0 (every flag True): layer 0 is not trained, not clipped
    over, sends no gradient; the rest trains as PyTorch with its optimizer and clip over model_parameters."""
    model = tiny_model("llama")
    kept = lambda n: not n.startswith("model.layers.0.")  # noqa: E731
    given = [p for n, p in model.named_parameters() if kept(n)]
    want_losses, want_norms, _ = reference(model, given=kept)
    before = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("model.layers.0.")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = megatrain.initialize(model=model, config=ds_config(), model_parameters=given)
    losses, norms = train_ds(engine)
    assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-5
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(norms, want_norms))
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in before.items())
    # its flag as the user set it (DeepSpeed leaves it too), no gradient held for it, and no slab kept
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.requires_grad and q.grad is None and engine.backend.engine.store.layers[0].grad is None


@pytest.mark.parametrize("how", ["factory", "replaced"])
def test_a_parameter_left_out_of_a_factory_built_optimizer_keeps_no_slab(how):
    """An optimizer factory (Engine(optimizer=callable)) building AdamW without layer 0 and the head (every flag
    True), or that AdamW handed over after the engine was built (replace_optimizer: a face's prepare(optimizer)):
    neither trains, layer 0 keeps no gradient slab and the resident slab ends before the head; the rest trains as
    PyTorch with AdamW and the clip over what that optimizer holds."""
    from kit import train_steps

    def left_out(n: str) -> bool:
        return n.startswith("model.layers.0.") or n == "lm_head.weight"

    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    given = [p for n, p in ref.named_parameters() if not left_out(n)]
    want = train_steps(_TorchRunner(ref, given, torch.optim.AdamW(given, lr=LR)), BATCHES, 3, clip=CLIP)
    before = {k: v.detach().clone() for k, v in model.state_dict().items() if left_out(k)}
    cfg = EngineConfig(compute_dtype="float32", optimizer_overlap=False, parity_probe=False)
    if how == "factory":
        eng = Engine(model, cfg, optimizer=lambda named: torch.optim.AdamW(
            [p for n, p in named if not left_out(n)], lr=LR))
    else:
        eng = Engine(model, cfg)
        eng.replace_optimizer(torch.optim.AdamW([p for n, p in model.named_parameters() if not left_out(n)], lr=LR))
    got = train_steps(eng, BATCHES, 3, clip=CLIP)
    assert max(abs(a - b) for a, b in zip(got[0], want[0])) <= 1e-5
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(got[1], want[1]))
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in before.items()), "a left-out tensor moved"
    assert eng.store.layers[0].grad is None and eng.store.layers[1].grad is not None
    head = next(s for s in eng.store.globals.slots if s.name == "lm_head.weight")
    assert head.offset + head.numel == eng.store.globals.numel  # the head is the globals' last slot...
    assert eng.store.globals.grad.numel() == head.offset  # ...and its slab ends before it
    full = Engine(tiny_model("llama"), cfg, optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=LR))
    held = sum(g.numel for g in eng.store.layers[:1]) + head.numel  # the slab bytes not kept: 4 B per element
    assert full.store.host_bytes() - eng.store.host_bytes() == 4 * held


@pytest.mark.parametrize("head_held", [False, True])
def test_a_head_left_out_of_the_optimizer_gets_no_gradient_computed(head_held, monkeypatch):
    """An optimizer without the head (its requires_grad left True, DeepSpeed's rule): the loss tile computes no head
    gradient at all (it used to compute it and drop it), the flag stays True, and the rest trains as PyTorch with
    that optimizer and the clip over what it holds. Control: held by the optimizer, the tile computes it."""
    from kit import train_steps

    from megatrain.engine.layer import loss as loss_module

    calls = []
    add = loss_module._add_head_grad
    monkeypatch.setattr(loss_module, "_add_head_grad", lambda *a, **k: calls.append(1) or add(*a, **k))
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    given = [p for n, p in ref.named_parameters() if head_held or n != "lm_head.weight"]
    want = train_steps(_TorchRunner(ref, given, torch.optim.AdamW(given, lr=LR)), BATCHES, 3, clip=CLIP)
    head = model.lm_head.weight.detach().clone()
    eng = Engine(model, EngineConfig(compute_dtype="float32", optimizer_overlap=False, parity_probe=False),
                 optimizer=torch.optim.AdamW([p for n, p in model.named_parameters()
                                              if head_held or n != "lm_head.weight"], lr=LR))
    got = train_steps(eng, BATCHES, 3, clip=CLIP)
    assert max(abs(a - b) for a, b in zip(got[0], want[0])) <= 1e-5
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(got[1], want[1]))
    assert model.lm_head.weight.requires_grad
    assert bool(calls) == head_held, len(calls)
    assert head_held or torch.equal(model.lm_head.weight.detach(), head)
