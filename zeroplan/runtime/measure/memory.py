"""Peak memory of one rank: CUDA's allocator counter, or live tensor storage bytes on CPU.

On CPU there is no allocator counter, so :class:`StorageTracker` watches every tensor an aten op
returns (a ``TorchDispatchMode``) and counts each untyped storage once, from the op that created
it until its last reference dies (a weakref callback) — the same accounting as
torch.distributed._tools.mem_tracker, without its per-module bookkeeping. Storage resizes (FSDP2
frees and re-allocates unsharded parameters with ``UntypedStorage.resize_``, which no dispatch
mode sees) are tracked by wrapping ``resize_``. Live storages that existed before the tracker
started can be added with :meth:`StorageTracker.track`.

A GPU run holds only part of a process's tensors on the device: what the engine moves there and
what is allocated on it. :meth:`StorageTracker.keep_on_device`, which the probe worker calls at
the first ``deepspeed.initialize``, keeps counting the model's tensors (:func:`device_roots`) and
sets every other live storage aside as host memory (a dataset built before the model), as
``module.to(device)`` would leave it.

Not counted: transient buffers inside one C++ kernel, memory owned by communication libraries,
the Python heap. The counter is therefore a lower bound of the process RSS, but it is the same
quantity as CUDA's ``max_memory_allocated`` (bytes of live tensors), which is what the estimator
predicts.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["StorageTracker", "PeakMemory", "device_roots", "storages_of"]


def storages_of(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """Untyped storages behind ``t``, looking through wrapper subclasses (DTensor, ...)."""
    out, todo = [], [t]
    while todo:
        obj = todo.pop()
        if is_traceable_wrapper_subclass(obj):
            attrs, _ = obj.__tensor_flatten__()
            todo.extend(v for v in (getattr(obj, a) for a in attrs) if isinstance(v, torch.Tensor))
        elif isinstance(obj, torch.Tensor) and obj.layout == torch.strided and obj.device.type != "meta":
            try:
                out.append(obj.untyped_storage())
            except (RuntimeError, NotImplementedError):  # e.g. functional tensors without storage
                continue
    return out


def device_roots(model: object, optimizer: object = None) -> list:
    """The model's parameters and buffers — what ``module.to(device)`` moves — with the ZeRO-3
    partitions ``zero.Init`` keeps beside each parameter (``ds_tensor``), and a client optimizer's
    state tensors. Anything else the script holds is host memory on a GPU."""
    roots: list = []
    if model is not None and callable(getattr(model, "parameters", None)):
        for p in model.parameters():
            roots.append(p)
            partition = getattr(p, "ds_tensor", None)
            if partition is not None:
                roots.append(partition)
            # Quantised parameters move their side tensors with them (bitsandbytes' Params4bit
            # ``quant_state`` absmax/code, nested state2; Int8Params' CB/SCB).
            roots.extend(_side_tensors(p))
        buffers = getattr(model, "buffers", None)
        if callable(buffers):
            roots.extend(buffers())
    state = getattr(optimizer, "state", None)
    if isinstance(state, dict):
        for per_param in state.values():
            if isinstance(per_param, dict):
                roots.extend(per_param.values())
    return roots


def _side_tensors(param: object, depth: int = 2) -> list:
    """Tensors a parameter object keeps in its attributes (and, ``depth`` levels down, in
    attribute objects such as bitsandbytes' ``QuantState``)."""
    found: list = []
    for value in getattr(param, "__dict__", {}).values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, type):
            found.extend(_side_tensors(value, depth - 1))
    return found


class StorageTracker(TorchDispatchMode):
    """Current and peak bytes of live tensor storage on one device type (default: CPU)."""

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        self.device_type = device_type
        self.current_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict = {}  # id(storage), or ("moved", id(tensor)) for a host tensor moved to the device -> counted bytes
        self._refs: dict = {}
        self._lock = threading.Lock()
        self._orig_resize = None
        self._orig_to = None
        self._orig_cuda = None
        self._host: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (ref, bytes): kept on the host by a GPU run
        self.host_bytes = 0
        """Bytes of live storages set aside as host memory by :meth:`keep_on_device` (not counted)."""

    # -- accounting -------------------------------------------------------------------------
    def _forget(self, key: int) -> None:
        with self._lock:
            self._refs.pop(key, None)
            self.current_bytes -= self._sizes.pop(key, 0)

    def _add(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        if key in self._refs or key in self._host:
            return
        nbytes = st.nbytes()
        try:
            ref = weakref.ref(st, lambda _r, key=key: self._forget(key))
        except TypeError:  # storage type without weakref support: cannot know when it dies
            return
        self._count(key, ref, nbytes)

    def track(self, *tensors: object) -> None:
        """Count the storages of ``tensors`` (any pytree of tensors) if not counted yet."""
        for leaf in tree_leaves(tensors):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == self.device_type:
                for st in storages_of(leaf):
                    self._add(st)

    def keep_on_device(self, *roots: object) -> int:
        """From now on count only what a GPU run would hold on the device: the storages of ``roots``
        (any pytree of tensors: the model's parameters and buffers, an optimizer's states) and every
        storage created from here on. Storages alive now and not among ``roots`` — a dataset, a
        tokenised corpus, anything else the script built on the host before its engine — are set
        aside as host memory, and the peak restarts from what is left.

        The rule is what ``deepspeed.initialize`` does on a GPU: ``module.to(device)`` moves the
        module's parameters and buffers (deepspeed/runtime/engine.py ``_configure_distributed_model``,
        ``self.module.to(self.device)``) and nothing else. A host tensor the script later moves
        with ``.to(device)``/``.cuda()`` — on CPU a no-op that allocates nothing — is counted from
        that call for its own bytes, as long as it lives (:meth:`_moved`). Returns the bytes set aside.
        """
        keep = {id(st) for leaf in tree_leaves(roots) if isinstance(leaf, torch.Tensor) for st in storages_of(leaf)}
        with self._lock:
            for key in [k for k in self._refs if k not in keep]:
                st = self._refs.pop(key)()
                nbytes = self._sizes.pop(key, 0)
                self.current_bytes -= nbytes
                if st is None:
                    continue
                self._host[key] = (weakref.ref(st, lambda _r, key=key: self._forget_host(key)), nbytes)
                self.host_bytes += nbytes
            self.peak_bytes = self.current_bytes
        return self.host_bytes

    def move_to_device(self, *roots: object) -> None:
        """A later ``deepspeed.initialize`` (after :meth:`keep_on_device`): the storages of ``roots``
        that were set aside as host memory are counted again from now on — that engine's
        ``module.to(device)`` moves them (a TRL policy built before its reference model's engine,
        trl/models/utils.py ``prepare_deepspeed``, stays on the host until its own engine)."""
        for leaf in tree_leaves(roots):
            if not isinstance(leaf, torch.Tensor):
                continue
            for st in storages_of(leaf):
                key = id(st)
                with self._lock:
                    entry = self._host.pop(key, None)
                    if entry is None:
                        continue
                    self.host_bytes -= entry[1]
                self._add(st)

    def _forget_host(self, key: int) -> None:
        with self._lock:
            entry = self._host.pop(key, None)
            if entry is not None:
                self.host_bytes -= entry[1]

    def _moved(self, tensor: object) -> None:
        """A tensor on host storage moved to the device: on a GPU that is a new allocation of the
        tensor's own bytes (a row of a dataset, not the dataset), alive as long as the tensor."""
        if not self._host or not isinstance(tensor, torch.Tensor):
            return
        if not any(id(st) in self._host for st in storages_of(tensor)):
            return
        key = ("moved", id(tensor))
        if key in self._refs:
            return
        nbytes = tensor.numel() * tensor.element_size()
        try:
            ref = weakref.ref(tensor, lambda _r, key=key: self._forget(key))
        except TypeError:
            return
        self._count(key, ref, nbytes)

    def _count(self, key: object, ref: object, nbytes: int) -> None:
        """Count ``nbytes`` alive under ``key`` (``ref`` forgets it when its object dies)."""
        with self._lock:
            self._refs[key] = ref
            self._sizes[key] = nbytes
            self.current_bytes += nbytes
            if self.current_bytes > self.peak_bytes:
                self.peak_bytes = self.current_bytes

    def reset_peak(self) -> None:
        """Start a new peak window from the current live bytes."""
        self.peak_bytes = self.current_bytes

    # -- hooks ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(out)
        # In-place and out= ops return their (maybe pre-existing) argument: covered above.
        return out

    def _resize(self, st: torch.UntypedStorage, size: int):
        result = self._orig_resize(st, size)
        key = id(st)
        if key in self._refs:
            with self._lock:
                new = st.nbytes()
                self.current_bytes += new - self._sizes.get(key, 0)
                self._sizes[key] = new
                if self.current_bytes > self.peak_bytes:
                    self.peak_bytes = self.current_bytes
        elif st.device.type == self.device_type:
            self._add(st)
        return result

    def __enter__(self):
        # The mode's first op imports torch._dynamo (torch/_compile.py ``_disable_dynamo``). Under
        # ``deepspeed.zero.Init``, which replaces ``torch.Tensor.__new__``, that import fails in
        # dynamo's polyfills ("Signature mismatch ... tensor_pynew"); a plain run imports dynamo
        # only at its first optimizer, outside zero.Init. Import it here, before any user code.
        import torch._dynamo  # noqa: F401

        self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            return tracker._resize(st, size)

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._orig_to, self._orig_cuda = torch.Tensor.to, torch.Tensor.cuda
        orig_to, orig_cuda = self._orig_to, self._orig_cuda

        def to(t, *args, **kwargs):
            out = orig_to(t, *args, **kwargs)
            if tracker._host and (kwargs.get("device") is not None or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args)):
                tracker._moved(out)
            return out

        def cuda(t, *args, **kwargs):
            out = orig_cuda(t, *args, **kwargs)
            tracker._moved(out)
            return out

        torch.Tensor.to, torch.Tensor.cuda = to, cuda  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        torch.Tensor.to, torch.Tensor.cuda = self._orig_to, self._orig_cuda  # type: ignore[method-assign]
        return super().__exit__(*exc)


class PeakMemory:
    """Peak memory of this rank: ``torch.cuda.max_memory_allocated`` on CUDA, else a StorageTracker.

    Use as a context manager around everything the rank does (model build included).
    ``track_cpu=False`` measures nothing on CPU. The tracker's per-op Python hook slows CPU steps,
    so a probe ends it with :meth:`stop_tracking` once warm-up is over (see docs/probe.md).
    """

    def __init__(self, device: torch.device | None = None, *, track_cpu: bool = True) -> None:
        on_cuda = (device is not None and device.type == "cuda") or (device is None and torch.cuda.is_available())
        self.kind = "cuda" if on_cuda else "cpu-storage" if track_cpu else None
        self.tracker = StorageTracker("cpu") if self.kind == "cpu-storage" else None
        self._stopped = False

    def __enter__(self) -> "PeakMemory":
        if self.tracker is not None:
            self.tracker.__enter__()
        elif self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_tracking()

    def keep_on_device(self, *roots: object) -> int | None:
        """CPU tracker: :meth:`StorageTracker.keep_on_device` (count only what a GPU run would hold
        on the device from now on; returns the bytes set aside as host memory). No-op on CUDA,
        where the allocator sees device memory only, and once tracking has stopped."""
        if self.tracker is None or self._stopped:
            return None
        return self.tracker.keep_on_device(*roots)

    def move_to_device(self, *roots: object) -> None:
        """CPU tracker: :meth:`StorageTracker.move_to_device`; no-op on CUDA and once stopped."""
        if self.tracker is not None and not self._stopped:
            self.tracker.move_to_device(*roots)

    @property
    def tracking(self) -> bool:
        """True while the CPU tracker counts (until :meth:`stop_tracking`); False on CUDA."""
        return self.tracker is not None and not self._stopped

    def stop_tracking(self) -> None:
        """End the CPU tracker now (idempotent): its per-op hook stops costing time, and ``peak_bytes``
        keeps the peak seen so far. The probe calls it when warm-up ends, so timed steps run untouched
        (CUDA's counters cost nothing and keep running)."""
        if self.tracker is not None and not self._stopped:
            self._stopped = True
            self.tracker.__exit__(None, None, None)

    @property
    def peak_bytes(self) -> int | None:
        if self.tracker is not None:
            return int(self.tracker.peak_bytes)
        return int(torch.cuda.max_memory_allocated()) if self.kind == "cuda" else None

    @property
    def current_bytes(self) -> int | None:
        if self.tracker is not None:
            return int(self.tracker.current_bytes)
        return int(torch.cuda.memory_allocated()) if self.kind == "cuda" else None
