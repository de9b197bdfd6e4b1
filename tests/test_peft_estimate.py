"""PEFT in the estimator and on the command line: published counts, QLoRA storage arithmetic,
and bad input (one line, exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zeroplan.estimator.peft import NF4_DOUBLE_QUANT_OVERHEAD_BITS, quantized_weight_bytes

from helpers import ROOT, run_zeroplan


run = run_zeroplan


def test_nf4_double_quantization_overhead_matches_qlora_paper():
    # QLoRA (arXiv 2305.14314) §3 "Double Quantization": the constants cost 32/64 = 0.5 bit per
    # parameter without it and 8/64 + 32/(64·256) = 0.127 bit with it.
    assert round(NF4_DOUBLE_QUANT_OVERHEAD_BITS, 3) == 0.127
    n = 64 * 256 * 1000
    parts = quantized_weight_bytes("nf4", n, rows=1)
    assert parts["nf4_codes"] * 8 / n == 4
    assert round((parts["absmax_8bit"] + parts["absmax_fp32_constants"]) * 8 / n, 3) == 0.127
    # LLM.int8 (arXiv 2208.07339) §3: int8 weights + one fp32 scale per row.
    assert quantized_weight_bytes("int8", 4096 * 4096, rows=4096) == {"int8_weights": 4096 * 4096, "row_scales_fp32": 4 * 4096}


def test_json_reports_trainable_and_frozen_counts_as_peft_prints_them():
    # peft's print_trainable_parameters() for Llama-3-8B with LoraConfig(r=16,
    # target_modules=["q_proj", "v_proj"]): "trainable params: 6,815,744 || all params: 8,037,076,992".
    r = run("estimate", "--model", "llama-3-8b", "--gpus", "2", "--cpu-memory", "256", "--gpu", "a100-80gb",
            "--lora-rank", "16", "--lora-targets", "q_proj,v_proj", "--micro-batch", "1", "--format", "json")
    assert r.returncode == 0, r.stderr
    model = json.loads(r.stdout)["model"]
    assert model["trainable_params"] == 6_815_744
    assert model["trainable_params"] + model["frozen_params"] == 8_037_076_992


@pytest.mark.parametrize(
    "args,message",
    [
        (["--lora-rank", "8", "--lora-targets", "q_proj,wq"],
         "--lora-targets wq: no such module in llama-3-8b; its linear modules are down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (or all-linear)"),
        (["--lora-rank", "-4"], "--lora-rank -4 is not valid; give a whole number >= 1 (typical: 8, 16, 64)"),
        (["--lora-rank", "2048", "--lora-targets", "k_proj"],
         "--lora-rank 2048 is larger than self_attn.k_proj (4096→1024); a rank above min(in, out) = 1024 adds parameters without adding capacity"),
        (["--lora-rank", "8", "--base-quant", "nf4", "--precision", "fp32"],
         "--base-quant nf4 with --precision fp32: bitsandbytes bases compute in bf16 or fp16; use --precision bf16"),
        (["--trainable-params", "120%"], "--trainable-params '120%' is not valid; give a count such as 2e8 or a percentage such as 1.5%"),
    ],
)
def test_bad_peft_input_is_one_line_exit_2(args, message):
    r = run("estimate", "--model", "llama-3-8b", "--gpus", "2", "--cpu-memory", "256", *args)
    assert r.returncode == 2
    assert r.stderr == f"zeroplan: error: {message}\n"


def test_model_spec_with_peft_round_trips_through_json():
    # Probes and the tuner ship the ModelSpec to workers as JSON and rebuild it there.
    from zeroplan.profiles import load_model_preset
    from zeroplan.profiles.lora import PeftOptions, resolve_peft
    from zeroplan.spec import ModelSpec

    spec = resolve_peft(load_model_preset("mistral-7b"), PeftOptions(lora_rank=8, lora_targets="all-linear", base_quant="nf4"),
                        model_arg="mistral-7b", precision="bf16")
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.as_dict()))) == spec


def test_quantized_base_bytes_equal_bitsandbytes_storage(tmp_path):
    """The bytes of a real QLoRA model equal ParameterBytes.total.

    Truth: transformers loads a small Llama checkpoint with BitsAndBytesConfig (NF4, double
    quantization) — deciding itself which modules to quantize —, peft prepares it and adds LoRA,
    and DeepSpeed's bf16 cast (engine.py ``_cast_module_mixed_precision``) is applied; we sum
    each parameter's storage plus its quant_state's absmax constants (first and second level).
    """
    import warnings

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from dataclasses import replace

    from zeroplan.estimator.peft import parameter_bytes
    from zeroplan.profiles.hf_config import model_from_hf_dict
    from zeroplan.profiles.lora import base_modules, lora_spec

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cfg = dict(model_type="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    data = dict(cfg)
    hf = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    transformers.AutoModelForCausalLM.from_config(hf).to(torch.bfloat16).save_pretrained(tmp_path)
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                            bnb_4bit_compute_dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quant, dtype=torch.bfloat16, device_map="cpu")
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    measured = 0
    for param in model.parameters():
        if param.dtype in (torch.float16, torch.float32):  # DeepSpeed bf16 casts every float parameter
            param.data = param.data.to(torch.bfloat16)
        measured += param.numel() * param.element_size()
        state = getattr(param, "quant_state", None)
        if state is not None:
            measured += state.absmax.numel() * state.absmax.element_size()
            if state.nested:
                measured += state.state2.absmax.numel() * state.state2.absmax.element_size()
    base = model_from_hf_dict(cfg, name="tiny")
    spec = replace(base, peft=lora_spec(base, base_modules(cfg), rank=8, targets=["q_proj", "v_proj"], base_quant="nf4"))
    assert parameter_bytes(spec, "bf16").total == measured


def test_peft_estimate_imports_no_torch_or_peft():
    code = (
        "import sys; from zeroplan.cli import main; "
        "sys.argv = ['zeroplan', 'estimate', '--model', 'llama-3-8b', '--gpus', '2', '--cpu-memory', '64', "
        "'--lora-rank', '8', '--base-quant', 'nf4', '--format', 'json', '-o', '/dev/null']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print([m for m in ('torch', 'deepspeed', 'transformers', 'peft', 'bitsandbytes') if m in sys.modules])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("targets,measured", [
    # DeepSpeed 0.19 on 2 CPU ranks, examples/lora_task.py's Llama (L4 h256 GQA 4/2 ffn 688 V8192), r 8:
    # the frozen parameters ds_status showed NOT_AVAILABLE when the loss's backward started
    # (benchmarks/zero3_gathered_params.py): the embedding and layer 0's q/k/v ...
    ("all-linear", {"input_embedding": 2_097_152, "first_block_qkv": 131_072}),
    ("q_proj,v_proj", {"input_embedding": 2_097_152, "first_block_qkv": 131_072}),
    # ... and with down_proj alone every layer-0 linear, down_proj's base_layer included.
    ("down_proj", {"input_embedding": 2_097_152, "first_block_qkv": 131_072, "first_block_attn_output": 65_536,
                   "first_block_mlp_input": 352_256, "first_block_mlp_output": 176_128}),
])
def test_zero3_releases_the_frozen_modules_no_gradient_flows_through(targets, measured):
    from dataclasses import replace

    from zeroplan.estimator.peft import stage3_released_frozen_params
    from zeroplan.profiles.hf_config import model_from_hf_dict
    from zeroplan.profiles.lora import base_modules, lora_spec

    config = dict(model_type="llama", vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    base = model_from_hf_dict(config, name="llama L4 h256")
    model = replace(base, peft=lora_spec(base, base_modules(config), rank=8, targets=targets.split(",") if targets != "all-linear" else targets))
    assert stage3_released_frozen_params(model, persistence_threshold=10 * model.hidden_size) == measured
    # Checkpointing re-gathers in the recomputed forward: nothing is assumed released.
    assert stage3_released_frozen_params(model, checkpointing="full") == {}
