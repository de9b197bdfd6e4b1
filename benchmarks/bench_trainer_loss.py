"""Which ``--loss`` figure a Hugging Face training step holds, measured on CPU with the real trainers.

    PYTHONPATH=. python benchmarks/bench_trainer_loss.py                    # transformers' Trainer, TRL's SFTTrainer
    PYTHONPATH=<trl source>:. python benchmarks/bench_trainer_loss.py --sft-loss-type none   # a TRL tag's source

One ``training_step`` of a 1-block bf16 Qwen3 (hidden 16, tied embeddings) on ``--tokens`` tokens,
at two vocabulary sizes; the step's peak of live tensor storage above the parameters and batch
(zeroplan's CPU tracker) grows with N·V by the bytes the loss keeps at its backward, so the
difference over N·ΔV is that figure per token and vocabulary entry, beside ``--loss``'s terms
(``zeroplan.estimator.activations.loss_activation_bytes``): ``plain`` 12, ``hf`` 12 + e = 14.

* ``Trainer``: transformers' ``Trainer.training_step`` calls ``compute_loss`` without
  ``return_outputs`` and back-propagates the loss alone (trainer.py ``training_step``).
* ``SFTTrainer``: TRL's, from whatever ``trl`` is importable — with ``PYTHONPATH`` pointing at a
  tag's source (``git archive v0.29.0 trl | tar -x -C DIR``) it measures that release; the metrics
  it computes from the logits (entropy, token accuracy) are listed. ``--sft-loss-type none`` leaves
  ``SFTConfig.loss_type`` out (releases before it existed); TRL 1.x's default is its fused LM head.
"""

from __future__ import annotations

import argparse
import tempfile

TOKENS = 512
VOCABS = (4096, 8192)


def training_step_peak(vocab_size: int, *, tokens: int = TOKENS, trainer: str = "trainer", sft_loss_type: str | None = None) -> tuple[int, list[str]]:
    """(peak bytes of one ``training_step`` beyond parameters and batch, metric names the trainer logged)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from zeroplan.runtime.measure.memory import StorageTracker

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, tie_word_embeddings=True, max_position_embeddings=tokens)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.randint(2, vocab_size, (1, tokens))
    inputs = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    with tempfile.TemporaryDirectory() as out:
        step = _sft_trainer(model, ids, out, sft_loss_type) if trainer == "sft" else _trainer(model, out)
        step.current_gradient_accumulation_steps = 1  # set by the train loop before each step
        model.train()
        with StorageTracker() as tracker:
            tracker.track(list(model.parameters()), inputs)
            base = tracker.current_bytes
            tracker.reset_peak()
            step.training_step(model, inputs)
            peak = tracker.peak_bytes - base
    return peak, sorted(getattr(step, "_metrics", {}).get("train", {}))


def _trainer(model, out: str):
    from transformers import Trainer, TrainingArguments

    return Trainer(model=model, args=TrainingArguments(output_dir=out, use_cpu=True, report_to=[]))


def _sft_trainer(model, ids, out: str, loss_type: str | None):
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>")),
                                  pad_token="<pad>", eos_token="<pad>")
    extra = {} if loss_type is None else {"loss_type": loss_type}
    args = SFTConfig(output_dir=out, use_cpu=True, report_to=[], max_length=None, bf16=False,
                     dataset_kwargs={"skip_prepare_dataset": True}, **extra)
    return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": ids.tolist()}), processing_class=tok)


def bytes_per_token_and_entry(*, tokens: int = TOKENS, trainer: str = "trainer", sft_loss_type: str | None = None) -> tuple[float, list[str]]:
    """The step's peak growth per token and vocabulary entry between ``VOCABS``, and the logged metrics."""
    (small, _), (large, metrics) = (training_step_peak(v, tokens=tokens, trainer=trainer, sft_loss_type=sft_loss_type) for v in VOCABS)
    return (large - small) / (tokens * (VOCABS[1] - VOCABS[0])), metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--sft-loss-type", default="nll", help="SFTConfig.loss_type; 'none' leaves it out (older TRL)")
    args = parser.parse_args(argv)
    import trl

    loss_type = None if args.sft_loss_type == "none" else args.sft_loss_type
    print(f"bytes held at the loss per token and vocabulary entry, bf16, N = {args.tokens}, V = {VOCABS[0]} -> {VOCABS[1]}")
    print("(zeroplan --loss: plain 12, hf 14)\n")
    print(f"{'bytes/(N·V)':>11}  {'training step':<22} metrics logged")
    for label, kind in (("transformers Trainer", "trainer"), ("TRL SFTTrainer", "sft")):
        value, metrics = bytes_per_token_and_entry(tokens=args.tokens, trainer=kind, sft_loss_type=loss_type)
        print(f"{value:>11.2f}  {label:<22} {', '.join(metrics) or '-'}")
    print(f"\nTRL from {trl.__file__}, SFTConfig.loss_type {args.sft_loss_type}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
