"""The ZP26x layout rules against DeepSpeed's own checks.

tests/data/layout_engine_checks.py runs, on 4 CPU ranks over gloo, the engine functions that hold
each check (UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter, register_with_transformers,
initialize_sequence_parallel, deepspeed.initialize with AutoTP + ZeRO-3) on the values the rules
reject; every rule must fire on those values and quote what the engine raised, and stay silent on
the values the engine accepted. Trigger/clean pairs for each rule are in helpers.LAYOUT_CASES
(tests/test_dsconfig_rules.py runs them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import BASE, ROOT, make, tiny_llama_heads
from zeroplan.dsconfig import validate_config
from zeroplan.dsconfig.rules.layout import layout_findings
from zeroplan.spec import Plan, TrainingSpec

pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("layout") / "engine.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                           str(ROOT / "tests" / "data" / "layout_engine_checks.py"), str(out)],
                          capture_output=True, text=True, env=env, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _only(findings, rule_id):
    found = [f for f in findings if f.rule_id == rule_id]
    assert len(found) == 1, findings
    return found[0]


def _quoted(engine_message: str) -> str:
    """The engine's reason up to its first full stop (the rest is advice the fix says)."""
    return engine_message.split(". ")[0]


@pytest.mark.slow
def test_rules_quote_the_engine_where_it_raises(engine):
    sp2 = make(sequence_parallel_size=2)
    cases = {
        # check name -> (finding, engine values)
        "heads": _only(validate_config(sp2, world_size=4, model=tiny_llama_heads(3, 1)), "ZP261"),
        "kv_heads": _only(validate_config(sp2, world_size=4, model=tiny_llama_heads(6, 3)), "ZP262"),
        "seq_len": _only(validate_config(sp2, world_size=4, training=TrainingSpec(seq_len=5)), "ZP263"),
        "eager": _only(validate_config(sp2, world_size=4, attn_implementation="eager"), "ZP264"),
        "sp_world": _only(validate_config(make(sequence_parallel_size=3), world_size=4), "ZP106"),
        "autotp_z3_batch": _only(validate_config(make(zero_optimization={"stage": 3}, tensor_parallel={"autotp_size": 2},
                                                      train_batch_size=4, gradient_accumulation_steps=1, train_micro_batch_size_per_gpu=1),
                                                 world_size=4), "ZP260"),
    }
    for check, finding in cases.items():
        raised = engine[check]
        assert raised["error"] is not None, (check, raised)
        quote = _quoted(raised["message"])
        if check == "autotp_z3_batch":  # the engine's numbers follow the quoted part
            quote = quote.split(" world_size ")[0]
        assert quote in finding.message, (check, quote, finding.message)


@pytest.mark.slow
def test_rules_are_silent_where_the_engine_runs(engine):
    assert engine["heads_ok"]["error"] is None and engine["seq_len_ok"]["error"] is None
    # 4 heads, 1 KV head replicated over sp 2 (what "heads_ok" built), a 6-token sequence.
    model = tiny_llama_heads(4, 1)
    found = validate_config(make(sequence_parallel_size=2), world_size=4, model=model, training=TrainingSpec(seq_len=6),
                            attn_implementation="sdpa")
    assert not [f for f in found if f.rule_id.startswith("ZP26") or f.rule_id == "ZP106"], found
    # AutoTP with ZeRO-3 trains in DeepSpeed 0.19.8 once train_batch_size is left out: not rejected.
    assert engine["autotp_z3"]["error"] is None, engine["autotp_z3"]
    cfg = make(zero_optimization={"stage": 3}, tensor_parallel={"autotp_size": 2}, gradient_accumulation_steps=1,
               train_micro_batch_size_per_gpu=1)
    cfg.pop("train_batch_size")
    assert not [f for f in validate_config(cfg, world_size=4) if f.severity == "error"]


def test_plan_layouts_are_checked_through_the_keys():
    plan = Plan(stage=3, sp=4, micro_batch=2, gradient_accumulation_steps=4)
    found = layout_findings(plan, world_size=8, model=tiny_llama_heads(6, 2), training=TrainingSpec(seq_len=4098))
    assert {f.rule_id for f in found} == {"ZP261", "ZP263"}
    assert layout_findings(Plan(stage=3, tp=2), world_size=4) == []  # AutoTP + ZeRO-3: no train_batch_size written
    assert {f.rule_id for f in layout_findings(Plan(stage=1, sp=2, tp=2), world_size=6)} == {"ZP265"}
    assert "train_batch_size" in BASE  # the CASES' base config carries one (ZP260's trigger)


def test_the_degrees_a_fix_lists_are_the_ones_its_rule_accepts():
    """ZP261 (sp and the heads) and ZP252 (AutoEP degree, world and experts) list the degrees to use
    (zeroplan.spec.divisors): each listed degree passes the rule, each other one fails it."""
    import re

    from helpers import LIST_MOE

    def listed(fix: str) -> set[int]:
        return {int(x) for x in re.findall(r"\d+", fix.split("(")[-1] if "(" in fix else fix.split("one of")[-1])}

    model = tiny_llama_heads(12, 12)
    (sp_fix,) = [f.fix for f in validate_config(make(sequence_parallel_size=5), world_size=5, model=model) if f.rule_id == "ZP261"]
    for sp in range(2, 13):
        found = {f.rule_id for f in validate_config(make(sequence_parallel_size=sp), world_size=sp, model=model)}
        assert ("ZP261" not in found) == (sp in listed(sp_fix)), (sp, sp_fix)
    experts, world = LIST_MOE.moe.num_experts, 8
    autoep = lambda ep: make(expert_parallel={"enabled": True, "autoep_size": ep})  # noqa: E731
    # 3 divides neither the world nor the experts: the world's finding, then the one listing what divides both
    ep_fix = [f.fix for f in validate_config(autoep(3), world_size=world, model=LIST_MOE) if f.rule_id == "ZP252"][-1]
    for ep in range(1, world + 1):
        found = {f.rule_id for f in validate_config(autoep(ep), world_size=world, model=LIST_MOE)}
        assert ("ZP252" not in found) == (ep in listed(ep_fix)), (ep, ep_fix, experts)
