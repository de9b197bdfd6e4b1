"""``zeroplan probe`` with LoRA options: bad input is one line and exit 2 before anything runs,
and the estimate beside a measurement takes its trainable count from the run (requires_grad)
and its LoRA layout from the task or the options, saying which."""

from __future__ import annotations

import json
import sys

import pytest

from zeroplan.profiles import load_model_preset
from zeroplan.profiles.hf_config import model_from_hf_dict
from zeroplan.profiles.lora import base_modules, lora_spec
from zeroplan.runtime.measure.peft_source import PeftFlags, model_for_estimate
from zeroplan.spec import SpecError

from helpers import ROOT
TASK = str(ROOT / "examples" / "lora_task.py")
#: examples/lora_task.py's default model (Llama, 4 layers, h 256, GQA 4/2, ffn 688, V 8192).
SMALL = dict(model_type="llama", vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """Run the console entry point in this process: (exit code, stderr)."""
    from zeroplan.cli import main

    monkeypatch.setattr(sys, "argv", ["zeroplan", *args])
    with pytest.raises(SystemExit) as done:
        main()
    return done.value.code, capsys.readouterr().err


@pytest.fixture
def other_base(tmp_path):
    """A Llama config saved from meta-llama/Meta-Llama-3-8B and an adapter made for Mistral."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(SMALL, _name_or_path="meta-llama/Meta-Llama-3-8B")))
    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps(
        dict(peft_type="LORA", r=8, target_modules=["q_proj"], base_model_name_or_path="mistralai/Mistral-7B-v0.1")
    ))
    return config, tmp_path / "ad"


@pytest.mark.parametrize("args,message", [
    (["--model", "llama-3-8b", "--lora-rank", "8", "--lora-targets", "q_proj,wq"],
     "--lora-targets wq: no such module in llama-3-8b; its linear modules are down_proj, gate_proj, k_proj, o_proj, "
     "q_proj, up_proj, v_proj (or all-linear)"),
    (["--lora-rank", "0"], "--lora-rank 0 is not valid; give a whole number >= 1 (typical: 8, 16, 64)"),
    (["--model", "llama-3-8b", "--lora-rank", "2048", "--lora-targets", "k_proj"],
     "--lora-rank 2048 is larger than self_attn.k_proj (4096→1024); a rank above min(in, out) = 1024 adds parameters "
     "without adding capacity"),
    (["--lora-rank", "8", "--base-quant", "nf4", "--precision", "fp32"],
     "--base-quant nf4 with --precision fp32: bitsandbytes bases compute in bf16 or fp16; use --precision bf16"),
    (["--base-quant", "nf4"], "--base-quant nf4 needs an adapter (--lora-rank or --adapter): a quantized base cannot train"),
    (["--lora-rank", "8", "--trainable-params", "1%"],
     "give one of --lora-rank/--lora-targets, --adapter or --trainable-params, not several"),
    (["--lora-targets", "q_proj"], "--lora-targets/--lora-alpha need --lora-rank (e.g. --lora-rank 16)"),
])
def test_probe_bad_lora_input_is_one_line_exit_2(monkeypatch, capsys, tmp_path, args, message):
    workdir = tmp_path / "run"
    code, err = cli(monkeypatch, capsys, "probe", TASK, "--stage", "2", "--workdir", str(workdir), *args)
    assert (code, err) == (2, f"zeroplan: error: {message}\n")
    assert not workdir.exists()  # nothing launched


def test_probe_adapter_for_another_base_model_is_exit_2(monkeypatch, capsys, other_base):
    config, adapter = other_base
    code, err = cli(monkeypatch, capsys, "probe", TASK, "--stage", "2", "--model", str(config), "--adapter", str(adapter))
    assert code == 2
    assert err == (f"zeroplan: error: --adapter {adapter} was made for mistralai/Mistral-7B-v0.1, but the model is "
                   "meta-llama/Meta-Llama-3-8B; give that model's config\n")


def _small(rank: int = 8, targets="q_proj,v_proj"):
    base = model_from_hf_dict(SMALL, name="llama L4 h256")
    return base, lora_spec(base, base_modules(SMALL), rank=rank, targets=targets.split(","))


def test_run_count_first_layout_from_the_options():
    # The numbers a DeepSpeed probe of examples/lora_task.py -- --rank 8 reports (requires_grad).
    base, peft = _small()
    flags = PeftFlags(lora_rank=8, lora_targets="q_proj,v_proj")
    model, note = model_for_estimate(base, origin="the discovered model", trainable=28_672, frozen=7_096_576, flags=flags)
    assert model.peft.method == "lora" and model.trainable_params == peft.trainable_params == 28_672
    assert note.startswith("trainable/frozen from requires_grad (28,672 trainable), as --lora-rank 8 --lora-targets q_proj,v_proj gives")


def test_options_that_disagree_with_the_run_give_way_to_its_count():
    base, _ = _small()
    flags = PeftFlags(lora_rank=64, lora_targets="q_proj,v_proj")  # the run used r = 8
    model, note = model_for_estimate(base, origin="the discovered model", trainable=28_672, frozen=7_096_576, flags=flags)
    assert (model.peft.method, model.trainable_params) == ("partial", 28_672)
    assert note.startswith("--lora-rank 64 --lora-targets q_proj,v_proj gives 229,376 trainable, the run 28,672; the run trains 28,672 of")


def test_options_alone_where_the_backend_reports_no_counts():
    base, _ = _small()
    model, note = model_for_estimate(base, origin="the task's model_spec", trainable=None, frozen=None,
                                     flags=PeftFlags(lora_rank=8, lora_targets="all-linear"))
    assert model.trainable_params == 147_968  # bench_lora_memory's r8 all-linear row, peft's count
    assert note.startswith("trainable/frozen from --lora-rank 8 --lora-targets all-linear: 147,968 trainable")


def test_options_that_do_not_fit_the_model_leave_a_note_not_an_error():
    base, _ = _small()
    model, note = model_for_estimate(base, origin="the discovered model", trainable=28_672, frozen=7_096_576,
                                     flags=PeftFlags(lora_rank=8, lora_targets="c_attn"))
    assert model.peft.method == "partial"
    assert note.startswith("--lora-rank 8 --lora-targets c_attn does not fit the discovered model (--lora-targets c_attn: no such module")


def test_without_options_the_run_count_alone():
    model, note = model_for_estimate(load_model_preset("llama-3-8b"), origin="the discovered model",
                                     trainable=6_815_744, frozen=8_030_261_248)
    assert (model.peft.method, model.trainable_params) == ("partial", 6_815_744)
    assert "give --lora-rank/--adapter for LoRA's activations" in note
    with pytest.raises(SpecError, match="--lora-rank 0 is not valid"):
        PeftFlags(lora_rank=0)


def test_options_give_a_discovered_peft_model_its_layout():
    # What discovery makes of examples/train_deepspeed_lora.py -- --rank 8: the PeftModel's total
    # (base + adapters) with a requires_grad split and no layout.
    from dataclasses import replace

    from zeroplan.spec import PeftSpec

    base, peft = _small()
    discovered = replace(base, params=base.params + peft.added_params, source="discovered", peft=PeftSpec(
        method="partial", base_params=base.params + peft.added_params, trainable_params=28_672, source="discovered"))
    model, note = model_for_estimate(discovered, origin="the discovered model", trainable=28_672, frozen=7_096_576,
                                     flags=PeftFlags(lora_rank=8, lora_targets="q_proj,v_proj"))
    assert (model.params, model.peft.method, model.total_params) == (base.params, "lora", 7_125_248)
    assert "as --lora-rank 8 --lora-targets q_proj,v_proj gives" in note
    alone, note = model_for_estimate(discovered, origin="the discovered model", trainable=28_672, frozen=7_096_576)
    assert (alone, note) == (discovered, None)  # discovery's own split stands
