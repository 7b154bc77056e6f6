"""`megatrain check-model`: run the parity probe for a model type, a local checkpoint or a config file.

The check itself lives with the engine (engine/check.py): the compatibility study asks it too.
"""

from __future__ import annotations

from ..engine import check_model

__all__ = ["check_model"]
