"""Plan: one choice of ZeRO stage, offload, checkpointing and batch shape."""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.spec.engines import TORCH_ENGINES
from zeroplan.spec.errors import SpecError, check_choice, check_positive_int

__all__ = ["Plan", "STAGES", "OFFLOADS", "CHECKPOINTING", "CHECKPOINTING_ALIASES", "BUCKET_KEYS", "DEEPSPEED_DEFAULT_KNOBS", "FSDP_STAGE_NAMES", "divisors", "LAYOUT_DEGREES", "resolve_engine_knobs"]

STAGES = (0, 1, 2, 3)
#: The parallel degrees a plan carries besides data parallelism, in label order.
LAYOUT_DEGREES = ("sp", "tp", "ep", "cp")
OFFLOADS = ("none", "cpu", "nvme")
#: Activation checkpointing as users name it: none; attention (Korthikanti et al. 2022 §4.2:
#: the attention core recomputed — what Megatron calls "selective"); selective-op (PyTorch's
#: op-level selective activation checkpointing as torchtitan applies it: matmul and SDPA outputs
#: saved, the rest recomputed); full (each block recomputed from its input).
CHECKPOINTING = ("none", "attention", "selective-op", "full")
#: Old spellings still accepted: ``selective`` was zeroplan's name for ``attention``.
CHECKPOINTING_ALIASES = {"selective": "attention"}
#: The ZeRO bucket and threshold sizes a Plan may set (elements), named as DeepSpeed's
#: ``zero_optimization`` keys; the one list the config builder, the config reader and the
#: estimator share.
BUCKET_KEYS = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
)


@dataclass(frozen=True)
class Plan:
    """A ZeRO configuration to estimate, export, probe or tune.

    Engine knobs left at ``None`` take DeepSpeed's defaults, or — when the model's hidden size
    is known — Hugging Face's integration rule (reduce bucket h², prefetch 0.9·h², persistence
    10·h), resolved by :func:`zeroplan.dsconfig.build_config` and by the estimator alike.
    """

    stage: int
    """ZeRO stage: 0 (plain DDP), 1 (P_os), 2 (P_os+g), 3 (P_os+g+p)."""
    offload_optimizer: str = "none"
    """Where optimizer states live: none (GPU), cpu (ZeRO-Offload), nvme (ZeRO-Infinity, stage 3 only)."""
    offload_param: str = "none"
    """Where fp16 parameters live between uses: none, cpu or nvme (stage 3 only)."""
    checkpointing: str = "none"
    """Activation checkpointing: none, attention (attention core recomputed), selective-op (op-level,
    matmul/SDPA outputs saved) or full (per block); ``selective`` is read as ``attention``."""
    micro_batch: int = 1
    """Samples per GPU per forward/backward (train_micro_batch_size_per_gpu)."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer step."""
    cpu_checkpointing: bool = False
    """Keep checkpointed block inputs in host memory (DeepSpeed activation_checkpointing.cpu_checkpointing)."""
    reduce_bucket_size: int | None = None
    """Elements per gradient reduce bucket (DeepSpeed default 5e8)."""
    allgather_bucket_size: int | None = None
    """Elements per all-gather bucket in stages 1–2 (DeepSpeed default 5e8)."""
    stage3_prefetch_bucket_size: int | None = None
    """Elements prefetched ahead in stage 3 (DeepSpeed default 5e7)."""
    stage3_param_persistence_threshold: int | None = None
    """Parameters smaller than this stay unpartitioned in stage 3 (DeepSpeed default 1e5)."""
    stage3_max_live_parameters: int | None = None
    """Upper bound on gathered parameters alive at once in stage 3 (DeepSpeed default 1e9)."""
    stage3_max_reuse_distance: int | None = None
    """Gathered parameters reused within this many elements are not released (default 1e9)."""
    zero_hpz_partition_size: int = 1
    """ZeRO++ hpZ (arXiv 2306.10209 §3.2): ranks of a node holding a secondary weight partition (1: off)."""
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ (§3.1): INT8 weights in the forward all-gather."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ (§3.3): INT4 hierarchical all-to-all gradient reduce (only across nodes)."""
    overlap_comm: bool = True
    """DeepSpeed ``overlap_comm``: stages 1–2 then keep two reduce buffers of reduce_bucket_size
    elements instead of one (stage_1_and_2.py ``setup_buckets``). True as zeroplan's configs set
    it; a config read without the key takes DeepSpeed's default (true at stage 3 only)."""
    sp: int = 1
    """Sequence-parallel degree (DeepSpeed Ulysses/ALST ``sequence_parallel_size``): each rank of a
    sequence group holds seq_len/sp tokens; 1: off."""
    tp: int = 1
    """Tensor-parallel degree (DeepSpeed AutoTP ``tensor_parallel.autotp_size``, ZeRO 0–2); 1: off."""
    ep: int = 1
    """Expert-parallel degree (DeepSpeed AutoEP ``expert_parallel``): experts split over ep ranks of
    the data-parallel group; 1: off."""
    cp: int = 1
    """Context-parallel degree (PyTorch ring attention under FSDP2, torchtitan's
    ``context_parallel_degree``): each rank holds seq_len/cp tokens of every sample; FSDP shards
    over dp × cp. 1: off."""
    tiled_mlp: bool = False
    """ALST's TiledMLP (DeepSpeed ``runtime/sequence_parallel/ulysses_sp.py`` ``TiledMLP``): each
    block's MLP runs in sequence tiles without saving its hidden activations and is recomputed tile
    by tile in backward."""

    def __post_init__(self) -> None:
        if self.stage not in STAGES or isinstance(self.stage, bool):
            raise SpecError(f"stage={self.stage!r} is not valid; choose 0, 1, 2 or 3")
        check_choice("offload_optimizer", self.offload_optimizer, OFFLOADS)
        check_choice("offload_param", self.offload_param, OFFLOADS)
        if self.checkpointing in CHECKPOINTING_ALIASES:
            object.__setattr__(self, "checkpointing", CHECKPOINTING_ALIASES[self.checkpointing])
        check_choice("checkpointing", self.checkpointing, CHECKPOINTING)
        check_positive_int("micro_batch", self.micro_batch, maximum=1_000_000)
        check_positive_int("gradient_accumulation_steps", self.gradient_accumulation_steps, maximum=1_000_000)
        if self.offload_param != "none" and self.stage != 3:
            raise SpecError(
                f"offload_param={self.offload_param} needs stage 3 (DeepSpeed ignores it below); "
                "use --stage 3 or --offload-param none"
            )
        if self.offload_optimizer != "none" and self.stage == 0:
            raise SpecError(
                f"offload_optimizer={self.offload_optimizer} needs ZeRO stage 1, 2 or 3; use --stage 1 or higher"
            )
        if self.offload_optimizer == "nvme" and self.stage != 3:
            raise SpecError(
                "offload_optimizer=nvme needs stage 3 (ZeRO-Infinity); use --stage 3 or --offload-optimizer cpu"
            )
        if self.cpu_checkpointing and self.checkpointing == "none":
            raise SpecError("cpu_checkpointing needs checkpointing attention, selective-op or full")
        for name in BUCKET_KEYS:
            value = getattr(self, name)
            if value is not None:
                check_positive_int(name, value, minimum=0, maximum=10**13)
        check_positive_int("zero_hpz_partition_size", self.zero_hpz_partition_size, maximum=1024)
        for name in ("zero_quantized_weights", "zero_quantized_gradients"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"{name}={getattr(self, name)!r} is not valid; give true or false")
        if not isinstance(self.overlap_comm, bool):
            raise SpecError(f"overlap_comm={self.overlap_comm!r} is not valid; give true or false")
        for name in ("sp", "tp", "ep", "cp"):
            check_positive_int(name, getattr(self, name), maximum=65_536)
        if not isinstance(self.tiled_mlp, bool):
            raise SpecError(f"tiled_mlp={self.tiled_mlp!r} is not valid; give true or false")
        if self.stage != 3 and (self.zero_hpz_partition_size > 1 or self.zero_quantized_weights or self.zero_quantized_gradients):
            raise SpecError(
                f"ZeRO++ (zero_hpz_partition_size={self.zero_hpz_partition_size}, zero_quantized_weights="
                f"{self.zero_quantized_weights}, zero_quantized_gradients={self.zero_quantized_gradients}) needs stage 3; "
                "use --stage 3 or turn them off"
            )

    def with_batch(self, micro_batch: int, gradient_accumulation_steps: int) -> "Plan":
        """This plan with another micro-batch and accumulation. ``dataclasses.replace`` would check
        every field again; here only the two new values are checked (the others were when this
        plan was made, and no other check reads these two), with the messages ``Plan`` gives."""
        check_positive_int("micro_batch", micro_batch, maximum=1_000_000)
        check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps, maximum=1_000_000)
        plan = object.__new__(Plan)
        object.__setattr__(plan, "__dict__", {**self.__dict__, "micro_batch": micro_batch, "gradient_accumulation_steps": gradient_accumulation_steps})
        return plan

    @property
    def zero_label(self) -> str:
        """Stage and offloads, e.g. ``z3+opt:cpu+param:cpu`` (the first part of :attr:`label`)."""
        text = f"z{self.stage}"
        if self.offload_optimizer != "none":
            text += f"+opt:{self.offload_optimizer}"
        if self.offload_param != "none":
            text += f"+param:{self.offload_param}"
        if self.zero_hpz_partition_size > 1:
            text += f"+hpz{self.zero_hpz_partition_size}"
        if self.zero_quantized_weights:
            text += "+qwz"
        if self.zero_quantized_gradients:
            text += "+qgz"
        return text

    @property
    def model_parallel(self) -> int:
        """Ranks that share one data-parallel replica's work: sp × tp × cp (the world is dp × sp ×
        tp × cp; the expert degree ep splits the data-parallel group and does not multiply the world)."""
        return self.sp * self.tp * self.cp

    def data_parallel(self, world: int) -> int:
        """The data-parallel degree on ``world`` ranks: world / (sp × tp × cp). Raises SpecError when
        sp × tp × cp does not divide the world."""
        if world % self.model_parallel:
            cp = f" × cp={self.cp}" if self.cp > 1 else ""
            raise SpecError(
                f"sp={self.sp} × tp={self.tp}{cp} = {self.model_parallel} does not divide {world} GPUs; "
                "choose degrees whose product divides the GPU count"
            )
        return world // self.model_parallel

    def zero_group_size(self, world: int) -> int:
        """Ranks ZeRO partitions model states over and reduces gradients across: world/tp. The
        sequence-parallel ranks of a replica hold the same parameters and join ZeRO's group
        (DeepSpeed ``utils/groups.py`` ``_get_sequence_data_parallel_group``: "the process group for
        zero sharding and gradient allreduce must be across both dimensions of data and sequence
        parallelism"; ``runtime/engine.py`` passes it as ``dp_process_group``); AutoTP's ranks hold
        different shards and do not. Context-parallel ranks join FSDP's group likewise (torchtitan
        shards over the ``dp_shard_cp`` mesh). Raises SpecError as :meth:`data_parallel`."""
        return self.data_parallel(world) * self.sp * self.cp

    def layout(self, world: int) -> dict[str, int]:
        """The parallel layout on ``world`` ranks: ``{dp, sp, tp, ep, cp}`` (JSON ``layout``)."""
        return {"dp": self.data_parallel(world), "sp": self.sp, "tp": self.tp, "ep": self.ep, "cp": self.cp}

    @property
    def layout_label(self) -> str:
        """The non-trivial degrees, e.g. ``sp4``, ``tp2``, ``sp2.tp2``, ``ep4``, ``cp4``; empty for pure
        data parallelism (so data-parallel labels read as before)."""
        return ".".join(f"{name}{getattr(self, name)}" for name in LAYOUT_DEGREES if getattr(self, name) > 1)

    @property
    def label(self) -> str:
        """The plan's one label, used everywhere a plan is named (tables, notes, trials.csv), e.g.
        ``z3+opt:cpu/ckpt:full/mb4/ga2``: stage and offloads, the layout when not pure data
        parallelism (``z2/sp4/ckpt:none/mb1/ga1``), checkpointing (``+tiledmlp`` with TiledMLP), micro-batch,
        gradient-accumulation steps. Bucket sizes are not part of it."""
        layout = f"/{self.layout_label}" if self.layout_label else ""
        tiled = "+tiledmlp" if self.tiled_mlp else ""
        return f"{self.zero_label}{layout}/ckpt:{self.checkpointing}{tiled}/mb{self.micro_batch}/ga{self.gradient_accumulation_steps}"

    def stage_name(self, engine: str = "deepspeed") -> str:
        """The stage as ``engine`` names it: ``2`` under DeepSpeed, ``shard-grad-op`` under fsdp
        (:data:`FSDP_STAGE_NAMES`)."""
        return FSDP_STAGE_NAMES[self.stage] if engine in TORCH_ENGINES else str(self.stage)

    def label_for(self, engine: str = "deepspeed") -> str:
        """:attr:`label` in ``engine``'s own words: under fsdp the PyTorch wrapper
        (``full-shard+offload:cpu/ckpt:none/mb4/ga1``), FSDP2's CPUOffloadPolicy moving
        parameters, gradients and the optimizer step together; under DeepSpeed :attr:`label`."""
        if engine not in TORCH_ENGINES:
            return self.label
        offload = "+offload:cpu" if "cpu" in (self.offload_optimizer, self.offload_param) else ""
        layout = f"/{self.layout_label}" if self.layout_label else ""
        return f"{FSDP_STAGE_NAMES[self.stage]}{offload}{layout}/ckpt:{self.checkpointing}/mb{self.micro_batch}/ga{self.gradient_accumulation_steps}"

    def as_dict(self) -> dict:
        d = {
            "stage": self.stage,
            "offload_optimizer": self.offload_optimizer,
            "offload_param": self.offload_param,
            "checkpointing": self.checkpointing,
            "micro_batch": self.micro_batch,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }
        if self.cpu_checkpointing:
            d["cpu_checkpointing"] = True
        if self.zero_hpz_partition_size > 1:
            d["zero_hpz_partition_size"] = self.zero_hpz_partition_size
        for name in ("zero_quantized_weights", "zero_quantized_gradients"):
            if getattr(self, name):
                d[name] = True
        if not self.overlap_comm and self.stage in (1, 2):
            d["overlap_comm"] = False
        for name in LAYOUT_DEGREES:
            if getattr(self, name) > 1:
                d[name] = getattr(self, name)
        if self.tiled_mlp:
            d["tiled_mlp"] = True
        return d


#: What each stage is under ``--engine fsdp`` (zeroplan/fsdpconfig.py, runtime/rank/backends/fsdp.py):
#: DistributedDataParallel; DDP with torch.distributed.optim.ZeroRedundancyOptimizer; FSDP2
#: ``fully_shard(reshard_after_forward=False)`` and ``=True``, which FSDP1 calls the
#: SHARD_GRAD_OP and FULL_SHARD sharding strategies (torch.distributed.fsdp.ShardingStrategy).
FSDP_STAGE_NAMES = {0: "ddp", 1: "ddp+zero-opt", 2: "shard-grad-op", 3: "full-shard"}

#: DeepSpeed's defaults (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig fields), in elements.
DEEPSPEED_DEFAULT_KNOBS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}


def resolve_engine_knobs(plan: Plan, hidden_size: int | None = None, *, trainable_params: int | None = None) -> dict[str, int]:
    """Bucket and ZeRO-3 sizes (elements) a run of ``plan`` will use.

    Plan fields that are set win. Otherwise, when the model's hidden size h is known, the rule
    of Hugging Face's DeepSpeed integration (transformers/integrations/deepspeed.py,
    ``trainer_config_finalize``: reduce_bucket_size = h², stage3_prefetch_bucket_size =
    int(0.9·h²), stage3_param_persistence_threshold = 10·h); else DeepSpeed's defaults
    (:data:`DEEPSPEED_DEFAULT_KNOBS`). With ``trainable_params`` (a parameter-efficient run), the
    reduce and all-gather buckets are capped at that count: DeepSpeed allocates the whole
    bucket (zero/stage_1_and_2.py, ``torch.empty(int(self.reduce_bucket_size))``) though only
    trainable gradients ever fill it.
    """
    knobs = dict(DEEPSPEED_DEFAULT_KNOBS)
    if hidden_size:
        knobs["reduce_bucket_size"] = hidden_size * hidden_size
        knobs["stage3_prefetch_bucket_size"] = int(0.9 * hidden_size * hidden_size)
        knobs["stage3_param_persistence_threshold"] = 10 * hidden_size
    if trainable_params:
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            knobs[name] = min(knobs[name], int(trainable_params))
    for name in knobs:
        value = getattr(plan, name, None)
        if value is not None:
            knobs[name] = int(value)
    return knobs


def divisors(n: int, *, least: int = 1, most: int | None = None) -> list[int]:
    """The divisors of ``n`` from ``least`` to ``most`` (default ``n``), ascending: the degrees a
    layout (sp, tp, ep) or a per-rank batch can split ``n`` into."""
    top = n if most is None else min(n, most)
    return [d for d in range(least, top + 1) if n % d == 0]
