"""Read a Hugging Face ``config.json`` offline into a :class:`~zeroplan.spec.ModelSpec`.

The parameter count is exact: for every supported ``model_type`` it equals
``sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())`` (tied weights
counted once, as ``.parameters()`` does), module by module as the ``modeling_<type>.py`` files
of transformers build them. Standard library only: no torch, no transformers.

Each ``_count_<arch>`` function mirrors one modeling file; the comments name the modules so a
reader can check every term against the source.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from zeroplan.spec import ModelSpec, SpecError

if TYPE_CHECKING:
    from zeroplan.spec import MoeSpec

__all__ = ["model_from_hf_config", "model_from_hf_dict", "count_hf_params", "SUPPORTED_MODEL_TYPES", "MOE_MODEL_TYPES"]

_MAX_DIM = 10**8


@dataclass(frozen=True)
class _Counted:
    """What one architecture counter returns: the exact count and the estimator's shape."""

    params: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_size: int
    vocab_size: int
    tied_embeddings: bool
    gated_mlp: bool
    largest_layer_params: int
    notes: tuple[str, ...] = ()
    moe: MoeSpec | None = None


class _Config:
    """A config dict with typed getters whose errors name the file, the key and the value."""

    def __init__(self, data: dict[str, Any], where: str) -> None:
        self.data = data
        self.where = where

    def _fail(self, msg: str) -> SpecError:
        return SpecError(f"{self.where}: {msg}")

    def get_int(self, *keys: str, default: int | None = None, minimum: int = 1) -> int:
        """The first of ``keys`` present (aliases, e.g. n_embd / hidden_size), as a checked int."""
        for key in keys:
            if key in self.data and self.data[key] is not None:
                value = self.data[key]
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                if isinstance(value, bool) or not isinstance(value, int):
                    raise self._fail(f'"{key}" is {value!r}; it must be a whole number >= {minimum}')
                if value < minimum:
                    raise self._fail(f'"{key}" is {value}; it must be >= {minimum}')
                if value > _MAX_DIM:
                    raise self._fail(f'"{key}" is {value}; it is absurdly large (> {_MAX_DIM})')
                return value
        if default is not None:
            return default
        raise self._fail(f'missing "{keys[0]}" (a whole number); is this a complete config.json?')

    def opt_int(self, *keys: str, minimum: int = 1) -> int | None:
        if any(self.data.get(k) is not None for k in keys):
            return self.get_int(*keys, minimum=minimum)
        return None

    def get_bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._fail(f'"{key}" is {value!r}; it must be true or false')
        return value

    def divisible(self, name_a: str, a: int, name_b: str, b: int) -> None:
        if a % b:
            raise self._fail(f"{name_a}={a} is not divisible by {name_b}={b}")


def _layer_norm(h: int, *, bias: bool = True) -> int:
    """torch.nn.LayerNorm(h): weight h (+ bias h)."""
    return 2 * h if bias else h


def _linear(n_in: int, n_out: int, *, bias: bool) -> int:
    """torch.nn.Linear(n_in, n_out): n_in·n_out weights (+ n_out bias)."""
    return n_in * n_out + (n_out if bias else 0)


def _count_gpt2(c: _Config) -> _Counted:
    """transformers/models/gpt2/modeling_gpt2.py (GPT2LMHeadModel).

    wte V×h, wpe P×h; per block ln_1, c_attn Conv1D(h→3h)+b, c_proj Conv1D(h→h)+b, ln_2,
    c_fc Conv1D(h→inner)+b, c_proj Conv1D(inner→h)+b; ln_f; lm_head V×h without bias, tied to
    wte by default (counted once).
    """
    h = c.get_int("n_embd", "hidden_size")
    layers = c.get_int("n_layer", "num_hidden_layers")
    heads = c.get_int("n_head", "num_attention_heads")
    vocab = c.get_int("vocab_size")
    positions = c.get_int("n_positions", "max_position_embeddings")
    inner = c.opt_int("n_inner") or 4 * h
    tied = c.get_bool("tie_word_embeddings", True)
    c.divisible("n_embd", h, "n_head", heads)
    if c.get_bool("add_cross_attention", False):
        raise c._fail('"add_cross_attention": true (GPT-2 as a decoder of an encoder-decoder) is not supported')
    block = (
        _layer_norm(h)
        + _linear(h, 3 * h, bias=True)
        + _linear(h, h, bias=True)
        + _layer_norm(h)
        + _linear(h, inner, bias=True)
        + _linear(inner, h, bias=True)
    )
    embed = vocab * h
    total = embed + positions * h + layers * block + _layer_norm(h) + (0 if tied else vocab * h)
    return _Counted(total, h, layers, heads, heads, inner, vocab, tied, False, max(embed, h * inner, 3 * h * h))


def _llama_family(
    c: _Config,
    *,
    qkv_bias: bool | None = None,
    attention_bias_key: bool = False,
    mlp_bias_key: bool = False,
    default_tied: bool = False,
    default_kv: int | None = None,
    default_head_dim: int | None = None,
    qk_norm: bool = False,
    fused: bool = False,
) -> _Counted:
    """Llama-style decoder: RMSNorm (weight only), rotary positions, SwiGLU MLP.

    transformers/models/llama/modeling_llama.py: embed_tokens V×h; per layer q_proj h→a·d,
    k_proj and v_proj h→kv·d, o_proj a·d→h (biases if ``attention_bias``), gate_proj and up_proj
    h→I, down_proj I→h (biases if ``mlp_bias``), input/post-attention RMSNorm h each; final norm
    h; lm_head V×h unless ``tie_word_embeddings``. Mistral (no biases), Qwen2 (q/k/v biases, o
    without), Qwen3 (per-head q_norm/k_norm), Gemma (head_dim 256 by default, tied) and Phi-3
    (fused qkv_proj and gate_up_proj: same counts) share this shape.
    """
    h = c.get_int("hidden_size")
    layers = c.get_int("num_hidden_layers")
    heads = c.get_int("num_attention_heads")
    kv = c.opt_int("num_key_value_heads") or default_kv or heads
    ffn = c.get_int("intermediate_size")
    vocab = c.get_int("vocab_size")
    if heads % kv:
        raise c._fail(f"num_attention_heads={heads} is not divisible by num_key_value_heads={kv}")
    head_dim = c.opt_int("head_dim") or default_head_dim
    if head_dim is None:
        c.divisible("hidden_size", h, "num_attention_heads", heads)
        head_dim = h // heads
    attn_bias = c.get_bool("attention_bias", False) if attention_bias_key else False
    q_b = attn_bias if qkv_bias is None else qkv_bias
    mlp_bias = c.get_bool("mlp_bias", False) if mlp_bias_key else False
    tied = c.get_bool("tie_word_embeddings", default_tied)
    attn = (
        _linear(h, heads * head_dim, bias=q_b)
        + 2 * _linear(h, kv * head_dim, bias=q_b)
        + _linear(heads * head_dim, h, bias=attn_bias)
    )
    mlp = 2 * _linear(h, ffn, bias=mlp_bias) + _linear(ffn, h, bias=mlp_bias)
    # RMSNorm has a weight and no bias: input and post-attention norms (h each), plus Qwen3's
    # q_norm and k_norm over one head (head_dim each).
    norms = 2 * h + (2 * head_dim if qk_norm else 0)
    block = attn + mlp + norms
    embed = vocab * h
    total = embed + layers * block + h + (0 if tied else vocab * h)
    notes: list[str] = []
    if heads * head_dim != h:
        notes.append(f"attention width heads×head_dim = {heads * head_dim} differs from hidden_size {h}")
    if fused:
        largest_matrix = max(h * (heads + 2 * kv) * head_dim, 2 * h * ffn)
    else:
        largest_matrix = max(h * ffn, h * heads * head_dim)
    return _Counted(total, h, layers, heads, kv, ffn, vocab, tied, True, max(embed, largest_matrix), tuple(notes))


def _count_llama(c: _Config) -> _Counted:
    return _llama_family(c, attention_bias_key=True, mlp_bias_key=True)


def _count_mistral(c: _Config) -> _Counted:
    """transformers/models/mistral/modeling_mistral.py: Llama without any biases (GQA, kv 8 default)."""
    return _llama_family(c, default_kv=8)


def _count_qwen2(c: _Config) -> _Counted:
    """transformers/models/qwen2/modeling_qwen2.py: q/k/v projections with bias, o_proj without."""
    return _llama_family(c, qkv_bias=True)


def _count_qwen3(c: _Config) -> _Counted:
    """transformers/models/qwen3/modeling_qwen3.py: ``attention_bias``, head_dim 128 by default, q/k norms."""
    return _llama_family(c, attention_bias_key=True, default_head_dim=128, qk_norm=True)


def _count_gemma(c: _Config) -> _Counted:
    """transformers/models/gemma/modeling_gemma.py: ``attention_bias``, head_dim 256 by default, tied."""
    return _llama_family(c, attention_bias_key=True, default_tied=True, default_kv=16, default_head_dim=256)


def _count_phi3(c: _Config) -> _Counted:
    """transformers/models/phi3/modeling_phi3.py: fused qkv_proj and gate_up_proj, no biases."""
    return _llama_family(c, fused=True)


def _count_gpt_neox(c: _Config) -> _Counted:
    """transformers/models/gpt_neox/modeling_gpt_neox.py (Pythia, GPT-NeoX-20B).

    embed_in V×h; per layer input/post-attention LayerNorm, query_key_value h→3h and dense h→h
    (biases if ``attention_bias``, default true), dense_h_to_4h h→I and dense_4h_to_h I→h (always
    biased); final_layer_norm; embed_out V×h unless tied (default untied).
    """
    h = c.get_int("hidden_size")
    layers = c.get_int("num_hidden_layers")
    heads = c.get_int("num_attention_heads")
    ffn = c.get_int("intermediate_size")
    vocab = c.get_int("vocab_size")
    c.divisible("hidden_size", h, "num_attention_heads", heads)
    bias = c.get_bool("attention_bias", True)
    tied = c.get_bool("tie_word_embeddings", False)
    block = (
        2 * _layer_norm(h)
        + _linear(h, 3 * h, bias=bias)
        + _linear(h, h, bias=bias)
        + _linear(h, ffn, bias=True)
        + _linear(ffn, h, bias=True)
    )
    embed = vocab * h
    total = embed + layers * block + _layer_norm(h) + (0 if tied else vocab * h)
    return _Counted(total, h, layers, heads, heads, ffn, vocab, tied, False, max(embed, h * ffn, 3 * h * h))


def _count_opt(c: _Config) -> _Counted:
    """transformers/models/opt/modeling_opt.py (OPTForCausalLM).

    embed_tokens V×p (p = word_embed_proj_dim, default h); embed_positions (P + 2)×h (OPT's
    offset of 2); project_in/project_out p↔h without bias when p ≠ h; final LayerNorm when
    ``do_layer_norm_before`` and not ``_remove_final_layer_norm``; per layer q/k/v/out_proj h→h
    and fc1 h→F, fc2 F→h (biases if ``enable_bias``), two LayerNorms (affine if
    ``layer_norm_elementwise_affine``); lm_head p→V without bias, tied by default.
    """
    h = c.get_int("hidden_size")
    layers = c.get_int("num_hidden_layers")
    heads = c.get_int("num_attention_heads")
    ffn = c.get_int("ffn_dim")
    vocab = c.get_int("vocab_size")
    positions = c.get_int("max_position_embeddings")
    proj = c.opt_int("word_embed_proj_dim") or h
    c.divisible("hidden_size", h, "num_attention_heads", heads)
    bias = c.get_bool("enable_bias", True)
    affine = c.get_bool("layer_norm_elementwise_affine", True)
    tied = c.get_bool("tie_word_embeddings", True)
    norm = _layer_norm(h) if affine else 0
    block = 4 * _linear(h, h, bias=bias) + _linear(h, ffn, bias=bias) + _linear(ffn, h, bias=bias) + 2 * norm
    embed = vocab * proj
    total = embed + (positions + 2) * h + layers * block
    if proj != h:
        total += 2 * proj * h
    if c.get_bool("do_layer_norm_before", True) and not c.get_bool("_remove_final_layer_norm", False):
        total += norm
    total += 0 if tied else vocab * proj
    return _Counted(total, h, layers, heads, heads, ffn, vocab, tied, False, max(embed, h * ffn))


def _count_bloom(c: _Config) -> _Counted:
    """transformers/models/bloom/modeling_bloom.py (BloomForCausalLM).

    word_embeddings V×h and word_embeddings_layernorm; per layer input_layernorm,
    query_key_value h→3h+b, dense h→h+b, post_attention_layernorm, dense_h_to_4h h→4h+b,
    dense_4h_to_h 4h→h+b; ln_f; lm_head tied (ALiBi: no position parameters).
    """
    h = c.get_int("hidden_size", "n_embed")
    layers = c.get_int("n_layer", "num_hidden_layers")
    heads = c.get_int("n_head", "num_attention_heads")
    vocab = c.get_int("vocab_size")
    c.divisible("hidden_size", h, "n_head", heads)
    tied = c.get_bool("tie_word_embeddings", True)
    block = 2 * _layer_norm(h) + _linear(h, 3 * h, bias=True) + _linear(h, h, bias=True) + _linear(h, 4 * h, bias=True) + _linear(4 * h, h, bias=True)
    embed = vocab * h
    total = embed + _layer_norm(h) + layers * block + _layer_norm(h) + (0 if tied else vocab * h)
    return _Counted(total, h, layers, heads, heads, 4 * h, vocab, tied, False, max(embed, 4 * h * h))


def _count_t5(c: _Config) -> _Counted:
    """transformers/models/t5/modeling_t5.py (T5ForConditionalGeneration), an encoder-decoder.

    shared V×d; encoder blocks: self-attention q/k/v d→a·d_kv and o a·d_kv→d (no biases), a
    relative-attention-bias table buckets×a in the first block only, FF wi d→F and wo F→d (wi_0 and
    wi_1 when ``feed_forward_proj`` is gated-*), one T5LayerNorm (weight d) per sub-layer, final
    norm; the decoder adds cross-attention (its own norm) to each block; lm_head V×d, tied.

    Equivalent shape for the estimator (documented in docs/profiles.md): num_layers =
    encoder + decoder blocks, hidden_size = d_model, num_heads = num_heads.
    """
    d = c.get_int("d_model")
    d_kv = c.get_int("d_kv")
    heads = c.get_int("num_heads")
    ffn = c.get_int("d_ff")
    enc_layers = c.get_int("num_layers")
    dec_layers = c.get_int("num_decoder_layers", default=enc_layers)
    vocab = c.get_int("vocab_size")
    buckets = c.get_int("relative_attention_num_buckets", default=32)
    # transformers 5 (configuration_t5.py) always ties lm_head to the shared embedding,
    # whatever ``tie_word_embeddings`` says (older versions honoured false, e.g. for T5 v1.1).
    c.get_bool("tie_word_embeddings", True)
    tied = True
    proj = c.data.get("feed_forward_proj", "relu")
    if not isinstance(proj, str):
        raise c._fail(f'"feed_forward_proj" is {proj!r}; it must be a string such as "relu" or "gated-gelu"')
    gated = proj.startswith("gated-")
    inner = heads * d_kv
    attention = 4 * d * inner
    ff = (3 if gated else 2) * d * ffn
    enc_block = attention + ff + 2 * d
    dec_block = 2 * attention + ff + 3 * d
    # The first block of each stack owns the relative position bias table.
    rel = buckets * heads
    total = vocab * d
    total += enc_layers * enc_block + rel + d
    total += dec_layers * dec_block + rel + d
    notes = (
        f"encoder-decoder: {enc_layers} encoder + {dec_layers} decoder blocks modelled as "
        f"{enc_layers + dec_layers} layers of width {d}",
    )
    # ModelSpec needs hidden_size divisible by heads; T5 keeps d_model and heads×d_kv apart.
    if d % heads:
        raise c._fail(f"d_model={d} is not divisible by num_heads={heads}; zeroplan cannot model this shape")
    return _Counted(total, d, enc_layers + dec_layers, heads, heads, ffn, vocab, tied, gated, max(vocab * d, d * ffn, d * inner), notes)


_COUNTERS: dict[str, Callable[[_Config], _Counted]] = {
    "gpt2": _count_gpt2,
    "llama": _count_llama,
    "mistral": _count_mistral,
    "qwen2": _count_qwen2,
    "qwen3": _count_qwen3,
    "gemma": _count_gemma,
    "phi3": _count_phi3,
    "gpt_neox": _count_gpt_neox,
    "opt": _count_opt,
    "bloom": _count_bloom,
    "t5": _count_t5,
}

# Mixture-of-experts counters live in their own module (it imports this one's helpers).
from zeroplan.profiles.hf_config_moe import MOE_COUNTERS, attention_kernel_of, mla_of  # noqa: E402

_COUNTERS.update(MOE_COUNTERS)

from zeroplan.profiles.hf_config_vision import VISION_LANGUAGE_MODEL_TYPES, qwen3_vl_vision_tower, split_vision_language  # noqa: E402

#: ``model_type`` values whose attention projects Q, K and V with one matrix (transformers'
#: GPT2Attention ``c_attn``, GPTNeoXAttention and BloomAttention ``query_key_value``,
#: Phi3Attention ``qkv_proj``).
FUSED_QKV_MODEL_TYPES: tuple[str, ...] = ("bloom", "gpt2", "gpt_neox", "phi3")

#: ``model_type`` values of mixture-of-experts models (their counters fill ``ModelSpec.moe``).
MOE_MODEL_TYPES: tuple[str, ...] = tuple(sorted(MOE_COUNTERS))

#: ``model_type`` values whose attention normalizes Q and K per head (transformers' Qwen3Attention
#: and Qwen3MoeAttention ``q_norm``/``k_norm``).
QK_NORM_MODEL_TYPES: tuple[str, ...] = ("qwen3", "qwen3_moe")

#: ``model_type`` values :func:`model_from_hf_config` understands (vision-language ones count
#: their ``text_config`` and add the vision tower, :mod:`zeroplan.profiles.hf_config_vision`).
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted([*_COUNTERS, *VISION_LANGUAGE_MODEL_TYPES]))


def _count(data: dict[str, Any], where: str) -> _Counted:
    vision_language = split_vision_language(data, where)
    if vision_language is not None:  # the decoder's count plus the vision tower's
        text, vision = vision_language
        counted = _count(text, where)
        tower = sum(vision.values())
        note = f"vision tower and mergers: {tower:,} parameters (vision_config) in the model states; their activations from the images' patches (TrainingSpec.image_patches)"
        return replace(counted, params=counted.params + tower, notes=(*counted.notes, note))
    model_type = data.get("model_type")
    if model_type is None:
        raise SpecError(f'{where}: no "model_type" key; supported: {", ".join(SUPPORTED_MODEL_TYPES)}')
    counter = _COUNTERS.get(model_type) if isinstance(model_type, str) else None
    if counter is None:
        raise SpecError(
            f'{where}: model_type {model_type!r} is not supported; supported: {", ".join(SUPPORTED_MODEL_TYPES)} '
            f"(or use --params)"
        )
    counted = counter(_Config(data, where))
    if counted.params > 10**14:
        raise SpecError(f"{where}: the config describes {counted.params:.3g} parameters, which is absurd")
    return counted


def count_hf_params(data: dict[str, Any], *, where: str = "config") -> int:
    """Exact parameter count of ``AutoModelForCausalLM.from_config`` for a config dict."""
    return _count(data, where).params


def model_from_hf_dict(data: dict[str, Any], *, name: str, where: str | None = None) -> ModelSpec:
    """A ModelSpec from an already-parsed config dict (presets embed one as ``[hf_config]``)."""
    where = where or name
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a JSON object (a config.json), got {type(data).__name__}")
    counted = _count(data, where)
    raw = data
    vision_language = split_vision_language(data, where)
    data = vision_language[0] if vision_language is not None else data  # the decoder's shape
    try:
        return ModelSpec(
            name=name,
            params=counted.params,
            hidden_size=counted.hidden_size,
            num_layers=counted.num_layers,
            num_heads=counted.num_heads,
            num_kv_heads=counted.num_kv_heads,
            ffn_size=counted.ffn_size,
            vocab_size=counted.vocab_size,
            tied_embeddings=counted.tied_embeddings,
            gated_mlp=counted.gated_mlp,
            largest_layer_params=counted.largest_layer_params,
            fused_qkv=data["model_type"] in FUSED_QKV_MODEL_TYPES,
            qk_norm=data["model_type"] in QK_NORM_MODEL_TYPES,
            attention_kernel=attention_kernel_of(data),
            mla=mla_of(data),
            source="config.json",
            notes=counted.notes,
            moe=counted.moe,
            vision=qwen3_vl_vision_tower(raw["vision_config"], where=f"{where}: vision_config") if vision_language else None,
        )
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None


def model_from_hf_config(path: Path | str) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (or a model folder holding one) offline.

    Raises SpecError, one line, for a missing file, an unreadable or non-JSON file, JSON that is
    not an object, an unsupported ``model_type`` (the supported ones are listed) and missing or
    nonsense fields.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecError(f"{path} is a directory without a config.json; give the path of a Hugging Face config.json")
        path = path / "config.json"
    if not path.exists():
        raise SpecError(f"{path}: no such file; give the path of a Hugging Face config.json or a preset name")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise SpecError(f"{path}: cannot read ({reason})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a JSON object (a config.json), got a JSON {type(data).__name__}")
    return model_from_hf_dict(data, name=str(path), where=str(path))
