"""Parallel layouts in the estimator, the plan space and the exported configs (issue 24).

Each formula against a truth outside it: DeepSpeed's AutoTP parameter count per rank as measured
on the engine, transformers' parameter count of the same model, Korthikanti et al.'s tensor-parallel
activation formula, hand-derivable Ulysses arithmetic, DeepSpeed's and accelerate's own config
readers.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from zeroplan.estimator import enumerate_plans, estimate_plan, layer_activation_bytes
from zeroplan.estimator.layout_space import parse_degrees, valid_layouts
from zeroplan.estimator.sequence_parallel import layout_activation_memory, layout_layer_terms, ulysses_attention_terms
from zeroplan.estimator.tensor_parallel import layout_comm, tensor_parallel_params
from zeroplan.profiles import load_gpu
from zeroplan.profiles.resolve import resolve_model
from zeroplan.spec import ClusterSpec, GiB, ModelSpec, Plan, SpecError, TrainingSpec

from helpers import run_zeroplan

#: The tiny Llama of issue 24 (h 256, 2 layers, 4 heads of 64, 2 KV heads, MLP 688, vocabulary
#: 2048, untied head): 2,499,840 parameters.
TINY_LLAMA = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=False)


def _tiny_spec(tmp_path) -> ModelSpec:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return resolve_model(None, str(path))


def test_tiny_llama_counts_as_transformers_builds_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == _tiny_spec(tmp_path).params == 2_499_840


def test_autotp_parameters_per_rank_as_deepspeed_holds_them(tmp_path):
    # Issue 24: DeepSpeed 0.19.8's AutoTP at tp=2 on 2 CPU ranks (gloo) holds 1,512,704 of the
    # tiny Llama's 2,499,840 parameters per rank: q/k/v/o, the MLP and the untied head split,
    # the embedding and the norms whole.
    parts = tensor_parallel_params(_tiny_spec(tmp_path), 2)
    assert parts.per_rank == 1_512_704
    assert parts.embedding == 2048 * 256 and parts.norms == 5 * 256 and parts.head == 1024 * 256
    assert tensor_parallel_params(_tiny_spec(tmp_path), 1).per_rank == 2_499_840


def test_tensor_parallel_activations_are_korthikantis():
    # Korthikanti et al. 2022 (arXiv 2205.05198) §4.2.1: a GPT block with tensor parallelism t (no
    # sequence parallelism) keeps sbh·(10 + 24/t + 5as/(ht)) bytes in 16-bit with dropout.
    model = ModelSpec(name="gpt", params=10**9, hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=16, ffn_size=4096, vocab_size=50257)
    s, b, h, a = 2048, 2, 1024, 16
    for t in (1, 2, 4, 8):
        terms = layout_layer_terms(model, layer_activation_bytes(model, seq_len=s, micro_batch=b, precision="bf16", flash_attention=False), tp=t)
        assert sum(terms.values()) == s * b * h * 10 + s * b * h * 24 // t + 5 * a * s * s * b // t


def test_ulysses_adds_the_gathered_output_and_replicated_kv_exactly():
    model = resolve_model(None, "llama-3-8b")  # 32 heads, 8 KV heads of 128
    s, b, e, h, d = 131072, 1, 2, model.hidden_size, model.head_dim
    # sp divides the KV heads: K and V after the all-to-all are as large as before it; only the
    # core's output [s, b, h/sp] is a tensor of its own.
    assert ulysses_attention_terms(model, seq_len=s, micro_batch=b, precision="bf16", sp=4) == {"gathered_attention_output": e * s // 4 * b * h}
    # sp = 32 > 8 KV heads: each rank holds one replicated KV head for the whole sequence.
    terms = ulysses_attention_terms(model, seq_len=s, micro_batch=b, precision="bf16", sp=32)
    assert terms["replicated_key_value"] == 2 * e * b * d * (s - s // 32 * 8)
    # The block at sp: the local-sequence block plus those terms, per layer, exactly.
    training = TrainingSpec(seq_len=s)
    acts = layout_activation_memory(model, training, Plan(stage=3, sp=8, checkpointing="none"))
    local = layer_activation_bytes(model, seq_len=s // 8, micro_batch=b, precision="bf16", flash_attention=True)
    assert acts.per_layer == sum(local.values()) + e * s // 8 * b * h


def test_millions_of_tokens_stay_exact_integers():
    model = resolve_model(None, "llama-3-8b")
    training = TrainingSpec(seq_len=15_500_000)
    acts = layout_activation_memory(model, training, Plan(stage=3, sp=32, checkpointing="full", cpu_checkpointing=True, tiled_mlp=True))
    assert all(isinstance(v, int) for v in (acts.per_layer, acts.layers, acts.recompute_working_set, acts.logits))
    comm = layout_comm(model, training, Plan(stage=3, sp=32, checkpointing="full"))
    assert isinstance(comm.sequence_all_to_all, int) and comm.sequence_all_to_all > 0


def test_tiled_mlp_drops_the_mlp_hidden_activations():
    model = resolve_model(None, "llama-3-8b")
    training = TrainingSpec(seq_len=65536)
    plain = layout_activation_memory(model, training, Plan(stage=3, sp=4))
    tiled = layout_activation_memory(model, training, Plan(stage=3, sp=4, tiled_mlp=True))
    hidden = 4 * 2 * (65536 // 4) * model.ffn_size  # gate, up, SiLU(gate), product (bf16)
    assert plain.per_layer - tiled.per_layer == hidden
    # Backward rebuilds one tile of ceil(s_l / h) tiles and zeros x_grad.
    assert tiled.recompute_working_set == 2 * (65536 // 4) * model.hidden_size + -(-hidden // -(-(65536 // 4) // model.hidden_size))


def _cluster(gpus: int, gpu: str = "h100-80gb") -> ClusterSpec:
    return ClusterSpec(gpus=gpus, gpus_per_node=min(gpus, 8), gpu=load_gpu(gpu), cpu_memory_per_node_bytes=2048 * GiB)


def test_zero_partitions_over_world_over_tp():
    model = resolve_model(None, "llama-3-8b")
    training = TrainingSpec(seq_len=8192)
    dp = estimate_plan(model, _cluster(8), training, Plan(stage=1))
    sp = estimate_plan(model, _cluster(8), training, Plan(stage=1, sp=4))
    # Sequence-parallel ranks join ZeRO's group (DeepSpeed's seq_data_parallel_group): the same
    # optimizer partition as pure data parallelism on 8 ranks.
    assert sp.states.optimizer_states == dp.states.optimizer_states
    tp = estimate_plan(model, _cluster(8), training, Plan(stage=1, tp=2))
    per_rank = tensor_parallel_params(model, 2).per_rank
    assert tp.states.optimizer_states == 12 * -(-per_rank // 4)


def test_space_keeps_only_layouts_deepspeed_runs():
    model = resolve_model(None, "llama-3-8b")
    layouts = {(s, t): stages for s, t, stages in valid_layouts(model, _cluster(8), TrainingSpec(seq_len=131072), sp="auto", tp="auto")}
    assert {s for s, _ in layouts} == {1, 2, 4, 8}
    assert 3 not in layouts[(1, 2)]  # AutoTP trains with ZeRO 0-2
    assert (8, 2) not in layouts  # 16 ranks on 8 GPUs
    with pytest.raises(SpecError, match="does not divide by sp=8"):
        valid_layouts(model, _cluster(8), TrainingSpec(seq_len=1001), sp=(8,))
    with pytest.raises(SpecError, match="eager"):
        valid_layouts(model, _cluster(8), TrainingSpec(seq_len=1024, flash_attention=False), sp=(2,))
    six_kv_heads = replace(model, hidden_size=24 * 128, num_heads=24, num_kv_heads=6, name="24 heads, 6 KV heads")
    with pytest.raises(SpecError, match="one must divide the other"):
        valid_layouts(six_kv_heads, _cluster(8), TrainingSpec(seq_len=1024), sp=(4,))
    assert parse_degrees("--sp", "4,1,2") == (1, 2, 4) and parse_degrees("--sp", "auto") == "auto"
    with pytest.raises(SpecError, match="--tp"):
        parse_degrees("--tp", "two")


def test_global_batch_uses_the_data_parallel_degree():
    model = resolve_model(None, "llama-3-8b")
    plans = enumerate_plans(model, _cluster(8), TrainingSpec(seq_len=8192, global_batch=16), sp=(4,), stage=3, checkpointing="full")
    assert plans and all(p.micro_batch * p.gradient_accumulation_steps * p.data_parallel(8) == 16 for p in plans)


def test_estimate_finds_a_sequence_parallel_plan_for_128k():
    result = run_zeroplan("estimate", "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--seq-len", "131072", "--format", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    best = doc["plans"][0]
    assert best["fits"] and best["layout"]["sp"] > 1 and best["layout"]["dp"] * best["layout"]["sp"] == 8
    assert "--sp auto" in doc["layout_note"]
    plain = run_zeroplan("estimate", "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--seq-len", "131072", "--sp", "1", "--top", "1")
    assert plain.returncode == 1 and "--sp auto" in plain.stderr


def test_pure_data_parallel_json_has_its_layout():
    result = run_zeroplan("estimate", "--params", "1e9", "--gpus", "4", "--gpu", "a100-80gb", "--stage", "2", "--format", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert "layout_note" not in doc
    assert all(p["layout"] == {"dp": 4, "sp": 1, "tp": 1, "ep": 1, "cp": 1} and "sp" not in p for p in doc["plans"])


def test_exported_layout_keys_read_back_by_deepspeed_and_zeroplan(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    from zeroplan.dsconfig import build_config, plan_from_config
    from zeroplan.dsconfig.layout_keys import batch_world_size

    model = resolve_model(None, "llama-3-8b")
    for plan, world in ((Plan(stage=3, sp=8, micro_batch=1, gradient_accumulation_steps=2, checkpointing="full"), 8),
                        (Plan(stage=2, tp=2, micro_batch=2), 2)):
        cfg = build_config(plan, world_size=world, training=TrainingSpec(seq_len=65536), model=model)
        # DeepSpeed's reader with no process group: world 1, so the batch assertion passes only
        # where the batch world (GPUs/sp) is 1 here: sp=8 on 8 GPUs, and AutoTP's 2 GPUs are not.
        if batch_world_size(plan, world) == 1:
            ds = DeepSpeedConfig(cfg)
            assert ds.train_batch_size == plan.micro_batch * plan.gradient_accumulation_steps
        if plan.tp > 1:
            assert DeepSpeedConfig({**cfg, "train_batch_size": plan.micro_batch}).tensor_parallel_config.autotp_size == plan.tp
        back = plan_from_config(cfg, batch_world_size(plan, world))
        assert (back.sp, back.tp, back.micro_batch, back.gradient_accumulation_steps) == (plan.sp, plan.tp, plan.micro_batch, plan.gradient_accumulation_steps)


def test_accelerate_reads_the_exported_parallelism_config(tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from accelerate.utils.launch import prepare_extend_env_parallelism_config

    from zeroplan.dsconfig.layout_keys import parallelism_config

    ds, acc = tmp_path / "ds.json", tmp_path / "acc.yaml"
    result = run_zeroplan("export", "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--seq-len", "131072", "--stage", "3",
                          "--micro-batch", "1", "--sp", "8", "--checkpointing", "full", "--output", str(ds), "--accelerate-config", str(acc))
    assert result.returncode == 0, result.stderr
    assert json.loads(ds.read_text())["sequence_parallel_size"] == 8
    assert "pad_to_multiple_of=8" in result.stderr
    # accelerate launch's own path: the config file's entries become launch arguments, then the
    # PARALLELISM_CONFIG_* environment ParallelismConfig reads.
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(acc), "train.py"]))
    env = prepare_extend_env_parallelism_config(args, {})
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    pc = ParallelismConfig()
    assert (pc.sp_size, pc.sp_backend, pc.sp_handler.sp_seq_length) == (8, "deepspeed", 131072)
    # The Trainer's form: ParallelismConfig(sp_backend=..., sp_size=...) from the same arguments.
    args = parallelism_config(Plan(stage=3, sp=8), seq_len=131072)
    pc = ParallelismConfig(sp_backend=args["sp_backend"], sp_size=args["sp_size"], sp_handler=DeepSpeedSequenceParallelConfig(**args["sp_handler"]))
    assert pc.sp_enabled and pc.sp_size == 8


def test_tune_space_searches_layouts():
    from zeroplan.tuner.space import build_space

    model = resolve_model(None, "llama-3-8b")
    space = build_space(model, _cluster(8), TrainingSpec(seq_len=131072), checkpointing=("full",), micro_batches=(1,), sp="auto")
    assert "dp" in space.layout_choices and "sp8" in space.layout_choices
    best = space.fitting[0]
    assert best.plan.sp > 1 and best.params["layout"] == best.plan.layout_label
    assert space.plan_for(best.params) == best.plan


def test_validate_takes_the_layout_a_launcher_sets(tmp_path):
    from zeroplan.dsconfig import build_config

    cfg = build_config(Plan(stage=3, sp=8, checkpointing="full"), world_size=8, training=TrainingSpec(seq_len=65536))
    plain = {k: v for k, v in cfg.items() if k != "sequence_parallel_size"}  # accelerate's parallelism_config sets sp instead
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(plain))
    args = ("validate", str(path), "--model", "llama-3-8b", "--gpu", "h100-80gb", "--gpus", "8", "--seq-len", "65536", "--format", "json")
    result = run_zeroplan(*args, "--sp", "8")
    assert result.returncode == 0, result.stderr
    fit = next(f for f in json.loads(result.stdout) if f["rule_id"] == "ZP702")
    assert "z3/sp8/ckpt:full/mb1/ga1" in fit["message"]
    path.write_text(json.dumps(cfg))
    clash = run_zeroplan(*args, "--sp", "4")
    assert clash.returncode == 2 and "--sp 4 disagrees with the config's sequence_parallel_size 8" in clash.stderr
    assert len(clash.stderr.strip().splitlines()) == 1


def test_autotp_ranks_build_the_whole_model_before_it_is_sharded():
    # deepspeed.initialize shards a model every rank has built whole (AutoTP slices the built
    # weights), so the host's build phase holds the whole fp32 model per rank, the steady state one shard.
    model = resolve_model(None, "llama-3-8b")
    est = estimate_plan(model, _cluster(8), TrainingSpec(seq_len=4096), Plan(stage=2, tp=2), model_build="fp32")
    build = next(p for p in est.host_phases.phases if p.name == "model_build")
    assert build.per_rank["model_fp32"] == 4 * model.params
    assert est.states.params == 2 * tensor_parallel_params(model, 2).per_rank


def test_sequence_parallel_lora_keeps_the_frozen_base_terms():
    # At sp=1 the layout path and the plain formula agree term for term, LoRA's frozen base included.
    from zeroplan.estimator import activation_memory
    from zeroplan.cli.common import with_peft

    model = with_peft(resolve_model(None, "llama-3-8b"), "llama-3-8b", precision="bf16", lora_rank=16, lora_targets="all-linear",
                      lora_alpha=None, adapter=None, trainable_params=None, base_quant=None)
    training = TrainingSpec(seq_len=32768)
    plain = activation_memory(model, replace(training, seq_len=32768 // 4), Plan(stage=2))
    layout = layout_activation_memory(model, training, Plan(stage=2, sp=4))
    gathered = 2 * (32768 // 4) * model.hidden_size
    assert layout.per_layer == plain.per_layer + gathered


@pytest.mark.parametrize("args, says", [
    (["--stage", "3", "--micro-batch", "1", "--tp", "2"], "tp=2 with ZeRO-3"),
    (["--stage", "2", "--micro-batch", "1", "--sp", "3"], "does not divide 8 GPUs"),
    (["--stage", "2", "--micro-batch", "1", "--sp", "3", "--model", "llama-3-8b"], "does not divide 8 GPUs"),
])
def test_explicit_export_refuses_a_layout_the_space_refuses(tmp_path, args, says):
    # An explicit plan passes the same layout rules the plan space enumerates by: one line, exit 2,
    # nothing written (it used to write nothing and end in a RuntimeError traceback).
    out = tmp_path / "ds.json"
    r = run_zeroplan("export", "--gpus", "8", *args, "-o", str(out))
    assert r.returncode == 2 and "Traceback" not in r.stderr and says in r.stderr, r.stderr
    assert not out.exists()
