"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) memory per GPU for one plan. Stdlib only.

The plan's stage maps onto PyTorch's engines as zeroplan's runtime runs them
(``zeroplan/runtime/rank/backends/fsdp.py``):

* stage 0: ``DistributedDataParallel`` with ``torch.autocast`` (fp32 parameters, 16-bit compute)
* stage 1: DDP + ``ZeroRedundancyOptimizer`` (optimizer states sharded)
* stage 2: FSDP2 ``fully_shard(reshard_after_forward=False)`` per block and at the root
* stage 3: FSDP2 ``fully_shard(reshard_after_forward=True)`` per block and at the root
* offload cpu: FSDP2 ``CPUOffloadPolicy`` (parameters, gradients and the optimizer step on the host)

Every byte below is read from PyTorch 2.x ``torch/distributed/fsdp/_fully_shard/``:

* ``_fsdp_param.py`` (``FSDPParam._init_sharded_param``): each parameter is sharded on dim 0 in
  its *original* dtype (fp32 when the model is built in fp32) — the sharded parameter is the
  optimizer's parameter, so it is also the fp32 master copy: m·Ψ/N, no separate 4Ψ master.
  Precision ``bf16-pure`` (the model cast with ``.to(torch.bfloat16)``, no MixedPrecisionPolicy,
  as torchtune's ``dtype: bf16``): m = 2, gathered, reduced and accumulated in bf16 too (with no
  policy ``param_dtype`` and ``reduce_dtype`` are the parameter's own), and torch.optim's states
  follow the parameter's dtype (torch/optim/adamw.py ``torch.zeros_like(p)``).
* ``_fsdp_collectives.py`` ``foreach_all_gather``/``foreach_all_gather_copy_out``: a group is
  all-gathered in ``MixedPrecisionPolicy.param_dtype`` (p bytes) into unsharded parameters that
  live until the group reshards: after forward (``reshard_after_forward=True``) or after its
  backward. The root group (embeddings, final norm, head) is gathered again in its pre-backward
  (when the gradient reaches its output) and held until the root's post-backward at the very
  end of backward. ``_fsdp_state.py``: backward prefetches one group ahead.
* ``foreach_reduce``: the group's unsharded gradients (p bytes) are copied into a reduce-scatter
  input in ``reduce_dtype`` (r bytes, fp32 in the runtime's policy) before they are freed; the
  reduce-scatter output is the sharded gradient, kept in the parameter's dtype (m·Ψ/N) until
  ``zero_grad(set_to_none=True)``. With ``CPUOffloadPolicy`` it is copied to the host.

Checked against live-tensor timelines of real FSDP2 runs on 2 CPU ranks
(``benchmarks/fsdp_memory_timeline.py``) and probes (``benchmarks/bench_fsdp_memory.py``).
The optimizer step's temporaries come from :func:`zeroplan.estimator.optimizer.optimizer_step_temporaries`.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.estimator.activations import ActivationMemory
from zeroplan.estimator.fsdp1 import flat_unit_gradients
from zeroplan.estimator.memory import ModelStates
from zeroplan.estimator.optimizer import PAGED_IMPLS, optimizer_step_temporaries, paged_state_bytes
from zeroplan.estimator.peft import dequant_workspace_bytes, parameter_bytes, quantized_weight_bytes
from zeroplan.spec import ClusterSpec, ModelSpec, Plan, SpecError, TrainingSpec, bytes_per_param, master_bytes_per_param

__all__ = [
    "FsdpGroups",
    "FsdpMemory",
    "fsdp_groups",
    "fsdp_memory",
    "check_fsdp_plan",
    "trainable_tensor_numels",
]

#: Bytes of the reduce-scatter in mixed precision (``MixedPrecisionPolicy(reduce_dtype=
#: torch.float32)``, the runtime's policy and torchtitan's default ``mixed_precision_reduce =
#: "float32"``). The sharded parameter's bytes m are the model's own dtype:
#: :func:`zeroplan.spec.master_bytes_per_param` (fp32 as built, bf16 in bf16-pure).
_REDUCE_BYTES = 4


def check_fsdp_plan(plan: Plan) -> None:
    """Raise SpecError for what PyTorch's engines cannot do: NVMe offload, offload below stage 2."""
    if plan.offload_optimizer == "nvme" or plan.offload_param == "nvme":
        raise SpecError("engine fsdp has no NVMe offload (FSDP2 offers CPUOffloadPolicy only); use --offload-optimizer cpu or --engine deepspeed")
    if plan.stage < 2 and (plan.offload_optimizer != "none" or plan.offload_param != "none"):
        raise SpecError(f"engine fsdp offloads only with FSDP2 (stage 2 or 3), not stage {plan.stage}; use --stage 2 or 3")


@dataclass(frozen=True)
class FsdpGroups:
    """How ``fully_shard`` per block + at the root splits the parameters into all-gather groups."""

    root: int
    """Parameters of the root group: input embedding, output projection when untied, final norm."""
    block: int
    """Parameters of one block group (the rest divided evenly over the blocks)."""
    blocks: int
    """Number of block groups (transformer layers)."""


def _trainable_split(model: ModelSpec) -> tuple[int, int, int, bool, int]:
    """(Ψ_t, trainable in the root group, trainable per block group, head trains, largest
    trainable tensor). LoRA adapters on per-block modules leave the root (embedding, final norm,
    head) frozen; a partial fine-tune (unknown layout) spreads Ψ_t in proportion."""
    groups = fsdp_groups(model)
    peft = model.peft
    if peft is None:
        return model.params, groups.root, groups.block, True, model.largest_layer_params
    psi_t = peft.trainable_params
    if peft.method == "lora" and peft.adapted and all(m.count == model.num_layers for m in peft.adapted) and not (
        peft.added_params - sum(m.rank * (m.in_features + m.out_features) * m.count for m in peft.adapted)
    ):
        largest = max(m.rank * max(m.in_features, m.out_features) for m in peft.adapted)
        return psi_t, 0, -(-psi_t // model.num_layers), False, largest
    root_t = psi_t * groups.root // model.total_params
    return psi_t, root_t, -(-(psi_t - root_t) // model.num_layers), True, model.largest_layer_params


def trainable_tensor_numels(model: ModelSpec) -> dict[int, int]:
    """Element count → number of trainable tensors of that size (what bitsandbytes decides
    per tensor: :func:`~zeroplan.estimator.optimizer.paged_state_bytes`).

    LoRA adapters counted module by module: A is r × in, B is out × r. A full fine-tune: the
    norm weights (two per block and the final one, h each) and one tensor holding the rest (the
    matrices, all far above bitsandbytes' thresholds for any model worth paging). Other
    adapters: their trainable count as one tensor.
    """
    peft = model.peft
    if peft is None:
        norms = min(model.params, (2 * model.num_layers + 1) * model.hidden_size)
        rest = model.params - norms
        out = {model.hidden_size: 2 * model.num_layers + 1} if norms else {}
        if rest:
            out[rest] = out.get(rest, 0) + 1
        return out
    if peft.method == "lora" and peft.adapted:
        out: dict[int, int] = {}
        for m in peft.adapted:
            for numel in (m.rank * m.in_features, m.rank * m.out_features):
                out[numel] = out.get(numel, 0) + m.count
        extra = peft.trainable_params - sum(k * v for k, v in out.items())
        if extra > 0:
            out[extra] = out.get(extra, 0) + 1
        return out
    return {peft.trainable_params: 1}


def _optimizer_placement(model: ModelSpec, training: TrainingSpec, impl: str, moments: int, count: int, shards: int) -> tuple[int, dict[str, int]]:
    """(optimizer-state bytes in torch's allocator, host-backed items) for ``count`` trainable
    parameters split over ``shards`` ranks: torch.optim's ``moments`` bytes each, or
    bitsandbytes' paged states (device part in torch's allocator, unified part backed by host RAM)."""
    if impl not in PAGED_IMPLS or training.optimizer not in ("adam", "adamw"):
        return moments * -(-count // shards), {}
    paged = paged_state_bytes(trainable_tensor_numels(model), impl=impl, optimizer=training.optimizer)
    device = -(-(paged["device_states"] + paged["absmax"]) // shards)
    return device, {"paged_optimizer_states": -(-paged["unified_states"] // shards)}


def _quantized_base(model: ModelSpec) -> tuple[int, int, int]:
    """(quantized elements, their stored bytes, their replicated constants' bytes) of a QLoRA /
    int8 base; zeros otherwise.

    bitsandbytes keeps the codes in the parameter (``Params4bit``: uint8, two NF4 codes per byte;
    ``Int8Params``: int8), which ``fully_shard`` shards on dim 0 and all-gathers as stored (not
    cast to ``param_dtype``: it is not floating point); the quantization constants live in
    ``quant_state`` (absmax, nested absmax / row scales), outside the parameter, so every rank
    keeps them whole. Measured on 2 CPU ranks: an NF4 Llama under FSDP2 gives the unsharded
    model's loss (benchmarks/results/fsdp_nf4_loss.txt).
    """
    peft = model.peft
    if peft is None or peft.base_quant == "none" or not peft.quantized_params:
        return 0, 0, 0
    parts = quantized_weight_bytes(peft.base_quant, peft.quantized_params, peft.quantized_rows)
    stored = parts.get("nf4_codes", 0) + parts.get("int8_weights", 0)
    return peft.quantized_params, stored, sum(parts.values()) - stored


def fsdp_groups(model: ModelSpec) -> FsdpGroups:
    """Root and per-block parameter counts of ``fully_shard`` applied per block and at the root.

    Root: V·h (embedding; a second V·h when the head is untied) + h (final norm); the other
    parameters (blocks, and small extras such as learned positions) spread over the L blocks.
    """
    root = min(model.total_params, model.embedding_params * (1 if model.tied_embeddings else 2) + model.hidden_size)
    return FsdpGroups(root=root, block=-(-(model.total_params - root) // model.num_layers), blocks=model.num_layers)


@dataclass(frozen=True)
class FsdpMemory:
    """Per-GPU bytes of one PyTorch-engine plan: the states and the items alive at each moment.

    ``phases`` maps each candidate peak moment to the items alive then on top of the states'
    parameters and optimizer states (which are alive throughout); the peak is the largest.
    """

    states: ModelStates
    """Sharded fp32 parameters (the master copy), sharded fp32 gradients, optimizer moments."""
    phases: dict[str, dict[str, int]]
    """``loss_backward``, ``block_backward``, ``root_post_backward``, ``optimizer_step`` → items."""
    host_items: dict[str, int]
    """Per-rank host bytes under CPUOffloadPolicy (params, gradients, optimizer states)."""

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: sum(self.phases[k].values()))

    @property
    def peak_allocated(self) -> int:
        """Parameters + optimizer states on the GPU + the largest phase."""
        return self.states.params + self.states.optimizer_states + sum(self.phases[self.peak_phase].values())


def fsdp_memory(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    plan: Plan,
    acts: ActivationMemory,
    *,
    device: str = "cuda",
    optimizer_impl: str = "torch",
    activation_total: int | None = None,
    flat_units: bool = False,
) -> FsdpMemory:
    """Memory of ``plan`` under PyTorch's engines (module docstring: sources per term).

    With Ψ parameters, N = cluster.gpus, p compute bytes (``param_dtype``: 2 in bf16/fp16, 4 in
    fp32), m = 4 (fp32 sharded parameter and gradient; 2 in bf16-pure), r = 4 (fp32
    reduce-scatter; 2 in bf16-pure, the parameter's dtype), K' the optimizer's moment bytes (8
    for Adam, in the parameter's dtype: 4 in bf16-pure), root/block group sizes from
    :func:`fsdp_groups`:

    * states: params m·Ψ/N, optimizer K'·Ψ/N, gradients m·Ψ/N (created by the reduce-scatters,
      freed by ``zero_grad(set_to_none=True)``: absent at the loss's backward).
    * loss_backward: all activations incl. the logits' term; unsharded parameters p·Ψ when
      nothing reshards after forward (stage 2), none in stage 3 (the root reshards too).
    * block_backward (first block in backward): activations without the logits' term + the
      recompute working set; root parameters and the head's gradient, both p bytes, held until
      the root's post-backward; the block's and the prefetched block's parameters (stage 3) or
      every block's (stage 2); the block's unsharded gradients (p).
    * block_reduce_scatter (that block's post-backward): its own saved and rebuilt activations
      freed, its parameters resharded, its reduce-scatter input (r) beside the unsharded
      gradients (p) and then beside the output (r/N) — never the block's activations and its
      reduce-scatter buffers together (counting both read +11 % on gpu_check --cpu's FSDP2 row).
    * root_post_backward: every sharded gradient + the root's unsharded parameters and
      gradients (p each) + its reduce-scatter input (r). (The block rule above — parameters
      resharded before the reduce — would drop the root's parameters here, but the measured
      stage-3 + full-recompute probe, benchmarks/results/fsdp_memory.txt, reads -0.5 % with them
      and -2.8 % without: not applied until that is understood.)
    * optimizer_step: the sharded gradients + :func:`optimizer_step_temporaries`.

    Stages 0–1 (DDP): parameters m·Ψ, DDP's gradient buckets m·Ψ (``Reducer``, a flat copy
    of every gradient: ``gradient_as_bucket_view=False``), gradients m·Ψ created in backward,
    optimizer K'·Ψ (stage 1: /N), and autocast's cached p-byte weight casts, saved for backward
    (none in bf16-pure: the weights already are in the compute dtype). At world size 1 there is
    no DDP (a single-device loop, torchtune's ``*_single_device`` recipes, zeroplan's runtime):
    the reducer and its buckets (torch/nn/parallel/distributed.py, built in ``DDP.__init__``)
    do not exist.
    ``device="cpu"``: the host is the device, so CPU offload moves nothing (what a CPU-only
    probe measures). ``activation_total`` replaces the formula's total (``--trace``).
    ``flat_units``: FSDP1 (``--engine fsdp1``) at stages 2-3: a unit's gradient covers its whole
    flat parameter when any of it trains, ``no_sync()`` accumulates unsharded p-byte gradients
    and the root stays gathered from forward to backward (:mod:`zeroplan.estimator.fsdp1`).
    """
    check_fsdp_plan(plan)
    n = cluster.gpus
    psi = model.total_params
    p = bytes_per_param(training.precision)
    # A frozen base (LoRA, docs/peft.md): gradients, DDP buckets, reduce-scatters and optimizer
    # states exist for the trainable parameters only; every parameter is still sharded and
    # gathered. Without peft all of these equal the full counts.
    psi_t, root_t, block_t, head_trains, largest_t = _trainable_split(model)
    m = master_bytes_per_param(training.precision)
    # Mixed precision reduces in fp32; bf16-pure and fp32 in the parameter's own dtype.
    r = _REDUCE_BYTES if p < m else m
    # torch.optim's moments take the parameter's dtype: fp32 (8 B for Adam), bf16 in bf16-pure (4 B).
    moments = {"adamw": 8, "adam": 8, "sgd": 4, "lion": 4, "adafactor": 0}[training.optimizer] * m // 4
    groups = fsdp_groups(model)
    on_gpu = device == "cuda"
    act_total = acts.total if activation_total is None else activation_total
    logits = min(acts.logits, act_total)
    layers_only = act_total - logits
    loss_acts = act_total - acts.recompute_working_set

    def shard(count: int) -> int:
        return -(-count // n)

    if plan.stage <= 1:
        params, grads = m * psi, m * psi_t
        quantized, workspace = 0, {}
        if model.peft is not None and model.peft.base_quant != "none":
            # A quantized base (QLoRA) stays as bitsandbytes stores it (Linear4bit/Linear8bitLt
            # weights, never an fp32 copy); peft's prepare_model_for_kbit_training keeps every
            # other parameter — norms, embeddings, head, adapters — in fp32. bitsandbytes
            # dequantizes one weight per matmul into the compute dtype instead of autocast.
            # In bf16-pure (torchtune's QLoRA recipes: no prepare_model_for_kbit_training) they stay bf16.
            quantized = model.peft.quantized_params
            params = parameter_bytes(model, "bf16-pure" if m == 2 else "fp32").total
            workspace = {"dequantized_weight": dequant_workspace_bytes(model, training.precision)}
        optimizer, paged_host = _optimizer_placement(model, training, optimizer_impl, moments, psi_t, n if plan.stage == 1 else 1)
        # autocast casts each matmul weight once per forward (the cast cache) and the matmul's
        # backward saves it: every floating-point weight but the untied input embedding's, p bytes.
        cast_cache = p * (psi - quantized - (0 if model.tied_embeddings else model.embedding_params)) if p < m else 0
        # One process trains without DDP (function docstring): no reducer, no buckets.
        bucket = {**({"ddp_gradient_buckets": m * psi_t} if n > 1 else {}), **workspace}
        partition = shard(psi_t) if plan.stage == 1 else psi_t
        temps = optimizer_step_temporaries(
            impl=optimizer_impl, optimizer=training.optimizer, partition_params=partition, largest_param=largest_t,
            state_bytes=m, on_gpu=on_gpu,
        )
        # Gradient accumulation under ``no_sync()`` (the runtime's loop): the earlier micro-steps'
        # gradients stay in ``param.grad`` through the last micro-step's backward.
        accumulated = {"accumulated_gradients": grads} if plan.gradient_accumulation_steps > 1 else {}
        phases = {
            "loss_backward": {**bucket, "activations": loss_acts, "autocast_weight_casts": cast_cache, **accumulated},
            "block_backward": {**bucket, "activations": layers_only, "autocast_weight_casts": cast_cache,
                               "head_gradient": m * model.embedding_params if head_trains else 0, **accumulated},
            "optimizer_step": {**bucket, "gradients": grads, **temps},
        }
        if training.optimizer_in_backward:
            grads, phases = _in_backward_phases(training, plan, n, m=m, largest=largest_t, optimizer_impl=optimizer_impl,
                                                on_gpu=on_gpu, common={**bucket, "autocast_weight_casts": cast_cache},
                                                loss_acts=loss_acts, layers_only=layers_only)
        states = ModelStates(params=params, gradients=grads, optimizer_states=optimizer)
        return FsdpMemory(states=states, phases=phases, host_items=paged_host)

    offload = (plan.offload_optimizer == "cpu" or plan.offload_param == "cpu") and on_gpu
    # FSDP2 with a quantized base (QLoRA): the codes are sharded and all-gathered as stored, the
    # constants replicated (_quantized_base), and each 4-bit/int8 matmul dequantizes its weight
    # into a p-byte workspace, again in backward (estimator.peft.dequant_workspace_bytes).
    quantized, q_stored, q_constants = _quantized_base(model)
    float_psi = psi - quantized
    workspace_bytes = dequant_workspace_bytes(model, training.precision)
    dequant = {"dequantized_weight": workspace_bytes} if workspace_bytes else {}
    params = m * shard(float_psi) + shard(q_stored) + q_constants
    if training.optimizer_in_backward:
        _check_in_backward(plan, n)
    if flat_units:
        # FSDP1 flat parameters (zeroplan.estimator.fsdp1): gradients, reduce-scatters and
        # accumulation cover every unit that holds a trainable parameter, whole; the optimizer
        # still steps only the trainable ones.
        units = flat_unit_gradients(root_params=groups.root, block_params=groups.block, blocks=groups.blocks,
                                    root_trainable=root_t, block_trainable=block_t)
        grad_psi, root_g, block_g = units.total, units.root, units.block
    else:
        grad_psi, root_g, block_g = psi_t, root_t, block_t
    grads = m * shard(grad_psi)
    optimizer, paged_host = _optimizer_placement(model, training, optimizer_impl, moments, psi_t, n)
    unsharded_all = p * float_psi + q_stored
    root_p = p * groups.root
    head_grad = p * model.embedding_params if head_trains else 0
    # The quantized weights are the blocks' linears (the root group stays floating point).
    block_bytes = p * (groups.block - quantized // groups.blocks) + q_stored // groups.blocks
    if plan.stage == 3:
        gathered_blocks = 2 * block_bytes  # the running block and the one prefetched
        loss_unsharded = 0
    else:
        gathered_blocks = unsharded_all - root_p
        loss_unsharded = unsharded_all
    temps = optimizer_step_temporaries(
        impl=optimizer_impl, optimizer=training.optimizer, partition_params=shard(psi_t), largest_param=shard(largest_t),
        state_bytes=m, on_gpu=on_gpu,
    )
    # The first block's own saved tensors (and, under recomputation, its rebuilt activations).
    own_block_acts = min(layers_only, acts.per_layer + (acts.recompute_working_set if activation_total is None else 0))
    # Gradient accumulation with ``set_requires_gradient_sync(False)`` on all but the last
    # micro-step (the runtime's loop): no reduce-scatter runs, and each parameter keeps its
    # unsharded gradient, upcast to ``reduce_dtype`` (torch/distributed/fsdp/_fully_shard/
    # _fsdp_param.py ``to_accumulated_grad_if_needed``: ``unsharded_accumulated_grad``), until
    # its group's post-backward in the last micro-step reduce-scatters it: all of them at the
    # loss's backward and the first block's, the root's until the root's post-backward.
    # FSDP1's no_sync() keeps the compute-dtype gradient as autograd made it (p bytes).
    acc_bytes = p if flat_units or p >= 4 else r
    accumulating = plan.gradient_accumulation_steps > 1
    acc_all = {"accumulated_unsharded_gradients": acc_bytes * grad_psi} if accumulating else {}
    acc_root = {"accumulated_unsharded_gradients": acc_bytes * root_g} if accumulating else {}
    # FSDP1 never reshards the root after forward (fsdp1 module docstring): held into backward.
    root_held = {"root_unsharded_params": root_p} if flat_units and plan.stage == 3 else {}
    # Context parallelism: the ring attention backward's buffers inside the block's backward
    # (zeroplan.estimator.context_parallel.ring_attention_backward_bytes), one item.
    ring = {"ring_attention_backward": _ring_backward(model, training, plan)} if plan.cp > 1 else {}
    phases = {
        "loss_backward": {"activations": loss_acts, "unsharded_params": loss_unsharded, **root_held, **acc_all},
        "block_backward": {
            **ring,
            "activations": layers_only,
            "root_unsharded_params": root_p,
            "head_gradient": head_grad,
            "unsharded_params": gathered_blocks,
            "block_unsharded_gradients": p * block_g,
            **dequant,
            **acc_all,
        },
        # The block's post-backward (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py
        # ``post_backward``): its backward has already freed its saved tensors (and the rebuilt
        # ones under recomputation), it reshards its parameters first, then ``foreach_reduce``
        # (_fsdp_collectives.py) copies the unsharded gradients into the reduce-scatter input,
        # frees them, and allocates the output (r/N of the input; a full copy at N = 1).
        "block_reduce_scatter": {
            "activations": layers_only - own_block_acts,
            "root_unsharded_params": root_p,
            "head_gradient": head_grad,
            "unsharded_params": gathered_blocks - block_bytes,
            "reduce_scatter_input": r * block_g,
            "block_unsharded_gradients": max(p * block_g, r * shard(block_g)),
            **acc_all,
        },
        "root_post_backward": {
            "sharded_gradients": 0 if offload else grads,
            "root_unsharded_params": root_p,
            "root_unsharded_gradients": p * root_g,
            "reduce_scatter_input": r * root_g,
            **({"reduce_scatter_output": r * shard(root_g)} if offload else {}),
            **acc_root,
        },
        "optimizer_step": {} if offload else {"sharded_gradients": grads, **temps},
    }
    host: dict[str, int] = {}
    if offload:
        host = {"params": params, "gradients": grads, "optimizer_states": optimizer, **temps}
        states = ModelStates(
            params=0, gradients=0, optimizer_states=0,
            offloaded_params=params, offloaded_gradients=grads, offloaded_optimizer_states=optimizer,
        )
    else:
        states = ModelStates(params=params, gradients=grads, optimizer_states=optimizer)
    return FsdpMemory(states=states, phases=phases, host_items={**host, **paged_host})


def _ring_backward(model: ModelSpec, training: TrainingSpec, plan: Plan) -> int:
    """Bytes of one layer's ring-attention backward buffers on a cp rank (freed when it returns)."""
    from zeroplan.estimator.context_parallel import ring_attention_backward_bytes

    return sum(ring_attention_backward_bytes(model, seq_len=training.seq_len, micro_batch=plan.micro_batch,
                                             precision=training.precision, cp=plan.cp).values())


def _in_backward_phases(training: TrainingSpec, plan: Plan, n: int, *, m: int, largest: int, optimizer_impl: str, on_gpu: bool,
                        common: dict[str, int], loss_acts: int, layers_only: int) -> tuple[int, dict[str, dict[str, int]]]:
    """(gradient bytes, phases) of one process that steps each parameter in its gradient hook.

    torchtune (fef3ed10, recipes/full_finetune_single_device.py:277-284 and torchtune/utils/
    memory.py:142-160, ``register_optim_in_bwd_hooks``) gives every parameter its own optimizer
    and registers ``register_post_accumulate_grad_hook(optim_step)``, where ``optim_step`` runs
    ``step()`` then ``zero_grad()`` (set_to_none): a gradient lives from its accumulation to the
    end of its own step. Autograd accumulates one parameter at a time, so at most the largest
    trainable tensor's gradient (m bytes each) and its step's temporaries are alive beside the
    activations; there is no optimizer step after backward (measured on CPU:
    benchmarks/results/optimizer_in_backward.txt). The head's gradient is stepped as soon as
    it exists, so it is not held through the blocks' backward either.
    """
    _check_in_backward(plan, n)
    if plan.gradient_accumulation_steps > 1:
        raise SpecError(f"optimizer_in_backward cannot accumulate gradients ({plan.gradient_accumulation_steps} micro-steps); "
                        "use a global batch of micro_batch × GPUs")
    temps = optimizer_step_temporaries(impl=optimizer_impl, optimizer=training.optimizer, partition_params=largest,
                                       largest_param=largest, state_bytes=m, on_gpu=on_gpu)
    in_flight = {"gradients": m * largest, **temps}
    return m * largest, {
        "loss_backward": {**common, "activations": loss_acts},
        "block_backward": {**common, "activations": layers_only, **in_flight},
    }


def _check_in_backward(plan: Plan, n: int) -> None:
    """SpecError unless one process trains without DDP or FSDP, where optimizer in backward is modelled."""
    if plan.stage > 1 or n > 1:
        raise SpecError(f"optimizer_in_backward is modelled for one process without DDP or FSDP (torchtune's single-device "
                        f"recipes), not stage {plan.stage} on {n} GPUs; use --stage 0 --gpus 1")
