"""Bad input, fuzzed (issue 5): malformed batches and bogus configs either train correctly or raise
ValueError/TypeError with a message; a rejected batch leaves the host store untouched.

Accepted batches are checked against the Hugging Face model itself (loss and every gradient), so
"trains" means "trains correctly", not merely "did not crash".
"""

from __future__ import annotations

import copy
import faulthandler
import math
import warnings
from typing import Any

import pytest
import torch
from conftest import tiny_model
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from megatrain.deepspeed import initialize

VOCAB, MAX_POS = 256, 32
BASE_CFG = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
FUZZ = settings(max_examples=50, deadline=None, derandomize=False, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def guard():
    # Tiny models gain nothing from intra-op threads; on a loaded machine spinning OpenMP threads
    # make every op ~20x slower. A hang is turned into a failure with every thread's stack.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(300, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
    torch.set_num_threads(before)


def _model():
    return tiny_model("llama", layers=2, hidden=32, vocab=VOCAB, max_pos=MAX_POS)


_STATE: dict[str, Any] = {}


def _setup() -> tuple[Any, torch.nn.Module]:
    """A fresh engine per example (a few ms) and one HF reference (reloaded from the engine's weights).

    Fresh, so that an example that fails half-way (gradients accumulated, a forward pending) cannot
    poison the next one, or hypothesis's shrinking of the first failure into a different example.
    """
    if not _STATE:
        _STATE.update(model=_model(), ref=_model())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = initialize(model=copy.deepcopy(_STATE["model"]), config=BASE_CFG)[0]
    return engine, _STATE["ref"]


# ---------------------------------------------------------------------------------------------------
# batches

# Corruptions that make a batch wrong: it must be refused.
MUST_REJECT = {
    "ids float", "ids bool", "ids 1-D", "ids 3-D", "ids empty", "ids too high", "ids negative", "ids list",
    "mask shape", "mask value 2", "mask value -1", "mask row all zero", "mask float 0.5", "labels all ignored",
    "labels too high", "labels negative", "labels shape", "labels float", "too long", "extra key",
    "position_ids shape",
}
# Unusual but meaningful: the engine may accept them (then the result must match Hugging Face).
MAY_ACCEPT = {None, "ids int32", "ids int16", "ids uint8", "mask bool", "mask float", "mask none", "labels int32",
              "labels none", "seq 1", "position_ids", "mask middle zeros", "non-contiguous"}


@st.composite
def batches(draw: st.DrawFn, corruption: str | None) -> tuple[dict[str, Any], str | None]:
    b = draw(st.integers(1, 3))
    s = 1 if corruption == "seq 1" else draw(st.integers(2, MAX_POS))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    mask = torch.ones_like(ids)
    if b > 1 and s > 2 and draw(st.booleans()):
        mask[-1, : draw(st.integers(1, s - 1))] = 0  # left padding
    labels = ids.clone()
    labels[mask == 0] = -100
    n_ignored = draw(st.integers(0, max(0, s - 2)))
    labels[0, torch.randperm(s, generator=g)[:n_ignored]] = -100
    batch: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def set_(key: str, value: Any) -> None:
        batch[key] = value

    edits = {
        "ids float": lambda: set_("input_ids", ids.float()),
        "ids bool": lambda: set_("input_ids", ids > 0),
        "ids 1-D": lambda: set_("input_ids", ids[0]),
        "ids 3-D": lambda: set_("input_ids", ids[None]),
        "ids empty": lambda: batch.update(input_ids=ids[:, :0], attention_mask=mask[:, :0], labels=labels[:, :0]),
        "ids too high": lambda: set_("input_ids", ids.index_put((torch.tensor(0), torch.tensor(s - 1)),
                                                                torch.tensor(VOCAB + draw(st.integers(0, 1000))))),
        "ids negative": lambda: set_("input_ids", ids.index_put((torch.tensor(0), torch.tensor(0)), torch.tensor(-1))),
        "ids list": lambda: set_("input_ids", ids.tolist()),
        "ids int32": lambda: set_("input_ids", ids.int()),
        "ids int16": lambda: set_("input_ids", ids.short()),
        "ids uint8": lambda: set_("input_ids", ids.clamp(max=255).to(torch.uint8)),
        "mask shape": lambda: set_("attention_mask", torch.ones(b, s + 1, dtype=torch.long)),
        "mask value 2": lambda: set_("attention_mask", mask * 2),
        "mask value -1": lambda: set_("attention_mask", mask.index_put((torch.tensor(0), torch.tensor(0)),
                                                                       torch.tensor(-1))),
        "mask row all zero": lambda: set_("attention_mask", mask.index_put((torch.tensor(0),), torch.tensor(0))),
        "mask float 0.5": lambda: set_("attention_mask", mask.float() * 0.5),
        "mask bool": lambda: set_("attention_mask", mask.bool()),
        "mask float": lambda: set_("attention_mask", mask.float()),
        "mask none": lambda: set_("attention_mask", None),
        "mask middle zeros": lambda: set_("attention_mask", mask.index_put((torch.tensor(0), torch.tensor(s // 2)),
                                                                           torch.tensor(0))),
        "labels all ignored": lambda: set_("labels", torch.full_like(labels, -100)),
        "labels too high": lambda: set_("labels", labels.index_put((torch.tensor(0), torch.tensor(s - 1)),
                                                                  torch.tensor(VOCAB))),
        "labels negative": lambda: set_("labels", labels.index_put((torch.tensor(0), torch.tensor(s - 1)),
                                                                  torch.tensor(-5))),
        "labels shape": lambda: set_("labels", labels[:, :-1]),
        "labels float": lambda: set_("labels", labels.float()),
        "labels int32": lambda: set_("labels", labels.int()),
        "labels none": lambda: set_("labels", None),
        "too long": lambda: batch.update(input_ids=torch.randint(0, VOCAB, (b, MAX_POS + draw(st.integers(1, 8))),
                                                                  generator=g), attention_mask=None, labels=None),
        "extra key": lambda: set_(draw(st.sampled_from(["inputs_embeds", "token_type_ids", "junk"])), ids),
        "position_ids": lambda: set_("position_ids", torch.arange(s).expand(b, s)),
        "position_ids shape": lambda: set_("position_ids", torch.arange(s + 1)[None]),
        "non-contiguous": lambda: batch.update(input_ids=ids.t().contiguous().t(), labels=labels.t().contiguous().t()),
        "seq 1": lambda: None,
        None: lambda: None,
    }
    edits[corruption]()
    return batch, corruption


def _snapshot(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.state_dict().items()}


def _grads(engine) -> dict[str, torch.Tensor]:
    inner = engine.engine
    inner.pipeline.synchronize_grads()
    return {n: p.grad.clone() for n, p in inner.named_parameters()}


# Every kind of damage gets its own few examples: one pooled draw left most kinds untried.
@pytest.mark.parametrize("kind", sorted(MUST_REJECT | MAY_ACCEPT, key=str))
@settings(FUZZ, max_examples=4)
@given(data=st.data())
def test_malformed_batches_train_correctly_or_are_refused_cleanly(kind, data):
    batch, corruption = data.draw(batches(kind))
    engine, ref = _setup()
    before = _snapshot(engine)
    try:
        out = engine(**batch)
    except (ValueError, TypeError) as e:
        event(f"refused: {corruption}")
        assert str(e).strip(), f"{corruption}: {type(e).__name__} without a message"
        after = _snapshot(engine)
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        assert not changed, f"{corruption}: a rejected batch changed {changed[:3]}"
        assert all(not g.any() for g in _grads(engine).values()), f"{corruption}: gradients left behind"
        assert engine.engine._pending is None
        return
    event(f"trained: {corruption}")
    assert corruption not in MUST_REJECT, f"accepted a malformed batch ({corruption})"

    # Accepted: it must be what the Hugging Face model computes with the same weights.
    ref.load_state_dict(before)
    ref.zero_grad(set_to_none=True)
    ids = batch["input_ids"].long()
    kw = {k: (v.long() if torch.is_tensor(v) and k != "attention_mask" else v) for k, v in batch.items()
          if k != "input_ids"}
    if batch.get("attention_mask") is not None:
        kw["attention_mask"] = batch["attention_mask"].long()
    expect = ref(input_ids=ids, **kw)
    if batch.get("labels") is None:
        keep = (kw.get("attention_mask") if kw.get("attention_mask") is not None else torch.ones_like(ids)).bool()
        diff = (out.logits - expect.logits)[keep].abs().max().item()
        assert diff <= 1e-4, f"{corruption}: logits differ from Hugging Face by {diff:.2e}"
        return
    assert abs(out.loss.item() - expect.loss.item()) <= 1e-5, (corruption, out.loss.item(), expect.loss.item())
    expect.loss.backward()
    engine.backward(out.loss)
    got = _grads(engine)
    # A gradient that is zero in exact arithmetic (q/k when the only labelled token attends to itself
    # alone) comes out as rounding noise of the terms that cancelled; those terms are of the model's
    # gradient scale, so each tensor's error is measured against at least 1e-3 of the largest gradient.
    floor = 1e-3 * max(p.grad.abs().max() for p in ref.parameters())
    for n, p in ref.named_parameters():
        scale = p.grad.abs().max().clamp_min(floor)
        rel = ((got[n] - p.grad).abs().max() / scale).item()
        assert rel <= 1e-4, f"{corruption}: gradient of {n} off by {rel:.2e} (relative)"
    engine.step()
    after = engine.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before), "an accepted batch did not train"


# ---------------------------------------------------------------------------------------------------
# configs

_JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.0, -1.0, 1e30, 0.5, 2.0]),
                  st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["", "auto", "yes", "x", "4"]),
                  st.lists(st.integers(-1, 2), max_size=3), st.just({}), st.just({"enabled": "maybe"}))
_DEVICES = st.sampled_from(["cpu", "cuda", "cuda:7", "meta", "gpu", "", "cpu:0", "mps", "xla"])

PATHS = [
    ("train_batch_size",), ("train_micro_batch_size_per_gpu",), ("gradient_accumulation_steps",),
    ("gradient_clipping",), ("optimizer",), ("optimizer", "type"), ("optimizer", "params"),
    ("optimizer", "params", "lr"), ("optimizer", "params", "betas"), ("optimizer", "params", "eps"),
    ("optimizer", "params", "weight_decay"), ("scheduler",), ("scheduler", "type"),
    ("scheduler", "params", "warmup_num_steps"), ("scheduler", "params", "warmup_max_lr"),
    ("bf16",), ("bf16", "enabled"), ("fp16", "enabled"), ("zero_optimization", "stage"),
    ("zero_optimization", "offload_param", "device"), ("zero_optimization", "offload_optimizer", "pin_memory"),
    ("steps_per_print",), ("wall_clock_breakdown",), ("dataloader_drop_last",), ("no_such_key",),
    ("megatrain",), ("megatrain", "device"), ("megatrain", "compute_dtype"), ("megatrain", "num_buffers"),
    ("megatrain", "loss_chunk_tokens"), ("megatrain", "pin_memory"), ("megatrain", "link_gbps"),
    ("megatrain", "offload_activations"), ("megatrain", "mlp_tile_tokens"), ("megatrain", "device_budget_bytes"),
    ("megatrain", "segment_attention"), ("megatrain", "measure_device_memory"), ("megatrain", "trace"),
    ("megatrain", "watchdog_s"), ("megatrain", "skip_nonfinite"), ("megatrain", "max_bad_steps"),
    ("megatrain", "host_mmap_threshold_bytes"), ("megatrain", "optimizer_overlap"),
    ("megatrain", "no_such_setting"),
]
_BOOL_SETTINGS = {("megatrain", k) for k in ("pin_memory", "measure_device_memory", "trace", "skip_nonfinite",
                                               "optimizer_overlap")}


@st.composite
def configs(draw: st.DrawFn) -> tuple[dict[str, Any], list[tuple[tuple[str, ...], Any]]]:
    cfg = copy.deepcopy(BASE_CFG)
    edits = []
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PATHS))
        value = draw(_DEVICES if path == ("megatrain", "device") else _JUNK)
        node = cfg
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[path[-1]] = value
        edits.append((path, value))
    return cfg, edits


_TEMPLATE: dict[str, torch.nn.Module] = {}


@FUZZ
@given(configs())
def test_bogus_configs_are_refused_before_touching_the_model_or_train(case):
    cfg, edits = case
    if "m" not in _TEMPLATE:
        _TEMPLATE["m"] = _model()
    model = copy.deepcopy(_TEMPLATE["m"])
    w = model.model.layers[0].mlp.up_proj.weight
    before = w.detach().clone()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, optimizer, _, _ = initialize(model=model, config=cfg)
    except (ValueError, TypeError) as e:
        event("config refused")
        assert str(e).strip(), f"{edits}: {type(e).__name__} without a message"
        assert w.numel() == before.numel() and torch.equal(w, before), f"{edits}: refused after taking the model"
        return
    event("config accepted")
    # Accepted: a non-boolean where a switch belongs is a typo the user did not mean. Judged on the
    # config as sent: a later edit may have overwritten an earlier one, or the section above it.
    for path in _BOOL_SETTINGS:
        value = cfg.get(path[0])
        value = value.get(path[1]) if isinstance(value, dict) else None
        assert value is None or isinstance(value, bool), f"accepted {path} = {value!r}"
    batch = {"input_ids": torch.randint(0, VOCAB, (2, 8)), "labels": torch.randint(0, VOCAB, (2, 8))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = engine(**batch)
        assert math.isfinite(out.loss.item())
        if optimizer is not None:
            engine.backward(out.loss)
            engine.step()
    assert all(torch.isfinite(v).all() for v in engine.state_dict().values())
