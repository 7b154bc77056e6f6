"""`deepspeed.checkpoint`: the helper accelerate's `get_state_dict` imports from it (`checkpoint.utils`). DeepSpeed's
checkpoint conversion tools (universal checkpoints, `zero_to_fp32`) are not MegaTrain's: its checkpoints are its own
format (`engine.save_checkpoint`)."""
