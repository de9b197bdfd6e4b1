"""LoRA on MoE experts: zeroplan's trainable count against peft's own ``get_nb_trainable_parameters``
on transformers models built from the same config (fused 3-D experts through peft's
``target_parameters``, attention through ``target_modules``)."""

from __future__ import annotations

import pytest

from zeroplan.spec import SpecError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CONFIGS = {
    "qwen3-moe-tiny": dict(model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96,
                           moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False),
    "mixtral-tiny": dict(model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False),
}


def _peft_count(config: dict, *, rank: int, modules: list[str], parameters: list[str]) -> int:
    data = dict(config)
    hf_config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
        lora = peft.LoraConfig(r=rank, target_modules=modules, target_parameters=parameters or None)
        trainable, _ = peft.get_peft_model(model, lora).get_nb_trainable_parameters()
    return trainable


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("modules, parameters", [
    (["q_proj", "v_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    ([], ["experts.gate_up_proj"]),
    ([], ["mlp.experts.down_proj"]),
])
def test_fused_expert_lora_count_is_pefts(tmp_path, name, modules, parameters):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS[name]))
    from zeroplan.profiles import model_from_hf_config
    from zeroplan.profiles.lora import PeftOptions

    model = PeftOptions(lora_rank=8, lora_targets=",".join(modules + parameters)).apply(
        model_from_hf_config(path), str(path), precision="bf16")
    assert model.trainable_params == _peft_count(CONFIGS[name], rank=8, modules=modules, parameters=parameters)


def test_expert_targets_on_a_dense_model_are_one_clear_error(tmp_path):
    import json

    from zeroplan.profiles import model_from_hf_config
    from zeroplan.profiles.lora import PeftOptions

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96,
                                    num_hidden_layers=2, num_attention_heads=4)))
    with pytest.raises(SpecError, match="fused expert tensors, but .* is dense"):
        PeftOptions(lora_rank=8, lora_targets="mlp.experts.down_proj").apply(model_from_hf_config(path), str(path), precision="bf16")
