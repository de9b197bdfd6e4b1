"""validate_config never raises on arbitrary JSON: every input gets findings, not a traceback."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from zeroplan.dsconfig import keys as K
from zeroplan.dsconfig import validate_config
from zeroplan.dsconfig.rules import Finding
from zeroplan.spec import ModelSpec

KEYS = sorted(
    K.TOP_LEVEL_KEYS | K.ZERO_KEYS | K.OFFLOAD_PARAM_KEYS | K.OFFLOAD_OPTIMIZER_KEYS | K.FP16_KEYS | K.BF16_KEYS
    | {"type", "params", "lr", "max_grad_norm", "torch_adam", "adam_w_mode", "weight_decay", "amp", "typo_key"}
)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30), st.integers(min_value=-40, max_value=80),
    st.sampled_from([10**400, -(10**400), 1e300, 2**63, 0, 0.5]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(["auto", "1e-4", "2", "cpu", "nvme", "none", "AdamW", "sgd", ""]),
)
JSON = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.sampled_from(KEYS), children, max_size=6),
    max_leaves=25,
)
BLOCKS = st.fixed_dictionaries(
    {},
    optional={
        "train_batch_size": SCALARS, "train_micro_batch_size_per_gpu": SCALARS, "gradient_accumulation_steps": SCALARS,
        "zero_optimization": st.one_of(JSON, st.fixed_dictionaries({}, optional={
            "stage": SCALARS, "offload_param": JSON, "offload_optimizer": JSON, "reduce_bucket_size": SCALARS,
            "stage3_prefetch_bucket_size": SCALARS, "stage3_param_persistence_threshold": SCALARS})),
        "fp16": st.one_of(JSON, st.fixed_dictionaries({"enabled": st.booleans()}, optional={
            "loss_scale": SCALARS, "initial_scale_power": SCALARS, "loss_scale_window": SCALARS, "min_loss_scale": SCALARS})),
        "bf16": JSON, "optimizer": JSON, "scheduler": JSON, "activation_checkpointing": JSON,
    },
)
MODEL = ModelSpec.from_params(1e9)


def _cluster():
    from zeroplan import profiles
    from zeroplan.spec import ClusterSpec, GiB

    return ClusterSpec(gpus=8, gpus_per_node=8, gpu=profiles.load_gpu("h100-80gb"), cpu_memory_per_node_bytes=512 * GiB)


CLUSTER = _cluster()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(cfg={"fp16": {"enabled": True, "initial_scale_power": 10**9, "min_loss_scale": 10**400}}, world=None, with_model=False)
@example(cfg={"train_batch_size": 10**400, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 3}, world=None,
         with_model=True)
@example(cfg={"zero_optimization": {"stage": 3, "reduce_bucket_size": 10**400, "stage3_prefetch_bucket_size": 1e300}},
         world=8, with_model=True)
@given(cfg=BLOCKS, world=st.one_of(st.none(), st.integers(1, 4096)), with_model=st.booleans())
def test_validate_never_raises(cfg, world, with_model):
    findings = validate_config(cfg, world_size=world, model=MODEL if with_model else None,
                               cluster=CLUSTER if with_model and world else None)
    assert all(isinstance(f, Finding) and f.message and f.fix for f in findings)


CONFIG_ALPHABET = st.sampled_from(list('{}[]:,"\\/*#\n\t -+.0123456789eEaNtrufslInfy') + ["//", "/*", "*/", "true", "null", '"k"'])


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(st.text(max_size=200), st.lists(CONFIG_ALPHABET, max_size=80).map("".join)))
@example(text="{/*")  # hjson's decoder raised IndexError on a comment cut at the end
def test_parse_raises_only_spec_error(text):
    from zeroplan.dsconfig import parse_config_text
    from zeroplan.spec import SpecError

    try:
        parsed = parse_config_text(text)
    except SpecError as exc:
        assert "\n" not in str(exc)
    else:
        assert isinstance(parsed.config, dict)
        validate_config(parsed.config, world_size=2, duplicate_keys=parsed.duplicate_keys, syntax=parsed.syntax)
