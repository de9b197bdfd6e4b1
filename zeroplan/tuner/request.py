"""What a tuning run is asked (:class:`TuneRequest`), what it tells as it goes (:class:`TuneListener`)
and what it hands back (:class:`TuneOutcome`): the contract of :func:`zeroplan.tuner.usecase.run_tune`,
which ``zeroplan tune`` and ``benchmarks/bench_tuner.py`` both call.

A request holds the user's choices as given (None: not given, the run decides), after the command
line checked their spelling; a new plan axis is one field here and one line in
:meth:`TuneRequest.space_options`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from zeroplan.profiles.lora import PeftOptions
from zeroplan.tuner.settings import TuneSettings

__all__ = ["NothingFits", "TuneListener", "TuneOutcome", "TuneRequest"]


@dataclass(frozen=True)
class TuneRequest:
    """One tuning run: the script, the machine, the model, the training, the plans to search and how."""

    script: Path
    """The training script: a DeepSpeed script or a zeroplan task (``zeroplan_task()``)."""
    script_kind: str
    """``task`` or ``script`` (:func:`zeroplan.runtime.script_kind`)."""
    gpus: int
    """Processes of the job, all nodes together."""
    nproc: int
    """Processes per node."""
    script_args: tuple[str, ...] = ()
    """Arguments passed on to the script."""
    nodes: Any = None
    """The multi-node layout (:func:`zeroplan.runtime.launch.multinode` ``NodeLayout``), None on one node."""
    launcher: str = "warm"
    """How a one-node probe starts its ranks: ``warm`` or ``torchrun``."""
    # -- cluster ----------------------------------------------------------------------------------
    gpu: Optional[str] = None
    """GPU profile name or .toml path; None: detected."""
    gpu_memory_gib: Optional[float] = None
    cpu_memory_gib: Optional[float] = None
    nvme_gib: Optional[float] = None
    node: Optional[str] = None
    """Node profile name or .toml path."""
    # -- model ------------------------------------------------------------------------------------
    params: Optional[float] = None
    """Total parameters (shape derived); with ``model`` None and neither given: the task's, else discovered."""
    model: Optional[str] = None
    """Preset name or Hugging Face config.json path."""
    model_spec: Any = None
    """The model as a :class:`~zeroplan.spec.ModelSpec`, for a caller that has one (wins over ``params``/``model``)."""
    peft: PeftOptions = field(default_factory=PeftOptions)
    """The fine-tuning options of a LoRA/QLoRA run (applied with ``params``/``model``)."""
    # -- training ---------------------------------------------------------------------------------
    precision: str = "bf16"
    optimizer: str = "adamw"
    seq_len: Optional[int] = None
    """Tokens per sample; None: the task's, else the first batch's, else 2048."""
    micro_batch: Optional[int] = None
    global_batch: Optional[int] = None
    grad_accum: Optional[int] = None
    loss: Optional[str] = None
    """What the loss keeps over the logits; None: the task's, else the estimator's default."""
    # -- plans searched ---------------------------------------------------------------------------
    engine: str = "deepspeed"
    """``deepspeed`` or ``fsdp``."""
    stage: Optional[int] = None
    offload_optimizer: Optional[str] = None
    offload_param: Optional[str] = None
    checkpointing: Optional[str] = None
    nvme_path: Optional[str] = None
    """Folder on an NVMe drive: adds nvme offload to the search."""
    bucket_sizes: tuple[int, ...] = ()
    """reduce_bucket_size values (elements) searched; () fixes it."""
    optimizer_impl: Optional[str] = None
    buckets: Mapping[str, Any] = field(default_factory=dict)
    """Bucket sizes and overlap_comm the plans carry (``resolve_engine_options``)."""
    max_micro_batch: Optional[int] = None
    """Largest micro-batch searched; None: the space's own limit."""
    layout: tuple = (None, None)
    """``--sp`` and ``--tp`` as parsed (:func:`zeroplan.estimator.layout_space.parse_degrees`:
    degrees or ``"auto"``; None where not given: data parallelism)."""
    ep: Optional[str] = None
    """``--ep`` as given (``4``, ``1,2,4`` or ``auto``; :func:`zeroplan.estimator.expert_parallel.parse_expert_degrees`,
    checked at construction); None: ep 1."""
    recipe: Any = None
    """The post-training recipe (:class:`zeroplan.spec.recipe.Recipe`) the plans are estimated
    under; None: plain SFT."""
    model_save: Optional[str] = None
    """``--model-save``: how the script saves checkpoints (``trainer`` | ``engine``); None: by the
    script (:func:`zeroplan.tuner.policy.script_model_save`)."""
    model_build: Optional[str] = None
    """``--model-build``: how the script builds or loads its model (``fp32`` | ``bf16`` | ``zero_init`` |
    ``meta`` | ``rank0``, :data:`zeroplan.estimator.host.BUILDS`); None: the engine's default at each plan."""
    # -- search -----------------------------------------------------------------------------------
    settings: TuneSettings = field(default_factory=TuneSettings)
    """Trials, time budget, estimator picks and probe timeout (checked where they are built)."""
    sampler: str = "tpe"
    seed: Optional[int] = None
    steps: int = 6
    warmup: int = 2
    ci: float = 0.05
    """Stop a probe once its step time's 95 % interval is within this fraction; 0: time every step."""
    resume: bool = False
    storage: Optional[str] = None
    """Optuna storage URL or journal path; None: ``output``/study.db."""
    output: Path = Path("zeroplan-out")
    config: Optional[Path] = None
    """The user's DeepSpeed config, base of every trial."""
    config_arg: str = "--deepspeed_config"

    def space_options(self) -> dict[str, Any]:
        """The plan axes as :func:`zeroplan.tuner.tune_space` takes them (a new axis: one line here)."""
        options = dict(
            script_kind=self.script_kind,
            stage=self.stage,
            offload_optimizer=self.offload_optimizer,
            offload_param=self.offload_param,
            checkpointing=self.checkpointing,
            nvme_path=self.nvme_path,
            bucket_sizes=self.bucket_sizes,
            engine=self.engine,
            optimizer_impl=self.optimizer_impl,
            buckets=dict(self.buckets),
        )
        if self.max_micro_batch is not None:
            options["max_micro_batch"] = self.max_micro_batch
        options["sp"], options["tp"] = (self.layout[0] or (1,)), (self.layout[1] or (1,))
        options["recipe"] = self.recipe
        options["ep"] = self.expert_degrees
        options["model_save"] = self.model_save  # None: run_tune decides by the script (policy.script_model_save)
        options["model_build"] = self.model_build
        return options

    def __post_init__(self) -> None:
        from zeroplan.tuner.space import check_expert_probes

        check_expert_probes(self.expert_degrees if self.engine == "deepspeed" else None)  # before any discovery or probe

    @property
    def expert_degrees(self) -> "list[int] | str | None":
        """``ep`` parsed (SpecError naming what is valid)."""
        from zeroplan.estimator.expert_parallel import parse_expert_degrees

        return parse_expert_degrees(self.ep, engine=self.engine)


class TuneListener:
    """What :func:`~zeroplan.tuner.usecase.run_tune` tells as it goes; this one ignores it all.

    ``event(kind, **data)`` receives the run's messages and every event of the search
    (:class:`~zeroplan.tuner.search.Tuner`'s ``on_event``); ``busy`` wraps a slow step that says
    nothing until it ends (discovering the model, compiling DeepSpeed's ops); ``searching`` wraps
    the search itself (the command line's live view).
    """

    def event(self, kind: str, **data: Any) -> None:
        """One thing that happened (the kinds: docs/design.md, "`tune`: data flow")."""

    def busy(self, kind: str, **data: Any) -> AbstractContextManager:
        """Around a slow step of ``kind``."""
        return nullcontext()

    def searching(self, tuner: Any) -> AbstractContextManager:
        """Around the search, once ``tuner`` is prepared."""
        return nullcontext()


@dataclass(frozen=True)
class TuneOutcome:
    """What a finished run hands back: its trials, the search's summary and where it wrote them."""

    frame: Any
    """trials.csv as a pandas DataFrame (:func:`zeroplan.tuner.results.write_results`)."""
    summary: Any
    """:class:`~zeroplan.tuner.settings.TuneSummary` of the search."""
    output: Path
    gpus: int
    """Processes of the job (the measured cluster's)."""
    trainer: bool
    """Whether the script is a Hugging Face Trainer script (it takes the config by ``--deepspeed``)."""
    tuner: Any = None
    """The :class:`~zeroplan.tuner.search.Tuner` that ran (its ledger, for benchmarks)."""
    space: Any = None
    """The :class:`~zeroplan.tuner.space.SearchSpace` searched."""


class NothingFits(Exception):
    """The estimator rules out every plan of ``space``: nothing to probe."""

    def __init__(self, space: Any) -> None:
        super().__init__(f"all {len(space.candidates)} plans are ruled out by the estimator")
        self.space = space
