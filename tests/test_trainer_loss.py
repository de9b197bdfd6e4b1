"""What the Hugging Face Trainer's training step holds at the loss, against the `--loss` terms.

transformers 5.x ``Trainer.training_step`` calls ``compute_loss(model, inputs)`` without
``return_outputs`` and back-propagates the returned loss (trainer.py ``training_step``; in
5.24.0 lines 2089-2126), so the model's output object, and the 16-bit logits in it, are gone
before backward: the step holds ``--loss plain``'s 12·N·V, not ``hf``'s (12 + e)·N·V. TRL 0.29's
``SFTTrainer.compute_loss`` (trl/trainer/sft_trainer.py:1182-1310 at v0.29.0) does the same —
its entropy and token-accuracy metrics run under ``no_grad`` over the held logits, 128 rows at a
time, before it returns the loss alone — measured by the same benchmark on that tag's source:
12.00 (benchmarks/results/trainer_loss.txt).
"""

from __future__ import annotations

import pytest

from helpers import benchmark
from zeroplan.estimator.activations import loss_activation_bytes
from zeroplan.spec import ModelSpec

pytest.importorskip("transformers")


def test_trainer_step_holds_the_plain_loss_figure():
    """The step's peak grows by exactly plain's bytes per token and vocabulary entry: the Trainer
    does not keep the returned logits through backward (hf would be 14 per N·V in bf16)."""
    bench = benchmark("bench_trainer_loss")
    measured, _ = bench.bytes_per_token_and_entry(trainer="trainer")

    def per_nv(loss: str) -> float:
        v = bench.VOCABS[0]
        model = ModelSpec(name="t", params=10**6, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, ffn_size=32, vocab_size=v)
        return sum(loss_activation_bytes(model, seq_len=bench.TOKENS, micro_batch=1, precision="bf16", loss=loss).values()) / (bench.TOKENS * v)

    assert per_nv("plain") == 12 and per_nv("hf") == 14
    assert abs(measured - per_nv("plain")) <= 0.01 * per_nv("plain"), measured
