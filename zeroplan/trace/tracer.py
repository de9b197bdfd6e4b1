"""Count the activation bytes a forward pass keeps for backward, without allocating them.

Method (PyTorch's own machinery, no model-specific formulas):

* the model is built and run under :class:`torch._subclasses.fake_tensor.FakeTensorMode`, so
  every tensor has a shape, dtype and storage but no memory (a Llama-3-8B forward at 4096 tokens
  traces in about a second);
* every tensor autograd saves for backward passes through
  :func:`torch.autograd.graph.saved_tensors_hooks`; its *storage* is counted once (views and
  tensors saved by several nodes share one storage), parameters and buffers are excluded;
* the logits the model returns are counted too (they stay alive until the loss's backward);
* bytes are attributed to a region by module hooks: ``embeddings`` (before the first block),
  one entry per transformer block, and ``logits`` (final norm, output projection and loss);
* checkpointing is applied for real: ``full`` wraps every block in
  :func:`torch.utils.checkpoint.checkpoint` (reentrant form, whose saved inputs pass through the
  same hook), ``attention`` (formerly ``selective``) wraps only the attention core (Korthikanti et al. 2022,
  arXiv 2205.05198, §4.2). The bytes a block's recomputation re-creates during backward are
  the difference between the ``none`` trace and the checkpointed trace of that block; the largest
  one is reported as ``recompute`` (only one block is recomputed at a time).

The trace models what CUDA kernels keep, also when it runs on CPU tensors:

* dropout saves a 1-byte boolean mask (``torch.native_dropout``, what CUDA runs) instead of the
  CPU fallback's mask in the activation dtype;
* with ``flash_attention`` the attention core runs the flash kernel without dropout (the CUDA
  flash kernel regenerates its dropout mask from a seed), keeping q, k, v, the output and the
  fp32 log-sum-exp; without it the model's eager attention runs and keeps the score matrix.

The real-tensor mode (``fake=False``) runs the same code on real CPU tensors; the validation
benchmark compares both with the bytes actually alive after forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

from zeroplan.spec import CHECKPOINTING_ALIASES, SpecError
from zeroplan.spec.errors import check_choice, check_positive_int
from zeroplan.trace.recording import _drop_grad, _enter_device_modes, _LiveStorages, _Recorder, _storage_keys
from zeroplan.trace.source import TraceSource, _require_torch, resolve_source

__all__ = ["TracedActivations", "PeakActivations", "trace_activations", "Tracer"]

#: Checkpointing modes the tracer applies for real (op-level selective-op is not traced yet).
TRACED_CHECKPOINTING = ("none", "attention", "full")


def traced_mode(checkpointing: str) -> str:
    """``checkpointing`` with old spellings mapped (selective → attention), checked against what is traced."""
    checkpointing = CHECKPOINTING_ALIASES.get(checkpointing, checkpointing)
    check_choice("checkpointing", checkpointing, TRACED_CHECKPOINTING)
    return checkpointing


@dataclass(frozen=True)
class TracedActivations:
    """Activation bytes of one forward + loss at one batch shape, by region."""

    source: str
    """Config path or task script traced."""
    micro_batch: int
    """Samples in the traced batch."""
    seq_len: int
    """Tokens per sample."""
    precision: str
    """Training dtype of the model (bf16, fp16, fp32)."""
    checkpointing: str
    """none, attention (attention core recomputed) or full (every block recomputed)."""
    flash_attention: bool
    """Attention through the flash kernel (no score matrix kept) rather than eager attention."""
    embeddings: int
    """Bytes saved before the first block: token ids, embedding output, dropout mask."""
    per_layer: tuple[int, ...]
    """Bytes saved inside each transformer block (with ``full``: the block's input only)."""
    logits: int
    """Bytes saved after the last block (final norm, output projection, fp32 loss) plus the logits output."""
    recompute: int
    """Bytes re-created while the largest block (full) or attention core (attention) is recomputed in backward."""
    fake: bool = True
    """True when traced under FakeTensorMode (no memory); False for a run on real tensors."""

    @property
    def layers(self) -> int:
        """Sum of :attr:`per_layer`."""
        return sum(self.per_layer)

    @property
    def total(self) -> int:
        """Activation bytes at the start of backward plus one block's recomputation."""
        return self.embeddings + self.layers + self.logits + self.recompute

    def as_dict(self) -> dict:
        return {
            "source": self.source,
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
            "precision": self.precision,
            "checkpointing": self.checkpointing,
            "flash_attention": self.flash_attention,
            "embeddings": self.embeddings,
            "per_layer": list(self.per_layer),
            "layers": self.layers,
            "logits": self.logits,
            "recompute": self.recompute,
            "total": self.total,
            "fake": self.fake,
        }


@dataclass(frozen=True)
class PeakActivations:
    """Live activation bytes over a whole forward + backward (storages created in the step)."""

    end_of_forward: int
    """Bytes alive when forward + loss return (what :attr:`TracedActivations.total` counts, minus recompute)."""
    peak: int
    """Largest bytes alive at any op of forward + backward: saved tensors, activation gradients,
    recomputed blocks, the loss's fp32 buffers; parameter gradients are dropped as soon as they
    are accumulated (ZeRO moves them into its buckets), so they count one at a time."""
    peak_op: str
    """The aten op at which the peak was reached."""
    peak_phase: str
    """``forward`` or ``backward``."""


# ---------------------------------------------------------------------------------------------
# recording saved tensors


@dataclass
class _RawTrace:
    embeddings: int
    per_layer: tuple[int, ...]
    logits: int
    attention: tuple[int, ...]


@dataclass
class Tracer:
    """A built model (fake or real) that can be traced at several batch shapes and checkpointing modes.

    Building is the slow part for big configs, so :class:`~zeroplan.trace.fit.ActivationModel`
    keeps one Tracer and runs a few forwards on it.
    """

    source: TraceSource
    precision: str = "bf16"
    flash_attention: bool = True
    fake: bool = True
    _mode: Any = field(default=None, repr=False)
    _model: Any = field(default=None, repr=False)
    _blocks: list = field(default_factory=list, repr=False)
    _excluded: set = field(default_factory=set, repr=False)
    _none_cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        check_choice("precision", self.precision, ("bf16", "fp16", "fp32"))
        self.source = resolve_source(self.source)
        _require_torch()  # one line naming the package, not an ImportError from FakeTensorMode
        self._mode = self._new_mode()
        with self._entered():
            self._model = self.source.build(precision=self.precision, flash_attention=self.flash_attention)
        self._blocks = self.source.blocks(self._model)
        self._excluded = _storage_keys(list(self._model.parameters()) + list(self._model.buffers()))

    def _new_mode(self):
        if not self.fake:
            return None
        from torch._subclasses.fake_tensor import FakeTensorMode

        return FakeTensorMode(allow_non_fake_inputs=True)

    @contextlib.contextmanager
    def _entered(self) -> Iterator[None]:
        with self._mode if self._mode is not None else contextlib.nullcontext():
            yield

    @property
    def num_layers(self) -> int:
        """Blocks found in the model."""
        return len(self._blocks)

    @property
    def vocab_size(self) -> int | None:
        """Rows of the output projection (the logits' last dimension), when the model exposes it:
        a Hugging Face model's ``config.vocab_size``, else ``get_output_embeddings()``, else the
        vocabulary a zeroplan task declares in its ``model_spec``; else None."""
        config_vocab = getattr(getattr(self._model, "config", None), "vocab_size", None)
        if isinstance(config_vocab, int) and config_vocab > 0:
            return config_vocab
        get_head = getattr(self._model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        weight = getattr(head, "weight", None)
        if weight is not None:
            return int(weight.shape[0])
        spec = getattr(getattr(self.source, "task", None), "model_spec", None)
        vocab = getattr(spec, "vocab_size", None)
        return vocab if isinstance(vocab, int) and vocab > 0 else None

    def _raw(self, *, micro_batch: int, seq_len: int, checkpointing: str) -> _RawTrace:
        import torch

        recorder = _Recorder(self._excluded)
        with self._entered():
            batch = self.source.make_batch(self._model, micro_batch=micro_batch, seq_len=seq_len)
            with contextlib.ExitStack() as stack:
                _enter_device_modes(stack, blocks=self._blocks, source=self.source, recorder=recorder, checkpointing=checkpointing,
                                    flash_attention=self.flash_attention)
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack))
                try:
                    loss, outputs = self.source.forward_loss(self._model, batch)
                except SpecError:
                    raise
                except Exception as exc:
                    raise SpecError(
                        f"forward of {self.source.name} failed at micro_batch={micro_batch}, "
                        f"seq_len={seq_len}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    ) from None
            recorder.region = "logits"
            for tensor in (outputs, loss):
                if isinstance(tensor, torch.Tensor):
                    recorder.add(tensor)
        by = recorder.bytes_by_region
        n = len(self._blocks)
        per_layer = tuple(by.get(("layer", i), 0) + by.get(("attention", ("layer", i)), 0) for i in range(n))
        attention = tuple(by.get(("attention", ("layer", i)), 0) for i in range(n))
        other_attention = sum(v for k, v in by.items() if isinstance(k, tuple) and k[0] == "attention" and k[1] in ("embeddings", "logits"))
        return _RawTrace(
            embeddings=by.get("embeddings", 0),
            per_layer=per_layer,
            logits=by.get("logits", 0) + other_attention,
            attention=attention,
        )

    def trace(self, *, micro_batch: int, seq_len: int, checkpointing: str = "none") -> TracedActivations:
        """Trace one forward + loss (checkpointed modes also need the ``none`` trace, which is cached)."""
        check_positive_int("micro_batch", micro_batch, maximum=1_000_000)
        check_positive_int("seq_len", seq_len, maximum=10_000_000)
        checkpointing = traced_mode(checkpointing)
        raw = self._raw(micro_batch=micro_batch, seq_len=seq_len, checkpointing=checkpointing)
        if checkpointing == "none":
            self._none_cache[(micro_batch, seq_len)] = raw
        recompute = 0
        if checkpointing != "none":
            base = self.raw_none(micro_batch=micro_batch, seq_len=seq_len)
            # One block (full) or one attention core (selective) is rematerialised at a time in
            # backward: the extra bytes are what that block kept without checkpointing.
            recompute = max((b - c for b, c in zip(base.per_layer, raw.per_layer)), default=0)
        return TracedActivations(
            source=self.source.name,
            micro_batch=micro_batch,
            seq_len=seq_len,
            precision=self.precision,
            checkpointing=checkpointing,
            flash_attention=self.flash_attention,
            embeddings=raw.embeddings,
            per_layer=raw.per_layer,
            logits=raw.logits,
            recompute=max(recompute, 0),
            fake=self.fake,
        )

    def peak(self, *, micro_batch: int, seq_len: int, checkpointing: str = "none") -> PeakActivations:
        """Run forward and backward (fake or real) watching every storage the step creates.

        A ``TorchDispatchMode`` records each new storage; after every op the bytes of those
        still alive are summed. This sees what the saved-tensor count cannot: gradients of
        activations, the loss's fp32 temporaries and the recomputation of checkpointed blocks.
        """
        import torch

        check_positive_int("micro_batch", micro_batch, maximum=1_000_000)
        check_positive_int("seq_len", seq_len, maximum=10_000_000)
        checkpointing = traced_mode(checkpointing)
        recorder = _Recorder(self._excluded)
        live = _LiveStorages(self._excluded)
        params = [p for p in self._model.parameters() if p.requires_grad]
        hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in params]
        try:
            with self._entered(), contextlib.ExitStack() as stack:
                _enter_device_modes(stack, blocks=self._blocks, source=self.source, recorder=recorder, checkpointing=checkpointing,
                                    flash_attention=self.flash_attention)
                stack.enter_context(live)
                batch = self.source.make_batch(self._model, micro_batch=micro_batch, seq_len=seq_len)
                loss, outputs = self.source.forward_loss(self._model, batch)
                end_of_forward = live.current()
                live.phase = "backward"
                loss.backward()
                del loss, outputs, batch
        finally:
            for hook in hooks:
                hook.remove()
            for p in params:
                p.grad = None
        return PeakActivations(end_of_forward=end_of_forward, peak=live.peak, peak_op=live.peak_op, peak_phase=live.peak_phase)

    def raw_none(self, *, micro_batch: int, seq_len: int) -> _RawTrace:
        """The un-checkpointed trace at this shape (cached)."""
        key = (micro_batch, seq_len)
        if key not in self._none_cache:
            self._none_cache[key] = self._raw(micro_batch=micro_batch, seq_len=seq_len, checkpointing="none")
        return self._none_cache[key]


def trace_activations(
    source: Any,
    *,
    seq_len: int,
    micro_batch: int = 1,
    precision: str = "bf16",
    checkpointing: str = "none",
    flash_attention: bool = True,
    fake: bool = True,
) -> TracedActivations:
    """Activation bytes of one forward + loss of ``source`` (config.json path, task script or TraceSource).

    ``fake=False`` allocates real CPU tensors (only for small models: validation).
    """
    tracer = Tracer(source, precision=precision, flash_attention=flash_attention, fake=fake)
    return tracer.trace(micro_batch=micro_batch, seq_len=seq_len, checkpointing=checkpointing)
