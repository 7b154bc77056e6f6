"""The one check of config keys and value types, shared by every reader of a MegaTrain config.

The DeepSpeed config parser, the engine's `megatrain` section (EngineConfig), the Accelerate face, the
planner and the sweep specs all refuse an unknown key the same way: the first key not in the known set,
with the closest known spelling suggested. Each reader words its own error (it knows where the key sits
and what the user should read), so this module finds the problem and the caller raises it. Torch-free:
the planner imports it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["check_keys", "close_match", "is_bool", "is_int", "is_number", "unknown_key"]

# difflib's default: close enough that the suggestion reads as a typo of it, not as another key.
CUTOFF = 0.6


def close_match(key: Any, known: Iterable[str]) -> str | None:
    """The known spelling closest to `key`, or None when nothing is close."""
    close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=CUTOFF)
    return close[0] if close else None


def unknown_key(d: Iterable[Any], known: Iterable[str]) -> tuple[Any, str | None] | None:
    """The first key of `d` not in `known` and its closest known spelling; None when every key is known."""
    known = frozenset(known)
    for key in d:
        if key not in known:
            return key, close_match(key, known)
    return None


def check_keys(d: Iterable[Any], known: Iterable[str], refuse: Callable[[Any, str | None], Exception]) -> None:
    """Raise `refuse(key, suggestion)` for the first key of `d` not in `known`."""
    found = unknown_key(d, known)
    if found is not None:
        raise refuse(*found)


def is_int(v: Any) -> bool:
    """An integer as JSON/YAML write one (True is not 1 here: a switch where a count belongs is a mistake)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_bool(v: Any) -> bool:
    """Exactly true or false: "no" or {} would be truthy, the opposite of what was meant."""
    return isinstance(v, bool)
