"""GPU profiles: ``gpus/<name>.toml`` shipped with the package, or any profile TOML by path
(fields 1:1 with :class:`~zeroplan.spec.GpuSpec`, plus ``nvml_names`` that select the profile for
an NVML device name and an optional free-form ``[calibration]`` table written by
``zeroplan calibrate``). Standard library only."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from zeroplan.profiles.tomlio import check_keys, closest, looks_like_path, normalize, read_toml, toml_value
from zeroplan.spec import GpuSpec, SpecError

__all__ = ["DEFAULT_GPU", "GPU_DIR", "gpu_from_toml", "gpu_names", "load_gpu", "gpu_for_device_name", "gpu_toml_text", "write_gpu_toml"]

GPU_DIR = Path(__file__).resolve().parent / "gpus"

#: Profile assumed when no GPU can be detected (stated in the cluster notes).
DEFAULT_GPU = "a100-80gb"

_GPU_FIELDS = (
    "name",
    "display_name",
    "memory_bytes",
    "peak_flops",
    "memory_bandwidth",
    "intra_node_bandwidth",
    "host_bandwidth",
    "inter_node_bandwidth",
    "efficiency",
    "cpu_adam_params_per_s",
    "collective_latency_s",
    "step_overhead_s",
    "stage3_layer_overhead_s",
    "hook_call_s",
    "comm_stream",
    "source",
)

_GPU_REQUIRED = (
    "name",
    "memory_bytes",
    "peak_flops",
    "memory_bandwidth",
    "intra_node_bandwidth",
    "host_bandwidth",
    "inter_node_bandwidth",
)

_GPU_EXTRA = ("nvml_names", "calibration")


def _gpu_spec_from_dict(data: dict[str, Any], where: str) -> GpuSpec:
    check_keys(data, _GPU_FIELDS + _GPU_EXTRA, _GPU_REQUIRED, where)
    for key in ("name", "display_name", "source"):
        if key in data and not isinstance(data[key], str):
            raise SpecError(f"{where}: {key} = {data[key]!r} must be a string")
    flops = data["peak_flops"]
    if not isinstance(flops, dict):
        raise SpecError(f"{where}: peak_flops must be a table ([peak_flops] with bf16, fp16, fp32 in FLOP/s)")
    kwargs = {k: data[k] for k in _GPU_FIELDS if k in data}
    kwargs["peak_flops"] = {str(k): v for k, v in flops.items()}
    try:
        return GpuSpec(**kwargs)
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None


def gpu_from_toml(path: Path | str) -> GpuSpec:
    """A GpuSpec from any profile TOML (a shipped preset or one written by ``zeroplan calibrate``)."""
    path = Path(path)
    return _gpu_spec_from_dict(read_toml(path, "GPU profile"), str(path))


@lru_cache(maxsize=None)
def _gpu_presets() -> dict[str, tuple[GpuSpec, tuple[str, ...]]]:
    out: dict[str, tuple[GpuSpec, tuple[str, ...]]] = {}
    for path in sorted(GPU_DIR.glob("*.toml")):
        data = read_toml(path, "GPU profile")
        spec = _gpu_spec_from_dict(data, str(path))
        out[spec.name] = (spec, tuple(data.get("nvml_names", ())))
    return out


def gpu_names() -> list[str]:
    """Names of the shipped GPU profiles, sorted."""
    return sorted(_gpu_presets())


def load_gpu(name_or_path: str | Path) -> GpuSpec:
    """A shipped profile by name (case-insensitive) or any profile TOML by path."""
    if isinstance(name_or_path, Path) or looks_like_path(str(name_or_path)):
        return gpu_from_toml(Path(name_or_path))
    presets = _gpu_presets()
    key = normalize(name_or_path)
    if key in presets:
        return presets[key][0]
    names = gpu_names()
    raise SpecError(
        f"unknown GPU profile {name_or_path!r}{closest(name_or_path, names)}; "
        f"valid: {', '.join(names)} (or a path to a profile .toml)"
    )


def gpu_for_device_name(device_name: str) -> str | None:
    """The profile whose ``nvml_names`` best match an NVML device name (longest substring), or None."""
    lowered = device_name.lower()
    best: tuple[int, str] | None = None
    for name, (_, patterns) in _gpu_presets().items():
        for pattern in patterns:
            if pattern.lower() in lowered and (best is None or len(pattern) > best[0]):
                best = (len(pattern), name)
    return best[1] if best else None


def gpu_toml_text(spec: GpuSpec, *, calibration: dict[str, Any] | None = None, nvml_names: tuple[str, ...] = ()) -> str:
    """The profile TOML for ``spec`` (what :func:`write_gpu_toml` writes)."""
    d = spec.as_dict()
    lines = ["# zeroplan GPU profile: bandwidths in bytes/s, FLOP/s dense, memory in bytes."]
    for key in _GPU_FIELDS:
        if key == "peak_flops":
            continue
        lines.append(f"{key} = {toml_value(d[key], key)}")
    if nvml_names:
        lines.append(f"nvml_names = {toml_value(list(nvml_names), 'nvml_names')}")
    lines += ["", "[peak_flops]"]
    lines += [f"{prec} = {toml_value(float(v), 'peak_flops.' + prec)}" for prec, v in d["peak_flops"].items()]
    if calibration:
        lines += ["", "[calibration]"]
        for key, value in calibration.items():
            if not key.replace("_", "").replace("-", "").isalnum():
                raise SpecError(f"calibration key {key!r} must be letters, digits, _ or -")
            lines.append(f"{key} = {toml_value(value, 'calibration.' + key)}")
    return "\n".join(lines) + "\n"


def write_gpu_toml(
    spec: GpuSpec, path: Path | str, *, calibration: dict[str, Any] | None = None, nvml_names: tuple[str, ...] = ()
) -> Path:
    """Write ``spec`` as a profile TOML atomically (temp file in the same folder + os.replace).

    ``calibration``: an optional flat table of scalars (measurement details) stored under
    ``[calibration]`` and ignored by the loader. Returns the path written.
    """
    path = Path(path)
    text = gpu_toml_text(spec, calibration=calibration, nvml_names=nvml_names)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise SpecError(f"{path} is a directory; give a file path for the GPU profile")
    if not parent.is_dir():
        raise SpecError(f"{path}: folder {parent} does not exist")
    import tempfile  # here: estimate reads profiles, only calibrate writes one

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise SpecError(f"{path}: cannot write ({exc.strerror})") from None
    return path
