"""Static tables of what DeepSpeed 0.19 accepts in a config, so validation never imports deepspeed.

Every table names the DeepSpeed source it mirrors; ``tests/test_dsconfig_keys.py`` re-derives
each one from the installed DeepSpeed (its pydantic models, and the keys ``DeepSpeedConfig``
actually reads) and fails when they drift apart.
"""

from __future__ import annotations

from zeroplan.spec import BUCKET_KEYS, DEEPSPEED_DEFAULT_KNOBS

__all__ = [
    "TOP_LEVEL_KEYS",
    "REMOVED_TOP_LEVEL_KEYS",
    "REMOVED_ZERO_KEYS",
    "ZERO_KEYS",
    "ZERO_INT_FIELDS",
    "OFFLOAD_PARAM_KEYS",
    "OFFLOAD_PARAM_INT_FIELDS",
    "OFFLOAD_OPTIMIZER_KEYS",
    "OFFLOAD_OPTIMIZER_INT_FIELDS",
    "FP16_KEYS",
    "FP16_INT_FIELDS",
    "BF16_KEYS",
    "ACTIVATION_CHECKPOINTING_KEYS",
    "OPTIMIZER_BLOCK_KEYS",
    "SCHEDULER_BLOCK_KEYS",
    "BATCH_INT_KEYS",
    "DEEPSPEED_OPTIMIZERS",
    "CPU_OFFLOAD_OPTIMIZERS",
    "TORCH_OPTIMIZERS",
    "ZERO_TESTED_OPTIMIZERS",
    "SCHEDULERS",
    "ZERO_DEFAULTS",
    "BUCKET_KEY_SPELLINGS",
    "OFFLOAD_DEVICES",
]

#: Top-level keys ``deepspeed.runtime.config.DeepSpeedConfig`` reads (recorded from a dict that
#: logs every lookup, see the test), plus keys read elsewhere: ``sequence_parallel_size`` and
#: ``data_parallel_size`` (deepspeed/__init__.py, runtime/config.py ``__init__``). Top-level keys
#: are read with ``dict.get``; an unknown one is silently ignored, which is why a typo is dangerous.
TOP_LEVEL_KEYS = frozenset(
    {
        "activation_checkpointing", "aio", "autotuning", "bf16", "bfloat16", "checkpoint", "comet",
        "comms_logger", "communication_data_type", "compile", "csv_monitor", "data_efficiency",
        "data_parallel_size", "data_types", "dataloader_drop_last", "datastates_ckpt",
        "disable_allgather", "disable_python_gc", "dump_state", "expert_parallel", "flops_profiler",
        "fp16", "gradient_accumulation_steps", "gradient_allreduce_op", "gradient_clipping",
        "gradient_predivide_factor", "hybrid_engine", "log_level", "managed_gradient_accumulation",
        "memory_breakdown", "optimizer", "pipeline", "prescale_gradients", "scheduler",
        "seq_parallel_communication_data_type", "sequence_parallel_size", "steps_per_print",
        "tensor_parallel", "tensorboard", "timers", "torch_autocast", "train_batch_size",
        "train_micro_batch_size_per_gpu", "use_data_before_expert_parallelism", "vocabulary_size",
        "wall_clock_breakdown", "wandb", "weight_quantization", "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer", "zero_optimization",
    }
)

#: deepspeed/runtime/config.py ``_REMOVED_TOP_LEVEL_CONFIG_KEYS``: DeepSpeedConfig raises
#: DeepSpeedConfigError when any of these is present.
REMOVED_TOP_LEVEL_KEYS = {
    "nebula": "Nebula checkpointing was removed; checkpoints would silently fall back to torch.save",
    "compression_training": "the compression library was removed; the model would train unquantized",
    "amp": "NVIDIA Apex AMP integration was removed; use fp16, bf16 or torch_autocast",
    "quantize_training": "Mixture-of-Quantization (quantize_training) was removed",
    "sparse_gradients": "sparse compression of dense embedding gradients was removed",
    "eigenvalue": "eigenvalue-based MoQ was removed",
    "sparse_attention": "DeepSpeed Sparse Attention was removed",
    "elasticity": "elastic training was removed; set the three batch keys directly",
    "graph_harvesting": "graph harvesting was removed",
    "curriculum_learning": "top-level curriculum_learning was removed; use data_efficiency.data_sampling.curriculum_learning",
    "progressive_layer_drop": "Progressive Layer Dropping was removed",
}

#: deepspeed/runtime/config.py ``_REMOVED_ZERO_CONFIG_KEYS``.
REMOVED_ZERO_KEYS = {
    "mics_shard_size": "MiCS ZeRO-3 sharding was removed",
    "mics_hierarchical_params_gather": "MiCS ZeRO-3 sharding was removed",
    "zeropp_loco_param": "LoCo-Zero++ was removed",
}

#: Field names and aliases of deepspeed/runtime/zero/config.py ``DeepSpeedZeroConfig``
#: (pydantic, ``extra="forbid"``, ``populate_by_name=True``: both spellings are accepted, any
#: other key is a validation error).
ZERO_KEYS = frozenset(
    {
        "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
        "use_multi_rank_bucket_allreduce", "allgather_partitions", "allgather_bucket_size",
        "overlap_comm", "compute_grad_norm", "load_from_fp32_weights", "elastic_checkpoint",
        "offload_param", "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
        "cpu_offload_use_pin_memory", "cpu_offload", "prefetch_bucket_size",
        "stage3_prefetch_bucket_size", "param_persistence_threshold",
        "stage3_param_persistence_threshold", "model_persistence_threshold",
        "stage3_model_persistence_threshold", "max_live_parameters", "stage3_max_live_parameters",
        "max_reuse_distance", "stage3_max_reuse_distance", "gather_16bit_weights_on_model_save",
        "stage3_gather_16bit_weights_on_model_save", "module_granularity_threshold",
        "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
        "stage3_use_all_reduce_for_fetch_params", "allgather_sequential",
        "stage3_allgather_sequential", "stage3_gather_fp16_weights_on_model_save",
        "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients", "parameter_alignment",
        "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients", "memory_efficient_linear", "pipeline_loading_checkpoint",
        "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
        "save_muon_momentum_buffer_in_memory", "leaf_module",
    }
)

#: ``int`` fields of DeepSpeedZeroConfig (both spellings) → the lower bound pydantic enforces
#: (``Field(gt=0)`` → 1, ``ge=0`` → 0, no bound → None). A float with a fractional part, e.g.
#: ``15099494.4`` from ``0.9·h²``, fails pydantic's int validation.
ZERO_INT_FIELDS = {
    "reduce_bucket_size": 1,
    "allgather_bucket_size": 0,
    "sub_group_size": 0,
    "prefetch_bucket_size": 0,
    "stage3_prefetch_bucket_size": 0,
    "param_persistence_threshold": 0,
    "stage3_param_persistence_threshold": 0,
    "model_persistence_threshold": 0,
    "stage3_model_persistence_threshold": 0,
    "max_live_parameters": 0,
    "stage3_max_live_parameters": 0,
    "max_reuse_distance": 0,
    "stage3_max_reuse_distance": 0,
    "module_granularity_threshold": None,
    "stage3_module_granularity_threshold": None,
    "zero_hpz_partition_size": 0,
}

#: deepspeed/runtime/zero/offload_config.py ``DeepSpeedZeroOffloadParamConfig``.
OFFLOAD_PARAM_KEYS = frozenset({"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"})
OFFLOAD_PARAM_INT_FIELDS = {"buffer_count": 0, "buffer_size": 0, "max_in_cpu": 0}

#: deepspeed/runtime/zero/offload_config.py ``DeepSpeedZeroOffloadOptimizerConfig``.
OFFLOAD_OPTIMIZER_KEYS = frozenset(
    {
        "device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
        "fast_init", "ratio", "super_offload", "cpuadam_cores_perc",
    }
)
OFFLOAD_OPTIMIZER_INT_FIELDS = {"buffer_count": 0}

#: deepspeed/runtime/zero/offload_config.py ``OffloadDeviceEnum``.
OFFLOAD_DEVICES = ("none", "cpu", "nvme")

#: deepspeed/runtime/precision_config.py ``DeepSpeedFP16Config``.
FP16_KEYS = frozenset(
    {
        "enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
        "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads",
    }
)
FP16_INT_FIELDS = {"initial_scale_power": None, "loss_scale_window": None, "hysteresis": None, "min_loss_scale": None}

#: deepspeed/runtime/precision_config.py ``DeepSpeedBF16Config``.
BF16_KEYS = frozenset(
    {"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads", "bf16_optimizer_states"}
)

#: deepspeed/runtime/activation_checkpointing/config.py ``ACT_CHKPT_DEFAULT`` keys.
ACTIVATION_CHECKPOINTING_KEYS = frozenset(
    {
        "partition_activations", "number_checkpoints", "contiguous_memory_optimization",
        "synchronize_checkpoint_boundary", "profile", "cpu_checkpointing",
    }
)

#: deepspeed/runtime/constants.py: OPTIMIZER block keys (TYPE, OPTIMIZER_PARAMS, LEGACY_FUSION).
OPTIMIZER_BLOCK_KEYS = frozenset({"type", "params", "legacy_fusion"})
#: deepspeed/runtime/constants.py: SCHEDULER block keys.
SCHEDULER_BLOCK_KEYS = frozenset({"type", "params"})

#: Batch keys DeepSpeed multiplies and compares (runtime/config.py ``_batch_assertion``).
BATCH_INT_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

#: deepspeed/runtime/config.py ``DEEPSPEED_OPTIMIZERS`` (lower-cased names DeepSpeed builds itself).
DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")

#: Optimizer types that run as a DeepSpeed CPU kernel when ``offload_optimizer`` is on
#: (runtime/engine.py ``_configure_basic_optimizer``: DeepSpeedCPUAdam for adam/adamw unless
#: ``torch_adam``, DeepSpeedCPUAdagrad for adagrad, DeepSpeedCPULion for lion).
CPU_OFFLOAD_OPTIMIZERS = ("adam", "adamw", "adagrad", "lion")

#: Any other type is looked up as ``getattr(torch.optim, type)`` (case-sensitive) by
#: ``_configure_basic_optimizer``. torch 2.13's optimizer classes:
TORCH_OPTIMIZERS = (
    "ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "LBFGS", "Muon",
    "NAdam", "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam",
)

#: Optimizers ZeRO accepts without ``zero_allow_untested_optimizer`` (runtime/zero/utils.py
#: ``ZERO_SUPPORTED_OPTIMIZERS``: torch Adam/AdamW/Adagrad, FusedAdam, CPU Adam/Adagrad/Lion,
#: FusedLion), expressed as config ``type`` values (lower-cased).
ZERO_TESTED_OPTIMIZERS = ("adam", "adamw", "adagrad", "lion", "muon")

#: deepspeed/runtime/lr_schedules.py ``VALID_LR_SCHEDULES``.
SCHEDULERS = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")

#: DeepSpeedZeroConfig defaults for the bucket and threshold keys (deepspeed/runtime/zero/config.py:
#: ``pp_int(5e8)`` reduce and all-gather buckets, ``pp_int(5e7)`` stage-3 prefetch, ``pp_int(1e5)``
#: persistence threshold, ``pp_int(1e9)`` max live parameters and max reuse distance), taken from
#: the one table the estimator uses too (:data:`zeroplan.spec.DEEPSPEED_DEFAULT_KNOBS`).
ZERO_DEFAULTS = {key: DEEPSPEED_DEFAULT_KNOBS[key] for key in BUCKET_KEYS}

#: Each bucket key (:data:`zeroplan.spec.BUCKET_KEYS`) → the spellings DeepSpeedZeroConfig accepts
#: for it, the one ``zeroplan export`` writes first (deepspeed/runtime/zero/config.py: the
#: ``stage3_*`` names are pydantic aliases of ``prefetch_bucket_size``, ``param_persistence_threshold``,
#: ``max_live_parameters`` and ``max_reuse_distance``).
BUCKET_KEY_SPELLINGS = {
    key: (key, key.removeprefix("stage3_")) if key.startswith("stage3_") else (key,) for key in BUCKET_KEYS
}
