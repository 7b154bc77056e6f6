"""`deepspeed.compression`: the helpers scripts import from it (`compression.helper`); DeepSpeed's compression
training itself (`init_compression`, quantization and pruning schedules) is not MegaTrain's and is not provided."""
