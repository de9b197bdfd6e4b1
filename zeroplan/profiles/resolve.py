"""Model and cluster descriptions from the options every command shares: ``--params``/``--model``
→ :class:`~zeroplan.spec.ModelSpec`; ``--gpus``, ``--gpu``, ``--node``, memory sizes →
:class:`~zeroplan.spec.ClusterSpec`, filling what is not given from NVML, node profiles or psutil
and saying so in the cluster's ``notes``. The CLI, the tests and the benchmarks call these, so
they all describe a cluster the same way. Standard library only.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

from zeroplan.spec import OPTIMIZERS, PRECISIONS, ClusterSpec, GiB, ModelSpec, SpecError, TrainingSpec

__all__ = ["check_choice_option", "resolve_model", "resolve_cluster", "resolve_training", "gib_option", "model_from_params"]


def gib_option(option: str, value: Optional[float], *, allow_zero: bool = False) -> Optional[int]:
    """GiB given for ``option`` → bytes (None stays None); SpecError naming the option otherwise."""
    if value is None:
        return None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise SpecError(f"{option} {value:g} is not valid; give a positive number of GiB")
    if value > 2**20:
        raise SpecError(f"{option} {value:g} GiB is absurd; give a value below 1048576 GiB")
    return int(value * GiB)


def resolve_model(params: Optional[float], model: Optional[str]) -> ModelSpec:
    """``--params`` or ``--model`` (preset name or config.json path) → ModelSpec."""
    from zeroplan import profiles

    if params is not None and model is not None:
        raise SpecError("give either --params or --model, not both")
    if model is not None:
        looks_like_path = model.endswith(".json") or os.sep in model or Path(model).exists()
        if looks_like_path:
            return profiles.model_from_hf_config(Path(model))
        return profiles.load_model_preset(model)
    if params is None:
        raise SpecError("no model given; use --params 7e9 or --model llama-3-8b (see `zeroplan profiles`)")
    if not math.isfinite(params) or params <= 0:
        raise SpecError(f"--params {params:g} is not valid; give a positive count such as 7e9")
    return model_from_params(params)


def model_from_params(params: float) -> ModelSpec:
    """A shape for a bare parameter count that adds up to it: the GPT-3 rule
    (:meth:`ModelSpec.from_params`, vocabulary 50257) where its embedding and one block fit in
    ``params``, else a model of blocks only.

    The rule puts V·h = 50257·h parameters into the token embedding with h >= 256: below
    50257·256 + 12·256² = 13.7M parameters the embedding alone would exceed the count (8.4M
    parameters would get a 12.9M embedding), and the estimate would hold gradients, logits and an
    embedding backward the model cannot have. A count that small says nothing about a vocabulary,
    so the shape keeps none (V = 1): Ψ ≈ 12·L·h² with the rule's h ≈ 128·L, h a multiple of 64
    (at least 64), and L the nearest whole number of blocks (at least 1). The note says so; give
    ``--model`` (a config.json) or drop ``--params`` to discover the real model from the script.
    """
    import dataclasses

    spec = ModelSpec.from_params(params)
    if spec.embedding_params + spec.block_params <= spec.params:
        return spec
    n = spec.params
    # 12·h³/128 = Ψ  →  h = (128·Ψ/12)^(1/3), the GPT-3 rule's width without an embedding.
    h = max(64, int(round((128 * n / 12) ** (1 / 3) / 64)) * 64)
    layers = max(1, int(round(n / (12 * h * h))))
    heads = max(1, h // 128) if h % 128 == 0 else max(1, h // 64)
    note = (
        f"shape derived from --params {params:.3g}: h={h}, L={layers}, heads={heads}, no vocabulary (V=1): "
        f"the GPT-3 rule's 50257-token embedding would hold {spec.embedding_params:,} parameters, more than the "
        f"{n:,} given (give --model, or drop --params to discover the model from the script)"
    )
    return dataclasses.replace(
        spec, hidden_size=h, num_layers=layers, num_heads=heads, num_kv_heads=heads, ffn_size=4 * h, vocab_size=1,
        tied_embeddings=False, notes=(note,),
    )


def resolve_cluster(
    *,
    gpus: int,
    gpus_per_node: Optional[int],
    gpu: Optional[str],
    gpu_memory_gib: Optional[float],
    cpu_memory_gib: Optional[str | float],
    nvme_gib: Optional[float],
    node: Optional[str] = None,
    runs_here: bool = False,
) -> ClusterSpec:
    """Cluster options → ClusterSpec, filling defaults from NVML, node profiles or psutil and saying so in ``notes``.

    Host RAM per node: see :func:`zeroplan.profiles.host.resolve_host` (``--cpu-memory``, else
    ``--node``, else this machine when the GPU is here or ``runs_here``, else the GPU's node profile).
    """
    from zeroplan import profiles
    from zeroplan.profiles.host import resolve_host

    if gpus < 1:
        raise SpecError(f"--gpus {gpus} is not valid; give at least 1")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise SpecError(f"--gpus-per-node {gpus_per_node} is not valid; give at least 1")
    notes: list[str] = []
    node_spec = profiles.load_node(node) if node is not None else None
    if gpu is None and node_spec is not None:
        gpu_spec = profiles.load_gpu(node_spec.gpu)
        gpu_here = profiles.gpu_is_here(gpu_spec)
    elif gpu is None:
        gpu_spec, note, gpu_here = profiles.detect_gpu()
        notes.append(note)
    else:
        gpu_spec = profiles.load_gpu(gpu)
        gpu_here = profiles.gpu_is_here(gpu_spec)
    if node_spec is not None and node_spec.gpu != gpu_spec.name:
        raise SpecError(
            f"--node {node_spec.name} has {node_spec.gpu} GPUs, not {gpu_spec.name}; drop --gpu or choose a node with "
            f"{gpu_spec.name} (zeroplan profiles lists them)"
        )
    host = resolve_host(
        gpu_spec,
        gpu_here=gpu_here,
        cpu_memory=None if cpu_memory_gib is None else str(cpu_memory_gib),
        node=node_spec,
        runs_here=runs_here,
    )
    notes.append(host.note)
    nvme = gib_option("--nvme", nvme_gib, allow_zero=True)
    if nvme is None:
        nvme = host.nvme_bytes or 0
    per_node = gpus_per_node if gpus_per_node is not None else min(gpus, host.node.gpus_per_node if host.node else 8)
    if node_spec is not None:
        # The node's NICs together (network_gbps) shared by its GPUs: each GPU's inter-node
        # bandwidth in the hierarchical collectives (zeroplan.estimator.comm).
        import dataclasses

        share = node_spec.network_gbps * 1e9 / 8 / node_spec.gpus_per_node
        if share != gpu_spec.inter_node_bandwidth:
            gpu_spec = dataclasses.replace(gpu_spec, inter_node_bandwidth=share)
            notes.append(
                f"inter-node bandwidth {share / 1e9:g} GB/s per GPU: node {node_spec.name}'s {node_spec.network_gbps:g} Gb/s "
                f"of NICs over {node_spec.gpus_per_node} GPUs"
            )
    return ClusterSpec(
        gpus=gpus,
        gpus_per_node=per_node,
        gpu=gpu_spec,
        gpu_memory_bytes=gib_option("--gpu-memory", gpu_memory_gib) or 0,
        cpu_memory_per_node_bytes=host.cpu_memory_bytes,
        nvme_per_node_bytes=nvme,
        notes=tuple(notes),
        node=host.node.name if host.node else "",
        cpu_memory_source=host.source,
    )


def check_choice_option(option: str, value: Optional[str], choices: tuple[str, ...]) -> None:
    """SpecError naming the flag unless ``value`` is None or one of ``choices``."""
    if value is not None and value not in choices:
        raise SpecError(f"{option} {value!r} is not valid; choose one of {', '.join(choices)}")


def resolve_training(
    *,
    precision: str,
    optimizer: str,
    seq_len: int,
    micro_batch: Optional[int],
    global_batch: Optional[int],
    grad_accum: Optional[int],
) -> TrainingSpec:
    """Training options → TrainingSpec (checks name the flag)."""
    check_choice_option("--precision", precision, PRECISIONS)
    check_choice_option("--optimizer", optimizer, OPTIMIZERS)
    for flag, value in (("--seq-len", seq_len), ("--micro-batch", micro_batch), ("--global-batch", global_batch), ("--grad-accum", grad_accum)):
        if value is not None and value < 1:
            raise SpecError(f"{flag} {value} is not valid; give a whole number >= 1")
    if global_batch is not None and grad_accum is not None and micro_batch is None:
        raise SpecError("--global-batch with --grad-accum also needs --micro-batch (or drop --grad-accum)")
    return TrainingSpec(
        precision=precision,
        optimizer=optimizer,
        seq_len=seq_len,
        micro_batch=micro_batch,
        global_batch=global_batch,
        grad_accum=grad_accum,
    )
