"""The engines zeroplan plans for, and the facts callers ask of one (``--engine``).

One row an engine: a new engine is a row here plus its estimator module, not a name added to
tuples in several layers. Callers ask a fact (``engine_facts(name).flat_units``) or take a
derived tuple (:data:`RUNNABLE_ENGINES`, :data:`TORCH_ENGINES`); where DeepSpeed's own
behaviour is meant (its config, zero.Init, AutoTP/AutoEP, its optimizers) the code says
``"deepspeed"``.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.spec.errors import SpecError

__all__ = ["ENGINES", "EngineFacts", "PURE_PRECISION_ENGINES", "RUNNABLE_ENGINES", "TORCH_ENGINES", "engine_facts"]


@dataclass(frozen=True)
class EngineFacts:
    """What zeroplan knows of one engine."""

    name: str
    """The ``--engine`` value."""
    torch: bool
    """PyTorch's engines (single device, DDP, ZeroRedundancyOptimizer, FSDP), estimated by
    :mod:`zeroplan.estimator.plans_fsdp`; False: DeepSpeed's ZeRO, :mod:`zeroplan.estimator.plans`."""
    runs: bool
    """``probe`` and ``tune`` run it (a runtime backend, zeroplan.runtime.rank.backends) and
    ``export`` writes its settings; False: ``estimate`` only."""
    flat_units: bool
    """FSDP1's flat parameters at stages 2-3 (:mod:`zeroplan.estimator.fsdp1`)."""
    pure_precision: bool
    """bf16-pure (no fp32 master) is modelled: PyTorch's engines without a mixed-precision policy.
    DeepSpeed 0.19's ``bf16.bf16_master_weights_and_grads`` / ``bf16_optimizer_states`` (ZeRO 1-3,
    deepspeed/runtime/config.py) are not."""


_FACTS = (
    EngineFacts("deepspeed", torch=False, runs=True, flat_units=False, pure_precision=False),
    # single device, DDP, ZeroRedundancyOptimizer, FSDP2 fully_shard (zeroplan.estimator.fsdp)
    EngineFacts("fsdp", torch=True, runs=True, flat_units=False, pure_precision=True),
    # the same below stage 2; FSDP1 per block with use_orig_params at 2-3 (zeroplan.estimator.fsdp1)
    EngineFacts("fsdp1", torch=True, runs=False, flat_units=True, pure_precision=True),
)
_BY_NAME = {f.name: f for f in _FACTS}

#: Engines the estimator models (``estimate --engine``).
ENGINES = tuple(_BY_NAME)
#: Engines probe and tune run and export writes settings for.
RUNNABLE_ENGINES = tuple(f.name for f in _FACTS if f.runs)
#: PyTorch's engines: ``fsdp`` (single device, DDP, ZeroRedundancyOptimizer, FSDP2) and ``fsdp1``
#: (the same below stage 2; FSDP1's flat parameters at stages 2-3, zeroplan.estimator.fsdp1).
TORCH_ENGINES = tuple(f.name for f in _FACTS if f.torch)
#: Engines whose memory model covers bf16-pure (:attr:`EngineFacts.pure_precision`).
PURE_PRECISION_ENGINES = tuple(f.name for f in _FACTS if f.pure_precision)


def engine_facts(name: str) -> EngineFacts:
    """The facts of engine ``name``; SpecError naming the valid ones otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise SpecError(f"engine={name!r} is not valid; choose one of {', '.join(ENGINES)}") from None
