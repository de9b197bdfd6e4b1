"""Scale traced activation bytes to any micro-batch and sequence length from a few traces.

Every tensor a transformer keeps for backward has a size of the form b·s·(width) or, for the
attention scores of eager attention, b·a·s²; tensors shared by the whole batch (rotary cos/sin
tables, a materialised causal mask) scale with s or s² alone. So for one checkpointing mode

    bytes(b, s) = α·b·s + β·b·s² + γ·s + δ·s² + ε·b + ζ

is exact (Korthikanti et al. 2022, arXiv 2205.05198, eq. 1–2, is the α/β part for one GPT
layer: α = 34·h·L, β = 5·a·L; ε and ζ hold per-sample and per-batch scalars of the loss). Six
traces — b ∈ {1, 2} × s ∈ {s₀/4, s₀/2, s₀} — fix the six coefficients (for each b a quadratic in
s, linear in b); a seventh at (3, s₀) checks them (:attr:`ActivationFit.max_fit_error`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zeroplan.spec import SpecError
from zeroplan.spec.errors import check_choice, check_positive_int
from zeroplan.trace.tracer import TRACED_CHECKPOINTING, Tracer, traced_mode

__all__ = ["ActivationModel", "ActivationFit", "MEASURES", "fit_activation_model"]

_COMPONENTS = ("embeddings", "layers", "logits", "recompute")
#: What an ActivationModel fits: the saved-tensor count (cheap) or the forward + backward peak.
MEASURES = ("saved", "peak")


def _components(measure: str) -> tuple[str, ...]:
    return _COMPONENTS if measure == "saved" else ("peak",)


def _features(b: int, s: int) -> tuple[float, ...]:
    return (b * s, b * s * s, s, s * s, b, 1.0)


@dataclass(frozen=True)
class ActivationFit:
    """Coefficients of α·b·s + β·b·s² + γ·s + δ·s² + ε·b + ζ for each component of one checkpointing mode."""

    checkpointing: str
    """none, attention or full."""
    coefficients: dict[str, tuple[float, ...]]
    """Component (embeddings, layers, logits, recompute) → (α, β, γ, δ, ε, ζ), bytes."""
    points: tuple
    """The traces (TracedActivations, or PeakActivations for ``peak``) solved from and checked against."""
    max_fit_error: float
    """Largest relative error of the fit at the check point (0 for an exact fit)."""

    def component(self, name: str, micro_batch: int, seq_len: int) -> int:
        x = _features(micro_batch, seq_len)
        return max(0, round(sum(c * f for c, f in zip(self.coefficients[name], x))))


@dataclass
class ActivationModel:
    """Traced activation bytes for any (micro_batch, seq_len, checkpointing) from a few traces per mode.

    Modes are traced lazily, on first use, with one built model (fake tensors: no memory).
    """

    tracer: Tracer
    """The built model the traces run on."""
    seq_len: int
    """Sequence length the fit is centred on (traced at seq_len and seq_len/2; exact there)."""
    measure: str = "saved"
    """``saved``: bytes saved for backward + logits + one block's recompute (a trace per point);
    ``peak``: the largest live bytes over forward + backward (:meth:`Tracer.peak`, ~8× slower)."""
    fits: dict[str, ActivationFit] = field(default_factory=dict)
    """Checkpointing mode → fit, filled on demand."""
    _direct: dict = field(default_factory=dict, repr=False)

    #: Above this relative error at the check point a peak fit is not trusted: the op at which
    #: the peak happens changed between the traced shapes, so each shape is traced directly.
    PEAK_FIT_TOLERANCE = 1e-3

    def __post_init__(self) -> None:
        check_choice("measure", self.measure, MEASURES)

    @property
    def source(self) -> str:
        return self.tracer.source.name

    def fit(self, checkpointing: str) -> ActivationFit:
        """The fit for ``checkpointing`` (traced now if not yet)."""
        checkpointing = traced_mode(checkpointing)
        if checkpointing not in self.fits:
            self.fits[checkpointing] = _fit_mode(self.tracer, self.seq_len, checkpointing, self.measure)
        return self.fits[checkpointing]

    def breakdown(self, micro_batch: int, seq_len: int, checkpointing: str) -> dict[str, int]:
        """Bytes per component (embeddings, layers, logits, recompute; or ``peak``) and their ``total``."""
        check_positive_int("micro_batch", micro_batch, maximum=1_000_000)
        check_positive_int("seq_len", seq_len, maximum=10_000_000)
        fixed = self.tracer.source.fixed_seq_len
        if fixed is not None and seq_len != fixed:
            raise SpecError(f"{self.source} is traced at its own seq_len {fixed}, not {seq_len}; use --seq-len {fixed}")
        fit = self.fit(checkpointing)
        if self.measure == "peak" and fit.max_fit_error > self.PEAK_FIT_TOLERANCE:
            key = (micro_batch, seq_len, checkpointing)
            if key not in self._direct:
                self._direct[key] = self.tracer.peak(micro_batch=micro_batch, seq_len=seq_len, checkpointing=checkpointing).peak
            return {"peak": self._direct[key], "total": self._direct[key]}
        parts = {name: fit.component(name, micro_batch, seq_len) for name in _components(self.measure)}
        parts["total"] = sum(parts.values())
        return parts

    def bytes(self, micro_batch: int, seq_len: int, checkpointing: str) -> int:
        """Total activation bytes per GPU for one micro-batch (see :class:`TracedActivations.total`)."""
        return self.breakdown(micro_batch, seq_len, checkpointing)["total"]

    def as_dict(self) -> dict:
        return {
            "source": self.source,
            "seq_len": self.seq_len,
            "precision": self.tracer.precision,
            "flash_attention": self.tracer.flash_attention,
            "measure": self.measure,
            "fits": {
                mode: {
                    "coefficients": {k: list(v) for k, v in fit.coefficients.items()},
                    "max_fit_error": fit.max_fit_error,
                }
                for mode, fit in self.fits.items()
            },
        }


def _trace_points(seq_len: int) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    # Two batch sizes × three sequence lengths determine the six coefficients.
    s_hi = max(seq_len, 3)
    s_mid = max(2, s_hi // 2)
    s_lo = max(1, s_hi // 4)
    if s_lo == s_mid:
        s_lo = s_mid - 1
    solve = [(1, s_mid), (2, s_mid), (1, s_hi), (2, s_hi), (1, s_lo), (2, s_lo)]
    return solve, (3, s_hi)


def _solve(points: list[tuple[int, int]], values: list[int]) -> tuple[float, ...]:
    import numpy as np

    a = np.array([_features(b, s) for b, s in points], dtype=np.float64)
    if len({s for _, s in points}) == 1:
        # One sequence length: only the per-sample slope and the intercept are identifiable.
        a[:, 1:5] = 0.0
        a[:, 4] = [b for b, _ in points]
    y = np.array(values, dtype=np.float64)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return tuple(float(c) for c in coef)


def _fit_mode(tracer: Tracer, seq_len: int, checkpointing: str, measure: str = "saved") -> ActivationFit:
    fixed = tracer.source.fixed_seq_len
    if fixed is not None:
        # A task makes its own batches at one sequence length: fit only in the batch size
        # (α·b·s + ε·b + ζ collapse to a line in b at that s; the other coefficients are 0).
        solve, check = [(1, fixed), (2, fixed)], (3, fixed)
    else:
        solve, check = _trace_points(seq_len)
    names = _components(measure)
    traces: list = []
    for b, s in solve + [check]:
        if measure == "peak":
            traces.append(tracer.peak(micro_batch=b, seq_len=s, checkpointing=checkpointing))
        else:
            traces.append(tracer.trace(micro_batch=b, seq_len=s, checkpointing=checkpointing))
    values = [{n: getattr(t, n) for n in names} for t in traces]
    coefficients = {name: _solve(solve, [v[name] for v in values[: len(solve)]]) for name in names}
    fit = ActivationFit(checkpointing=checkpointing, coefficients=coefficients, points=tuple(traces), max_fit_error=0.0)
    b, s = (solve + [check])[-1]
    predicted = sum(fit.component(name, b, s) for name in names)
    actual = sum(values[-1].values())
    # The peak is reached at one op; if that op changes between the traced shapes the quadratic
    # is only approximate, which this check point shows.
    error = abs(predicted - actual) / max(1, actual)
    return ActivationFit(checkpointing=checkpointing, coefficients=coefficients, points=tuple(traces), max_fit_error=error)


def fit_activation_model(
    source: Any,
    *,
    seq_len: int,
    precision: str = "bf16",
    flash_attention: bool = True,
    checkpointing: tuple[str, ...] = TRACED_CHECKPOINTING,
    fake: bool = True,
    measure: str = "saved",
) -> ActivationModel:
    """Build ``source`` once and fit the given checkpointing modes around ``seq_len`` (others on demand).

    ``measure``: ``saved`` (saved-for-backward + logits + recompute) or ``peak`` (forward + backward).
    """
    check_positive_int("seq_len", seq_len, maximum=10_000_000)
    checkpointing = tuple(traced_mode(mode) for mode in checkpointing)
    tracer = Tracer(source, precision=precision, flash_attention=flash_attention, fake=fake)
    model = ActivationModel(tracer=tracer, seq_len=seq_len, measure=measure)
    for mode in checkpointing:
        model.fit(mode)
    return model


