"""How the tracer records: a saved-tensor hook that counts each storage once by region, a
dispatch mode that follows live storages for peaks, attention and checkpointing made to behave as
on the device (flash/eager attention, selective and full recomputation), and block regions.
Used by :class:`zeroplan.trace.tracer.Tracer` and :mod:`zeroplan.trace.measure`."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from zeroplan.trace.source import TraceSource

__all__: list[str] = []


class _Recorder:
    """Pack hook that counts each saved storage once, by the region active when it is first saved."""

    def __init__(self, excluded_keys: set) -> None:
        self.excluded = excluded_keys
        self.region: Any = "embeddings"
        self.bytes_by_region: dict[Any, int] = {}
        self._seen: set = set()
        # Holding the storages keeps their ids from being reused by later allocations.
        self._keep: list = []

    def add(self, tensor: Any) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        storage = tensor.untyped_storage()
        key = StorageWeakRef(storage)
        if key in self.excluded or key in self._seen:
            return
        self._seen.add(key)
        self._keep.append(storage)
        self.bytes_by_region[self.region] = self.bytes_by_region.get(self.region, 0) + storage.nbytes()

    def pack(self, tensor: Any) -> Any:
        self.add(tensor)
        return tensor

    @staticmethod
    def unpack(tensor: Any) -> Any:
        return tensor


def _hold(recorder: _Recorder, *objects: Any) -> None:
    """Count tensors a checkpoint keeps alive through its closure (keyword arguments, masks).

    Reentrant checkpoint saves only its positional tensor inputs through autograd; everything
    else the recomputation needs stays referenced by the closure until backward.
    """
    import torch
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(list(objects)):
        if isinstance(leaf, torch.Tensor):
            recorder.add(leaf)


def _drop_grad(param: Any) -> None:
    param.grad = None


class _LiveStorages:
    """Context manager around a TorchDispatchMode that tracks the bytes of storages created inside it."""

    def __init__(self, excluded: set) -> None:
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        outer = self
        self.excluded = excluded
        self.entries: dict = {}
        self.peak = 0
        self.peak_op = ""
        self.phase = "forward"
        self.peak_phase = "forward"

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for leaf in tree_leaves(out):
                    if isinstance(leaf, torch.Tensor):
                        key = StorageWeakRef(leaf.untyped_storage())
                        if key not in outer.excluded and key not in outer.entries:
                            outer.entries[key] = leaf.untyped_storage().nbytes()
                now = outer.current()
                if now > outer.peak:
                    outer.peak, outer.peak_op, outer.peak_phase = now, str(func), outer.phase
                return out

        self._mode = Mode()

    def current(self) -> int:
        """Bytes of tracked storages still alive (expired ones are forgotten)."""
        dead = [key for key in self.entries if key.expired()]
        for key in dead:
            del self.entries[key]
        return sum(self.entries.values())

    def __enter__(self) -> "_LiveStorages":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


def _storage_keys(tensors) -> set:
    from torch.multiprocessing.reductions import StorageWeakRef

    return {StorageWeakRef(t.untyped_storage()) for t in tensors}


# ---------------------------------------------------------------------------------------------
# device-faithful ops and the attention core


def _device_faithful_mode(*, flash_attention: bool, selective: bool, recorder: _Recorder):
    """A TorchFunctionMode that makes CPU ops keep what their CUDA counterparts keep (see module doc)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.overrides import TorchFunctionMode

    sdpa = F.scaled_dot_product_attention

    class DeviceFaithful(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.dropout:
                return _native_dropout(*args, **kwargs)
            if func is sdpa:
                return _attention(*args, **kwargs)
            return func(*args, **kwargs)

    def _native_dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return input
        return torch.native_dropout(input, p, True)[0]

    def _sdpa_call(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if flash_attention:
            # CUDA's flash kernel keeps q, k, v, out and the log-sum-exp, and regenerates the
            # dropout mask from a seed: run the CPU flash kernel without dropout to get exactly that.
            try:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
            except RuntimeError:
                return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        with sdpa_kernel([SDPBackend.MATH]):
            return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    def _attention(q, k, v, *args, **kwargs):
        def core(q_, k_, v_):
            return _sdpa_call(q_, k_, v_, *args, **kwargs)

        return _in_attention_core(recorder, selective, core, q, k, v, closure=(args, kwargs))

    return DeviceFaithful()


def _in_attention_core(recorder: _Recorder, selective: bool, core, *tensors, closure: Any = ()):
    """Run the attention core in its own region; with ``selective``, under reentrant checkpoint."""
    import torch.utils.checkpoint as ckpt

    outer = recorder.region
    recorder.region = ("attention", outer)
    try:
        if selective:
            _hold(recorder, closure)
            return ckpt.checkpoint(core, *tensors, use_reentrant=True)
        return core(*tensors)
    finally:
        recorder.region = outer


@contextlib.contextmanager
def _hf_eager_attention(source: TraceSource, recorder: _Recorder, *, selective: bool) -> Iterator[None]:
    """Route Hugging Face eager attention through :func:`_in_attention_core` while tracing.

    HF attention modules look their kernel up in ``AttentionInterface`` (falling back to the
    model file's ``eager_attention_forward``); an ``eager`` entry there is used first, so adding
    one for the duration of the trace wraps every layer's attention core.
    """
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        yield
        return
    mapping = AttentionInterface._global_mapping
    had = "eager" in mapping
    previous = mapping.get("eager")

    def eager(module, query, key, value, attention_mask, **kwargs):
        fn = source.eager_attention(module)

        def core(q_, k_, v_):
            return fn(module, q_, k_, v_, attention_mask, **kwargs)

        return _in_attention_core(recorder, selective, core, query, key, value, closure=(attention_mask, kwargs))

    mapping["eager"] = eager
    try:
        yield
    finally:
        if had:
            mapping["eager"] = previous
        else:
            mapping.pop("eager", None)


@contextlib.contextmanager
def _block_regions(blocks: list, recorder: _Recorder, *, full: bool) -> Iterator[None]:
    """Attribute saves to blocks; with ``full`` checkpoint every block (reentrant, inputs saved)."""
    import torch.utils.checkpoint as ckpt

    handles = []
    patched = []
    last = len(blocks) - 1
    for i, block in enumerate(blocks):

        def pre(_module, _args, _i=i):
            recorder.region = ("layer", _i)

        def post(_module, _args, _output, _i=i):
            recorder.region = "logits" if _i == last else ("layer", _i)

        handles.append(block.register_forward_pre_hook(pre))
        handles.append(block.register_forward_hook(post))
        if full:
            original = block.forward

            def checkpointed(*args, _original=original, **kwargs):
                def run(*a):
                    return _original(*a, **kwargs)

                _hold(recorder, kwargs)
                return ckpt.checkpoint(run, *args, use_reentrant=True)

            block.forward = checkpointed
            patched.append(block)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for block in patched:
            del block.forward


# ---------------------------------------------------------------------------------------------
# the tracer


def _enter_device_modes(
    stack: contextlib.ExitStack, *, blocks: list, source: TraceSource, recorder: _Recorder, checkpointing: str, flash_attention: bool
) -> None:
    """Enter, on ``stack``, what every trace and measurement of a step runs under: grad mode, the
    block regions (full recomputation), the eager attention regions (selective) and the
    device-faithful kernels for ``checkpointing`` (a traced mode)."""
    import torch

    stack.enter_context(torch.enable_grad())
    stack.enter_context(_block_regions(blocks, recorder, full=checkpointing == "full"))
    stack.enter_context(_hf_eager_attention(source, recorder, selective=checkpointing == "attention"))
    stack.enter_context(_device_faithful_mode(flash_attention=flash_attention, selective=checkpointing == "attention", recorder=recorder))
