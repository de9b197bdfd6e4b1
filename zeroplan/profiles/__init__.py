"""Presets and machine facts, as specs: GPU profiles (:mod:`~zeroplan.profiles.gpu_presets`), this
machine's GPU (:mod:`~zeroplan.profiles.detect`), model presets
(:mod:`~zeroplan.profiles.model_presets`), node profiles and host RAM (:mod:`~zeroplan.profiles.node`,
:mod:`~zeroplan.profiles.host`), Hugging Face config.json (:mod:`~zeroplan.profiles.hf_config`),
TOML reading and writing (:mod:`~zeroplan.profiles.tomlio`), and the model and cluster the
command-line options describe (:mod:`~zeroplan.profiles.resolve`).

Standard library only (``tomllib``, ``json``): ``zeroplan estimate`` imports this package.
"""

from __future__ import annotations

from zeroplan.profiles.detect import default_gpu, detect_gpu, gpu_is_here, local_gpu_count
from zeroplan.profiles.gpu_presets import (
    DEFAULT_GPU,
    GPU_DIR,
    gpu_for_device_name,
    gpu_from_toml,
    gpu_names,
    gpu_toml_text,
    load_gpu,
    write_gpu_toml,
)
from zeroplan.profiles.hf_config import SUPPORTED_MODEL_TYPES, count_hf_params, model_from_hf_config
from zeroplan.profiles.model_presets import MODEL_DIR, load_model_preset, model_names, model_preset_info
from zeroplan.profiles.node import default_node, load_node, node_from_toml, node_names
from zeroplan.profiles.resolve import resolve_cluster, resolve_model

__all__ = [
    "DEFAULT_GPU",
    "GPU_DIR",
    "MODEL_DIR",
    "SUPPORTED_MODEL_TYPES",
    "count_hf_params",
    "default_gpu",
    "default_node",
    "detect_gpu",
    "local_gpu_count",
    "gpu_is_here",
    "gpu_for_device_name",
    "gpu_from_toml",
    "gpu_names",
    "gpu_toml_text",
    "load_gpu",
    "load_model_preset",
    "model_from_hf_config",
    "model_names",
    "model_preset_info",
    "node_names",
    "load_node",
    "node_from_toml",
    "resolve_cluster",
    "resolve_model",
    "write_gpu_toml",
]
