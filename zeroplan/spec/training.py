"""TrainingSpec: precision, optimizer and batch shape of a run."""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.spec.engines import PURE_PRECISION_ENGINES, TORCH_ENGINES  # noqa: F401  (re-exported: their home is spec.engines)
from zeroplan.spec.errors import SpecError, check_choice, check_positive_int

__all__ = [
    "LOSSES",
    "PRECISIONS",
    "PURE_PRECISION_ENGINES",
    "TORCH_ENGINES",
    "OPTIMIZERS",
    "TrainingSpec",
    "bytes_per_param",
    "compute_precision",
    "master_bytes_per_param",
    "optimizer_state_bytes_per_param",
]

#: bf16 and fp16: mixed precision (16-bit compute, fp32 master weights, gradients reduced and
#: optimizer states in fp32); fp32; bf16-pure: weights, gradients and optimizer states all in
#: bf16, no fp32 master (a model cast with ``.to(torch.bfloat16)`` and torch's AdamW, as
#: torchtune's ``dtype: bf16`` trains).
PRECISIONS = ("bf16", "fp16", "fp32", "bf16-pure")
#: Loss implementations over the logits (zeroplan.estimator.activations.loss_activation_bytes):
#: hf (a Hugging Face model's loss, logits returned), plain (log-softmax + NLL in fp32, logits
#: dropped), megatron (vocab-parallel cross-entropy, in place), fused (Liger's fused linear
#: cross-entropy), chunked (cross-entropy over logit chunks, torchtune's default of 8, eager),
#: chunked-compiled (the same with torchtune's ``compile=True``, which compiles each chunk's
#: upcast and cross-entropy), tiled (ALST's tiled loss) and trl (TRL 1.x's fused LM head, ``add_fused_lm_head``: log-probs over
#: vocabulary tiles, which SFT, DPO and GRPO trainers all use).
LOSSES = ("hf", "plain", "megatron", "fused", "chunked", "chunked-compiled", "tiled", "trl")
OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "lion")


def bytes_per_param(precision: str) -> int:
    """Bytes of one parameter (and one gradient) in the training precision: 2 for bf16/fp16/bf16-pure, 4 for fp32.

    ZeRO paper (arXiv 1910.02054) §3.1: mixed precision keeps fp16 parameters and gradients (2Ψ + 2Ψ).
    """
    found = _BYTES_PER_PARAM.get(precision) if isinstance(precision, str) else None
    if found is not None:
        return found
    check_choice("precision", precision, PRECISIONS)
    return 4 if precision == "fp32" else 2


#: :func:`bytes_per_param` by precision (a lookup: the estimator asks several times per plan).
_BYTES_PER_PARAM = {"bf16": 2, "fp16": 2, "bf16-pure": 2, "fp32": 4}


def compute_precision(precision: str) -> str:
    """The dtype the matmuls run in (the key of ``GpuSpec.peak_flops``): bf16-pure computes in bf16."""
    check_choice("precision", precision, PRECISIONS)
    return "bf16" if precision == "bf16-pure" else precision


def master_bytes_per_param(precision: str) -> int:
    """Bytes of the parameter the optimizer updates (and of a gradient reduced for it): the fp32
    master in mixed precision and fp32 (4), the bf16 parameter itself in bf16-pure (2)."""
    check_choice("precision", precision, PRECISIONS)
    return 2 if precision == "bf16-pure" else 4


def optimizer_state_bytes_per_param(optimizer: str, precision: str) -> int:
    """K in the ZeRO paper's KΨ: optimizer-state bytes per parameter.

    ZeRO paper §3.1: mixed-precision Adam keeps an fp32 master copy, momentum and variance:
    K = 4 + 4 + 4 = 12. Other optimizers (same accounting, fp32 states):

    * SGD with momentum: master 4 + momentum 4 = 8 (Lion: master 4 + momentum 4 = 8; Chen et al.
      2023, arXiv 2302.06675, keeps one moment).
    * Adafactor without momentum (Shazeer & Stern 2018, arXiv 1804.04235): master 4 + the factored
      second moment, O(rows + cols) per matrix, counted as 0 per parameter: K = 4.

    In pure fp32 training there is no separate master copy, so K drops by 4 (Adam: 8). In
    bf16-pure there is no master either, and torch.optim creates its states in the parameter's
    dtype (torch/optim/adamw.py ``_init_group``: ``exp_avg = torch.zeros_like(p,
    memory_format=torch.preserve_format)``): Adam's two moments take 2 + 2 = 4 bytes.
    """
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_choice("precision", precision, PRECISIONS)
    moments = {"adamw": 8, "adam": 8, "sgd": 4, "lion": 4, "adafactor": 0}[optimizer]
    if precision == "bf16-pure":
        return moments // 2
    master = 4 if precision in ("bf16", "fp16") else 0
    return master + moments


@dataclass(frozen=True)
class TrainingSpec:
    """What one optimizer step processes and in which precision.

    Give either ``global_batch`` (then accumulation is derived per plan and world size, exactly)
    or ``grad_accum`` (then the global batch follows), or neither (accumulation 1).
    """

    precision: str = "bf16"
    """Training precision: bf16, fp16 (both mixed precision with fp32 master), fp32, or bf16-pure
    (bf16 weights, gradients and optimizer states; engine fsdp only)."""
    optimizer: str = "adamw"
    """adamw, adam, sgd (with momentum), adafactor or lion."""
    seq_len: int = 2048
    """Tokens per sample."""
    micro_batch: int | None = None
    """Samples per GPU per forward/backward; None lets the estimator enumerate 1, 2, 4, ..."""
    global_batch: int | None = None
    """Samples per optimizer step across all GPUs (train_batch_size), or None."""
    grad_accum: int | None = None
    """Micro-steps per optimizer step, or None."""
    flash_attention: bool = True
    """Attention kernel that does not keep the a·s² score matrix (SDPA/flash)."""
    loss: str = "hf"
    """How the loss is computed over the logits (:data:`LOSSES`): hf, plain, megatron, fused, chunked, chunked-compiled, tiled or trl."""
    optimizer_in_backward: bool = False
    """Each parameter is stepped by its own optimizer in its gradient hook and its gradient freed
    there (torchtune's ``optimizer_in_bwd: True``; PyTorch's optimizer-in-backward tutorial):
    no full set of gradients ever exists. One process, no gradient accumulation."""
    image_patches: int = 0
    """Vision patches per sample that the model's vision tower encodes (after the patch embedding,
    before the spatial merge; Qwen-VL's ``image_grid_thw`` products summed over the sample's
    images). 0: no images, or a text-only model (:mod:`zeroplan.estimator.vision`)."""

    def __post_init__(self) -> None:
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_positive_int("seq_len", self.seq_len, maximum=100_000_000)
        check_choice("loss", self.loss, LOSSES)
        check_positive_int("image_patches", self.image_patches, minimum=0, maximum=100_000_000)
        if not isinstance(self.optimizer_in_backward, bool):
            raise SpecError(f"optimizer_in_backward={self.optimizer_in_backward!r} must be true or false")
        if self.optimizer_in_backward and (self.grad_accum or 1) > 1:
            # torchtune refuses it too (recipes/full_finetune_single_device.py:117-120 at fef3ed10).
            raise SpecError(f"optimizer_in_backward steps every parameter in its gradient hook: it cannot accumulate "
                            f"gradients (grad_accum={self.grad_accum}); use grad_accum 1 or drop optimizer_in_backward")
        if self.micro_batch is not None:
            check_positive_int("micro_batch", self.micro_batch, maximum=1_000_000)
        if self.global_batch is not None:
            check_positive_int("global_batch", self.global_batch, maximum=100_000_000)
        if self.grad_accum is not None:
            check_positive_int("grad_accum", self.grad_accum, maximum=1_000_000)

    def check_divides(self, world_size: int) -> None:
        """SpecError unless the global batch splits into whole samples per GPU.

        DeepSpeed needs train_batch_size == micro_batch × accumulation × world_size
        (deepspeed/runtime/config.py, ``_batch_assertion``), so no micro-batch reaches a global
        batch that ``world_size`` does not divide; the message names the nearest that work.
        """
        if self.global_batch is None or self.global_batch % world_size == 0:
            return
        lower = max(world_size, self.global_batch // world_size * world_size)
        raise SpecError(
            f"--global-batch {self.global_batch} is not a multiple of --gpus {world_size} (each GPU takes whole samples); "
            f"use {lower} or {lower + world_size}"
        )

    def accumulation_for(self, micro_batch: int, world_size: int) -> int:
        """Gradient-accumulation steps for ``micro_batch`` on ``world_size`` data-parallel ranks.

        DeepSpeed requires train_batch_size == micro_batch × accumulation × world_size exactly
        (deepspeed/runtime/config.py, ``_batch_assertion``); a global batch that does not divide
        raises SpecError naming the nearest valid values.
        """
        if self.global_batch is None:
            return self.grad_accum or 1
        per_step = micro_batch * world_size
        if self.global_batch % per_step:
            lower = max(per_step, self.global_batch // per_step * per_step)
            raise SpecError(
                f"global_batch={self.global_batch} is not a multiple of micro_batch×gpus="
                f"{micro_batch}×{world_size}={per_step}; use {lower} or {lower + per_step}"
            )
        return self.global_batch // per_step

    def as_dict(self) -> dict:
        return {
            "precision": self.precision,
            "optimizer": self.optimizer,
            "seq_len": self.seq_len,
            "micro_batch": self.micro_batch,
            "global_batch": self.global_batch,
            "grad_accum": self.grad_accum,
            "flash_attention": self.flash_attention,
            "loss": self.loss,
            "optimizer_in_backward": self.optimizer_in_backward,
            "image_patches": self.image_patches,
        }

