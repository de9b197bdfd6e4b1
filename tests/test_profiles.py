"""GPU profiles, model presets, NVML detection and the `zeroplan profiles` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest

from zeroplan import profiles
from zeroplan.profiles import (
    count_hf_params,
    default_gpu,
    gpu_for_device_name,
    gpu_from_toml,
    gpu_names,
    load_gpu,
    load_model_preset,
    model_names,
    model_preset_info,
    write_gpu_toml,
)
from zeroplan.spec import GiB, SpecError

from helpers import QWEN3_VL_30B_A3B, ROOT as REPO, run_zeroplan

EXPECTED_GPUS = {"a100-40gb", "a100-80gb", "h100-80gb", "h100-pcie", "h200", "v100-32gb", "l40s", "rtx-4090", "mi300x"}
EXPECTED_MODELS = {
    "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-175b", "llama-2-7b", "llama-2-13b", "llama-2-70b",
    "llama-3-8b", "llama-3-70b", "mistral-7b", "qwen2-7b", "bloom-176b", "t5-3b", "megatron-turing-530b",
    "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "deepseek-v3", "gpt-oss-20b", "gpt-oss-120b",
}


# ---------------------------------------------------------------------------------------------
# GPU profiles


def test_gpu_presets_present():
    assert set(gpu_names()) == EXPECTED_GPUS


@pytest.mark.parametrize("name", sorted(EXPECTED_GPUS))
def test_gpu_preset_loads_and_is_plausible(name):
    spec = load_gpu(name)
    assert spec.name == name == Path(profiles.GPU_DIR / f"{name}.toml").stem
    assert 16 * GiB <= spec.memory_bytes <= 256 * GiB
    assert spec.peak_flops["bf16"] >= spec.peak_flops["fp32"]
    assert spec.peak_flops["fp16"] >= spec.peak_flops["fp32"]
    # Device memory is faster than any link; NVLink/xGMI or PCIe peers at least as fast as the network.
    assert spec.memory_bandwidth > spec.intra_node_bandwidth >= spec.inter_node_bandwidth
    assert spec.source.startswith(("NVIDIA", "AMD")) and "https://" in spec.source
    assert spec.display_name


def test_datasheet_numbers():
    # A100 datasheet: 312 TFLOPS bf16 dense, 19.5 TFLOPS FP32, 2,039 GB/s (80GB SXM), NVLink 600 GB/s.
    a100 = load_gpu("a100-80gb")
    assert a100.peak_flops["bf16"] == 312e12 and a100.peak_flops["fp32"] == 19.5e12
    assert a100.memory_bandwidth == 2039e9 and a100.intra_node_bandwidth == 600e9 / 2
    assert a100.memory_bytes == 80 * GiB and a100.inter_node_bandwidth == 200e9 / 8
    # H100 SXM: 1,979 TFLOPS bf16 with sparsity -> 989.4 dense; 3.35 TB/s; NVLink 900 GB/s; 400 Gb/s IB.
    h100 = load_gpu("h100-80gb")
    assert h100.peak_flops["bf16"] == 989.4e12 and h100.memory_bandwidth == 3.35e12
    assert h100.intra_node_bandwidth == 900e9 / 2 and h100.inter_node_bandwidth == 400e9 / 8
    assert load_gpu("h200").memory_bandwidth == 4.8e12


def test_load_gpu_is_case_insensitive():
    assert load_gpu("H100_80GB") == load_gpu("h100-80gb")


@pytest.mark.parametrize(
    "name, hint",
    [("h100", "did you mean h100-80gb or h100-pcie?"), ("a100-80g", "did you mean a100-80gb?"), ("tpu-v5", "")],
)
def test_unknown_gpu(name, hint):
    with pytest.raises(SpecError) as err:
        load_gpu(name)
    text = str(err.value)
    assert f"unknown GPU profile {name!r}" in text
    assert hint in text
    assert "valid: a100-40gb, a100-80gb, h100-80gb" in text


def test_gpu_round_trip_through_toml(tmp_path):
    spec = replace(load_gpu("h200"), name="my-h200", memory_bytes=150_000_000_000, efficiency=0.512, display_name='odd "name" ×')
    path = write_gpu_toml(spec, tmp_path / "mine.toml", calibration={"matmul_bf16_tflops": 701.5, "host": "node-1", "ok": True})
    assert gpu_from_toml(path) == spec
    assert load_gpu(str(path)) == spec
    assert load_gpu(path) == spec
    assert [p.name for p in tmp_path.iterdir()] == ["mine.toml"]  # no temp file left behind


def test_write_gpu_toml_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "gpu.toml"
    write_gpu_toml(load_gpu("a100-80gb"), path)
    before = path.read_text()
    with pytest.raises(SpecError, match="not finite"):
        write_gpu_toml(load_gpu("h200"), path, calibration={"bad": float("nan")})
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.toml"]
    with pytest.raises(SpecError, match="does not exist"):
        write_gpu_toml(load_gpu("h200"), tmp_path / "missing" / "gpu.toml")


def _profile_text(**changes) -> str:
    text = (profiles.GPU_DIR / "a100-80gb.toml").read_text()
    for old, new in changes.items():
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize(
    "text, message",
    [
        (_profile_text(**{"memory_bandwidth = ": "memory_bandwith = "}), "unknown key(s) memory_bandwith"),
        (_profile_text(**{"host_bandwidth = 32000000000.0\n": ""}), "missing key(s) host_bandwidth"),
        (_profile_text(**{"memory_bytes = 85899345920": "memory_bytes = -1"}), "gpu memory_bytes=-1 is too small"),
        (_profile_text(**{"intra_node_bandwidth = 300000000000.0": "intra_node_bandwidth = \"fast\""}), "not a number"),
        (_profile_text(**{"fp32 = ": "tf32 = "}), "peak_flops lacks 'fp32'"),
        (_profile_text(**{"[peak_flops]": "[peak_flops"}), "not valid TOML"),
        ("name = 'x'\npeak_flops = 3\n", "missing key(s) memory_bytes"),
    ],
)
def test_bad_gpu_toml(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        gpu_from_toml(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_gpu_toml_path_errors(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_gpu(str(tmp_path / "none.toml"))
    with pytest.raises(SpecError, match="is a directory"):
        gpu_from_toml(tmp_path)


# ---------------------------------------------------------------------------------------------
# NVML detection


@pytest.mark.parametrize(
    "device, profile",
    [
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb"),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("Tesla V100-SXM2-32GB", "v100-32gb"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("Tesla T4", None),
    ],
)
def test_device_name_mapping(device, profile):
    assert gpu_for_device_name(device) == profile


def test_default_gpu_without_nvml_here():
    # This machine has no NVIDIA driver: the stated default, never an exception.
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present; covered by the fake-NVML tests")
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - any NVML failure means "no driver" for this check
        pass
    spec, note = default_gpu()
    assert spec == load_gpu("a100-80gb")
    # default_gpu's note (zeroplan profiles, which has no --gpu) names no option; the commands
    # that take --gpu get detect_gpu's, which says to set it.
    assert "a100-80gb assumed" in note and "--gpu" not in note
    from zeroplan.profiles import detect_gpu

    assert detect_gpu()[1] == note + "; set --gpu"


def test_detection_without_a_driver_says_what_pynvml_says():
    """Without NVML's library, detection answers before importing pynvml, in pynvml's own words:
    the note equals the one pynvml's nvmlInit gives (same process kind, pynvml imported first)."""
    import subprocess
    import sys

    from helpers import zeroplan_env

    code = "import sys\n{}\nfrom zeroplan.profiles import detect_gpu\nprint(detect_gpu()[1]); print('pynvml' in sys.modules)"
    lazy = subprocess.run([sys.executable, "-c", code.format("")], capture_output=True, text=True, env=zeroplan_env(), timeout=60)
    eager = subprocess.run([sys.executable, "-c", code.format("import pynvml")], capture_output=True, text=True, env=zeroplan_env(),
                           timeout=60)
    assert lazy.returncode == 0 == eager.returncode, lazy.stderr + eager.stderr
    note, imported = lazy.stdout.splitlines()
    if "detected" in eager.stdout:
        pytest.skip("an NVIDIA driver is present: pynvml is imported and asked")
    assert note == eager.stdout.splitlines()[0]
    assert imported == "False"


class _NVMLError(Exception):
    pass


def _fake_pynvml(*, name="NVIDIA H200", total=150_754_820_096, count=1, init_error=False):
    """Stand-in for nvidia-ml-py's module (no NVIDIA driver on the test machine)."""
    mod = types.ModuleType("pynvml")
    mod.NVMLError = _NVMLError
    calls = {"shutdown": 0}

    def init():
        if init_error:
            raise _NVMLError("Driver Not Loaded")

    def shutdown():
        calls["shutdown"] += 1

    mod.nvmlInit = init
    mod.nvmlShutdown = shutdown
    mod.nvmlDeviceGetCount = lambda: count
    mod.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    mod.nvmlDeviceGetName = lambda h: name
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=total, free=total, used=0)
    mod.calls = calls
    return mod


def test_default_gpu_detected(monkeypatch):
    fake = _fake_pynvml(name=b"NVIDIA H100 80GB HBM3", total=85_520_809_984, count=8)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    spec, note = default_gpu()
    assert spec == replace(load_gpu("h100-80gb"), memory_bytes=85_520_809_984)
    assert "detected NVIDIA H100 80GB HBM3" in note and "×8" in note and "h100-80gb" in note
    assert fake.calls["shutdown"] == 1


def test_default_gpu_unknown_device_keeps_its_memory(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(name="Tesla T4", total=16 * GiB))
    spec, note = default_gpu()
    assert spec.memory_bytes == 16 * GiB and spec.name == "a100-80gb"
    assert "no matching profile" in note


@pytest.mark.parametrize("kwargs, text", [({"init_error": True}, "no NVIDIA driver"), ({"count": 0}, "sees no device")])
def test_default_gpu_nvml_failures(monkeypatch, kwargs, text):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(**kwargs))
    spec, note = default_gpu()
    assert spec == load_gpu("a100-80gb") and text in note


def test_default_gpu_without_nvidia_ml_py(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    spec, note = default_gpu()
    assert spec == load_gpu("a100-80gb") and "nvidia-ml-py not installed" in note


def test_gpus_default_is_this_machines_gpus_else_8_to_plan_and_2_to_run(monkeypatch):
    """--gpus not given: NVML's count (narrowed by CUDA_VISIBLE_DEVICES, as CUDA narrows it);
    without a GPU, 8 for estimate/export and 2 CPU ranks for probe/tune."""
    from zeroplan.cli.common import resolve_gpus
    from zeroplan.profiles import local_gpu_count

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(name="NVIDIA H100 80GB HBM3", count=8))
    assert local_gpu_count() == 8
    assert resolve_gpus(None, runs_here=False) == resolve_gpus(None, runs_here=True) == 8
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert resolve_gpus(None, runs_here=True) == 2 and resolve_gpus(4, runs_here=True) == 4
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(init_error=True))
    assert local_gpu_count() is None
    assert (resolve_gpus(None, runs_here=False), resolve_gpus(None, runs_here=True)) == (8, 2)


# ---------------------------------------------------------------------------------------------
# Model presets


def test_model_presets_present():
    assert set(model_names()) == EXPECTED_MODELS


@pytest.mark.parametrize("name", sorted(EXPECTED_MODELS))
def test_model_preset_matches_its_config(name):
    spec = load_model_preset(name)
    info = model_preset_info(name)
    assert spec.name == name and spec.source == "preset"
    assert info["source"] and info["display_name"]
    # params and shape are what the embedded architecture config counts to.
    from zeroplan.profiles.hf_config import model_from_hf_dict

    counted = model_from_hf_dict(info["hf_config"], name=name)
    for field in ("params", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_size", "vocab_size",
                  "tied_embeddings", "gated_mlp", "largest_layer_params", "active_params", "moe", "qk_norm"):
        assert getattr(spec, field) == getattr(counted, field), field


@pytest.mark.parametrize("name", sorted(EXPECTED_MODELS))
def test_model_preset_params_equal_transformers(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    data = dict(model_preset_info(name)["hf_config"])
    model_type = data.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **data)
    auto = transformers.AutoModelForSeq2SeqLM if model_type == "t5" else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    assert load_model_preset(name).params == sum(p.numel() for p in model.parameters())


def test_published_parameter_counts():
    # GPT-2 small, tied lm_head counted once: 124,439,808 (transformers' GPT2LMHeadModel).
    assert load_model_preset("gpt2").params == 124_439_808
    # Llama 2 (arXiv 2307.09288) and Llama 3 Hub checkpoints.
    assert load_model_preset("llama-2-7b").params == 6_738_415_616
    assert load_model_preset("llama-2-13b").params == 13_015_864_320
    assert load_model_preset("llama-2-70b").params == 68_976_648_192
    assert load_model_preset("llama-3-8b").params == 8_030_261_248
    assert load_model_preset("llama-3-70b").params == 70_553_706_496
    # BLOOM model card: "176,247,271,424 parameters".
    assert load_model_preset("bloom-176b").params == 176_247_271_424
    # GPT-3 (arXiv 2005.14165 Table 2.1) reports 175.0B; the dense GPT-2-style count is within 0.3%.
    assert abs(load_model_preset("gpt3-175b").params - 175.0e9) / 175.0e9 < 0.003
    # MT-NLG (arXiv 2201.11990) reports 530B.
    assert abs(load_model_preset("megatron-turing-530b").params - 530e9) / 530e9 < 0.002
    # Qwen3-30B-A3B model card: "30.5B in total and 3.3B activated"; Mixtral (arXiv 2401.04088):
    # 47B, 13B active; DeepSeek-V3 (arXiv 2412.19437): 671B, 37B activated.
    for name, total, active in (("qwen3-30b-a3b", 30.5e9, 3.3e9), ("mixtral-8x7b", 46.7e9, 12.9e9), ("deepseek-v3", 671e9, 37e9)):
        spec = load_model_preset(name)
        assert abs(spec.params - total) / total < 0.01 and abs(spec.active_params - active) / active < 0.03, name


def test_unknown_model_preset():
    with pytest.raises(SpecError) as err:
        load_model_preset("llama2-7b")
    assert "unknown model preset 'llama2-7b' (did you mean llama-2-7b?)" in str(err.value)
    assert "config.json" in str(err.value)


def test_t5_preset_says_it_is_an_equivalent_shape():
    spec = load_model_preset("t5-3b")
    assert spec.num_layers == 48 and any("encoder-decoder" in n for n in spec.notes)
    assert spec.params == count_hf_params(model_preset_info("t5-3b")["hf_config"])


# ---------------------------------------------------------------------------------------------
# CLI


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return run_zeroplan(*args, columns=100)


def test_cli_profiles_json():
    result = run_cli("profiles", "--format", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert {g["name"] for g in doc["gpus"]} == EXPECTED_GPUS
    assert {m["name"] for m in doc["models"]} == EXPECTED_MODELS
    by_name = {m["name"]: m for m in doc["models"]}
    assert by_name["llama-3-8b"]["params"] == 8_030_261_248 and by_name["llama-3-8b"]["num_kv_heads"] == 8
    assert "Touvron" in by_name["llama-2-7b"]["reference"]
    assert doc["detected_gpu"]["note"].startswith("GPU:")


def test_cli_profiles_table_and_output(tmp_path):
    result = run_cli("profiles")
    assert result.returncode == 0, result.stderr
    for name in ("h100-80gb", "mi300x", "llama-3-70b", "megatron-turing-530b"):
        assert name in result.stdout
    assert "989.4" in result.stdout and "8.03B" in result.stdout
    out = tmp_path / "profiles.txt"
    result = run_cli("profiles", "--output", str(out))
    assert result.returncode == 0 and result.stdout == ""
    assert "llama-3-70b" in out.read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (("profiles", "--format", "csv"), "--format 'csv' is not valid; choose one of table, json"),
        (("estimate", "--model", "llama2-7b", "--gpus", "8"), "did you mean llama-2-7b?"),
        (("estimate", "--model", "/nonexistent/config.json", "--gpus", "8"), "/nonexistent/config.json: no such file"),
        (("estimate", "--params", "7e9", "--gpu", "h100", "--gpus", "8"), "did you mean h100-80gb or h100-pcie?"),
    ],
)
def test_cli_bad_input(args, message):
    result = run_cli(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zeroplan: error: ") and message in lines[0]


def test_cli_bad_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mamba", "hidden_size": 768}))
    result = run_cli("estimate", "--model", str(path), "--gpus", "8")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "model_type 'mamba' is not supported; supported: bloom, deepseek_v3, gemma, gpt2" in result.stderr


def test_profiles_module_stays_light():
    # `zeroplan estimate` imports zeroplan.profiles: it must not pull torch or transformers in.
    code = "import sys, zeroplan.profiles, zeroplan.cli.profiles; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.stdout.strip() == "[]", result.stderr




@pytest.mark.parametrize("tiny", [False, True])
def test_vision_language_config_counts_like_transformers(tiny):
    """Qwen3-VL: the decoder from text_config plus the vision tower and mergers, against
    transformers' Qwen3VLMoeForConditionalGeneration on the meta device (full size and a tiny one)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from zeroplan.profiles.hf_config import model_from_hf_dict
    from zeroplan.profiles.hf_config_vision import qwen3_vl_vision_params

    data = json.loads(json.dumps(QWEN3_VL_30B_A3B))
    if tiny:
        data["text_config"].update(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                                   num_experts_per_tok=2, vocab_size=1000)
        data["vision_config"].update(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                                     deepstack_visual_indexes=[1, 3])
    config = transformers.Qwen3VLMoeConfig(text_config=data["text_config"], vision_config=data["vision_config"],
                                           tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.Qwen3VLMoeForConditionalGeneration(config)
    spec = model_from_hf_dict(data, name="qwen3-vl")
    assert spec.params == sum(p.numel() for p in model.parameters())
    assert sum(qwen3_vl_vision_params(data["vision_config"]).values()) == sum(p.numel() for p in model.model.visual.parameters())
    text = model_from_hf_dict({**data["text_config"], "model_type": "qwen3_moe", "tie_word_embeddings": False}, name="text")
    assert (spec.hidden_size, spec.num_layers, spec.moe, spec.qk_norm) == (text.hidden_size, text.num_layers, text.moe, True)
    if not tiny:
        assert spec.params == 31_070_754_032 and spec.params - text.params == 538_631_408


def test_dense_vision_language_config_counts_like_transformers():
    """Qwen3-VL's dense form (``qwen3_vl``): a tiny config against transformers'
    Qwen3VLForConditionalGeneration on the meta device, vision tower included."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from zeroplan.profiles.hf_config import model_from_hf_dict

    text = {"model_type": "qwen3_vl_text", "attention_bias": False, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
            "intermediate_size": 96, "max_position_embeddings": 4096, "num_attention_heads": 4, "num_hidden_layers": 2,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 5000000, "vocab_size": 1000,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": [2, 3, 3], "rope_type": "default"}}
    vision = {**QWEN3_VL_30B_A3B["vision_config"], "model_type": "qwen3_vl", "depth": 4, "hidden_size": 32, "intermediate_size": 48,
              "num_heads": 2, "out_hidden_size": 64, "deepstack_visual_indexes": [1, 3]}
    data = {"model_type": "qwen3_vl", "tie_word_embeddings": False, "text_config": text, "vision_config": vision}
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.Qwen3VLForConditionalGeneration(config)
    assert model_from_hf_dict(data, name="qwen3-vl-dense").params == sum(p.numel() for p in model.parameters())


def test_vision_language_config_without_vision_config_is_one_line():
    from zeroplan.profiles.hf_config import model_from_hf_dict
    from zeroplan.spec import SpecError

    with pytest.raises(SpecError, match='needs "text_config" and "vision_config"'):
        model_from_hf_dict({"model_type": "qwen3_vl_moe", "text_config": {}}, name="cfg.json")
