"""The estimator against training runs reported in public (benchmarks/public_runs.json).

Every published peak-memory figure is checked in one of three ways: within a stated tolerance
where zeroplan can express the run's setting; on the side an unmodelled mechanism predicts where
the run relies on one; in a band around today's error where the cause is not pinned down. And the
verdict (fits / tight / oom) of every run: it may be tight, or agree with the report, unless its
disagreement is listed below. The split into a tuning and a held-out half is by source, and the
tight margin is the one the tuning half chooses.
The allocator-reserve model (zeroplan.estimator.allocator) is checked as a pure function.
"""

from __future__ import annotations

import importlib.util

import pytest

from zeroplan.estimator.activations import ActivationMemory
from zeroplan.estimator.allocator import ROUND_LARGE_BYTES, allocator_reserve

from helpers import ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("bench_public_runs", ROOT / "benchmarks" / "bench_public_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _bench()
ROWS = {row["id"]: row for row in BENCH.load_rows()}
RESULTS = {r["id"]: r for r in BENCH.evaluate(list(ROWS.values()))}

#: Published peaks of runs whose setting the estimator can express, each with its source (also in
#: the table's `source` column) and the tolerance on (estimate − reported) / reported.
GOLDEN_PEAKS = {
    # torchtitan docs/performance.md (d4c86e375) Table 3: Llama 3.1 8B on 128 H100, FSDP, local batch
    # 2, selective AC: 67.0 GiB reserved; multinode_trainer.slurm sets no allocator option (off).
    "torchtitan-llama3.1-8b-h100x128": 0.10,
    # huggingface/peft README: bloomz-7b1 LoRA in plain PyTorch on one A100 80GB: 32 GB.
    "peft-bloomz-7b1-lora": 0.10,
    # Same table: T0_3B LoRA in plain PyTorch, 14.4 GB. ±15 %: the sequence length is assumed (tweets
    # padded per batch) and T5's decoder is counted at the encoder's length; the fp32 base (10.4 GiB)
    # is most of the peak.
    "peft-t0-3b-lora": 0.15,
    # Same table: mt0-xxl LoRA in plain PyTorch, 56 GB. ±15 %: as T0_3B, and zeroplan counts T5's
    # head as tied (transformers 5 ties it) where mT5's untied head holds 3.8 GiB more (-7 %).
    "peft-mt0-xxl-lora": 0.15,
    # Same table: T0_3B full fine-tune in plain PyTorch, 47.14 GB: one process, no DDP (no reducer
    # buckets at world size 1; charging them read +18 %).
    "peft-t0-3b-full": 0.10,
    # torchtune README (fef3ed1), Llama-7B peak memory per GPU, dtype bf16 (precision bf16-pure).
    # ±15 %: sequence length and the reported kind are assumed (the rows' notes).
    # 1 x RTX 4090, LoRA single device: 17.18 GB.
    "torchtune-llama2-7b-lora-1x4090": 0.15,
    # 4 x RTX 4090, full fine-tune, FSDP: 22.9 GB.
    "torchtune-llama2-7b-full-4x4090": 0.15,
    # torchtune README (1814feb), Llama 3.2 3B packed to 4096, full fine-tune, no AC: 60.0 GiB active.
    "torchtune-llama3.2-3b-full-packed-a100": 0.15,
    # litgpt tutorials/resource-tables.md (4839345), LoRA over Fabric's FSDP (FSDP1 per Block,
    # use_orig_params; engine fsdp1), max_memory_allocated: 7B on 2 A100 mb4, 23.39 GB; 13B on 4
    # A100 mb1, 35.57 GB (-56 % and -74 % under FSDP2's model, which gives frozen weights no gradient).
    "litgpt-llama2-7b-lora-fsdp-mb4-2xa100-40g": 0.10,
    "litgpt-llama2-13b-lora-fsdp-mb1-4xa100-40g": 0.10,
    # Same table, LoRA and QLoRA with compile (loss chunked-compiled) and activation offloading
    # (cpu_checkpointing): 8.5 and 4.6 GiB active. Compile of each block is not modelled (it
    # lowers the real figure).
    "torchtune-llama3.2-3b-lora-a100": 0.15,
    "torchtune-llama3.2-3b-qlora-a100": 0.15,
    # torchtune README (fef3ed1), 1 x RTX 4090, full fine-tune with bitsandbytes' PagedAdamW stepped
    # in backward (optimizer_impl bnb-paged, optimizer_in_backward): 14.97 GB.
    "torchtune-llama2-7b-full-lowmem-1x4090": 0.15,
}

#: Published peaks the estimate misses for causes not pinned down (each row's note lists the
#: suspects). Held in a band around today's error, so that a change that moves them is seen and
#: the note revisited; not a claim of accuracy.
UNEXPLAINED_PEAKS = {
    # DeepSpeed ZeRO-3 with CPU-offloaded fp32 parameters on one GPU (PEFT README, Dec 2022):
    # today -11 %, -32 %, -50 % (-15 %, -36 %, -50 % before the RMSNorm terms). Suspects: the figure may be the eval loop's (generate under
    # ZeRO-3 gathers every block per token), or DeepSpeed 0.7 held more gathered parameters than
    # the stage3_max_live_parameters bound the estimate counts.
    "peft-t0-3b-lora-ds-z3-offload": (-0.30, 0.0),
    "peft-mt0-xxl-lora-ds-z3-offload": (-0.50, -0.20),
    "peft-bloomz-7b1-lora-ds-z3-offload": (-0.65, -0.35),
    # torchtune's max_memory_reserved keeps what model building and loading cached (reserved
    # memory never shrinks without empty_cache); today -37 % (QLoRA, 1 GPU) and -35 % (LoRA, FSDP
    # over 2 GPUs, where rank 0 builds the whole bf16 model, 12.6 GiB, on its GPU before FSDP
    # shards it).
    "torchtune-llama2-7b-qlora-1x4090": (-0.45, -0.25),
    "torchtune-llama2-7b-lora-2x4090": (-0.50, -0.30),
    # torchtitan Table 1 (8 H100, 82.4 GiB reserved) and Table 2 (32k tokens, full AC, 83.9 GiB),
    # launched by the single-node script that sets expandable_segments at the cited commits:
    # today -19 % and -20 %. Suspects: what torchtitan's loss keeps over a 128k vocabulary in fp32
    # beyond the "plain" loss's terms, and (Table 2) float8 and compile, which lower the real figure.
    "torchtitan-llama3.1-8b-h100x8": (-0.25, -0.12),
    "torchtitan-llama3.1-8b-h100x8-seq32k": (-0.26, -0.13),
    # The same table's context-parallel rows (CP 2/4/8 at 64K/128K/256K: 84.2, 84.0, 84.5 GiB) hold
    # 32K tokens per rank as the 32K row does, and read the same error (-19.4, -19.2, -19.7 %): the
    # peak is the loss's backward over the rank's tokens at every cp; the ring's backward buffers
    # (zeroplan.estimator.context_parallel) sit in a block's backward, 5.7-8.7 GiB below it.
    "torchtitan-llama3.1-8b-h100x8-cp2-seq64k": (-0.26, -0.13),
    "torchtitan-llama3.1-8b-h100x8-cp4-seq128k": (-0.26, -0.13),
    "torchtitan-llama3.1-8b-h100x8-cp8-seq256k": (-0.26, -0.13),
}

#: Published peaks of the rows added with the split (benchmarks/public_runs.json, 2026-12), none
#: examined for causes yet: held in a band of ±10 points around today's error so that a change
#: that moves them shows here. Not a claim of accuracy (the benchmark reports their errors).
NEW_ROW_PEAK_BANDS = {
    # today -3.8% (+14.1% while torch's per-parameter foreach square roots counted as stranded at stage 0)
    "swift-qwen2-7b-full-1gpu": (-0.14, +0.06),
    "swift-qwen2-7b-lora-ddp-2gpu": (-0.49, -0.29),  # today -38.8%
    "swift-qwen2-7b-lora-z2-2gpu": (-0.19, +0.01),  # today -9.2%
    "swift-qwen2-7b-lora-z3-2gpu": (-0.41, -0.21),  # today -31.2%
    "litgpt-llama2-7b-lora-mb1-1xa100-40g": (-0.18, +0.02),  # today -7.8% (was -14.3% before the RMSNorm terms)
    "litgpt-llama2-7b-lora-mb2-1xa100-40g": (-0.21, -0.01),  # today -11.4% (was -20.9% before the RMSNorm terms)
    "litgpt-llama2-7b-qlora-nf4-mb1-1xa100-40g": (-0.38, -0.18),  # today -28.5% (was -38.3% before the RMSNorm terms)
    "litgpt-llama2-13b-lora-mb1-1xa100-40g": (-0.17, +0.03),  # today -6.8% (was -12.5% before the RMSNorm terms)
    "peft-docs-llama2-70b-lora-z3-8xh100": (-0.29, -0.09),  # today -18.8% (was -21.8% before the RMSNorm terms)
    "peft-docs-llama2-70b-qlora-z3-2x40gb": (-0.33, -0.13),  # today -23.5% (was -24.8% before the RMSNorm terms)
    "peft-docs-llama2-70b-qlora-fsdp-offload-2x24gb": (-0.42, -0.22),  # today -32.4% (was -35.6% before the RMSNorm terms)
    "swift-bench-yi-34b-lora-512-1xa100": (-0.10, +0.10),  # today -0.3%
    "swift-bench-yi-34b-lora-1024-1xa100": (-0.12, +0.08),  # today -2.2%
    "swift-bench-yi-34b-lora-2048-1xa100": (-0.12, +0.08),  # today -2.2%
    "swift-bench-yi-34b-lora-4096-1xa100": (-0.16, +0.04),  # today -5.9%
    "swift-bench-yi-6b-lora-2048-1xa100": (-0.20, -0.00),  # today -10.4%
    "swift-bench-yi-6b-lora-4096-1xa100": (-0.45, -0.25),  # today -34.9%
    "swift-bench-yi-6b-lora-8192-1xa100": (-0.54, -0.34),  # today -43.5%
    # gpt-oss-20b LoRA on one GPU (mixture-of-experts rows of December 2026): axolotl's README,
    # ~44 GiB device_mem_reserved, today +6.1%; ms-swift's example script, 42GB at max_length
    # 2048 with shorter samples (the estimate at 2048 is an upper bound), today +14.8%.
    "axolotl-gpt-oss-20b-lora-1x48gb": (-0.04, +0.16),
    "swift-5277-gpt-oss-20b-lora-1gpu": (+0.05, +0.25),
}

#: Runs whose verdict contradicts the report today (fits called oom, or OOM called fits), and why
#: (docs/estimate.md, "Held against public runs"). Each must still disagree: a fix shows here.
KNOWN_DISAGREEMENTS = {
    # Reported OOM, estimated 14.8 of 24 GiB: where in the run it failed (evaluation, saving,
    # loading under zero.Init) is not said.
    "lf-5070-qwen2.5-7b-lora-z3-2x4090",
    # Reported OOM (8 A800, ZeRO-3, batch 1, lengths under 2048), estimated 68.9 of 80 GiB: 13.9 %
    # headroom, tight at the 14 % margin and fits at 12 %, the margin the tuning half's sweep picks
    # once the December MoE rows are in (2 of its 20 OOMs called fits, the rule's 1 in 10).
    "deepseek-coder-33b-z3-8xa800",
    # (Held-out rows that agree now: litgpt's 13B LoRA over FSDP on 2 A100, OOM, reads oom with
    # FSDP1's whole-block gradients, zeroplan.estimator.fsdp1; the two single-GPU litgpt LoRA OOMs
    # at micro-batch 4 read tight since the RMSNorms' fp32 inputs are counted,
    # zeroplan.estimator.norms; the host OOM under ZeRO-3 offload on one H100, at 99 % of 744 GiB
    # since ZeRO-3's per-parameter pinned partitions are, zeroplan.estimator.host.zero3_pinned_param_blocks.)
    # (The Hugging Face Ulysses blog's 128K row, reported OOM, reads oom, 80.7 of 79.6 GiB, with what
    # the blog's documented launch runs: no optimizer offload, test_blog_launch_runs_no_optimizer_offload
    # below; it read fits, 67.6 GiB, with the offload its text states.)
    # ms-swift#6473: Qwen3-30B-A3B full SFT under ZeRO-2 with optimizer offload on 8 H200 and 1.5 TB
    # of host RAM; training and validation ran, the host ran out at the final save. Estimated: host
    # 1,099 GiB per node of 1,397 at its worst phase, the save: the step's 644 GiB (ZeRO-2's offload
    # accumulation buffers at swift's default two micro-steps included) plus every rank's
    # copy of the bf16 model that the Trainer's save_model takes through accelerate's get_state_dict
    # (zeroplan.estimator.host_save; DeepSpeed's ZeRO-2 state_dict itself returns views). GPU 63 of
    # 140 GiB. What the save allocates beyond that is not found in the sources read.
    "swift-6473-qwen3-30b-a3b-full-z2-offload-8xh200",
}


def test_table_has_sources_and_settings():
    assert len(ROWS) >= 37
    for row in ROWS.values():
        assert row["source"].startswith("https://"), row["id"]
        assert row["outcome"] in ("fits", "oom"), row["id"]
        assert ("model" in row) != ("hf_config" in row), row["id"]
        if "reported_peak_gib" in row:
            assert row["reported_kind"] in ("reserved", "allocated", "nvidia-smi"), row["id"]
    published = {i for i, r in ROWS.items() if "reported_peak_gib" in r}
    groups = (set(GOLDEN_PEAKS), set(UNEXPLAINED_PEAKS), set(NEW_ROW_PEAK_BANDS))
    # Every published peak is checked, in exactly one way.
    assert set.union(*groups) == published
    assert sum(map(len, groups)) == len(published)
    assert KNOWN_DISAGREEMENTS <= set(ROWS)


@pytest.mark.parametrize("run", sorted(GOLDEN_PEAKS))
def test_published_peak_within_tolerance(run):
    assert abs(RESULTS[run]["peak_error"]) <= GOLDEN_PEAKS[run], _peak_message(run)


def _peak_message(run: str) -> str:
    result = RESULTS[run]
    return (
        f"{run}: estimated {result['predicted_peak'] / 2**30:.1f} GiB vs reported {result['reported_peak'] / 2**30:.1f} GiB "
        f"({result['peak_error']:+.1%})"
    )


@pytest.mark.parametrize("run", sorted({**UNEXPLAINED_PEAKS, **NEW_ROW_PEAK_BANDS}))
def test_unexplained_peak_in_its_band(run):
    low, high = {**UNEXPLAINED_PEAKS, **NEW_ROW_PEAK_BANDS}[run]
    assert low <= RESULTS[run]["peak_error"] <= high, _peak_message(run)


def _contradicts(run: str) -> bool:
    verdict = RESULTS[run]["verdict"]
    return verdict != "tight" and (verdict == "fits") != (ROWS[run]["outcome"] == "fits")


@pytest.mark.parametrize("run", sorted(set(ROWS) - KNOWN_DISAGREEMENTS))
def test_verdict_does_not_contradict_the_report(run):
    result = RESULTS[run]
    assert not _contradicts(run), (
        f"{run}: verdict {result['verdict']} ({result['gpu_required'] / 2**30:.1f} GiB of {result['gpu_memory'] / 2**30:.1f}), "
        f"the source says {ROWS[run]['outcome']}"
    )


@pytest.mark.parametrize("run", sorted(KNOWN_DISAGREEMENTS))
def test_known_disagreements_still_disagree(run):
    assert _contradicts(run), f"{run} no longer contradicts its report: take it out of KNOWN_DISAGREEMENTS"


def test_split_by_source_and_margin_from_the_tuning_half():
    from zeroplan.estimator.verdict import TIGHT_MARGIN

    halves: dict[str, set] = {}
    for row in ROWS.values():
        assert row["split"] in ("tuning", "heldout"), row["id"]
        halves.setdefault(row["split_group"], set()).add(row["split"])
    # All rows of one source in one half.
    assert all(len(h) == 1 for h in halves.values()), {g: h for g, h in halves.items() if len(h) > 1}
    results = list(RESULTS.values())
    tuning = [r for r in results if r["split"] == "tuning"]
    chosen, _ = BENCH.choose_margin(tuning)
    assert chosen == TIGHT_MARGIN
    with pytest.raises(ValueError, match="tuning rows only"):
        BENCH.choose_margin(results)
    # The summary's confusion matrix accounts for every row of each half.
    for half in ("tuning", "heldout"):
        s = BENCH.summary([r for r in results if r["split"] == half])
        assert sum(c for row in s["matrix"].values() for c in row.values()) == s["rows"] > 30


def test_cached_segments_do_not_decide_an_oom():
    # The ZeRO-Offload tutorial trains the 10B GPT-2 on one 32 GB V100: 28.8 GiB allocated at the
    # last block's rebuild + 1 GiB CUDA context fit its 31.7 GiB; the rebuild's 2.9 GiB stranded
    # segments push the reserved peak to 32.7 GiB, but CUDACachingAllocator::malloc frees cached
    # unsplit segments (release_cached_blocks) and retries before it raises an OOM.
    for run in ("ds-tutorial-gpt2-10b-offload-1gpu",):  # (torchtitan's 32k row now runs with expandable segments)
        result = RESULTS[run]
        assert result["gpu_total"] > result["gpu_memory"] >= result["gpu_required"], run
        assert result["fits"], run
        assert any("caching allocator frees those cached segments" in n for n in result["notes"]), run


def test_allocator_reserve_by_mechanism():
    reserve = allocator_reserve(transients={"loss_gradients": 8 * 2**30, "bucket": 2**30}, live_large_tensors=100)
    assert reserve.block_rounding == 100 * ROUND_LARGE_BYTES // 2
    assert reserve.stranded_transients == 9 * 2**30
    assert reserve.largest_transient == 8 * 2**30
    assert reserve.total == reserve.block_rounding + reserve.stranded_transients
    # A failing malloc frees the cached unsplit segments; the round-up tails inside live blocks stay.
    assert reserve.held == reserve.block_rounding
    # expandable_segments grow segments in place: nothing is stranded, the page rounding stays.
    expandable = allocator_reserve(transients={"loss_gradients": 8 * 2**30}, live_large_tensors=100, expandable_segments=True)
    assert expandable.stranded_transients == 0 and expandable.block_rounding == reserve.block_rounding
    with pytest.raises(ValueError):
        allocator_reserve(transients={"x": -1}, live_large_tensors=0)


def test_loss_and_block_rebuild_are_not_alive_together():
    acts = ActivationMemory(per_layer=1, layers=10, recompute_working_set=5, embeddings=1, logits=8, on_cpu=0, logits_held=2)
    assert acts.total == 24
    assert acts.backward_peak == 19  # the loss's moment: 10 + 1 + 8 > 10 + 1 + 5 + 2
    rebuild = ActivationMemory(per_layer=1, layers=10, recompute_working_set=9, embeddings=1, logits=8, on_cpu=0, logits_held=2)
    assert rebuild.backward_peak == 22 and not rebuild.peak_at_loss


def test_host_ram_of_an_fsdp_load_on_rank0():
    # The Hugging Face Llama 2 70B FSDP run (2 nodes × 8 A100, 1 TB RAM per node) loads on rank 0
    # and builds on the meta device elsewhere (the blog's "Challenge 1": 70·4·8 GB ≈ 2 TB per node
    # if every rank loaded the model). The estimate's default for fsdp is that rank-0 load.
    result = RESULTS["hfblog-llama2-70b-full-fsdp-16xa100"]
    assert result["cpu_memory"] == 1000 * 2**30
    # The rank-0 load (~140 GB) plus, since the run's paged AdamW is modelled (bnb-paged), the
    # states bitsandbytes keeps in unified memory, which host RAM backs when they are paged out:
    # 8 ranks × 8 B × 69e9 / 16 ≈ 276 GB. Every rank loading in fp32 would need ~2 TB.
    assert result["cpu_per_node"] < 0.3 * result["cpu_memory"]


def test_blog_launch_runs_no_optimizer_offload(tmp_path):
    """The Ulysses blog rows' offload_optimizer 'none' is what accelerate's own launch code makes of
    the blog's accelerate config, printed or with its Best Practices' nested ZeRO snippet
    (benchmarks/blog_accelerate_offload.py); accelerate's own spelling turns the offload on."""
    spec = importlib.util.spec_from_file_location("blog_accelerate_offload", ROOT / "benchmarks" / "blog_accelerate_offload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    devices = {}
    for name, extra in module.FORMS.items():
        exported, config = module.deepspeed_config_for(module.BLOG_YAML.format(extra=extra), tmp_path)
        devices[name] = config["zero_optimization"]["offload_optimizer"]["device"]
        assert config["zero_optimization"]["stage"] == 3
    assert list(devices.values()) == ["none", "none", "cpu"], devices
    blog = [row for row in ROWS.values() if row["split_group"] == "https://huggingface.co/blog/ulysses-sp"]
    assert len(blog) == 6 and {row["offload_optimizer"] for row in blog} == {"none"}
    assert all("CPU optimizer offloading" in row["says"] for row in blog)
