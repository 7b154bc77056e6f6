"""File formats the run reads and writes: tensor files (safetensors with a JSON index) and atomic writes."""
