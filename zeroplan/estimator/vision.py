"""A vision-language model's vision tower: the activations its images keep for backward.

Pure arithmetic (stdlib only). Source: transformers' ``Qwen3VLMoeVisionModel``
(models/qwen3_vl_moe/modeling_qwen3_vl_moe.py; the dense Qwen3-VL's ``Qwen3VLVisionModel`` is the
same). For the P patches of a micro-batch's images (``image_grid_thw`` t·h·w summed; the Qwen-VL
processor's ``smart_resize`` sets h and w from ``max_pixels``), with width h, MLP width I, depth d,
m² patches per merged token, D DeepStack mergers, e bytes per activation value:

* ``patch_embed``: the Conv3d saves its input, the pixel values cast to the weights' dtype:
  P·(c·t·p²)·e.
* ``position_embedding``: the learned 2-D position table is resampled bilinearly
  (``get_vision_interpolation_indices_and_weights``: 4 int64 indices and 4 fp32 weights per patch);
  the lookup saves the indices, the weighting multiply the fp32 weights: P·4·8 + P·4·4.
* ``blocks``: each ``Qwen3VLMoeVisionBlock`` (full attention over one image's patches, then a GELU
  MLP) is a ``GradientCheckpointingLayer``: under checkpointing it keeps its input, d·P·h·e;
  without, everything its backward needs (:func:`vision_block_saved_bytes`) in each of d blocks,
  plus the shared RoPE tables.
* ``mergers``: the merger and the D DeepStack mergers (``Qwen3VLMoeVisionPatchMerger``: LayerNorm,
  Linear m²h → m²h, GELU, Linear m²h → o) are not checkpointed. The merger's LayerNorm keeps the
  last block's output (P·h·e; the DeepStack mergers read block outputs the next block already
  keeps); each merger then keeps its LayerNorm's output, its first Linear's output (GELU's input)
  and GELU's output, each P/m² × m²h = P·h values: (1 + D)·3·P·h·e; plus each LayerNorm's mean and
  rstd (the merger's over P rows, a DeepStack merger's over P/m² rows).

Measured on CPU with transformers' own model (Qwen3-VL-30B-A3B's published vision_config, random
bf16 weights, two 480×270 images at ``max_pixels`` 50176: 2 × 10×18 = 360 patches), saved-tensor
hooks counting every storage kept for backward other than the parameters: 34,303,320 bytes with
gradient checkpointing and 426,498,840 without — both equal to this module's sum
(tests/test_vision_activations.py repeats it on a small config). The merged tokens and DeepStack
features the decoder receives are not kept by it (``masked_scatter``'s backward needs only the mask).

Under checkpointing the one block rebuilt at a time runs in the vision tower's backward, which
comes after the decoder's (the tower is the first module of the forward): its
:func:`vision_block_saved_bytes` is reported as ``rebuild`` but is not alive at the decoder's
moments. Without checkpointing the blocks also keep the RoPE cos/sin tables (2·P·(h/heads) fp32
values, one pair for all blocks); under checkpointing the blocks keep only their inputs.
"""

from __future__ import annotations

from zeroplan.spec.vision import VisionTowerSpec

__all__ = ["vision_block_saved_bytes", "vision_tower_activation_bytes", "VISION_PARTS"]

#: The parts :func:`vision_tower_activation_bytes` returns, in order.
VISION_PARTS = ("patch_embed", "position_embedding", "blocks", "mergers", "rebuild")


def vision_block_saved_bytes(vision: VisionTowerSpec, *, patches: int, value_bytes: int, norm_stat_bytes: int = 4) -> int:
    """Bytes one vision block saves for backward over ``patches`` patches (no recomputation).

    From ``Qwen3VLMoeVisionBlock.forward`` and its attention: ``norm1``'s input and output (the
    latter is ``qkv``'s input), the ``qkv`` output (the value view keeps all 3h of it), the rotated
    query and key (``apply_rotary_pos_emb_vision`` casts back to the activation dtype), the
    attention's output and its fp32 log-sum-exp per head and patch, the concatenated output (the
    per-image attention outputs are joined with ``torch.cat``; ``proj``'s input), ``norm2``'s input
    and output (``linear_fc1``'s input), and GELU's input and output (``linear_fc1``'s output and
    ``linear_fc2``'s input, I wide): 11·P·h·e + 2·P·I·e + heads·P·4, plus the two LayerNorms'
    mean and rstd (``norm_stat_bytes`` each per patch: fp32 on CUDA, ATen's layer_norm_kernel.cu
    allocates them in the accumulation type; the input dtype on CPU).

    Measured with transformers' SDPA path on CPU (per-image ``scaled_dot_product_attention``
    over ``cu_seqlens`` chunks); flash_attention_2's varlen path is not measured here.
    """
    p, h = patches, vision.hidden_size
    return (11 * p * h + 2 * p * vision.intermediate_size) * value_bytes + vision.num_heads * p * 4 + 4 * p * norm_stat_bytes


def vision_tower_activation_bytes(
    vision: VisionTowerSpec,
    *,
    patches: int,
    checkpointing: bool,
    value_bytes: int,
    norm_stat_bytes: int = 4,
) -> dict[str, int]:
    """Activation bytes the vision tower keeps for backward, by part (:data:`VISION_PARTS`), for
    ``patches`` patches (all the micro-batch's images). ``blocks`` is d·P·h·e under checkpointing
    (``checkpointing=True``: the blocks are ``GradientCheckpointingLayer`` s, so any
    recomputation of the model recomputes them) and d × :func:`vision_block_saved_bytes` without;
    ``rebuild`` (one block rebuilt in the tower's own backward, after the decoder's) is only
    non-zero under checkpointing and is not part of what is alive while the decoder runs
    (module docstring). 0 everywhere for 0 patches.
    """
    if patches <= 0:
        return dict.fromkeys(VISION_PARTS, 0)
    p, h, e = patches, vision.hidden_size, value_bytes
    block = vision_block_saved_bytes(vision, patches=p, value_bytes=e, norm_stat_bytes=norm_stat_bytes)
    merged_rows = p // vision.spatial_merge_size**2
    mergers = (
        p * h * e  # the last block's output, the merger LayerNorm's input
        + (1 + vision.deepstack_mergers) * 3 * p * h * e  # LayerNorm out, Linear out (GELU in), GELU out
        + 2 * p * norm_stat_bytes  # the merger's LayerNorm over h: mean and rstd per patch
        + vision.deepstack_mergers * 2 * merged_rows * norm_stat_bytes  # DeepStack LayerNorms over m²h
    )
    return {
        "patch_embed": p * vision.patch_values * e,
        "position_embedding": p * 4 * 8 + p * 4 * 4,
        # Without recomputation the rotary multiplies also keep the fp32 cos and sin tables, one
        # pair shared by every block (``Qwen3VLMoeVisionRotaryEmbedding``, head_dim wide).
        "blocks": vision.depth * p * h * e if checkpointing else vision.depth * block + 2 * p * (h // vision.num_heads) * 4,
        "mergers": mergers,
        "rebuild": block if checkpointing else 0,
    }
