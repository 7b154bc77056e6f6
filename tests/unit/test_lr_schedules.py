"""MegaTrain's warm-up schedules against DeepSpeed's own classes, step by step."""

from __future__ import annotations

import deepspeed.runtime.lr_schedules as ds  # noqa: E402
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatrain import lr_schedules as mt


def _opt(lrs=(0.1,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.AdamW(groups)


CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5}),
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 7, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_num_steps": 1}),  # warmup_max_lr from the optimizer; 1 step -> 2
    ("WarmupLR", {"warmup_min_lr": [0.0, 1e-3], "warmup_max_lr": [1e-2, 2e-2], "warmup_num_steps": 3}),
    ("WarmupDecayLR", {"total_num_steps": 6, "warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 2,
                       "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 4}),
    ("WarmupDecayLR", {"total_num_steps": 3, "warmup_num_steps": 5}),  # total < warmup; default max 1e-3
    ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 3}),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_min_ratio": 0.1, "warmup_num_steps": 4, "cos_min_ratio": 0.05,
                        "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 2, "warmup_num_steps": 4}),  # no decay window
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.0}),
    ("LRRangeTest", {"lr_range_test_min_lr": [1e-4, 5e-4], "lr_range_test_step_size": 4,
                     "lr_range_test_staircase": True}),
]


def _run(cls, params, n_groups, steps):
    lrs = (0.1, 0.05)[:n_groups]
    opt = _opt(lrs)
    sched = cls(opt, **params)
    seen = [[g["lr"] for g in opt.param_groups]]  # after construction: what the first step uses
    for _ in range(steps):
        sched.step()
        seen.append(list(sched.get_last_lr()))
        assert seen[-1] == [g["lr"] for g in opt.param_groups]
    return seen, sched


@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_matches_deepspeed_step_by_step(name, params):
    n_groups = 2 if any(isinstance(v, list) for v in params.values()) else 1
    ours, _ = _run(getattr(mt, name), params, n_groups, 25)
    theirs, _ = _run(getattr(ds, name), params, n_groups, 25)
    assert ours == theirs  # bit-identical floats, the first steps included
    assert len({tuple(x) for x in ours}) > 1  # the schedule actually moves


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]),
    warmup=st.integers(1, 30),
    total=st.integers(1, 60),
    lo=st.floats(0.0, 1e-3),
    hi=st.floats(1e-3, 1.0),
    ratio=st.floats(0.0, 0.5),
    kind=st.sampled_from(["log", "linear"]),
)
def test_matches_deepspeed_random_params(name, warmup, total, lo, hi, ratio, kind):
    if name == "WarmupLR":
        p = {"warmup_min_lr": lo, "warmup_max_lr": hi, "warmup_num_steps": warmup, "warmup_type": kind}
    elif name == "WarmupDecayLR":
        p = {"total_num_steps": total, "warmup_min_lr": lo, "warmup_max_lr": hi, "warmup_num_steps": warmup,
             "warmup_type": kind}
    else:
        p = {"total_num_steps": total, "warmup_min_ratio": ratio, "warmup_num_steps": warmup,
             "cos_min_ratio": lo * 100, "warmup_type": kind}
    ours, _ = _run(getattr(mt, name), p, 1, total + warmup + 3)
    theirs, _ = _run(getattr(ds, name), p, 1, total + warmup + 3)
    assert ours == theirs


def test_first_value_is_min_and_sets_optimizer():
    opt = _opt((0.5,))
    mt.WarmupDecayLR(opt, total_num_steps=10, warmup_min_lr=1e-4, warmup_max_lr=1e-2, warmup_num_steps=3)
    assert opt.param_groups[0]["lr"] == 1e-4  # the optimizer's own 0.5 is never used
    opt = _opt((0.5,))
    mt.WarmupCosineLR(opt, total_num_steps=10)
    assert opt.param_groups[0]["lr"] == 0.0


def test_state_dict_resume_continues_identically():
    params = {"total_num_steps": 15, "warmup_min_lr": 1e-5, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}
    full, _ = _run(mt.WarmupDecayLR, params, 1, 12)
    _, first = _run(mt.WarmupDecayLR, params, 1, 5)
    sd = first.state_dict()
    assert sd == {"last_batch_iteration": 4}
    opt = _opt()
    resumed = mt.WarmupDecayLR(opt, **params)
    resumed.load_state_dict(sd)
    tail = []
    for _ in range(7):
        resumed.step()
        tail.append(resumed.get_last_lr())
    assert tail == full[6:]


def test_explicit_iteration_leaves_optimizer_alone_like_deepspeed():
    opt = _opt((0.3,))
    s = mt.WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=4, last_batch_iteration=2)
    assert opt.param_groups[0]["lr"] == 0.3
    with pytest.raises(RuntimeError, match="step"):
        s.get_last_lr()
    s.step()
    ref = ds.WarmupLR(_opt((0.3,)), warmup_max_lr=1.0, warmup_num_steps=4, last_batch_iteration=2)
    ref.step()
    assert s.get_last_lr() == ref.get_last_lr()


def test_tensor_lr_is_filled_in_place():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=torch.tensor(0.1))
    lr_tensor = opt.param_groups[0]["lr"]
    s = mt.WarmupLR(opt, warmup_max_lr=1e-2, warmup_num_steps=3, warmup_type="linear")
    s.step()
    s.step()
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(1e-2 * 1 / 3)  # iterations -1, 0, 1


def test_works_through_a_wrapper_and_rejects_non_optimizers():
    class Wrapper:
        def __init__(self, o):
            self.optimizer = o

    opt = _opt()
    mt.WarmupLR(Wrapper(opt), warmup_max_lr=0.2)
    assert opt.param_groups[0]["lr"] == 0.0
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        mt.WarmupLR(object())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"warmup_num_steps": 0}, "warmup_num_steps"),
        ({"warmup_num_steps": 2.5}, "warmup_num_steps"),
        ({"warmup_type": "Linear"}, "warmup_type"),
        ({"warmup_min_lr": [0.0, 0.1]}, "one per param group"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mt.WarmupLR(_opt(), **kwargs)
    with pytest.raises(ValueError, match="total_num_steps"):
        mt.WarmupDecayLR(_opt(), total_num_steps=0)


ONE_CYCLE = [
    {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 4},
    {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 3, "cycle_second_step_size": 5,
     "decay_lr_rate": 0.5, "decay_step_size": 2, "decay_mom_rate": 0.1, "cycle_min_mom": 0.85},
    {"cycle_min_lr": [1e-4, 2e-4], "cycle_max_lr": [1e-2, 3e-2], "cycle_first_step_size": 6,
     "cycle_first_stair_count": 3, "cycle_second_stair_count": 2},
]


@pytest.mark.parametrize("params", ONE_CYCLE, ids=range(len(ONE_CYCLE)))
@pytest.mark.parametrize("opt_kind", ["adamw", "sgd"])
def test_one_cycle_matches_deepspeed_lr_and_momentum(params, opt_kind):
    def run(cls):
        n = 2 if isinstance(params["cycle_min_lr"], list) else 1
        groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.1} for _ in range(n)]
        opt = torch.optim.AdamW(groups) if opt_kind == "adamw" else torch.optim.SGD(groups, lr=0.1, momentum=0.9)
        sched = cls(opt, **params)
        seen = [[(g["lr"], g.get("betas"), g.get("momentum")) for g in opt.param_groups]]
        for _ in range(20):
            sched.step()
            seen.append([(g["lr"], g.get("betas"), g.get("momentum")) for g in opt.param_groups])
        return seen

    ours, theirs = run(mt.OneCycle), run(ds.OneCycle)
    assert ours == theirs  # lr and betas bit-identical, DeepSpeed's beta2 = 0.99 included
    assert len({x[0][0] for x in ours}) > 2  # the schedule moves
