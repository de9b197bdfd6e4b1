"""Whether attention saves its a·s² probabilities, from the model's attention path and the device
(``ModelSpec.attention_kernel``). The activation formula's ``flash_attention`` switch
(:func:`zeroplan.estimator.activations.layer_activation_bytes`) is the training's wish; a model
whose attention cannot run a fused kernel on the device saves the probabilities anyway.

* ``sdpa``: transformers calls ``scaled_dot_product_attention``; its flash kernels (CUDA, and
  ``_scaled_dot_product_flash_attention_for_cpu``) keep the output and log-sum-exp only.
* ``sdpa-v-dim``: Q·K and V head dims differ (DeepSeek-V2/V3 MLA: 192 vs 128). CUDA's
  memory-efficient backend accepts that; the CPU flash kernel does not and SDPA runs the math
  path, whose ``softmax`` output (e·a·s²·b) is saved for backward — measured with saved-tensor
  hooks on examples/deepseek_v3_tiny.json: one (4, 4, 256, 256) fp32 tensor per layer.
* ``eager``: the model has no SDPA path (gpt-oss, modeling_gpt_oss.py ``_supports_sdpa = False``):
  ``eager_attention_forward`` saves the softmax over s + 1 columns (the sink) on every device —
  measured: one (4, 4, 256, 257) fp32 tensor per layer of examples/gpt_oss_tiny.json.
"""

from __future__ import annotations

import dataclasses

from zeroplan.spec import ModelSpec, TrainingSpec

__all__ = ["fused_attention", "with_attention_kernel"]


def fused_attention(model: ModelSpec, training: TrainingSpec, device: str) -> bool:
    """Whether the attention of ``model`` keeps no a·s² tensor on ``device`` (``cuda`` or ``cpu``)."""
    if not training.flash_attention or model.attention_kernel == "eager":
        return False
    return not (model.attention_kernel == "sdpa-v-dim" and device == "cpu")


def with_attention_kernel(model: ModelSpec, training: TrainingSpec, device: str) -> TrainingSpec:
    """``training`` with ``flash_attention`` as the model's attention runs it on ``device``."""
    fused = fused_attention(model, training, device)
    return training if fused == training.flash_attention else dataclasses.replace(training, flash_attention=fused)
