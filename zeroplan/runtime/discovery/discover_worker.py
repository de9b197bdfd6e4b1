"""The torch side of model discovery: watch where a script creates its engine and describe the model.

``python -m zeroplan.runtime.discovery.discover_worker SPEC_JSON`` (under a one-process ``torchrun``) runs
the user's script with :data:`WATCHED_ENTRY_POINTS` wrapped. At the first call it writes what the
model is (:func:`describe_model`) to the spec's ``result_path``, lets the engine be built, writes
the shape of the first batch the engine's forward sees, and stops the script. The probe worker
(``zeroplan.runtime.rank.worker``) uses the same :func:`describe_model` and :func:`batch_shape` so a
probe of a plain script learns its model in the same run.

Hugging Face ``Trainer`` (and TRL's trainers, which subclass it) and ``accelerate`` build their
DeepSpeed engine through ``deepspeed.initialize`` too: ``Accelerator._prepare_deepspeed`` reads
``deepspeed.initialize`` at call time (accelerate/accelerator.py), so one wrapper sees all three.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Callable

__all__ = ["WATCHED_ENTRY_POINTS", "describe_model", "batch_shape", "watch_entry_points", "main"]

#: The functions whose first call tells us the model (shown in the "no engine" message).
WATCHED_ENTRY_POINTS = ("deepspeed.initialize", "torch.distributed.fsdp.fully_shard")

#: Attribute names under which modules keep their head counts (GPT-2, Llama, nn.MultiheadAttention, ...).
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "heads")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")


from zeroplan.runtime.rank.moe_leaf import moe_blocks

def _numel(p: Any) -> int:
    # ZeRO-3's zero.Init leaves an empty local tensor and keeps the full size in ds_numel;
    # an FSDP2 DTensor's numel() is already the global size.
    return int(getattr(p, "ds_numel", 0) or p.numel())


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def describe_model(model: Any) -> dict:
    """What the estimator needs to know about a ``torch.nn.Module``.

    ``total_params`` counts shared (tied) parameters once, as ``model.parameters()`` yields them;
    ``largest_layer_params`` is the most parameters any one module holds directly — the rule of
    DeepSpeed's ``model_to_params`` (deepspeed/runtime/zero/stage3.py), whose ZeRO-3 estimate
    gathers a whole module at once. ``hf_config`` is ``model.config.to_dict()`` when the model
    carries a Hugging Face config; ``shape`` is read from the module tree (:func:`_infer_shape`).
    """
    params = list(model.parameters())
    total = sum(_numel(p) for p in params)
    trainable = sum(_numel(p) for p in params if p.requires_grad)
    largest_name, largest = "", 0
    for name, module in model.named_modules():
        n = sum(_numel(p) for p in module.parameters(recurse=False))
        if n > largest:
            largest_name, largest = name or "<root>", n
    sizes: Counter = Counter(_numel(p) for p in params)
    dtypes: Counter = Counter()
    for p in params:
        dtypes[str(p.dtype).removeprefix("torch.")] += _numel(p)
    config = getattr(model, "config", None)
    hf_config = None
    if config is not None and callable(getattr(config, "to_dict", None)):
        try:
            hf_config = _json_safe(config.to_dict())
        except (TypeError, ValueError):
            hf_config = None
    return {
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "total_params": total,
        "trainable_params": trainable,
        "largest_layer_name": largest_name,
        "largest_layer_params": largest,
        "dtype": dtypes.most_common(1)[0][0] if dtypes else "unknown",
        "hf_config": hf_config,
        "shape": _infer_shape(model),
        # (elements, count) per parameter size, largest first: what a reduce bucket is tested against.
        "parameter_sizes": sorted(([n, c] for n, c in sizes.items()), reverse=True)[:64],
        "moe_blocks": moe_blocks(model),
    }


def _int_attr(module: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _infer_shape(model: Any) -> dict:
    """Transformer shape read from the module tree of a model without a Hugging Face config.

    * vocabulary and width: the ``nn.Embedding`` with the most rows;
    * tied: a ``nn.Linear`` whose weight *is* that embedding's weight;
    * layers: the longest ``nn.ModuleList``/``nn.Sequential`` of same-class children (the blocks);
    * MLP width: the widest ``nn.Linear`` side in a block other than the width; gated when two
      linears map width → MLP width (SwiGLU's gate and up);
    * heads: an int attribute named like ``num_heads``/``n_head`` in a block, else width / 64.

    ``inferred`` lists the fields that are guesses rather than read.
    """
    import torch.nn as nn

    guessed: list[str] = []
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    emb = max(embeddings, key=lambda m: m.num_embeddings, default=None)
    blocks: list = []
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            children = list(m.children())
            if len(children) > len(blocks) and children and all(type(c) is type(children[0]) for c in children):
                blocks = children
    block = blocks[0] if blocks else model
    block_linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    if emb is not None:
        hidden, vocab = int(emb.embedding_dim), int(emb.num_embeddings)
    elif block_linears:
        hidden, vocab = int(block_linears[0].in_features), 1
        guessed.append("vocab_size")
    else:
        hidden, vocab = max((int(m.in_features) for m in linears), default=1), 1
        guessed += ["hidden_size", "vocab_size"]
    tied = emb is not None and any(m.weight is emb.weight for m in linears)
    sides = [s for m in block_linears for s in (int(m.in_features), int(m.out_features)) if s != hidden]
    ffn = max(sides, default=4 * hidden)
    if not sides:
        guessed.append("ffn_size")
    gated = sum(1 for m in block_linears if m.in_features == hidden and m.out_features == ffn) >= 2
    heads = None
    kv_heads = None
    for m in block.modules():
        heads = heads or _int_attr(m, _HEAD_ATTRS)
        kv_heads = kv_heads or _int_attr(m, _KV_HEAD_ATTRS)
    if heads is None or hidden % heads:
        heads = max(1, hidden // 64) if hidden % max(1, hidden // 64) == 0 else 1
        guessed.append("num_heads")
    if kv_heads is None or heads % kv_heads:
        kv_heads = heads
    if not blocks:
        guessed.append("num_layers")
    return {
        "hidden_size": hidden,
        "num_layers": max(1, len(blocks)),
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "ffn_size": ffn,
        "vocab_size": vocab,
        "tied_embeddings": bool(tied),
        "gated_mlp": bool(gated),
        "inferred": guessed,
    }


def batch_shape(args: tuple, kwargs: dict) -> tuple[int | None, int | None]:
    """(micro_batch, seq_len) of a forward call: ``input_ids`` if given, else its first tensor.

    A 2-D or wider tensor is read as (batch, sequence, ...); a 1-D one gives the batch only.
    """
    import torch

    tensor = kwargs.get("input_ids")
    if not isinstance(tensor, torch.Tensor):
        candidates = list(args) + list(kwargs.values())
        flat: list = []
        for c in candidates:
            flat.extend(c if isinstance(c, (list, tuple)) else [c])
        tensor = next((t for t in flat if isinstance(t, torch.Tensor)), None)
    if tensor is None or tensor.dim() == 0:
        return None, None
    return int(tensor.shape[0]), (int(tensor.shape[1]) if tensor.dim() >= 2 else None)


def watch_entry_points(
    on_model: Callable[[str, Any], None], on_engine: Callable[[str, Any], None] | None = None, on_frozen: Callable[[Any], None] | None = None
) -> None:
    """Wrap :data:`WATCHED_ENTRY_POINTS`: ``on_model(entry_point, module)`` before the engine is
    built, ``on_engine(entry_point, engine_module)`` after (the module whose forward sees batches).
    An engine built without an optimizer (a TRL reference model:
    :func:`zeroplan.runtime.rank.recipe_watch.frozen_engine_call`) is not the trained model: it goes to
    ``on_frozen(engine)`` only."""
    import deepspeed

    from zeroplan.runtime.rank.dsops import skip_shm_comm_op
    from zeroplan.runtime.rank.recipe_watch import frozen_engine_call

    skip_shm_comm_op()
    original_initialize = deepspeed.initialize

    def initialize(*args, **kwargs):
        if frozen_engine_call(args, kwargs):
            outputs = original_initialize(*args, **kwargs)
            if on_frozen is not None:
                on_frozen(outputs[0])
            return outputs
        model = kwargs.get("model", args[1] if len(args) > 1 else None)
        if model is not None:
            on_model("deepspeed.initialize", model)
        outputs = original_initialize(*args, **kwargs)
        if on_engine is not None:
            on_engine("deepspeed.initialize", outputs[0])
        return outputs

    deepspeed.initialize = initialize
    try:
        import torch.distributed.fsdp as fsdp
    except ImportError:
        return
    original_shard = getattr(fsdp, "fully_shard", None)
    if original_shard is None:
        return
    seen = {"model": False}

    def fully_shard(module, *args, **kwargs):
        out = original_shard(module, *args, **kwargs)

        # fully_shard is applied to the blocks, then to the root; the root's forward runs first,
        # so the first sharded module to see a batch is the model.
        def pre_hook(mod, hook_args, hook_kwargs):
            if not seen["model"]:
                seen["model"] = True
                on_model("torch.distributed.fsdp.fully_shard", mod)
                if on_engine is not None:
                    on_engine("torch.distributed.fsdp.fully_shard", mod, first_call=(hook_args, hook_kwargs))

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        return out

    fsdp.fully_shard = fully_shard



class _Found(BaseException):
    """Stops the script once the model and its first batch are known (not an ``Exception``)."""


def _write(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    result_path = Path(spec["result_path"])
    script = spec["script"]
    sys.path.insert(0, str(Path(script).parent))
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    result: dict = {"status": "no_engine", "entry_point": None}
    frozen: list[dict] = []

    def on_frozen(engine: Any) -> None:
        from zeroplan.runtime.rank.recipe_watch import frozen_engine_info

        frozen.append(frozen_engine_info(engine))

    def on_model(entry_point: str, model: Any) -> None:
        if result.get("model") is None:
            from zeroplan.runtime.rank.recipe_watch import describe_trainer, find_trainer

            result.update(status="model", entry_point=entry_point, model=describe_model(model))
            trainer = find_trainer()  # a Trainer script: its recipe (TRL DPO/GRPO) from the trainer and its config
            info = describe_trainer(trainer, frozen) if trainer is not None else None
            if info:
                result.update(info)
            _write(result_path, result)

    def on_engine(entry_point: str, engine: Any, first_call=None) -> None:
        def record(args: tuple, kwargs: dict) -> None:
            micro, seq = batch_shape(args, kwargs)
            result.update(status="ok", micro_batch=micro, seq_len=seq)
            from zeroplan.runtime.discovery.discover import trace_if_not_transformer

            trace_if_not_transformer(result, result.get("model") or {}, getattr(engine, "module", engine), args, kwargs)
            _write(result_path, result)
            raise _Found()

        if first_call is not None:
            record(*first_call)
        engine.register_forward_pre_hook(lambda mod, a, kw: record(a, kw), with_kwargs=True)

    watch_entry_points(on_model, on_engine, on_frozen)
    sys.argv = [script, *spec["script_args"]]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except _Found:
        pass
    except SystemExit as exc:
        if exc.code not in (0, None) and result["status"] == "no_engine":
            result.update(status="error", error=f"the script exited with status {exc.code!r} before creating an engine")
    except BaseException as exc:  # the user's script may raise anything: report it
        text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500]
        if result["status"] == "no_engine":
            result.update(status="error", error=text)
        else:
            result["after_model_error"] = text  # the model is known; the batch shape is not
        traceback.print_exc()
        code = 1
    _write(result_path, result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
