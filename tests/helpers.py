"""What several test files share: the repository's paths, running ``zeroplan`` (as a process or
through its entry point in this process), loading an example or benchmark script by path, and
the tuner's replayed probes.

Tests import from here (``from helpers import ROOT, run_zeroplan``; pytest puts ``tests/`` on the
import path as the folder of the root conftest) or take the fixtures ``repo_root`` and
``zeroplan_cli`` that tests/conftest.py builds on it. No test edits ``sys.path`` and none imports
another test module.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

__all__ = [
    "BASE", "benchmark", "BENCHMARKS", "CASES", "example", "EXAMPLES", "GPT_TASK", "H", "make", "make_space",
    "Replay", "ROOT", "run_case", "run_main", "run_mains", "run_zeroplan", "SMALL", "TINY_LLAMA", "tiny_llama_heads", "WORLD", "zeroplan_env",
]  # and _DELETE, make()'s marker for a removed key

#: The repository root (the folder holding pyproject.toml).
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BENCHMARKS = ROOT / "benchmarks"


def zeroplan_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH (the code under test)."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def run_zeroplan(
    *args: str, cwd: Optional[Path] = None, timeout: float = 120, columns: Optional[int] = None, env: Optional[dict] = None,
    input: Optional[str] = None,
) -> subprocess.CompletedProcess:
    """``python -m zeroplan ARGS`` as a child process from the repository root (text output captured).

    ``columns`` sets the terminal width rich renders tables for; ``env`` replaces
    :func:`zeroplan_env` entirely; ``input`` is written to the child's stdin.
    """
    if env is None:
        env = zeroplan_env(**({"COLUMNS": str(columns)} if columns else {}))
    return subprocess.run(
        [sys.executable, "-m", "zeroplan", *args], capture_output=True, text=True, cwd=cwd or ROOT, env=env, timeout=timeout,
        input=input,
    )


def run_main(argv: list[str], capsys, *, input: Optional[str] = None) -> tuple[int, str, str]:
    """Run ``zeroplan`` in this process through ``main()`` (the console-script entry point):
    (exit code, stdout, stderr), read with pytest's ``capsys``; ``input`` is what it reads on stdin."""
    from zeroplan.cli import main

    old, old_stdin = sys.argv, sys.stdin
    sys.argv = ["zeroplan", *argv]
    if input is not None:
        sys.stdin = io.StringIO(input)
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv, sys.stdin = old, old_stdin
    out, err = capsys.readouterr()
    return code, out, err


class SpaceReached(Exception):
    """Raised by :func:`stop_at_space`'s stand-in for the tuner's space: the tune got that far."""


def stop_at_space(monkeypatch) -> dict:
    """Make ``zeroplan.tuner.usecase._space`` record the space options a tune hands it and raise
    :class:`SpaceReached` before anything is built or probed; returns the dict it fills."""
    import zeroplan.tuner.usecase as usecase

    seen: dict = {}

    def space(request, listener, runner, model, cluster, training, space_options, **kw):
        seen.update(space_options)
        raise SpaceReached

    monkeypatch.setattr(usecase, "_space", space)
    return seen


def run_mains(cases: list[list[str]]) -> list[tuple[int, str, str]]:
    """Each argv through zeroplan's entry point in one child process (one interpreter start for
    all): (exit code, stdout, stderr) per argv."""
    code = (
        "import contextlib, io, json, sys\n"
        "from zeroplan.cli import main\n"
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    sys.argv = ['zeroplan', *argv]\n"
        "    o, e = io.StringIO(), io.StringIO()\n"
        "    rc = 0\n"
        "    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):\n"
        "        try:\n"
        "            main()\n"
        "        except SystemExit as exc:\n"
        "            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)\n"
        "    out.append([rc, o.getvalue(), e.getvalue()])\n"
        "print(json.dumps(out))\n"
    )
    r = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True, cwd=ROOT,
                       env=zeroplan_env(COLUMNS="200"), timeout=120)
    assert r.returncode == 0, r.stderr
    return [tuple(x) for x in json.loads(r.stdout.splitlines()[-1])]


def _load(path: Path) -> ModuleType:
    """Import the script at ``path`` as the module of its file name, once per session: later
    ``import NAME`` statements (in tests or in the examples themselves) get the same module."""
    name = path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def example(name: str) -> ModuleType:
    """``examples/NAME.py`` as module ``NAME``."""
    return _load(EXAMPLES / f"{name}.py")


def benchmark(name: str) -> ModuleType:
    """``benchmarks/NAME.py`` as module ``NAME``."""
    return _load(BENCHMARKS / f"{name}.py")


# -- the tuner's bookkeeping without probes (test_tuner_search, test_tuner_ledger, test_tuner_failures,
#    test_shared_study's worker processes) -------------------------------------------------------------

def _gpt_task_spec():
    from zeroplan.spec import ModelSpec

    return ModelSpec(
        name="gpt_task", params=136_960, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
        ffn_size=256, vocab_size=512,
    )


#: The default GPT of examples/gpt_task.py (GPT-2 architecture, tied head): 136,960 parameters
#: (test_tuner_space checks the count against the module).
GPT_TASK = _gpt_task_spec()


def make_space(global_batch: int = 16):
    """The tuner's search space for GPT_TASK on 2 CPU ranks."""
    from zeroplan.profiles import resolve_cluster
    from zeroplan.spec import TrainingSpec
    from zeroplan.tuner import build_space

    cluster = resolve_cluster(gpus=2, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=None, cpu_memory_gib=64, nvme_gib=None)
    return build_space(GPT_TASK, cluster, TrainingSpec(seq_len=64, global_batch=global_batch), device="cpu")


class Replay:
    """Outcomes by rule: oom for z0 at micro-batch >= 4, else a throughput growing with micro-batch."""

    def __init__(self, oom_from: int | None = 4, crash_keys: tuple[str, ...] = ()):
        self.calls: list = []
        self.oom_from = oom_from
        self.crash_keys = crash_keys

    def __call__(self, plan, *, trial_number: int, on_line=None):
        from zeroplan.tuner import ProbeOutcome, plan_key

        self.calls.append(plan)
        if plan_key(plan) in self.crash_keys:
            raise RuntimeError("runner exploded")
        if self.oom_from is not None and plan.stage == 0 and plan.micro_batch >= self.oom_from:
            return ProbeOutcome(status="oom", error="CUDA out of memory")
        value = plan.micro_batch * (1.0 - 0.1 * plan.stage) * (0.7 if plan.checkpointing == "full" else 1.0)
        return ProbeOutcome(status="ok", samples_per_second=value, peak_memory_bytes=1000 * plan.micro_batch, ds_config={"stage": plan.stage})


# -- validation rules: one triggering and one clean config per rule (test_dsconfig_rules; test_dsconfig_deepspeed
#    checks the triggers DeepSpeed's own parser rejects) ------------------------------------------------------

import copy  # noqa: E402

from zeroplan import profiles  # noqa: E402
from zeroplan.dsconfig import validate_config  # noqa: E402
from zeroplan.spec import ClusterSpec, GiB, ModelSpec  # noqa: E402

#: A clean ZeRO-2 config for 2 GPUs: 16 = 2 × 4 × 2.
BASE = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 500000000},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4, "warmup_num_steps": 10}},
}
WORLD = 2
#: DeepSpeed's Muon optimizer block (runtime/config.py MUON_OPTIMIZER).
MUON = {"type": "Muon", "params": {"lr": 1e-3}}

_DELETE = object()


def make(**changes) -> dict:
    """BASE with changes; keys are dotted paths (``zero_optimization.stage``), _DELETE removes."""
    cfg = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        parts = dotted.split("__")
        node = cfg
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if value is _DELETE:
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = value
    return cfg


Z3 = {"zero_optimization": {"stage": 3}}
FP16 = {"bf16": {"enabled": False}, "fp16": {"enabled": True, "loss_scale": 0}}
SMALL = ModelSpec.from_params(125e6)
H = SMALL.hidden_size


def _cluster(gpus: int, per_node: int):
    from zeroplan.profiles.resolve import resolve_cluster

    return resolve_cluster(gpus=gpus, gpus_per_node=per_node, gpu="h100-80gb", gpu_memory_gib=None, cpu_memory_gib=64, nvme_gib=None)


def _recipe(kind: str, **fields):
    from zeroplan.spec.recipe import Recipe

    return Recipe(kind, **fields)


def _lora_32b() -> ModelSpec:
    from zeroplan.profiles.lora import PeftOptions

    return PeftOptions(16, None, None, None, None, None).apply(ModelSpec.from_params(32e9), None, precision="bf16")


LORA_32B = _lora_32b()


def z3(**zero) -> dict:
    return make(zero_optimization={"stage": 3, **zero})


def nvme_params(aio: dict) -> dict:
    return make(zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}, aio=aio)


#: A model with an MoE block whose experts are an nn.ModuleList that DeepSpeed does not flag itself.
LIST_MOE_BLOCK = "mymodels.moe.ListMoeBlock"


def _list_moe() -> ModelSpec:
    import dataclasses

    from zeroplan.profiles.hf_config import model_from_hf_dict

    spec = model_from_hf_dict(dict(model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   num_local_experts=4, num_experts_per_tok=2), name="list-moe")
    moe = dataclasses.replace(spec.moe, fused_experts=False, leaf_module_classes=(LIST_MOE_BLOCK,))
    return dataclasses.replace(spec, moe=moe)


LIST_MOE = _list_moe()


def fp16(**opts) -> dict:
    return make(bf16={"enabled": False}, fp16={"enabled": True, "loss_scale": 0, **opts})


# (rule id, triggering config, clean config, validate kwargs, DeepSpeedConfig rejects the trigger)
CASES = [
    ("ZP101", make(train_batch_size=128), make(), {}, True),
    ("ZP101", make(train_batch_size=15), make(), {"world_size": None}, False),
    ("ZP102", make(train_batch_size=18, gradient_accumulation_steps=_DELETE),
     make(gradient_accumulation_steps=_DELETE), {}, True),
    ("ZP102", make(train_batch_size=12, train_micro_batch_size_per_gpu=_DELETE, gradient_accumulation_steps=4),
     make(train_micro_batch_size_per_gpu=_DELETE), {}, True),
    ("ZP102", make(train_batch_size=3, train_micro_batch_size_per_gpu=_DELETE, gradient_accumulation_steps=_DELETE),
     make(train_batch_size=4, train_micro_batch_size_per_gpu=_DELETE, gradient_accumulation_steps=_DELETE), {}, True),
    ("ZP103", make(train_batch_size=_DELETE, train_micro_batch_size_per_gpu=_DELETE), make(train_batch_size=_DELETE), {}, True),
    ("ZP104", make(train_batch_size=_DELETE), make(), {}, False),
    ("ZP105", make(), make(), {"world_size": None, "_clean_kwargs": {"world_size": WORLD}}, False),
    ("ZP106", make(sequence_parallel_size=3), make(sequence_parallel_size=2), {"world_size": 4}, True),
    ("ZP201", make(zero_optimization={"stage": 4}), make(zero_optimization={"stage": 3}), {}, True),
    ("ZP202", make(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}}),
     z3(offload_param={"device": "cpu"}), {}, False),
    ("ZP203", z3(offload_param={"device": "nvme"}), z3(offload_param={"device": "nvme", "nvme_path": "/local_nvme"}), {}, False),
    ("ZP204", make(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}}),
     make(zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}), {}, False),
    ("ZP205", z3(offload_param={"device": "gpu"}), z3(offload_param={"device": "cpu"}), {}, True),
    ("ZP206", make(zero_optimization={"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}),
     make(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}), {}, True),
    ("ZP301", make(fp16={"enabled": True}), make(fp16={"enabled": False}), {}, True),
    ("ZP302", fp16(loss_scale_window=0), fp16(loss_scale_window=1000), {}, True),
    ("ZP302", fp16(loss_scale_window=10), fp16(loss_scale_window=500), {}, False),
    ("ZP303", fp16(min_loss_scale=0), fp16(min_loss_scale=1), {}, True),
    ("ZP303", fp16(initial_scale_power=8, min_loss_scale=256), fp16(initial_scale_power=16, min_loss_scale=256), {}, False),
    ("ZP304", fp16(initial_scale_power=10**6), fp16(initial_scale_power=16), {}, False),
    ("ZP304", fp16(initial_scale_power=-3), fp16(initial_scale_power=0), {}, False),
    ("ZP401", make(optimizer={"type": "AdamW", "params": {"lr": "1e-4"}}), make(), {}, False),
    ("ZP401", make(train_batch_size="16"), make(), {}, True),
    ("ZP401", make(zero_optimization={"stage": 2, "reduce_bucket_size": "5e8"}),
     make(zero_optimization={"stage": 2, "reduce_bucket_size": 5e8}), {}, True),
    ("ZP402", z3(stage3_prefetch_bucket_size=15099494.4), z3(stage3_prefetch_bucket_size=15099494), {}, True),
    ("ZP402", make(zero_optimization={"stage": 2, "reduce_bucket_size": 0}), make(), {}, True),
    ("ZP402", make(train_batch_size=10**400), make(), {}, False),
    ("ZP402", make(train_micro_batch_size_per_gpu=2.5, train_batch_size=_DELETE), make(train_batch_size=_DELETE), {}, False),
    ("ZP501", make(zero_optimization={"stage": 2, "overlap_com": True}), make(), {}, True),
    ("ZP501", fp16(loss_scale_windows=100), fp16(), {}, True),
    ("ZP501", z3(offload_param={"device": "cpu", "pin_mem": True}), z3(offload_param={"device": "cpu", "pin_memory": True}), {}, True),
    ("ZP501", make(gradient_cliping=1.0), make(), {}, False),
    ("ZP502", make(amp={"enabled": True}), make(), {}, True),
    ("ZP502", make(zero_optimization={"stage": 3, "mics_shard_size": 8}), z3(), {}, True),
    ("ZP503", make(), make(), {"duplicate_keys": ("zero_optimization.stage",), "_clean_kwargs": {}}, False),
    ("ZP504", make(gradient_accumulation_steps="auto"), make(), {}, True),
    ("ZP505", make(fp16=True), make(fp16={"enabled": False}), {}, True),
    ("ZP506", make(), make(), {"syntax": "hjson", "_clean_kwargs": {"syntax": "json"}}, False),
    ("ZP601", make(optimizer={"type": "AdamW", "params": {"lr": 1e-4, "max_grad_norm": 1.0}}), make(), {}, False),
    ("ZP602", make(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
                   optimizer={"type": "Lamb", "params": {"lr": 1e-3}}),
     make(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
          optimizer={"type": "Lion", "params": {"lr": 1e-4}}), {}, False),
    ("ZP602", make(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
                   optimizer={"type": "SGD", "params": {"lr": 1e-2}}, zero_allow_untested_optimizer=True),
     make(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}), {}, False),
    ("ZP602", make(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"}}, optimizer=_DELETE),
     make(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"}}, optimizer=_DELETE,
          zero_force_ds_cpu_optimizer=False), {}, False),
    ("ZP603", make(optimizer={"type": "sgd", "params": {"lr": 1e-2}}, zero_optimization={"stage": 0}),
     make(optimizer={"type": "SGD", "params": {"lr": 1e-2}}, zero_optimization={"stage": 0}), {}, False),
    ("ZP604", make(optimizer={"type": "SGD", "params": {"lr": 1e-2}}),
     make(optimizer={"type": "SGD", "params": {"lr": 1e-2}}, zero_allow_untested_optimizer=True), {}, False),
    ("ZP605", make(scheduler={"type": "CosineAnnealing"}), make(), {}, False),
    ("ZP606", make(optimizer={"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.1}}),
     make(optimizer={"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.1, "adam_w_mode": False}}), {}, False),
    ("ZP701", z3(stage3_prefetch_bucket_size=500_000_000), z3(stage3_prefetch_bucket_size=int(0.9 * H * H)),
     {"model": SMALL}, False),
    ("ZP701", z3(stage3_param_persistence_threshold=100_000_000), z3(stage3_param_persistence_threshold=10 * H),
     {"model": SMALL}, False),
    ("ZP701", make(zero_optimization={"stage": 2, "reduce_bucket_size": 100}),
     make(zero_optimization={"stage": 2, "reduce_bucket_size": H * H}), {"model": SMALL}, False),
    ("ZP701", make(zero_optimization={"stage": 2, "reduce_bucket_size": 10**10}), make(), {}, False),
    # 7B on 8 × A100 with 96 GiB per node: pinned fp32 gradient (3.5 GB → 4 GiB), gradient partition
    # and parameter partition (1.75 GB → 2 GiB each) per rank = 64 GiB of 96: over half.
    ("ZP901", make(train_batch_size=64, zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                            "offload_param": {"device": "cpu"}}),
     make(train_batch_size=64, zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                                  "offload_param": {"device": "cpu", "pin_memory": False}}),
     {"world_size": 8, "model": ModelSpec.from_params(7e9), "cluster": ClusterSpec(
         gpus=8, gpus_per_node=8, gpu=profiles.load_gpu("a100-80gb"), cpu_memory_per_node_bytes=96 * GiB)}, False),
    # SMALL's largest parameter (the embedding, V·h) is 45.0M elements: 22.5M per rank on 2.
    ("ZP902", z3(offload_param={"device": "nvme", "nvme_path": "/local_nvme", "buffer_size": 22_000_000}),
     z3(offload_param={"device": "nvme", "nvme_path": "/local_nvme", "buffer_size": 23_000_000}), {"model": SMALL}, False),
    # O_DIRECT needs 512-byte multiples; 8 ranks × 2 parameter handles × 8 threads × 1024 events = 131,072 > 65,536.
    ("ZP903", nvme_params({"block_size": 1_000_000}),
     nvme_params({"block_size": 1_048_576}), {}, False),
    ("ZP903", nvme_params({"queue_depth": 1024, "intra_op_parallelism": 8}),
     nvme_params({"queue_depth": 512, "intra_op_parallelism": 8}),
     {"cluster": _cluster(8, 8), "model": SMALL, "world_size": 8}, False),
    # SMALL on one rank: an attention matrix (h² = 589,824 elements) is 1.18 MB in bf16 — swapped at the
    # default 1 MiB threshold, kept on the host at block_size 4 MiB.
    ("ZP904", nvme_params({"block_size": 4 * 1_048_576}),
     nvme_params({"block_size": 1_048_576}),
     {"model": SMALL, "world_size": 1}, False),
    # ZeRO++ (zeroplan/dsconfig/rules/zeropp.py)
    ("ZP240", make(zero_optimization={"stage": 2, "zero_quantized_weights": True}), make(), {}, False),
    ("ZP241", z3(zero_hpz_partition_size=3), z3(zero_hpz_partition_size=2), {"world_size": 4}, False),
    ("ZP242", z3(zero_hpz_partition_size=16), z3(zero_hpz_partition_size=8), {"world_size": 16, "cluster": _cluster(16, 8), "model": SMALL}, False),
    ("ZP243", z3(zero_hpz_partition_size=2), z3(), {"cluster": _cluster(2, 2), "model": SMALL}, False),
    ("ZP243", z3(zero_quantized_gradients=True), z3(), {"cluster": _cluster(2, 2), "model": SMALL}, False),
    ("ZP244", z3(zero_quantized_gradients=True, reduce_scatter=False), z3(zero_quantized_gradients=True), {}, False),
    ("ZP250", z3(), z3(leaf_module={"classes": [LIST_MOE_BLOCK]}), {"model": LIST_MOE}, False),
    ("ZP250", z3(leaf_module={"classes": ["MixtralSparseMoeBlock"]}), z3(leaf_module={"classes": ["ListMoeBlock"]}),
     {"model": LIST_MOE}, False),
    # The environment's versions decide (transformers 5.x with DeepSpeed <= 0.19.8 in the project's venv).
    ("ZP251", make(expert_parallel={"enabled": True, "autoep_size": 1}), make(expert_parallel={"enabled": False}), {}, False),
    # DeepSpeed's MoE check at ZeRO-1/2 against a script's own optimizer (benchmarks/moe_client_optimizer.py).
    ("ZP254", make(expert_parallel={"enabled": True, "autoep_size": 1}, optimizer=_DELETE),
     make(expert_parallel={"enabled": True, "autoep_size": 1}), {}, False),
    # AutoEP's own checks (tests/test_expert_parallel.py runs DeepSpeed's validators on the same values).
    ("ZP252", make(expert_parallel={"enabled": True, "autoep_size": 4}), make(expert_parallel={"enabled": True, "autoep_size": 2}),
     {"model": LIST_MOE}, False),
    ("ZP252", make(expert_parallel={"enabled": True, "autoep_size": 2}), make(expert_parallel={"enabled": False}), {"model": SMALL}, False),
    ("ZP253", make(expert_parallel={"enabled": True, "autoep_size": 2, "expert_tensor_parallel_size": 2}),
     make(expert_parallel={"enabled": True, "autoep_size": 2, "expert_tensor_parallel_size": 1}), {}, False),
    ("ZP253", make(zero_optimization={"stage": 3, "zero_quantized_gradients": True}, expert_parallel={"enabled": True, "autoep_size": 2}),
     make(zero_optimization={"stage": 3}, expert_parallel={"enabled": True, "autoep_size": 2}), {}, False),
    # DeepSpeed 0.18-0.19 additions (zeroplan/dsconfig/rules/ds019.py); the engine's own errors on CPU:
    # tests/test_dsconfig_engine.py::test_ds019_rules_match_the_engine
    ("ZP607", make(optimizer=MUON, zero_optimization={"stage": 3}),
     make(optimizer=MUON, zero_optimization={"stage": 3, "reduce_scatter": False}), {}, False),
    ("ZP608", make(optimizer=MUON, zero_optimization={"stage": 0}), make(optimizer=MUON, zero_optimization={"stage": 1}), {}, False),
    ("ZP207", make(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}),
     z3(offload_optimizer={"device": "cpu", "ratio": 0.5}), {}, True),
    ("ZP208", z3(offload_optimizer={"device": "cpu", "super_offload": True}),
     z3(offload_optimizer={"device": "cpu", "super_offload": True}), {"accelerator": "cpu", "_clean_kwargs": {"accelerator": "cuda"}}, False),
    ("ZP209", make(compile={"deepcompile": True}), make(compile={"deepcompile": True}),
     {"accelerator": "xpu", "_clean_kwargs": {"accelerator": "cuda"}}, False),
    ("ZP210", z3(offload_optimizer={"device": "cpu"}, zenflow={"topk_ratio": 0.1}),
     make(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 0.1}}),
     {"accelerator": "cpu"}, False),
    ("ZP211", make(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"overlap_step": True}}),
     make(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"overlap_step": False}}),
     {"accelerator": "cpu"}, False),
    # Post-training recipes (zeroplan/dsconfig/rules/recipe.py). ms-swift#7986's setting: a 32B LoRA policy at
    # ZeRO-3 beside a colocated vLLM engine (half the GPU) gathers the whole model to merge the adapters;
    # clean: the same run with vLLM in server mode (no slice on the training GPUs; generation still gathers, 60 of 80 GiB).
    ("ZP951", make(train_batch_size=64, zero_optimization={"stage": 3}), make(train_batch_size=64, zero_optimization={"stage": 3}),
     {"world_size": 8, "model": LORA_32B, "cluster": _cluster(8, 8), "recipe": _recipe("grpo", vllm_gpu_memory=0.5),
      "_clean_kwargs": {"world_size": 8, "model": LORA_32B, "cluster": _cluster(8, 8), "recipe": _recipe("grpo")}}, False),
    ("ZP952", make(), z3(), {"model": SMALL, "recipe": _recipe("dpo")}, False),
    # 2 per GPU × 2 processes × 4 accumulation steps = 16 completions: not groups of 3, groups of 4.
    ("ZP953", make(), make(), {"recipe": _recipe("grpo", generations=3), "_clean_kwargs": {"world_size": WORLD, "recipe": _recipe("grpo", generations=4)}}, False),
    # 7B at ZeRO-3 on 8 × H100: the training peak (36.8 GiB) beside 0.6 × 80 GiB of vLLM is over; 0.3 fits.
    ("ZP954", make(train_batch_size=64, zero_optimization={"stage": 3}), make(train_batch_size=64, zero_optimization={"stage": 3}),
     {"world_size": 8, "model": ModelSpec.from_params(7e9), "cluster": _cluster(8, 8), "recipe": _recipe("grpo", vllm_gpu_memory=0.6),
      "_clean_kwargs": {"world_size": 8, "model": ModelSpec.from_params(7e9), "cluster": _cluster(8, 8),
                        "recipe": _recipe("grpo", vllm_gpu_memory=0.3)}}, False),
]


def run_case(cfg: dict, kwargs: dict, *, clean: bool):
    kw = dict(kwargs)
    clean_kwargs = kw.pop("_clean_kwargs", None)
    if clean and clean_kwargs is not None:
        kw = clean_kwargs
    kw.setdefault("world_size", WORLD)
    return validate_config(cfg, **kw)


# Parallel layouts (zeroplan/dsconfig/rules/layout.py); the engine's own errors on 4 CPU ranks:
# tests/test_layout_rules.py. A tiny Llama's shape: 4 heads, 2 KV heads. BASE's batch (2 × 4 × 2
# data-parallel ranks) holds for sp 2 on 4 GPUs and sp 4 on 8.
import dataclasses  # noqa: E402

from zeroplan.spec import TrainingSpec  # noqa: E402

TINY_LLAMA = ModelSpec(name="tiny-llama", params=158_016, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       ffn_size=176, vocab_size=512, gated_mlp=True, tied_embeddings=False)
_TP2 = {"autotp_size": 2}


def tiny_llama_heads(heads: int, kv_heads: int) -> ModelSpec:
    """TINY_LLAMA with other head counts (head size 16)."""
    return dataclasses.replace(TINY_LLAMA, hidden_size=16 * heads, num_heads=heads, num_kv_heads=kv_heads)


_SP2 = make(sequence_parallel_size=2)
LAYOUT_CASES = [
    ("ZP260", make(zero_optimization={"stage": 3}, tensor_parallel=_TP2),
     make(zero_optimization={"stage": 3}, tensor_parallel=_TP2, train_batch_size=_DELETE), {}, False),
    ("ZP261", make(sequence_parallel_size=4), _SP2,
     {"world_size": 8, "model": tiny_llama_heads(6, 2),
      "_clean_kwargs": {"world_size": 4, "model": tiny_llama_heads(6, 2)}}, False),
    ("ZP262", _SP2, _SP2, {"world_size": 4, "model": tiny_llama_heads(6, 3),
                           "_clean_kwargs": {"world_size": 4, "model": TINY_LLAMA}}, False),
    ("ZP263", _SP2, _SP2, {"world_size": 4, "training": TrainingSpec(seq_len=4095),
                           "_clean_kwargs": {"world_size": 4, "training": TrainingSpec(seq_len=4096)}}, False),
    ("ZP264", _SP2, _SP2, {"world_size": 4, "attn_implementation": "eager",
                           "_clean_kwargs": {"world_size": 4, "attn_implementation": "sdpa"}}, False),
    ("ZP265", make(tensor_parallel={"autotp_size": 3}), make(tensor_parallel=_TP2), {"world_size": 4}, False),
    ("ZP265", make(sequence_parallel_size=2, tensor_parallel=_TP2), make(sequence_parallel_size=2, tensor_parallel=_TP2),
     {"world_size": 2, "_clean_kwargs": {"world_size": 4}}, False),
    ("ZP266", make(sequence_parallel_size="x"), _SP2, {"world_size": 4}, True),
    ("ZP266", make(sequence_parallel_size=2.5), _SP2, {"world_size": 4}, False),
]
CASES.extend(LAYOUT_CASES)


#: Qwen/Qwen3-VL-30B-A3B-Instruct's config.json (huggingface.co, architecture fields; QwenLM/Qwen3-VL#2053's model).
QWEN3_VL_30B_A3B = {
    "model_type": "qwen3_vl_moe", "tie_word_embeddings": False,
    "text_config": {"model_type": "qwen3_vl_moe_text", "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128,
                    "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 262144, "mlp_only_layers": [],
                    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
                    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "vocab_size": 151936},
    "vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
                      "in_channels": 3, "intermediate_size": 4304, "model_type": "qwen3_vl_moe", "num_heads": 16,
                      "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2,
                      "temporal_patch_size": 2},
}
