"""The vision tower's activations (zeroplan.estimator.vision) against transformers' own Qwen3-VL
vision model: every storage its forward keeps for backward, counted with saved-tensor hooks on CPU."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from helpers import BENCHMARKS, QWEN3_VL_30B_A3B, benchmark
from zeroplan.estimator.activations import activation_memory
from zeroplan.estimator.vision import vision_tower_activation_bytes
from zeroplan.profiles.hf_config import model_from_hf_dict
from zeroplan.spec import Plan, TrainingSpec

#: A small vision_config of the same structure (deepstack on two blocks, one of them the last).
SMALL_VISION = {**QWEN3_VL_30B_A3B["vision_config"], "depth": 3, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4,
                "out_hidden_size": 32, "patch_size": 4, "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 2]}


def _saved_bytes(vision_config: dict, grid: list[list[int]], *, checkpointing: bool) -> int:
    """What transformers' vision model keeps for backward (benchmarks/vision_activations.py ``measure``)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return benchmark("vision_activations").measure(vision_config, grid, checkpointing=checkpointing)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_vision_tower_saved_bytes_equal_transformers(checkpointing):
    """Two images of different grids (4×6 and 2×4 patches: 32 in all), with and without
    checkpointing: the sum equals what transformers' model keeps, byte for byte (CPU keeps the
    LayerNorms' mean/rstd in the input dtype: norm_stat_bytes 2)."""
    grid = [[1, 4, 6], [1, 2, 4]]
    tower = model_from_hf_dict({**QWEN3_VL_30B_A3B, "vision_config": SMALL_VISION}, name="small").vision
    predicted = vision_tower_activation_bytes(tower, patches=32, checkpointing=checkpointing, value_bytes=2, norm_stat_bytes=2)
    rebuild = predicted.pop("rebuild")
    assert (rebuild > 0) == checkpointing
    assert sum(predicted.values()) == _saved_bytes(SMALL_VISION, grid, checkpointing=checkpointing)


def test_qwen3_vl_issue_images_are_360_patches():
    """QwenLM/Qwen3-VL#2053: two 480×270 images at max_pixels 50176. The Qwen-VL processor's own
    smart_resize (factor = patch 16 × merge 2) makes each 160×288, 10×18 patches: 360 per sample,
    the public rows' image_patches."""
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    h, w = smart_resize(270, 480, factor=32, min_pixels=784, max_pixels=50176)
    assert (h, w) == (160, 288)
    rows = json.loads((BENCHMARKS / "public_runs.json").read_text())["rows"]
    patches = {r["id"]: r.get("image_patches") for r in rows if r["id"].startswith("qwen3vl-2053")}
    assert patches and set(patches.values()) == {2 * (h // 16) * (w // 16)}


def test_published_tower_and_what_it_adds_to_a_plan():
    """Qwen3-VL-30B-A3B's tower read from its config; with 360 patches under full checkpointing
    the plan's activations grow by exactly the tower's saved tensors (34.3 MB on CPU, measured with
    the full-size model while writing this module), and a text-only model or no images adds nothing."""
    spec = model_from_hf_dict(QWEN3_VL_30B_A3B, name="qwen3-vl-30b-a3b")
    v = spec.vision
    assert (v.hidden_size, v.intermediate_size, v.depth, v.num_heads, v.patch_values, v.deepstack_mergers) == (1152, 4304, 27, 16, 1536, 3)
    on_cpu = vision_tower_activation_bytes(v, patches=360, checkpointing=True, value_bytes=2, norm_stat_bytes=2)
    assert sum(on_cpu.values()) - on_cpu["rebuild"] == 34_303_320
    plan = Plan(stage=2, micro_batch=1, checkpointing="full")
    training = TrainingSpec(seq_len=8192, micro_batch=1)
    without = activation_memory(spec, training, plan)
    with_images = activation_memory(spec, replace(training, image_patches=360), plan)
    parts = vision_tower_activation_bytes(v, patches=360, checkpointing=True, value_bytes=2)
    added = sum(parts.values()) - parts["rebuild"]
    assert with_images.embeddings - without.embeddings == with_images.vision_tower == added
    assert replace(with_images, embeddings=without.embeddings, vision_tower=0) == without
    text_only = model_from_hf_dict({**QWEN3_VL_30B_A3B["text_config"], "model_type": "qwen3_moe"}, name="text")
    assert text_only.vision is None
    assert activation_memory(text_only, replace(training, image_patches=360), plan).vision_tower == 0


def test_benchmark_config_is_the_published_one():
    """The benchmark measures the same published config the tests count parameters against."""
    assert benchmark("vision_activations").QWEN3_VL_30B_A3B == QWEN3_VL_30B_A3B


def test_bad_image_patches_is_one_line():
    """A negative or fractional patch count fails where the spec is built, naming the field."""
    from zeroplan.spec import SpecError

    for bad in (-1, 2.5, True):
        with pytest.raises(SpecError, match="image_patches"):
            TrainingSpec(image_patches=bad)
    assert TrainingSpec().as_dict()["image_patches"] == 0
