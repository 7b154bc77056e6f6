"""The fused pass's compiled kernel is built and self-checked when the engine is built, not inside the first step
on the optimizer thread; where it cannot be built the user is warned, with what the fallback costs."""

from __future__ import annotations

import warnings

import pytest
from kit import cpu_engine

import megatrain.engine.update.adam_kernel as K
from megatrain.engine.runtime import ckernel


def test_the_kernel_is_tried_at_construction(monkeypatch):
    monkeypatch.setattr(K._KERNEL, "state", False)  # not tried yet in this process
    cpu_engine(optimizer_overlap=True)
    assert K._KERNEL.state is not False, "the kernel was left to the first step"


def test_a_missing_compiler_warns_naming_the_cost(monkeypatch):
    monkeypatch.setattr(K._KERNEL, "state", False)
    monkeypatch.setattr(ckernel, "compiler", lambda: None)
    monkeypatch.delenv("MEGATRAIN_ADAM_KERNEL", raising=False)
    with pytest.warns(UserWarning, match="compiled AdamW kernel unavailable: no C compiler.*slower"):
        cpu_engine(optimizer_overlap=True)
    assert K._KERNEL.state is None


def test_turned_off_by_hand_is_not_warned_about(monkeypatch):
    monkeypatch.setattr(K._KERNEL, "state", False)
    monkeypatch.setenv("MEGATRAIN_ADAM_KERNEL", "torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        cpu_engine(optimizer_overlap=True)
