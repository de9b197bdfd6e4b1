"""The analytic estimator: memory, traffic and time per ZeRO plan. Stdlib only — no torch."""

from zeroplan.estimator.activations import (
    ActivationMemory,
    activation_memory,
    checkpointing_duplicate,
    layer_activation_bytes,
    selective_op_layer_bytes,
)
from zeroplan.estimator.choose import PlanChoice, best_plan
from zeroplan.estimator.comm import CommVolume, comm_volume
from zeroplan.estimator.host import HOST_PHASES, HostPhase, HostPhases, host_phases, pinned_bytes
from zeroplan.estimator.memory import EngineOverhead, HostMemory, ModelStates, engine_overhead, host_memory, model_states
from zeroplan.estimator.plans import (
    DEFAULT_MICRO_BATCHES,
    GpuMemory,
    PlanEstimate,
    enumerate_plans,
    estimate_all,
    estimate_plan,
)
from zeroplan.estimator.timing import StepTime, flops_per_token, step_time

__all__ = [
    "ActivationMemory",
    "CommVolume",
    "DEFAULT_MICRO_BATCHES",
    "EngineOverhead",
    "GpuMemory",
    "HOST_PHASES",
    "HostPhase",
    "HostPhases",
    "HostMemory",
    "ModelStates",
    "PlanChoice",
    "PlanEstimate",
    "StepTime",
    "activation_memory",
    "checkpointing_duplicate",
    "best_plan",
    "comm_volume",
    "engine_overhead",
    "enumerate_plans",
    "estimate_all",
    "estimate_plan",
    "flops_per_token",
    "host_memory",
    "host_phases",
    "layer_activation_bytes",
    "selective_op_layer_bytes",
    "model_states",
    "pinned_bytes",
    "step_time",
]
