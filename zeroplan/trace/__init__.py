"""Traced activation memory: saved-for-backward bytes of a real model, counted under FakeTensorMode.

Importing this package does not import torch or transformers; the functions do, when called.
"""

from zeroplan.trace.fit import ActivationFit, ActivationModel, fit_activation_model
from zeroplan.trace.module import ModuleActivations, trace_module
from zeroplan.trace.override import TracedActivationOverride, activation_override
from zeroplan.trace.source import HFConfigSource, TaskSource, TraceSource, resolve_source
from zeroplan.trace.tracer import PeakActivations, TracedActivations, Tracer, trace_activations

__all__ = [
    "ActivationFit",
    "ActivationModel",
    "HFConfigSource",
    "ModuleActivations",
    "PeakActivations",
    "TaskSource",
    "TraceSource",
    "TracedActivationOverride",
    "TracedActivations",
    "Tracer",
    "activation_override",
    "fit_activation_model",
    "resolve_source",
    "trace_activations",
    "trace_module",
]
