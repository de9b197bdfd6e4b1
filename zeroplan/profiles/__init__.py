"""GPU and model presets (TOML files shipped with the package) and the Hugging Face config reader.

Standard library only (``tomllib``, ``json``): ``zeroplan estimate`` imports this module.

* GPU profiles: ``gpus/<name>.toml``, fields 1:1 with :class:`~zeroplan.spec.GpuSpec` plus
  ``nvml_names`` (substrings of the NVML device name that select the profile) and an optional
  free-form ``[calibration]`` table (written by ``zeroplan calibrate``). :func:`gpu_from_toml`
  reads any such file; :func:`write_gpu_toml` writes one atomically.
* Model presets: ``models/<name>.toml``, the :class:`~zeroplan.spec.ModelSpec` fields, ``source``
  (paper or model card), optional ``notes`` and an ``[hf_config]`` table from which ``params`` is
  counted exactly (see :mod:`zeroplan.profiles.hf_config`).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import tempfile
import tomllib
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from zeroplan.profiles.hf_config import SUPPORTED_MODEL_TYPES, count_hf_params, model_from_hf_config
from zeroplan.profiles.resolve import resolve_cluster, resolve_model
from zeroplan.spec import GiB, GpuSpec, ModelSpec, SpecError

__all__ = [
    "DEFAULT_GPU",
    "SUPPORTED_MODEL_TYPES",
    "count_hf_params",
    "default_gpu",
    "default_node",
    "detect_gpu",
    "gpu_is_here",
    "gpu_for_device_name",
    "gpu_from_toml",
    "gpu_names",
    "gpu_toml_text",
    "load_gpu",
    "load_model_preset",
    "model_from_hf_config",
    "model_names",
    "model_preset_info",
    "node_names",
    "load_node",
    "node_from_toml",
    "resolve_cluster",
    "resolve_model",
    "write_gpu_toml",
]

_HERE = Path(__file__).resolve().parent
GPU_DIR = _HERE / "gpus"
MODEL_DIR = _HERE / "models"

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

_MODEL_FIELDS = (
    "name",
    "params",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "ffn_size",
    "vocab_size",
    "tied_embeddings",
    "gated_mlp",
    "largest_layer_params",
)
_MODEL_EXTRA = ("display_name", "source", "notes", "hf_config")


def _normalize(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _closest(name: str, choices: list[str]) -> str:
    """`` (did you mean X?)`` or an empty string: names containing the input first, else difflib's."""
    key = _normalize(name)
    matches = [c for c in choices if key and key in c] or difflib.get_close_matches(key, choices, n=1, cutoff=0.5)
    return f" (did you mean {' or '.join(matches[:3])}?)" if matches else ""


def _read_toml(path: Path, what: str) -> dict[str, Any]:
    if path.is_dir():
        raise SpecError(f"{path} is a directory; give the path of a {what} .toml file")
    if not path.exists():
        raise SpecError(f"{path}: no such file; give the path of a {what} .toml file or a preset name")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML ({exc})") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read ({exc.strerror})") from None


def _check_keys(data: dict[str, Any], known: tuple[str, ...], required: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise SpecError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(known)}")
    missing = [k for k in required if k not in data]
    if missing:
        raise SpecError(f"{where}: missing key(s) {', '.join(missing)}")


# --------------------------------------------------------------------------------------------
# GPUs


def _gpu_spec_from_dict(data: dict[str, Any], where: str) -> GpuSpec:
    _check_keys(data, _GPU_FIELDS + _GPU_EXTRA, _GPU_REQUIRED, where)
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
    return _gpu_spec_from_dict(_read_toml(path, "GPU profile"), str(path))


@lru_cache(maxsize=None)
def _gpu_presets() -> dict[str, tuple[GpuSpec, tuple[str, ...]]]:
    out: dict[str, tuple[GpuSpec, tuple[str, ...]]] = {}
    for path in sorted(GPU_DIR.glob("*.toml")):
        data = _read_toml(path, "GPU profile")
        spec = _gpu_spec_from_dict(data, str(path))
        out[spec.name] = (spec, tuple(data.get("nvml_names", ())))
    return out


def gpu_names() -> list[str]:
    """Names of the shipped GPU profiles, sorted."""
    return sorted(_gpu_presets())


def _looks_like_path(name: str) -> bool:
    return name.endswith(".toml") or os.sep in name or "/" in name


def load_gpu(name_or_path: str | Path) -> GpuSpec:
    """A shipped profile by name (case-insensitive) or any profile TOML by path."""
    if isinstance(name_or_path, Path) or _looks_like_path(str(name_or_path)):
        return gpu_from_toml(Path(name_or_path))
    presets = _gpu_presets()
    key = _normalize(name_or_path)
    if key in presets:
        return presets[key][0]
    names = gpu_names()
    raise SpecError(
        f"unknown GPU profile {name_or_path!r}{_closest(name_or_path, names)}; "
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


def _nvml_device() -> tuple[str, int, int] | str:
    """(device name, memory bytes, device count) of NVML device 0, or why there is none."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py not installed, no detection"
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError) as exc:
        return f"no NVIDIA driver: {exc}"
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count < 1:
            return "NVML sees no device"
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        device_name = pynvml.nvmlDeviceGetName(handle)
        if isinstance(device_name, bytes):
            device_name = device_name.decode(errors="replace")
        memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    except (pynvml.NVMLError, OSError) as exc:
        return f"NVML query failed: {exc}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return device_name, memory, count


def detect_gpu() -> tuple[GpuSpec, str, bool]:
    """:func:`default_gpu` plus whether NVML found a GPU on this machine (True) or one was assumed."""
    fallback = load_gpu(DEFAULT_GPU)
    found = _nvml_device()
    if isinstance(found, str):
        return fallback, f"GPU: {DEFAULT_GPU} assumed ({found}); set --gpu", False
    device_name, memory, count = found
    profile = gpu_for_device_name(device_name)
    if profile is None:
        spec = replace(fallback, memory_bytes=memory, display_name=device_name)
        return spec, (
            f"GPU: detected {device_name} ({memory / GiB:.1f} GiB) ×{count}, no matching profile: "
            f"{DEFAULT_GPU}'s speeds with the detected memory; set --gpu or run zeroplan calibrate"
        ), True
    spec = replace(load_gpu(profile), memory_bytes=memory)
    return spec, f"GPU: detected {device_name} ({memory / GiB:.1f} GiB) ×{count} via NVML: profile {profile}", True


def default_gpu() -> tuple[GpuSpec, str]:
    """The GPU of this machine (NVML, device 0) as a profile with its real memory, and a note.

    Falls back to :data:`DEFAULT_GPU` with a note saying so when nvidia-ml-py is missing, NVML
    cannot start (no driver) or no device is present; never raises for those.
    """
    spec, note, _ = detect_gpu()
    return spec, note


def gpu_is_here(spec: GpuSpec) -> bool:
    """Whether NVML finds ``spec``'s GPU on this machine (its profile matches device 0's name)."""
    found = _nvml_device()
    if isinstance(found, str):
        return False
    return gpu_for_device_name(found[0]) == spec.name or (bool(spec.display_name) and spec.display_name == found[0])


def _toml_value(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SpecError(f"{where}: {value} is not finite and cannot be written to TOML")
        return repr(value)
    if isinstance(value, str):
        # A JSON string is a valid TOML basic string (same escapes, \uXXXX included).
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v, where) for v in value) + "]"
    raise SpecError(f"{where}: cannot write a {type(value).__name__} to TOML; use numbers, strings, booleans or lists")


def gpu_toml_text(spec: GpuSpec, *, calibration: dict[str, Any] | None = None, nvml_names: tuple[str, ...] = ()) -> str:
    """The profile TOML for ``spec`` (what :func:`write_gpu_toml` writes)."""
    d = spec.as_dict()
    lines = ["# zeroplan GPU profile: bandwidths in bytes/s, FLOP/s dense, memory in bytes."]
    for key in _GPU_FIELDS:
        if key == "peak_flops":
            continue
        lines.append(f"{key} = {_toml_value(d[key], key)}")
    if nvml_names:
        lines.append(f"nvml_names = {_toml_value(list(nvml_names), 'nvml_names')}")
    lines += ["", "[peak_flops]"]
    lines += [f"{prec} = {_toml_value(float(v), 'peak_flops.' + prec)}" for prec, v in d["peak_flops"].items()]
    if calibration:
        lines += ["", "[calibration]"]
        for key, value in calibration.items():
            if not key.replace("_", "").replace("-", "").isalnum():
                raise SpecError(f"calibration key {key!r} must be letters, digits, _ or -")
            lines.append(f"{key} = {_toml_value(value, 'calibration.' + key)}")
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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise SpecError(f"{path}: cannot write ({exc.strerror})") from None
    return path


# --------------------------------------------------------------------------------------------
# Models


@lru_cache(maxsize=None)
def _model_presets() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(MODEL_DIR.glob("*.toml")):
        data = _read_toml(path, "model preset")
        _check_keys(data, _MODEL_FIELDS + _MODEL_EXTRA, _MODEL_FIELDS[:8], str(path))
        out[data["name"]] = data
    return out


def model_names() -> list[str]:
    """Names of the shipped model presets, sorted."""
    return sorted(_model_presets())


def model_preset_info(name: str) -> dict[str, Any]:
    """The raw preset table (ModelSpec fields, ``display_name``, ``source``, ``notes``, ``hf_config``)."""
    presets = _model_presets()
    key = _normalize(name)
    if key not in presets:
        names = model_names()
        raise SpecError(
            f"unknown model preset {name!r}{_closest(name, names)}; valid: {', '.join(names)} "
            f"(or a path to a Hugging Face config.json, or --params)"
        )
    return presets[key]


def load_model_preset(name: str) -> ModelSpec:
    """A ModelSpec for a shipped preset (case-insensitive name)."""
    data = model_preset_info(name)
    kwargs = {k: data[k] for k in _MODEL_FIELDS if k in data}
    return ModelSpec(**kwargs, source="preset", notes=tuple(data.get("notes", ())))


# Node profiles reuse the TOML helpers above.
from zeroplan.profiles.node import default_node, load_node, node_from_toml, node_names  # noqa: E402
