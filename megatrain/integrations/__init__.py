"""Bridges from the tools people already train with to MegaTrain (Hugging Face Trainer, TRL, DeepSpeed)."""
