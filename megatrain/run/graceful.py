"""Graceful stop: turn SIGTERM / SIGINT into "finish this step, save a checkpoint, exit".

Schedulers (Slurm, Kubernetes, spot reclaim) announce the end of a job with SIGTERM and follow with
SIGKILL after a grace period; a person presses Ctrl-C. Either way hours of optimizer state must not be
lost, and a checkpoint must not be cut in half::

    with megatrain.run.graceful.GracefulStop() as stop:
        for step in range(start, total):
            ...  # forward / backward / engine.step() for every micro-batch of the step
            if stop.should_stop(engine):
                stop.save_and_exit(engine, "ckpt")   # prints what happened, exits with code 0

The handler only sets a flag: the loop decides when it is safe to stop (at an optimizer-step
boundary, where a checkpoint holds everything needed to continue bit-exactly). The first signal also
puts back the handlers that were installed before, normally the defaults, so a second SIGTERM kills
the process and a second Ctrl-C raises KeyboardInterrupt: a user who really wants out is never stuck
behind a slow save. A kill during the save is safe too, because checkpoints are published
atomically (`megatrain.run.checkpoint`).

Exit code: 0 by default (the run stopped cleanly and can be resumed); pass `exit_code=` to
`save_and_exit` for a scheduler that should requeue on a non-zero status (143 is the shell's
convention for "terminated by SIGTERM").
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from . import checkpoint

__all__ = ["GracefulStop"]

_PREFIX = "MegaTrain"


def _say(msg: str) -> None:
    # os.write, not print: a signal handler can interrupt a print in progress, and a buffered stream
    # re-entered from the handler raises RuntimeError.
    try:
        os.write(sys.stderr.fileno(), f"{_PREFIX}: {msg}\n".encode())
    except (OSError, ValueError, AttributeError):
        pass


class GracefulStop:
    """Context manager: a stop signal sets `requested`; the training loop saves and exits at a step boundary."""

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals = tuple(signals)
        if not self.signals:
            raise ValueError("GracefulStop needs at least one signal to watch")
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    # -- installation -----------------------------------------------------------------------------
    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("GracefulStop must be entered from the main thread (Python delivers signals there)")
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> bool:
        self._restore()
        return False

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        self.signum = signum
        self._restore()
        name = signal.Signals(signum).name
        _say(f"received {name}: finishing the current step, then saving a checkpoint and exiting "
             f"(send {name} again to stop immediately without a checkpoint)")

    @property
    def signal_name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None

    # -- use in the loop --------------------------------------------------------------------------
    @staticmethod
    def at_boundary(engine: Any) -> bool:
        """True between optimizer steps, where a checkpoint captures the whole training state.

        Mid-accumulation the gradients of the finished micro-batches live only in memory (a checkpoint
        does not hold them), so stopping there would lose work and break bit-exact resumption.
        """
        micro = getattr(engine, "micro_steps", None)
        gas = getattr(engine, "gradient_accumulation_steps", None)
        if micro is None or gas is None:
            return True
        gas = gas() if callable(gas) else gas
        return micro % max(1, int(gas)) == 0

    def should_stop(self, engine: Any = None) -> bool:
        """A stop was requested and (given an engine) it is at an optimizer-step boundary."""
        return self.requested and (engine is None or self.at_boundary(engine))

    def save_and_exit(self, engine: Any, save_dir: str | os.PathLike, *, tag: str | None = None,
                      client_state: dict | None = None, keep_last: int | None = None,
                      exit_code: int = 0) -> NoReturn:
        """Write a checkpoint with `engine.save_checkpoint`, say where it went, and exit with `exit_code`."""
        if not hasattr(engine, "save_checkpoint"):
            raise TypeError(f"{type(engine).__name__} has no save_checkpoint(); pass the engine that "
                            "megatrain.initialize() returned")
        if not self.at_boundary(engine):
            raise RuntimeError("save_and_exit() called in the middle of a gradient accumulation cycle: the "
                               "partial gradients would be lost; check should_stop(engine) after engine.step()")
        kwargs: dict[str, Any] = {"tag": tag, "client_state": client_state}
        if keep_last is not None:
            kwargs["keep_last"] = keep_last
        engine.save_checkpoint(save_dir, **kwargs)
        steps = getattr(engine, "global_steps", None)
        why = f"on {self.signal_name}" if self.signum is not None else "on request"
        at = f" after global step {steps}" if steps is not None else ""
        where = Path(save_dir).resolve() / (tag or checkpoint.latest_tag(save_dir) or "")
        _say(f"stopped {why}{at}; checkpoint saved to {where} "
             f"(resume with engine.load_checkpoint({str(save_dir)!r}))")
        sys.stdout.flush()
        sys.exit(exit_code)
