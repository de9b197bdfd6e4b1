"""Options shared by every command (same spellings everywhere) and their conversion to specs.

Commands declare parameters with these ``Annotated`` aliases and call :func:`resolve_model`,
:func:`resolve_cluster`, :func:`resolve_training` and :func:`plan_filters`; every bad value
raises :class:`~zeroplan.spec.SpecError`, which ``zeroplan.cli.main`` turns into exit code 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from zeroplan.profiles.lora import PeftOptions
from zeroplan.profiles.resolve import check_choice_option, resolve_cluster, resolve_model, resolve_training
from zeroplan.spec import (
    CHECKPOINTING,
    CHECKPOINTING_ALIASES,
    OFFLOADS,
    TORCH_ENGINES,
    ModelSpec,
    SpecError,
)

__all__ = [
    "stdout_console",
    "ParamsOpt",
    "ModelOpt",
    "GpusOpt",
    "RunGpusOpt",
    "resolve_gpus",
    "GpusPerNodeOpt",
    "GpuOpt",
    "GpuMemoryOpt",
    "CpuMemoryOpt",
    "NvmeOpt",
    "NodeOpt",
    "SeqLenOpt",
    "MicroBatchOpt",
    "GlobalBatchOpt",
    "GradAccumOpt",
    "PrecisionOpt",
    "OptimizerOpt",
    "StageOpt",
    "OffloadOptimizerOpt",
    "OffloadParamOpt",
    "CheckpointingOpt",
    "FormatOpt",
    "OutputOpt",
    "LoraRankOpt",
    "LoraTargetsOpt",
    "LoraAlphaOpt",
    "AdapterOpt",
    "TrainableParamsOpt",
    "BaseQuantOpt",
    "PeftOptions",
    "LossOpt",
    "OptimizerImplOpt",
    "BucketsOpt",
    "ReduceBucketOpt",
    "AllgatherBucketOpt",
    "PrefetchBucketOpt",
    "OverlapCommOpt",
    "ModelBuildOpt",
    "ModelSaveOpt",
    "SpOpt",
    "TpOpt",
    "TiledMlpOpt",
    "resolve_layout_options",
    "resolve_engine_options",
    "with_peft",
    "resolve_model",
    "resolve_cluster",
    "resolve_training",
    "check_choice_option",
    "check_plan_options",
    "write_output",
    "terminal_width",
]

_MODEL = "Model"
_CLUSTER = "Cluster"
_TRAIN = "Training"
_PLAN = "Plan"
_OUT = "Output"
_PEFT = "Fine-tuning (LoRA / QLoRA)"

ParamsOpt = Annotated[
    Optional[float],
    typer.Option("--params", help="Total parameters, e.g. 7e9 (shape derived by the GPT-3 rule).", rich_help_panel=_MODEL),
]
ModelOpt = Annotated[
    Optional[str],
    typer.Option("--model", help="Preset name (see `zeroplan profiles`) or path to a Hugging Face config.json.", rich_help_panel=_MODEL),
]
#: ``--gpus`` when not given: this machine's GPUs when it has some (as ``--gpu`` is detected);
#: else a typical 8-GPU node for the commands that only plan, and 2 CPU ranks for the ones that
#: run engines here (8 ranks would share a few cores). :func:`resolve_gpus` applies it.
PLAN_GPUS_WITHOUT_GPU = 8
RUN_GPUS_WITHOUT_GPU = 2
GpusOpt = Annotated[
    Optional[int],
    typer.Option("--gpus", help="Total GPUs (data-parallel world size) [default: this machine's GPUs; without one, 8, a typical node].", rich_help_panel=_CLUSTER),
]
RunGpusOpt = Annotated[
    Optional[int],
    typer.Option("--gpus", help="Total GPUs (processes) of the job [default: this machine's GPUs; without one, 2 ranks on the CPU].", rich_help_panel=_CLUSTER),
]
GpusPerNodeOpt = Annotated[
    Optional[int], typer.Option("--gpus-per-node", help="GPUs per node [default: min(gpus, 8)].", rich_help_panel=_CLUSTER)
]
GpuOpt = Annotated[
    Optional[str],
    typer.Option("--gpu", help="GPU profile name or path to a profile .toml [default: detected with NVML, else a100-80gb].", rich_help_panel=_CLUSTER),
]
GpuMemoryOpt = Annotated[
    Optional[float], typer.Option("--gpu-memory", help="Usable GiB per GPU [default: the profile's].", rich_help_panel=_CLUSTER)
]
CpuMemoryOpt = Annotated[
    Optional[str],
    typer.Option(
        "--cpu-memory",
        help="Host GiB per node, or 'local' for this machine's RAM [default: the node profile of the GPU; this machine's when NVML finds the GPU here].",
        rich_help_panel=_CLUSTER,
    ),
]
NodeOpt = Annotated[
    Optional[str],
    typer.Option("--node", help="Node profile (host RAM, NVMe, NICs), e.g. dgx-a100-640gb, aws-p4d.24xlarge, or a .toml path (see docs/host-memory.md).", rich_help_panel=_CLUSTER),
]
NvmeOpt = Annotated[
    Optional[float], typer.Option("--nvme", help="NVMe GiB per node for offload [default: 0, no NVMe].", rich_help_panel=_CLUSTER)
]
SeqLenOpt = Annotated[int, typer.Option("--seq-len", help="Tokens per sample.", rich_help_panel=_TRAIN)]
MicroBatchOpt = Annotated[
    Optional[int], typer.Option("--micro-batch", help="Samples per GPU per step [default: try 1, 2, 4, ...].", rich_help_panel=_TRAIN)
]
GlobalBatchOpt = Annotated[
    Optional[int], typer.Option("--global-batch", help="Samples per optimizer step across all GPUs (kept exact).", rich_help_panel=_TRAIN)
]
GradAccumOpt = Annotated[
    Optional[int], typer.Option("--grad-accum", help="Gradient-accumulation steps.", rich_help_panel=_TRAIN)
]
PrecisionOpt = Annotated[
    str, typer.Option("--precision", help="bf16 | fp16 | fp32 | bf16-pure (bf16 weights, gradients and optimizer states, no fp32 master; engine fsdp).", rich_help_panel=_TRAIN)
]
OptimizerOpt = Annotated[
    str, typer.Option("--optimizer", help="adamw | adam | sgd | adafactor | lion.", rich_help_panel=_TRAIN)
]
StageOpt = Annotated[Optional[int], typer.Option("--stage", help="ZeRO stage 0|1|2|3.", rich_help_panel=_PLAN)]
OffloadOptimizerOpt = Annotated[
    Optional[str], typer.Option("--offload-optimizer", help="none | cpu | nvme.", rich_help_panel=_PLAN)
]
OffloadParamOpt = Annotated[Optional[str], typer.Option("--offload-param", help="none | cpu | nvme.", rich_help_panel=_PLAN)]
CheckpointingOpt = Annotated[
    Optional[str], typer.Option("--checkpointing", help="none | attention (attention core recomputed; old name: selective) | selective-op (op-level: matmul/SDPA outputs saved) | full.", rich_help_panel=_PLAN)
]
FormatOpt = Annotated[str, typer.Option("--format", help="table | json | csv.", rich_help_panel=_OUT)]
OutputOpt = Annotated[
    Optional[Path], typer.Option("--output", "-o", help="Write to this file instead of stdout.", rich_help_panel=_OUT)
]
LoraRankOpt = Annotated[
    Optional[int], typer.Option("--lora-rank", help="LoRA rank r: train adapters on a frozen base.", rich_help_panel=_PEFT)
]
LoraTargetsOpt = Annotated[
    Optional[str],
    typer.Option("--lora-targets", help="Modules to adapt, e.g. q_proj,v_proj, or all-linear [default: q_proj,v_proj].", rich_help_panel=_PEFT),
]
LoraAlphaOpt = Annotated[Optional[float], typer.Option("--lora-alpha", help="LoRA alpha (scale alpha/r; no effect on memory).", rich_help_panel=_PEFT)]
AdapterOpt = Annotated[
    Optional[Path], typer.Option("--adapter", help="PEFT adapter_config.json (or its folder), read offline.", rich_help_panel=_PEFT)
]
TrainableParamsOpt = Annotated[
    Optional[str], typer.Option("--trainable-params", help="Train only N parameters (2e8) or P% of them (1.5%).", rich_help_panel=_PEFT)
]
BaseQuantOpt = Annotated[
    Optional[str], typer.Option("--base-quant", help="Frozen base stored as none | nf4 (QLoRA) | int8.", rich_help_panel=_PEFT)
]


LossOpt = Annotated[
    Optional[str],
    typer.Option("--loss", help="hf | plain | megatron | fused | chunked | chunked-compiled (torchtune's compile=True) | tiled (ALST's tiled loss) | trl: what the loss keeps over the logits (docs/estimate.md) [default: hf; a task's own; trl under a --recipe].", rich_help_panel=_TRAIN),
]
OptimizerImplOpt = Annotated[
    Optional[str],
    typer.Option("--optimizer-impl", help="torch | torch-forloop | torch-fused | deepspeed-fused | deepspeed-cpu | bnb-paged | bnb-paged-8bit: whose optimizer step runs (torch-forloop: foreach=False, torch < 2.0; bnb-paged*: bitsandbytes' paged AdamW, states in unified memory, engine fsdp) [default: DeepSpeed's own (FusedAdam, CPU Adam with offload) under deepspeed, torch under fsdp; a config without an optimizer block: torch].", rich_help_panel=_TRAIN),
]
BucketsOpt = Annotated[
    str,
    typer.Option("--buckets", help="hf (reduce h², prefetch 0.9·h²: Trainer's 'auto') | deepspeed (5e8/5e8/5e7 elements: plain DeepSpeed, Megatron-DeepSpeed).", rich_help_panel=_PLAN),
]
ReduceBucketOpt = Annotated[
    Optional[float], typer.Option("--reduce-bucket-size", help="Elements per gradient reduce bucket (overrides --buckets).", rich_help_panel=_PLAN)
]
AllgatherBucketOpt = Annotated[
    Optional[float], typer.Option("--allgather-bucket-size", help="Elements per stage 1-2 all-gather bucket (overrides --buckets).", rich_help_panel=_PLAN)
]
PrefetchBucketOpt = Annotated[
    Optional[float], typer.Option("--prefetch-bucket-size", help="Elements prefetched ahead in stage 3 (overrides --buckets).", rich_help_panel=_PLAN)
]
SpOpt = Annotated[
    Optional[str],
    typer.Option("--sp", help="Sequence-parallel degree (DeepSpeed Ulysses/ALST): 4, a list 1,2,4 or auto [default: 1; estimate widens to auto when nothing fits at 1].", rich_help_panel=_PLAN),
]
TpOpt = Annotated[
    Optional[str],
    typer.Option("--tp", help="Tensor-parallel degree (DeepSpeed AutoTP, ZeRO 0-2): 2, a list 1,2 or auto [default: 1].", rich_help_panel=_PLAN),
]
TiledMlpOpt = Annotated[
    bool, typer.Option("--tiled-mlp", help="ALST's TiledMLP: MLPs run and are recomputed in sequence tiles (DeepSpeed TiledMLP).", rich_help_panel=_PLAN)
]
OverlapCommOpt = Annotated[
    Optional[str],
    typer.Option("--overlap-comm", help="on | off: DeepSpeed's overlap_comm — stages 1-2 keep two reduce buffers when on, one when off; written into exported configs [default: on].", rich_help_panel=_PLAN),
]
ModelBuildOpt = Annotated[
    Optional[str],
    typer.Option("--model-build", help="fp32 | bf16 | zero_init | meta | rank0: how each rank builds or loads the model on the host, for the host's model-build phase (docs/host-memory.md) [default: rank0 under fsdp, zero_init at DeepSpeed stage 3, else fp32; zero_init: stage 3 only].", rich_help_panel=_PLAN),
]
ModelSaveOpt = Annotated[
    Optional[str],
    typer.Option("--model-save", help="trainer | engine: how the run saves checkpoints, for the host's save phase: trainer (Hugging Face Trainer / accelerate: every rank copies the 16-bit model to the host at ZeRO 0-2) or engine (the script calls engine.save_checkpoint) [default: trainer; tune: the script's own, trainer for a Trainer script, else engine] (docs/host-memory.md).", rich_help_panel=_PLAN),
]


def resolve_layout_options(sp: Optional[str], tp: Optional[str]) -> tuple:
    """``--sp``/``--tp`` parsed (:func:`zeroplan.estimator.layout_space.parse_degrees`); None where not given."""
    from zeroplan.estimator.layout_space import parse_degrees

    return (None if sp is None else parse_degrees("--sp", sp)), (None if tp is None else parse_degrees("--tp", tp))


def resolve_engine_options(
    *,
    engine: str,
    engine_flag: str = "--engine",
    optimizer_impl: Optional[str] = None,
    loss: Optional[str] = None,
    offload_optimizer: Optional[str] = None,
    offload_param: Optional[str] = None,
    buckets: str = "hf",
    reduce_bucket_size: Optional[float] = None,
    allgather_bucket_size: Optional[float] = None,
    prefetch_bucket_size: Optional[float] = None,
    overlap_comm: Optional[str] = None,
) -> dict[str, int | bool]:
    """Checks of the engine-dependent flags, each naming the flag; returns the plan's bucket fields
    (and ``overlap_comm`` when ``--overlap-comm`` is given: on or off).

    An optimizer implementation the engine lacks (``--engine fsdp --optimizer-impl deepspeed-cpu``),
    NVMe offload with ``--engine fsdp`` (ZeRO++ comes only from a config: probe checks it), an unknown ``--loss`` or
    ``--buckets`` or ``--overlap-comm`` and a bucket size ≤ 0 are errors (exit 2). Combinations with the plan
    (``deepspeed-cpu`` without optimizer offload) are checked where the plan is known
    (:func:`zeroplan.estimator.optimizer.resolve_optimizer_impl`). ``engine_flag`` names the
    option in messages (``--backend`` for probe and tune).
    """
    from zeroplan.estimator.optimizer import ENGINE_OPTIMIZER_IMPLS, OPTIMIZER_IMPLS
    from zeroplan.estimator.plans import BUCKET_CONVENTIONS, ENGINES, bucket_sizes
    from zeroplan.spec import LOSSES

    check_choice_option(engine_flag, engine, ENGINES)
    check_choice_option("--optimizer-impl", optimizer_impl, OPTIMIZER_IMPLS)
    if optimizer_impl is not None and optimizer_impl not in ENGINE_OPTIMIZER_IMPLS[engine]:
        raise SpecError(
            f"--optimizer-impl {optimizer_impl!r} does not exist for {engine_flag} {engine}; "
            f"choose one of {', '.join(ENGINE_OPTIMIZER_IMPLS[engine])}"
        )
    if engine in TORCH_ENGINES and "nvme" in (offload_optimizer, offload_param):
        raise SpecError(f"{engine_flag} {engine} has no NVMe offload (FSDP2 offers CPUOffloadPolicy only); use --offload-optimizer cpu or {engine_flag} deepspeed")
    check_choice_option("--loss", loss, LOSSES)
    check_choice_option("--buckets", buckets, BUCKET_CONVENTIONS)
    sizes = {}
    for flag, name, value in (("--reduce-bucket-size", "reduce_bucket_size", reduce_bucket_size),
                              ("--allgather-bucket-size", "allgather_bucket_size", allgather_bucket_size),
                              ("--prefetch-bucket-size", "prefetch_bucket_size", prefetch_bucket_size)):
        if value is not None and not (value > 0 and float(value).is_integer()):
            raise SpecError(f"{flag} {value:g} is not valid; give a positive whole number of elements such as 5e8")
        sizes[name] = int(value) if value is not None else None
    check_choice_option("--overlap-comm", overlap_comm, OVERLAP_COMM_CHOICES)
    fields: dict[str, int | bool] = dict(bucket_sizes(buckets, **sizes))
    if overlap_comm is not None:
        fields["overlap_comm"] = overlap_comm == "on"
    return fields


#: ``--overlap-comm`` values.
OVERLAP_COMM_CHOICES = ("on", "off")


def resolve_gpus(gpus: Optional[int], *, runs_here: bool) -> int:
    """``--gpus`` as given, else this machine's GPU count (NVML), else
    :data:`RUN_GPUS_WITHOUT_GPU` (probe, tune) or :data:`PLAN_GPUS_WITHOUT_GPU` (estimate, export)."""
    if gpus is not None:
        if gpus < 1:
            raise SpecError(f"--gpus {gpus} is not valid; give at least 1")
        return gpus
    from zeroplan.profiles import local_gpu_count

    return local_gpu_count() or (RUN_GPUS_WITHOUT_GPU if runs_here else PLAN_GPUS_WITHOUT_GPU)


def with_peft(model_spec: ModelSpec, model_arg: Optional[str], *, precision: str, **options) -> ModelSpec:
    """``PeftOptions(**options).apply(model_spec, model_arg, precision=precision)``."""
    return PeftOptions(**options).apply(model_spec, model_arg, precision=precision)


def check_plan_options(
    *, stage: Optional[int], offload_optimizer: Optional[str], offload_param: Optional[str], checkpointing: Optional[str]
) -> None:
    """Checks of the plan flags' spellings (combinations are checked by :class:`~zeroplan.spec.Plan`)."""
    if stage is not None and stage not in (0, 1, 2, 3):
        raise SpecError(f"--stage {stage} is not valid; choose 0, 1, 2 or 3")
    check_choice_option("--offload-optimizer", offload_optimizer, OFFLOADS)
    check_choice_option("--offload-param", offload_param, OFFLOADS)
    check_choice_option("--checkpointing", checkpointing, (*CHECKPOINTING, *CHECKPOINTING_ALIASES))


_STDOUT_CONSOLE = None


def stdout_console(**kwargs):
    """A rich ``Console`` on stdout (``kwargs`` as ``Console`` takes them) whose closed pipe raises
    ``BrokenPipeError``: :func:`zeroplan.cli.main` then ends quietly with its own exit status
    (rich's default, ``Console.on_broken_pipe``, exits 1, which estimate uses for "no plan fits")."""
    global _STDOUT_CONSOLE
    if _STDOUT_CONSOLE is None:
        from rich.console import Console

        class _StdoutConsole(Console):
            def on_broken_pipe(self) -> None:
                self.quiet = True  # nothing more to write
                raise BrokenPipeError

        _STDOUT_CONSOLE = _StdoutConsole
    return _STDOUT_CONSOLE(**kwargs)


def write_output(text: str, output: Optional[Path]) -> None:
    """Print ``text`` or write it atomically to ``output`` (an existing file is replaced only on success)."""
    if output is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    if output.is_dir():
        raise SpecError(f"--output {output} is a directory; give a file path")
    parent = output.parent if str(output.parent) else Path(".")
    if not parent.exists():
        raise SpecError(f"--output {output}: folder {parent} does not exist")
    tmp = output.with_name(f".{output.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text if text.endswith("\n") else text + "\n")
        os.replace(tmp, output)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SpecError(f"--output {output}: cannot write ({exc.strerror})") from None


def terminal_width(piped: int) -> Optional[int]:
    """A rich Console's ``width``: None (the terminal's, or ``COLUMNS``) on a terminal or when
    ``COLUMNS`` is set; ``piped`` columns when output goes to a pipe or file without it."""
    return None if sys.stdout.isatty() or os.environ.get("COLUMNS") else piped


def require_runtime(command: str) -> None:
    """SpecError unless torch is installed: probe, tune and calibrate run real engines.

    Checked before anything is launched or written, so a light install (``pip install -e .``)
    gets one line with the fix instead of every rank failing to start ``torch.distributed.run``.
    """
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise SpecError(f"zeroplan {command} runs real engines and needs torch and deepspeed; install them with pip install 'zeroplan[runtime]'")
