"""Vision-language configs: the language model's ``text_config`` plus the vision tower's parameters.

A Qwen3-VL ``config.json`` nests the decoder under ``text_config`` and the vision encoder under
``vision_config``. The estimator models the decoder (its shape sets activations, buckets and
FLOPs); the vision tower and its mergers join the parameter count, so their model states (2Ψ +
2Ψ + KΨ) are counted. Their shape (:func:`qwen3_vl_vision_tower`) sets the tower's activations
for the patches a sample brings (``TrainingSpec.image_patches``, :mod:`zeroplan.estimator.vision`).
"""

from __future__ import annotations

from typing import Any

from zeroplan.spec import SpecError
from zeroplan.spec.vision import VisionTowerSpec

__all__ = ["VISION_LANGUAGE_MODEL_TYPES", "qwen3_vl_vision_params", "qwen3_vl_vision_tower", "split_vision_language"]

#: ``model_type`` of a vision-language config → the ``model_type`` its ``text_config`` counts as.
VISION_LANGUAGE_MODEL_TYPES: dict[str, str] = {"qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}


def _linear(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


def qwen3_vl_vision_params(vision: dict[str, Any], *, where: str = "vision_config") -> dict[str, int]:
    """Parameters of Qwen3-VL's vision tower and mergers, by part, from its ``vision_config``
    (transformers' ``Qwen3VLMoeVisionModel``, models/qwen3_vl_moe/modeling_qwen3_vl_moe.py; the
    dense Qwen3-VL's ``Qwen3VLVisionModel`` is the same). With h the vision width, I its MLP
    width, d its depth, p the patch size, t the temporal patch size, c the input channels, m² the
    spatial merge (m = ``spatial_merge_size``) and o = ``out_hidden_size`` (the decoder's width):

    * patch embedding: a Conv3d c → h over t×p×p, with bias: c·t·p²·h + h;
    * learned position embedding: ``num_position_embeddings`` × h;
    * each of the d blocks: two LayerNorms (4h), ``attn.qkv`` h → 3h and ``attn.proj`` h → h with
      biases, ``mlp.linear_fc1`` h → I and ``linear_fc2`` I → h with biases;
    * the merger (``Qwen3VLMoeVisionPatchMerger``): LayerNorm over h (2h), then m²h → m²h → o;
    * one DeepStack merger per ``deepstack_visual_indexes`` entry: the same with its LayerNorm over
      m²h (``use_postshuffle_norm=True``).

    Equal to ``sum(p.numel())`` of transformers' model on the meta device (tests/test_profiles.py):
    538,631,408 for Qwen3-VL-30B-A3B's published vision_config.
    """
    def get(key: str) -> int:
        value = vision.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(f'{where}: "{key}" is {value!r}; it must be a whole number >= 1')
        return value

    h, inner, depth = get("hidden_size"), get("intermediate_size"), get("depth")
    p, t, c = get("patch_size"), get("temporal_patch_size"), get("in_channels")
    m2, out = get("spatial_merge_size") ** 2, get("out_hidden_size")
    deepstack = vision.get("deepstack_visual_indexes") or []
    if not isinstance(deepstack, list):
        raise SpecError(f'{where}: "deepstack_visual_indexes" is {deepstack!r}; it must be a list of block indexes')
    block = 4 * h + _linear(h, 3 * h) + _linear(h, h) + _linear(h, inner) + _linear(inner, h)
    merged = _linear(m2 * h, m2 * h) + _linear(m2 * h, out)
    return {
        "patch_embed": c * t * p * p * h + h,
        "pos_embed": get("num_position_embeddings") * h,
        "blocks": depth * block,
        "merger": 2 * h + merged,
        "deepstack_mergers": len(deepstack) * (2 * m2 * h + merged),
    }


def split_vision_language(data: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, int]] | None:
    """``(text config, vision parameters by part)`` for a vision-language config, else None.

    The text config takes the decoder's ``model_type`` (:data:`VISION_LANGUAGE_MODEL_TYPES`) and
    the top level's ``tie_word_embeddings`` (Qwen3-VL keeps it there: the output projection
    belongs to the whole model)."""
    text_type = VISION_LANGUAGE_MODEL_TYPES.get(data.get("model_type"))
    if text_type is None:
        return None
    text, vision = data.get("text_config"), data.get("vision_config")
    if not isinstance(text, dict) or not isinstance(vision, dict):
        raise SpecError(f'{where}: model_type {data["model_type"]!r} needs "text_config" and "vision_config" objects')
    text = {**text, "model_type": text_type}
    if "tie_word_embeddings" in data:
        text["tie_word_embeddings"] = data["tie_word_embeddings"]
    return text, qwen3_vl_vision_params(vision, where=f"{where}: vision_config")


def qwen3_vl_vision_tower(vision: dict[str, Any], *, where: str = "vision_config") -> VisionTowerSpec:
    """The vision tower's shape from a Qwen3-VL ``vision_config`` (the fields
    :func:`qwen3_vl_vision_params` reads), for its activations."""
    qwen3_vl_vision_params(vision, where=where)  # the same checks, one line each
    try:
        return VisionTowerSpec(
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            depth=vision["depth"],
            num_heads=vision.get("num_heads", 16),  # Qwen3VLMoeVisionConfig's default
            patch_values=vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2,
            spatial_merge_size=vision["spatial_merge_size"],
            out_hidden_size=vision["out_hidden_size"],
            deepstack_mergers=len(vision.get("deepstack_visual_indexes") or []),
        )
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None
