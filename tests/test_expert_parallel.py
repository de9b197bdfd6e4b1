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


def _autoep_starts_here() -> bool:
    """Whether DeepSpeed's AutoEP gets past the call ZP251 names with the installed packages: it
    retargets transformers' output recorders with ``registry.get(key, default)``
    (deepspeed/module_inject/auto_ep_presets/base.py), which transformers 5's registry refuses."""
    from transformers.utils.output_capturing import _CanRecordRegistry

    try:
        _CanRecordRegistry().get("key", None)
    except TypeError:
        return False
    return True


def test_tune_space_estimates_ep_plans_and_prunes_them_with_zp251():
    """``tune --ep 1,2``: ep-2 plans are enumerated and estimated like the others (their expert
    layout's memory and all-to-all time), and, where AutoEP cannot start, set aside with ZP251's
    line instead of being probed; ep-1 plans stay probeable."""
    from zeroplan.profiles import resolve_cluster
    from zeroplan.tuner import build_space

    model = _qwen3_moe_tiny()
    cl = resolve_cluster(gpus=2, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=None, cpu_memory_gib=64, nvme_gib=None)
    training = TrainingSpec(seq_len=64, global_batch=8)
    space = build_space(model, cl, training, stages=(1, 2), offload_optimizer=("none",), offload_param=("none",), checkpointing=("none",),
                        micro_batches=(1, 2), device="cpu", ep=[1, 2])
    by_ep = {e: [c for c in space.candidates if c.plan.ep == e] for e in (1, 2)}
    assert by_ep[1] and len(by_ep[2]) == len(by_ep[1])
    assert "ep2" in space.layout_choices and space.plan_for(by_ep[2][0].params).ep == 2
    # Each rank keeps 4 of the 8 experts: the ep-2 twin of a stage-1 plan holds fewer parameter bytes.
    twin = {c.plan.label.replace("/ep2", ""): c for c in by_ep[2]}
    for c in by_ep[1]:
        assert twin[c.plan.label].predicted_gpu_bytes < c.predicted_gpu_bytes
        assert twin[c.plan.label].predicted_step_time_s > 0
    if _autoep_starts_here():
        assert all(c.fits for c in by_ep[2])
    else:
        assert not any(c.fits for c in by_ep[2])
        assert all(c.reason.startswith("not probed (ZP251): expert_parallel (AutoEP)") and "TypeError" in c.reason for c in by_ep[2])
        assert all(c.fits for c in by_ep[1]) and {c.plan.ep for c in space.fitting} == {1}


def test_tune_ep_above_one_only_stops_before_any_probe(tmp_path, capsys):
    """``tune --ep 2`` where AutoEP cannot start: one line naming ZP251's reason, exit 2, nothing
    written (no study, no probe folder); a bad --ep is one line too."""
    if _autoep_starts_here():
        pytest.skip("AutoEP starts with the installed transformers/DeepSpeed")
    out = tmp_path / "out"
    code, _, err = run_main(["tune", "examples/moe_task.py", "--gpus", "2", "--ep", "2", "-o", str(out)], capsys)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "(ZP251)" in err and "_CanRecordRegistry.get() takes 2 positional arguments" in err
    assert not out.exists()
    code, _, err = run_main(["tune", "examples/moe_task.py", "--gpus", "2", "--ep", "two", "-o", str(out)], capsys)
    assert code == 2 and "give a whole number >= 1" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.e2e
def test_trainer_optimizer_fails_deepspeeds_moe_check_where_zp254_says():
    """HF Trainer's own optimizer (no ``optimizer`` block) against an MoE engine at ZeRO-1/2:
    DeepSpeed's assertion, measured on one CPU rank; with the block DeepSpeed marks a ``moe`` group
    and starts. ZP254 fires on the first config and not on the second."""
    import subprocess
    import sys

    from helpers import BENCHMARKS, make, run_case, zeroplan_env

    r = subprocess.run([sys.executable, str(BENCHMARKS / "moe_client_optimizer.py")], capture_output=True, text=True,
                       env=zeroplan_env(DS_ACCELERATOR="cpu"), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["trainer_groups_have_moe_key"] is False
    for stage in (1, 2):
        assert got[f"z{stage}_client"].startswith("AssertionError: The model has moe layers, but None of the param groups are marked as MoE")
        assert got[f"z{stage}_config"] == "ok" and got[f"z{stage}_config_moe_groups"] == 1
        ep = {"enabled": True, "autoep_size": 1}
        no_block = make(expert_parallel=ep, zero_optimization={"stage": stage})
        no_block.pop("optimizer")
        assert "ZP254" in {f.rule_id for f in run_case(no_block, {}, clean=False)}
        assert "ZP254" not in {f.rule_id for f in run_case(make(expert_parallel=ep, zero_optimization={"stage": stage}), {}, clean=True)}
