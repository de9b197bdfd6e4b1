"""The probe contract: what the tuner and the CLI ask for (:class:`ProbeRequest`) and get back
(:class:`ProbeResult`). No torch import here; the launcher and worker do the work."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from zeroplan.runtime.launch.registry import DEFAULT_ONE_NODE, local_launchers
from zeroplan.runtime.launch.multinode import NodeLaunch
from zeroplan.estimator.optimizer import ENGINE_OPTIMIZER_IMPLS, resolve_optimizer_impl
from zeroplan.estimator.plans import check_engine_precision
from zeroplan.runtime.measure.peft_source import PeftFlags
from zeroplan.spec import LOSSES, RUNNABLE_ENGINES, ModelSpec, Plan, SpecError, TrainingSpec
from zeroplan.spec.recipe import Recipe
from zeroplan.spec.errors import check_choice

__all__ = ["BACKENDS", "LOCAL_LAUNCHERS", "STATUSES", "ProbeRequest", "ProbeResult"]

#: The engines a probe runs (zeroplan.spec.engines).
BACKENDS = RUNNABLE_ENGINES
STATUSES = ("ok", "oom", "error", "timeout")
#: How a one-node probe starts its ranks: ``warm`` forks them from a server that imported torch and
#: DeepSpeed once (zeroplan.runtime.launch.warm), ``torchrun`` starts ``torchrun --standalone``
#: (the registry's one-node kinds, zeroplan.runtime.launch.registry).
LOCAL_LAUNCHERS = local_launchers()


@dataclass(frozen=True)
class ProbeRequest:
    """One short probe job: a script, an engine, a plan, how long to run it."""

    script: Path
    """User script: a DeepSpeed training script, or a zeroplan task (defines ``zeroplan_task()``)."""
    nproc: int = 2
    """Processes per node (``torchrun --nproc_per_node``)."""
    backend: str = "deepspeed"
    """``deepspeed`` or ``fsdp`` (fsdp runs zeroplan tasks only)."""
    ds_config: dict | None = None
    """DeepSpeed config (written to ``ds_config.json`` in the workdir and passed to the script)."""
    plan: Plan | None = None
    """The plan under test (needed by the fsdp backend; used for the estimate)."""
    training: TrainingSpec | None = None
    """Training setup (precision, optimizer, seq_len) used for the estimate and by tasks."""
    model: ModelSpec | None = None
    """Model shape for the estimate (a zeroplan task may supply its own ``model_spec``)."""
    script_args: tuple[str, ...] = ()
    """Arguments for the script, before the config argument."""
    config_arg: str = "--deepspeed_config"
    """How the script takes its config path (``--deepspeed`` for Hugging Face Trainer scripts)."""
    steps: int = 5
    """Measured optimizer steps."""
    warmup: int = 2
    """Optimizer steps run before measuring (not timed)."""
    timeout_s: float = 300.0
    """Wall-clock limit for the whole job; past it the process group is killed."""
    workdir: Path | None = None
    """Where config, per-rank results and the log go (a temporary folder if None)."""
    torchrun_args: tuple[str, ...] = ()
    """Extra torchrun arguments (``--nnodes``, ``--node-rank``, ``--rdzv-endpoint`` ...)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment variables for the job."""
    seq_len: int | None = None
    """Tokens per sample for tokens/s; None: the task's ``seq_len``, else ``training.seq_len`` if given."""
    nodes: NodeLaunch | None = None
    """Several nodes (torchrun rendezvous or a Slurm step; zeroplan.runtime.launch.multinode); None: one node."""
    optimizer_impl: str | None = None
    """Whose optimizer step the estimate assumes (``zeroplan.estimator.OPTIMIZER_IMPLS``); None:
    discovered — torch's AdamW for a DeepSpeed config without an ``optimizer`` block, else the engine's own."""
    loss: str | None = None
    """What the loss keeps over the logits, for the estimate (``zeroplan.spec.LOSSES``); None: the
    task's ``loss``, else ``training.loss``."""
    recipe: Recipe | None = None
    """The post-training recipe for the estimate (``--recipe``, zeroplan.spec.recipe); None: the
    recipe discovery found in the run (its summary's ``recipe``), else plain SFT."""
    peft_flags: PeftFlags | None = None
    """LoRA/QLoRA options for the estimate when the run's own model does not carry a layout
    (zeroplan.runtime.measure.peft_source)."""
    launcher: str = DEFAULT_ONE_NODE
    """How a one-node probe starts its ranks (``LOCAL_LAUNCHERS``, zeroplan.runtime.launch): ``warm``
    (ranks forked from a pre-imported server; torchrun where it cannot start, and whenever
    ``torchrun_args`` are given) or ``torchrun``. Several nodes: ``nodes.launcher``."""

    @property
    def world_size(self) -> int:
        """Ranks in the whole job: processes per node × nodes."""
        return self.nproc * (self.nodes.nnodes if self.nodes else 1)

    def __post_init__(self) -> None:
        object.__setattr__(self, "script", Path(self.script))
        if self.workdir is not None:
            object.__setattr__(self, "workdir", Path(self.workdir))
        if self.backend not in BACKENDS:
            raise SpecError(f"backend={self.backend!r} is not valid; choose one of {', '.join(BACKENDS)}")
        for name in ("nproc", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"{name}={value!r} is not valid; give a whole number >= 1")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise SpecError(f"warmup={self.warmup!r} is not valid; give a whole number >= 0")
        if not self.timeout_s > 0:
            raise SpecError(f"timeout_s={self.timeout_s!r} is not valid; give a positive number of seconds")
        if self.seq_len is not None and (isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise SpecError(f"seq_len={self.seq_len!r} is not valid; give a whole number >= 1 or None")
        if not self.config_arg.startswith("-"):
            raise SpecError(f"config_arg={self.config_arg!r} is not valid; give an option such as --deepspeed_config")
        if self.loss is not None:
            check_choice("loss", self.loss, LOSSES)
        if self.launcher not in local_launchers():
            raise SpecError(f"launcher={self.launcher!r} is not valid; choose one of {', '.join(local_launchers())}")
        if self.optimizer_impl is not None:
            valid = ENGINE_OPTIMIZER_IMPLS[self.backend]
            if self.optimizer_impl not in valid:
                raise SpecError(f"optimizer_impl={self.optimizer_impl!r} does not exist for backend {self.backend}; choose one of {', '.join(valid)}")
            if self.plan is not None:
                resolve_optimizer_impl(self.optimizer_impl, engine=self.backend, plan=self.plan)
        if self.training is not None:
            check_engine_precision(self.backend, self.training.precision)
        object.__setattr__(self, "script_args", tuple(str(a) for a in self.script_args))
        object.__setattr__(self, "torchrun_args", tuple(str(a) for a in self.torchrun_args))
        object.__setattr__(self, "env", tuple((str(k), str(v)) for k, v in self.env))


@dataclass(frozen=True)
class ProbeResult:
    """What a probe measured (docs/design.md, "JSON: probe --format json"), with the estimate beside it."""

    status: str
    """``ok``, ``oom``, ``error`` or ``timeout``."""
    backend: str
    """Engine that ran: ``deepspeed`` or ``fsdp``."""
    world_size: int
    """Processes in the job."""
    steps: int
    """Measured optimizer steps completed (0 when the probe failed before any)."""
    step_time: float | None = None
    """Mean seconds per measured optimizer step (slowest rank)."""
    samples_per_second: float | None = None
    """Samples per optimizer step across all ranks / step_time."""
    tokens_per_second: float | None = None
    """samples_per_second × seq_len when the sequence length is known, else None."""
    peak_memory: int | None = None
    """Largest per-rank peak bytes (CUDA: max_memory_allocated; CPU: live tensor storage)."""
    peak_memory_per_rank: list[int] = field(default_factory=list)
    """Peak bytes of each rank, rank order."""
    estimated_peak_memory: int | None = None
    """The estimator's predicted peak bytes per GPU for this plan, when plan and model are known."""
    error: str | None = None
    """Readable reason when status is not ``ok``."""
    log_tail: str = ""
    """Last lines of the job's combined stdout/stderr."""
    memory_kind: str | None = None
    """How peak memory was measured: ``cuda`` or ``cpu-storage``."""
    workdir: str | None = None
    """Folder holding the config, per-rank results and the full log."""
    estimate_note: str | None = None
    """Why there is no estimate (model shape or sequence length unknown, ...), or what the estimate
    assumed (e.g. the trainable count a PEFT script reported), else None."""
    state_memory_per_rank: list[int] = field(default_factory=list)
    """Live bytes of each rank just before its last optimizer step: activations freed; parameters,
    gradients, optimizer states and engine buffers remain (the measured "model states")."""
    step_time_per_rank: list[float | None] = field(default_factory=list)
    """Mean measured step seconds of each rank, rank order (None for a rank that measured none)."""
    node_per_rank: list[int | None] = field(default_factory=list)
    """Node rank each rank ran on (multi-node probes; the launcher's node rank), rank order."""
    trainable_params: int | None = None
    """Parameters with requires_grad in the engine's module (DeepSpeed runs), else None."""
    frozen_params: int | None = None
    """Parameters without requires_grad in the engine's module (DeepSpeed runs), else None."""
    discovered_model: dict | None = None
    """What a plain script's model is, read at ``deepspeed.initialize`` when no model was given
    (``zeroplan.runtime.discovery.discover.DiscoveredModel.as_dict``); None otherwise."""
    activations_source: str | None = None
    """Where the estimate's activation bytes came from (``zeroplan.runtime.discovery.discover.ACTIVATION_SOURCES``:
    traced, config, module-tree, params, model, task, not-modelled); None without an estimate."""
    trainer: str | None = None
    """The Hugging Face Trainer class that trained (``DPOTrainer``, ``GRPOTrainer``, ...), else None."""
    recipe: dict | None = None
    """Its post-training recipe (``zeroplan.runtime.discovery.recipe_discovery.RECIPE_KEYS``: kind, generations,
    completion_len, vllm_gpu_memory, reference, reward_model, critic_model), else None."""
    trl: dict | None = None
    """The trainer config's values that shape the recipe and batch, by TRL's field names."""
    frozen_engines: list = field(default_factory=list)
    """Engines built without an optimizer (a TRL reference model): class, params, stage, offload_param."""
    memory_phases_per_rank: list = field(default_factory=list)
    """Per rank, the recipe's memory phases (generation, scoring, rollout, loss_forward, backward):
    ``entry_bytes`` and ``peak_bytes`` of the call with the highest peak (CPU tracker only)."""

    host_peak_per_node: int | None = None
    """Peak host RSS of the node (torchrun and every worker, shared library pages once), sampled
    every 50 ms from the launcher with psutil."""
    host_peak_per_rank: list[int] = field(default_factory=list)
    """Peak RSS of each rank (the kernel's high-water mark, exact), rank order."""
    host_phase_peaks_per_node: dict[str, int] = field(default_factory=dict)
    """Sampled node peak within each phase the run reached (model_build, engine_init, step, checkpoint_save)."""
    host_phase_peaks_per_rank: list[dict] = field(default_factory=list)
    """Each rank's peak RSS per phase."""
    estimated_host_peak_per_node: int | None = None
    """The estimator's host peak per node for this run: its phases that ran, plus the node's measured
    idle footprint (``host_baseline_per_node``)."""
    estimated_host_phases_per_node: dict[str, int] = field(default_factory=dict)
    """The estimator's host bytes per node for each phase that ran, baseline included."""
    host_baseline_per_node: int | None = None
    """Node RSS when the ranks start the user's code: interpreter, torch, DeepSpeed, torchrun."""
    pinned_bytes_per_rank: list = field(default_factory=list)
    """Host bytes DeepSpeed pinned in each rank (its pin-memory tracker), None where not exposed."""
    memory_limit: str | None = None
    """For ``oom``: ``host`` or ``device`` — which memory ran out."""
    launcher: str | None = None
    """What started the ranks: ``warm``, ``torchrun``, or None (a multi-node probe: see ``nodes``)."""
    launcher_note: str | None = None
    """Why the warm launcher was not used although asked for (it could not start here), else None."""
    phases_s: dict[str, float] = field(default_factory=dict)
    """Wall seconds of each phase the probe reached, as the launcher saw them
    (zeroplan.runtime.measure.phases.PHASES: server, launch, imports, script, engine, warmup, measure,
    teardown, report)."""
    waits_s: dict[str, float] = field(default_factory=dict)
    """Seconds the probe waited on something that is not its plan, not charged to its timeout:
    ``launcher`` (the warm server's start and its answer), ``op build`` (a DeepSpeed op being
    compiled while the ranks waited to load it)."""
    cpu_step_time: float | None = None
    """CPU seconds per measured optimizer step (median) of the rank that used most: the work of its
    own threads. With one thread per CPU rank (zeroplan.runtime.rank.threads) other jobs on the machine
    change it little, where they change step_time by their share of the cores; it leaves out time
    spent blocked (waiting on a collective)."""
    load_average: tuple[float, float] | None = None
    """The machine's 1-minute load average when the probe started and when it reported."""

    @property
    def host_worst_phase(self) -> str | None:
        """The phase with the largest measured node RSS."""
        peaks = self.host_phase_peaks_per_node
        return max(peaks, key=peaks.get) if peaks else None

    @property
    def estimated_host_worst_phase(self) -> str | None:
        peaks = self.estimated_host_phases_per_node
        return max(peaks, key=peaks.get) if peaks else None

    @property
    def host_memory_error(self) -> float | None:
        """(estimated − measured) / measured host peak per node, for a finished probe."""
        if self.status != "ok" or not self.host_peak_per_node or self.estimated_host_peak_per_node is None:
            return None
        return (self.estimated_host_peak_per_node - self.host_peak_per_node) / self.host_peak_per_node

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r} is not one of {STATUSES}")

    @property
    def memory_error(self) -> float | None:
        """(estimated − measured) / measured peak memory; None unless the probe finished (``ok``)
        with both numbers (a failed run's peak is partial)."""
        if self.status != "ok" or not self.peak_memory or self.estimated_peak_memory is None:
            return None
        return (self.estimated_peak_memory - self.peak_memory) / self.peak_memory

    def as_dict(self) -> dict:
        """JSON-ready dict in the order of docs/design.md, plus ``memory_error`` and extras."""
        return {
            "status": self.status,
            "backend": self.backend,
            "world_size": self.world_size,
            "steps": self.steps,
            "step_time": self.step_time,
            "samples_per_second": self.samples_per_second,
            "tokens_per_second": self.tokens_per_second,
            "peak_memory": self.peak_memory,
            "peak_memory_per_rank": list(self.peak_memory_per_rank),
            "estimated_peak_memory": self.estimated_peak_memory,
            "memory_error": self.memory_error,
            "memory_kind": self.memory_kind,
            "error": self.error,
            "log_tail": self.log_tail,
            "workdir": self.workdir,
            "state_memory_per_rank": list(self.state_memory_per_rank),
            "estimate_note": self.estimate_note,
            "step_time_per_rank": list(self.step_time_per_rank),
            "node_per_rank": list(self.node_per_rank),
            "trainable_params": self.trainable_params,
            "frozen_params": self.frozen_params,
            "memory_limit": self.memory_limit,
            "host_peak_per_node": self.host_peak_per_node,
            "host_peak_per_rank": list(self.host_peak_per_rank),
            "estimated_host_peak_per_node": self.estimated_host_peak_per_node,
            "host_memory_error": self.host_memory_error,
            "host_worst_phase": self.host_worst_phase,
            "estimated_host_worst_phase": self.estimated_host_worst_phase,
            "host_phase_peaks_per_node": dict(self.host_phase_peaks_per_node),
            "estimated_host_phases_per_node": dict(self.estimated_host_phases_per_node),
            "host_phase_peaks_per_rank": list(self.host_phase_peaks_per_rank),
            "host_baseline_per_node": self.host_baseline_per_node,
            "pinned_bytes_per_rank": list(self.pinned_bytes_per_rank),
            "discovered_model": self.discovered_model,
            "activations_source": self.activations_source,
            "launcher": self.launcher,
            "launcher_note": self.launcher_note,
            "phases_s": dict(self.phases_s),
            "waits_s": dict(self.waits_s),
            "cpu_step_time": self.cpu_step_time,
            "load_average": list(self.load_average) if self.load_average else None,
            "trainer": self.trainer,
            "recipe": self.recipe,
            "trl": self.trl,
            "frozen_engines": list(self.frozen_engines),
            "memory_phases_per_rank": list(self.memory_phases_per_rank),
        }
