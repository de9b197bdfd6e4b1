"""What autograd saves in the tiny DeepSeek-V3 (multi-head latent attention, shared experts) and
gpt-oss (eager attention with sinks, clamped SwiGLU experts) of examples/, by storage, against the
activation formula — the causes of the probes' gaps (benchmarks/results/moe_probe_models.txt)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import EXAMPLES  # noqa: E402  (after the import skips)


def _saved_bytes_per_layer(config: Path, *, seq_len: int, micro_batch: int) -> list[int]:
    """Bytes of every tensor autograd saves inside each decoder layer (parameters excluded), fp32,
    with the attention implementation transformers picks on the CPU."""
    data = json.loads(config.read_text())
    hf_config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current = [None]
    saved: list[dict[int, int]] = [{} for _ in model.model.layers]
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None))

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if current[0] is not None and key not in params:
            saved[current[0]][key] = t.untyped_storage().nbytes()
        return t

    x = torch.randint(0, hf_config.vocab_size, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=x)
    return [sum(layer.values()) for layer in saved]


@pytest.mark.parametrize("name", ["deepseek_v3_tiny", "gpt_oss_tiny"])
def test_saved_activations_match_the_formula_on_cpu(name):
    from zeroplan.estimator.activations import layer_activation_bytes
    from zeroplan.estimator.attention_kernel import fused_attention
    from zeroplan.profiles import model_from_hf_config
    from zeroplan.spec import TrainingSpec

    path = EXAMPLES / f"{name}.json"
    spec = model_from_hf_config(path)
    s, b = 256, 4
    training = TrainingSpec(precision="fp32", seq_len=s)
    assert not fused_attention(spec, training, "cpu")  # MLA's unequal head dims / gpt-oss's eager path
    measured = sum(_saved_bytes_per_layer(path, seq_len=s, micro_batch=b))
    terms = layer_activation_bytes(spec, seq_len=s, micro_batch=b, precision="fp32", flash_attention=False)
    formula = spec.num_layers * sum(terms.values())
    # The two RMSNorms per block also keep their normalized output (+ rsqrt), which the formula
    # leaves out (as for Qwen3-MoE, tests/test_moe.py).
    rms_norm_normalized = spec.num_layers * 2 * (4 * s * b * spec.hidden_size + 4 * s * b)
    assert measured - rms_norm_normalized == pytest.approx(formula, rel=0.04)  # -3.0 % and -3.4 % here


def test_flash_stays_on_for_mla_on_cuda_and_off_for_gpt_oss_everywhere():
    from zeroplan.estimator.attention_kernel import fused_attention
    from zeroplan.profiles import model_from_hf_config
    from zeroplan.spec import TrainingSpec

    t = TrainingSpec(seq_len=256)
    mla = model_from_hf_config(EXAMPLES / "deepseek_v3_tiny.json")
    oss = model_from_hf_config(EXAMPLES / "gpt_oss_tiny.json")
    qwen = model_from_hf_config(EXAMPLES / "qwen3_moe_tiny.json")
    assert (fused_attention(mla, t, "cuda"), fused_attention(mla, t, "cpu")) == (True, False)
    assert (fused_attention(oss, t, "cuda"), fused_attention(oss, t, "cpu")) == (False, False)
    assert (fused_attention(qwen, t, "cuda"), fused_attention(qwen, t, "cpu")) == (True, True)
    # What decides it: PyTorch's CPU flash kernel takes one head dim for Q, K and V.
    q, k = torch.randn(1, 2, 8, 24, requires_grad=True), torch.randn(1, 2, 8, 24)
    unequal = torch.nn.functional.scaled_dot_product_attention(q, k, torch.randn(1, 2, 8, 16), is_causal=True)
    equal = torch.nn.functional.scaled_dot_product_attention(q, k, torch.randn(1, 2, 8, 24), is_causal=True)
    assert "FlashAttention" not in type(unequal.grad_fn).__name__
    assert "FlashAttention" in type(equal.grad_fn).__name__
