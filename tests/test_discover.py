"""Model discovery: the model a script creates, read where it creates its engine.

References: ``sum(p.numel())`` of the script's own model, DeepSpeed's ``model_to_params``
(deepspeed/runtime/zero/stage3.py) for the largest layer, the shape the example task declares by
hand, and transformers' LlamaConfig for a Hugging Face model.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from zeroplan.runtime.discovery.discover import DISCOVERY_FILE, DiscoveredModel, discover_model, discovered_or_cached
from zeroplan.spec import SpecError

from helpers import ROOT, example, run_zeroplan, zeroplan_env
ENV = zeroplan_env(DS_ACCELERATOR="cpu")
gpt_task = example("gpt_task")

torch = pytest.importorskip("torch")


def _discovered(model, **extra) -> DiscoveredModel:
    from zeroplan.runtime.discovery.discover_worker import describe_model

    return DiscoveredModel.from_worker({"entry_point": "deepspeed.initialize", "model": describe_model(model), **extra}, script="train.py")


def test_describe_model_counts_like_torch_and_deepspeed():
    from deepspeed.runtime.zero.stage3 import model_to_params

    cfg = gpt_task.GPTConfig(layers=3, hidden=64, heads=4, vocab=512, seq_len=32)
    model = gpt_task.GPT(cfg)
    found = _discovered(model, micro_batch=2, seq_len=32)
    total, largest = model_to_params(model)
    assert found.total_params == sum(p.numel() for p in model.parameters()) == total
    assert found.largest_layer_params == largest and found.largest_layer_name == "tok"
    assert found.trainable_params == found.total_params and found.dtype == "float32"
    # The shape read from the module tree is the one the example declares by hand.
    declared = gpt_task.model_spec(cfg)
    spec = found.model_spec()
    for name in ("params", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_size", "vocab_size", "tied_embeddings", "gated_mlp"):
        assert getattr(spec, name) == getattr(declared, name), name
    assert spec.source == "discovered" and spec.peft is None


def test_frozen_parameters_become_a_partial_fine_tune():
    model = gpt_task.GPT(gpt_task.GPTConfig())
    for p in model.tok.parameters():
        p.requires_grad_(False)
    spec = _discovered(model).model_spec()
    assert spec.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert spec.frozen_params == model.tok.weight.numel()
    assert spec.total_params == sum(p.numel() for p in model.parameters())


def test_hugging_face_model_shape_comes_from_its_config():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(config)
    spec = _discovered(model).model_spec()
    assert spec.params == sum(p.numel() for p in model.parameters())
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.ffn_size, spec.vocab_size) == (64, 2, 4, 2, 176, 1000)
    assert spec.gated_mlp and not spec.tied_embeddings
    assert not [n for n in spec.notes if "formula gives" in n]  # zeroplan's Llama count agrees with transformers


def test_batch_shape_reads_input_ids_or_the_first_tensor():
    from zeroplan.runtime.discovery.discover_worker import batch_shape

    assert batch_shape((), {"input_ids": torch.zeros(3, 17, dtype=torch.long), "labels": torch.zeros(3, 17)}) == (3, 17)
    assert batch_shape(((torch.zeros(5, 9), torch.zeros(5, 9)),), {}) == (5, 9)
    assert batch_shape((torch.zeros(4),), {}) == (4, None)


NO_ENGINE = "print('training nothing')\n"
HANGS = "import time\ntime.sleep(120)\n"


def _tune(script: Path, out: Path, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_zeroplan("tune", str(script), "--gpus", "2", "--output", str(out), *extra, env=ENV, timeout=timeout)


@pytest.mark.slow
def test_script_without_an_engine_names_the_watched_entry_points(tmp_path, zeroplan_here):
    script = tmp_path / "no_engine.py"
    script.write_text(NO_ENGINE)
    r = zeroplan_here("tune", str(script), "--gpus", "2", "--output", str(tmp_path / "out"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        f"zeroplan: error: model discovery: {script} finished without calling deepspeed.initialize (also called by "
        "Hugging Face Trainer, TRL and accelerate) or torch.distributed.fsdp.fully_shard; give the model with "
        "--params 7e9 or --model NAME|config.json"
    ]


@pytest.mark.slow
def test_hanging_discovery_times_out(tmp_path):
    hangs = tmp_path / "hangs.py"
    hangs.write_text(HANGS)
    with pytest.raises(SpecError, match=rf"^model discovery: {hangs} created no engine within 3 s \(log: .*discovery.log\); raise --timeout"):
        discover_model(hangs, timeout_s=3, workdir=tmp_path / "w")


REJECTS_DEEPSPEED = textwrap.dedent(
    """
    from dataclasses import dataclass
    from transformers import HfArgumentParser

    @dataclass
    class Args:
        lr: float = 1e-3

    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses()
    """
)


@pytest.mark.slow
def test_trainer_style_script_rejecting_deepspeed_is_one_line(tmp_path, zeroplan_here):
    script = tmp_path / "rejects.py"
    script.write_text(REJECTS_DEEPSPEED)
    out = tmp_path / "out"
    r = zeroplan_here("tune", str(script), "--gpus", "2", "--output", str(out))
    assert r.returncode == 2, r.stdout + r.stderr
    config = out / "discovery" / "ds_config.json"
    assert r.stderr.strip().splitlines() == [
        f"zeroplan: error: model discovery: {script} failed before creating an engine: ValueError: Some specified arguments "
        f"are not used by the HfArgumentParser: ['--deepspeed', '{config.resolve()}'] (log: {(out / 'discovery' / 'discovery.log').resolve()}); "
        "the script does not take --deepspeed: give the flag it takes with --config-arg"
    ]


FSDP_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo")
    model = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 100))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model(torch.zeros(3, 11, dtype=torch.long)).sum().backward()
    raise SystemExit("ran past the first forward")
    """
)


@pytest.mark.slow
def test_fsdp2_fully_shard_is_watched(tmp_path):
    script = tmp_path / "fsdp_train.py"
    script.write_text(FSDP_SCRIPT)
    found, cached = discovered_or_cached(script, output_dir=tmp_path / "out", timeout_s=120)
    reference = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 100))
    assert not cached and found.entry_point == "torch.distributed.fsdp.fully_shard"
    assert found.total_params == sum(p.numel() for p in reference.parameters())
    assert (found.micro_batch, found.seq_len) == (3, 11)
    # Cached in the output folder, reused while the script is unchanged.
    assert json.loads((tmp_path / "out" / DISCOVERY_FILE).read_text())["model"]["total_params"] == found.total_params
    again, cached = discovered_or_cached(script, output_dir=tmp_path / "out", timeout_s=120)
    assert cached and again == found


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.e2e
def test_tune_plain_deepspeed_script_without_model_flags(tmp_path):
    """The discovered model is the script's (sum of numel), and the search is pruned with it: with
    a memory limit nothing fits, and the smallest plan's predicted memory is the one the estimator
    gives for the model spec the example declares by hand."""
    from zeroplan.cli.common import resolve_cluster, resolve_training
    from zeroplan.tuner import build_space

    out = tmp_path / "out"
    gpu_memory_gib = 0.0001
    r = _tune(ROOT / "examples" / "train_deepspeed.py", out, "--global-batch", "8", "--gpu-memory", str(gpu_memory_gib), timeout=280)
    assert r.returncode == 1, r.stdout + r.stderr
    cfg = gpt_task.GPTConfig()  # the script's defaults
    found = DiscoveredModel.from_dict(json.loads((out / DISCOVERY_FILE).read_text())["model"])
    assert found.total_params == sum(p.numel() for p in gpt_task.GPT(cfg).parameters())
    assert (found.micro_batch, found.seq_len) == (1, cfg.seq_len)
    assert f"model discovered at deepspeed.initialize: GPT, {found.total_params:,} parameters" in r.stdout
    # The same cluster and training the command line builds for these flags, with the declared spec.
    cluster = resolve_cluster(gpus=2, gpus_per_node=None, gpu=None, gpu_memory_gib=gpu_memory_gib, cpu_memory_gib=None, nvme_gib=None, runs_here=True)
    training = resolve_training(precision="bf16", optimizer="adamw", seq_len=cfg.seq_len, micro_batch=None, global_batch=8, grad_accum=None)
    space = build_space(gpt_task.model_spec(cfg), cluster, training, offload_optimizer=["none", "cpu"], offload_param=["none", "cpu"],
                        checkpointing=["none"], device="cpu")
    assert not space.fitting
    closest = min(space.candidates, key=lambda c: c.predicted_gpu_total_bytes)
    text = " ".join(r.stdout.split())
    assert f"nothing fits: all {len(space.candidates)} plans are ruled out by the estimator; the smallest, {closest.plan.label}, " in text
    assert closest.reason.removeprefix("does not fit: ") in text
