"""LoRA parameter counts against peft itself, and the one-line errors of bad PEFT input.

Truth: ``get_peft_model(model, LoraConfig(...)).get_nb_trainable_parameters()`` on a transformers
model built from the same config on the meta device (no memory, real sizes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.profiles import model_from_hf_config
from zeroplan.profiles.lora import PeftOptions, read_adapter_config, resolve_peft
from zeroplan.spec import SpecError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
transformers.logging.set_verbosity_error()

# Real widths (Llama-3-8B, Mistral-7B, Qwen2-1.5B, GPT-2) with few layers: LoRA adds the same
# parameters to every layer, and building 32 real-size layers takes peft ~10 s even on meta.
CONFIGS = {
    "llama-3-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=3,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    ),
    "mistral-7b": dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=8,
    ),
    "qwen2-1.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=4,
        num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "gpt2": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=3, n_head=12),
    "phi3-small": dict(
        model_type="phi3", vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, pad_token_id=0,
    ),
}

CASES = [
    ("llama-3-8b", 16, "q_proj,v_proj"),
    ("llama-3-8b", 64, "all-linear"),
    ("mistral-7b", 8, "q_proj,k_proj,v_proj,o_proj"),
    ("mistral-7b", 32, "gate_proj,up_proj,down_proj"),
    ("qwen2-1.5b", 8, "all-linear"),
    ("qwen2-1.5b", 128, "k_proj,v_proj"),
    ("gpt2", 8, "c_attn"),
    ("gpt2", 16, "c_attn,c_proj"),
    ("gpt2", 4, "all-linear"),
    ("phi3-small", 8, "qkv_proj,gate_up_proj"),
]


def peft_trainable(config: dict, **lora) -> tuple[int, int]:
    data = dict(config)
    hf_config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    with _quiet():
        wrapped = peft.get_peft_model(model, peft.LoraConfig(**lora))
    return wrapped.get_nb_trainable_parameters()


class _quiet:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


def _model(tmp_path: Path, name: str):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(CONFIGS[name]))
    return path, model_from_hf_config(path)


@pytest.mark.parametrize("name,rank,targets", CASES)
def test_lora_counts_equal_peft(tmp_path, name, rank, targets):
    path, base = _model(tmp_path, name)
    spec = resolve_peft(base, PeftOptions(lora_rank=rank, lora_targets=targets), model_arg=str(path), precision="bf16")
    peft_targets = "all-linear" if targets == "all-linear" else targets.split(",")
    trainable, total = peft_trainable(CONFIGS[name], r=rank, target_modules=peft_targets)
    assert spec.trainable_params == trainable
    assert spec.total_params == total
    assert spec.frozen_params == total - trainable


def test_adapter_config_with_rank_pattern_dora_and_modules_to_save(tmp_path):
    path, base = _model(tmp_path, "mistral-7b")
    cfg = dict(
        peft_type="LORA", r=16, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"down_proj": 4}, use_dora=True, modules_to_save=["lm_head"], bias="none",
    )
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    spec = resolve_peft(base, PeftOptions(adapter=tmp_path), model_arg=str(path), precision="bf16")
    kwargs = {k: v for k, v in cfg.items() if k not in ("peft_type",)}
    trainable, total = peft_trainable(CONFIGS["mistral-7b"], **kwargs)
    assert (spec.trainable_params, spec.total_params) == (trainable, total)
    assert read_adapter_config(tmp_path)["r"] == 16


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(lora_rank=8, lora_targets="q_proj,qq_proj"), "--lora-targets qq_proj: no such module in"),
        (dict(lora_rank=0, lora_targets="q_proj"), "--lora-rank 0 is not valid"),
        (dict(lora_rank=300, lora_targets="k_proj"), "--lora-rank 300 is larger than self_attn.k_proj (512→256)"),
        (dict(lora_rank=8, base_quant="nf4"), None),
    ],
)
def test_bad_lora_flags(tmp_path, kwargs, message):
    path = tmp_path / "config.json"
    cfg = dict(CONFIGS["llama-3-8b"], hidden_size=512, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1024, num_hidden_layers=2)
    path.write_text(json.dumps(cfg))
    base = model_from_hf_config(path)
    if message is None:
        with pytest.raises(SpecError, match="--precision fp32"):
            resolve_peft(base, PeftOptions(**kwargs), model_arg=str(path), precision="fp32")
        return
    with pytest.raises(SpecError) as err:
        resolve_peft(base, PeftOptions(**kwargs), model_arg=str(path), precision="bf16")
    assert str(err.value).startswith(message)
    if "no such module" in message:
        assert str(err.value).endswith("its linear modules are down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (or all-linear)")


def test_adapter_for_another_base_model(tmp_path):
    cfg = dict(CONFIGS["llama-3-8b"], _name_or_path="meta-llama/Meta-Llama-3-8B")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "adapter_config.json").write_text(
        json.dumps(dict(peft_type="LORA", r=8, target_modules=["q_proj"], base_model_name_or_path="mistralai/Mistral-7B-v0.1"))
    )
    with pytest.raises(SpecError, match=r"was made for mistralai/Mistral-7B-v0.1, but the model is meta-llama/Meta-Llama-3-8B"):
        resolve_peft(model_from_hf_config(path), PeftOptions(adapter=tmp_path / "ad"), model_arg=str(path), precision="bf16")
