"""This machine's GPU through NVML (nvidia-ml-py, optional): which profile it is, with its real
memory, or the default profile and a note saying why nothing was detected."""

from __future__ import annotations

from dataclasses import replace

from zeroplan.profiles.gpu_presets import DEFAULT_GPU, gpu_for_device_name, load_gpu
from zeroplan.spec import GiB, GpuSpec

__all__ = ["detect_gpu", "default_gpu", "gpu_is_here", "local_gpu_count"]


#: pynvml's text for NVML_ERROR_LIBRARY_NOT_FOUND (pynvml.py, ``NVMLError._errcode_to_string``).
NVML_LIBRARY_NOT_FOUND = "NVML Shared Library Not Found"


def _nvml_library_missing() -> bool:
    """Whether NVML's library cannot be loaded here, tried as pynvml's ``nvmlInit`` first tries it
    on Linux (pynvml.py, ``_LoadNvmlLibrary``: ``CDLL("libnvidia-ml.so.1")``).

    Checked before pynvml is imported (its ~2,000 ctypes definitions take ~10 ms, a tenth of
    ``zeroplan estimate``'s start-up) on a machine without a driver, when nothing imported it yet."""
    import sys

    if not sys.platform.startswith("linux") or "pynvml" in sys.modules:
        return False
    import importlib.util

    try:
        if importlib.util.find_spec("pynvml") is None:
            return False  # `import pynvml` below says it is not installed
    except (ImportError, ValueError):
        return False  # an odd install: `import pynvml` below says what is wrong
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return True
    return False


def _nvml_device() -> tuple[str, int, int] | str:
    """(device name, memory bytes, device count) of NVML device 0, or why there is none."""
    if _nvml_library_missing():
        return f"no NVIDIA driver: {NVML_LIBRARY_NOT_FOUND}"
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


def _detection() -> tuple[GpuSpec, str, str, bool]:
    """(profile, what was found, what to do about it, whether NVML found a GPU here)."""
    fallback = load_gpu(DEFAULT_GPU)
    found = _nvml_device()
    if isinstance(found, str):
        return fallback, f"GPU: {DEFAULT_GPU} assumed ({found})", "set --gpu", False
    device_name, memory, count = found
    profile = gpu_for_device_name(device_name)
    if profile is None:
        spec = replace(fallback, memory_bytes=memory, display_name=device_name)
        return spec, (
            f"GPU: detected {device_name} ({memory / GiB:.1f} GiB) ×{count}, no matching profile: "
            f"{DEFAULT_GPU}'s speeds with the detected memory"
        ), "set --gpu or run zeroplan calibrate", True
    spec = replace(load_gpu(profile), memory_bytes=memory)
    return spec, f"GPU: detected {device_name} ({memory / GiB:.1f} GiB) ×{count} via NVML: profile {profile}", "", True


def detect_gpu() -> tuple[GpuSpec, str, bool]:
    """:func:`default_gpu` plus whether NVML found a GPU on this machine (True) or one was assumed;
    the note ends with what to do (``set --gpu``) for the commands that take ``--gpu``."""
    spec, fact, hint, here = _detection()
    return spec, f"{fact}; {hint}" if hint else fact, here


def default_gpu() -> tuple[GpuSpec, str]:
    """The GPU of this machine (NVML, device 0) as a profile with its real memory, and a note.

    Falls back to :data:`DEFAULT_GPU` with a note saying so when nvidia-ml-py is missing, NVML
    cannot start (no driver) or no device is present; never raises for those. The note names
    no option (``zeroplan profiles``, which shows it, has no ``--gpu``).
    """
    spec, fact, _, _ = _detection()
    return spec, fact


def gpu_is_here(spec: GpuSpec) -> bool:
    """Whether NVML finds ``spec``'s GPU on this machine (its profile matches device 0's name)."""
    found = _nvml_device()
    if isinstance(found, str):
        return False
    return gpu_for_device_name(found[0]) == spec.name or (bool(spec.display_name) and spec.display_name == found[0])


def local_gpu_count() -> int | None:
    """GPUs a job on this machine can use: NVML's device count, narrowed by ``CUDA_VISIBLE_DEVICES``
    when it is set (as CUDA narrows it); None when there is none (no driver, no device)."""
    import os

    found = _nvml_device()
    if isinstance(found, str):
        return None
    count = found[2]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count or None
