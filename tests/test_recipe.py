"""Post-training recipes: the Recipe spec, its memory terms against TRL's own code and errors, the
CLI flags and the TRL values export writes (docs/recipes.md)."""

from __future__ import annotations

import json

import pytest

from helpers import run_zeroplan
from zeroplan.spec import ModelSpec, Plan, SpecError, TrainingSpec
from zeroplan.spec.recipe import Recipe


# -- the spec ---------------------------------------------------------------------------------


def test_defaults_are_trls():
    # GRPOConfig: num_generations=8, max_completion_length=512, beta=0.0 (no reference model);
    # DPOConfig: beta=0.1 with a reference model.
    from trl import DPOConfig, GRPOConfig

    grpo = GRPOConfig(output_dir="/tmp/zp-grpo", per_device_train_batch_size=8, report_to=[], use_cpu=True)
    assert Recipe("grpo").generations == grpo.num_generations
    assert Recipe("grpo").completion_len == grpo.max_completion_length
    assert (Recipe("grpo").reference == "none") == (grpo.beta == 0.0)
    assert Recipe("dpo").reference == "model" and DPOConfig(output_dir="/tmp/zp-dpo", report_to=[], use_cpu=True).beta > 0


@pytest.mark.parametrize("fields,needle", [
    ({"kind": "dpo", "generations": 4}, "generations=4 is for grpo or ppo"),
    ({"kind": "grpo", "generations": 1}, "at least 2 generations"),
    ({"kind": "grpo", "vllm_gpu_memory": 1.5}, "fraction in (0, 1)"),
    ({"kind": "sft", "vllm_gpu_memory": 0.3}, "is for grpo or ppo"),
    ({"kind": "grpo", "vllm_sleep": True}, "give --vllm-gpu-memory"),
    ({"kind": "dpo", "critic_model": "gpt2"}, "is for ppo"),
    ({"kind": "kto"}, "choose one of sft, dpo, grpo, ppo"),
    ({"kind": "dpo", "reference": "frozen"}, "choose one of model, offload, precomputed, none"),
])
def test_bad_recipe_names_field_and_remedy(fields, needle):
    with pytest.raises(SpecError) as err:
        Recipe(**fields)
    assert needle in str(err.value)


def test_round_trip_and_discovery_keys():
    r = Recipe("grpo", generations=4, completion_len=64, vllm_gpu_memory=0.3)
    assert Recipe.from_dict(r.as_dict()) == r
    # Discovery writes the contract's keys; one it does not know is refused by name.
    assert Recipe.from_dict({"kind": "dpo", "reference": "precomputed"}).reference == "precomputed"
    with pytest.raises(SpecError, match="num_generations"):
        Recipe.from_dict({"kind": "grpo", "num_generations": 4})


def test_completion_must_leave_a_prompt():
    with pytest.raises(SpecError, match="leaves no prompt"):
        Recipe("grpo", completion_len=512).check_sequence(512)


# -- TRL's own checks ---------------------------------------------------------------------------


def _trl_refuses(mb: int, ga: int, g: int) -> str | None:
    from trl import GRPOConfig

    try:
        GRPOConfig(output_dir="/tmp/zp-grpo", per_device_train_batch_size=mb, gradient_accumulation_steps=ga,
                   num_generations=g, report_to=[], use_cpu=True)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("mb,ga,g", [(1, 1, 2), (2, 1, 2), (3, 2, 4), (4, 2, 8), (2, 3, 3), (6, 1, 4), (8, 1, 8)])
def test_generation_batch_check_matches_grpoconfig(mb, ga, g):
    from zeroplan.dsconfig import validate_config
    from zeroplan.estimator.plans_recipe import trl_accepts

    refused = _trl_refuses(mb, ga, g)  # one process here: TRL's world size is 1
    assert trl_accepts(Plan(0, micro_batch=mb, gradient_accumulation_steps=ga), 1, Recipe("grpo", generations=g)) == (refused is None)
    cfg = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": ga, "train_batch_size": mb * ga}
    found = [f for f in validate_config(cfg, world_size=1, recipe=Recipe("grpo", generations=g)) if f.rule_id == "ZP953"]
    assert bool(found) == (refused is not None)
    if refused:
        # validate quotes TRL's own message.
        assert found[0].message.startswith(refused.rstrip("."))


def test_trl_values_are_accepted_by_trl(tmp_path):
    from trl import DPOConfig, GRPOConfig

    from zeroplan.dsconfig.trl_values import trl_config_values

    training = TrainingSpec(seq_len=1024)
    plan = Plan(3, checkpointing="full", micro_batch=4, gradient_accumulation_steps=2)
    grpo = trl_config_values(Recipe("grpo", generations=8, completion_len=256, vllm_gpu_memory=0.3, reference="model"), plan, training)
    cfg = GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **grpo)
    assert (cfg.num_generations, cfg.max_completion_length, cfg.steps_per_generation) == (8, 256, 2)
    assert cfg.use_vllm and cfg.vllm_gpu_memory_utilization == 0.3 and cfg.beta > 0 and cfg.gradient_checkpointing
    dpo = trl_config_values(Recipe("dpo", reference="precomputed"), plan, training)
    cfg = DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **dpo)
    assert cfg.precompute_ref_log_probs and cfg.max_length == 1024 and cfg.per_device_train_batch_size == 4


# -- memory terms against TRL's code --------------------------------------------------------------


@pytest.mark.parametrize("n,h,v", [(256, 64, 1000), (300, 32, 40000)])
def test_fused_head_terms_match_trls_function_on_cpu(n, h, v):
    """TRL's ChunkedLogProbFunction forward + backward on CPU, live tensor storage above its inputs:
    loss 'trl' + the CPU fold (benchmarks/bench_loss_memory.py --variants trl measures larger shapes)."""
    import torch
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    from zeroplan.estimator.recipe_terms import cpu_fold_bytes, trl_logprob_head_bytes
    from zeroplan.runtime.measure.memory import StorageTracker

    hidden = torch.randn(n, h).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h) / h**0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (n,))
    with StorageTracker() as tracker:
        tracker.track(hidden, weight, y)
        base = tracker.current_bytes
        tracker.reset_peak()
        logps = ChunkedLogProbFunction.apply(hidden, weight, None, y, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs",))[0]
        (-logps.sum() / n).backward()
        measured = tracker.peak_bytes - base
    terms = trl_logprob_head_bytes(tokens=n, vocab_size=v, hidden_size=h, precision="bf16")
    fold = cpu_fold_bytes(tokens=n, vocab_size=v, precision="bf16", backward=True)
    predicted = sum(terms.values()) + max(0, fold - terms["gradient_casts"])
    assert predicted == pytest.approx(measured, rel=0.01)


def test_reference_placement_follows_prepare_deepspeed():
    from zeroplan.estimator.recipe_terms import reference_weight_bytes

    m = ModelSpec.from_params(7e9)
    # Stage 3: sharded like the policy (offload_param kept, so offloaded with it); below: stage 0, whole.
    assert reference_weight_bytes(m, stage=3, offload_param="none", data_parallel=8, precision="bf16") == -(-2 * m.params // 8)
    assert reference_weight_bytes(m, stage=3, offload_param="cpu", data_parallel=8, precision="bf16") == 0
    for stage in (0, 1, 2):
        assert reference_weight_bytes(m, stage=stage, offload_param="none", data_parallel=8, precision="bf16") == 2 * m.params


def _estimate(recipe, *, stage=3, mb=1, ga=1, seq=512, model=None, device="cuda"):
    from zeroplan.estimator.plans_recipe import estimate_recipe_plan
    from zeroplan.profiles.resolve import resolve_cluster

    cluster = resolve_cluster(gpus=8, gpus_per_node=8, gpu="h100-80gb", gpu_memory_gib=None, cpu_memory_gib=2048, nvme_gib=None)
    return estimate_recipe_plan(model or ModelSpec.from_params(7e9), cluster, TrainingSpec(seq_len=seq),
                                Plan(stage, micro_batch=mb, gradient_accumulation_steps=ga), recipe, device=device)


def test_plain_sft_is_unchanged():
    assert _estimate(None).as_dict() == _estimate(Recipe("sft")).as_dict()
    assert "recipe" not in _estimate(None).as_dict()


def test_dpo_doubles_the_sequences_and_adds_the_reference():
    dpo = _estimate(Recipe("dpo"), stage=2, mb=2)
    assert dpo.recipe["training_pass"]["sequences_per_forward"] == 4
    assert dpo.recipe["resident"]["reference_weights"] == 2 * ModelSpec.from_params(7e9).params
    assert dpo.plan.micro_batch == 2  # the plan is the user's; the pass is doubled
    pre = _estimate(Recipe("dpo", reference="precomputed"), stage=2, mb=2)
    assert "reference_weights" not in pre.recipe["resident"]
    assert dpo.gpu.required - pre.gpu.required >= dpo.recipe["resident"]["reference_weights"]


def test_grpo_itemises_generation_and_zero3_gather():
    grpo = _estimate(Recipe("grpo", generations=4, completion_len=256), stage=3, mb=4, ga=2)
    t = grpo.recipe["terms"]
    m = ModelSpec.from_params(7e9)
    assert t["generation_batch_per_gpu"] == 8
    assert t["kv_cache"] == 2 * m.num_layers * 8 * m.num_kv_heads * m.head_dim * 512 * 2
    assert t["generation_gather"] == 2 * m.params - 2 * m.params // 8
    assert grpo.recipe["moments"]["generation"] >= t["generation_gather"] + t["kv_cache"]
    # ZeRO-2 holds the whole model already: nothing to gather.
    assert _estimate(Recipe("grpo", generations=4, completion_len=256), stage=2, mb=4, ga=2).recipe["terms"]["generation_gather"] == 0


def test_vllm_slice_has_its_own_verdict():
    small = _estimate(Recipe("grpo", completion_len=256, vllm_gpu_memory=0.1), model=ModelSpec.from_params(70e9))
    assert small.recipe["vllm"]["verdict"] == "oom" and small.verdict == "oom"
    assert any("vLLM cannot start" in n for n in small.notes)
    roomy = _estimate(Recipe("grpo", completion_len=256, vllm_gpu_memory=0.3), model=ModelSpec.from_params(1e9))
    assert roomy.recipe["vllm"]["verdict"] == "fits"
    assert roomy.recipe["resident"]["vllm_slice"] == int(0.3 * roomy.judgement.gpu.capacity_bytes)


# -- the command line ---------------------------------------------------------------------------------


def test_estimate_json_carries_the_recipe():
    r = run_zeroplan("estimate", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "h100-80gb", "--cpu-memory", "1024",
                     "--recipe", "grpo", "--generations", "4", "--completion-len", "256", "--format", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["recipe"]["kind"] == "grpo" and doc["recipe"]["generations"] == 4
    assert all("recipe" in p and "moments" in p["recipe"] for p in doc["plans"])


def test_bad_recipe_flag_is_one_line():
    r = run_zeroplan("estimate", "--params", "7e9", "--recipe", "dpo", "--generations", "4")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "generations=4 is for grpo or ppo" in r.stderr


def test_export_writes_trl_values_beside_the_config(tmp_path):
    out = tmp_path / "ds.json"
    r = run_zeroplan("export", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "h100-80gb", "--cpu-memory", "1024",
                     "--recipe", "grpo", "--generations", "8", "--completion-len", "512", "--output", str(out))
    assert r.returncode == 0, r.stderr
    ds = json.loads(out.read_text())
    trl = json.loads((tmp_path / "ds.trl.json").read_text())
    assert trl["per_device_train_batch_size"] == ds["train_micro_batch_size_per_gpu"]
    assert trl["gradient_accumulation_steps"] == ds["gradient_accumulation_steps"]
    assert trl["num_generations"] == 8 and trl["deepspeed"] == str(out)
    # The plan export chose passes TRL's own divisibility check.
    assert (trl["per_device_train_batch_size"] * 8 * trl["gradient_accumulation_steps"]) % 8 == 0


def test_trl_sft_on_cpu_counts_the_tile_fold():
    # TRL's SFTTrainer uses the same fused head: --loss trl; on CPU (probes) its fold's temporaries count.
    from dataclasses import replace

    from zeroplan.estimator import estimate_plan
    from zeroplan.estimator.plans_recipe import estimate_recipe_plan
    from zeroplan.profiles.resolve import resolve_cluster

    cluster = resolve_cluster(gpus=2, gpus_per_node=2, gpu="h100-80gb", gpu_memory_gib=None, cpu_memory_gib=64, nvme_gib=None)
    model, training, plan = ModelSpec.from_params(125e6), TrainingSpec(seq_len=256, loss="trl"), Plan(2, micro_batch=2)
    est = estimate_recipe_plan(model, cluster, training, plan, Recipe("sft"), device="cpu")
    fold = est.recipe["terms"]["head_tile_fold_cpu"]
    assert fold > 0
    base = estimate_plan(model, cluster, training, plan, device="cpu")
    above = {m.name: m.allocated_above_states for m in base.moments}
    floor = base.gpu.peak_allocated - max(above.values())
    # The fold happens at the loss's backward: that moment grows by it, the others do not.
    assert est.gpu.peak_allocated == floor + max(max(above.values()), above["the loss's backward"] + fold)
    assert est.recipe["moments"]["the loss's backward"] == above["the loss's backward"] + fold
    # DPO doubles the scored tokens: twice the fold's tile on top of the doubled pass.
    dpo = estimate_recipe_plan(model, cluster, training, plan, Recipe("dpo"), device="cpu")
    assert dpo.recipe["logprob_head"] == estimate_recipe_plan(
        model, cluster, training, replace(plan, micro_batch=4), Recipe("sft"), device="cpu").recipe["logprob_head"]


@pytest.mark.parametrize("b,s", [(2, 128), (4, 256)])
def test_reference_forward_matches_a_no_grad_llama_under_trls_head(b, s):
    """A reference (or old-policy) pass as TRL runs it: transformers' Llama with TRL's fused head,
    under no_grad, on CPU; live tensor storage above the weights and inputs."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from zeroplan.estimator.recipe_terms import no_grad_forward_bytes
    from zeroplan.profiles.hf_config import model_from_hf_dict
    from zeroplan.runtime.measure.memory import StorageTracker

    shape = dict(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa")).to(torch.bfloat16)
    add_fused_lm_head(model)
    ids = torch.randint(0, 1000, (b, s))
    with StorageTracker() as tracker:
        tracker.track(*model.parameters(), ids)
        base = tracker.current_bytes
        tracker.reset_peak()
        with torch.no_grad():
            model(input_ids=ids, labels=ids, fused_lm_head=True, use_cache=False)
        measured = tracker.peak_bytes - base
    spec = model_from_hf_dict({"model_type": "llama", **shape}, name="tiny-llama")
    predicted = sum(no_grad_forward_bytes(spec, sequences=b, seq_len=s, precision="bf16", flash_attention=True, on_cpu=True).values())
    assert predicted == pytest.approx(measured, rel=0.02)


def test_validate_flags_trls_generation_batch_in_one_line(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "train_batch_size": 16}))
    r = run_zeroplan("validate", str(cfg), "--gpus", "2", "--recipe", "grpo", "--generations", "3", "--format", "json")
    assert r.returncode == 1
    (found,) = [f for f in json.loads(r.stdout) if f["rule_id"] == "ZP953"]
    assert found["message"].startswith("generation_batch_size (16) must be divisible by num_generations (3)")


def test_recommended_export_command_runs(tmp_path):
    import shlex

    r = run_zeroplan("estimate", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "h100-80gb", "--cpu-memory", "1024",
                     "--recipe", "dpo", "--reference", "precomputed", "--top", "3", columns=200)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("Write it: "))
    argv = shlex.split(line.removeprefix("Write it: "))
    assert argv[:2] == ["zeroplan", "export"] and "--recipe" in argv and "--reference" in argv
    argv[argv.index("--output") + 1] = str(tmp_path / "ds.json")
    done = run_zeroplan(*argv[1:])
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "ds.trl.json").read_text())["precompute_ref_log_probs"] is True


# A DPO step over the full logits, as LLaMA-Factory 0.9 (src/llamafactory/train/dpo/trainer.py:182-191,
# 226-234) and TRL before 1.0 run it: the policy's fp32 logits and their log-probs of the shifted
# view, held while the reference scores the same batch under no_grad. Peak resident memory of the
# process (the kernel's high-water mark VmHWM, reset first through /proc/self/clear_refs; large
# blocks mmapped so that freed ones leave it) above the weights and inputs, after a short warm-up.
_FULL_LOGIT_DPO = r"""
import os, sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
torch.set_num_threads(1)
b, s, shape = int(sys.argv[1]), int(sys.argv[2]), eval(sys.argv[3])
torch.manual_seed(0)
policy = Qwen2ForCausalLM(Qwen2Config(**shape, attn_implementation="sdpa")).to(torch.bfloat16)
reference = Qwen2ForCausalLM(Qwen2Config(**shape, attn_implementation="sdpa")).to(torch.bfloat16).eval()
ids = torch.randint(0, shape["vocab_size"], (2 * b, s))

def logps(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits.to(torch.float32)
    targets = ids[:, 1:].clone().unsqueeze(2)
    return torch.gather(logits[:, :-1, :].log_softmax(-1), 2, targets).squeeze(2).sum(-1), logits

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def high_water_mark():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmHWM"].split()[0]) * 1024

warm, _ = logps(policy, ids[:, :8])
with torch.no_grad():
    logps(reference, ids[:, :8])
del warm, _
before = rss()
with open("/proc/self/clear_refs", "w") as f:  # "5": reset this process's peak RSS (VmHWM) to its current RSS
    f.write("5")
policy_logps, policy_logits = logps(policy, ids)
with torch.no_grad():
    reference_logps, _ = logps(reference, ids)
print(high_water_mark() - before)
"""


def test_full_logit_dpo_reference_moment_matches_a_measured_step():
    """The reference forward of a full-logit DPO step (loss ``plain``): the policy's held logits and
    saved log-softmax (8·N·V) plus the reference's shifted log-softmax (12·N·V), against the step's
    measured peak. The previous model (the policy's logits gone, (e + 8)·N·V for the reference)
    read about half of it (measured 332 MB, predicted 329; the previous model 165)."""
    import os
    import subprocess
    import sys

    from zeroplan.estimator.plans_recipe import estimate_recipe_plan
    from zeroplan.profiles.hf_config import model_from_hf_dict
    from zeroplan.profiles.resolve import resolve_cluster

    shape = dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    b = 1
    out = subprocess.run([sys.executable, "-c", _FULL_LOGIT_DPO, str(b), "256", repr(shape)], capture_output=True, text=True,
                         env=env, timeout=120, check=True)
    measured = int(out.stdout.split()[-1])
    spec = model_from_hf_dict({"model_type": "qwen2", **shape}, name="tiny-qwen2")
    cluster = resolve_cluster(gpus=1, gpus_per_node=1, gpu="h100-80gb", gpu_memory_gib=None, cpu_memory_gib=64, nvme_gib=None)
    est = estimate_recipe_plan(spec, cluster, TrainingSpec(seq_len=256, loss="plain"), Plan(0, micro_batch=b, checkpointing="none"),
                               Recipe("dpo"), device="cuda")
    assert est.recipe["terms"]["policy_logits_held"] == 8 * 2 * b * 256 * 32000
    # On CPU the same: no TRL tile fold without TRL's fused head.
    on_cpu = estimate_recipe_plan(spec, cluster, TrainingSpec(seq_len=256, loss="plain"), Plan(0, micro_batch=b, checkpointing="none"),
                                  Recipe("dpo"), device="cpu")
    assert "head_tile_fold_cpu" not in on_cpu.recipe["terms"]
    assert est.recipe["moments"]["the reference forward"] == pytest.approx(measured, rel=0.03)
