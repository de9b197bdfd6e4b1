"""Host RAM per rank and per node, phase by phase: model build, engine init, step, checkpoint save.

Pure arithmetic (stdlib only). A rank's host memory is not one steady figure: it peaks while the
model is built (before ZeRO partitions anything), again when ``deepspeed.initialize`` allocates
the offload buffers, at the first optimizer step (CPU Adam creates its moments lazily) and at
checkpoint save (16-bit weights gathered on rank 0). :func:`host_phases` returns every phase
itemized; a plan fits the node only if its worst phase does.

Sources (DeepSpeed 0.19, ``deepspeed/runtime/...``; PyTorch 2.x), cited per item below:

* ``zero/stage_1_and_2.py``: ``__init__`` lines 557-575 (fp32 master partition, 16-bit staging
  buffer), 653-661 (gradient staging), ``initialize_optimizer_states`` lines 935-941 (fp32
  gradient partition); with ``offload_optimizer`` ``self.device = 'cpu'`` (line 278).
* ``zero/stage_1_and_2.py`` at stage 2 with CPU offload and more than one micro-step per optimizer step:
  ``copy_grads_in_partition`` calls ``async_accumulate_grad_in_cpu_via_gpu`` (0.18.2 lines
  1421-1425 and 1286-1330; 0.19.8 lines 2160-2168 and 1809-1853), which keeps in
  ``accumulated_grads_in_cpu`` one host buffer per parameter of the rank's partition, the
  parameter's whole gradient in its dtype (``torch.zeros(param.numel(), dtype=param.dtype,
  device=self.device)``, pinned with ``pin_memory``): :func:`offload_accumulation_bytes`.
* ``zero/stage3.py``: lines 789-795 (``grad_partitions_flat_buffer``), 898-908 (16-bit parameter
  partitions on the host with ``offload_param``), 1148-1152 (fp32 master partition),
  ``initialize_optimizer_states`` lines 1303-1342 (a transient fp32 buffer of the largest
  sub-group's full numel; one fp32 gradient buffer per sub-group on the host).
* ``ops/adam/cpu_adam.py`` ``DeepSpeedCPUAdam.step``: ``exp_avg`` and ``exp_avg_sq`` created
  with ``torch.zeros_like`` at the first step (lazy state).
* ``zero/offload_config.py``: ``pin_memory`` defaults to True; NVMe ``buffer_count`` 5 × ``buffer_size``
  1e8 for parameters, ``buffer_count`` 4 for the optimizer swapper.
* ``engine.py`` ``_zero3_consolidated_16bit_state_dict`` (line 5631): every parameter gathered and
  copied to the host (``param.detach().cpu()``) on rank 0 when
  ``stage3_gather_16bit_weights_on_model_save`` is true.
* PyTorch ``ATen/core/CachingHostAllocator.h`` line 305: pinned host blocks are rounded up to the
  next power of two (``c10::llvm::PowerOf2Ceil``), so a pinned buffer of 1.1 GiB holds 2 GiB.
* What a process holds beyond tensors, measured (torch 2.13.0+cpu, DeepSpeed 0.19.8, Python 3.11,
  ``/proc/self/status`` of one process, identical over repeated runs; docs/host-memory.md):
  ``import torch, deepspeed`` leaves 249 MiB resident (164 MiB anonymous, 85 MiB file-backed
  library pages); ``deepspeed.initialize`` then imports what the script had not: ``torch._dynamo``
  (torch/optim/optimizer.py ``add_param_group`` is wrapped by ``torch._disable_dynamo``, whose
  first call imports it: torch/_compile.py), +70 MiB anonymous, and DeepSpeed's engine, ZeRO
  optimizer and op modules, +44 MiB anonymous; the libraries they map add 16 MiB of file-backed
  pages, shared by every rank of the node.
* glibc malloc (mallopt(3), "M_MMAP_THRESHOLD": the threshold is dynamic — freeing a chunk that
  was mmapped raises it to that chunk's size, at most ``DEFAULT_MMAP_THRESHOLD_MAX`` = 32 MiB on
  64-bit systems): once a tensor of up to 32 MiB has been freed, tensors of that size come from
  the heap, which keeps freed chunks resident for reuse (:func:`allocator_retention_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroplan.estimator.engine_work import parameter_tensor_sizes
from zeroplan.estimator.frozen import once
# The per-tensor and pinned-block buffers (re-exported here: zeroplan.estimator.host.pinned_bytes etc.).
from zeroplan.estimator.host_blocks import offload_accumulation_bytes, pinned_bytes, reuse_cached_blocks, zero3_pinned_param_blocks
from zeroplan.estimator.host_save import MODEL_SAVES, trainer_save_bytes
from zeroplan.spec.engines import engine_facts
from zeroplan.estimator.memory import largest_param_numel
from zeroplan.estimator.plan_cache import PlanCache

from zeroplan.spec import (
    ClusterSpec,
    ModelSpec,
    Plan,
    TrainingSpec,
    bytes_per_param,
    optimizer_state_bytes_per_param,
    resolve_engine_knobs,
)

__all__ = [
    "BUILDS",
    "plan_host_phases",
    "HOST_PHASES",
    "HostPhase",
    "HostPhases",
    "CPU_IMPORT_BASELINE_BYTES",
    "MALLOC_MMAP_THRESHOLD_MAX_BYTES",
    "PROCESS_BASELINE_BYTES",
    "RUNTIME_IMPORT_BYTES",
    "RUNTIME_SHARED_LIBRARY_BYTES",
    "TORCH_DYNAMO_IMPORT_BYTES",
    "allocator_retention_bytes",
    "default_build",
    "host_phases",
    "offload_accumulation_bytes",
    "pinned_bytes",
    "stage_for_build",
]

#: How the model is built on each rank before ``deepspeed.initialize``:
#: ``fp32`` (``nn.Module`` default dtype, the whole model on every rank), ``bf16`` (the whole
#: model in 16 bit: ``torch_dtype=torch.bfloat16`` / ``low_cpu_mem_usage``), ``zero_init``
#: (``deepspeed.zero.Init``: partitioned as it is built, stage 3 only), ``meta`` (meta device, then
#: weights loaded shard by shard: one layer at a time), ``rank0`` (rank 0 loads the whole model in
#: 16 bit, the other ranks build it on the meta device and receive it by broadcast: accelerate's
#: ``fsdp_cpu_ram_efficient_loading``, torchtune's distributed recipes; one copy per node).
BUILDS = ("fp32", "bf16", "zero_init", "meta", "rank0")
#: Phase names, in the order a run goes through them.
HOST_PHASES = ("model_build", "engine_init", "step", "checkpoint_save")
#: Host RSS of one training process before it builds anything on CUDA: the interpreter, torch,
#: DeepSpeed and the CUDA runtime's host-side libraries. An assumption (2 GiB), not measured on
#: a GPU node; on CPU probes the worker measures its own baseline instead.
PROCESS_BASELINE_BYTES = 2 * 1024**3
_MiB = 1024**2
#: Resident bytes of one process after ``import torch, deepspeed`` on a CPU-only build, measured
#: (torch 2.13.0+cpu, DeepSpeed 0.19.8, Python 3.11: VmRSS 249 MiB = 164 MiB anonymous + 85 MiB
#: file-backed). The process baseline of CPU estimates; CPU probes measure their own instead.
CPU_IMPORT_BASELINE_BYTES = 249 * _MiB
#: ``torch._dynamo``, imported by the first ``torch.optim.Optimizer`` (``add_param_group`` is
#: wrapped by ``torch._disable_dynamo``, which imports it on first call: torch/_compile.py) or by
#: the first op under a ``TorchDispatchMode`` (the CPU probe's memory tracker): 810 modules,
#: +70 MiB anonymous, measured as above.
TORCH_DYNAMO_IMPORT_BYTES = 70 * _MiB
#: The rest of what ``deepspeed.initialize`` imports on first call (engine, ZeRO optimizers, the
#: CPU Adam and communication op libraries): +44 MiB anonymous per process, measured as above
#: with a one-layer model (ZeRO-2 and ZeRO-3, CPU offload: the same to the MiB).
RUNTIME_IMPORT_BYTES = 44 * _MiB
#: File-backed pages of the libraries those imports map (+16 MiB by the end of the first step):
#: shared by the ranks of a node, so counted once per node.
RUNTIME_SHARED_LIBRARY_BYTES = 16 * _MiB
#: glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit systems (mallopt(3)).
MALLOC_MMAP_THRESHOLD_MAX_BYTES = 32 * _MiB


def allocator_retention_bytes(*, stage: int, params: int, trainable_params: int, largest_param: int, bytes_per_param: int) -> int:
    """Heap bytes glibc keeps resident after a step on a CPU device: the step's per-parameter temporaries.

    glibc (mallopt(3), M_MMAP_THRESHOLD) serves a request below the mmap threshold from its heap
    and keeps the chunk for reuse when it is freed; the threshold is dynamic and rises to the size
    of any freed mmapped chunk, up to 32 MiB (``DEFAULT_MMAP_THRESHOLD_MAX``), so after the first
    step every per-parameter tensor of up to 32 MiB comes from the heap and stays resident once
    freed (the heap is trimmed only at its top). A step allocates and frees, per parameter: its
    full gradient in the training precision before the reduce (p·Ψ_trainable), and in stage 3
    also the parameter gathered for the forward and again for the backward
    (``partition_parameters.py`` ``all_gather_coalesced``, released after use: 2·p·Ψ). When the
    largest parameter's size exceeds the threshold it is mmapped and returned on free, so it is
    left out.
    """
    mmapped = largest_param if bytes_per_param * largest_param > MALLOC_MMAP_THRESHOLD_MAX_BYTES else 0
    gradients = max(trainable_params - mmapped, 0)
    gathered = 2 * max(params - mmapped, 0) if stage == 3 else 0
    return bytes_per_param * (gradients + gathered)


@dataclass(frozen=True)
class HostPhase:
    """Host bytes of one phase: items per rank, plus items the node holds once (on its first rank)."""

    name: str
    """One of :data:`HOST_PHASES`."""
    per_rank: dict[str, int] = field(default_factory=dict)
    """Bytes every rank of the node holds at this phase's peak, by item."""
    rank0_only: dict[str, int] = field(default_factory=dict)
    """Bytes the node holds once, counted on its first rank: gathered weights at save, and the
    file-backed pages of shared libraries every rank maps."""
    ranks: int = 1
    """Ranks on the node."""

    @property
    def per_rank_bytes(self) -> int:
        """Host bytes of the busiest rank (rank 0 when it gathers)."""
        return sum(self.per_rank.values()) + sum(self.rank0_only.values())

    @once
    def per_node_bytes(self) -> int:
        """Host bytes of the whole node at this phase (computed once: phases are shared between plans)."""
        return self.ranks * sum(self.per_rank.values()) + sum(self.rank0_only.values())

    def as_dict(self) -> dict:
        return {
            "per_rank": self.per_rank_bytes,
            "per_node": self.per_node_bytes,
            "items_per_rank": dict(self.per_rank),
            "items_rank0_only": dict(self.rank0_only),
        }


@dataclass(frozen=True)
class HostPhases:
    """Every phase of one plan on one node; the node must hold the worst."""

    phases: tuple[HostPhase, ...]
    build: str
    """How the model is built (:data:`BUILDS`)."""
    pin_memory: bool
    """Offload buffers pinned (DeepSpeed's default) and rounded to powers of two (CUDA only)."""
    pinned: tuple[str, ...] = ()
    """Names of the items DeepSpeed pins when ``pin_memory`` is on (page-locked: never swapped out)."""

    @once
    def worst(self) -> HostPhase:
        """The phase with the largest per-node bytes (the first of equals, in run order). Computed
        once: the phases are shared by every plan with the same host layout (:func:`plan_host_phases`)."""
        return max(self.phases, key=lambda ph: ph.per_node_bytes)

    @property
    def per_node_bytes(self) -> int:
        return self.worst.per_node_bytes

    @property
    def per_rank_bytes(self) -> int:
        return max(ph.per_rank_bytes for ph in self.phases)

    def get(self, name: str) -> HostPhase:
        return next(ph for ph in self.phases if ph.name == name)

    def as_dict(self) -> dict:
        return {ph.name: ph.as_dict() for ph in self.phases}


def stage_for_build(stage: int | None, build: str | None) -> int | None:
    """The stage filter a space is searched with under ``build``: ``zero_init`` is
    ``deepspeed.zero.Init``, which partitions the parameters as they are built and exists at
    stage 3 only (runtime/zero/partition_parameters.py), so a space left open (``stage`` None)
    narrows to 3; a stage given is kept (a stage 0-2 with ``zero_init`` is refused where the
    options are read: :func:`~zeroplan.estimator.usecase.check_model_build`)."""
    return 3 if build == "zero_init" and stage is None else stage


def default_build(model: ModelSpec, plan: Plan, *, engine: str = "deepspeed") -> str:
    """How a run of ``plan`` builds its model on the host when nobody says (``--model-build``).

    * A quantized base: ``meta`` — ``from_pretrained(quantization_config=...)`` loads and quantizes
      tensor by tensor, never the whole model in fp32.
    * PyTorch's engines (``fsdp``, ``fsdp1``): ``rank0`` — the FSDP recipes load on rank 0 and
      broadcast, or build on the meta device: accelerate with ``fsdp_cpu_ram_efficient_loading`` (accelerate 1.15
      utils/dataclasses.py:1975-1977 reads FSDP_CPU_RAM_EFFICIENT_LOADING; its FSDP guides and the
      Hugging Face 70B/405B posts turn it on), torchtune's ``full_finetune_distributed`` /
      ``lora_finetune_distributed`` (model built under ``torch.device("meta")``, the memory-mapped
      checkpoint loaded into the shards), torchtitan (meta device, then ``init_weights`` or a DCP
      load, each rank its shards: less still). A script that calls ``from_pretrained`` on every
      rank is ``bf16``.
    * DeepSpeed stage 3: ``zero_init`` — Hugging Face's ``from_pretrained`` builds under
      ``deepspeed.zero.Init`` when ZeRO-3 is configured (``is_deepspeed_zero3_enabled``).
    * DeepSpeed stages 0-2: ``fp32`` — every rank builds the whole ``nn.Module`` in fp32 before
      ``deepspeed.initialize`` (the conservative case; ``from_pretrained(dtype=bfloat16)`` is ``bf16``).
    """
    if model.peft is not None and model.peft.base_quant != "none":
        return "meta"
    if engine_facts(engine).torch:
        return "rank0"
    return "zero_init" if plan.stage == 3 else "fp32"


def host_phases(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    plan: Plan,
    *,
    device: str = "cuda",
    build: str | None = None,
    pin_memory: bool = True,
    gather_16bit_on_save: bool = False,
    param_swap_elements: int = 5 * 100_000_000,
    optimizer_swap_buffers: int = 4,
    device_bytes: dict[str, int] | None = None,
    baseline_bytes: int | None = None,
    checkpoint_bytes_on_cpu: int = 0,
    dynamo_in_baseline: bool = False,
    built_params: int | None = None,
    model_save: str = "engine",
    accumulates: bool | None = None,
) -> HostPhases:
    """Host bytes per rank and per node of ``plan``, phase by phase (sources in the module docstring).

    With Ψ parameters, N ranks, partition s = ⌈Ψ/N⌉, p bytes per 16-bit parameter, L the largest
    parameter tensor:

    * model_build: ``fp32`` 4Ψ, ``bf16`` 2Ψ per rank (plus, for tied embeddings, the output layer's
      own V·h matrix that exists until it is tied); ``zero_init`` 4·(largest layer) plus the
      16-bit partition p·s when it lives on the host; ``meta`` 4·(largest layer); ``rank0``
      4·(largest layer) per rank plus p·Ψ on rank 0 (the loaded model before its broadcast).
    * engine_init: what ``deepspeed.initialize`` allocates on the host. Stages 1-2 with CPU offload:
      fp32 master 4s, 16-bit staging p·s, fp32 gradient partition 4s, gradient staging p·L.
      Stage 3 with CPU offload: fp32 master 4s, gradient partition p·s, one fp32 gradient buffer
      per sub-group 4s, and while it runs a transient fp32 buffer of the largest sub-group's
      partition (4·min(s, sub_group_size)). offload_param cpu: the 16-bit partition p·s; pinned
      (CUDA), stage 3 keeps every parameter's own power-of-two block beside the flat buffer
      (:func:`zero3_pinned_param_blocks`; model_build under ``zero_init`` holds those blocks).
      NVMe: the pinned swap buffers.
    * step: engine_init (less the transient) + Adam's two fp32 moments 8s (CPU Adam allocates them
      at the first step); stage 2 with CPU offload and more than one micro-step per optimizer
      step (``accumulates``; None: ``plan.gradient_accumulation_steps > 1``): + one host buffer per
      parameter of the partition, about p·s (:func:`offload_accumulation_bytes`, each pinned block a
      power of two).
    * checkpoint_save: step + the 16-bit model gathered on rank 0 (p·Ψ) with
      ``gather_16bit_on_save``; ``model_save="trainer"`` (the Hugging Face Trainer) at stages 0-2:
      + p·Ψ on every rank (:func:`~zeroplan.estimator.host_save.trainer_save_bytes`).

    Pinned buffers count as :func:`pinned_bytes` on CUDA (power-of-two blocks); on ``device="cpu"``
    DeepSpeed's CPU accelerator pins nothing. ``device="cpu"`` (a CPU probe, where the "device" is
    host memory too) adds ``device_bytes`` — the device-side bytes per rank at each phase, by
    phase name — and every phase carries the process baseline (``baseline_bytes``, default
    :data:`PROCESS_BASELINE_BYTES` on CUDA, :data:`CPU_IMPORT_BASELINE_BYTES` on CPU).

    Beyond tensors, from engine init on every rank holds the modules ``deepspeed.initialize``
    imports (:data:`TORCH_DYNAMO_IMPORT_BYTES` + :data:`RUNTIME_IMPORT_BYTES`; their libraries'
    pages, :data:`RUNTIME_SHARED_LIBRARY_BYTES`, once per node) — ``dynamo_in_baseline``: torch._dynamo
    was imported before the measured baseline (a CPU probe's memory tracker imports it). On CPU the step's
    temporaries are host memory, and glibc keeps up to :func:`allocator_retention_bytes` of them.
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}: choose cuda or cpu")
    if build is None:
        build = default_build(model, plan)
    if build not in BUILDS:
        raise ValueError(f"build={build!r}: choose one of {', '.join(BUILDS)}")
    if model_save not in MODEL_SAVES:
        raise ValueError(f"model_save={model_save!r}: choose one of {', '.join(MODEL_SAVES)}")
    if build == "zero_init" and plan.stage != 3:
        raise ValueError("build='zero_init' needs stage 3 (deepspeed.zero.Init partitions only stage-3 parameters)")
    n = plan.zero_group_size(cluster.gpus)  # ZeRO's partitions: world/tp (Plan.zero_group_size)
    g = cluster.gpus_in_node
    psi = model.total_params
    p = bytes_per_param(training.precision)
    s = -(-psi // n)
    # Offloaded optimizer buffers hold trainable parameters only (a LoRA adapter, not the frozen
    # base: zeroplan.estimator.peft); without peft s_t = s.
    s_t = -(-model.trainable_params // n)
    largest = largest_param_numel(model)
    knobs = resolve_engine_knobs(plan, model.hidden_size, trainable_params=model.peft and model.trainable_params)
    pinned_on = pin_memory and device == "cuda"
    pinned_names: list[str] = []

    def pin(nbytes: int) -> int:
        return pinned_bytes(nbytes) if pinned_on else nbytes

    if baseline_bytes is None:
        baseline_bytes = CPU_IMPORT_BASELINE_BYTES if device == "cpu" else PROCESS_BASELINE_BYTES
    dev = device_bytes or {}
    # What the process holds beyond tensors once deepspeed.initialize ran (module docstring).
    imports = {"runtime_imports": RUNTIME_IMPORT_BYTES}
    if not dynamo_in_baseline:
        imports["torch_dynamo_import"] = TORCH_DYNAMO_IMPORT_BYTES
    shared_libraries = {"runtime_libraries_once_per_node": RUNTIME_SHARED_LIBRARY_BYTES}

    def with_common(name: str, items: dict[str, int]) -> dict[str, int]:
        out = {"process_baseline": baseline_bytes}
        if name != "model_build":
            out.update(imports)
        out.update({k: v for k, v in items.items() if v})
        if device == "cpu" and dev.get(name):
            out["device_states_on_host"] = dev[name]
        return out

    # -- model build --------------------------------------------------------------------------
    host_partition = plan.offload_param == "cpu" or device == "cpu"
    # ZeRO-3's per-parameter pinned partitions (zero.Init, or the engine's own Init of a built model).
    param_blocks: dict[int, int] = {}
    if plan.stage == 3 and plan.offload_param == "cpu" and pinned_on:
        param_blocks = zero3_pinned_param_blocks(
            parameter_tensor_sizes(model), world_size=n, bytes_per_param=p, persistence_threshold=knobs["stage3_param_persistence_threshold"]
        )
    cached = dict(param_blocks)
    # A tied output layer is first built as its own V×h matrix (nn.Linear in the model's __init__,
    # GPT-2 and Hugging Face models alike), then replaced by the embedding (tie_weights): both
    # exist for a moment while the whole model is built.
    untied = model.vocab_size * model.hidden_size if model.tied_embeddings else 0
    # ``built_params``: what a rank builds before the engine shards it (the whole model under AutoTP,
    # whose ``model`` here is one rank's shard: deepspeed.initialize slices the built model).
    psi_built = built_params or psi
    if build == "fp32":
        built = {"model_fp32": 4 * psi_built, "untied_head_transient": 4 * untied}
    elif build == "bf16":
        built = {"model_16bit": p * psi_built, "untied_head_transient": p * untied}
    elif build == "zero_init":
        built = {"layer_being_built_fp32": 4 * model.largest_layer_params}
        if host_partition:
            built["param_partition_16bit"] = sum(b * c for b, c in param_blocks.items()) if param_blocks else p * s
    else:
        built = {"layer_being_loaded_fp32": 4 * model.largest_layer_params}
    # rank0: the other ranks build on the meta device; rank 0 alone holds the loaded 16-bit model
    # until it is broadcast (partitioned by the engine).
    build_rank0 = {"model_16bit_on_rank0": p * psi_built} if build == "rank0" else {}

    # -- engine init: offload buffers --------------------------------------------------------
    init: dict[str, int] = {}
    transient: dict[str, int] = {}
    if plan.offload_optimizer in ("cpu", "nvme"):
        if plan.stage in (1, 2):
            init["fp32_master_partition"] = pin(4 * s_t)
            init["bit16_staging_partition"] = pin(p * s_t)
            init["fp32_grad_partition"] = pin(4 * s_t)
            init["grad_staging_largest_param"] = pin(p * largest)
            pinned_names.extend(("fp32_master_partition", "bit16_staging_partition", "fp32_grad_partition", "grad_staging_largest_param"))
        else:
            sub_group = min(s_t, knobs["sub_group_size"])
            n_sub = -(-s_t // sub_group)
            if plan.offload_optimizer == "cpu":
                init["fp32_master_partition"] = 4 * s_t
                if pinned_on:
                    # Allocated after the per-parameter blocks were freed: a block of the same size serves.
                    per_group = [4 * sub_group] * n_sub if n_sub > 1 else [4 * s_t]
                    init["fp32_grad_per_subgroup"] = sum(reuse_cached_blocks(cached, nbytes) for nbytes in per_group)
                else:
                    init["fp32_grad_per_subgroup"] = 4 * s_t
                pinned_names.append("fp32_grad_per_subgroup")
            else:
                init["optimizer_swap_buffers"] = optimizer_swap_buffers * pin(4 * sub_group)
                pinned_names.append("optimizer_swap_buffers")
            init["grad_partition_buffer"] = pin(p * s_t)
            pinned_names.append("grad_partition_buffer")
            # largest_numel sums ds_tensor.ds_numel, the partition sizes (partition_parameters.py
            # line 1847): the largest sub-group's partition, at most about sub_group_size.
            transient["init_fp32_grad_buffer"] = 4 * min(s_t, knobs["sub_group_size"])
    if plan.offload_param == "cpu":
        # The flat buffers hold the trainable parameters' partitions (stage3.py:891-907 sums the
        # trainable groups); a frozen base keeps its per-parameter pinned partitions.
        init["param_partition_16bit"] = pin(p * (s_t if param_blocks else s))
        pinned_names.append("param_partition_16bit")
        if param_blocks:
            init["param_partitions_per_parameter"] = sum(b * c for b, c in cached.items())
            pinned_names.append("param_partitions_per_parameter")
    elif plan.offload_param == "nvme":
        # partitioned_param_swapper.py: one pinned tensor of buffer_count × buffer_size elements.
        init["param_swap_buffers"] = pin(p * param_swap_elements)
        pinned_names.append("param_swap_buffers")
    if checkpoint_bytes_on_cpu:
        init["activation_checkpoints"] = checkpoint_bytes_on_cpu

    # -- step: CPU Adam's moments appear at the first step ------------------------------------
    step = dict(init)
    if plan.offload_optimizer == "cpu":
        # Moments only: the fp32 master copy is fp32_master_partition above (K − 4 in the ZeRO paper's K).
        moments = optimizer_state_bytes_per_param(training.optimizer, "bf16") - 4
        if moments:
            step["optimizer_moments"] = moments * s_t
    if accumulates is None:
        accumulates = plan.gradient_accumulation_steps > 1
    if accumulates and plan.stage == 2 and plan.offload_optimizer in ("cpu", "nvme"):
        # Unpinned, p·s_t; pinned, each tensor's power-of-two block. A LoRA run's trainable tensors are
        # its adapters: counted unrounded (their shapes are not listed here).
        step["offload_grad_accumulation"] = (
            offload_accumulation_bytes(parameter_tensor_sizes(model), world_size=n, bytes_per_param=p, pinned=True)
            if pinned_on and model.peft is None else p * s_t
        )
        pinned_names.append("offload_grad_accumulation")

    if device == "cpu":
        # The step's device temporaries are host memory here, served and kept by glibc's heap; on a
        # GPU node they are device memory and the host allocates none per step (CPU Adam updates
        # its buffers in place).
        step["allocator_retention"] = allocator_retention_bytes(
            stage=plan.stage, params=psi, trainable_params=model.trainable_params, largest_param=largest, bytes_per_param=p
        )

    # -- checkpoint save ----------------------------------------------------------------------
    save = dict(step)
    if model_save == "trainer":
        quantized = model.peft is not None and model.peft.base_quant != "none"
        save.update(trainer_save_bytes(stage=plan.stage, total_params=psi, bytes_per_param=p, tp=plan.tp, quantized_base=quantized))
    rank0 = {"gathered_16bit_model": p * psi} if (gather_16bit_on_save and plan.stage == 3) else {}

    phases = (
        HostPhase("model_build", with_common("model_build", built), rank0_only=build_rank0, ranks=g),
        HostPhase("engine_init", with_common("engine_init", {**init, **transient}), rank0_only=shared_libraries, ranks=g),
        HostPhase("step", with_common("step", step), rank0_only=shared_libraries, ranks=g),
        HostPhase("checkpoint_save", with_common("checkpoint_save", save), rank0_only={**shared_libraries, **rank0}, ranks=g),
    )
    return HostPhases(phases=phases, build=build, pin_memory=pin_memory, pinned=tuple(pinned_names))


#: Plan fields :func:`host_phases` does not read: micro-batch, accumulation and recomputation
#: change activations and time, not the host's buffers (checkpoints kept on the CPU come in as
#: ``checkpoint_bytes_on_cpu``; whether there is more than one micro-step, which adds ZeRO-2's
#: offload accumulation buffers, as ``accumulates``). Every other field, including one added later, keys the cache.
_NOT_ON_HOST = frozenset({"micro_batch", "gradient_accumulation_steps", "checkpointing"})
_HOST_CACHE = PlanCache(host_phases, ignores=_NOT_ON_HOST)


def plan_host_phases(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan, *, device: str, build: str | None,
    checkpoint_bytes_on_cpu: int, built_params: int | None = None, model_save: str = "engine",
) -> HostPhases:
    """:func:`host_phases` with its other defaults, computed once for the plans that differ only in
    micro-batch, accumulation or checkpointing (an estimate's 196 plans have a dozen host layouts;
    :class:`~zeroplan.estimator.plan_cache.PlanCache`). The result is shared: read it, do not change it."""
    return _HOST_CACHE(model, cluster, training, plan, device=device, build=build, checkpoint_bytes_on_cpu=checkpoint_bytes_on_cpu,
                       built_params=built_params, model_save=model_save, accumulates=plan.gradient_accumulation_steps > 1)
