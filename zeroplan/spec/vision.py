"""VisionTowerSpec: the vision encoder of a vision-language model, enough for its activations."""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.spec.errors import check_positive_int

__all__ = ["VisionTowerSpec"]


@dataclass(frozen=True)
class VisionTowerSpec:
    """A ViT-style vision tower with patch merging (Qwen3-VL's ``vision_config``): a patch
    embedding, ``depth`` blocks of full attention over an image's patches, a merger that folds
    ``spatial_merge_size²`` neighbouring patches into one decoder token, and one DeepStack merger
    per ``deepstack_visual_indexes`` entry (transformers' ``Qwen3VLMoeVisionModel``)."""

    hidden_size: int
    """Width h of the vision blocks (``vision_config.hidden_size``)."""
    intermediate_size: int
    """Inner width I of a block's MLP."""
    depth: int
    """Number of vision blocks."""
    num_heads: int
    """Attention heads per block."""
    patch_values: int
    """Values one patch feeds the patch embedding: in_channels · temporal_patch_size · patch_size²."""
    spatial_merge_size: int
    """m: an m×m square of patches becomes one decoder token."""
    out_hidden_size: int
    """Width of the merged tokens (the decoder's hidden size)."""
    deepstack_mergers: int = 0
    """DeepStack mergers (``len(deepstack_visual_indexes)``): each merges one block's output again."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "depth", "num_heads", "patch_values", "spatial_merge_size", "out_hidden_size"):
            check_positive_int(name, getattr(self, name), maximum=10**8)
        check_positive_int("deepstack_mergers", self.deepstack_mergers, minimum=0, maximum=10**4)
