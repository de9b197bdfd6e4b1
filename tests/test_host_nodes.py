"""Whose RAM: node profiles (vendor figures), the precedence of host-memory sources, bad input."""

from __future__ import annotations

import sys
import types

import pytest

from zeroplan import profiles
from zeroplan.profiles import resolve_cluster
from zeroplan.estimator import enumerate_plans, estimate_all
from zeroplan.spec import GiB, ModelSpec, SpecError, TrainingSpec

from helpers import run_zeroplan
TiB = 1024**4


# Vendor figures, typed from the pages each profile cites (memory in the vendor's unit).
@pytest.mark.parametrize(
    "name, gpu, cpu_bytes, nvme_bytes",
    [
        ("dgx-a100-640gb", "a100-80gb", 2 * TiB, 8 * 3_840_000_000_000),  # 2 TB; 8× 3.84 TB U.2
        ("dgx-a100-320gb", "a100-40gb", 1 * TiB, 4 * 3_840_000_000_000),
        ("dgx-h100", "h100-80gb", 2 * TiB, 8 * 3_840_000_000_000),
        ("dgx-h200", "h200", 2 * TiB, 8 * 3_840_000_000_000),
        ("aws-p4d.24xlarge", "a100-40gb", 1152 * GiB, 8 * 1000 * 10**9),
        ("aws-p5.48xlarge", "h100-80gb", 2048 * GiB, 8 * 3_840_000_000_000),
        ("azure-nd96asr-a100-v4", "a100-40gb", 900 * GiB, 6000 * GiB),
        ("azure-nd96amsr-a100-v4", "a100-80gb", 1900 * GiB, 6400 * GiB),
        ("azure-nd96isr-h100-v5", "h100-80gb", 1900 * GiB, 28000 * GiB),
        ("gcp-a2-ultragpu-8g", "a100-80gb", 1360 * GiB, 8 * 375 * GiB),
        ("gcp-a3-highgpu-8g", "h100-80gb", 1872 * GiB, 16 * 375 * GiB),
    ],
)
def test_node_profiles_match_vendor_figures(name, gpu, cpu_bytes, nvme_bytes):
    node = profiles.load_node(name)
    assert (node.gpu, node.gpus_per_node, node.cpu_memory_bytes, node.nvme_bytes) == (gpu, 8, cpu_bytes, nvme_bytes)
    assert node.source.split("https://", 1)[1], "every profile cites a URL"
    profiles.load_gpu(node.gpu)


def test_one_default_node_per_gpu():
    defaults: dict[str, list[str]] = {}
    for name in profiles.node_names():
        node = profiles.load_node(name)
        assert "https://" in node.source, name
        if node.default_for_gpu:
            defaults.setdefault(node.gpu, []).append(name)
    assert all(len(v) == 1 for v in defaults.values()), defaults
    assert defaults["a100-80gb"] == ["dgx-a100-640gb"] and defaults["h200"] == ["dgx-h200"]


def _no_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError: no GPU here


def _fake_nvml(monkeypatch, device_name):
    mod = types.ModuleType("pynvml")
    mod.NVMLError = type("NVMLError", (Exception,), {})
    mod.nvmlInit = mod.nvmlShutdown = lambda: None
    mod.nvmlDeviceGetCount = lambda: 8
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetName = lambda h: device_name
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=80 * GiB)
    monkeypatch.setitem(sys.modules, "pynvml", mod)


def _cluster(**kw):
    args = dict(gpus=64, gpus_per_node=None, gpu=None, gpu_memory_gib=None, cpu_memory_gib=None, nvme_gib=None)
    args.update(kw)
    return resolve_cluster(**args)


def test_readme_command_plans_for_the_cluster_not_this_machine(monkeypatch):
    """`zeroplan estimate --params 175e9 --gpus 64` on a machine without a GPU: the DGX A100's 2 TB per node."""
    _no_nvml(monkeypatch)
    cluster = _cluster()
    assert cluster.cpu_memory_per_node_bytes == 2 * TiB and cluster.cpu_memory_source == "node:dgx-a100-640gb"
    assert any("dgx-a100-640gb" in n and "not on this machine" in n for n in cluster.notes)
    import psutil

    here = psutil.virtual_memory().total
    model = ModelSpec.from_params(175e9)
    training = TrainingSpec()
    ests = estimate_all(model, cluster, training, enumerate_plans(model, cluster, training, stage=3, offload_optimizer="cpu"))
    fitting = [e for e in ests if e.fits]
    # Offload plans needing far more than this machine's RAM fit on the cluster's nodes.
    assert fitting and all(here < e.cpu_per_node <= 2 * TiB for e in fitting)


def test_gpu_here_uses_this_machines_ram(monkeypatch):
    import psutil

    _fake_nvml(monkeypatch, "NVIDIA H100 80GB HBM3")
    here = _cluster(gpus=8, gpu="h100-80gb")
    assert here.cpu_memory_source == "local" and here.cpu_memory_per_node_bytes == psutil.virtual_memory().total
    elsewhere = _cluster(gpus=8, gpu="a100-40gb")  # not the GPU NVML sees: its node profile
    assert elsewhere.cpu_memory_source == "node:dgx-a100-320gb" and elsewhere.cpu_memory_per_node_bytes == 1 * TiB


def test_explicit_sources_win(monkeypatch):
    import psutil

    _no_nvml(monkeypatch)
    assert _cluster(cpu_memory_gib="512").cpu_memory_per_node_bytes == 512 * GiB
    local = _cluster(cpu_memory_gib="local")
    assert local.cpu_memory_source == "local" and local.cpu_memory_per_node_bytes == psutil.virtual_memory().total
    p4d = _cluster(gpus=16, node="aws-p4d.24xlarge")
    assert (p4d.gpu.name, p4d.cpu_memory_per_node_bytes, p4d.nvme_per_node_bytes) == ("a100-40gb", 1152 * GiB, 8 * 10**12)
    assert _cluster(gpu="l40s").cpu_memory_source == "unknown"  # no node profile: not checked, and said so
    assert _cluster(gpu="l40s").cpu_memory_per_node_bytes == 0


@pytest.mark.parametrize(
    "value, message",
    [
        ("0", "positive number of GiB"),
        ("-8", "positive number of GiB"),
        ("nan", "positive number of GiB"),
        ("1e9", "more than any node holds"),
        ("lots", "give GiB per node"),
    ],
)
def test_bad_cpu_memory(monkeypatch, value, message):
    _no_nvml(monkeypatch)
    with pytest.raises(SpecError, match=message):
        _cluster(cpu_memory_gib=value)


def test_local_when_psutil_fails(monkeypatch):
    import psutil

    def broken():
        raise OSError("no /proc/meminfo")

    monkeypatch.setattr(psutil, "virtual_memory", broken)
    with pytest.raises(SpecError, match=r"--cpu-memory local: cannot read this machine's RAM \(OSError: no /proc/meminfo\)"):
        _cluster(cpu_memory_gib="local")


def test_node_and_gpu_disagree(monkeypatch):
    _no_nvml(monkeypatch)
    with pytest.raises(SpecError, match="--node dgx-h100 has h100-80gb GPUs, not a100-80gb"):
        _cluster(gpu="a100-80gb", node="dgx-h100")


def test_both_reasons_when_gpu_and_host_fail(monkeypatch):
    _no_nvml(monkeypatch)
    cluster = _cluster(gpus=8, cpu_memory_gib="24")
    model = ModelSpec.from_params(70e9)
    training = TrainingSpec(micro_batch=1)
    (est,) = estimate_all(model, cluster, training, enumerate_plans(model, cluster, training, stage=1, offload_optimizer="cpu", checkpointing="full"))
    assert not est.fits
    assert any(n.startswith("GPU needs") for n in est.notes) and any(n.startswith("CPU needs") for n in est.notes)


_cli = run_zeroplan


def test_cli_bad_node_profile_one_line(tmp_path):
    bad = tmp_path / "mynode.toml"
    bad.write_text('name = "mynode"\ngpu = "a100-80gb"\ngpus_per_node = 8\nnvme_bytes = 0\nnics = "x"\nnetwork_gbps = 100\nsource = "https://example.org"\n')
    r = _cli("estimate", "--params", "7e9", "--gpus", "8", "--node", str(bad))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"zeroplan: error: {bad}: missing key(s) cpu_memory_bytes"]
    r = _cli("estimate", "--params", "7e9", "--gpus", "8", "--cpu-memory", "0")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--cpu-memory 0" in r.stderr
