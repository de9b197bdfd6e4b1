"""Traced activation memory: FakeTensorMode trace vs bytes alive after a real forward, fits, errors.

Truths used here: the bytes of storages actually alive after a real forward on CPU (a dispatch
mode watching allocations, independent of the saved-tensor hooks the tracer counts with), the
kernels' documented saves (eager softmax keeps its fp32 output, full recompute keeps the block
input, Korthikanti et al. 2022 §4), and transformers' own config classes for bad input.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from zeroplan.spec import Plan, SpecError, TrainingSpec  # noqa: E402
from zeroplan.trace import Tracer, activation_override, fit_activation_model, trace_activations  # noqa: E402
from zeroplan.trace.measure import measure_retained_bytes  # noqa: E402

from helpers import ROOT

# A few hundred thousand parameters each: GPT-2 (learned positions, GELU, dropout 0.1),
# Llama (RMSNorm, rotary, SwiGLU, GQA) and Qwen2 (Llama plus q/k/v biases).
TINY = {
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 128},
    "llama": {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    },
    "qwen2": {
        "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    },
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("configs")
    paths = {}
    for name, cfg in TINY.items():
        paths[name] = folder / f"{name}.json"
        paths[name].write_text(json.dumps(cfg))
    return paths


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "eager"])
@pytest.mark.parametrize("arch", sorted(TINY))
def test_fake_trace_matches_bytes_alive_after_real_forward(configs, arch, flash):
    fake = Tracer(configs[arch], precision="bf16", flash_attention=flash)
    real = Tracer(configs[arch], precision="bf16", flash_attention=flash, fake=False)
    for mode in ("none", "selective", "full"):
        traced = fake.trace(micro_batch=2, seq_len=32, checkpointing=mode)
        measured = measure_retained_bytes(None, micro_batch=2, seq_len=32, checkpointing=mode, tracer=real)
        kept = traced.total - traced.recompute  # what is alive when forward ends
        assert measured.retained > 0
        assert abs(kept - measured.retained) <= 0.02 * measured.retained, (arch, flash, mode, kept, measured)
        # The same hook on real tensors counts the same bytes as on fake ones.
        assert real.trace(micro_batch=2, seq_len=32, checkpointing=mode).total == traced.total


@pytest.mark.parametrize("mode", ["none", "full"])
def test_backward_peak_on_fake_tensors_equals_the_real_run(configs, mode):
    fake = Tracer(configs["llama"], precision="bf16")
    real = Tracer(configs["llama"], precision="bf16", fake=False)
    traced = fake.trace(micro_batch=2, seq_len=32, checkpointing=mode)
    peak_fake = fake.peak(micro_batch=2, seq_len=32, checkpointing=mode)
    peak_real = real.peak(micro_batch=2, seq_len=32, checkpointing=mode)
    assert peak_fake.end_of_forward == traced.total - traced.recompute
    assert peak_fake.peak == peak_real.peak and peak_fake.peak_op == peak_real.peak_op
    assert peak_fake.peak_phase == "backward" and peak_fake.peak > peak_fake.end_of_forward
    if mode == "none":
        # The loss's backward holds the fp32 gradient of the log-softmax output and of its
        # input on top of everything forward kept: 2 × 4·b·s·V bytes.
        vocab = TINY["llama"]["vocab_size"]
        assert peak_fake.peak - peak_fake.end_of_forward == pytest.approx(8 * 2 * 32 * vocab, rel=0.05)


def test_checkpointing_keeps_less_and_full_keeps_the_block_input(configs):
    # Flash attention: with eager attention the causal mask is a block argument too.
    tracer = Tracer(configs["gpt2"], precision="bf16", flash_attention=True)
    b, s, h = 3, 32, TINY["gpt2"]["n_embd"]
    none, selective, full = (tracer.trace(micro_batch=b, seq_len=s, checkpointing=m) for m in ("none", "selective", "full"))
    assert full.layers < selective.layers < none.layers
    # Korthikanti et al. 2022 §4.1: full recompute keeps only each block's input, 2·s·b·h bytes in 16-bit.
    assert full.per_layer == (2 * s * b * h,) * TINY["gpt2"]["n_layer"]
    # Recomputing one block rematerialises what that block kept without checkpointing.
    assert full.recompute == max(n - f for n, f in zip(none.per_layer, full.per_layer))
    assert none.recompute == 0 and selective.recompute > 0


def test_eager_attention_keeps_the_softmax_output_flash_does_not(configs):
    # Llama's eager attention: softmax in fp32 (its output saved, 4 bytes) cast back to bf16 for
    # the product with V (saved, 2 bytes): 6·a·s² bytes per sample per layer; flash keeps none.
    cfg = TINY["llama"]
    eager = fit_activation_model(configs["llama"], seq_len=64, flash_attention=False, checkpointing=("none",))
    flash = fit_activation_model(configs["llama"], seq_len=64, flash_attention=True, checkpointing=("none",))
    beta_eager = eager.fit("none").coefficients["layers"][1]
    beta_flash = flash.fit("none").coefficients["layers"][1]
    assert beta_eager == pytest.approx(6 * cfg["num_attention_heads"] * cfg["num_hidden_layers"], rel=1e-6)
    assert abs(beta_flash) < 1e-6


def test_fit_reproduces_traces_at_other_shapes(configs):
    model = fit_activation_model(configs["llama"], seq_len=48, checkpointing=("none", "full"))
    tracer = model.tracer
    for mode in ("none", "full"):
        assert model.fit(mode).max_fit_error < 1e-3
        for b, s in ((5, 48), (1, 20), (4, 40)):
            direct = tracer.trace(micro_batch=b, seq_len=s, checkpointing=mode).total
            assert model.bytes(b, s, mode) == pytest.approx(direct, rel=1e-3), (mode, b, s)


def test_override_is_the_estimator_hook(configs):
    training = TrainingSpec(precision="bf16", seq_len=32)
    override = activation_override(configs["qwen2"], training)
    for plan in (Plan(stage=2, micro_batch=2), Plan(stage=3, micro_batch=3, checkpointing="full")):
        direct = trace_activations(configs["qwen2"], seq_len=32, micro_batch=plan.micro_batch, checkpointing=plan.checkpointing)
        # Plus the loss's backward: fp32 gradients of log-softmax input and output, 2 × 4·s·b·V.
        loss = 8 * 32 * plan.micro_batch * TINY["qwen2"]["vocab_size"]
        assert override(plan) == pytest.approx(direct.total + loss, rel=1e-3)
        assert override.breakdown(plan)["loss_gradients"] == loss
        assert override.breakdown(plan)["total"] == override(plan)
    assert "traced" in override.describe() and "8·s·b·V" in override.describe()
    assert set(override.as_dict()["fits"]) == {"none", "full"}


def test_peak_fit_matches_direct_peaks(configs):
    # On this tiny model the op at which the peak happens moves with the batch size under full
    # checkpointing (a block's backward overtakes the loss's), so that fit is flagged and each
    # shape is traced directly; the un-checkpointed peak stays at the loss and fits exactly.
    override = activation_override(configs["llama"], TrainingSpec(precision="bf16", seq_len=32), measure="peak")
    for plan in (Plan(stage=2, micro_batch=5), Plan(stage=3, micro_batch=4, checkpointing="full")):
        assert override(plan) == pytest.approx(override.peak(plan), rel=1e-3)
    assert override.model.fit("none").max_fit_error < 1e-3
    assert "peak" in override.describe()


def test_task_script_is_traced_at_its_own_seq_len():
    task = ROOT / "examples" / "gpt_task.py"
    model = fit_activation_model(task, seq_len=64, precision="fp32", checkpointing=("none",))
    real = Tracer(task, precision="fp32", fake=False)
    measured = measure_retained_bytes(None, micro_batch=3, seq_len=64, tracer=real)
    assert model.bytes(3, 64, "none") == pytest.approx(measured.retained, rel=0.02)
    with pytest.raises(SpecError, match="seq_len 64"):
        model.bytes(1, 128, "none")


@pytest.mark.parametrize(
    "body, needle",
    [
        ("x = 1\n", "has no top-level function zeroplan_task()"),
        ("def zeroplan_task():\n    return {'build_model': None}\n", "returned dict, not zeroplan.runtime.rank.task.Task"),
        ("raise ValueError('bad flag --foo')\n", "fails to load: ValueError: bad flag --foo"),
    ],
)
def test_task_scripts_load_as_the_probe_worker_loads_them(tmp_path, body, needle):
    """One loader (zeroplan.spec.task.load_task) for the worker, the tuner and the tracer: a script
    the worker would reject is rejected here too, in one line naming the script."""
    from zeroplan.trace.source import TaskSource

    script = tmp_path / "task.py"
    script.write_text(body)
    with pytest.raises(SpecError) as err:
        TaskSource.from_path(script)
    assert needle in str(err.value) and str(script) in str(err.value) and "\n" not in str(err.value)


def test_large_config_traces_without_memory(tmp_path):
    psutil = pytest.importorskip("psutil")
    cfg = {  # Llama-3-8B's shape
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    before = psutil.Process().memory_info().rss
    traced = trace_activations(path, seq_len=4096, micro_batch=1)
    grown = psutil.Process().memory_info().rss - before
    assert traced.total > 20 * 2**30  # the activations of one 4096-token sample
    assert grown < 2**30  # ... without allocating them (nor 16 GB of weights)
    # The fp32 log-softmax alone is s·V·4 bytes.
    assert traced.logits > 4096 * 128256 * 4


@pytest.mark.parametrize(
    "content, message",
    [
        ({"model_type": "no-such-model", "hidden_size": 8}, "unknown to transformers"),
        ({"hidden_size": 8}, "no 'model_type'"),
        ({"model_type": "llama", "hidden_size": 63, "num_attention_heads": 4, "num_hidden_layers": 1}, "fails to build|does not build"),
        ("{not json", "not readable JSON"),
    ],
)
def test_bad_configs_are_one_line_spec_errors(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(SpecError, match=message) as info:
        activation_override(path, TrainingSpec(seq_len=16))
    assert "\n" not in str(info.value)


def test_missing_transformers_is_a_spec_error(tmp_path, monkeypatch):
    import importlib.util

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY["llama"]))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real_find_spec(name, *a))
    with pytest.raises(SpecError, match="needs the transformers library"):
        trace_activations(path, seq_len=16)


def test_importing_trace_does_not_import_torch():
    code = "import sys, zeroplan.trace; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
