"""Results built without their dataclass ``__init__`` (zeroplan/estimator/frozen.py) are the
instances the ``__init__`` makes: every field set, nothing else (but cached properties' values),
equal to the class's own."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from zeroplan.estimator import enumerate_plans, estimate_all
from zeroplan.estimator.frozen import built, once
from zeroplan.estimator.plan_estimate import GpuMemory
from zeroplan.profiles import load_gpu
from zeroplan.spec import ClusterSpec, GiB, ModelSpec, TrainingSpec


def _dataclass_objects(obj, seen):
    """Every dataclass instance reachable from ``obj`` through fields, tuples, lists and dict values."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        yield obj
        for f in dataclasses.fields(obj):
            yield from _dataclass_objects(getattr(obj, f.name), seen)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _dataclass_objects(item, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _dataclass_objects(item, seen)


@pytest.mark.parametrize("options", [dict(), dict(device="cpu"), dict(expandable_segments=True), dict(engine="fsdp")])
def test_every_result_an_estimate_builds_has_exactly_its_fields(options):
    model = ModelSpec.from_params(7e9)
    cluster = ClusterSpec(gpus=16, gpus_per_node=8, gpu=load_gpu("a100-80gb"), cpu_memory_per_node_bytes=512 * GiB)
    training = TrainingSpec()
    seen: set[int] = set()
    classes = set()
    plans = enumerate_plans(model, cluster, training, engine=options.get("engine", "deepspeed"))
    for est in estimate_all(model, cluster, training, plans, **options):
        for obj in _dataclass_objects(est, seen):
            names = {f.name for f in dataclasses.fields(obj)}
            # Beyond its fields, an instance holds only the values its cached properties computed.
            extra = set(vars(obj)) - names
            assert names <= set(vars(obj)), type(obj).__name__
            assert all(isinstance(getattr(type(obj), k, None), (functools.cached_property, once)) for k in extra), (type(obj).__name__, extra)
            assert obj == dataclasses.replace(obj), type(obj).__name__  # the class's own __init__, same fields
            classes.add(type(obj).__name__)
    assert {"PlanEstimate", "GpuMemory", "StepTime", "PlanVerdict", "Headroom"} <= classes


def test_built_is_the_class_instance_and_checks_its_names():
    values = dict(params=1, gradients=2, optimizer_states=3, activations=4, overhead=5, total=6, peak_allocated=7)
    made = built(GpuMemory, **values)
    assert made == GpuMemory(**values) and repr(made) == repr(GpuMemory(**values)) and hash(made) == hash(GpuMemory(**values))
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.total = 0
    with pytest.raises(TypeError, match="missing"):
        built(GpuMemory, params=1)
    with pytest.raises(TypeError, match="unknown"):
        built(GpuMemory, bogus=1, **values)
