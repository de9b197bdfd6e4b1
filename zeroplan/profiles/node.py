"""Node profiles (``nodes/<name>.toml``): host RAM, NVMe and NICs of a DGX or a cloud instance.

Fields 1:1 with :class:`~zeroplan.spec.NodeSpec`; every figure carries its vendor ``source``.
The node whose ``default_for_gpu`` is true stands for its GPU when the planned GPU is not the
one on this machine (see :mod:`zeroplan.profiles.host`). Standard library only.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from zeroplan.spec import NodeSpec, SpecError

__all__ = ["NODE_DIR", "default_node", "load_node", "node_from_toml", "node_names"]

NODE_DIR = Path(__file__).resolve().parent / "nodes"

_NODE_FIELDS = (
    "name",
    "display_name",
    "gpu",
    "gpus_per_node",
    "cpu_memory_bytes",
    "nvme_bytes",
    "nics",
    "network_gbps",
    "default_for_gpu",
    "source",
)
_NODE_REQUIRED = ("name", "gpu", "gpus_per_node", "cpu_memory_bytes", "nvme_bytes", "nics", "network_gbps", "source")


def _node_from_dict(data: dict[str, Any], where: str) -> NodeSpec:
    from zeroplan.profiles.gpu_presets import load_gpu
    from zeroplan.profiles.tomlio import check_keys as _check_keys

    _check_keys(data, _NODE_FIELDS, _NODE_REQUIRED, where)
    try:
        spec = NodeSpec(**{k: data[k] for k in _NODE_FIELDS if k in data})
        load_gpu(spec.gpu)
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None
    return spec


def node_from_toml(path: Path | str) -> NodeSpec:
    """A NodeSpec from any node profile TOML."""
    from zeroplan.profiles.tomlio import read_toml as _read_toml

    path = Path(path)
    return _node_from_dict(_read_toml(path, "node profile"), str(path))


@lru_cache(maxsize=None)
def _node_presets() -> dict[str, NodeSpec]:
    from zeroplan.profiles.tomlio import read_toml as _read_toml

    out: dict[str, NodeSpec] = {}
    for path in sorted(NODE_DIR.glob("*.toml")):
        spec = _node_from_dict(_read_toml(path, "node profile"), str(path))
        out[spec.name] = spec
    return out


def node_names() -> list[str]:
    """Names of the shipped node profiles, sorted."""
    return sorted(_node_presets())


def load_node(name_or_path: str | Path) -> NodeSpec:
    """A shipped node profile by name (case-insensitive) or any node TOML by path."""
    from zeroplan.profiles.tomlio import closest as _closest, looks_like_path as _looks_like_path, normalize as _normalize

    if isinstance(name_or_path, Path) or _looks_like_path(str(name_or_path)):
        return node_from_toml(Path(name_or_path))
    presets = _node_presets()
    key = _normalize(name_or_path)
    if key in presets:
        return presets[key]
    names = node_names()
    raise SpecError(
        f"unknown node profile {name_or_path!r}{_closest(name_or_path, names)}; "
        f"valid: {', '.join(names)} (or a path to a node profile .toml)"
    )


def default_node(gpu_name: str) -> NodeSpec | None:
    """The node profile that stands for ``gpu_name`` (``default_for_gpu = true``), or None."""
    for spec in _node_presets().values():
        if spec.default_for_gpu and spec.gpu == gpu_name:
            return spec
    return None
