"""Qwen3-VL's vision tower on CPU: what it keeps for backward vs zeroplan.estimator.vision.

    PYTHONPATH=. python benchmarks/vision_activations.py [-o benchmarks/results/vision_activations.txt]

Builds transformers' ``Qwen3VLMoeVisionModel`` at full size from Qwen/Qwen3-VL-30B-A3B-Instruct's
published ``vision_config`` (random bf16 weights, SDPA), feeds it the images of QwenLM/Qwen3-VL#2053
(two 480×270 images, resized by the Qwen-VL processor's ``smart_resize`` at ``max_pixels`` 50176)
and counts, with saved-tensor hooks, every storage the forward keeps for backward other than the
parameters — with and without gradient checkpointing — against
:func:`zeroplan.estimator.vision.vision_tower_activation_bytes` (CPU keeps LayerNorm statistics in
the input dtype: ``norm_stat_bytes=2``). Arithmetic on shapes: the figures do not depend on load.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

#: QwenLM/Qwen3-VL#2053: two 480×270 images per sample at max_pixels 50176 (min_pixels: the script's 784).
IMAGES = ((270, 480), (270, 480))
MAX_PIXELS, MIN_PIXELS = 50176, 784


def measure(vision_config: dict, grid: list[list[int]], *, checkpointing: bool) -> int:
    """Bytes of the non-parameter storages transformers' vision model saves for backward."""
    from test_vision_activations import _saved_bytes

    return _saved_bytes(vision_config, grid, checkpointing=checkpointing)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from test_profiles import QWEN3_VL_30B_A3B
    from zeroplan.estimator.vision import vision_tower_activation_bytes
    from zeroplan.profiles.hf_config import model_from_hf_dict

    vision_config = QWEN3_VL_30B_A3B["vision_config"]
    patch = vision_config["patch_size"]
    factor = patch * vision_config["spatial_merge_size"]
    grid = []
    for height, width in IMAGES:
        h, w = smart_resize(height, width, factor=factor, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
        grid.append([1, h // patch, w // patch])
    patches = sum(t * h * w for t, h, w in grid)
    tower = model_from_hf_dict(QWEN3_VL_30B_A3B, name="qwen3-vl-30b-a3b").vision
    lines = [f"Qwen3-VL-30B-A3B vision tower, images {IMAGES} at max_pixels {MAX_PIXELS}: grids {grid}, {patches} patches"]
    for checkpointing in (True, False):
        start = time.perf_counter()
        measured = measure(vision_config, grid, checkpointing=checkpointing)
        parts = vision_tower_activation_bytes(tower, patches=patches, checkpointing=checkpointing, value_bytes=2, norm_stat_bytes=2)
        rebuild = parts.pop("rebuild")
        predicted = sum(parts.values())
        lines.append(f"checkpointing {'on ' if checkpointing else 'off'}: measured {measured:,} B, predicted {predicted:,} B "
                     f"({(predicted - measured) / measured:+.2%}); parts {parts}; one block rebuilt in the tower's backward "
                     f"{rebuild:,} B ({time.perf_counter() - start:.0f} s)")
    report = "\n".join(lines)
    print(report)
    if args.output:
        args.output.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
