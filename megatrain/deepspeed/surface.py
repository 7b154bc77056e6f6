"""DeepSpeedEngine's public names that MegaTrain's engine does not answer, each with the reason.

A script written for DeepSpeed may call any public attribute of `deepspeed.runtime.engine.DeepSpeedEngine`.
`MegaTrainEngine` answers the training loop's (forward, backward, step, the config accessors, checkpoints, weights
out, `tput_timer`, `monitor`, ranks, ...); every other public name of DeepSpeed 0.19.8's engine is listed here and
reading it raises AttributeError naming the reason, never the wrapped model's attribute of the same name or a plain
"no attribute". tests/unit/test_ds_surface.py lists DeepSpeedEngine's public surface from the installed package
and fails on a name that is neither answered nor listed here.
"""

from __future__ import annotations

__all__ = ["REFUSED", "refusal"]

_ZERO = ("ZeRO's partitioning, bucketing and offload settings: MegaTrain partitions nothing (every parameter whole "
         "in host memory, layers streamed through the device); the config's ZeRO section is read for its stage only")
_COMM = ("DeepSpeed's gradient communication: MegaTrain averages gradients across ranks itself, in the boundary "
         "micro-batch's backward (no_sync() keeps them local)")
_PRECISION = ("DeepSpeed's fp16 / loss-scaling / autocast machinery: MegaTrain keeps FP32 masters in host memory "
              "and computes in FP32 or bf16 (bfloat16_enabled(); docs/SETTINGS.md, precision)")
_PARALLEL = "model, tensor, sequence and pipeline parallelism: MegaTrain's only parallelism is data parallel"
_OFFLOAD = ("DeepSpeed's offload / NVMe swapping: MegaTrain's host store and NVMe tier are set in the config's "
            "\"megatrain\" section")
_FEATURES = ("a DeepSpeed training feature MegaTrain does not have (autotuning, flops profiler, curriculum / data "
             "efficiency, random-LTD, compression, MoE layers)")
_COMPILE = "compiling the engine (DeepCompile, torch.compile passes): MegaTrain runs its own layer schedule"
_CHECKPOINT = ("DeepSpeed's checkpoint format and its options: MegaTrain writes its own crash-consistent checkpoints "
               "(save_checkpoint / load_checkpoint)")
_INTERNAL = "an internal of DeepSpeed's engine with no counterpart in MegaTrain's"
_TIMERS = ("DeepSpeed's internal timers: wall_clock_breakdown prints MegaTrain's forward / backward / step times, "
           "tput_timer measures samples per second")
_BATCH = "the batch sizes are fixed when initialize() builds the engine"

_GROUPS = {
    _ZERO: """zero_allgather_bucket_size zero_allgather_partitions zero_allgather_sequential zero_allow_untested_optimizer
        zero_compute_grad_norm zero_contiguous_gradients zero_cpu_offload zero_elastic_checkpoint
        zero_force_ds_cpu_optimizer zero_hpz_partition_size zero_ignore_unused_parameters zero_legacy_stage1
        zero_load_from_fp32_weights zero_log_trace_cache_warnings zero_max_live_parameters zero_max_reuse_distance
        zero_model_persistence_threshold zero_module_granularity_threshold zero_multi_rank_bucket_allreduce
        zero_nvme_offload_optimizer zero_offload_optimizer zero_offload_param zero_optimization_partition_gradients
        zero_optimization_partition_weights zero_overlap_comm zero_param_persistence_threshold
        zero_parameter_alignment zero_partial_offload zero_prefetch_bucket_size zero_quantized_gradients
        zero_quantized_nontrainable_weights zero_quantized_weights zero_reduce_bucket_size zero_reduce_scatter
        zero_round_robin_gradients zero_save_muon_momentum_buffer_in_memory zero_sub_group_size
        zero_use_cpu_optimizer empty_partition_cache""",
    _COMM: """allreduce_and_copy allreduce_bucket allreduce_gradients allreduce_no_retain buffered_allreduce_fallback
        sparse_all_gather sparse_allreduce sparse_allreduce_bucket sparse_allreduce_no_retain all_gather_scalar
        enable_backward_allreduce data_parallel_group gradient_average gradient_predivide_factor postscale_gradients
        communication_data_type coalesce_grad_reduction use_ds_comm""",
    _PRECISION: """fp16_auto_cast fp16_master_weights_and_gradients dynamic_loss_scale dynamic_loss_scale_args
        initial_dynamic_scale loss_scale torch_autocast_dtype torch_autocast_enabled
        torch_autocast_lower_precision_safe_modules torch_autocast_z0_gradscaler bf16_master_weights_and_gradients
        bf16_optimizer_states clip_fp32_gradients scale""",
    _PARALLEL: """autotp_size tensor_parallel_config get_sequence_parallel_group is_first_weights_partition_group
        mesh_device all_to_all_group mpu pipeline_parallelism""",
    _OFFLOAD: "aio_config swap_tensor_config super_offload zenflow_config offload_states reload_states cpuadam_cores_perc",
    _FEATURES: """autotuning_enabled autotuning_end_profile_step autotuning_metric autotuning_metric_path
        autotuning_model_info_path autotuning_profile_model_info autotuning_start_profile_step flops_profiler
        flops_profiler_detailed flops_profiler_enabled flops_profiler_module_depth flops_profiler_output_file
        flops_profiler_profile_step flops_profiler_recompute_fwd_factor flops_profiler_top_modules
        curriculum_learning_config curriculum_learning_enabled data_efficiency_config data_efficiency_enabled
        data_sampling_config data_sampling_enabled random_ltd_config random_ltd_enabled random_ltd_initialize
        random_ltd_scheduler set_custom_curriculum_learning_schedule set_data_post_process_func load_moe_state_dict
        gate_modules moe_layers num_experts has_moe_layers""",
    _COMPILE: """compile_autosp compile_autotp compile_zero_optimization_stage get_autosp_backend get_autotp_backend
        get_compile_time get_deepcompile_backend get_deepspeed_compile_backend is_deepcompile_active
        is_deepcompile_enabled register_compile_pass uses_parallelization_pass_only""",
    _CHECKPOINT: """checkpoint_engine checkpoint_serialization_enabled checkpoint_tag_validation_enabled
        checkpoint_tag_validation_fail checkpoint_writer_enabled use_node_local_storage load_universal_checkpoint
        load_module_state_dict save_non_zero_checkpoint save_zero_checkpoint loaded_checkpoint_dp_world_size
        loaded_checkpoint_mp_world_size""",
    _TIMERS: "timers engine_timers engine_timers_cache get_wall_clock_timers print_forward_breakdown",
    _BATCH: "set_train_batch_size set_train_micro_batch_size",
    _INTERNAL: """basic_optimizer client_optimizer client_lr_scheduler dont_change_device flatten unflatten
        module_forward_pre_hook module_forward_post_hook scale_wrt_gas warn_unscaled_loss losses
        is_sanity_checks_enabled collect_python_gc managed_gradient_accumulation optimizer_legacy_fusion get_type
        log_level memory_breakdown dump_state destroy get_optimizer_configuration""",
}

REFUSED: dict[str, str] = {name: reason for reason, names in _GROUPS.items() for name in names.split()}


def refusal(name: str) -> str:
    return f"DeepSpeedEngine.{name} is not available on MegaTrain's engine: {REFUSED[name]}"
