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

#: Qwen/Qwen3-VL-30B-A3B-Instruct's config.json (huggingface.co, architecture fields; QwenLM/Qwen3-VL#2053's model).
QWEN3_VL_30B_A3B = {
    "model_type": "qwen3_vl_moe", "tie_word_embeddings": False,
    "text_config": {"model_type": "qwen3_vl_moe_text", "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128,
                    "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 262144, "mlp_only_layers": [],
                    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
                    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "vocab_size": 151936},
    "vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
                      "in_channels": 3, "intermediate_size": 4304, "model_type": "qwen3_vl_moe", "num_heads": 16,
                      "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2,
                      "temporal_patch_size": 2},
}
#: QwenLM/Qwen3-VL#2053: two 480×270 images per sample at max_pixels 50176 (min_pixels: the script's 784).
IMAGES = ((270, 480), (270, 480))
MAX_PIXELS, MIN_PIXELS = 50176, 784


def measure(vision_config: dict, grid: list[list[int]], *, checkpointing: bool) -> int:
    """Bytes of every non-parameter storage transformers' vision model keeps for backward (bf16,
    CPU, SDPA) over the images of ``grid`` (``image_grid_thw`` rows)."""
    import torch
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    config = Qwen3VLMoeVisionConfig(**{k: v for k, v in vision_config.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3VLMoeVisionModel(config).to(torch.bfloat16).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    grid_thw = torch.tensor(grid)
    patch_values = config.in_channels * config.temporal_patch_size * config.patch_size**2
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), patch_values, dtype=torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(pixels, grid_thw=grid_thw)
    return sum(saved.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

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
