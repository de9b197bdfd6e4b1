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

from zeroplan.spec import ClusterSpec, GiB, ModelSpec, SpecError

__all__ = ["resolve_model", "resolve_cluster", "gib_option"]


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
    return ModelSpec.from_params(params)


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
