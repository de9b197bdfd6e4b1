"""model_from_hf_config: exact parameter counts against transformers, and one-line errors.

Truth: ``sum(p.numel() for p in model.parameters())`` of the model transformers itself builds from
the same config on the meta device (no memory, so real sizes are instant).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroplan.profiles import SUPPORTED_MODEL_TYPES, count_hf_params, model_from_hf_config
from zeroplan.spec import SpecError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def transformers_model(config: dict):
    """The transformers model for ``config``, built on the meta device."""
    data = dict(config)
    model_type = data.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **data)
    auto = transformers.AutoModelForSeq2SeqLM if model_type == "t5" else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(hf_config)


def transformers_count(config: dict) -> int:
    """Parameters of the transformers model for ``config``, built on the meta device."""
    return sum(p.numel() for p in transformers_model(config).parameters())


def write_config(tmp_path: Path, config: dict, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


# Real-size configs (as published on the Hugging Face Hub) and small ones that switch on the
# optional parts (biases, untied heads, explicit head_dim, projections).
CONFIGS = {
    "gpt2": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
    "gpt2-xl": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=1600, n_layer=48, n_head=25),
    "gpt2-small-untied-inner": dict(
        model_type="gpt2", vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4, n_inner=100,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    ),
    "llama-2-7b": dict(
        model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
    ),
    "llama-3-70b": dict(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
    ),
    "llama-3.2-1b-tied": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
    ),
    "llama-small-biases": dict(
        model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=100, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, attention_bias=True, mlp_bias=True, head_dim=16,
        bos_token_id=0, eos_token_id=0,
    ),
    "mistral-7b": dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
    ),
    "mistral-nemo-head-dim": dict(
        model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=14336, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    ),
    "qwen2-7b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
    ),
    "qwen2-0.5b-tied": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "qwen3-small": dict(
        model_type="qwen3", vocab_size=1000, hidden_size=64, intermediate_size=100, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
    ),
    "gemma-7b": dict(
        model_type="gemma", vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=16, head_dim=256,
    ),
    "phi3-mini": dict(
        model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32,
    ),
    "pythia-70m": dict(
        model_type="gpt_neox", vocab_size=50304, hidden_size=512, intermediate_size=2048, num_hidden_layers=6,
        num_attention_heads=8,
    ),
    "opt-350m-projected": dict(
        model_type="opt", vocab_size=50272, hidden_size=1024, ffn_dim=4096, num_hidden_layers=24,
        num_attention_heads=16, max_position_embeddings=2048, word_embed_proj_dim=512, do_layer_norm_before=False,
    ),
    "opt-125m": dict(
        model_type="opt", vocab_size=50272, hidden_size=768, ffn_dim=3072, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=2048,
    ),
    "bloom-560m": dict(model_type="bloom", vocab_size=250880, hidden_size=1024, n_layer=24, n_head=16),
    "t5-3b": dict(
        model_type="t5", vocab_size=32128, d_model=1024, d_kv=128, d_ff=16384, num_layers=24, num_heads=32,
    ),
    "t5-v1_1-small-gated": dict(
        model_type="t5", vocab_size=1000, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=3,
        num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
    ),
    # Mixture of experts (active parameters and full-size shapes: tests/test_moe.py).
    "qwen3-moe-tiny": dict(
        model_type="qwen3_moe", vocab_size=120, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
    ),
    "qwen2-moe-tiny": dict(
        model_type="qwen2_moe", vocab_size=120, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2,
    ),
    "mixtral-tiny": dict(
        model_type="mixtral", vocab_size=120, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    ),
    "deepseek-v3-tiny": dict(
        model_type="deepseek_v3", vocab_size=120, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
        num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
    ),
    "gpt-oss-tiny": dict(
        model_type="gpt_oss", vocab_size=120, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_count_matches_transformers(tmp_path, name):
    config = CONFIGS[name]
    spec = model_from_hf_config(write_config(tmp_path, config))
    model = transformers_model(config)
    assert spec.params == sum(p.numel() for p in model.parameters())
    assert spec.source == "config.json"
    # fused_qkv: the model holds one h×(a + 2·kv_heads)·head_dim weight per block for Q, K and V.
    h, head_dim = spec.hidden_size, config.get("head_dim") or spec.head_dim
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * head_dim
    fused = [n for n, p in model.named_parameters() if p.dim() == 2 and sorted(p.shape) == sorted((h, qkv))]
    assert spec.fused_qkv == bool(fused), fused
    if fused:
        assert len(fused) == spec.num_layers, fused


#: Vision-language types are counted against transformers' ...ForConditionalGeneration (vision tower
#: included) in tests/test_profiles.py (test_vision_language_config_counts_like_transformers, test_dense_...).
COUNTED_IN_TEST_PROFILES = {"qwen3_vl", "qwen3_vl_moe"}


def test_every_supported_type_is_covered():
    covered = {c["model_type"] for c in CONFIGS.values()} | COUNTED_IN_TEST_PROFILES
    assert covered == set(SUPPORTED_MODEL_TYPES)


def test_published_counts():
    # GPT-2 124M with tied lm_head: 124,439,808 (what transformers' GPT2LMHeadModel reports).
    assert count_hf_params(CONFIGS["gpt2"]) == 124_439_808
    # Llama 2 7B (arXiv 2307.09288): 6,738,415,616 in the Hub checkpoint.
    assert count_hf_params(CONFIGS["llama-2-7b"]) == 6_738_415_616
    # Pythia-70m: 70,426,624 total parameters (EleutherAI pythia README, "Total Params").
    assert count_hf_params(CONFIGS["pythia-70m"]) == 70_426_624


def test_shape_fields(tmp_path):
    spec = model_from_hf_config(write_config(tmp_path, CONFIGS["llama-3-70b"]))
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (8192, 80, 64, 8)
    assert (spec.ffn_size, spec.vocab_size, spec.tied_embeddings, spec.gated_mlp) == (28672, 128256, False, True)
    assert spec.largest_layer_params == 128256 * 8192
    gpt2 = model_from_hf_config(write_config(tmp_path, CONFIGS["gpt2"]))
    assert (gpt2.ffn_size, gpt2.tied_embeddings, gpt2.gated_mlp) == (3072, True, False)


def test_model_folder_is_accepted(tmp_path):
    write_config(tmp_path, CONFIGS["gpt2"])
    assert model_from_hf_config(tmp_path).params == 124_439_808


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    model_type=st.sampled_from(["llama", "mistral", "qwen2", "gemma", "phi3"]),
    kv_heads=st.sampled_from([1, 2, 4]),
    groups=st.integers(1, 3),
    head_dim=st.sampled_from([8, 16]),
    layers=st.integers(1, 3),
    ffn=st.integers(1, 200),
    vocab=st.integers(8, 500),
    tied=st.booleans(),
    bias=st.booleans(),
)
def test_random_llama_family_matches_transformers(model_type, kv_heads, groups, head_dim, layers, ffn, vocab, tied, bias):
    heads = kv_heads * groups
    config = dict(
        model_type=model_type, vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=ffn,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    if model_type in ("llama", "gemma"):
        config["attention_bias"] = bias
    if model_type == "llama":
        config["mlp_bias"] = not bias
    assert count_hf_params(config) == transformers_count(config)


@settings(max_examples=20, deadline=None)
@given(
    heads=st.integers(1, 4),
    head_dim=st.sampled_from([4, 8]),
    layers=st.integers(1, 3),
    positions=st.integers(1, 64),
    vocab=st.integers(8, 300),
    inner=st.one_of(st.none(), st.integers(1, 100)),
    tied=st.booleans(),
)
def test_random_gpt2_matches_transformers(heads, head_dim, layers, positions, vocab, inner, tied):
    config = dict(
        model_type="gpt2", vocab_size=vocab, n_positions=positions, n_embd=heads * head_dim, n_layer=layers,
        n_head=heads, n_inner=inner, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0,
    )
    assert count_hf_params(config) == transformers_count(config)


# ---------------------------------------------------------------------------------------------
# Bad input: one SpecError naming the problem.

LLAMA_SMALL = CONFIGS["llama-small-biases"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mamba"}, "model_type 'mamba' is not supported; supported: bloom, deepseek_v3, gemma, gpt2"),
        ({"model_type": None}, 'no "model_type" key'),
        ({"model_type": 3}, "model_type 3 is not supported"),
        ({"hidden_size": None}, 'missing "hidden_size"'),
        ({"hidden_size": -64}, '"hidden_size" is -64; it must be >= 1'),
        ({"hidden_size": 0}, '"hidden_size" is 0; it must be >= 1'),
        ({"hidden_size": "4096"}, "\"hidden_size\" is '4096'; it must be a whole number"),
        ({"hidden_size": 64.5}, '"hidden_size" is 64.5; it must be a whole number'),
        ({"num_hidden_layers": True}, '"num_hidden_layers" is True; it must be a whole number'),
        ({"num_key_value_heads": 3}, "num_attention_heads=8 is not divisible by num_key_value_heads=3"),
        ({"head_dim": None, "hidden_size": 60}, "hidden_size=60 is not divisible by num_attention_heads=8"),
        ({"vocab_size": 10**9}, "absurdly large"),
        ({"tie_word_embeddings": "yes"}, "\"tie_word_embeddings\" is 'yes'; it must be true or false"),
    ],
)
def test_bad_fields(tmp_path, change, message):
    config = {k: v for k, v in {**LLAMA_SMALL, **change}.items() if v is not None}
    path = write_config(tmp_path, config)
    with pytest.raises(SpecError) as err:
        model_from_hf_config(path)
    text = str(err.value)
    assert message in text
    assert str(path) in text
    assert "\n" not in text


def test_gpt2_heads_must_divide_width(tmp_path):
    config = {**CONFIGS["gpt2"], "n_head": 7}
    with pytest.raises(SpecError, match="n_embd=768 is not divisible by n_head=7"):
        model_from_hf_config(write_config(tmp_path, config))


def test_missing_file(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        model_from_hf_config(tmp_path / "nope" / "config.json")


def test_directory_without_config(tmp_path):
    with pytest.raises(SpecError, match="is a directory without a config.json"):
        model_from_hf_config(tmp_path)


def test_not_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama",')
    with pytest.raises(SpecError, match=r"not valid JSON \(line 1"):
        model_from_hf_config(path)


def test_not_utf8(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(SpecError, match="cannot read"):
        model_from_hf_config(path)


@pytest.mark.parametrize("payload, kind", [("[1, 2]", "list"), ('"llama"', "str"), ("7", "int"), ("null", "NoneType")])
def test_json_not_an_object(tmp_path, payload, kind):
    path = tmp_path / "config.json"
    path.write_text(payload)
    with pytest.raises(SpecError, match=f"expected a JSON object .* got a JSON {kind}"):
        model_from_hf_config(path)
