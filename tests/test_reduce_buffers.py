"""DeepSpeed's reduce buffers at the moments they exist, against peaks measured on real engines.

DeepSpeed 0.19 allocates the stage 1–2 contiguous-gradient buffers at the first gradient hook of
each backward (deepspeed/runtime/zero/stage_1_and_2.py ``setup_buckets``, called from
``process_gradients``: one buffer of ``reduce_bucket_size`` elements, a second with
``overlap_comm``) and frees them at the backward's epilogue (``_release_ipg_buffers``); stage 3
allocates one buffer in its constructor (stage3.py, ``bucket.buffer = torch.empty(self.reduce_bucket_size, ...)``)
and keeps it. The measured peaks are from ``benchmarks/bench_probe_memory.py`` on 2 CPU ranks
(example GPT L4 h256, bf16, micro-batch 2; benchmarks/results/probe_memory_buckets.json).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import psutil
import pytest

from zeroplan.estimator import estimate_plan
from zeroplan.estimator.memory import engine_overhead, first_flush_blocks, model_states
from zeroplan.profiles import default_gpu
from zeroplan.spec import ClusterSpec, ModelSpec, Plan, SpecError, TrainingSpec

from helpers import ROOT
DOC = json.loads((ROOT / "benchmarks" / "results" / "probe_memory_buckets.json").read_text())
PLANS = {"z0": dict(stage=0), "z1": dict(stage=1), "z2": dict(stage=2), "z3": dict(stage=3),
         "z2+opt:cpu": dict(stage=2, offload_optimizer="cpu")}


def _model() -> ModelSpec:
    return replace(ModelSpec.from_dict(DOC["model"]), dropout=False)


def _cluster() -> ClusterSpec:
    return ClusterSpec(gpus=2, gpus_per_node=2, gpu=default_gpu()[0])


def _training() -> TrainingSpec:
    return TrainingSpec(precision="bf16", seq_len=DOC["training"]["seq_len"], loss="plain")


def _row(plan: str, bucket: int | None, overlap: bool = True) -> dict:
    return next(r for r in DOC["rows"] if r["plan"] == plan and r["reduce_bucket_size"] == bucket and r["overlap_comm"] == overlap)


def _estimate(plan: str, bucket: int | None, overlap: bool = True):
    from zeroplan.runtime.measure.prediction import comparable_estimate

    p = Plan(micro_batch=2, reduce_bucket_size=bucket, overlap_comm=overlap, **PLANS[plan])
    est = estimate_plan(_model(), _cluster(), _training(), p, device="cpu")
    return est, comparable_estimate(est, on_cpu=True, ranks_per_node=2)


@pytest.mark.parametrize(("plan", "overlap"), [("z1", True), ("z2", True), ("z2", False)])
def test_stage_1_and_2_peak_at_the_first_gradient_hook_with_large_buckets(plan, overlap):
    """2e7-element buckets: the buffers (2 × 40 MB, or one without overlap_comm) beside every
    block's activations set the peak. Not modelled: one block's backward transients (~1 MiB, so
    −0.7 %), and 2.0 MiB more on rank 0 without overlap_comm (−3.1 % there; rank 1 −1.0 %)."""
    est, predicted = _estimate(plan, 20_000_000, overlap)
    assert any(n.startswith("peak at the first gradient hook") for n in est.notes), est.notes
    for measured in _row(plan, 20_000_000, overlap)["measured_peak_per_rank"]:
        assert abs(predicted - measured) <= (0.01 if overlap else 0.035) * measured, (predicted, measured)
    # The breakdown adds up at that moment: the gradient partition is not there yet.
    assert est.gpu.gradients == est.states.gradients - engine_overhead(_model(), _cluster(), _training(), est.plan, device="cpu").deferred_bytes
    assert est.gpu.params + est.gpu.gradients + est.gpu.optimizer_states + est.gpu.activations + est.gpu.overhead == est.gpu.total


def test_overlap_comm_is_one_buffer_of_reduce_bucket_size():
    """Measured peak with overlap_comm minus without = one bf16 buffer of 2e7 elements, as predicted
    (rank 1; rank 0 holds 2.0 MiB more without overlap_comm, not explained)."""
    measured = _row("z2", 20_000_000, True)["measured_peak_per_rank"][1] - _row("z2", 20_000_000, False)["measured_peak_per_rank"][1]
    predicted = _estimate("z2", 20_000_000, True)[1] - _estimate("z2", 20_000_000, False)[1]
    assert predicted == 2 * 20_000_000
    assert abs(measured - predicted) <= 0.001 * predicted, measured


@pytest.mark.parametrize("plan", ["z0", "z1", "z2", "z3", "z2+opt:cpu"])
def test_small_buckets_leave_the_peak_at_the_loss_or_the_step(plan):
    """h² buckets (65,536 elements): no buffer at the loss's backward, where stages 1–3 peak; within 0.1 %."""
    est, predicted = _estimate(plan, None)
    for measured in _row(plan, None)["measured_peak_per_rank"]:
        assert abs(predicted - measured) <= 0.001 * measured, (plan, predicted, measured)


def test_stage_3_keeps_one_buffer_from_the_start_whatever_overlap_comm():
    """Stage 3: 2e7 vs h² raises the measured peak by exactly one bf16 buffer's difference."""
    small, large = _row("z3", None)["measured_peak_per_rank"][0], _row("z3", 20_000_000)["measured_peak_per_rank"][0]
    assert abs((large - small) - 2 * (20_000_000 - 256 * 256)) <= 0.001 * (large - small)
    off = _row("z3", 20_000_000, False)["measured_peak_per_rank"][0]
    assert off == pytest.approx(large, rel=1e-4)
    est, predicted = _estimate("z3", 20_000_000)
    assert abs(predicted - large) <= 0.001 * large
    assert "reduce_bucket" in engine_overhead(_model(), _cluster(), _training(), est.plan, device="cpu").always


def test_stage_0_flattens_in_chunks_of_5e8_after_backward():
    """Stage 0 reduces with engine.py's MEMORY_OPT_ALLREDUCE_SIZE (5e8), not reduce_bucket_size,
    once backward is done: a flat copy of all gradients for a small model, never in the loss's moment."""
    model = _model()
    small = engine_overhead(model, _cluster(), _training(), Plan(stage=0, micro_batch=2), device="cpu")
    large = engine_overhead(model, _cluster(), _training(), Plan(stage=0, micro_batch=2, reduce_bucket_size=1000), device="cpu")
    assert small.after_backward == large.after_backward == {"flat_allreduce_chunk": 2 * model.params}
    assert "reduce_bucket" not in small.during_backward


def test_first_flush_comes_after_the_blocks_that_fit_the_bucket():
    """Gradients arrive final norm first, then block by block from the last (GPT block: 786,432
    weights at h 256): a 1e6 bucket flushes inside the second block, so one block is done."""
    model = _model()
    assert model.block_params == 786_432
    assert first_flush_blocks(model, reduce_bucket_size=1_000_000) == 1
    assert first_flush_blocks(model, reduce_bucket_size=model.params) is None
    untied = replace(model, tied_embeddings=False, params=model.params + model.embedding_params)
    assert first_flush_blocks(untied, reduce_bucket_size=1_000_000) == 0  # the head alone overflows it


def test_overlap_comm_is_read_as_deepspeed_reads_it():
    """A config's overlap_comm, else DeepSpeed's own default (DeepSpeedZeroConfig: true at stage 3 only)."""
    ds_config = pytest.importorskip("deepspeed.runtime.zero.config")
    from zeroplan.dsconfig import build_config, plan_from_config

    for stage in (1, 2, 3):
        base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
        assert plan_from_config(base, 2).overlap_comm is ds_config.DeepSpeedZeroConfig(stage=stage).overlap_comm
        for value in (True, False):
            cfg = {**base, "zero_optimization": {"stage": stage, "overlap_comm": value}}
            assert plan_from_config(cfg, 2).overlap_comm is value
    from zeroplan.runtime.measure.prediction import with_config_buckets

    # A probe of a plain script with its own config estimates with the config's overlap_comm.
    assert with_config_buckets(Plan(stage=2), {"zero_optimization": {"stage": 2}}).overlap_comm is False
    assert with_config_buckets(Plan(stage=2), {"zero_optimization": {"stage": 2, "overlap_comm": True}}).overlap_comm is True
    training = TrainingSpec(seq_len=128)
    assert build_config(Plan(stage=2), world_size=2, training=training)["zero_optimization"]["overlap_comm"] is True
    assert build_config(Plan(stage=2, overlap_comm=False), world_size=2, training=training)["zero_optimization"]["overlap_comm"] is False
    with pytest.raises(SpecError, match="overlap_comm"):
        Plan(stage=2, overlap_comm="yes")


def _timelines() -> dict[str, dict[str, int]]:
    """benchmarks/results/reduce_buffer_timelines.txt: per section, each timeline mark and each
    label's largest live bytes (``s1 ...`` names) → bytes."""
    out: dict[str, dict[str, int]] = {}
    section = None
    for line in (ROOT / "benchmarks" / "results" / "reduce_buffer_timelines.txt").read_text().splitlines():
        if line.startswith("## "):
            section = line[3:]
            out[section] = {}
        elif section and " B  s1 " in line:
            size, name = line.split(" B  s1 ", 1)
            out[section].setdefault(name.strip(), int(size.split()[-1].replace(",", "")))
    return out


def test_the_buffers_come_and_go_where_deepspeed_allocates_them():
    """From the traced step: stages 1–2 free exactly their buffers at the epilogue
    (``_release_ipg_buffers``), 2 × or 1 × reduce_bucket_size × 2 B; stage 0's all-reduce after
    backward adds exactly the flat copy the estimator counts (2Ψ); stage 3 holds its buffer
    from the step's start to its end."""
    t = _timelines()
    model = _model()
    for section, plan in (("stage 2", Plan(stage=2, reduce_bucket_size=20_000_000)),
                          ("stage 2, overlap_comm false", Plan(stage=2, reduce_bucket_size=20_000_000, overlap_comm=False))):
        released = t[section]["epilogue: before the ipg buffers are released"] - t[section]["epilogue: ipg buffers released"]
        assert released == engine_overhead(model, _cluster(), _training(), plan, device="cpu").after_first_hook["ipg_buffers"]
        # None of it at the loss's backward: the largest live bytes there are the h² run's.
        assert t[section]["bwd loss"] == _row("z2", None)["measured_peak_per_rank"][1]
    stage0 = engine_overhead(model, _cluster(), _training(), Plan(stage=0, reduce_bucket_size=20_000_000), device="cpu")
    assert t["stage 0"]["allreduce_gradients"] - t["stage 0"]["allreduce_gradients start"] == stage0.after_backward["flat_allreduce_chunk"]
    plan3 = Plan(stage=3, reduce_bucket_size=20_000_000)
    stage3 = engine_overhead(model, _cluster(), _training(), plan3, device="cpu")
    assert stage3.always["reduce_bucket"] == 2 * 20_000_000
    # Between steps (no activation, no gradient in flight) stage 3 holds its states and the buffer.
    resting = model_states(model, _cluster(), _training(), plan3).total + sum(stage3.always.values())
    for mark in ("start", "after engine.step()"):
        assert abs(t["stage 3"][mark] - resting) <= 0.001 * resting, (mark, t["stage 3"][mark], resting)


# --- Host RSS on CPU probes: the buffers are torch.empty, resident only where written ----------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS of untouched pages is Linux's")
def test_empty_buffer_pages_are_resident_only_once_written():
    """The premise of counting a reduce buffer's written part: a CPU ``torch.empty`` the size of a
    1e8-element bf16 bucket adds (almost) nothing to RSS until written, then what was written."""
    torch = pytest.importorskip("torch")
    proc = psutil.Process()
    mib = 2**20
    before = proc.memory_info().rss
    buf = torch.empty(100_000_000, dtype=torch.bfloat16)  # 200 MB, like setup_buckets' buffer
    allocated = proc.memory_info().rss
    buf.narrow(0, 0, 8 * mib).fill_(1.0)  # 16 MiB written, as bucket.buffer[i].narrow(...).copy_(grad)
    written = proc.memory_info().rss
    del buf
    assert allocated - before < 4 * mib
    assert 16 * mib <= written - allocated < 24 * mib


def _host_step(bucket: int, overlap: bool, stage: int = 2) -> tuple[int, int]:
    """(host bytes per rank at the step phase on a CPU probe, the device peak) for the L4 h256 GPT."""
    from zeroplan.runtime.measure.hostmem import device_bytes_on_host

    p = Plan(stage=stage, micro_batch=2, reduce_bucket_size=bucket, overlap_comm=overlap)
    est = estimate_plan(_model(), _cluster(), _training(), p, device="cpu")
    return device_bytes_on_host(est, _model(), world_size=2)["step"], est.gpu.peak_allocated


def test_host_step_counts_the_written_part_of_the_reduce_buffers():
    """5e8-element buckets (DeepSpeed's default) on a 5.3M-parameter model: every gradient lands in
    the first buffer, the second (overlap_comm) is never written, so host RSS is the same with one
    buffer or two while the device peak differs by a whole buffer (1e9 B in bf16); and the first
    buffer's unwritten tail is not counted either: host RSS is that of one buffer exactly the
    model's size, which is written whole."""
    psi = _model().trainable_params
    two, device_two = _host_step(500_000_000, True)
    one, device_one = _host_step(500_000_000, False)
    exact, device_exact = _host_step(psi, False)
    assert device_two - device_one == 2 * 500_000_000
    assert exact == device_exact
    assert two == one == exact
    assert device_one - one > 2 * (500_000_000 - psi) - 2 * psi


def test_host_step_counts_buffers_filled_whole():
    """Buckets of 1e6 elements fill (and alternate) many times over a 5.3M-parameter backward:
    both buffers are written through, host RSS counts them whole."""
    for overlap in (True, False):
        host, device = _host_step(1_000_000, overlap)
        assert host == device


@pytest.mark.e2e
def test_probe_host_step_with_default_buckets(tmp_path):
    """A 0.7M-parameter model under DeepSpeed's 5e8-element default buckets on 2 CPU ranks: the
    step phase's host RSS estimate within 10 % of the measured (2.67 GiB vs 0.85 GiB measured
    while the two 1 GB buffers were counted whole)."""
    pytest.importorskip("deepspeed")
    import subprocess

    script = tmp_path / "train.py"
    script.write_text(
        "import argparse, torch, deepspeed\n"
        "p = argparse.ArgumentParser(); p.add_argument('--local_rank', type=int, default=-1)\n"
        "p = deepspeed.add_config_arguments(p); args = p.parse_args()\n"
        "deepspeed.init_distributed()\n"
        "model = torch.nn.Sequential(torch.nn.Embedding(1000, 128), torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 1000))\n"
        "engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())\n"
        "for step in range(20):\n"
        "    x = torch.randint(0, 1000, (engine.train_micro_batch_size_per_gpu(), 64), device=engine.device)\n"
        "    loss = torch.nn.functional.cross_entropy(engine(x).float().view(-1, 1000), x.view(-1))\n"
        "    engine.backward(loss); engine.step()\n"
    )
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 2}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, "-m", "zeroplan", "probe", str(script), "--config", str(config), "--gpus", "2",
                        "--format", "json", "--workdir", str(tmp_path / "probe")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout)
    measured = result["host_phase_peaks_per_node"]["step"]
    estimated = result["estimated_host_phases_per_node"]["step"]
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)


def test_overlap_comm_flag_sets_the_plan_and_the_exported_config(tmp_path):
    """``--overlap-comm off`` halves the stage-2 reduce buffers in the estimate and is written into
    the exported config, where DeepSpeed's own parser reads it back; ``on`` (the default) keeps two."""
    ds_config = pytest.importorskip("deepspeed.runtime.zero.config")
    from helpers import run_mains as _run_cli

    flags = ["--params", "1e9", "--gpus", "8", "--stage", "2", "--offload-optimizer", "none", "--micro-batch", "1", "--checkpointing", "full"]
    on_json, off_json = tmp_path / "on.json", tmp_path / "off.json"
    results = _run_cli([
        ["estimate", *flags, "--format", "json"],
        ["estimate", *flags, "--format", "json", "--overlap-comm", "off"],
        ["export", *flags, "-o", str(on_json)],
        ["export", *flags, "--overlap-comm", "off", "-o", str(off_json)],
    ])
    assert [rc for rc, _, _ in results] == [0, 0, 0, 0], results
    (on,), (off,) = (json.loads(out)["plans"] for _, out, _ in results[:2])
    assert "overlap_comm" not in on and off["overlap_comm"] is False
    assert on["overhead_items"]["ipg_buffers"] == 2 * off["overhead_items"]["ipg_buffers"]
    for path, expected in ((on_json, True), (off_json, False)):
        zero = json.loads(path.read_text())["zero_optimization"]
        assert ds_config.DeepSpeedZeroConfig(**zero).overlap_comm is expected


def test_tune_overlap_comm_reaches_a_trial_built_on_a_base_config():
    """``tune --overlap-comm off`` with a base config (the user's, or the Trainer template, which
    has no overlap_comm): every trial's config says it, since apply_plan_config keeps the base's
    untuned ZeRO keys and DeepSpeed's default would otherwise decide."""
    from zeroplan.dsconfig import build_config
    from zeroplan.dsconfig.trial import HF_TEMPLATE, apply_plan_config, with_overlap_comm

    plan = Plan(stage=2, micro_batch=1, overlap_comm=False)
    for base in (HF_TEMPLATE, {"zero_optimization": {"stage": 1, "overlap_comm": True}}):
        cfg = apply_plan_config(with_overlap_comm(base, False), build_config(plan, world_size=2, training=_training()), plan)
        assert cfg["zero_optimization"]["overlap_comm"] is False
        assert "overlap_comm" not in HF_TEMPLATE["zero_optimization"]  # the template itself is untouched
    assert with_overlap_comm(None, False) is None


# --- Traced activations (estimate --trace): the buffers beside what is alive after the loss ----


@pytest.fixture(scope="module")
def traced_example_gpt():
    """The activation override ``estimate --trace`` builds for the probed example GPT (L4 h256
    V8192, 128 tokens, bf16): a FakeTensorMode trace of examples/gpt_task.py."""
    pytest.importorskip("torch")
    from zeroplan.trace import activation_override

    shape = {"GPT_LAYERS": "4", "GPT_HIDDEN": "256", "GPT_HEADS": "4", "GPT_VOCAB": "8192", "GPT_SEQ_LEN": str(DOC["training"]["seq_len"])}
    saved = {k: os.environ.get(k) for k in shape}
    os.environ.update(shape)
    try:
        override = activation_override(ROOT / "examples" / "gpt_task.py", _training())
        override(Plan(stage=2, micro_batch=2))  # trace now, with the shape in the environment
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return override


@pytest.mark.parametrize("row", range(len(DOC["rows"])), ids=lambda i: f"{DOC['rows'][i]['plan']}-{DOC['rows'][i]['reduce_bucket_size']}-{DOC['rows'][i]['overlap_comm']}")
def test_traced_estimate_counts_the_buffers_beside_what_outlives_the_loss(traced_example_gpt, row):
    """With traced activations the first gradient hook holds the reduce buffers beside the blocks'
    saved tensors, not beside the loss's fp32 arrays over the logits (freed before the output
    projection's backward fires the hook): every measured peak of the bucket benchmark within 4 %
    (buffers on the traced total: up to +22.5 %; the loss's arrays missing from a task's trace:
    −16.7 %)."""
    from zeroplan.runtime.measure.prediction import comparable_estimate

    r = DOC["rows"][row]
    plan = Plan(micro_batch=2, reduce_bucket_size=r["reduce_bucket_size"], overlap_comm=r["overlap_comm"], **PLANS[r["plan"]])
    est = estimate_plan(_model(), _cluster(), _training(), plan, device="cpu", activation_bytes=traced_example_gpt)
    predicted = comparable_estimate(est, on_cpu=True, ranks_per_node=2)
    measured = max(r["measured_peak_per_rank"])
    assert abs(predicted - measured) <= 0.04 * measured, (predicted, measured, est.notes[-1])
