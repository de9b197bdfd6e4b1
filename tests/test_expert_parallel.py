"""Expert parallelism (DeepSpeed AutoEP): the degrees zeroplan accepts against DeepSpeed's own
validators, what a rank holds against the transformers model's expert parameters, and the CLI."""

from __future__ import annotations

import json

import pytest

from helpers import run_main
from zeroplan.spec import Plan, SpecError, TrainingSpec

deepspeed = pytest.importorskip("deepspeed")


def _qwen3_moe_tiny():
    from zeroplan.profiles.hf_config import model_from_hf_dict

    return model_from_hf_dict(dict(
        model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, tie_word_embeddings=False,
    ), name="qwen3-moe-tiny")


def _deepspeed_refuses(world: int, ep: int, experts: int) -> bool:
    """Whether DeepSpeed's own AutoEP checks refuse ep on world ranks for a layer of ``experts``."""
    from deepspeed.module_inject.auto_ep_config import AutoEPConfig, validate_autoep_post_detection
    from deepspeed.module_inject.auto_ep_folding import build_folding_spec
    from deepspeed.module_inject.auto_ep_presets.base import MoELayerSpec

    config = AutoEPConfig()
    config.enabled, config.autoep_size = True, ep
    layer = MoELayerSpec(
        moe_module_name="model.layers.0.mlp", model_family="qwen3_moe", router_name="gate", experts_name="experts",
        expert_storage="fused_3d", expert_w1_name="gate_up_proj", expert_w2_name="down_proj", expert_w3_name=None,
        num_experts=experts, top_k=2, hidden_size=64, ffn_hidden_size=32, score_func="softmax", score_apply="post",
        route_norm=True, gate_bias=False, return_router_logits=False, router_logits_capture_target="none",
        router_logits_capture_index=None, router_logits_capture_layer_name=None, has_shared_experts=False,
        shared_experts_name="",
    )
    try:
        build_folding_spec(world_size=world, pp_size=1, tp_size=1, ep_size=ep)
        validate_autoep_post_detection(config, [layer])
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("world", [1, 2, 4, 6, 8, 16])
@pytest.mark.parametrize("experts", [4, 6, 8, 128])
def test_accepted_degrees_are_deepspeeds(world, experts):
    import dataclasses

    from zeroplan.estimator.expert_parallel import expert_layout, valid_expert_degrees

    model = _qwen3_moe_tiny()
    model = dataclasses.replace(model, params=10**7, moe=dataclasses.replace(model.moe, num_experts=experts))
    accepted = valid_expert_degrees(model, world)
    for ep in range(1, 2 * max(world, 8) + 1):
        refused = _deepspeed_refuses(world, ep, experts)
        assert (ep not in accepted) == refused, (world, experts, ep)
        if refused:
            with pytest.raises(SpecError):
                expert_layout(model, Plan(stage=2, ep=ep), world)
        else:
            from deepspeed.module_inject.auto_ep_folding import build_folding_spec

            # edp: the group expert gradients and optimizer states are partitioned over.
            assert expert_layout(model, Plan(stage=2, ep=ep), world).edp == build_folding_spec(
                world_size=world, pp_size=1, tp_size=1, ep_size=ep).edp_size


def _expert_and_other_params():
    """(routed expert parameters, all parameters) of the tiny Qwen3-MoE built by transformers on
    the meta device: a parameter of a module named ``experts`` is a routed expert tensor."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    experts = sum(p.numel() for n, p in model.named_parameters() if n.rsplit(".", 2)[-2] == "experts")
    return experts, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_rank_holds_its_local_experts_and_partitions_them_over_edp(stage):
    """DeepSpeed's rule (stage_1_and_2.py _configure_moe_settings; engine.py _resolve_zero3_param_placement):
    a rank keeps E/ep experts, partitioned over world/ep ranks. Expert counts from transformers' model."""
    from zeroplan.estimator.expert_parallel import expert_parallel_states
    from zeroplan.profiles.resolve import resolve_cluster

    experts, total = _expert_and_other_params()
    model = _qwen3_moe_tiny()
    assert (model.moe.routed_params, model.total_params) == (experts, total)
    world, ep = 8, 4
    cluster = resolve_cluster(gpus=world, gpus_per_node=None, gpu="h100-80gb", gpu_memory_gib=None, cpu_memory_gib=None,
                              nvme_gib=None, node=None)
    training = TrainingSpec(precision="bf16", optimizer="adamw", seq_len=64)
    states = expert_parallel_states(model, cluster, training, Plan(stage=stage, ep=ep))
    dense = total - experts
    local = experts // ep
    edp = world // ep

    def part(count: int, over: int) -> int:
        return -(-count // over)

    replicated_params = stage < 3
    params = 2 * (dense + local) if replicated_params else 2 * (part(dense, world) + part(local, edp))
    grads = 2 * (dense + local) if stage == 0 else 2 * (part(dense, world) + part(local, edp))
    optim = 12 * (dense + local) if stage == 0 else 12 * (part(dense, world) + part(local, edp))
    assert (states.params, states.gradients, states.optimizer_states) == (params, grads, optim)


def test_ep_saves_replicated_expert_memory_and_adds_all_to_all():
    from zeroplan.estimator import enumerate_plans, estimate_all
    from zeroplan.estimator.expert_parallel import expert_all_to_all, with_expert_degrees
    from zeroplan.profiles import load_model_preset
    from zeroplan.profiles.resolve import resolve_cluster

    model = load_model_preset("qwen3-30b-a3b")
    cluster = resolve_cluster(gpus=8, gpus_per_node=None, gpu="h100-80gb", gpu_memory_gib=None, cpu_memory_gib=None,
                              nvme_gib=None, node=None)
    training = TrainingSpec(precision="bf16", optimizer="adamw", seq_len=4096, micro_batch=1)
    plans = with_expert_degrees(enumerate_plans(model, cluster, training, stage=2, offload_optimizer="none",
                                                checkpointing="full"), model, 8, [1, 8])
    by_ep = {e.plan.ep: e for e in estimate_all(model, cluster, training, plans)}
    routed = model.moe.routed_params
    # ZeRO-2 keeps bf16 parameters whole: ep 8 drops 7/8 of the routed experts' 2 bytes.
    assert by_ep[1].states.params - by_ep[8].states.params == 2 * (routed - routed // 8)
    # Optimizer states: (Ψ_e/ep)/(world/ep) = Ψ_e/world per rank, as without ep (stage_1_and_2.py _configure_moe_settings).
    assert by_ep[1].states.optimizer_states == by_ep[8].states.optimizer_states
    a2a = expert_all_to_all(model, cluster, training, by_ep[8].plan)
    # 48 MoE layers × 4096 tokens × top-8 × h 2048 × 2 bytes × 7/8, forward and backward.
    assert a2a.dispatch_bytes == int(2 * 48 * 4096 * 8 * 2048 * 2 * 7 / 8)
    assert a2a.calls == 4 * 48
    assert by_ep[8].comm.gradient_reduce < by_ep[1].comm.gradient_reduce


def test_estimate_ep_auto_json_layout(capsys):
    code, out, err = run_main(["estimate", "--model", "mixtral-8x7b", "--gpus", "8", "--gpu", "h100-80gb", "--ep", "auto",
                               "--stage", "2", "--micro-batch", "1", "--checkpointing", "full", "--format", "json"], capsys)
    assert code in (0, 1), err
    plans = json.loads(out)["plans"]
    assert {p["layout"]["ep"] for p in plans} == {1, 2, 4, 8}
    assert all(p["layout"]["dp"] == 8 for p in plans)


@pytest.mark.parametrize("argv, words", [
    (["--model", "mixtral-8x7b", "--gpus", "8", "--ep", "3"], "--ep 3 must divide the 8 GPUs"),
    (["--model", "mixtral-8x7b", "--gpus", "16", "--ep", "16"], "num_experts=8 is not divisible by autoep_size=16"),
    (["--model", "llama-2-7b", "--gpus", "8", "--ep", "2"], "needs a mixture-of-experts model"),
    (["--model", "mixtral-8x7b", "--gpus", "8", "--ep", "two"], "give a whole number >= 1"),
    (["--model", "mixtral-8x7b", "--gpus", "8", "--ep", "2", "--engine", "fsdp"], "AutoEP"),
    (["--model", "mixtral-8x7b", "--gpus", "8", "--ep", "2", "--lora-rank", "8"], "is not modelled"),
])
def test_bad_ep_is_one_line(capsys, argv, words):
    code, out, err = run_main(["estimate", *argv], capsys)
    assert code == 2 and words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_exported_expert_parallel_parses_under_deepspeed(capsys, tmp_path):
    from deepspeed.runtime.config import get_expert_parallel_config

    target = tmp_path / "ds.json"
    code, out, err = run_main(["export", "--model", "mixtral-8x7b", "--gpus", "8", "--stage", "2", "--micro-batch", "1",
                               "--ep", "4", "--output", str(target)], capsys)
    assert code == 0, err
    cfg = json.loads(target.read_text())
    parsed = get_expert_parallel_config(cfg)
    assert parsed.enabled is True and parsed.autoep_size == 4
    assert "ZP251" in err or "TypeError" in err  # the installed transformers 5 / DeepSpeed 0.19.8 pair
    from zeroplan.dsconfig.plan import plan_from_config

    assert plan_from_config(cfg, 8).ep == 4
