"""The tuner's admission on host memory: plans over --cpu-memory and plans at the same stage/offload
that need more host RAM than a probe killed for it are pruned with the reason recorded, and never
probed; other stages and offloads are not."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import optuna

from zeroplan.profiles import resolve_cluster
from zeroplan.spec import GiB, ModelSpec, Plan, TrainingSpec
from zeroplan.tuner import ProbeOutcome, TuneSettings, Tuner, build_space, make_sampler, open_study, plan_key, storage_url
from zeroplan.tuner.admission import Knowledge, admit, knowledge_from_trials

from helpers import GPT_TASK, ROOT


def _space(cpu_memory_gib):
    cluster = resolve_cluster(gpus=2, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=None, cpu_memory_gib=cpu_memory_gib, nvme_gib=None)
    return build_space(GPT_TASK, cluster, TrainingSpec(seq_len=64, global_batch=16), device="cpu")


def test_admit_prunes_what_needs_more_host_ram_than_a_host_oom_at_its_stage():
    space = _space(64)
    by_host = sorted(space.fitting, key=lambda c: c.predicted_host_bytes_per_node)
    small, big = by_host[0], by_host[-1]
    assert small.predicted_host_bytes_per_node < big.predicted_host_bytes_per_node
    assert small.plan.zero_label != big.plan.zero_label
    # The same stage and offload as the OOM'd plan, predicted to need more host RAM (the host
    # estimate of one stage/offload does not vary with micro-batch here, so the figure is raised).
    smaller_mb = next(c for c in space.fitting if c.plan.zero_label == small.plan.zero_label and c.plan.micro_batch < small.plan.micro_batch)
    bigger_same = replace(smaller_mb, predicted_host_bytes_per_node=small.predicted_host_bytes_per_node + GiB)
    host_oom = Knowledge(ooms=((3, small),), host_ooms=((3, small),))
    rejection = admit(bigger_same, gpu_memory_bytes=space.cluster.gpu_memory_bytes, knowledge=host_oom)
    assert rejection is not None and rejection.status == "pruned" and rejection.constraint == ("oom", 1.0)
    assert rejection.reason == f"needs more host memory than a host-OOM'd plan (trial #3: {small.plan.label})"
    # Another stage or offload needing more host RAM is probed: one OOM never prunes the whole space.
    assert admit(big, gpu_memory_bytes=space.cluster.gpu_memory_bytes, knowledge=host_oom) is None
    # Plans predicted equal at the same stage/offload (they differ in micro-batch): only the OOM
    # rule's, a micro-batch no smaller, are pruned.
    same = [c for c in space.fitting if c.plan.zero_label == small.plan.zero_label and c.key != small.key]
    assert same and all(c.predicted_host_bytes_per_node == small.predicted_host_bytes_per_node for c in same)
    for c in same:
        pruned = admit(c, gpu_memory_bytes=space.cluster.gpu_memory_bytes, knowledge=host_oom) is not None
        assert pruned == (c.plan.micro_batch >= small.plan.micro_batch and c.plan.checkpointing == "none" or c.plan.checkpointing == small.plan.checkpointing and c.plan.micro_batch >= small.plan.micro_batch)
    # The same probe out of *device* memory says nothing about host RAM.
    device_oom = Knowledge(ooms=((3, small),))
    other_zero = next(c for c in reversed(by_host) if c.plan.stage != small.plan.stage or c.plan.offload_optimizer != small.plan.offload_optimizer)
    assert admit(other_zero, gpu_memory_bytes=space.cluster.gpu_memory_bytes, knowledge=device_oom) is None
    # Less host RAM than the plan that ran out: still admitted.
    assert admit(small, gpu_memory_bytes=space.cluster.gpu_memory_bytes, knowledge=Knowledge(host_ooms=((4, big),))) is None


def test_plan_over_cpu_memory_is_pruned_with_host_overshoot():
    roomy = _space(64)
    limit = sorted(c.predicted_host_bytes_per_node for c in roomy.fitting)[len(roomy.fitting) // 2]
    space = _space(str(limit / GiB))
    over = [c for c in space.candidates if c.predicted_host_bytes_per_node > limit]
    assert over and all(not c.fits and "host memory per node at" in c.reason for c in over)
    cand = over[0]
    rejection = admit(cand, gpu_memory_bytes=space.cluster.gpu_memory_bytes, cpu_memory_bytes=limit)
    assert rejection.state == "PRUNED" and rejection.reason == cand.reason
    assert rejection.constraint == ("memory", max(cand.predicted_host_bytes_per_node / limit - 1.0, 0.01))


class HostOomWithOffload:
    """Replayed probes: stage 2 with the optimizer offloaded runs out of host memory (the kernel
    killed it), the rest work."""

    def __init__(self):
        self.calls: list[Plan] = []

    def __call__(self, plan: Plan, *, trial_number: int, on_line=None) -> ProbeOutcome:
        self.calls.append(plan)
        if plan.stage == 2 and plan.offload_optimizer == "cpu":
            return ProbeOutcome(status="oom", error="a worker was killed by SIGKILL with no result", memory_limit="host")
        return ProbeOutcome(status="ok", samples_per_second=float(plan.micro_batch), peak_memory_bytes=1000, ds_config={})


def test_a_host_oom_prunes_at_its_stage_and_offload_only(tmp_path):
    # 50M parameters: offloading plans need more host RAM per node than the others.
    cluster = resolve_cluster(gpus=2, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=None, cpu_memory_gib=64, nvme_gib=None)
    space = build_space(ModelSpec.from_params(5e7), cluster, TrainingSpec(seq_len=64, global_batch=16), device="cpu", micro_batches=[1, 2])
    # The z2 offload plans first: the first probe runs out of host memory.
    space.candidates[:] = sorted(space.candidates, key=lambda c: (not c.fits, (c.plan.stage, c.plan.offload_optimizer) != (2, "cpu")))
    runner = HostOomWithOffload()
    study = open_study(storage_url(None, tmp_path), resume=False, sampler=make_sampler("random", seed=0))
    tuner = Tuner(study, space, runner, TuneSettings(trials=5, n_initial=1))
    tuner.prepare(resume=False)
    tuner.run()
    trials = study.get_trials()
    knowledge = knowledge_from_trials(trials, space)
    assert knowledge.host_ooms, "no probe ran out of host memory"
    first = min(n for n, _ in knowledge.host_ooms)
    oomed = next(c for n, c in knowledge.host_ooms if n == first)
    assert first == 0 and (runner.calls[0].stage, runner.calls[0].offload_optimizer) == (2, "cpu")
    later = [space.get(plan_key(p)) for p in runner.calls[1:]]
    assert later  # the search went on
    # Nothing at the OOM'd stage/offload needing at least its memory was probed after it.
    assert not any(c.plan.zero_label == oomed.plan.zero_label and c.plan.micro_batch >= oomed.plan.micro_batch
                   and c.plan.checkpointing == oomed.plan.checkpointing for c in later)
    # Plans of other stages that need more host RAM stay admissible (an OOM never prunes the space).
    more = [c for c in space.fitting if c.plan.zero_label != oomed.plan.zero_label and c.predicted_host_bytes_per_node > oomed.predicted_host_bytes_per_node]
    assert more and all(admit(c, gpu_memory_bytes=cluster.gpu_memory_bytes, knowledge=knowledge) is None for c in more if c.key not in {plan_key(p) for p in runner.calls})
    pruned = [t for t in trials if t.user_attrs.get("reason", "").startswith("larger than an OOM'd micro-batch")]
    assert all(t.state == optuna.trial.TrialState.PRUNED for t in pruned)


def test_tune_prunes_every_plan_over_cpu_memory_without_probing(tmp_path):
    """--cpu-memory below every plan's worst host phase: tune names the phase, exits 1, probes nothing."""
    out = tmp_path / "o"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, "-m", "zeroplan", "tune", "examples/gpt_task.py", "--gpus", "2", "--global-batch", "16",
                        "--cpu-memory", "0.3", "--output", str(out)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    text = " ".join(r.stdout.split())
    assert "nothing fits" in text and "GiB host memory per node at step > 0.30 GiB" in text
    assert not list(out.glob("**/rank-*.json")) and not list(out.glob("**/probe.json"))
