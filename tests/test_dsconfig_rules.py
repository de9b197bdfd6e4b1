"""Every validation rule: one config that triggers it and a near-identical one that does not.

The cases are shared with tests/test_dsconfig_deepspeed.py, which checks that the errors we
say DeepSpeed raises on are in fact raised by DeepSpeed's own config parser.
"""

from __future__ import annotations

import copy

import pytest

from zeroplan.dsconfig import RULES, has_errors, validate_config
from zeroplan import profiles
from zeroplan.spec import ClusterSpec, GiB, ModelSpec, SpecError

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


def z3(**zero) -> dict:
    return make(zero_optimization={"stage": 3, **zero})


def nvme_params(aio: dict) -> dict:
    return make(zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}, aio=aio)


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
]


def run_case(cfg: dict, kwargs: dict, *, clean: bool):
    kw = dict(kwargs)
    clean_kwargs = kw.pop("_clean_kwargs", None)
    if clean and clean_kwargs is not None:
        kw = clean_kwargs
    kw.setdefault("world_size", WORLD)
    return validate_config(cfg, **kw)


def _case_id(case) -> str:
    return case[0]


@pytest.mark.parametrize("rule_id,bad,good,kwargs,ds_rejects", CASES, ids=[_case_id(c) for c in CASES])
def test_rule_triggers_on_bad_and_not_on_good(rule_id, bad, good, kwargs, ds_rejects):
    bad_findings = [f for f in run_case(bad, kwargs, clean=False) if f.rule_id == rule_id]
    good_findings = [f for f in run_case(good, kwargs, clean=True) if f.rule_id == rule_id]
    assert bad_findings, f"{rule_id} did not fire"
    assert not good_findings, f"{rule_id} fired on the clean config: {good_findings}"
    for f in bad_findings:
        assert f.message and f.fix and f.severity in ("error", "warning", "info")


def test_every_rule_has_a_case():
    covered = {c[0] for c in CASES} | {"ZP702"}  # ZP702 needs the estimator: test_dsconfig_fit.py
    covered |= {r for r in RULES if r.startswith("ZP8")}  # PEFT rules: tests/test_peft_rules.py
    assert covered == set(RULES)


def test_clean_base_has_no_findings_at_all():
    assert validate_config(BASE, world_size=WORLD) == []


def test_batch_fix_names_both_ways_out():
    # The example: 4 × 8 × 8 GPUs = 256, config says 128.
    cfg = make(train_batch_size=128, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=8)
    (f,) = [f for f in validate_config(cfg, world_size=8) if f.rule_id == "ZP101"]
    assert "set gradient_accumulation_steps to 4" in f.fix and "train_batch_size to 256" in f.fix
    assert f.severity == "error" and f.path == "train_batch_size"


def test_derivation_follows_deepspeed_floor_division():
    cfg = make(train_batch_size=18, gradient_accumulation_steps=_DELETE)
    (f,) = [f for f in validate_config(cfg, world_size=2) if f.rule_id == "ZP102"]
    assert "18 // 2 // 2 = 4" in f.message and "16" in f.message  # 4 × 2 × 2 = 16 != 18


def test_unknown_key_suggests_nearest():
    cfg = make(zero_optimization={"stage": 3, "stage3_prefetch_bucket": 1000})
    (f,) = [f for f in validate_config(cfg, world_size=2) if f.rule_id == "ZP501"]
    assert "stage3_prefetch_bucket_size" in f.fix and f.severity == "error"
    (top,) = [f for f in validate_config(make(gradient_cliping=1.0), world_size=2) if f.rule_id == "ZP501"]
    assert "gradient_clipping" in top.fix and top.severity == "warning"


def test_integer_string_in_pydantic_field_is_only_a_warning():
    cfg = make(zero_optimization={"stage": "2", "reduce_bucket_size": "500000000"})
    found = [f for f in validate_config(cfg, world_size=2) if f.rule_id in ("ZP401", "ZP201")]
    assert {f.rule_id for f in found} == {"ZP401"} and all(f.severity == "warning" for f in found)


def test_auto_values_report_their_resolution():
    cfg = make(zero_optimization={"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
               train_batch_size="auto")
    found = {f.path: f for f in validate_config(cfg, world_size=2, model=SMALL) if f.rule_id == "ZP504"}
    assert str(H * H) in found["zero_optimization.reduce_bucket_size"].message
    assert str(int(0.9 * H * H)) in found["zero_optimization.stage3_prefetch_bucket_size"].message
    assert "16 (2 × 4 × 2 GPUs)" in found["train_batch_size"].message
    assert found["train_batch_size"].severity == "warning"


def test_findings_sorted_errors_first_and_has_errors():
    cfg = make(train_batch_size=128, fp16={"enabled": True, "loss_scale_window": 5}, bf16={"enabled": False})
    findings = validate_config(cfg, world_size=2)
    order = [f.severity for f in findings]
    assert order == sorted(order, key=["error", "warning", "info"].index)
    assert has_errors(findings)
    assert not has_errors([f for f in findings if f.severity != "error"])


@pytest.mark.parametrize("bad", [{"world_size": 0}, {"world_size": True}, {"world_size": 2.0}])
def test_bad_world_size_is_spec_error(bad):
    with pytest.raises(SpecError):
        validate_config(BASE, **bad)


def test_non_dict_config_is_spec_error():
    with pytest.raises(SpecError):
        validate_config([1, 2], world_size=2)  # type: ignore[arg-type]


def test_rules_are_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "validate.md").read_text()
    for rule_id, rule in RULES.items():
        assert f"| {rule_id} |" in doc, f"{rule_id} missing from docs/validate.md"
        assert rule.why and rule.title
