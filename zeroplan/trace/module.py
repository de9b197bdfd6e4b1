"""Activation bytes of any ``nn.Module``: its real forward and backward on a batch's shapes, under FakeTensorMode.

The transformer tracer (:mod:`zeroplan.trace.tracer`) builds a model from a config; a model that
is not a transformer zeroplan knows (an MLP, a CNN, a custom architecture) has no config to build
from and no formula. What the probe does have is the module the script handed to
``deepspeed.initialize`` and the first batch its forward saw. :func:`trace_module` runs that
module's own ``forward`` on fake copies of that batch's tensors, then a backward from its outputs,
with ``torch.func.functional_call`` swapping in fake parameters and buffers of the same shapes and
dtypes; no byte is allocated and nothing in the real module changes (its hooks, e.g. DeepSpeed's,
are set aside for the trace and put back).

What is counted is the measure of :meth:`zeroplan.trace.tracer.Tracer.peak`: the largest sum of
bytes alive at any op of forward and backward, over every storage an op creates — tensors saved
for backward, the outputs, activation gradients — with parameters and buffers excluded. Parameter
gradients are excluded too (each storage autograd hands to a parameter's hook is taken out of the
whole timeline): DeepSpeed moves them into its buckets and the estimator counts them as model
states and bucket terms.

The backward starts from a gradient of ones over each floating-point output: the script's loss
runs outside the module and is not traced, so what it keeps (for a mean-squared error: one
output-sized difference) is left out; its gradient arriving at the outputs is counted.

A module is traced at the first batch's size ``b`` and at ``2·b`` (the batch's tensors with their
first dimension doubled); activations of a model without cross-sample state are an affine
function of the batch, ``fixed + per_sample·b``, which :class:`ModuleActivations` extends to other
micro-batches.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from zeroplan.spec import SpecError

__all__ = ["ModuleActivations", "trace_module"]


@dataclass(frozen=True)
class ModuleActivations:
    """Traced forward + backward peak of a module at two batch sizes, and the line through them."""

    module_class: str
    """``module.QualName`` of the traced module."""
    micro_batch: int
    """Samples in the batch traced first (the script's first batch)."""
    peak_at_micro_batch: int
    """Largest live activation bytes over forward + backward at ``micro_batch``."""
    peak_at_double: int
    """The same at ``2 · micro_batch``."""
    input_shapes: tuple[tuple[int, ...], ...] = ()
    """Shapes of the batch's tensors as the forward received them."""

    def __post_init__(self) -> None:
        if self.micro_batch < 1:
            raise SpecError(f"micro_batch={self.micro_batch} is not valid; a traced batch has at least one sample")
        for name in ("peak_at_micro_batch", "peak_at_double"):
            if getattr(self, name) < 0:
                raise SpecError(f"{name}={getattr(self, name)} is not valid; bytes are >= 0")

    @property
    def per_sample(self) -> float:
        """Bytes each further sample adds (slope between the two traces; 0 if the second is not larger)."""
        return max(0.0, (self.peak_at_double - self.peak_at_micro_batch) / self.micro_batch)

    @property
    def fixed(self) -> float:
        """Bytes that do not grow with the batch (intercept, at least 0)."""
        return max(0.0, self.peak_at_micro_batch - self.per_sample * self.micro_batch)

    def bytes_at(self, micro_batch: int) -> int:
        """Activation peak at ``micro_batch`` samples: the traced value at the traced sizes, else the line."""
        if micro_batch == self.micro_batch:
            return self.peak_at_micro_batch
        if micro_batch == 2 * self.micro_batch:
            return self.peak_at_double
        return int(round(self.fixed + self.per_sample * micro_batch))

    def __call__(self, plan: Any) -> int:
        """The estimator's ``activation_bytes`` hook (:func:`zeroplan.estimator.estimate_plan`): bytes for ``plan.micro_batch``."""
        return self.bytes_at(int(plan.micro_batch))

    def describe(self) -> str:
        return (
            f"activations traced from {self.module_class.rsplit('.', 1)[-1]}'s own forward + backward on the first batch "
            f"under FakeTensorMode ({_mib(self.peak_at_micro_batch)} at micro-batch {self.micro_batch}, "
            f"{_mib(self.peak_at_double)} at {2 * self.micro_batch}), not a transformer formula"
        )

    def as_dict(self) -> dict:
        return {
            "module_class": self.module_class,
            "micro_batch": self.micro_batch,
            "peak_at_micro_batch": self.peak_at_micro_batch,
            "peak_at_double": self.peak_at_double,
            "input_shapes": [list(s) for s in self.input_shapes],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "ModuleActivations":
        return cls(
            module_class=str(data["module_class"]),
            micro_batch=int(data["micro_batch"]),
            peak_at_micro_batch=int(data["peak_at_micro_batch"]),
            peak_at_double=int(data["peak_at_double"]),
            input_shapes=tuple(tuple(int(n) for n in s) for s in data.get("input_shapes", ())),
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@contextlib.contextmanager
def _hooks_set_aside(module: Any) -> Iterator[None]:
    """Every submodule's forward/backward hooks removed for the trace (DeepSpeed's ZeRO-3 fetch
    hooks would gather real parameters) and put back afterwards, even on error."""
    names = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks", "_forward_hooks_with_kwargs",
             "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")
    saved = []
    for sub in module.modules():
        for name in names:
            value = getattr(sub, name, None)
            if isinstance(value, dict) and value:
                saved.append((sub, name, value))
                setattr(sub, name, type(value)())
    try:
        yield
    finally:
        for sub, name, value in saved:
            setattr(sub, name, value)


def _fake_like(mode: Any, tensor: Any, *, batch_factor: int = 1, requires_grad: bool = False) -> Any:
    """A fake tensor of ``tensor``'s shape (``ds_shape`` for a ZeRO-3 partitioned parameter) and
    dtype, its first dimension multiplied by ``batch_factor``."""
    import torch

    shape = list(getattr(tensor, "ds_shape", None) or tensor.shape)
    if batch_factor != 1 and shape:
        shape[0] *= batch_factor
    with mode:
        out = torch.empty(shape, dtype=tensor.dtype)
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            out = out.requires_grad_(requires_grad)
    return out


class _Lifetimes:
    """Birth and death (op index) of every storage created inside it, through a TorchDispatchMode,
    so that a peak can be computed afterwards without the storages found later to be parameter
    gradients (known only when autograd hands them to a parameter's hook)."""

    def __init__(self, excluded: set) -> None:
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        outer = self
        self.excluded = excluded
        self.ops = 0
        self.alive: dict = {}  # key -> (birth op, bytes)
        self.spans: list = []  # (key, birth, death, bytes) of storages that died
        self.gradients: set = set()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer.ops += 1
                for key in [k for k in outer.alive if k.expired()]:
                    birth, nbytes = outer.alive.pop(key)
                    outer.spans.append((key, birth, outer.ops, nbytes))
                for leaf in tree_leaves(out):
                    if isinstance(leaf, torch.Tensor):
                        key = StorageWeakRef(leaf.untyped_storage())
                        if key not in outer.excluded and key not in outer.alive:
                            outer.alive[key] = (outer.ops, leaf.untyped_storage().nbytes())
                return out

        self.mode = Mode()

    def mark_gradient(self, grad) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self.gradients.add(StorageWeakRef(grad.untyped_storage()))

    def peak(self) -> int:
        """Largest sum of live bytes at any op, parameter gradients left out."""
        spans = self.spans + [(k, b, self.ops + 1, n) for k, (b, n) in self.alive.items()]
        events: dict[int, int] = {}
        for key, birth, death, nbytes in spans:
            if key in self.gradients:
                continue
            events[birth] = events.get(birth, 0) + nbytes
            events[death] = events.get(death, 0) - nbytes
        now = best = 0
        for op in sorted(events):
            now += events[op]
            best = max(best, now)
        return best


def _peak(module: Any, args: tuple, kwargs: dict, *, batch_factor: int) -> int:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from torch.utils._pytree import tree_leaves, tree_map

    from zeroplan.trace.recording import _storage_keys

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    params = {name: _fake_like(mode, p, requires_grad=p.requires_grad) for name, p in module.named_parameters()}
    buffers = {name: _fake_like(mode, b) for name, b in module.named_buffers()}

    def fake(x: Any) -> Any:
        return _fake_like(mode, x, batch_factor=batch_factor) if isinstance(x, torch.Tensor) else x

    fake_args, fake_kwargs = tree_map(fake, args), tree_map(fake, kwargs)
    live = _Lifetimes(_storage_keys(list(params.values()) + list(buffers.values())))
    for p in params.values():
        if p.requires_grad:
            # A parameter's gradient is a model state (DeepSpeed copies it into its bucket and the
            # estimator counts it there): seen here, it is left out of the activation peak.
            p.register_hook(lambda grad: (live.mark_gradient(grad), grad)[1])
            p.register_post_accumulate_grad_hook(_drop_grad)
    with mode, torch.enable_grad(), live.mode:
        outputs = functional_call(module, {**params, **buffers}, fake_args, fake_kwargs)
        leaves = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves:
            torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
        del outputs, leaves
    return int(live.peak())


def _drop_grad(param: Any) -> None:
    param.grad = None


def trace_module(module: Any, args: tuple = (), kwargs: dict | None = None) -> ModuleActivations:
    """Trace ``module``'s forward + backward on the shapes of ``args``/``kwargs`` (the batch its
    forward received) at that batch size and at twice it; SpecError, one line, when it cannot.

    Runs with the caller's dispatch modes set aside (a probe's storage tracker must not count the
    trace) and without the module's hooks.
    """
    import torch
    from torch.utils._python_dispatch import _disable_current_modes
    from torch.utils._pytree import tree_leaves

    kwargs = kwargs or {}
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise SpecError("the first batch holds no tensor with a batch dimension; activations are not traced")
    micro = int(tensors[0].shape[0])
    name = f"{type(module).__module__}.{type(module).__qualname__}"
    try:
        with _disable_current_modes(), _hooks_set_aside(module):
            one = _peak(module, args, kwargs, batch_factor=1)
            two = _peak(module, args, kwargs, batch_factor=2)
    except SpecError:
        raise
    except Exception as exc:  # the user's forward may fail under fake tensors (data-dependent ops)
        text = str(exc).strip().splitlines()
        raise SpecError(
            f"tracing {type(module).__name__}'s forward under FakeTensorMode failed: {type(exc).__name__}: {text[0] if text else ''}"
        ) from None
    return ModuleActivations(
        module_class=name, micro_batch=max(1, micro), peak_at_micro_batch=one, peak_at_double=two,
        input_shapes=tuple(tuple(int(n) for n in t.shape) for t in tensors),
    )
