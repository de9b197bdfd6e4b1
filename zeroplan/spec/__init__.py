"""Frozen, validated descriptions of a model, a cluster, a training setup and a plan."""

from zeroplan.spec.cluster import GB, ClusterSpec, GiB, GpuSpec
from zeroplan.spec.engines import ENGINES, RUNNABLE_ENGINES, EngineFacts, engine_facts
from zeroplan.spec.errors import SpecError
from zeroplan.spec.model import MAX_PARAMS, ModelSpec, derive_shape_from_params, format_params
from zeroplan.spec.plan import BUCKET_KEYS, CHECKPOINTING, CHECKPOINTING_ALIASES, DEEPSPEED_DEFAULT_KNOBS, OFFLOADS, STAGES, Plan, divisors, resolve_engine_knobs
from zeroplan.spec.training import (
    LOSSES,
    OPTIMIZERS,
    PRECISIONS,
    PURE_PRECISION_ENGINES,
    TORCH_ENGINES,
    TrainingSpec,
    bytes_per_param,
    compute_precision,
    master_bytes_per_param,
    optimizer_state_bytes_per_param,
)
from typing import TYPE_CHECKING

from zeroplan.spec.lazy import lazy_exports

#: Names of the specs a dense model's plain estimate does not use, and their modules: loaded when
#: first read (PEP 562), as ``from zeroplan.spec import MoeSpec`` does.
_LAZY = {
    "MoeSpec": "moe", "MAX_NODE_MEMORY_BYTES": "node", "NodeSpec": "node",
    "BASE_QUANTS": "peft", "PEFT_METHODS": "peft", "AdaptedModule": "peft", "PeftSpec": "peft",
}

if TYPE_CHECKING:
    from zeroplan.spec.moe import MoeSpec
    from zeroplan.spec.node import MAX_NODE_MEMORY_BYTES, NodeSpec
    from zeroplan.spec.peft import BASE_QUANTS, PEFT_METHODS, AdaptedModule, PeftSpec


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "AdaptedModule",
    "BASE_QUANTS",
    "PEFT_METHODS",
    "PeftSpec",
    "BUCKET_KEYS",
    "CHECKPOINTING",
    "CHECKPOINTING_ALIASES",
    "ClusterSpec",
    "DEEPSPEED_DEFAULT_KNOBS",
    "ENGINES",
    "EngineFacts",
    "RUNNABLE_ENGINES",
    "GB",
    "GiB",
    "GpuSpec",
    "MAX_NODE_MEMORY_BYTES",
    "MAX_PARAMS",
    "ModelSpec",
    "MoeSpec",
    "NodeSpec",
    "OFFLOADS",
    "LOSSES",
    "OPTIMIZERS",
    "PRECISIONS",
    "PURE_PRECISION_ENGINES",
    "TORCH_ENGINES",
    "Plan",
    "STAGES",
    "SpecError",
    "TrainingSpec",
    "bytes_per_param",
    "compute_precision",
    "derive_shape_from_params",
    "divisors",
    "engine_facts",
    "format_params",
    "master_bytes_per_param",
    "optimizer_state_bytes_per_param",
    "resolve_engine_knobs",
]
