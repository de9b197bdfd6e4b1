"""Host RAM by phase: every item checked against the buffers a real DeepSpeed engine holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zeroplan.estimator import estimate_plan, host_phases, pinned_bytes
from zeroplan.estimator.host import offload_accumulation_bytes
from zeroplan.spec import ClusterSpec, GiB, ModelSpec, Plan, TrainingSpec
from zeroplan import profiles

from helpers import ROOT, SpaceReached, stop_at_space
A100 = profiles.load_gpu("a100-80gb")

# The engine-side model: Embedding(V, H) → Linear(H, F) → Linear(F, H), no biases.
V, H, F = 1000, 64, 256
TINY = ModelSpec(name="tiny", params=V * H + 2 * H * F, hidden_size=H, num_layers=1, num_heads=1, num_kv_heads=1,
                 ffn_size=F, vocab_size=V, largest_layer_params=2 * H * F)

_WORKER = r"""
import json, sys
import torch, deepspeed
def status_kib(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":"))
after_imports = {"rss": status_kib("VmRSS") * 1024}
from zeroplan.runtime.rank.dsops import skip_shm_comm_op
skip_shm_comm_op()  # inference-only op, as zeroplan's probe workers skip it
deepspeed.init_distributed(dist_backend="gloo")
before_initialize = status_kib("RssAnon") * 1024
V, H, F = 1000, 64, 256
base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
zero = {"z2": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "z3": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
def nbytes(ts):
    seen = {}
    for t in ts:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())
out = {}
for name, z in zero.items():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(V, H), torch.nn.Linear(H, F, bias=False), torch.nn.Linear(F, H, bias=False))
    engine, _, _, _ = deepspeed.initialize(model=model, config={**base, "zero_optimization": z}, model_parameters=model.parameters())
    o = engine.optimizer
    at_init = {}
    if name == "z2":
        at_init["fp32_master_partition"] = nbytes(o.single_partition_of_fp32_groups)
        at_init["fp32_grad_partition"] = nbytes([t.grad for t in o.single_partition_of_fp32_groups])
        at_init["bit16_staging_partition"] = nbytes(o.param_buffer_of_bit16_for_cpu_offload_groups)
        at_init["grad_staging_largest_param"] = nbytes([o.temp_grad_buffer_for_cpu_offload])
    else:
        at_init["fp32_master_partition"] = nbytes(o.fp32_partitioned_groups_flat)
        at_init["fp32_grad_per_subgroup"] = nbytes([t.grad for t in o.fp32_partitioned_groups_flat])
        at_init["grad_partition_buffer"] = nbytes([o.grad_partitions_flat_buffer])
        at_init["param_partition_16bit"] = nbytes(o.fp16_partitioned_groups_flat)
    moments_before = sum(1 for s in o.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    x = torch.randint(0, V, (2, 8))
    loss = engine(x).float().pow(2).mean(); engine.backward(loss); engine.step()
    moments = [t for s in o.optimizer.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    out[name] = {"engine_init": at_init, "moments_at_init": moments_before, "optimizer_moments": nbytes(moments)}
    if name == "z2":  # the first initialize imports the runtime; this model's tensors are < 1 MiB
        out["runtime_anon"] = status_kib("RssAnon") * 1024 - before_initialize
# ZeRO-2 with CPU offload over two micro-steps: the host buffers of accumulated gradients.
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(V, H), torch.nn.Linear(H, F, bias=False), torch.nn.Linear(F, H, bias=False))
engine, _, _, _ = deepspeed.initialize(model=model, config={**base, "gradient_accumulation_steps": 2, "zero_optimization": zero["z2"]},
                                       model_parameters=model.parameters())
for _ in range(2):
    loss = engine(torch.randint(0, V, (2, 8))).float().pow(2).mean(); engine.backward(loss); engine.step()
out["z2_ga2"] = {"offload_grad_accumulation": nbytes(list(engine.optimizer.accumulated_grads_in_cpu.values()))}
out["after_imports"] = after_imports
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.fixture(scope="module")
def engine_buffers(tmp_path_factory):
    pytest.importorskip("deepspeed")
    tmp = tmp_path_factory.mktemp("host")
    script, out = tmp / "w.py", tmp / "out.json"
    script.write_text(_WORKER)
    # One rank: the worker runs as the rendezvous' only member itself (the environment torchrun
    # would give it), without a torchrun agent importing torch beside it (13.2 -> 11.7 s of CPU, load 8).
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    r = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


def _cluster(gpus=1):
    return ClusterSpec(gpus=gpus, gpus_per_node=gpus, gpu=A100, cpu_memory_per_node_bytes=64 * GiB)


@pytest.mark.slow
@pytest.mark.parametrize("name, plan", [
    ("z2", Plan(stage=2, offload_optimizer="cpu", micro_batch=2)),
    ("z3", Plan(stage=3, offload_optimizer="cpu", offload_param="cpu", micro_batch=2)),
])
def test_items_equal_deepspeeds_buffers(engine_buffers, name, plan):
    """Each engine_init item is the byte count of the DeepSpeed buffer it names; the moments appear at the first step."""
    measured = engine_buffers[name]
    phases = host_phases(TINY, _cluster(), TrainingSpec(precision="bf16"), plan, device="cpu", baseline_bytes=0)
    init = phases.get("engine_init").per_rank
    assert {k: init[k] for k in measured["engine_init"]} == measured["engine_init"]
    assert measured["moments_at_init"] == 0  # lazy: nothing before the first step
    step = phases.get("step").per_rank
    assert step["optimizer_moments"] == measured["optimizer_moments"] and "optimizer_moments" not in init


@pytest.mark.slow
def test_accumulation_buffers_equal_deepspeeds(engine_buffers):
    """ZeRO-2 with CPU offload at two micro-steps keeps each parameter's gradient on the host
    (accumulated_grads_in_cpu); at one micro-step there is none (zeroplan.estimator.host.offload_accumulation_bytes)."""
    plan = Plan(stage=2, offload_optimizer="cpu", micro_batch=2, gradient_accumulation_steps=2)
    step = host_phases(TINY, _cluster(), TrainingSpec(precision="bf16"), plan, device="cpu", baseline_bytes=0).get("step").per_rank
    assert step["offload_grad_accumulation"] == engine_buffers["z2_ga2"]["offload_grad_accumulation"] == 2 * TINY.params
    one = host_phases(TINY, _cluster(), TrainingSpec(precision="bf16"), Plan(stage=2, offload_optimizer="cpu", micro_batch=2),
                      device="cpu", baseline_bytes=0).get("step").per_rank
    assert "offload_grad_accumulation" not in one


def test_accumulation_buffers_pinned_per_tensor():
    """On CUDA each buffer is its own pinned block: a 768 × 2048 bf16 expert projection (3 MiB)
    holds 4 MiB; the rank holds 1/N of the tensors."""
    sizes = (768 * 2048,) * 6 + (4096 * 2048,)
    assert offload_accumulation_bytes(sizes, world_size=2, bytes_per_param=2, pinned=True) == (6 * 4 + 16) * 2**20 // 2
    assert offload_accumulation_bytes(sizes, world_size=2, bytes_per_param=2, pinned=False) == 2 * sum(sizes) // 2
    model = ModelSpec.from_params(7e9)
    cl = ClusterSpec(gpus=8, gpus_per_node=8, gpu=A100)
    z2 = Plan(stage=2, offload_optimizer="cpu", micro_batch=1, gradient_accumulation_steps=4)
    # Keyed by the accumulation too: the cached phases of the one-micro-step plan are not reused.
    from zeroplan.estimator.host import plan_host_phases

    common = dict(device="cuda", build=None, checkpoint_bytes_on_cpu=0)
    assert "offload_grad_accumulation" not in plan_host_phases(model, cl, TrainingSpec(), Plan(stage=2, offload_optimizer="cpu", micro_batch=1),
                                                               **common).get("step").per_rank
    item = plan_host_phases(model, cl, TrainingSpec(), z2, **common).get("step").per_rank["offload_grad_accumulation"]
    assert item >= 2 * -(-model.params // 8)
    z1 = Plan(stage=1, offload_optimizer="cpu", micro_batch=1, gradient_accumulation_steps=4)
    assert "offload_grad_accumulation" not in host_phases(model, cl, TrainingSpec(), z1).get("step").per_rank


@pytest.mark.e2e
def test_process_terms_match_this_stack(engine_buffers):
    """The measured per-process constants hold for the installed torch/DeepSpeed: what
    ``import torch, deepspeed`` leaves resident, and what the first ``deepspeed.initialize`` imports
    (torch._dynamo with the first optimizer, DeepSpeed's engine and ops). Re-measure them
    (docs/host-memory.md) when this fails after an upgrade. Not in the default run: in a
    freshly created venv with an empty extensions cache (what CI builds) the import baseline read
    316.6 MB against the 261 MB measured in a used one (+21 %), so the constant describes a warm
    environment, not every one."""
    from zeroplan.estimator.host import CPU_IMPORT_BASELINE_BYTES, RUNTIME_IMPORT_BYTES, TORCH_DYNAMO_IMPORT_BYTES

    assert engine_buffers["after_imports"]["rss"] == pytest.approx(CPU_IMPORT_BASELINE_BYTES, rel=0.15)
    assert engine_buffers["runtime_anon"] == pytest.approx(RUNTIME_IMPORT_BYTES + TORCH_DYNAMO_IMPORT_BYTES, rel=0.15)


def test_pinned_rounding_is_power_of_two():
    assert [pinned_bytes(n) for n in (0, 1, 4096, 4097, 3 * GiB)] == [0, 1, 4096, 8192, 4 * GiB]


def test_pinning_counts_only_on_cuda():
    plan = Plan(stage=2, offload_optimizer="cpu", micro_batch=1)
    model = ModelSpec.from_params(7e9)
    cl = ClusterSpec(gpus=8, gpus_per_node=8, gpu=A100, cpu_memory_per_node_bytes=2048 * GiB)
    s = -(-model.params // 8)
    cuda = host_phases(model, cl, TrainingSpec(), plan).get("engine_init").per_rank
    unpinned = host_phases(model, cl, TrainingSpec(), plan, pin_memory=False).get("engine_init").per_rank
    assert unpinned["fp32_master_partition"] == 4 * s and cuda["fp32_master_partition"] == pinned_bytes(4 * s) > 4 * s


def test_worst_phase_named_and_used_for_fit():
    """Stage 2 builds the fp32 model on every rank: 8 × 4Ψ at build beats the offloaded states when
    the script saves through the engine; the Trainer's save adds 8 × 2Ψ to the step's and wins."""
    model = ModelSpec.from_params(13e9)
    plan = Plan(stage=2, offload_optimizer="cpu", micro_batch=1, checkpointing="full")
    cl = ClusterSpec(gpus=8, gpus_per_node=8, gpu=A100, cpu_memory_per_node_bytes=256 * GiB)
    trainer = estimate_plan(model, cl, TrainingSpec(), plan)
    step = trainer.host_phases.get("step")
    assert trainer.cpu_worst_phase == "checkpoint_save" and trainer.cpu_per_node == step.per_node_bytes + 8 * 2 * model.params
    est = estimate_plan(model, cl, TrainingSpec(), plan, model_save="engine")
    build = est.host_phases.get("model_build")
    assert est.cpu_worst_phase == "model_build" and est.cpu_per_node == build.per_node_bytes
    assert build.per_rank["model_fp32"] == 4 * model.params
    assert not est.fits and any("at model build" in n for n in est.notes)
    d = est.as_dict()
    assert d["cpu_worst_phase"] == "model_build" and set(d["cpu_phases"]) == {"model_build", "engine_init", "step", "checkpoint_save"}


def test_zero3_gather_on_save_is_rank0_only():
    model = ModelSpec.from_params(7e9)
    plan = Plan(stage=3, offload_optimizer="cpu", offload_param="cpu", micro_batch=1)
    cl = ClusterSpec(gpus=16, gpus_per_node=8, gpu=A100)
    save = host_phases(model, cl, TrainingSpec(), plan, gather_16bit_on_save=True).get("checkpoint_save")
    step = host_phases(model, cl, TrainingSpec(), plan).get("step")
    assert save.per_node_bytes - step.per_node_bytes == 2 * model.params  # once per node, not per rank


def test_estimates_share_host_phases_only_across_fields_host_phases_does_not_read():
    """estimate_plan computes host phases once per host layout (plan_host_phases); the fields it
    leaves out of the key must not change host_phases' answer, and every other field must key it.
    Accumulation keys it only as one micro-step or more (ZeRO-2's offload accumulation buffers)."""
    from dataclasses import replace

    from zeroplan.estimator.host import _HOST_CACHE, _NOT_ON_HOST, plan_host_phases
    from zeroplan.spec import derive_shape_from_params

    model = derive_shape_from_params(13e9)
    cluster = ClusterSpec(gpus=16, gpus_per_node=8, gpu=A100, gpu_memory_bytes=80 * GiB, cpu_memory_per_node_bytes=512 * GiB)
    training = TrainingSpec()
    varied = {"micro_batch": 8, "gradient_accumulation_steps": 4, "checkpointing": "full"}
    assert set(varied) == _NOT_ON_HOST
    assert set(_HOST_CACHE.keyed_fields) | _NOT_ON_HOST == set(Plan.__dataclass_fields__)
    for stage, opt, par in ((1, "cpu", "none"), (2, "cpu", "none"), (3, "cpu", "cpu"), (3, "nvme", "nvme"), (0, "none", "none")):
        plan = Plan(stage=stage, offload_optimizer=opt, offload_param=par, gradient_accumulation_steps=2)
        other = replace(plan, **varied)
        assert host_phases(model, cluster, training, plan) == host_phases(model, cluster, training, other)
        shared = plan_host_phases(model, cluster, training, plan, device="cuda", build=None, checkpoint_bytes_on_cpu=0)
        assert plan_host_phases(model, cluster, training, other, device="cuda", build=None, checkpoint_bytes_on_cpu=0) is shared
        assert shared == host_phases(model, cluster, training, plan)
    # One micro-step against several: ZeRO-2 with offload keeps its accumulation buffers only with several.
    z2 = Plan(stage=2, offload_optimizer="cpu")
    single = plan_host_phases(model, cluster, training, z2, device="cuda", build=None, checkpoint_bytes_on_cpu=0)
    several = plan_host_phases(model, cluster, training, replace(z2, gradient_accumulation_steps=2), device="cuda", build=None,
                               checkpoint_bytes_on_cpu=0)
    assert "offload_grad_accumulation" in several.get("step").per_rank and "offload_grad_accumulation" not in single.get("step").per_rank
    # A field host_phases reads keys a layout of its own.
    a = plan_host_phases(model, cluster, training, Plan(stage=3, offload_optimizer="cpu"), device="cuda", build=None, checkpoint_bytes_on_cpu=0)
    b = plan_host_phases(model, cluster, training, Plan(stage=3, offload_optimizer="cpu", offload_param="cpu"), device="cuda", build=None,
                         checkpoint_bytes_on_cpu=0)
    assert a != b


def test_trainer_save_is_every_ranks_clone_of_the_16bit_state_dict():
    """At ZeRO 0-2 the Hugging Face Trainer's save_model calls accelerate's get_state_dict on every
    rank, which is DeepSpeed's clone_tensors_for_torch_save of the module's state dict to the CPU
    (zeroplan.estimator.host_save): the save phase's item is that clone's bytes, on every rank."""
    torch = pytest.importorskip("torch")
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    module = torch.nn.Sequential(torch.nn.Embedding(V, H), torch.nn.Linear(H, F, bias=False), torch.nn.Linear(F, H, bias=False))
    state = module.to(torch.bfloat16).state_dict()
    clone = clone_tensors_for_torch_save(state)
    assert all(c.data_ptr() != t.data_ptr() for c, t in zip(clone.values(), state.values()))  # copies, not views
    cloned = sum(t.numel() * t.element_size() for t in clone.values())
    cl = ClusterSpec(gpus=8, gpus_per_node=8, gpu=A100)
    z2 = Plan(stage=2, offload_optimizer="cpu", micro_batch=1)
    step = host_phases(TINY, cl, TrainingSpec(), z2).get("step")
    save = host_phases(TINY, cl, TrainingSpec(), z2, model_save="trainer").get("checkpoint_save")
    assert save.per_rank["trainer_state_dict_on_host"] == cloned
    assert save.per_node_bytes - step.per_node_bytes == 8 * cloned
    assert host_phases(TINY, cl, TrainingSpec(), z2, model_save="engine").get("checkpoint_save").per_node_bytes == step.per_node_bytes
    # Stage 3 gathers on rank 0 only (gathered_16bit_model), not a clone per rank.
    z3 = Plan(stage=3, offload_optimizer="cpu", offload_param="cpu", micro_batch=1)
    assert "trainer_state_dict_on_host" not in host_phases(TINY, cl, TrainingSpec(), z3, model_save="trainer").get("checkpoint_save").per_rank
    # GPU estimates assume the Trainer; CPU estimates (compared with probes) the engine's own save.
    assert "trainer_state_dict_on_host" in estimate_plan(TINY, cl, TrainingSpec(), z2).host_phases.get("checkpoint_save").per_rank
    assert "trainer_state_dict_on_host" not in estimate_plan(TINY, cl, TrainingSpec(), z2, device="cpu").host_phases.get("checkpoint_save").per_rank
    with pytest.raises(ValueError, match="model_save"):
        host_phases(TINY, cl, TrainingSpec(), z2, model_save="disk")


def test_model_save_flag_sets_the_save_phase_and_bad_values_are_one_line(capsys):
    from helpers import run_main

    args = ["estimate", "--model", "llama-2-7b", "--gpus", "8", "--stage", "2", "--offload-optimizer", "cpu", "--model-build", "meta",
            "--format", "json", "--top", "1"]
    per_node = {}
    for save in ("trainer", "engine"):
        code, out, _ = run_main([*args, "--model-save", save], capsys)
        doc = json.loads(out)
        plan, params = doc["plans"][0], doc["model"]["params"]
        per_node[save] = (plan["cpu_phases"]["checkpoint_save"]["per_node"], plan["cpu_phases"]["step"]["per_node"])
    save_t, step_t = per_node["trainer"]
    save_e, step_e = per_node["engine"]
    assert step_t == step_e == save_e and save_t - step_t == 8 * 2 * params == 8 * 2 * 6_738_415_616
    code, out, err = run_main([*args, "--model-save", "disk"], capsys)
    assert code == 2 and err.strip().count("\n") == 0 and "--model-save 'disk' is not valid" in err and "Traceback" not in err


def test_export_takes_model_save_into_its_choice_and_fit(capsys):
    """On 250 GiB nodes a 7B model at ZeRO-2 with optimizer offload fits the host only when the run
    saves through engine.save_checkpoint: the Trainer's save adds its 16-bit copy on all 8 ranks
    (257 GiB per node at the save, model build 231 GiB)."""
    from helpers import run_main

    args = ["export", "--params", "7e9", "--gpus", "8", "--gpu", "a100-80gb", "--stage", "2", "--offload-optimizer", "cpu",
            "--offload-param", "none", "--checkpointing", "full", "--cpu-memory", "250"]
    code, out, err = run_main(args, capsys)
    assert code == 1 and "no plan fits" in err
    code, out, err = run_main([*args, "--model-save", "engine"], capsys)
    assert code == 0 and json.loads(out)["zero_optimization"]["stage"] == 2 and "chose" in err
    # An explicit plan is written as asked; its fit note (ZP702) judges the same save.
    explicit = [*args, "--micro-batch", "1"]
    notes = {}
    for save in ("trainer", "engine"):
        code, out, err = run_main([*explicit, "--model-save", save], capsys)
        assert code == 0
        notes[save] = err
    assert "checkpoint save" in notes["trainer"] and "tight" in notes["engine"] and "checkpoint save" not in notes["engine"]
    code, out, err = run_main([*args, "--model-save", "disk"], capsys)
    assert code == 2 and err.strip().count("\n") == 0 and "--model-save 'disk' is not valid" in err


@pytest.mark.parametrize(
    ("source", "given", "expected"),
    [
        ("from transformers import Trainer, TrainingArguments\n", None, "trainer"),
        ("import deepspeed\nengine, *_ = deepspeed.initialize(model=None)\n", None, "engine"),
        ("from transformers import Trainer, TrainingArguments\n", "engine", "engine"),
    ],
    ids=["trainer-script", "deepspeed-script", "flag-wins"],
)
def test_tune_estimates_the_save_of_the_script_it_runs(tmp_path, monkeypatch, source, given, expected):
    """run_tune hands the space the script's own save: a Trainer script's save_model clone, a plain
    DeepSpeed script's engine.save_checkpoint; --model-save wins. The space is stopped before any probe."""
    import zeroplan.tuner.usecase as usecase
    from zeroplan.tuner.request import TuneRequest

    script = tmp_path / "train.py"
    script.write_text(source)
    seen = stop_at_space(monkeypatch)
    request = TuneRequest(script=script, script_kind="script", gpus=2, nproc=2, params=1e8, global_batch=8,
                          output=tmp_path / "out", model_save=given)
    with pytest.raises(SpaceReached):
        usecase.run_tune(request)
    assert seen["model_save"] == expected


def test_tune_space_estimates_the_save_it_is_given():
    from zeroplan.profiles import resolve_model
    from zeroplan.tuner import tune_space

    cl = ClusterSpec(gpus=8, gpus_per_node=8, gpu=A100)
    model = resolve_model(7e9, None)
    training = TrainingSpec(global_batch=8)
    by_save = {}
    for save in ("trainer", "engine"):
        space = tune_space(model, cl, training, script_kind="script", stage=2, offload_optimizer="cpu", offload_param="none",
                           device="cuda", model_save=save)
        by_save[save] = {c.key: c for c in space.candidates}
        for c in space.candidates:
            assert c.predicted_host_bytes_per_node == estimate_plan(model, cl, training, c.plan, model_save=save).cpu_per_node
    assert by_save["trainer"].keys() == by_save["engine"].keys()
    # The Trainer's save (step + 8 ranks × 2 bytes × Ψ) is above the fp32 model build here.
    assert all(by_save["trainer"][k].predicted_host_bytes_per_node > by_save["engine"][k].predicted_host_bytes_per_node for k in by_save["engine"])


def test_tune_refuses_a_bad_model_save_in_one_line(capsys, repo_root):
    from helpers import run_main

    code, out, err = run_main(["tune", str(repo_root / "examples" / "gpt_task.py"), "--gpus", "2", "--model-save", "disk"], capsys)
    assert code == 2 and err.strip().count("\n") == 0 and "--model-save 'disk' is not valid" in err and "Traceback" not in err
