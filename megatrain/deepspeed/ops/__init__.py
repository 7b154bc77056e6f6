"""`deepspeed.ops`: the optimizer classes scripts build before `initialize()`."""
from . import adam  # noqa: F401  (deepspeed.ops.adam.DeepSpeedCPUAdam after `import megatrain as deepspeed`)
