"""Bucket conventions against DeepSpeed's own defaults; the loss term against a measured backward."""

from __future__ import annotations


import pytest

from zeroplan.estimator.activations import loss_activation_bytes
from zeroplan.estimator.plans import bucket_sizes
from zeroplan.spec import ModelSpec, SpecError

from helpers import benchmark, run_zeroplan


def test_deepspeed_convention_is_deepspeeds_own_defaults():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ds = DeepSpeedZeroConfig()
    assert bucket_sizes("deepspeed") == {
        "reduce_bucket_size": ds.reduce_bucket_size,
        "allgather_bucket_size": ds.allgather_bucket_size,
        "stage3_prefetch_bucket_size": ds.prefetch_bucket_size,
    }
    assert bucket_sizes("hf") == {}
    assert bucket_sizes("deepspeed", reduce_bucket_size=1000)["reduce_bucket_size"] == 1000


def test_bucket_size_must_be_positive():
    with pytest.raises(SpecError, match="reduce_bucket_size=0"):
        bucket_sizes("hf", reduce_bucket_size=0)
    for flag in ("--reduce-bucket-size", "--allgather-bucket-size", "--prefetch-bucket-size"):
        r = run_zeroplan("estimate", "--params", "1e9", flag, "-5", columns=200)
        assert r.returncode == 2 and f"{flag} -5 is not valid" in r.stderr and "Traceback" not in r.stderr


def test_plain_loss_matches_cross_entropy_backward():
    """F.cross_entropy(logits.float(), y): what is alive at its backward beyond the bf16 logits."""
    import torch
    import torch.nn.functional as F

    from zeroplan.runtime.measure.memory import StorageTracker

    n, v = 256, 1024
    model = ModelSpec(name="t", params=10**6, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=4, ffn_size=256, vocab_size=v)
    logits = torch.randn(n, v, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, v, (n,))
    with StorageTracker() as tracker:
        tracker.track(logits, y)
        base = tracker.current_bytes
        loss = F.cross_entropy(logits.float(), y)
        tracker.reset_peak()
        loss.backward()
        peak = tracker.peak_bytes - base
    predicted = loss_activation_bytes(model, seq_len=n, micro_batch=1, precision="bf16", loss="plain")
    # The 12·N·V of three fp32 arrays; the 2-byte gradient handed back to the logits comes after
    # the fp32 ones are freed but one: 4 + 2 < 12.
    assert abs(peak - sum(predicted.values())) <= 0.01 * peak


def test_loss_choices_order():
    model = ModelSpec(name="llama-like", params=8 * 10**9, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                      ffn_size=14336, vocab_size=128256, tied_embeddings=False, gated_mlp=True)
    total = {loss: sum(loss_activation_bytes(model, seq_len=8192, micro_batch=1, precision="bf16", loss=loss).values())
             for loss in ("hf", "plain", "megatron", "fused", "chunked")}
    # Llama-3 at s = 8192: 14.7 GB per sample in Hugging Face's loss (docs/estimate.md).
    assert total["hf"] == 14 * 8192 * 128256
    # Eager chunked cross-entropy keeps every chunk's fp32 log-softmax until backward: more than
    # Megatron's in-place softmax, less than one full fp32 upcast (benchmarks/results/loss_memory.txt).
    assert total["fused"] < total["megatron"] < total["chunked"] < total["plain"] < total["hf"]


@pytest.mark.slow  # inductor compiles two graphs on CPU: 20-30 s on 2 busy cores
def test_compiled_chunked_loss_matches_measurement():
    """The compiled chunked loss's term against its CPU measurement (benchmarks/compiled_loss_memory.py:
    inductor's saved tensors and the allocator's peak, independent of the formula)."""
    pytest.importorskip("torch")
    measure = benchmark("compiled_loss_memory").measure
    model = ModelSpec(name="x", params=10**6, hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=4, ffn_size=1024,
                      vocab_size=8000, tied_embeddings=True, gated_mlp=True)
    n, v = 256, 8000
    saved = {}
    for loss, compiled in (("chunked", False), ("chunked-compiled", True)):
        r = measure(compiled, b=1, s=n, v=v)
        predicted = sum(loss_activation_bytes(model, seq_len=n, micro_batch=1, precision="bf16", loss=loss).values())
        assert abs(predicted - r["peak_bytes"]) <= 0.01 * r["peak_bytes"], (loss, predicted, r)
        saved[loss] = r["saved_bytes"]
    # Eager autograd saves each chunk's fp32 log-softmax (4·N·V); the compiled graph the chunk's
    # own bf16 logits (2·N·V) and row statistics (the labels and two fp32 vectors: under 1 %).
    assert 4 * n * v <= saved["chunked"] <= 1.01 * 4 * n * v
    assert 2 * n * v <= saved["chunked-compiled"] <= 1.01 * 2 * n * v
