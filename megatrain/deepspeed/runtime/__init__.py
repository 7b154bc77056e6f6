"""`deepspeed.runtime`: the import paths DeepSpeed scripts use below the top level (`runtime.zero.partition_parameters`,
`runtime.engine`), each answering MegaTrain's object of the same name."""
