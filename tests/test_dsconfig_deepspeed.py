"""DeepSpeed itself as the truth: exported configs parse under ``DeepSpeedConfig``, the errors we
claim DeepSpeed raises on are raised by it, and our static key tables match its pydantic models.

``DeepSpeedConfig(dict)`` takes the world size from ``deepspeed.comm``; without a process group
``get_rank()`` asserts and the config silently falls back to world size 1. So the tests give it
an ``mpu`` (DeepSpeed's hook for the data-parallel size) and a ``get_rank`` that answers 0 —
exactly the path a Megatron-style launcher takes — to check any world size without launching.
"""

from __future__ import annotations

import copy
import itertools
import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402

from helpers import CASES, ROOT, run_case  # noqa: E402
from zeroplan.dsconfig import build_config, resolve_buckets, validate_config  # noqa: E402
from zeroplan.dsconfig import keys as K  # noqa: E402
from zeroplan.spec import ModelSpec, Plan, SpecError, TrainingSpec  # noqa: E402


class _DataParallelMPU:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size


@pytest.fixture
def ds_config(monkeypatch):
    """DeepSpeedConfig(cfg) as rank 0 of ``world_size`` launched ranks.

    Configs with ``sequence_parallel_size`` take DeepSpeed's no-mpu path (a torchrun launch:
    world size from ``get_world_size()``, divided by the SP size); others pass an mpu."""
    import deepspeed.comm as dist

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)

    def parse(cfg: dict, world_size: int):
        if "sequence_parallel_size" in cfg:
            monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
            return DeepSpeedConfig(copy.deepcopy(cfg))
        return DeepSpeedConfig(copy.deepcopy(cfg), mpu=_DataParallelMPU(world_size))

    return parse


def _valid_plans():
    for stage, opt, par in itertools.product(range(4), ("none", "cpu", "nvme"), ("none", "cpu", "nvme")):
        try:
            yield Plan(stage=stage, offload_optimizer=opt, offload_param=par, micro_batch=2, gradient_accumulation_steps=3,
                       checkpointing="full" if stage == 3 else "none")
        except SpecError:
            continue


PLANS = list(_valid_plans())
MODEL = ModelSpec.from_params(7e9)


def test_every_stage_offload_combination_is_covered():
    combos = {(p.stage, p.offload_optimizer, p.offload_param) for p in PLANS}
    # stage 0: none; 1–2: optimizer none/cpu; 3: optimizer × param, none/cpu/nvme each
    assert len(combos) == 1 + 2 * 2 + 9


@pytest.mark.parametrize("plan", PLANS, ids=[p.label for p in PLANS])
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("model", [None, MODEL], ids=["no-model", "7B"])
def test_export_parses_under_deepspeed_and_passes_validate(ds_config, plan, precision, model):
    world = 4
    nvme = "/local_nvme" if "nvme" in (plan.offload_optimizer, plan.offload_param) else None
    cfg = build_config(plan, world_size=world, training=TrainingSpec(precision=precision), model=model, nvme_path=nvme)

    findings = validate_config(cfg, world_size=world, model=model)
    assert not [f for f in findings if f.severity in ("error", "warning")], findings

    ds = ds_config(cfg, world)
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (2 * 3 * world, 2, 3)
    z = ds.zero_config
    assert int(z.stage) == plan.stage
    assert (z.offload_optimizer.device if z.offload_optimizer else "none") == plan.offload_optimizer
    assert (z.offload_param.device if z.offload_param else "none") == plan.offload_param
    buckets = resolve_buckets(plan, model)
    if plan.stage > 0:
        assert z.reduce_bucket_size == buckets["reduce_bucket_size"]
    if plan.stage == 3:
        assert z.prefetch_bucket_size == buckets["stage3_prefetch_bucket_size"]
        assert z.param_persistence_threshold == buckets["stage3_param_persistence_threshold"]
    assert ds.float16_config.enabled == (precision == "fp16")
    assert ds.bfloat16_config.enabled == (precision == "bf16")
    assert ds.optimizer_name == "adamw" and ds.optimizer_params["lr"] == 1e-4
    assert ds.scheduler_name == "WarmupLR"
    assert ds.activation_checkpointing_config.cpu_checkpointing is False


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd", "lion", "adafactor"])
def test_each_optimizer_exports_a_config_deepspeed_accepts(ds_config, optimizer):
    plan = Plan(stage=2, offload_optimizer="cpu", micro_batch=1)
    cfg = build_config(plan, world_size=2, training=TrainingSpec(optimizer=optimizer))
    assert not [f for f in validate_config(cfg, world_size=2) if f.severity == "error"]
    ds = ds_config(cfg, 2)
    name = cfg["optimizer"]["type"]
    # DeepSpeed lower-cases its own optimizers and looks the rest up on torch.optim by name.
    import torch

    assert ds.optimizer_name == name.lower() or hasattr(torch.optim, ds.optimizer_name)
    if optimizer == "adam":
        assert ds.optimizer_params["adam_w_mode"] is False
    if optimizer in ("sgd", "adafactor"):
        assert ds.zero_allow_untested_optimizer is True


@pytest.mark.parametrize("world", [1, 3, 8])
def test_fp16_block_matches_deepspeed_dynamic_scaling(ds_config, world):
    cfg = build_config(Plan(stage=1), world_size=world, training=TrainingSpec(precision="fp16"))
    ds = ds_config(cfg, world)
    assert ds.float16_config.loss_scale == 0  # dynamic
    assert ds.float16_config.initial_dynamic_scale() == 2**16
    assert ds.train_batch_size == world


DS_REJECTS = [c for c in CASES if c[4]]

_BATCH_ASSERT = r"train_batch_size is not equal to micro_batch_per_gpu \* gradient_acc_step \* world_size"
_STR_COMPARE = r"'>' not supported between instances of 'str' and 'int'"  # a string batch value reaches a comparison
#: How DeepSpeed 0.19 rejects each case: exception type and a pattern its message must match.
#: ``None``: a pydantic ValidationError that names the key of our finding (its path's last part).
DS_ERRORS = {
    "ZP101": (AssertionError, _BATCH_ASSERT),  # runtime/config.py _batch_assertion
    "ZP102": (AssertionError, _BATCH_ASSERT),
    "ZP106": (AssertionError, _BATCH_ASSERT),
    "ZP103": (AssertionError, "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"),
    "ZP201": (None, None),
    "ZP205": (None, None),
    "ZP206": (AssertionError, "Cannot provide deprecated parameter 'cpu_offload'"),  # config_utils.py
    "ZP207": ("ValidationError", "Partial offloading only supported for ZeRO Stage 3"),  # runtime/zero/config.py offload_ratio_check
    "ZP301": (AssertionError, "bfloat16 and fp16 modes cannot be simultaneously enabled"),
    "ZP302": (None, None),
    "ZP303": (None, None),
    "ZP401": (None, None),
    "ZP402": (None, None),
    "ZP501": (None, None),
    "ZP502": ("DeepSpeedConfigError", "has been removed"),  # _REMOVED_*_CONFIG_KEYS
    "ZP504": (TypeError, _STR_COMPARE),
    "ZP505": (TypeError, "argument after \\*\\* must be a mapping"),
    "ZP266": (TypeError, r"unsupported operand type\(s\) for /: 'int' and 'str'"),  # runtime/config.py:469
}


@pytest.mark.parametrize("rule_id,bad,good,kwargs,_", DS_REJECTS, ids=[c[0] for c in DS_REJECTS])
def test_errors_we_report_are_errors_for_deepspeed(ds_config, rule_id, bad, good, kwargs, _):
    """For every case marked "DeepSpeed rejects": DeepSpeedConfig raises on the bad config for the
    reason our finding names (its own exception and message), accepts the clean one, and our
    finding is an error (or a warning for "auto", which only the HF Trainer fills in)."""
    import re

    from deepspeed.runtime.config import DeepSpeedConfigError
    from pydantic import ValidationError

    world = kwargs.get("world_size") or 2
    ours = [f for f in run_case(bad, kwargs, clean=False) if f.rule_id == rule_id]
    with pytest.raises((AssertionError, TypeError, ValidationError, DeepSpeedConfigError)) as info:
        ds_config(bad, world)
    kind, pattern = DS_ERRORS[rule_id]
    text = str(info.value)
    if rule_id == "ZP401" and not isinstance(info.value, ValidationError):  # a string batch value, compared
        assert isinstance(info.value, TypeError) and re.search(_STR_COMPARE, text), text
    elif kind is None:
        assert isinstance(info.value, ValidationError), text
        assert any(re.search(rf"\b{re.escape(f.path.rsplit('.', 1)[-1])}\b", text) for f in ours), (text, [f.path for f in ours])
    else:
        expected = {"DeepSpeedConfigError": DeepSpeedConfigError, "ValidationError": ValidationError}.get(kind, kind)
        assert isinstance(info.value, expected) and re.search(pattern, text), (type(info.value), text)
    ds_config(good, world)
    assert {f.severity for f in ours} & ({"error", "warning"} if rule_id == "ZP504" else {"error"})


def test_sequence_parallel_divides_the_world_like_deepspeed(ds_config):
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "sequence_parallel_size": 2}
    assert ds_config(cfg, 8).world_size == 4
    assert validate_config(cfg, world_size=8) == []
    (f,) = validate_config(cfg, world_size=4)  # 2 data-parallel ranks: 8 != 2 × 1 × 2
    assert f.rule_id == "ZP101" and "4 GPUs / sequence_parallel_size 2" in f.message
    with pytest.raises(AssertionError):
        ds_config(cfg, 4)


def test_sequence_parallel_size_values_deepspeed_does_not_check(ds_config):
    """ZP266's other cases, as DeepSpeed 0.19.8 reads them: 0 divides by zero, a negative degree fails
    the batch check, and a fraction is accepted with a fractional world and train_batch_size."""
    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    with pytest.raises(ZeroDivisionError):
        ds_config({**base, "sequence_parallel_size": 0}, 4)
    with pytest.raises(AssertionError, match="Train batch size: -8.0 has to be greater than 0"):
        ds_config({**base, "sequence_parallel_size": -1}, 4)
    ds = ds_config({**base, "sequence_parallel_size": 2.5}, 4)
    assert (ds.world_size, ds.train_batch_size) == (1.6, 3.2)
    for value, said in ((0, "ZeroDivisionError"), (-1, "has to be greater than 0"), (2.5, "4 GPUs / 2.5 = 1.6")):
        (f,) = [f for f in validate_config({**base, "sequence_parallel_size": value}, world_size=4) if f.rule_id == "ZP266"]
        assert f.severity == "error" and said in f.message, f.message


def test_blog_config_fails_in_deepspeed_where_validate_says(ds_config):
    BLOG = ROOT / "tests" / "data" / "configs" / "blog_zero2_offload.json"

    from zeroplan.dsconfig import load_config

    cfg = load_config(BLOG).config
    ds = ds_config(cfg, 4)  # written for 4 GPUs: DeepSpeed parses it ...
    assert ds.zero_config.offload_param is not None and int(ds.zero_config.stage) == 2  # ... and ignores offload_param
    assert isinstance(ds.optimizer_params["lr"], str)  # the string reaches the optimizer
    with pytest.raises(AssertionError, match="128 != 4 \\* 8 \\* 8"):
        ds_config(cfg, 8)


# ------------------------------------------------------------------ static tables vs DeepSpeed


def _fields_and_aliases(model_cls) -> set[str]:
    names = set()
    for name, info in model_cls.model_fields.items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
    return names


def _int_fields(model_cls) -> dict[str, int | None]:
    import annotated_types

    out = {}
    for name, info in model_cls.model_fields.items():
        if info.annotation is not int:
            continue
        bound = None
        for meta in info.metadata:
            if isinstance(meta, annotated_types.Gt):
                bound = meta.gt + 1
            elif isinstance(meta, annotated_types.Ge):
                bound = meta.ge
        out[name] = bound
        if info.alias:
            out[info.alias] = bound
    return out


def test_zero_keys_match_deepspeed_zero_config():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert K.ZERO_KEYS == _fields_and_aliases(DeepSpeedZeroConfig)
    assert K.ZERO_INT_FIELDS == _int_fields(DeepSpeedZeroConfig)


def test_offload_and_precision_keys_match_deepspeed():
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
        OffloadDeviceEnum,
    )

    assert K.OFFLOAD_PARAM_KEYS == _fields_and_aliases(DeepSpeedZeroOffloadParamConfig)
    assert K.OFFLOAD_PARAM_INT_FIELDS == _int_fields(DeepSpeedZeroOffloadParamConfig)
    assert K.OFFLOAD_OPTIMIZER_KEYS == _fields_and_aliases(DeepSpeedZeroOffloadOptimizerConfig)
    assert K.OFFLOAD_OPTIMIZER_INT_FIELDS == _int_fields(DeepSpeedZeroOffloadOptimizerConfig)
    assert K.FP16_KEYS == _fields_and_aliases(DeepSpeedFP16Config)
    assert K.FP16_INT_FIELDS == _int_fields(DeepSpeedFP16Config)
    assert K.BF16_KEYS == _fields_and_aliases(DeepSpeedBF16Config)
    assert set(K.OFFLOAD_DEVICES) == {e.value for e in OffloadDeviceEnum}


def test_defaults_match_deepspeed_zero_config():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    z = DeepSpeedZeroConfig()
    assert K.ZERO_DEFAULTS == {
        "reduce_bucket_size": z.reduce_bucket_size,
        "allgather_bucket_size": z.allgather_bucket_size,
        "stage3_prefetch_bucket_size": z.prefetch_bucket_size,
        "stage3_param_persistence_threshold": z.param_persistence_threshold,
        "stage3_max_live_parameters": z.max_live_parameters,
        "stage3_max_reuse_distance": z.max_reuse_distance,
    }
    assert resolve_buckets(Plan(stage=3), None) == K.ZERO_DEFAULTS
    from zeroplan.spec import DEEPSPEED_DEFAULT_KNOBS  # the estimator's table

    assert DEEPSPEED_DEFAULT_KNOBS["sub_group_size"] == z.sub_group_size


def test_removed_keys_optimizers_schedulers_match_deepspeed():
    import torch
    from deepspeed.runtime import config as ds_cfg
    from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT_DEFAULT
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    assert set(K.REMOVED_TOP_LEVEL_KEYS) == set(ds_cfg._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    assert set(K.REMOVED_ZERO_KEYS) == set(ds_cfg._REMOVED_ZERO_CONFIG_KEYS)
    assert tuple(K.DEEPSPEED_OPTIMIZERS) == tuple(ds_cfg.DEEPSPEED_OPTIMIZERS)
    assert tuple(K.SCHEDULERS) == tuple(VALID_LR_SCHEDULES)
    assert K.ACTIVATION_CHECKPOINTING_KEYS == set(ACT_CHKPT_DEFAULT)
    torch_optimizers = {
        n for n in dir(torch.optim)
        if isinstance(getattr(torch.optim, n), type) and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
        and n != "Optimizer"
    }
    assert set(K.TORCH_OPTIMIZERS) == torch_optimizers
    tested = {cls.__name__ for cls in ZERO_SUPPORTED_OPTIMIZERS}
    # adam/adamw → torch Adam/AdamW, FusedAdam or DeepSpeedCPUAdam; adagrad → (CPU)Adagrad; lion → (Fused|CPU)Lion
    assert {"Adam", "AdamW", "Adagrad", "DeepSpeedCPULion", "FusedLion"} <= tested
    assert not {"SGD", "Adafactor", "FusedLamb"} & tested


def test_top_level_keys_cover_every_key_deepspeed_reads(ds_config):
    """Record every key DeepSpeedConfig looks up on the top-level dict: each must be known to us
    (or be a removed feature), else validate would call a real key unknown."""
    seen: set[str] = set()

    class Recording(dict):
        def get(self, key, *default):
            seen.add(key)
            return super().get(key, *default)

        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

        def keys(self):
            outer = self

            class _Keys:
                def __contains__(self, key):
                    seen.add(key)
                    return dict.__contains__(outer, key)

                def __iter__(self):
                    return iter(dict.keys(outer))

            return _Keys()

    DeepSpeedConfig(Recording({"train_micro_batch_size_per_gpu": 1}), mpu=_DataParallelMPU(1))
    assert len(seen) > 40
    assert seen <= K.TOP_LEVEL_KEYS | set(K.REMOVED_TOP_LEVEL_KEYS), seen - K.TOP_LEVEL_KEYS


def test_hf_integration_rule_matches_transformers():
    """resolve_buckets applies the rule transformers' Trainer uses for "auto" bucket sizes. The
    rule is run from transformers' own ``trainer_config_finalize``; the two lookups it borrows
    from accelerate (not installed here) are supplied for a plain dict."""
    hf = pytest.importorskip("transformers.integrations.deepspeed")
    from types import SimpleNamespace

    class Finalizer(hf.HfTrainerDeepSpeedConfig):
        def __init__(self, config: dict) -> None:  # skip accelerate's loader
            self.config, self.mismatches, self._dtype = config, [], None

        def find_config_node(self, ds_key_long):
            node = self.config
            *parents, key = ds_key_long.split(".")
            for part in parents:
                node = node.get(part)
                if node is None:
                    return None, key
            return node, key

        def get_value(self, ds_key_long, default=None):
            node, key = self.find_config_node(ds_key_long)
            return default if node is None else node.get(key, default)

        def is_zero3(self):
            return self.config["zero_optimization"]["stage"] == 3

    for hidden in (768, 4096, 5120, 8192):
        cfg = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                     "stage3_param_persistence_threshold": "auto"}}
        fin = Finalizer(cfg)
        fin.trainer_config_finalize(SimpleNamespace(get_warmup_steps=lambda n: 1),
                                    SimpleNamespace(config=SimpleNamespace(hidden_size=hidden)), 100)
        model = ModelSpec(name=f"h{hidden}", params=7_000_000_000, hidden_size=hidden, num_layers=32,
                          num_heads=hidden // 64, num_kv_heads=hidden // 64, ffn_size=4 * hidden, vocab_size=32000)
        ours = resolve_buckets(Plan(stage=3), model)
        z = fin.config["zero_optimization"]
        assert ours["reduce_bucket_size"] == z["reduce_bucket_size"]
        assert ours["stage3_prefetch_bucket_size"] == z["stage3_prefetch_bucket_size"]
        assert ours["stage3_param_persistence_threshold"] == z["stage3_param_persistence_threshold"]
