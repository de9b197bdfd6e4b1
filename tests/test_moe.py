"""Mixture-of-experts models: total and active parameter counts from a config.json against the
transformers model built on the meta device, and what the estimator does with them."""

from __future__ import annotations

import json

import pytest

from helpers import EXAMPLES
from zeroplan.profiles import model_from_hf_config
from zeroplan.spec import SpecError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

#: Published shapes (the models' config.json on the Hugging Face Hub; see the presets' sources)
#: and tiny ones that switch the optional parts on (dense layers, shared experts, biases).
MOE_CONFIGS = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, tie_word_embeddings=False,
    ),
    "qwen3-moe-tiny-dense-layers": dict(
        model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
        num_experts_per_tok=2, mlp_only_layers=[0], decoder_sparse_step=2, attention_bias=True,
    ),
    "qwen2-moe-tiny": dict(
        model_type="qwen2_moe", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
    ),
    "mixtral-tiny": dict(
        model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True,
    ),
    "deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
        num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4,
    ),
    "deepseek-v3-tiny-no-q-lora": dict(
        model_type="deepseek_v3", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
        kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
        num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1, attention_bias=True,
    ),
    "gpt-oss-20b": dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
    ),
    "gpt-oss-120b": dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4,
    ),
    "gpt-oss-tiny": dict(
        model_type="gpt_oss", vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
    ),
}


def meta_model(config: dict):
    data = dict(config)
    hf_config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(hf_config), hf_config


def reference_counts(config: dict) -> tuple[int, int, int]:
    """(total, active, largest expert module) from the meta model: a parameter of a module named
    ``experts`` holds E experts along its first dimension, of which a token touches top-k; every
    other parameter (attention, router, shared experts, dense MLPs, embeddings) is touched whole."""
    model, hf_config = meta_model(config)
    k = hf_config.num_experts_per_tok
    total = active = 0
    largest_experts = 0
    seen: set[int] = set()  # a tied lm_head shares the embedding's parameter: count it once
    for module_name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        if module_name.endswith(".experts"):
            numel = sum(p.numel() for p in own)
            experts = {p.shape[0] for p in own}
            assert len(experts) == 1, (module_name, [p.shape for p in own])
            active += numel * k // experts.pop()
            largest_experts = max(largest_experts, numel)
        else:
            active += sum(p.numel() for p in own)
        total += sum(p.numel() for p in own)
    assert total == sum(p.numel() for p in model.parameters())
    return total, active, largest_experts


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_total_and_active_params_match_the_meta_model(tmp_path, name):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MOE_CONFIGS[name]))
    spec = model_from_hf_config(path)
    total, active, largest_experts = reference_counts(MOE_CONFIGS[name])
    assert spec.params == total
    assert spec.active_params == active
    assert spec.moe is not None and spec.moe.fused_experts
    # ZeRO-3 fetches a module's parameters together: one layer's fused experts at once.
    assert spec.moe.layer_experts_params == largest_experts
    assert spec.largest_layer_params >= largest_experts


def test_published_totals_and_active():
    """Against the model cards: Qwen3-30B-A3B "30.5B in total and 3.3B activated"; Mixtral 8x7B
    46.7B total, 12.9B active (mistral.ai, "Mixtral of experts", 2023); DeepSeek-V3 671B total,
    37B activated (arXiv 2412.19437 §1, the 14B MTP module aside); gpt-oss-120b 116.83B / 5.13B and
    gpt-oss-20b 20.91B / 3.61B (OpenAI gpt-oss model card, arXiv 2508.10925 Table 1, whose active
    count leaves out the V·h input embedding: a token reads one row of it)."""
    expected = {
        "qwen3-30b-a3b": (30.5e9, 3.3e9),
        "mixtral-8x7b": (46.7e9, 12.9e9),
        "deepseek-v3": (671e9, 37e9),
        "gpt-oss-120b": (116.83e9, 5.13e9),
        "gpt-oss-20b": (20.91e9, 3.61e9),
    }
    from zeroplan.profiles.hf_config import model_from_hf_dict

    for name, (total, active) in expected.items():
        spec = model_from_hf_dict(MOE_CONFIGS[name], name=name)
        assert spec.params == pytest.approx(total, rel=0.01), name
        counted = spec.active_params - (spec.embedding_params if name.startswith("gpt-oss") else 0)
        assert counted == pytest.approx(active, rel=0.03), name


def test_qwen3_30b_fetches_604m_expert_parameters_at_once():
    from zeroplan.profiles.hf_config import model_from_hf_dict

    spec = model_from_hf_dict(MOE_CONFIGS["qwen3-30b-a3b"], name="q")
    assert spec.moe.layer_experts_params == 128 * 3 * 2048 * 768 == 603_979_776


def test_no_moe_layer_is_an_error(tmp_path):
    config = dict(MOE_CONFIGS["qwen3-moe-tiny-dense-layers"], mlp_only_layers=[0, 1, 2, 3, 4])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(SpecError, match="no layer is an MoE layer"):
        model_from_hf_config(path)


def test_more_experts_per_token_than_experts(tmp_path):
    config = dict(MOE_CONFIGS["mixtral-tiny"], num_experts_per_tok=5)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(SpecError, match="experts_per_token=5 exceeds num_experts=4"):
        model_from_hf_config(path)


# ---------------------------------------------------------------------------------------------
# Estimator: memory from every expert, FLOPs from the active ones, ZeRO-3's fused-expert fetch
# ---------------------------------------------------------------------------------------------


def _cluster(gpus: int):
    from zeroplan.profiles.resolve import resolve_cluster

    return resolve_cluster(gpus=gpus, gpus_per_node=8, gpu="h100-80gb", gpu_memory_gib=None, cpu_memory_gib=2048, nvme_gib=None)


def test_states_use_total_and_flops_use_active_params():
    from zeroplan.estimator.memory import model_states
    from zeroplan.estimator.timing import flops_per_token
    from zeroplan.profiles import load_model_preset
    from zeroplan.spec import Plan, TrainingSpec

    model = load_model_preset("qwen3-30b-a3b")
    training = TrainingSpec(seq_len=2048)
    states = model_states(model, _cluster(8), training, Plan(stage=0))
    assert states.params == 2 * model.params and states.optimizer_states == 12 * model.params
    flops = flops_per_token(model, training, Plan(stage=0))
    assert flops["weights"] == 6.0 * model.active_params  # Kaplan's 6N with N the active parameters


def test_zero3_gathers_a_whole_layer_of_fused_experts():
    """DeepSpeed fetches a module's parameters together (partitioned_param_coordinator.py
    fetch_sub_module), so however small stage3_max_live_parameters is, one layer's experts
    (Qwen3-235B-A22B: 128 · 3 · 4096 · 1536 = 2.42e9 parameters) are gathered at once."""
    from zeroplan.estimator.memory import engine_overhead
    from zeroplan.profiles import load_model_preset
    from zeroplan.spec import Plan, TrainingSpec

    model = load_model_preset("qwen3-235b-a22b")
    assert model.moe.layer_experts_params == 2_415_919_104
    for max_live in (None, 10**8):  # DeepSpeed's default 1e9, and a small one
        plan = Plan(stage=3, stage3_max_live_parameters=max_live)
        gathered = engine_overhead(model, _cluster(32), TrainingSpec(), plan).during_backward["gathered_params"]
        assert gathered == 2 * model.moe.layer_experts_params


def test_dispatch_activations_scale_with_top_k():
    from zeroplan.estimator.activations import layer_activation_bytes
    from zeroplan.profiles.hf_config import model_from_hf_dict

    model = model_from_hf_dict(MOE_CONFIGS["qwen3-30b-a3b"], name="q")
    terms = layer_activation_bytes(model, seq_len=1024, micro_batch=2, precision="bf16", flash_attention=True)
    n, h = 2048, 2048
    assert terms["expert_inputs"] == terms["expert_outputs"] == 2 * 8 * n * h  # bf16 top-8 copies
    assert terms["router_probs"] == 4 * n * 128 + 8 * n * 8
    assert terms["mlp_hidden"] == 4 * 2 * n * 8 * 768  # gate_up (2I), SiLU, product per routed copy


# ---------------------------------------------------------------------------------------------
# Leaf modules: ModuleList experts found in the module tree, written by export, checked by validate
# ---------------------------------------------------------------------------------------------


class _Expert(torch.nn.Module):
    def __init__(self, h: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(h, inner, bias=False)
        self.up_proj = torch.nn.Linear(h, inner, bias=False)
        self.down_proj = torch.nn.Linear(inner, h, bias=False)


class _ListMoe(torch.nn.Module):
    def __init__(self, h: int = 16, inner: int = 8, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = torch.nn.Linear(h, experts, bias=False)
        self.experts = torch.nn.ModuleList(_Expert(h, inner) for _ in range(experts))


def test_moe_blocks_finds_modulelist_experts_and_deepspeed_defaults():
    from zeroplan.runtime.rank.moe_leaf import moe_blocks

    model = torch.nn.Sequential(_ListMoe(), _ListMoe())
    (block,) = moe_blocks(model)
    assert block["class"] == f"{__name__}._ListMoe" and block["count"] == 2
    assert block["num_experts"] == 4 and block["top_k"] == 2 and block["expert_ffn_size"] == 8
    assert block["expert_params"] == sum(p.numel() for p in model[0].experts[0].parameters()) == 3 * 16 * 8
    assert not block["default_leaf"]
    # transformers 5's fused experts are no ModuleList: nothing to flag.
    fused, _ = meta_model(MOE_CONFIGS["mixtral-tiny"])
    assert moe_blocks(fused) == []


def test_default_leaf_classes_are_deepspeeds():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES

    from zeroplan.spec.moe import DEEPSPEED_DEFAULT_LEAF_MODULE_CLASSES

    assert list(DEEPSPEED_DEFAULT_LEAF_MODULE_CLASSES) == DEFAULT_LEAF_MODULE_CLASSES


def _discovered_list_moe():
    from zeroplan.runtime.discovery.discover import DiscoveredModel
    from zeroplan.runtime.discovery.discover_worker import describe_model

    data = dict(MOE_CONFIGS["mixtral-tiny"])
    hf_config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    for layer in model.model.layers:
        layer.mlp = _ListMoe(h=64, inner=48, experts=4, top_k=2)
        layer.mlp.gate = torch.nn.Linear(64, 4, bias=False)
    described = describe_model(model)
    return DiscoveredModel.from_worker({"entry_point": "deepspeed.initialize", "model": described}, script="s.py"), model


def test_discovered_modulelist_moe_exports_leaf_modules_and_validates():
    from zeroplan.dsconfig import build_config, validate_config
    from zeroplan.spec import Plan, TrainingSpec

    discovered, model = _discovered_list_moe()
    spec = discovered.model_spec()
    assert spec.params == sum(p.numel() for p in model.parameters())
    assert spec.moe is not None and not spec.moe.fused_experts
    assert spec.moe.leaf_module_classes == (f"{__name__}._ListMoe",)
    training = TrainingSpec(seq_len=64)
    plan = Plan(stage=3, micro_batch=1)
    cfg = build_config(plan, world_size=2, training=training, model=spec)
    classes = cfg["zero_optimization"]["leaf_module"]["classes"]
    assert classes[-1] == f"{__name__}._ListMoe" and len(classes) == 4  # DeepSpeed's 3 defaults kept
    assert not [f for f in validate_config(cfg, world_size=2, model=spec) if f.rule_id == "ZP250"]
    del cfg["zero_optimization"]["leaf_module"]
    (finding,) = [f for f in validate_config(cfg, world_size=2, model=spec) if f.rule_id == "ZP250"]
    assert finding.severity == "error" and "_ListMoe" in finding.message
    # Stages 0-2 hook no parameters: no leaf modules needed or written.
    cfg2 = build_config(Plan(stage=2, micro_batch=1), world_size=2, training=training, model=spec)
    assert "leaf_module" not in cfg2["zero_optimization"]


def test_exported_leaf_module_parses_under_deepspeed():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig

    from zeroplan.dsconfig import build_config
    from zeroplan.spec import Plan, TrainingSpec

    discovered, _ = _discovered_list_moe()
    cfg = build_config(Plan(stage=3, micro_batch=1), world_size=2, training=TrainingSpec(seq_len=64), model=discovered.model_spec())
    parsed = DeepSpeedZeroLeafModuleConfig(**cfg["zero_optimization"]["leaf_module"])
    assert parsed.classes == cfg["zero_optimization"]["leaf_module"]["classes"]


def test_autoep_rule_cites_a_call_that_fails_on_the_installed_versions():
    """ZP251's reason, checked on the installed packages: DeepSpeed's AutoEP calls the registry's
    ``get`` with a default; transformers 5's registry ``get`` takes the model alone."""
    pytest.importorskip("deepspeed")
    import inspect

    from deepspeed.module_inject.auto_ep_presets import base
    from transformers.utils.output_capturing import _CanRecordRegistry

    assert "registry.get(registry_key, _MISSING_REGISTRY_ENTRY)" in inspect.getsource(base)
    with pytest.raises(TypeError, match="takes 2 positional arguments but 3 were given"):
        _CanRecordRegistry().get("key", None)


def test_saved_activations_of_a_qwen3_moe_layer_match_the_formula():
    """Every tensor autograd saves in one decoder layer of the tiny Qwen3-MoE (examples/moe_task.py)
    in fp32, by storage, against layer_activation_bytes' MoE, Q/K-norm and RMSNorm terms (the
    block's two RMSNorms save their input, rsqrt and normalized output: zeroplan.estimator.norms)."""
    from zeroplan.estimator.activations import layer_activation_bytes
    from zeroplan.profiles import model_from_hf_config

    path = EXAMPLES / "qwen3_moe_tiny.json"
    data = json.loads(path.read_text())
    spec = model_from_hf_config(path)
    model, _ = meta_model(data)
    model = model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    s, b = 256, 4
    x = torch.randint(0, data["vocab_size"], (b, s), generator=torch.Generator().manual_seed(0))
    layer = model.model.layers[0]
    saved: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside = [False]
    layer.register_forward_pre_hook(lambda m, i: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda m, i, o: inside.__setitem__(0, False))

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if inside[0] and key not in params:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=x)
    terms = layer_activation_bytes(spec, seq_len=s, micro_batch=b, precision="fp32", flash_attention=True)
    assert sum(saved.values()) == pytest.approx(sum(terms.values()), rel=0.02)


def test_hang_reason_names_the_leaf_module_fix():
    from zeroplan.runtime.measure.classify import classify
    from zeroplan.runtime.rank.moe_leaf import leaf_module_warning

    model = torch.nn.Sequential(_ListMoe())
    warning = leaf_module_warning(model)
    assert warning and f"{__name__}._ListMoe" in warning and "leaf_module.classes" in warning
    status, reason = classify(returncode=None, timed_out=True, timeout_s=60, ranks=[], expected_ranks=2,
                              log_text=f"[rank0] loading\n{warning}\n")
    assert status == "timeout" and "likely cause: ZeRO-3 MoE blocks without leaf modules" in reason
    assert classify(returncode=None, timed_out=True, timeout_s=60, ranks=[], expected_ranks=2, log_text="")[1].endswith("killed")
    # Over gloo the mismatched all-gathers abort instead of hanging (observed with examples/moe_task.py --list).
    gloo = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at pair.cc:456] "
            "op.preamble.length <= op.nbytes. 4096 vs 64. Received data size doesn't match expected size. Is there a "
            "distributed collective mismatch in your code?\n")
    status, reason = classify(returncode=1, timed_out=False, timeout_s=60, ranks=[], expected_ranks=2, log_text=warning + "\n" + gloo)
    assert status == "error" and "collective mismatch" in reason and "leaf_module.classes" in reason
    pytest.importorskip("deepspeed")
    from deepspeed.utils import set_z3_leaf_modules

    set_z3_leaf_modules(model, [_ListMoe])
    assert leaf_module_warning(model) is None


def test_stage1_unreduced_gradients_are_the_fused_expert_tensors():
    """Stage 1 holds gradients larger than the reduce bucket unreduced until the epilogue; in an
    MoE layer those are the fused expert tensors (E·2I·h and E·h·I), not h×(k·I) matrices."""
    from zeroplan.estimator.embedding_backward import _matrices_over
    from zeroplan.profiles.hf_config import model_from_hf_dict

    model = model_from_hf_dict(MOE_CONFIGS["mixtral-tiny"], name="m")  # h 64, I 48, E 4, 2 layers
    h, i, e = 64, 48, 4
    bucket = 4000  # above every attention and router matrix (64·64 = 4096 is not: q and o count)
    expected = 2 * (2 * h * h + e * 2 * i * h + e * h * i)  # per layer: q, o and the two fused tensors
    assert _matrices_over(model, bucket) == expected


def test_discovered_model_without_a_config_gets_its_experts_from_the_blocks():
    from zeroplan.runtime.discovery.discover import DiscoveredModel

    block = {"class": "mymodels.moe.ListMoeBlock", "count": 2, "num_experts": 4, "expert_params": 3 * 64 * 48,
             "expert_ffn_size": 48, "top_k": 2, "default_leaf": False, "is_leaf": False}
    shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn_size=96, vocab_size=128)
    total = 200_000
    found = DiscoveredModel(entry_point="deepspeed.initialize", model_class="m.M", total_params=total, trainable_params=total,
                            largest_layer_name="x", largest_layer_params=9216, dtype="float32", shape=shape, moe_blocks=[block])
    spec = found.model_spec()
    assert spec.moe.num_experts == 4 and spec.moe.experts_per_token == 2 and spec.moe.moe_layers == 2
    assert spec.active_params == total - 2 * (4 - 2) * 3 * 64 * 48
    assert spec.moe.leaf_module_classes == ("mymodels.moe.ListMoeBlock",) and not spec.moe.fused_experts
    # Top-k not found: every expert counted active, and the notes say so.
    found = DiscoveredModel(**{**found.as_dict(), "moe_blocks": [dict(block, top_k=None)]})
    spec = found.model_spec()
    assert spec.active_params == total and any("every expert counted active" in n for n in spec.notes)
