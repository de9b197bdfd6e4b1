"""Every validation rule: one config that triggers it and a near-identical one that does not.

The cases (tests/helpers.py) are shared with tests/test_dsconfig_deepspeed.py, which checks that the errors we
say DeepSpeed raises on are in fact raised by DeepSpeed's own config parser.
"""

from __future__ import annotations

import pytest

from zeroplan.dsconfig import RULES, has_errors, validate_config
from zeroplan.spec import SpecError
from helpers import BASE, CASES, H, ROOT, SMALL, WORLD, _DELETE, make, run_case

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

    doc = (ROOT / "docs" / "validate.md").read_text()
    for rule_id, rule in RULES.items():
        assert f"| {rule_id} |" in doc, f"{rule_id} missing from docs/validate.md"
        assert rule.why and rule.title
