"""Model presets: ``models/<name>.toml`` shipped with the package — the
:class:`~zeroplan.spec.ModelSpec` fields, ``source`` (paper or model card), optional ``notes`` and
an ``[hf_config]`` table from which ``params`` is counted exactly (see
:mod:`zeroplan.profiles.hf_config`). Standard library only."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from zeroplan.profiles.hf_config import MOE_MODEL_TYPES, QK_NORM_MODEL_TYPES, model_from_hf_dict
from zeroplan.profiles.tomlio import check_keys, closest, normalize, read_toml
from zeroplan.spec import ModelSpec, SpecError

__all__ = ["MODEL_DIR", "model_names", "model_preset_info", "load_model_preset"]

MODEL_DIR = Path(__file__).resolve().parent / "models"

_MODEL_FIELDS = (
    "name",
    "params",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "ffn_size",
    "vocab_size",
    "tied_embeddings",
    "gated_mlp",
    "largest_layer_params",
)

_MODEL_EXTRA = ("display_name", "source", "notes", "hf_config")


@lru_cache(maxsize=None)
def _model_presets() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(MODEL_DIR.glob("*.toml")):
        data = read_toml(path, "model preset")
        check_keys(data, _MODEL_FIELDS + _MODEL_EXTRA, _MODEL_FIELDS[:8], str(path))
        out[data["name"]] = data
    return out


def model_names() -> list[str]:
    """Names of the shipped model presets, sorted."""
    return sorted(_model_presets())


def model_preset_info(name: str) -> dict[str, Any]:
    """The raw preset table (ModelSpec fields, ``display_name``, ``source``, ``notes``, ``hf_config``)."""
    presets = _model_presets()
    key = normalize(name)
    if key not in presets:
        names = model_names()
        raise SpecError(
            f"unknown model preset {name!r}{closest(name, names)}; valid: {', '.join(names)} "
            f"(or a path to a Hugging Face config.json, or --params)"
        )
    return presets[key]


def load_model_preset(name: str) -> ModelSpec:
    """A ModelSpec for a shipped preset (case-insensitive name)."""
    data = model_preset_info(name)
    kwargs = {k: data[k] for k in _MODEL_FIELDS if k in data}
    from_config: dict = {}
    if data.get("hf_config", {}).get("model_type") in MOE_MODEL_TYPES + QK_NORM_MODEL_TYPES:
        # The experts (counts, widths, storage), Q/K norms and the attention path (gpt-oss's
        # eager attention, DeepSeek's latent attention) come from the embedded config.json.
        counted = model_from_hf_dict(data["hf_config"], name=data["name"])
        from_config = {k: getattr(counted, k) for k in ("moe", "qk_norm", "attention_kernel", "mla")}
    return ModelSpec(**kwargs, source="preset", notes=tuple(data.get("notes", ())), **from_config)
