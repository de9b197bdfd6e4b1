"""Probing sequence- and tensor-parallel layouts (zeroplan.runtime.rank.layout) on the real engine.

The reference for the slow tests is the plain run: a tiny Llama from examples/tiny_llama/config.json
(and a tiny Qwen3, examples/tiny_qwen3; random weights, seed 0) gives the same step-0 loss under
Ulysses sp=2 and AutoTP tp=2 on two CPU ranks as on one rank without a layout, as DeepSpeed's and
transformers' own code computes it; so does the HF Trainer example under sp=2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import EXAMPLES, run_main, run_zeroplan
from zeroplan.runtime.rank.layout import Layout, apply_probe_layout, layout_of_config, with_layout
from zeroplan.spec import Plan, SpecError

SCRIPT = EXAMPLES / "train_hf_causal_lm.py"
BASE = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1}}


def test_layout_is_read_from_deepspeed_keys():
    assert layout_of_config(BASE) == Layout()
    assert layout_of_config({"sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 4}}) == Layout(sp=2, tp=4)
    # AutoTP's default autotp_size is 0 (deepspeed/runtime/tensor_parallel/config.py): off
    assert layout_of_config({"tensor_parallel": {"autotp_size": 0}}).trivial


def test_with_layout_counts_the_batch_as_deepspeed_config_does():
    # sp: world / sp data-parallel ranks; AutoTP: left to DeepSpeed (its two parses under ZeRO-3 disagree).
    assert with_layout(BASE, sp=2, world_size=4)["train_batch_size"] == 2
    out = with_layout(BASE, tp=2, world_size=4)
    assert out["tensor_parallel"] == {"autotp_size": 2} and "train_batch_size" not in out
    assert "sequence_parallel_size" not in BASE  # a copy


def test_probe_layout_must_divide_the_world():
    with pytest.raises(SpecError, match="does not divide the 4 ranks"):
        apply_probe_layout(BASE, None, sp=3, tp=1, world_size=4)
    with pytest.raises(SpecError, match="--tp 0 is not valid"):
        apply_probe_layout(None, Plan(stage=1), sp=1, tp=0, world_size=2)
    _, plan = apply_probe_layout(None, Plan(stage=1), sp=2, tp=1, world_size=2)
    assert (plan.sp, plan.tp, plan.layout_label) == (2, 1, "sp2")


def test_probe_sp_that_does_not_divide_gpus_is_one_line(capsys):
    code, out, err = run_main(["probe", str(SCRIPT), "--gpus", "2", "--stage", "1", "--sp", "4"], capsys)
    assert code == 2 and "--sp 4 × --tp 1 = 4 does not divide the 2 ranks" in err and "Traceback" not in err


def _losses(tmp_path: Path, capsys, name: str, gpus: int, *flags: str, micro_batch: int = 1) -> list[list[float]]:
    """One ``zeroplan probe`` through the CLI in this process: the probes share the session's warm
    launcher server, as tune's trials do (tests/conftest.py ``warm_server``)."""
    workdir = tmp_path / name
    code, out, err = run_main(["probe", str(SCRIPT), "--gpus", str(gpus), "--stage", "1", "--micro-batch", str(micro_batch), "--precision", "fp32",
                               "--steps", "1", "--warmup", "1", "--seq-len", "64", "--workdir", str(workdir), *flags], capsys)
    assert code == 0, out[-2000:] + err[-2000:]
    ranks = [json.loads(p.read_text()) for p in sorted(workdir.glob("rank-*.json"))]
    # Distinct samples per optimizer step: micro × data-parallel ranks (an AutoTP group trains one batch).
    assert {r["samples_per_step"] for r in ranks} == {micro_batch * gpus // LAYOUT_DEGREE.get(flags[:2], 1)}, ranks
    return [r["losses"] for r in ranks]


#: The layout flags of _losses' callers and their sp × tp (the data-parallel degree is ranks / that).
LAYOUT_DEGREE = {("--sp", "2"): 2, ("--tp", "2"): 2}


@pytest.mark.slow
def test_sp2_and_tp2_give_the_plain_step0_loss(tmp_path, capsys, warm_server):
    """A plain DeepSpeed loop (examples/train_hf_causal_lm.py) that knows nothing of layouts, two
    samples per micro batch (a CPU rank's sequence shard of two rows is a strided view that
    transformers' loss refused before runtime/rank/layout.copy_sp_shards_on_cpu)."""
    (plain,) = _losses(tmp_path, capsys, "plain", 1, micro_batch=2)
    # sp 2 × dp 2 on 4 ranks: the first sp group runs rank 0's samples, the second rank 2's (its
    # loss backward crossed torch's gloo all_gather bug before runtime/rank/layout.fix_gloo_all_gather).
    sp2 = _losses(tmp_path, capsys, "sp2", 4, "--sp", "2", micro_batch=2)
    tp2 = _losses(tmp_path, capsys, "tp2", 2, "--tp", "2", micro_batch=2)
    for rank_losses in sp2[:2] + tp2:
        assert abs(rank_losses[0] - plain[0]) <= 1e-5, (plain, sp2, tp2)
    assert sp2[2][0] == sp2[3][0] and abs(sp2[2][0] - plain[0]) > 1e-4  # one sample per sp group, another sample
    assert len(sp2) == 4 and len(tp2) == 2


@pytest.mark.slow
@pytest.mark.e2e  # the default run keeps one probe per path; python -m pytest -m e2e runs this too
def test_qwen3_sp2_gives_the_plain_step0_loss(tmp_path, capsys, warm_server):
    """Qwen3 (q/k norms on the head dimension, tied embeddings) under Ulysses."""
    qwen = ("--", "--model-config", str(EXAMPLES / "tiny_qwen3"))
    (plain,) = _losses(tmp_path, capsys, "plain", 1, *qwen)
    sp2 = _losses(tmp_path, capsys, "sp2", 2, "--sp", "2", *qwen)
    assert len(sp2) == 2 and all(abs(r[0] - plain[0]) <= 1e-5 for r in sp2), (plain, sp2)


@pytest.mark.slow
@pytest.mark.e2e  # the default run keeps one probe per path; python -m pytest -m e2e runs this too
def test_hf_trainer_sp2_gives_the_plain_step0_loss(tmp_path):
    """The Trainer path: accelerate builds the ParallelismConfig from the environment the rank sets,
    registers Ulysses, adapts the data loader and computes the loss (deepspeed_sp_compute_loss)."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                  "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 1}}))
    losses = {}
    for name, gpus, sp in (("plain", 1, 1), ("sp2", 2, 2)):
        workdir = tmp_path / name
        proc = run_zeroplan("probe", str(EXAMPLES / "train_hf_trainer.py"), "--config", str(config), "--config-arg", "--deepspeed",
                            "--gpus", str(gpus), "--sp", str(sp), "--steps", "1", "--warmup", "1", "--workdir", str(workdir),
                            "--", "--use_cpu", "--per_device_train_batch_size", "1", "--report_to", "none", timeout=240)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        losses[name] = [json.loads(p.read_text())["losses"][0] for p in sorted(workdir.glob("rank-*.json"))]
    assert len(losses["sp2"]) == 2
    assert all(abs(x - losses["plain"][0]) <= 1e-5 for x in losses["sp2"]), losses


def test_probe_refuses_a_layout_the_engine_refuses(capsys):
    # 4 heads (examples/tiny_llama) do not split over sp 3: UlyssesSPAttentionHF would raise on every rank.
    code, _, err = run_main(["probe", str(SCRIPT), "--gpus", "3", "--stage", "1", "--sp", "3", "--model", str(EXAMPLES / "tiny_llama" / "config.json")],
                            capsys)
    assert code == 2 and "ZP261" in err and "Attention head count 4 is not divisible by SP size 3" in err and "nothing launched" in err
    code, _, err = run_main(["probe", str(SCRIPT), "--gpus", "2", "--stage", "1", "--sp", "2", "--seq-len", "63"], capsys)
    assert code == 2 and "ZP263" in err and "Traceback" not in err
