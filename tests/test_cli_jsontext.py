"""dumps_indented writes exactly json.dumps(obj, indent=2, default=str)."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from zeroplan.cli.jsontext import dumps_indented

_LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text()
_DOCS = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(_DOCS, st.integers(min_value=0, max_value=4))
def test_same_text_as_json_dumps(doc, indent):
    assert dumps_indented(doc, indent=indent) == json.dumps(doc, indent=indent, default=str)


def test_values_json_converts_are_left_to_it():
    doc = {"path": Path("/tmp/x"), 3: "int key", "nested": [{"b": b"x".decode()}], "flag": True}
    assert dumps_indented(doc) == json.dumps(doc, indent=2, default=str)


def test_an_estimate_document_is_unchanged():
    from zeroplan.cli.estimate import estimates_to_json
    from zeroplan.estimator import enumerate_plans, estimate_all
    from zeroplan.profiles import load_gpu, load_model_preset
    from zeroplan.spec import ClusterSpec, GiB, TrainingSpec

    model = load_model_preset("llama-2-7b")
    cluster = ClusterSpec(gpus=8, gpus_per_node=8, gpu=load_gpu("a100-80gb"), gpu_memory_bytes=80 * GiB, cpu_memory_per_node_bytes=512 * GiB)
    training = TrainingSpec()
    doc = estimates_to_json(model, cluster, training, estimate_all(model, cluster, training, enumerate_plans(model, cluster, training)))
    assert dumps_indented(doc) == json.dumps(doc, indent=2, default=str)
