"""The real engine as the truth: exported configs train a step under ``deepspeed.initialize``, and
configs that ``validate`` calls start-up failures do fail there.

One subprocess (a single-rank gloo group on CPU, ``DS_ACCELERATOR=cpu``) runs every config; the
first run JIT-builds DeepSpeed's CPU Adam for the offload cases (minutes; cached afterwards).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zeroplan.dsconfig import build_config, load_config, validate_config
from zeroplan.spec import Plan, TrainingSpec

pytest.importorskip("deepspeed")

from helpers import ROOT
BLOG = ROOT / "tests" / "data" / "configs" / "blog_zero2_offload.json"

_WORKER = r"""
import json, os, sys, traceback
import torch, deepspeed
from zeroplan.runtime.rank.dsops import skip_shm_comm_op

skip_shm_comm_op()  # inference-only op: a minute of compiling on a fresh machine
deepspeed.init_distributed(dist_backend="gloo")
results = {}
for name, cfg in json.load(open(sys.argv[1])).items():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    # "client-*": the script brings its own torch AdamW, as the HF Trainer does without an optimizer block.
    client = torch.optim.AdamW(model.parameters(), lr=1e-4) if name.startswith("client-") else None
    for p in model.parameters():  # Muon (DeepSpeed 0.19) needs every parameter tagged
        p.use_muon = p.dim() >= 2
    try:
        engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters(),
                                                       optimizer=client)
        dtype = torch.bfloat16 if cfg.get("bf16", {}).get("enabled") else torch.float32
        for _ in range(cfg["gradient_accumulation_steps"]):
            x = torch.randn(cfg["train_micro_batch_size_per_gpu"], 16, dtype=dtype)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
        results[name] = {"ok": True, "optimizer": type(engine.basic_optimizer).__name__,
                         "global_steps": engine.global_steps}
        engine.destroy()
    except BaseException as exc:
        results[name] = {"ok": False, "error": type(exc).__name__, "message": str(exc)[:300]}
json.dump(results, open(sys.argv[2], "w"))
"""


def _exported(stage: int, **plan) -> dict:
    return build_config(Plan(stage=stage, micro_batch=2, gradient_accumulation_steps=2, **plan), world_size=1,
                        training=TrainingSpec(precision="bf16"))


def _with(cfg: dict, mutate) -> dict:
    cfg = json.loads(json.dumps(cfg))
    mutate(cfg)
    return cfg


GOOD = {
    "z0": _exported(0),
    "z1": _exported(1),
    "z2": _exported(2),
    "z3": _exported(3, checkpointing="full"),
    "z3-offload-cpu": _exported(3, offload_optimizer="cpu", offload_param="cpu"),
}
_CLIENT_OFFLOAD = _with(GOOD["z3-offload-cpu"], lambda c: c.pop("optimizer"))
# The ZP602 fix for a client optimizer under offload: accept it explicitly.
GOOD["client-adamw-offload-forced"] = _with(_CLIENT_OFFLOAD, lambda c: c.update(zero_force_ds_cpu_optimizer=False))
# name → (config, the rule validate reports as an error for it)
BAD = {
    # Without a scheduler the string reaches the fused Adam step (a WarmupLR scheduler would
    # overwrite lr with a number at start-up and hide it; CPU Adam fails either way).
    "lr-string": (_with(GOOD["z2"], lambda c: (c["optimizer"]["params"].update(lr="1e-4"), c.pop("scheduler"))), "ZP401"),
    "lr-string-cpu-adam": (_with(GOOD["z3-offload-cpu"], lambda c: c["optimizer"]["params"].update(lr="1e-4")), "ZP401"),
    "max-grad-norm": (_with(GOOD["z2"], lambda c: c["optimizer"]["params"].update(max_grad_norm=1.0)), "ZP601"),
    "sgd-lowercase": (_with(GOOD["z0"], lambda c: c["optimizer"].update(type="sgd", params={"lr": 0.01})), "ZP603"),
    "sgd-untested": (_with(GOOD["z2"], lambda c: c["optimizer"].update(type="SGD", params={"lr": 0.01})), "ZP604"),
    "bad-scheduler": (_with(GOOD["z1"], lambda c: c["scheduler"].update(type="Cosine")), "ZP605"),
    "client-adamw-offload": (_CLIENT_OFFLOAD, "ZP602"),
    # DeepSpeed 0.18-0.19 additions (zeroplan/dsconfig/rules/ds019.py)
    "muon-z3-reduce-scatter": (_with(GOOD["z3"], lambda c: c.update(optimizer={"type": "Muon", "params": {"lr": 1e-3}})), "ZP607"),
    "superoffload-cpu": (_with(GOOD["z3-offload-cpu"], lambda c: c["zero_optimization"]["offload_optimizer"].update(super_offload=True)),
                         "ZP208"),
    "zenflow-z3-cpu": (_with(GOOD["z3-offload-cpu"], lambda c: c["zero_optimization"].update(zenflow={
        "topk_ratio": 0.1, "update_interval": 4, "select_strategy": "step", "select_interval": 4})), "ZP210"),
}


@pytest.fixture(scope="module")
def engine_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    configs = {**GOOD, **{name: cfg for name, (cfg, _) in BAD.items()}}
    (tmp / "configs.json").write_text(json.dumps(configs))
    (tmp / "worker.py").write_text(_WORKER)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29571",
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(tmp / "worker.py"), str(tmp / "configs.json"), str(tmp / "out.json")],
                          capture_output=True, text=True, env=env, timeout=900, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GOOD))
def test_exported_config_trains_a_step(engine_results, name):
    assert validate_config(GOOD[name], world_size=1) == []
    result = engine_results[name]
    assert result["ok"], result
    assert result["global_steps"] == 1  # one optimizer step over 2 micro-steps
    if name == "z3-offload-cpu":
        assert result["optimizer"] == "DeepSpeedCPUAdam"


#: How DeepSpeed 0.19 fails on each BAD config: the exception and a pattern of its message that
#: names the problem the rule reports (a failure for another reason does not count).
ENGINE_ERRORS = {
    "lr-string": ("TypeError", r"multi_tensor_adam\(\): incompatible function arguments"),  # the str lr reaches the kernel
    "lr-string-cpu-adam": ("TypeError", r"create_adam\(\): incompatible function arguments"),  # DeepSpeedCPUAdam's constructor
    "max-grad-norm": ("ValueError", r"'max_grad_norm' is not supported as an optimizer parameter"),
    "sgd-lowercase": ("AssertionError", r"sgd is not a supported DeepSpeed Optimizer"),
    "sgd-untested": ("AssertionError", r"untested ZeRO Optimizer.*zero_allow_untested_optimizer"),
    "bad-scheduler": ("AssertionError", r"does not recognize LR scheduler Cosine"),
    "client-adamw-offload": ("ZeRORuntimeException", r"ZeRO-Offload with a client provided optimizer"),
    "muon-z3-reduce-scatter": ("ValueError", r"Muon and reduce scatter cannot be used together"),  # stage3.py:360
    "superoffload-cpu": ("AssertionError", r"SuperOffload only supports NVIDIA CUDA GPUs"),  # superoffload_stage3.py:23
    # engine_stage3.py: device='cuda'; torch's _lazy_init (torch/cuda/__init__.py) raises the first on
    # a CPU build of torch, the second on a CUDA build on a machine without a driver.
    "zenflow-z3-cpu": (("AssertionError", "RuntimeError"), r"Torch not compiled with CUDA enabled|Found no NVIDIA driver"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BAD))
def test_config_validate_rejects_fails_in_the_engine(engine_results, name):
    import re

    cfg, rule_id = BAD[name]
    severity = "warning" if name == "client-adamw-offload" else "error"  # fine with a DeepSpeed CPU optimizer
    # The engine runs on the CPU accelerator here, as the CUDA-only rules are told.
    assert rule_id in {f.rule_id for f in validate_config(cfg, world_size=1, accelerator="cpu") if f.severity == severity}
    result = engine_results[name]
    assert not result["ok"], f"{name} started although validate reports {rule_id}"
    error, pattern = ENGINE_ERRORS[name]
    errors = (error,) if isinstance(error, str) else error
    assert result["error"] in errors and re.search(pattern, result["message"]), result


@pytest.mark.slow
def test_blog_config_lr_string_crashes_deepspeed_cpu_adam(engine_results):
    """The issue's claim: a string learning rate crashes DeepSpeed's CPU Adam with a TypeError."""
    assert engine_results["lr-string-cpu-adam"]["error"] == "TypeError"
    assert "lr" in {f.path.rsplit(".", 1)[-1] for f in validate_config(load_config(BLOG).config, world_size=4)}
