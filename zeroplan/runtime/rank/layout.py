"""A probe's parallel layout on the rank: Ulysses sequence parallelism (DeepSpeed ALST) and AutoTP.

The degrees are read where DeepSpeed reads them, from the config the script hands to the engine:
``sequence_parallel_size`` (deepspeed/runtime/config.py, the data-parallel size is the world over
it) and ``tensor_parallel.autotp_size`` (deepspeed/runtime/tensor_parallel/config.py
``TPTrainingConfig.autotp_size``; engine.py ``_configure_tensor_parallel``). ``zeroplan probe
--sp/--tp`` writes them (:func:`with_layout`); a user's config that carries them is run as it is.

What a plain DeepSpeed script does not do itself, the rank does around ``deepspeed.initialize``,
the way accelerate does it for HF Trainer (accelerate/accelerator.py ``_prepare_deepspeed``):

* sequence parallelism: :meth:`UlyssesSPAttentionHF.register_with_transformers` on the model
  (its attention implementation, the micro batch) returns the sp process groups (``mpu``), which
  go to ``deepspeed.initialize``. Each forward's batch becomes this rank's sequence shard through
  DeepSpeed's own :class:`UlyssesSPDataLoaderAdapter` (labels padded with -100 and shifted into
  ``shift_labels`` before the split, ``position_ids`` kept global), and the loss is the sp group's
  token-weighted mean computed by transformers' ``deepspeed_sp_compute_loss``
  (transformers/integrations/deepspeed.py), as the HF Trainer does under ALST.
  The adapter gathers one sample from every sp rank and serves them over sp micro-steps; the probe
  takes the first (the sp group's first rank's sample) for each micro-step, so one optimizer step
  consumes micro batch × accumulation × data-parallel samples, as DeepSpeed counts
  ``train_batch_size`` under sp.
* tensor parallelism: DeepSpeed shards the model itself; it checks that every rank of a tp group
  feeds the same batch (engine.py ``check_dataloader_inputs_same_across_ranks``: "Data
  inconsistency within the TP group"), which a tp-aware sampler gives. The probe broadcasts the
  tp group's first rank's batch before each forward, so a script with a plain per-rank sampler
  runs too.

Under HF Trainer / accelerate, accelerate passes ``mpu`` itself and adapts the data loader; the
rank then leaves the engine alone (``mpu`` already in the call) and only sets accelerate's
``PARALLELISM_CONFIG_*`` environment so a script without a ``parallelism_config`` gets one
(accelerate/accelerator.py: ``ACCELERATE_USE_PARALLELISM_CONFIG``; parallelism_config.py reads
``PARALLELISM_CONFIG_SP_SIZE`` / ``_SP_BACKEND``).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Layout", "layout_of_config", "with_layout", "apply_probe_layout", "environment_for", "accelerate_environment",
    "prepare_initialize", "adapt_engine", "init_comm_before_ulysses", "fix_gloo_all_gather", "copy_sp_shards_on_cpu",
    "check_probe_layout",
]


@dataclass(frozen=True)
class Layout:
    """Sequence- and tensor-parallel degrees of a run (1: off)."""

    sp: int = 1
    """Ulysses sequence-parallel degree (``sequence_parallel_size``)."""
    tp: int = 1
    """AutoTP tensor-parallel degree (``tensor_parallel.autotp_size``)."""

    @property
    def trivial(self) -> bool:
        return self.sp <= 1 and self.tp <= 1


def _degree(value) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


def layout_of_config(config: dict | None) -> Layout:
    """The degrees a DeepSpeed config asks for (absent or 0/1: off; AutoTP's default autotp_size is 0)."""
    if not isinstance(config, dict):
        return Layout()
    tp_block = config.get("tensor_parallel")
    tp = _degree(tp_block.get("autotp_size")) if isinstance(tp_block, dict) else 1
    return Layout(sp=_degree(config.get("sequence_parallel_size")), tp=tp)


def with_layout(config: dict, *, sp: int = 1, tp: int = 1, world_size: int) -> dict:
    """``config`` with the DeepSpeed keys for ``sp``/``tp`` (a copy) and ``train_batch_size`` as
    DeepSpeed's batch assertion counts it: micro × accumulation × ``world_size / sp``.

    deepspeed/runtime/config.py ``DeepSpeedConfig.__init__``: with Ulysses' ``mpu``
    (parallel_state_sp) the world is ``dist.get_world_size() / sp``; a plain script's AutoTP
    config is parsed before the engine builds its tp groups (deepspeed/__init__.py ``initialize``
    passes ``mpu=None``), so the tp ranks are counted as data-parallel ones there (measured: tp=2
    on 2 ranks with train_batch_size 1 fails "1 != 1 * 1 * 2"). Under ZeRO-3 the config is parsed
    a second time, by ``zero.Init`` inside the stage-3 optimizer (zero/partition_parameters.py
    ``Init.__init__``: ``DeepSpeedConfig(config, mpu)`` with ``mpu`` = DeepSpeed's tp groups, whose
    data-parallel world is world / tp), and no ``train_batch_size`` satisfies both (measured: tp=2,
    ZeRO-3, 2 ranks: "2 != 1 * 1 * 1"). So with AutoTP the key is left out, and DeepSpeed derives it
    from micro batch × accumulation in each parse (config.py ``_set_batch_related_parameters``).
    """
    out = copy.deepcopy(config)
    if sp > 1:
        out["sequence_parallel_size"] = sp
    if tp > 1:
        block = dict(out.get("tensor_parallel") or {})
        block["autotp_size"] = tp
        out["tensor_parallel"] = block
    dp = world_size // max(sp, 1)
    micro, accum = out.get("train_micro_batch_size_per_gpu"), out.get("gradient_accumulation_steps", 1)
    if tp > 1 and isinstance(micro, int):
        out.pop("train_batch_size", None)
    elif isinstance(micro, int) and isinstance(accum, int) and "train_batch_size" in out:
        out["train_batch_size"] = micro * accum * dp
    return out


def read_config(spec: dict) -> dict | None:
    """The DeepSpeed config the probe wrote for the script (None: the script brings its own)."""
    path = spec.get("config_path")
    if not path or not Path(path).is_file():
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def accelerate_environment(layout: Layout) -> dict[str, str]:
    """accelerate's ``ParallelismConfig`` from the environment, for a Trainer script without one
    (accelerate/parallelism_config.py ``__post_init__``; accelerate/accelerator.py builds it only
    when ``ACCELERATE_USE_PARALLELISM_CONFIG`` is true). Empty without sp: AutoTP needs none,
    accelerate reads ``tensor_parallel.autotp_size`` from the DeepSpeed config."""
    if layout.sp <= 1:
        return {}
    # accelerate's DeepSpeedSequenceParallelConfig leaves the attention unset unless told; sdpa is
    # its documented default and what a CPU run has (export PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION
    # to run another: the rank only sets what is not set).
    return {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": str(layout.sp),
            "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed", "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION": "sdpa"}


def _micro_batch(kwargs: dict, config: dict | None) -> int:
    params = kwargs.get("config_params") or kwargs.get("config")
    for source in (params, config):
        if isinstance(source, dict) and isinstance(source.get("train_micro_batch_size_per_gpu"), int):
            return source["train_micro_batch_size_per_gpu"]
    return 1


def prepare_initialize(args: tuple, kwargs: dict, layout: Layout, config: dict | None) -> dict | None:
    """Before ``deepspeed.initialize``: register Ulysses attention on the HF model and pass its sp
    groups as ``mpu`` (returns the state :func:`adapt_engine` needs; None when nothing was done:
    no sp, or the caller, e.g. accelerate, passed its own ``mpu``)."""
    if layout.sp <= 1 or kwargs.get("mpu") is not None:
        return None
    model = kwargs.get("model", args[1] if len(args) > 1 else None)
    if getattr(model, "config", None) is None:
        raise ValueError(
            f"sequence_parallel_size {layout.sp}: Ulysses sequence parallelism (DeepSpeed ALST) runs Hugging Face "
            "models (UlyssesSPAttentionHF needs model.config); this model has none")
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    attn = getattr(model.config, "_attn_implementation", None) or "sdpa"
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=attn, sequence_parallel_size=layout.sp,
        micro_batch_size=_micro_batch(kwargs, config), seq_length_is_variable=True)
    kwargs["mpu"] = mpu
    return {"mpu": mpu}


def _sp_batch(kwargs: dict, mpu, device) -> dict:
    """This rank's shard of the sp group's first sample, through DeepSpeed's adapter."""
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    batch = {k: v for k, v in kwargs.items() if v is not None}
    ids = batch.get("input_ids")
    if ids is None or not torch.is_tensor(ids):
        raise ValueError("sequence parallelism: the forward got no input_ids tensor; Ulysses shards input_ids, labels and position_ids")
    if "labels" not in batch:
        raise ValueError("sequence parallelism: the forward got no labels; Ulysses computes the loss from shift_labels across the sp group")
    batch.pop("attention_mask", None)  # Ulysses drops masks (ulysses_sp.py uattn_wrapper) and masks by position_ids
    if "position_ids" not in batch:
        batch["position_ids"] = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
    adapter = UlyssesSPDataLoaderAdapter([batch], sp_rank=mpu.get_sequence_parallel_rank(), sp_group=mpu.get_sequence_parallel_group(),
                                         sp_world_size=mpu.get_sequence_parallel_world_size(), device=device)
    shard = next(adapter)
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in shard.items()}


def _broadcast_tp(kwargs: dict, args: tuple):
    """The tp group's first rank's inputs on every rank of the group (DeepSpeed's groups)."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    group = groups.get_tensor_model_parallel_group()
    holder = [(args, kwargs)]
    dist.broadcast_object_list(holder, src=groups.get_tensor_model_parallel_src_rank(), group=group)
    return holder[0]


def adapt_engine(engine, layout: Layout, sp_state: dict | None) -> None:
    """Wrap ``engine.forward`` so the script's full batch runs in the layout (see the module doc)."""
    if layout.tp > 1:
        inner_tp = engine.forward

        def forward_tp(*args, **kwargs):
            args, kwargs = _broadcast_tp(kwargs, args)
            return inner_tp(*args, **kwargs)

        engine.forward = forward_tp
    if sp_state is None:
        return
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

    mpu = sp_state["mpu"]
    inner = engine.forward
    pc = SimpleNamespace(sp_backend="deepspeed", sp_size=layout.sp)

    def forward_sp(*args, **kwargs):
        if args:
            raise ValueError("sequence parallelism: call the engine with keyword inputs (input_ids=..., labels=...)")
        shard = _sp_batch(kwargs, mpu, engine.device)
        loss, outputs = deepspeed_sp_compute_loss(None, lambda **kw: inner(**kw), shard, True, pc)
        outputs["loss"] = loss
        return outputs

    engine.forward = forward_sp


def environment_for(spec: dict) -> tuple[Layout, dict | None]:
    """(layout, config) the rank runs: from the config file the probe wrote."""
    config = read_config(spec)
    layout = layout_of_config(config)
    if spec.get("kind") == "script":
        for key, value in accelerate_environment(layout).items():
            os.environ.setdefault(key, value)
    return layout, config


def apply_probe_layout(config: dict | None, plan, *, sp: int, tp: int, world_size: int):
    """``zeroplan probe --sp/--tp``: (config, plan) with the layout; the config's own keys when
    no flag is given. A layout the world cannot hold is one error line (SpecError)."""
    import dataclasses

    from zeroplan.spec import SpecError

    for flag, value in (("--sp", sp), ("--tp", tp)):
        if value < 1:
            raise SpecError(f"{flag} {value} is not valid; give a whole number >= 1 (1: off)")
    given = layout_of_config(config)
    sp = sp if sp > 1 else given.sp
    tp = tp if tp > 1 else given.tp
    if world_size % (sp * tp):
        raise SpecError(f"--sp {sp} × --tp {tp} = {sp * tp} does not divide the {world_size} ranks; "
                        f"give degrees whose product divides --gpus (data-parallel degree = ranks / (sp × tp))")
    if config is not None and (sp, tp) != (given.sp, given.tp):
        config = with_layout(config, sp=sp, tp=tp, world_size=world_size)
    if plan is not None and (plan.sp, plan.tp) != (sp, tp):
        plan = dataclasses.replace(plan, sp=sp, tp=tp)
    return config, plan


def init_comm_before_ulysses(layout: Layout) -> None:
    """Under sp, make ``register_with_transformers`` find deepspeed.comm initialised.

    accelerate registers Ulysses before ``deepspeed.initialize`` (accelerator.py
    ``_prepare_deepspeed``), and parallel_state_sp.py ``initialize_sequence_parallel`` asserts
    ``deepspeed.comm.is_initialized()``; on CPU (``--use_cpu``) accelerate has set up
    torch.distributed only, so the assertion fails (measured: HF Trainer, sp=2, 2 CPU ranks).
    ``deepspeed.init_distributed`` over the existing process group is what the engine would do next.
    """
    if layout.sp <= 1:
        return
    import deepspeed
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    original = UlyssesSPAttentionHF.register_with_transformers.__func__

    def register_with_transformers(cls, *args, **kwargs):
        if not ds_comm.is_initialized():
            import torch.distributed as dist

            deepspeed.init_distributed(dist_backend=dist.get_backend() if dist.is_initialized() else None)
        return original(cls, *args, **kwargs)

    UlyssesSPAttentionHF.register_with_transformers = classmethod(register_with_transformers)


def copy_sp_shards_on_cpu(layout: Layout) -> None:
    """Under sp, give each rank its sequence shard as its own tensor, as a GPU run has it.

    DeepSpeed's ``UlyssesSPDataLoaderAdapter.refill`` cuts every tensor of the batch with
    ``batch[k][:, start:end].cpu()`` (deepspeed 0.19.8 runtime/sequence_parallel/ulysses_sp.py,
    the "batch sharding" loop) and the engine's device copy follows; on a GPU rank both copy, so
    the shard is contiguous. On a CPU rank ``Tensor.cpu()`` and ``.to("cpu")`` return the same
    strided view, and with more than one sample per micro batch the view spans rows: transformers'
    ``ForCausalLMLoss`` then fails at ``shift_labels.view(-1)`` (loss/loss_utils.py; measured: tune
    over ``--sp 1,2`` at micro batch 8, every sp plan "view size is not compatible"). The copy here
    is the one the GPU run makes; on a GPU it finds contiguous tensors and copies nothing. Covers
    the probe's own forward (``_sp_batch``) and accelerate's adapted data loader alike.
    """
    if layout.sp <= 1:
        return
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    original = UlyssesSPDataLoaderAdapter.refill
    if getattr(original, "_zeroplan_copies", False):
        return

    def refill(self):
        original(self)
        for shard in self.micro_batches:
            for key, value in shard.items():
                if torch.is_tensor(value) and not value.is_contiguous():
                    shard[key] = value.contiguous()

    refill._zeroplan_copies = True
    UlyssesSPDataLoaderAdapter.refill = refill


def fix_gloo_all_gather(layout: Layout) -> None:
    """Under sp on gloo, give ``torch.distributed.nn.functional.all_gather`` a backward that works
    in a group without global rank 0.

    The sp-group loss (transformers' ``deepspeed_sp_compute_loss``, the Trainer's and the probe's)
    gathers the ranks' losses with that differentiable all_gather. On gloo its backward emulates
    reduce-scatter with ``_AlltoAll``, which calls ``dist.scatter(..., src=i, group=group)`` with
    the *group* rank ``i`` where scatter takes a global rank (torch/distributed/nn/functional.py
    ``_AlltoAll.forward``): every sp group but the first fails with "Global rank 0 is not part of
    group" (measured: sp=2 × dp=2 on 4 CPU ranks). The replacement's backward is the same sum —
    each rank's gradient for its own entry summed over the group — as an all_reduce. NCCL keeps
    torch's own path.
    """
    if layout.sp <= 1:
        return
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_fn

    original = dist_fn.all_gather

    class _GatherSum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, group, tensor):
            ctx.group = group
            out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group=group))]
            dist.all_gather(out, tensor.contiguous(), group=group)
            return tuple(out)

        @staticmethod
        def backward(ctx, *grads):
            stacked = torch.stack([g.contiguous() for g in grads])
            dist.all_reduce(stacked, group=ctx.group)
            return None, stacked[dist.get_rank(group=ctx.group)]

    def all_gather(tensor, group=dist.group.WORLD):
        if dist.get_backend(group=group) != dist.Backend.GLOO:
            return original(tensor, group=group)
        return _GatherSum.apply(group, tensor)

    dist_fn.all_gather = all_gather


def check_probe_layout(plan, *, world_size: int, model=None, seq_len: int | None = None) -> None:
    """What ``validate`` knows of the layout (ZP26x with the model's heads and the sequence, when
    given), as one error line before anything is launched."""
    from zeroplan.dsconfig.rules.layout import layout_findings
    from zeroplan.spec import SpecError, TrainingSpec

    training = TrainingSpec(seq_len=seq_len) if seq_len else None
    errors = [f for f in layout_findings(plan, world_size=world_size, model=model, training=training) if f.severity == "error"]
    if errors:
        raise SpecError(f"--sp {plan.sp} --tp {plan.tp}: {errors[0].rule_id} {errors[0].message}; {errors[0].fix}; nothing launched")
