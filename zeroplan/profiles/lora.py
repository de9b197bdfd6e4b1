"""Exact LoRA parameter counts from a Hugging Face config, offline, and PEFT specs from flags.

LoRA (Hu et al. 2021, arXiv 2106.09685, §4.1) adds to a frozen weight W (out × in) the product
B·A with A: r × in and B: out × r, so each adapted module adds r·(in + out) trainable parameters.
peft builds exactly that (peft/tuners/lora/layer.py, ``update_layer``: ``lora_A = nn.Linear(in,
r, bias=False)``, ``lora_B = nn.Linear(r, out, bias=False)``; embeddings: ``lora_embedding_A``
r × V and ``lora_embedding_B`` h × r; DoRA adds a magnitude vector of ``out`` elements).

Target matching follows peft (peft/tuners/tuners_utils.py, ``check_target_module_exists``): a list
entry matches a module whose full name equals it or ends with ``"." + entry``; a string is a
regular expression matched against the full name; ``all-linear`` is every linear module but the
output layer. Standard library only (no torch, no peft); tests compare with ``peft`` itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

from zeroplan.spec import ModelSpec, SpecError

if TYPE_CHECKING:
    from zeroplan.profiles.lora_modules import BaseModule
    from zeroplan.spec.peft import PeftSpec

__all__ = [
    "BaseModule",
    "PeftOptions",
    "check_peft_options",
    "base_modules",
    "base_modules_from_shape",
    "lora_spec",
    "partial_spec",
    "read_adapter_config",
    "resolve_peft",
]


def __getattr__(name: str) -> Any:
    # The module lists load when LoRA is asked for (resolve_peft); read from here, they load now.
    if name in ("BaseModule", "base_modules", "base_modules_from_shape"):
        from zeroplan.profiles import lora_modules

        return getattr(lora_modules, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _linear_names(modules: Iterable[BaseModule]) -> str:
    names = sorted({m.name.rsplit(".", 1)[-1] for m in modules if m.kind == "linear"})
    return ", ".join(names)


def _matches(target: str | list[str], full_name: str) -> bool:
    """peft's check_target_module_exists: regex fullmatch for a string, suffix match for a list."""
    if isinstance(target, str):
        return re.fullmatch(target, full_name) is not None
    return any(full_name == t or full_name.endswith("." + t) for t in target)


def _matching(modules: Iterable[BaseModule], target: str | list[str]) -> list[BaseModule]:
    """The modules with at least one full name that ``target`` matches (:func:`_matches`)."""
    return [m for m in modules if any(_matches(target, name) for name in m.full_names())]


def _pattern_value(patterns: dict[str, Any], full_name: str, default: Any) -> Any:
    """peft's get_pattern_key: the first key k with ``(.*\\.)?k$`` matching the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", full_name):
            return value
    return default


def lora_spec(
    model: ModelSpec,
    modules: tuple[BaseModule, ...],
    *,
    rank: int,
    targets: str | list[str],
    alpha: Optional[float] = None,
    dropout: float = 0.0,
    base_quant: str = "none",
    rank_pattern: Optional[dict[str, int]] = None,
    modules_to_save: Iterable[str] = (),
    use_dora: bool = False,
    source: str = "flags",
    notes: tuple[str, ...] = (),
) -> PeftSpec:
    """The PeftSpec of LoRA rank ``rank`` on ``targets`` (a list of names, a regex or ``all-linear``).

    Added parameters: Σ r·(in + out) over adapted linear modules (Hu et al. §4.1), r·(V + h) per
    adapted embedding, + out per module with DoRA, + a full trainable copy of each
    ``modules_to_save`` module (peft ModulesToSaveWrapper). All added parameters train; the
    base is frozen. Quantized storage covers every linear module but the output layer (what
    transformers' bitsandbytes integration converts: ``modules_to_not_convert`` keeps lm_head).
    """
    from zeroplan.spec.peft import BASE_QUANTS, AdaptedModule, PeftSpec

    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise SpecError(f"--lora-rank {rank!r} is not valid; give a whole number >= 1 (typical: 8, 16, 64)")
    if base_quant not in BASE_QUANTS:
        raise SpecError(f"--base-quant {base_quant!r} is not valid; choose one of {', '.join(BASE_QUANTS)}")
    linear_like = [m for m in modules if m.kind in ("linear", "output", "embedding")]
    expert_targets: list[str] = []
    chosen: list[BaseModule] = []
    if targets == "all-linear" or targets == ["all-linear"]:
        chosen = [m for m in modules if m.kind == "linear"]
        shown_targets: tuple[str, ...] = ("all-linear",)
    else:
        if isinstance(targets, list):
            from zeroplan.profiles.lora_experts import split_expert_parameter_targets

            # peft's target_parameters (fused 3-D expert tensors, zeroplan.profiles.lora_experts) apart.
            targets, expert_targets = split_expert_parameter_targets([t.strip() for t in targets if t.strip()])
            if not targets and not expert_targets:
                raise SpecError(f"--lora-targets is empty; give module names ({_linear_names(modules)}) or all-linear")
            unknown = [t for t in targets if not _matching(linear_like, [t])]
            if unknown:
                raise SpecError(
                    f"--lora-targets {','.join(unknown)}: no such module in {model.name}; its linear modules are "
                    f"{_linear_names(modules)} (or all-linear)"
                )
            shown_targets = tuple(targets + expert_targets)
        else:
            shown_targets = (targets,)
        if targets:
            chosen = _matching(linear_like, targets)
            if not chosen:
                raise SpecError(
                    f"target_modules {targets!r} matches no module of {model.name}; its linear modules are "
                    f"{_linear_names(modules)}"
                )
    patterns = dict(rank_pattern or {})
    adapted: list[AdaptedModule] = []
    added = 0
    for m in chosen:
        # Per-layer modules share a rank unless rank_pattern names a single layer; group by rank.
        by_rank: dict[int, int] = {}
        for full in m.full_names():
            if not _matches(targets if shown_targets != ("all-linear",) else [m.name], full):
                continue
            r = int(_pattern_value(patterns, full, rank))
            by_rank[r] = by_rank.get(r, 0) + 1
        for r, count in by_rank.items():
            if r <= 0:
                raise SpecError(f"rank_pattern gives {m.name} rank {r}; ranks must be >= 1")
            if m.kind != "embedding" and r > min(m.in_features, m.out_features):
                raise SpecError(
                    f"--lora-rank {r} is larger than {m.name} ({m.in_features}→{m.out_features}); a rank above "
                    f"min(in, out) = {min(m.in_features, m.out_features)} adds parameters without adding capacity"
                )
            per = r * (m.in_features + m.out_features) + (m.out_features if use_dora and m.kind != "embedding" else 0)
            added += per * count
            adapted.append(AdaptedModule(m.name, m.in_features, m.out_features, count, r))
    if expert_targets:
        from zeroplan.profiles.lora_experts import fused_expert_lora_params

        added += fused_expert_lora_params(model, rank, expert_targets)
    for name in modules_to_save:
        hits = _matching(linear_like, [name])
        if not hits:
            raise SpecError(f"modules_to_save {name!r} matches no module of {model.name}")
        added += sum(m.numel * m.count for m in hits)
    quantized = rows = largest = 0
    if base_quant != "none":
        q = [m for m in modules if m.kind == "linear"]
        quantized = sum(m.numel * m.count for m in q)
        rows = sum(m.out_features * m.count for m in q)
        largest = max(m.numel for m in q)
    return PeftSpec(
        method="lora",
        base_params=model.params,
        trainable_params=added,
        added_params=added,
        base_quant=base_quant,
        quantized_params=quantized,
        quantized_rows=rows,
        largest_quantized_numel=largest,
        rank=rank,
        alpha=alpha,
        dropout=dropout,
        targets=shown_targets,
        adapted=tuple(adapted),
        source=source,
        notes=notes,
    )


def partial_spec(model: ModelSpec, trainable: str) -> PeftSpec:
    """``--trainable-params N`` (a count such as 2e8) or ``P%`` of the model's parameters."""
    from zeroplan.spec.peft import PeftSpec

    text = trainable.strip()
    try:
        if text.endswith("%"):
            pct = float(text[:-1])
            if not 0 < pct <= 100:
                raise ValueError
            count = int(round(model.params * pct / 100))
        else:
            value = float(text)
            if value != int(value) or value < 1:
                raise ValueError
            count = int(value)
    except ValueError:
        raise SpecError(
            f"--trainable-params {trainable!r} is not valid; give a count such as 2e8 or a percentage such as 1.5%"
        ) from None
    if count < 1 or count > model.params:
        raise SpecError(
            f"--trainable-params {trainable} gives {count} of the model's {model.params} parameters; "
            f"give between 1 and {model.params}"
        )
    return PeftSpec(method="partial", base_params=model.params, trainable_params=count)


def read_adapter_config(path: Path | str) -> dict[str, Any]:
    """A PEFT ``adapter_config.json`` (or a folder holding one), read offline and checked."""
    path = Path(path)
    if path.is_dir():
        path = path / "adapter_config.json"
    if not path.is_file():
        raise SpecError(f"--adapter {path}: no such file; give a PEFT adapter_config.json or its folder")
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"--adapter {path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"--adapter {path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise SpecError(f"--adapter {path}: expected a JSON object (an adapter_config.json)")
    peft_type = data.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise SpecError(f"--adapter {path}: peft_type {peft_type!r} is not supported; zeroplan counts LORA adapters")
    if data.get("layers_to_transform") not in (None, []):
        raise SpecError(f"--adapter {path}: layers_to_transform is not supported; adapt every layer")
    if data.get("bias", "none") != "none":
        raise SpecError(f"--adapter {path}: bias={data.get('bias')!r} is not supported; zeroplan counts bias='none'")
    return data


def _base_name(hf: Optional[dict[str, Any]]) -> Optional[str]:
    """The checkpoint a config.json was saved from (``_name_or_path``), when it says."""
    if hf and isinstance(hf.get("_name_or_path"), str) and hf["_name_or_path"]:
        return hf["_name_or_path"]
    return None


def check_peft_options(options: PeftOptions, *, precision: str) -> None:
    """The checks of the fine-tuning options that need no model (one SpecError line each): LoRA
    flags with --adapter or --trainable-params, a rank ≤ 0, --lora-targets/--lora-alpha without a
    rank, an unknown --base-quant, a quantized base with fp32 or without an adapter."""
    lora_flags = options.lora_flags
    if sum((lora_flags, options.adapter is not None, options.trainable_params is not None)) > 1:
        raise SpecError("give one of --lora-rank/--lora-targets, --adapter or --trainable-params, not several")
    if options.lora_rank is not None and options.lora_rank <= 0:
        raise SpecError(f"--lora-rank {options.lora_rank!r} is not valid; give a whole number >= 1 (typical: 8, 16, 64)")
    if (options.lora_targets is not None or options.lora_alpha is not None) and options.lora_rank is None:
        raise SpecError("--lora-targets/--lora-alpha need --lora-rank (e.g. --lora-rank 16)")
    quant = options.base_quant or "none"
    if options.base_quant is not None:  # not given: "none", a storage spec.peft knows (loaded only to check one given)
        from zeroplan.spec.peft import BASE_QUANTS

        if quant not in BASE_QUANTS:
                raise SpecError(f"--base-quant {quant!r} is not valid; choose one of {', '.join(BASE_QUANTS)}")
    if quant != "none":
        if precision == "fp32":
            raise SpecError(
                f"--base-quant {quant} with --precision fp32: bitsandbytes bases compute in bf16 or fp16; use --precision bf16"
            )
        if not (lora_flags or options.adapter is not None):
            raise SpecError(f"--base-quant {quant} needs an adapter (--lora-rank or --adapter): a quantized base cannot train")


@dataclass(frozen=True)
class PeftOptions:
    """The fine-tuning options as given (``--lora-rank`` … ``--base-quant``; None where not given),
    so every command resolves and checks them one way (see docs/peft.md)."""

    lora_rank: Optional[int] = None
    """LoRA rank r (``--lora-rank``)."""
    lora_targets: Optional[str] = None
    """Modules to adapt, comma-separated or ``all-linear`` (``--lora-targets``)."""
    lora_alpha: Optional[float] = None
    """LoRA α (``--lora-alpha``); no effect on memory."""
    adapter: Optional[Path] = None
    """A PEFT adapter_config.json or its folder (``--adapter``)."""
    trainable_params: Optional[str] = None
    """``N`` or ``P%`` of the base trains (``--trainable-params``)."""
    base_quant: Optional[str] = None
    """Storage of the frozen base: none, nf4 or int8 (``--base-quant``)."""

    @property
    def given(self) -> list[str]:
        """The flags given, spelled as on the command line."""
        return ["--" + f.name.replace("_", "-") for f in fields(PeftOptions) if getattr(self, f.name) is not None]

    @property
    def label(self) -> str:
        """The options as typed, for notes (``--lora-alpha`` left out: no effect on memory)."""
        return " ".join(f"{flag} {getattr(self, flag[2:].replace('-', '_'))}" for flag in self.given if flag != "--lora-alpha")

    @property
    def lora_flags(self) -> bool:
        """Any of ``--lora-rank``, ``--lora-targets``, ``--lora-alpha`` given."""
        return self.lora_rank is not None or self.lora_targets is not None or self.lora_alpha is not None

    def check(self, precision: str) -> None:
        """:func:`check_peft_options` on these options, plus a readable ``--adapter`` file."""
        check_peft_options(self, precision=precision)
        if self.adapter is not None:
            read_adapter_config(self.adapter)

    def apply(self, model_spec: ModelSpec, model_arg: Optional[str], *, precision: str) -> ModelSpec:
        """The model with its frozen/trainable split from these options (unchanged when none is given)."""
        return resolve_peft(model_spec, self, model_arg=model_arg, precision=precision)

    def require_model(self, what: str) -> None:
        """SpecError naming the options given when there is no model to apply them to (``what``
        says what to add and why)."""
        if self.given:
            raise SpecError(f"the fine-tuning options ({', '.join(self.given)}) {what}")


def resolve_peft(model: ModelSpec, options: PeftOptions, *, model_arg: Optional[str], precision: str) -> ModelSpec:
    """``model`` with its PeftSpec from the command-line options (unchanged when none is given).

    One SpecError line for: LoRA flags with --adapter or --trainable-params, a quantized base
    without an adapter or with fp32, unknown targets, a rank ≤ 0 or above a layer's width, an
    adapter config made for another base model.
    """
    check_peft_options(options, precision=precision)
    lora_rank, lora_targets, lora_alpha = options.lora_rank, options.lora_targets, options.lora_alpha
    adapter, trainable_params = options.adapter, options.trainable_params
    lora_flags = options.lora_flags
    quant = options.base_quant or "none"
    if trainable_params is not None:
        return replace(model, peft=partial_spec(model, trainable_params))
    if not (lora_flags or adapter is not None):
        return model
    # The module lists (and the config readers under them) load only when LoRA is asked for.
    from zeroplan.profiles.lora_modules import base_modules, base_modules_from_shape

    hf = _hf_config_of(model_arg)
    notes: list[str] = []
    if hf is not None:
        modules = base_modules(hf, where=model.name)
    else:
        modules = base_modules_from_shape(model)
        notes.append("no config.json: LoRA counted on Llama-named modules of the shape (biases ignored)")
    if adapter is not None:
        cfg = read_adapter_config(adapter)
        base = cfg.get("base_model_name_or_path")
        ours = _base_name(hf)
        if isinstance(base, str) and base and ours and Path(base).name.lower() != Path(ours).name.lower():
            raise SpecError(
                f"--adapter {adapter} was made for {base}, but the model is {ours}; give that model's config"
            )
        targets = cfg.get("target_modules")
        if targets is None:
            raise SpecError(f"--adapter {adapter}: no target_modules (peft fills them per architecture; list them)")
        if isinstance(targets, list) and targets == ["all-linear"]:
            targets = "all-linear"
        rank = cfg.get("r", 8)
        spec = lora_spec(
            model,
            modules,
            rank=rank,
            targets=targets if isinstance(targets, (str, list)) else list(targets),
            alpha=cfg.get("lora_alpha"),
            dropout=float(cfg.get("lora_dropout") or 0.0),
            base_quant=quant,
            rank_pattern=cfg.get("rank_pattern") or {},
            modules_to_save=cfg.get("modules_to_save") or (),
            use_dora=bool(cfg.get("use_dora", False)),
            source=str(adapter),
            notes=tuple(notes),
        )
        return replace(model, peft=spec)
    text = lora_targets or "q_proj,v_proj"
    targets_arg: str | list[str] = "all-linear" if text == "all-linear" else text.split(",")
    if lora_targets is None:
        notes.append("--lora-targets not given: q_proj,v_proj (peft's default for Llama-style models)")
        if not any(m.name.endswith(("q_proj", "v_proj")) for m in modules):
            raise SpecError(f"give --lora-targets: {model.name} has no q_proj/v_proj; its linear modules are {_linear_names(modules)}")
    spec = lora_spec(
        model, modules, rank=lora_rank, targets=targets_arg, alpha=lora_alpha, base_quant=quant, notes=tuple(notes)
    )
    return replace(model, peft=spec)


def _hf_config_of(model_arg: Optional[str]) -> Optional[dict[str, Any]]:
    """The config dict behind ``--model`` (a preset's ``[hf_config]`` or the config.json file)."""
    if model_arg is None:
        return None
    from zeroplan import profiles

    path = Path(model_arg)
    if model_arg.endswith(".json") or path.is_dir() or path.exists():
        if path.is_dir():
            path = path / "config.json"
        import json

        return json.loads(path.read_text(encoding="utf-8"))
    info = profiles.model_preset_info(model_arg)
    return info.get("hf_config")
