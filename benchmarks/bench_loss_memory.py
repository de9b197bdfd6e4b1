"""Memory of the output projection + loss by implementation, measured on CPU beside ``--loss``'s terms.

    PYTHONPATH=. python benchmarks/bench_loss_memory.py                       # table
    PYTHONPATH=. python benchmarks/bench_loss_memory.py -o benchmarks/results/loss_memory.txt

For each way of computing next-token cross-entropy over an N×h bf16 hidden state and a V×h bf16
output projection, the peak of live tensor storage above the inputs (hidden, weight, targets)
from the projection's forward through the backward, beside
``zeroplan.estimator.activations.loss_activation_bytes`` for the matching ``--loss``:

* ``hf``: ``logits = hidden @ W.T`` kept by the caller (a Hugging Face model's output holds them)
  and transformers' own ``ForCausalLMLoss`` (transformers/loss/loss_utils.py: ``logits.float()``,
  then ``F.cross_entropy``).
* ``plain``: ``F.cross_entropy(logits.float(), y)``, the logits dropped after the forward.
* ``megatron``: Megatron-LM's vocabulary cross-entropy at tensor-parallel size 1, op for op as
  megatron/core/tensor_parallel/cross_entropy.py runs it (``.float()``, in-place max subtraction,
  ``exp(out=)``, ``div_``; the softmax saved and turned into the gradient in place).
* ``chunked``: torchtune's ``CEWithChunkedOutputLoss`` (torchtune/modules/loss/
  ce_chunked_output_loss.py): the projection per chunk of 8 (``model.output`` on
  ``h.tensor_split(8)``), ``F.cross_entropy(chunk.float(), reduction="sum")`` per chunk, and the
  recipe's ``del logits`` before ``backward()``, eager (a compiled ``compute_cross_entropy`` runs
  outside the tracker's dispatch mode, so it cannot be measured this way).
* ``trl``: TRL 1.x's fused LM head, its own ``ChunkedLogProbFunction`` (trl/kernels/chunked_logprob.py),
  which SFT, DPO and GRPO trainers call; on CPU its tiles are folded with torch ops whose fp32
  temporaries the table adds to the prediction (``recipe_terms.cpu_fold_bytes``, column "emulation").
* ``fused``: Liger's fused linear cross-entropy algorithm (liger_kernel/ops/
  fused_linear_cross_entropy.py) in plain torch: chunks of next_pow2(ceil(N / ceil(V/h))) rows,
  the chunk's softmax gradient written over its bf16 logits, the input gradient and the weight
  gradient accumulated in place during forward. Liger's Triton kernel keeps the fp32 softmax in
  registers; this CPU version needs one fp32 chunk (4·chunk·V bytes) on top, which the table adds
  to the prediction (column "emulation").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _megatron_ce():
    import torch

    class VocabCrossEntropy(torch.autograd.Function):
        """Megatron-LM's _VocabParallelCrossEntropy at tensor-parallel size 1 (no all-reduces)."""

        @staticmethod
        def forward(ctx, logits, target):
            logits = logits.float()  # calculate_logits_max
            logits_max = logits.max(dim=-1)[0]
            logits -= logits_max.unsqueeze(-1)  # in place
            rows = torch.arange(logits.shape[0])
            predicted = logits[rows, target].clone()
            torch.exp(logits, out=logits)
            sum_exp = logits.sum(dim=-1)
            loss = torch.log(sum_exp) - predicted
            logits.div_(sum_exp.unsqueeze(-1))  # the softmax, in place
            ctx.save_for_backward(logits, target)
            return loss

        @staticmethod
        def backward(ctx, grad_output):
            softmax, target = ctx.saved_tensors
            grad = softmax  # the gradient is built in place of the saved softmax
            grad[torch.arange(grad.shape[0]), target] -= 1.0
            grad.mul_(grad_output.unsqueeze(-1))
            return grad, None

    return VocabCrossEntropy


def _fused_linear_ce():
    import torch

    class FusedLinearCrossEntropy(torch.autograd.Function):
        """Liger's algorithm: logits in row chunks, gradients computed in forward and held."""

        @staticmethod
        def forward(ctx, hidden, weight, target):
            n, h = hidden.shape
            v = weight.shape[0]
            inc_factor = -(-v // h)
            chunk = min(n, 1 << max(0, (-(-n // inc_factor) - 1).bit_length()))
            grad_input = torch.zeros_like(hidden)
            grad_weight = torch.zeros_like(weight)
            loss = torch.zeros((), dtype=torch.float32)
            for start in range(0, n, chunk):
                x = hidden[start:start + chunk]
                logits = x @ weight.t()  # chunk × V in bf16
                t = target[start:start + chunk]
                p = logits.float()  # the kernel's fp32 work (registers in Triton)
                p -= p.max(dim=-1, keepdim=True)[0]
                p.exp_()
                sum_exp = p.sum(dim=-1, keepdim=True)
                rows = torch.arange(p.shape[0])
                loss += (torch.log(sum_exp.squeeze(-1)) - torch.log(p[rows, t])).sum()
                p /= sum_exp
                p[rows, t] -= 1.0
                p /= n
                logits.copy_(p)  # the gradient over the chunk's logits, in place
                del p
                torch.mm(logits, weight, out=grad_input[start:start + chunk])
                torch.addmm(grad_weight, logits.t(), x, out=grad_weight)  # accumulated in place
                del logits
            ctx.save_for_backward(grad_input, grad_weight)
            return loss / n

        @staticmethod
        def backward(ctx, grad_output):
            grad_input, grad_weight = ctx.saved_tensors
            if not torch.equal(grad_output, torch.ones_like(grad_output)):  # the loss is last: grad_output is 1
                grad_input.mul_(grad_output)
                grad_weight.mul_(grad_output)
            return grad_input, grad_weight, None

    return FusedLinearCrossEntropy


def measure(variant: str, *, n: int, h: int, v: int, chunks: int = 8) -> dict:
    """Peak live bytes above hidden + weight + targets, and where the fp32 work of an emulation goes."""
    import torch
    import torch.nn.functional as F

    from zeroplan.runtime.measure.memory import StorageTracker

    torch.manual_seed(0)
    hidden = (torch.randn(n, h) / h**0.5).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h) / h**0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (n,))
    with StorageTracker() as tracker:
        tracker.track(hidden, weight, y)
        base = tracker.current_bytes
        tracker.reset_peak()
        if variant == "hf":
            from transformers.loss.loss_utils import ForCausalLMLoss

            logits = hidden @ weight.t()
            # shift_labels given: the targets are already next tokens (make_batch's y).
            loss = ForCausalLMLoss(logits.unsqueeze(0), None, vocab_size=v, shift_labels=y.unsqueeze(0))
            loss.backward()  # logits stay referenced, as a model output's do
            del logits
        elif variant == "plain":
            loss = F.cross_entropy((hidden @ weight.t()).float(), y)
            loss.backward()
        elif variant == "megatron":
            loss = _megatron_ce().apply(hidden @ weight.t(), y).mean()
            loss.backward()
        elif variant == "chunked":
            ce = lambda logits, labels: F.cross_entropy(logits.float(), labels, reduction="sum")  # noqa: E731
            logits = [chunk @ weight.t() for chunk in hidden.tensor_split(chunks)]
            labels = y.tensor_split(chunks)
            loss = sum(ce(lc, yc) for lc, yc in zip(logits, labels)) / n
            del logits  # torchtune's recipes free the logits before backward
            loss.backward()
        elif variant == "fused":
            loss = _fused_linear_ce().apply(hidden, weight, y)
            loss.backward()
        elif variant == "trl":
            # TRL's own autograd function, as add_fused_lm_head calls it (trl/trainer/utils.py:1641-1653).
            from trl.kernels.chunked_logprob import ChunkedLogProbFunction
            from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

            logps = ChunkedLogProbFunction.apply(hidden, weight, None, y, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs",))[0]
            loss = -logps.sum() / n
            loss.backward()
        else:
            raise ValueError(variant)
        peak = tracker.peak_bytes - base
        grads = hidden.grad.untyped_storage().nbytes() + weight.grad.untyped_storage().nbytes()
    return {"variant": variant, "peak_bytes": peak, "input_and_weight_grads_bytes": grads, "loss": float(loss.detach())}


VARIANTS = ("hf", "plain", "megatron", "chunked", "fused", "trl")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("-o", "--output", type=Path)
    args = p.parse_args(argv)

    from zeroplan.estimator.activations import LOSS_CHUNKS, fused_chunk_rows, loss_activation_bytes
    from zeroplan.spec import ModelSpec

    n, h, v = args.seq_len * args.micro_batch, args.hidden, args.vocab
    model = ModelSpec(name="head", params=v * h, hidden_size=h, num_layers=1, num_heads=max(1, h // 64),
                      num_kv_heads=max(1, h // 64), ffn_size=4 * h, vocab_size=v)
    rows = []
    for variant in [x.strip() for x in args.variants.split(",") if x.strip()]:
        row = measure(variant, n=n, h=h, v=v, chunks=LOSS_CHUNKS)
        terms = loss_activation_bytes(model, seq_len=args.seq_len, micro_batch=args.micro_batch, precision="bf16", loss=variant)
        row["loss_option"] = variant
        # The torch emulation of Liger's kernel holds one fp32 chunk the Triton kernel does not.
        row["emulation_bytes"] = 4 * fused_chunk_rows(n, vocab_size=v, hidden_size=h) * v if variant == "fused" else 0
        if variant == "trl":
            # Without Triton (CPU) TRL folds each tile with torch ops: their fp32 temporaries (recipe_terms.cpu_fold_bytes).
            from zeroplan.estimator.recipe_terms import cpu_fold_bytes

            # The fold's temporaries are freed before the gradients are cast back: the larger of the two counts.
            row["emulation_bytes"] = max(0, cpu_fold_bytes(tokens=n, vocab_size=v, precision="bf16", backward=True) - terms["gradient_casts"])
        row["predicted_bytes"] = sum(terms.values()) + row["emulation_bytes"]
        row["predicted_terms"] = terms
        rows.append(row)
        print(f"{variant}: measured {row['peak_bytes']:,} predicted {row['predicted_bytes']:,}", file=sys.stderr)
    nv = n * v
    lines = [f"Output projection + cross-entropy, bf16, N = s·b = {args.seq_len}·{args.micro_batch} = {n} tokens, h = {h}, "
             f"V = {v} (N·V = {nv:,}); CPU, live tensor storage above hidden + weight + targets",
             "predicted: loss_activation_bytes(--loss) (+ the emulation's fp32 chunk for fused)",
             "", f"{'--loss':<9} {'measured':>13} {'×N·V':>6} {'predicted':>13} {'×N·V':>6} {'err':>7} {'emulation':>10}"]
    for row in rows:
        meas, pred = row["peak_bytes"], row["predicted_bytes"]
        lines.append(f"{row['loss_option']:<9} {meas:>13,} {meas / nv:>6.2f} {pred:>13,} {pred / nv:>6.2f} "
                     f"{(pred - meas) / meas:>+7.1%} {row['emulation_bytes']:>10,}")
    text = "\n".join(lines) + "\n"
    if args.output:
        args.output.write_text(text)
        args.output.with_suffix(".json").write_text(json.dumps({"n": n, "hidden": h, "vocab": v, "rows": rows}, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
