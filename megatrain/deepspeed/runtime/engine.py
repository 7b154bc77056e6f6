"""`deepspeed.runtime.engine`: `DeepSpeedEngine`, MegaTrain's engine under DeepSpeed's name."""

from ..deepspeed_engine import DeepSpeedEngine, MegaTrainEngine

__all__ = ["DeepSpeedEngine", "MegaTrainEngine"]
