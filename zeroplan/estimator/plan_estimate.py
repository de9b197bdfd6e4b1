"""What the estimator predicts for one plan (:class:`PlanEstimate`, its :class:`GpuMemory`) and the
fit notes both engines' paths write (:mod:`zeroplan.estimator.plans`, :mod:`zeroplan.estimator.plans_fsdp`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zeroplan.estimator.activations import ActivationMemory
from zeroplan.estimator.allocator import AllocatorReserve
from zeroplan.estimator.comm import CommVolume
from zeroplan.estimator.host import HostPhases
from zeroplan.estimator.memory import HostMemory, ModelStates
from zeroplan.estimator.moments import Moment
from zeroplan.estimator.timing import StepTime
from zeroplan.estimator.verdict import PlanVerdict
from zeroplan.spec import GiB, Plan

__all__ = ["GpuMemory", "PlanEstimate", "gpu_fit_note", "stranded_note"]


@dataclass(frozen=True)
class GpuMemory:
    """Per-GPU memory at the step's peak, in bytes (the ``gpu`` object of docs/design.md)."""

    params: int
    gradients: int
    """Gradient bytes alive at the peak (DeepSpeed allocates some only after the loss's backward)."""
    optimizer_states: int
    activations: int
    overhead: int
    """Engine extras alive at the peak plus the CUDA reserve (context, allocator fragmentation)."""
    total: int
    """Everything the GPU must hold at the peak: params + gradients + optimizer_states + activations + overhead."""
    peak_allocated: int
    """``total`` less the CUDA reserve: what ``torch.cuda.max_memory_allocated`` should report."""
    peak_reserved: int = 0
    """``peak_allocated`` plus the caching allocator's reserve (:mod:`zeroplan.estimator.allocator`):
    what ``torch.cuda.max_memory_reserved`` should report (``total`` less the CUDA context)."""
    required: int = 0
    """The plan's GPU figure: what the table's GPU column shows, what the verdict compares
    (:mod:`zeroplan.estimator.verdict`) and what pruning uses. What the GPU must have for the step
    not to run out of memory:
    ``peak_allocated`` + the CUDA context + the reserve a failing malloc cannot release
    (:attr:`~zeroplan.estimator.allocator.AllocatorReserve.held`). Cached segments the allocator
    frees before raising an OOM are in ``total`` and ``peak_reserved`` only."""

    def as_dict(self) -> dict[str, int]:
        return {
            "params": self.params,
            "gradients": self.gradients,
            "optimizer_states": self.optimizer_states,
            "activations": self.activations,
            "overhead": self.overhead,
            "total": self.total,
            "peak_allocated": self.peak_allocated,
            "peak_reserved": self.peak_reserved,
            "required": self.required,
        }


@dataclass(frozen=True)
class PlanEstimate:
    """Everything the estimator predicts for one plan."""

    plan: Plan
    gpu: GpuMemory
    overhead_items: dict[str, int]
    """Every engine extra by name; items of the other phase (see ``peak_phase`` and
    :class:`~zeroplan.estimator.memory.EngineOverhead`) are listed but not in ``gpu.overhead``."""
    states: ModelStates
    activation_breakdown: Optional[ActivationMemory]
    host: HostMemory
    comm: CommVolume
    time: StepTime
    tokens_per_second: float
    fits: bool
    notes: tuple[str, ...]
    peak_phase: str = "backward"
    """When the GPU peak happens: ``backward`` (activations alive) or ``step`` (optimizer step)."""
    host_phases: Optional[HostPhases] = None
    """Host RAM per rank and per node by phase (model build, engine init, step, checkpoint save)."""
    engine: str = "deepspeed"
    """The engine modelled: ``deepspeed`` or ``fsdp`` (PyTorch's DDP/FSDP2)."""
    allocator: Optional[AllocatorReserve] = None
    """What the CUDA caching allocator reserves beyond ``gpu.peak_allocated`` (None on CPU)."""
    moments: tuple[Moment, ...] = ()
    """Every candidate peak moment of a DeepSpeed step (:func:`~zeroplan.estimator.moments.deepspeed_moments`);
    ``gpu.peak_allocated`` is the model states and always-resident extras plus the largest. Empty under fsdp."""
    judgement: Optional[PlanVerdict] = None
    """The verdict with its headroom on GPU and host (:mod:`zeroplan.estimator.verdict`)."""
    model_build: str = ""
    """How each rank builds or loads the model on the host (:data:`~zeroplan.estimator.host.BUILDS`)."""
    layout_comm: Optional[object] = None
    """The sequence/tensor-parallel collectives' bytes per step
    (:class:`~zeroplan.estimator.tensor_parallel.LayoutComm`); None for pure data parallelism."""
    recipe: Optional[dict] = None
    """A post-training recipe's memory terms (:mod:`zeroplan.estimator.plans_recipe`); None for plain SFT."""

    @property
    def verdict(self) -> str:
        """``fits``, ``tight`` or ``oom`` (``fits`` is ``verdict != "oom"``)."""
        if self.judgement is not None:
            return self.judgement.verdict
        return "fits" if self.fits else "oom"

    @property
    def cpu_per_node(self) -> int:
        """Host RAM per node at the worst phase."""
        if self.host_phases is not None:
            return self.host_phases.per_node_bytes
        return self.host.cpu_per_node

    @property
    def cpu_worst_phase(self) -> str:
        """The phase whose host RAM per node is largest."""
        return self.host_phases.worst.name if self.host_phases is not None else "step"

    @property
    def nvme_per_node(self) -> int:
        return self.host.nvme_per_node

    @property
    def comm_per_step(self) -> int:
        return self.comm.total

    @property
    def step_time(self) -> float:
        return self.time.total

    def as_dict(self) -> dict:
        """A ``plans[]`` object of docs/design.md."""
        d = self.plan.as_dict()
        d.update(
            {
                "gpu": self.gpu.as_dict(),
                "model_states": {
                    "params": self.states.params,
                    "gradients": self.states.gradients,
                    "optimizer_states": self.states.optimizer_states,
                },
                "overhead_items": dict(self.overhead_items),
                "peak_phase": self.peak_phase,
                "engine": self.engine,
                "allocator_reserve": self.allocator.as_dict() if self.allocator is not None else {},
                "cpu_per_node": self.cpu_per_node,
                "cpu_worst_phase": self.cpu_worst_phase,
                "cpu_phases": self.host_phases.as_dict() if self.host_phases is not None else {},
                "cpu_items": dict(self.host.cpu_items),
                "nvme_per_node": self.nvme_per_node,
                "comm_per_step": self.comm_per_step,
                "inter_node_comm_per_step": self.comm.inter_node,
                "pcie_per_step": self.comm.pcie,
                "step_time": self.step_time,
                "step_time_breakdown": {
                    "compute": self.time.compute,
                    "communication": self.time.communication,
                    "exposed_communication": self.time.exposed_communication,
                    "optimizer": self.time.optimizer,
                    "offload_transfer": self.time.offload_transfer,
                    "engine_overhead": self.time.engine_overhead,
                    # A recipe's rollout and log-prob passes (plans_recipe.py); absent for plain SFT.
                    **({"generation": self.time.generation, "scoring": self.time.scoring} if self.recipe is not None else {}),
                },
                "tokens_per_second": self.tokens_per_second,
                "fits": self.fits,
                "verdict": self.verdict,
                "headroom": self.judgement.as_dict() if self.judgement is not None else None,
                "model_build": self.model_build,
                **({"layout_comm": self.layout_comm.as_dict()} if self.layout_comm is not None else {}),
                "notes": list(self.notes),
            }
        )
        if self.recipe is not None:
            d["recipe"] = self.recipe
        return d


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def stranded_note(allocator: AllocatorReserve, transients: dict[str, int]) -> str:
    """The note for a plan whose allocator reserve holds a large stranded transient."""
    return (
        f"allocator reserve {_gib(allocator.total)}: {', '.join(k.replace('_', ' ') for k in transients)} "
        f"strand their cached segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True avoids it: --expandable-segments)"
    )


def gpu_fit_note(gpu: GpuMemory, capacity_bytes: int) -> str:
    """Why ``gpu`` does not fit ``capacity_bytes`` (decided on ``gpu.required``), or why it fits
    although its reserved peak does not (the allocator releases its cached segments before an
    OOM); "" when neither."""
    if gpu.required > capacity_bytes:
        return f"GPU needs {_gib(gpu.required)} > {_gib(capacity_bytes)}"
    if gpu.total > capacity_bytes:
        return (
            f"fits in {_gib(gpu.required)} of {_gib(capacity_bytes)}; the reserved peak ({_gib(gpu.total)} with the "
            f"context) does not, and the caching allocator frees those cached segments and retries before an OOM"
        )
    return ""
