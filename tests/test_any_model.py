"""Models that are not transformers, and what a GPU run would hold on the device.

References: the live tensor bytes of a real forward + backward measured with the probe's own
StorageTracker (the trace runs the same module under FakeTensorMode), torch's parameter counts,
transformers' LlamaConfig, and probes of real DeepSpeed engines on CPU ranks (slow tests).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import ROOT, example, run_main

from zeroplan.profiles.resolve import model_from_params
from zeroplan.runtime.discovery.discover import DiscoveredModel, activation_source
from zeroplan.spec import ModelSpec


torch = pytest.importorskip("torch")


def _mlp(layers: int = 8, width: int = 256):
    return example("train_deepspeed_mlp").build_model(layers, width)


def _real_peak(model, batch) -> int:
    """The trace's accounting (zeroplan.trace.module._Lifetimes) on a real forward + backward of
    real tensors: what the fake run must reproduce byte for byte."""
    from zeroplan.trace.module import _Lifetimes
    from zeroplan.trace.recording import _storage_keys

    live = _Lifetimes(_storage_keys(list(model.parameters())))
    hooks = []
    for p in model.parameters():
        hooks.append(p.register_hook(lambda g: (live.mark_gradient(g), g)[1]))
        hooks.append(p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None)))
    try:
        with live.mode:
            out = model(batch)
            torch.autograd.backward([out], [torch.ones_like(out)])
            del out
    finally:
        for h in hooks:
            h.remove()
    return live.peak()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traced_module_matches_a_real_forward_backward(dtype):
    from zeroplan.trace.module import trace_module

    model = _mlp().to(dtype)
    batch = torch.randn(4, 256, dtype=dtype)
    traced = trace_module(model, (batch,))
    assert traced.micro_batch == 4 and traced.input_shapes == ((4, 256),)
    assert traced.peak_at_micro_batch == _real_peak(model, batch)
    assert traced.peak_at_double == _real_peak(model, torch.randn(8, 256, dtype=dtype))
    # Linear + ReLU keeps nothing that does not grow with the batch: the line goes through 0.
    assert traced.fixed == 0 and traced.bytes_at(12) == 3 * traced.peak_at_micro_batch
    assert all(p.grad is None for p in model.parameters())  # the real module is untouched


def test_activation_source_is_traced_only_for_models_that_are_not_transformers():
    gpt_task = example("gpt_task")
    from transformers import LlamaConfig, LlamaForCausalLM

    from zeroplan.runtime.discovery.discover_worker import describe_model

    assert activation_source(describe_model(_mlp())) == "traced"
    assert activation_source(describe_model(gpt_task.GPT(gpt_task.GPTConfig()))) == "module-tree"
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert activation_source(describe_model(llama)) == "config"


def test_discovered_mlp_estimate_uses_its_trace_and_its_real_parameter_sizes():
    from zeroplan.runtime.discovery.discover_worker import describe_model
    from zeroplan.trace.module import trace_module
    from zeroplan.estimator.embedding_backward import _matrices_over

    model = _mlp(8, 1024)
    data = {"entry_point": "deepspeed.initialize", "model": describe_model(model), "micro_batch": 1, "seq_len": 1024,
            "activations": trace_module(model, (torch.randn(1, 1024),)).as_dict()}
    found = DiscoveredModel.from_worker(data, script="train_deepspeed_mlp.py")
    assert found.activations_source == "traced"
    spec = ModelSpec.from_dict(found.model_spec().as_dict())
    assert spec.params == 8 * 1024 * 1024 and spec.parameter_sizes == ((1024 * 1024, 8),)
    # Stage 1 keeps gradients larger than the reduce bucket: the real 1024² matrices, not a guessed block.
    assert _matrices_over(spec, 1_000_000) == 8 * 1024 * 1024 and _matrices_over(spec, 2_000_000) == 0
    assert found.traced_activations()(type("P", (), {"micro_batch": 1})()) == data["activations"]["peak_at_micro_batch"]


def _mlp_summary(activations: dict | None, error: str | None = None) -> dict:
    from zeroplan.runtime.discovery.discover_worker import describe_model

    data = {"entry_point": "deepspeed.initialize", "model": describe_model(_mlp(8, 1024)), "micro_batch": 1, "seq_len": 1024,
            "activations": activations, "activations_error": error}
    found = DiscoveredModel.from_worker(data, script="train_deepspeed_mlp.py")
    return {"model_spec": found.model_spec().as_dict(), "discovered": found.as_dict(), "seq_len": 1, "memory_kind": "cpu-storage"}


def test_probe_estimate_of_a_model_that_is_not_a_transformer():
    from zeroplan.runtime.api import ProbeRequest
    from zeroplan.runtime.measure.prediction import _estimate
    from zeroplan.spec import Plan

    request = ProbeRequest(script=ROOT / "examples" / "train_deepspeed_mlp.py", nproc=2)
    plan = Plan(stage=2, micro_batch=1, reduce_bucket_size=1_000_000, allgather_bucket_size=1_000_000)
    small, large = {"module_class": "torch.nn.Sequential", "micro_batch": 1, "peak_at_micro_batch": 22_528, "peak_at_double": 45_056}, None
    large = dict(small, peak_at_micro_batch=small["peak_at_micro_batch"] + 50 * 2**20, peak_at_double=small["peak_at_double"] + 50 * 2**20)
    def at_loss(summary: dict, context: dict) -> int:
        estimated, note = _estimate(request, plan, None, summary, 2, context)
        assert estimated == int(context["est"].gpu.peak_allocated)
        return next(m.activations for m in context["est"].moments if m.name == "the loss's backward"), note

    context: dict = {}
    acts, note = at_loss(_mlp_summary(small), context)
    # The traced bytes are the activations the estimate holds, not a transformer's for 1,024 "tokens".
    assert acts == 22_528 and context["activations_source"] == "traced" and note is None
    assert at_loss(_mlp_summary(large), {})[0] == large["peak_at_micro_batch"]
    context = {}
    acts, note = at_loss(_mlp_summary(None, "tracing Sequential's forward failed"), context)
    assert acts == 0 and context["activations_source"] == "not-modelled"
    assert "not modelled" in note and "forward failed" in note


@pytest.mark.parametrize("params", [1e6, 8388608, 13.6e6, 13.7e6, 1.25e8, 7e9, 175e9, 1e12])
def test_shape_from_params_adds_up_to_the_count(params):
    spec = model_from_params(params)
    # The embedding and at least one block fit in the count; the blocks make up the rest.
    assert spec.embedding_params + spec.block_params <= spec.params
    formula = spec.embedding_params + spec.num_layers * spec.block_params
    assert abs(formula - spec.params) / spec.params < 0.35
    assert spec.hidden_size % spec.num_heads == 0


def test_shape_from_params_keeps_the_gpt3_rule_where_it_holds():
    assert (model_from_params(175e9).hidden_size, model_from_params(175e9).num_layers) == (12288, 96)
    small = model_from_params(8388608)
    assert small.vocab_size == 1 and "no vocabulary" in small.notes[0]
    assert model_from_params(7e9).vocab_size == 50257


def test_keep_on_device_sets_host_data_aside():
    from zeroplan.runtime.measure.memory import PeakMemory, device_roots

    with PeakMemory(torch.device("cpu")) as memory:
        corpus = torch.zeros(1000, 1000)  # 4,000,000 bytes built before the model: host memory on a GPU
        model = torch.nn.Linear(100, 100)  # 40,400 bytes
        assert memory.current_bytes == 4_040_400
        assert memory.keep_on_device(device_roots(model)) == 4_000_000
        assert memory.current_bytes == memory.peak_bytes == 40_400
        row = corpus[3]  # a view of host storage: still host memory
        assert memory.current_bytes == 40_400
        batch = corpus[:10].to("cpu")  # moved "to the device": its own 10 rows, not the corpus
        assert memory.current_bytes == 40_400 + 40_000
        del batch
        assert memory.current_bytes == 40_400
        made = torch.ones(10, 10)  # allocated after the engine: device memory
        assert memory.current_bytes == 40_800 and memory.peak_bytes == 80_400
        del corpus, row, made
        assert memory.tracker.host_bytes == 0


def _probe(args: list[str], tmp_path: Path, capsys, monkeypatch) -> dict:
    """``zeroplan probe ARGS --format json`` on CPU ranks through the CLI in this process: the
    probes share the session's warm launcher server (tests/conftest.py ``warm_server``)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    cut = args.index("--")
    args = [*args[:cut], "--workdir", str(tmp_path / "w"), "--format", "json", *args[cut:]]
    code, out, err = run_main(["probe", *args], capsys)
    assert code == 0, err[-2000:]
    return json.loads(out)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_probe_of_a_linear_stack_without_model_flags_is_traced(tmp_path, capsys, monkeypatch, warm_server):
    r = _probe([str(ROOT / "examples" / "train_deepspeed_mlp.py"), "--gpus", "2", "--stage", "1", "--reduce-bucket-size", "1e6",
                "--allgather-bucket-size", "1e6", "--", "--steps", "8"], tmp_path, capsys, monkeypatch)
    assert r["status"] == "ok" and r["activations_source"] == "traced"
    assert abs(r["memory_error"]) <= 0.10, r["memory_error"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_script_with_a_host_corpus_probes_within_15_percent(tmp_path, capsys, monkeypatch, warm_server):
    data = ROOT / "tests" / "data"
    r = _probe([str(data / "trainer_token_tensor.py"), "--config", str(data / "configs" / "zero2_auto.json"), "--gpus", "2",
                "--micro-batch", "1", "--", "--use_cpu", "--output_dir", str(tmp_path / "out"), "--report_to", "none"], tmp_path, capsys, monkeypatch)
    assert r["status"] == "ok" and r["activations_source"] == "config"
    rank = json.loads((tmp_path / "w" / "rank-0.json").read_text())
    assert rank["host_tensors_set_aside"] >= 100_000 * 128 * 8  # the corpus
    assert abs(r["memory_error"]) <= 0.15, r["memory_error"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_discovery_run_traces_a_model_that_is_not_a_transformer(tmp_path):
    from zeroplan.runtime.discovery.discover import discover_model, discovery_config
    from zeroplan.spec import TrainingSpec

    found = discover_model(ROOT / "examples" / "train_deepspeed_mlp.py", script_args=("--steps", "2"),
                           ds_config=discovery_config(TrainingSpec()), workdir=tmp_path)
    assert found.total_params == 8 * 1024 * 1024 and found.activations_source == "traced"
    traced = found.traced_activations()
    assert traced.micro_batch == 1 and traced.input_shapes == ((1, 1024),) and traced.peak_at_micro_batch > 0
    assert found.model_spec().parameter_sizes == ((1024 * 1024, 8),)


def test_tune_space_of_a_discovered_mlp_uses_what_probe_predicts():
    """tune prunes and ranks a model that is not a transformer with its own traced activations —
    the figure a probe of it prints (0.0 % of the measured peak, benchmarks/results/any_model.txt)
    — not with a GPT derived from its parameter count."""
    from zeroplan.estimator import estimate_plan
    from zeroplan.profiles import resolve_cluster
    from zeroplan.runtime.discovery.discover_worker import describe_model
    from zeroplan.runtime.measure.prediction import comparable_estimate
    from zeroplan.spec import TrainingSpec
    from zeroplan.trace.module import trace_module
    from zeroplan.tuner import build_space

    model = _mlp(8, 1024)
    data = {"entry_point": "deepspeed.initialize", "model": describe_model(model), "micro_batch": 1, "seq_len": 1024,
            "activations": trace_module(model, (torch.randn(1, 1024),)).as_dict()}
    found = DiscoveredModel.from_worker(data, script="train_deepspeed_mlp.py")
    spec = found.model_spec()
    cluster = resolve_cluster(gpus=2, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=None, cpu_memory_gib=64, nvme_gib=None)
    # Discovery reads the first batch's second dimension as its length: 1024 floats, as tune does.
    training = TrainingSpec(seq_len=found.seq_len, global_batch=8)
    traced = build_space(spec, cluster, training, stages=(1, 2), device="cpu", activation_bytes=found.activation_bytes())
    formula = build_space(spec, cluster, training, stages=(1, 2), device="cpu")
    by_key = {c.key: c for c in formula.candidates}
    assert traced.candidates
    for cand in traced.candidates:
        est = estimate_plan(spec, cluster, training, cand.plan, device="cpu", activation_bytes=found.activation_bytes())
        assert cand.predicted_peak_memory_bytes == comparable_estimate(est, on_cpu=True, ranks_per_node=2)
        # A GPT guessed from the count reads the 1024 floats as 1024 tokens (+19.7 % at 2 ranks, z1).
        assert cand.predicted_peak_memory_bytes < by_key[cand.key].predicted_peak_memory_bytes
    untraced = DiscoveredModel.from_worker({**data, "activations": None, "activations_error": "boom"}, script="x.py")
    assert untraced.activations_source == "not-modelled" and untraced.activation_bytes()(traced.candidates[0].plan) == 0
