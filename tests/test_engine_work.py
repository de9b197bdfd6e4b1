"""DeepSpeed's per-step bookkeeping (zeroplan.estimator.engine_work) against real models and engines.

Truth: the parameter tensors and modules transformers builds for a Llama config (meta device, so
instant), DeepSpeed's own persistence rule applied to them, and the collective calls a real
DeepSpeed 0.19 engine issued per optimizer step (benchmarks/engine_collectives.py, recorded in
benchmarks/results/engine_work.txt; re-measured by the e2e test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zeroplan.estimator.engine_work import bucket_flushes, engine_work, parameter_tensors, stage3_gathers
from zeroplan.profiles import model_from_hf_config
from zeroplan.spec import ModelSpec, Plan

from helpers import ROOT, example
LLAMA = dict(model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def test_parameter_tensors_match_a_real_llama(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    data = dict(LLAMA)
    hf_config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    spec = model_from_hf_config(path)
    threshold = 10 * spec.hidden_size  # the persistence threshold zeroplan's configs set (10·h)
    counted = parameter_tensors(spec, persistence_threshold=threshold)
    params = list(model.parameters())
    holders = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    assert counted.tensors == len(params) == counted.trainable_tensors
    assert counted.modules == len(holders)
    # DeepSpeed keeps whole every parameter of at most the threshold (zero/parameter_offload.py).
    assert counted.persistent_tensors == sum(p.numel() <= threshold for p in params)
    assert counted.gathered_modules == sum(any(p.numel() > threshold for p in m.parameters(recurse=False)) for m in holders)
    assert sorted(counted.trainable_sizes) == sorted(p.numel() for p in params)


def test_bucket_flushes_follow_deepspeeds_overflow_rule():
    # In hook order: 30, 30 fill 60 ≤ 64; 10 would overflow → flush; 10 + 50 = 60; 100 > 64 on its
    # own after a flush; end → flush.
    assert bucket_flushes((30, 30, 10, 50, 100), 64) == 3
    assert bucket_flushes((5, 5, 5), 1_000) == 1
    assert bucket_flushes((), 10) == 0


# Collective calls per optimizer step of the example GPT on 2 ranks, micro-batch 2, by (stage, accumulation),
# counted on DeepSpeed 0.19.8 (benchmarks/results/engine_work.txt).
MEASURED = {(0, 1): 1, (0, 2): 1, (1, 1): 23, (1, 2): 23, (2, 1): 23, (2, 2): 43, (3, 1): 48, (3, 2): 77}
#: The example GPT's ModelSpec, as its task declares it (examples/gpt_task.py model_spec): q, k and v
#: fused into one linear, 4096 parameters (the position table) the shape does not name.
GPT = ModelSpec(name="gpt_task L2 h64", params=136_960, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                ffn_size=256, vocab_size=512, tied_embeddings=True, fused_qkv=True)


@pytest.mark.parametrize("stage, accumulation", sorted(MEASURED))
def test_collective_counts_equal_a_real_engines(stage, accumulation):
    # Stages 1-2 reduce 19 buckets per backward, plus one all-reduce because blocks.0.fc.weight
    # (16384 elements, over the 4096 bucket) spans both ranks' partitions with 14720 on the first.
    work = engine_work(GPT, Plan(stage=stage, micro_batch=2, gradient_accumulation_steps=accumulation), world_size=2, precision="bf16")
    assert work.collectives == MEASURED[(stage, accumulation)]
    if stage >= 1:
        assert work.hooks > 0 and work.copied_bytes > 0


def test_parameter_tensors_follow_the_example_gpts_buffer_and_hook_order():
    # Truth: the real module's parameters (DeepSpeed's flat-buffer order) and the order autograd runs
    # their post-accumulate-grad hooks (DeepSpeed's register_grad_hook) in one backward.
    torch = pytest.importorskip("torch")
    gpt_task = example("gpt_task")
    TorchGPT, GPTConfig = gpt_task.GPT, gpt_task.GPTConfig

    model = TorchGPT(GPTConfig())
    fired = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p.numel()))
    tokens = torch.randint(0, GPTConfig().vocab, (1, GPTConfig().seq_len))
    model(tokens).sum().backward()
    counted = parameter_tensors(GPT, persistence_threshold=640)
    assert counted.trainable_sizes == tuple(p.numel() for p in model.parameters())
    assert counted.gradient_order == tuple(fired)
    assert counted.persistent_tensors == sum(p.numel() <= 640 for p in model.parameters())


def test_parameter_tensors_match_a_real_fused_gpt2():
    # transformers' GPT-2 (Conv1D c_attn: one h×3h weight), on the meta device; its position table
    # wpe is what the shape does not name.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = dict(model_type="gpt2", vocab_size=320, n_positions=48, n_embd=64, n_layer=2, n_head=4)
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    spec = ModelSpec(name="gpt2 tiny", params=sum(p.numel() for p in model.parameters()), hidden_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=4, ffn_size=256, vocab_size=320, tied_embeddings=True, fused_qkv=True)
    counted = parameter_tensors(spec, persistence_threshold=640)
    assert counted.trainable_sizes == tuple(p.numel() for p in model.parameters())
    holders = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    assert counted.modules == len(holders)


def test_stage3_count_within_ten_percent_of_the_engine():
    # Stage 3 used to count every gathered module again in backward (107 against 77); DeepSpeed
    # keeps a parameter whose next use is within stage3_max_reuse_distance (1e9) and gathers once.
    work = engine_work(GPT, Plan(stage=3, micro_batch=2, gradient_accumulation_steps=2), world_size=2, precision="bf16")
    assert abs(work.collectives - MEASURED[(3, 2)]) <= 0.1 * MEASURED[(3, 2)], work.collectives
    assert work.stage3_regathered_fraction == 0.0


def _example_gpt_trace(threshold: int) -> tuple:
    """The modules of the example GPT that ZeRO-3's hooks visit in forward and in backward (the
    model, then pre-order; backward in reverse with each block before its children), each as its
    parameters above ``threshold``."""
    torch = pytest.importorskip("torch")
    gpt_task = example("gpt_task")
    TorchGPT, GPTConfig = gpt_task.GPT, gpt_task.GPTConfig

    with torch.device("meta"):
        model = TorchGPT(GPTConfig())

    def own(m):
        return tuple((f"p{id(t)}", t.numel()) for t in m.parameters(recurse=False) if t.numel() > threshold)

    m = model
    leaves = [m.tok, m.pos] + [x for b in m.blocks for x in (b, b.ln1, b.qkv, b.proj, b.ln2, b.fc, b.out)] + [m.ln_f, m.head]
    back = [m.head, m.ln_f] + [x for b in reversed(m.blocks) for x in (b, b.out, b.fc, b.ln2, b.proj, b.qkv, b.ln1)] + [m.pos, m.tok]
    return tuple(own(x) for x in [m] + leaves), tuple(own(x) for x in [m] + back)


@pytest.mark.parametrize("reuse, forward_calls", [(1_000_000_000, 10), (0, 16)])
def test_stage3_replay_matches_the_engines_gathers(reuse, forward_calls):
    # benchmarks/engine_collectives.py --stage 3 --accumulation 2 [--max-reuse-distance 0]
    # (DeepSpeed 0.19.8, 2 CPU ranks, zeroplan's config: prefetch 3686, persistence 640): 38 and 50
    # all-gathers per step, 18 of them the persistent parameters' re-gathers after the step, the
    # others all issued during forward (20 and 32; none during engine.backward).
    gathers = stage3_gathers(*_example_gpt_trace(640), prefetch_bucket=3686, max_reuse_distance=reuse)
    assert (gathers.forward_calls, gathers.backward_calls) == (forward_calls, 0)


def test_stage3_reuse_distance_rule():
    # partitioned_param_coordinator.py __params_to_release: a module's parameters are released
    # unless used again within max_reuse_distance elements; without prefetching (bucket 0) every
    # module then gathers in forward and, released, again in backward.
    mods = tuple(((f"m{i}", 100),) for i in range(4))
    back = mods[::-1]
    kept = stage3_gathers(mods, back, prefetch_bucket=0, max_reuse_distance=10**9)
    released = stage3_gathers(mods, back, prefetch_bucket=0, max_reuse_distance=1)
    assert (kept.forward_calls, kept.backward_calls, kept.regathered_elements) == (4, 0, 0)
    # The last module is used again at once in backward (nothing walked in between): kept.
    assert (released.forward_calls, released.backward_calls, released.regathered_elements) == (4, 3, 300)
    # A bucket of 300 elements takes the next three modules in one prefetch: 2 calls.
    assert stage3_gathers(mods, back, prefetch_bucket=300, max_reuse_distance=10**9).forward_calls == 2


@pytest.mark.e2e
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_collective_counts_measured_now(stage):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(29650 + stage),
         str(ROOT / "benchmarks" / "engine_collectives.py"), "--stage", str(stage), "--micro-batch", "2", "--accumulation", "2"],
        capture_output=True, text=True, env=env, timeout=600, check=True,
    ).stdout
    row = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert row["measured_total"] == MEASURED[(stage, 2)]
