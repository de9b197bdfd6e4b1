"""Presets and machine facts, as specs: GPU profiles (:mod:`~zeroplan.profiles.gpu_presets`), this
machine's GPU (:mod:`~zeroplan.profiles.detect`), model presets
(:mod:`~zeroplan.profiles.model_presets`), node profiles and host RAM (:mod:`~zeroplan.profiles.node`,
:mod:`~zeroplan.profiles.host`), Hugging Face config.json (:mod:`~zeroplan.profiles.hf_config`),
TOML reading and writing (:mod:`~zeroplan.profiles.tomlio`), and the model and cluster the
command-line options describe (:mod:`~zeroplan.profiles.resolve`).

Standard library only (``tomllib``, ``json``): ``zeroplan estimate`` imports this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeroplan.spec.lazy import lazy_exports

#: Each name this package exports and the module that defines it. The modules load when a name is
#: first read (PEP 562), so importing one of them (``zeroplan estimate`` imports ``resolve`` and
#: ``lora``) does not load the rest: the Hugging Face config readers and the model and node
#: presets only load for the commands that read them.
_EXPORTS = {
    "default_gpu": "detect", "detect_gpu": "detect", "gpu_is_here": "detect", "local_gpu_count": "detect",
    "DEFAULT_GPU": "gpu_presets", "GPU_DIR": "gpu_presets", "gpu_for_device_name": "gpu_presets", "gpu_from_toml": "gpu_presets",
    "gpu_names": "gpu_presets", "gpu_toml_text": "gpu_presets", "load_gpu": "gpu_presets", "write_gpu_toml": "gpu_presets",
    "SUPPORTED_MODEL_TYPES": "hf_config", "count_hf_params": "hf_config", "model_from_hf_config": "hf_config",
    "MODEL_DIR": "model_presets", "load_model_preset": "model_presets", "model_names": "model_presets",
    "model_preset_info": "model_presets",
    "default_node": "node", "load_node": "node", "node_from_toml": "node", "node_names": "node",
    "resolve_cluster": "resolve", "resolve_model": "resolve",
}

if TYPE_CHECKING:
    from zeroplan.profiles.detect import default_gpu, detect_gpu, gpu_is_here, local_gpu_count
    from zeroplan.profiles.gpu_presets import (
        DEFAULT_GPU, GPU_DIR, gpu_for_device_name, gpu_from_toml, gpu_names, gpu_toml_text, load_gpu, write_gpu_toml,
    )
    from zeroplan.profiles.hf_config import SUPPORTED_MODEL_TYPES, count_hf_params, model_from_hf_config
    from zeroplan.profiles.model_presets import MODEL_DIR, load_model_preset, model_names, model_preset_info
    from zeroplan.profiles.node import default_node, load_node, node_from_toml, node_names
    from zeroplan.profiles.resolve import resolve_cluster, resolve_model


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


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
