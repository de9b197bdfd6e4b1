"""What the tracer runs: a Hugging Face ``config.json`` built with random weights, or a zeroplan task.

A :class:`TraceSource` knows how to build the model (inside whatever tensor mode the caller has
entered: ``FakeTensorMode`` for tracing, none for a real run), how to make a batch and how to
run forward + loss. Nothing here downloads anything: configs are read from disk and models are
built with ``from_config`` (random initialisation).

torch and transformers are imported inside functions so that importing :mod:`zeroplan.trace`
stays cheap and works without them; missing libraries raise :class:`~zeroplan.spec.SpecError`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from zeroplan.spec import SpecError

__all__ = ["TraceSource", "HFConfigSource", "TaskSource", "resolve_source", "torch_dtype"]


def torch_dtype(precision: str):
    """The dtype the model is held in during training: DeepSpeed casts the module to fp16/bf16."""
    import torch

    try:
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    except KeyError:
        raise SpecError(f"precision={precision!r} is not valid; choose bf16, fp16 or fp32") from None


def _require_torch() -> None:
    if importlib.util.find_spec("torch") is None:
        raise SpecError("activation tracing needs torch; install it (pip install 'zeroplan[runtime]')")


@dataclass
class TraceSource:
    """Base class: a model the tracer can build and run. Subclasses fill in the three methods."""

    name: str
    """Shown in reports: config path or task script."""

    def build(self, *, precision: str, flash_attention: bool) -> Any:
        """Build the model (train mode) in the training dtype under the caller's tensor mode."""
        raise NotImplementedError

    def blocks(self, model: Any) -> list:
        """The repeated transformer blocks, in execution order."""
        return find_blocks(model)

    def make_batch(self, model: Any, *, micro_batch: int, seq_len: int) -> Any:
        """A batch of ``micro_batch`` × ``seq_len`` tokens (random ids) under the caller's mode."""
        raise NotImplementedError

    def forward_loss(self, model: Any, batch: Any) -> tuple[Any, Any]:
        """Run forward and the loss; returns ``(loss, other outputs kept alive by the caller)``."""
        raise NotImplementedError

    def eager_attention(self, module: Any) -> Callable | None:
        """The model's own eager attention function for ``module`` (None: not an HF model)."""
        return None

    @property
    def fixed_seq_len(self) -> int | None:
        """Sequence length the source always uses (a task's), or None when any length can be traced."""
        return None


def find_blocks(model: Any) -> list:
    """The transformer blocks: the ``nn.ModuleList`` holding the most parameters whose children share one class.

    Works for GPT-2 (``transformer.h``), Llama/Qwen2/Mistral (``model.layers``) and plain
    PyTorch models that keep their blocks in a ModuleList.
    """
    import torch

    best, best_params = None, -1
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            kinds = {type(child) for child in module}
            if len(kinds) != 1:
                continue
            n = sum(p.numel() for p in module.parameters())
            if n > best_params:
                best, best_params = module, n
    if best is None:
        raise SpecError(
            f"cannot find the transformer blocks of {type(model).__name__}: no nn.ModuleList of identical blocks"
        )
    return list(best)


@dataclass
class HFConfigSource(TraceSource):
    """A Hugging Face ``config.json`` (or a folder holding one), built with ``AutoModelForCausalLM.from_config``."""

    config: dict = field(default_factory=dict)
    """The parsed JSON."""

    @classmethod
    def from_path(cls, path: str | Path) -> "HFConfigSource":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise SpecError(f"model config {path} does not exist; give a Hugging Face config.json")
        try:
            config = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SpecError(f"model config {path} is not readable JSON ({exc})") from None
        if not isinstance(config, dict):
            raise SpecError(f"model config {path} is not a JSON object")
        if "model_type" not in config:
            raise SpecError(f"model config {path} has no 'model_type'; it is not a Hugging Face config.json")
        return cls(name=str(path), config=config)

    def _hf_config(self, *, flash_attention: bool):
        if importlib.util.find_spec("transformers") is None:
            raise SpecError(
                "--trace needs the transformers library to build the model; install it "
                "(pip install 'zeroplan[trace]') or drop --trace to use the formula"
            )
        _require_torch()
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        model_type = self.config["model_type"]
        if model_type not in CONFIG_MAPPING:
            raise SpecError(
                f"model_type {model_type!r} in {self.name} is unknown to transformers; "
                "give a config of a model transformers implements (gpt2, llama, qwen2, mistral, ...)"
            )
        kwargs = {k: v for k, v in self.config.items() if k not in ("model_type", "transformers_version", "architectures")}
        # Quantisation and remote code would need downloads or kernels; the shape is all we need.
        kwargs.pop("quantization_config", None)
        kwargs.pop("auto_map", None)
        try:
            cfg = AutoConfig.for_model(model_type, **kwargs)
        except Exception as exc:  # transformers raises many types for bad configs
            raise SpecError(f"model config {self.name} does not build a {model_type} config: {_one_line(exc)}") from None
        cfg.use_cache = False
        # Tied configs for multimodal wrappers keep the text model under text_config.
        return cfg

    def build(self, *, precision: str, flash_attention: bool) -> Any:
        # _hf_config first: it says which package is missing before anything imports it.
        cfg = self._hf_config(flash_attention=flash_attention)
        import torch
        from transformers import AutoModelForCausalLM

        dtype = torch_dtype(precision)
        try:
            model = AutoModelForCausalLM.from_config(
                cfg, dtype=dtype, attn_implementation="sdpa" if flash_attention else "eager"
            )
        except SpecError:
            raise
        except Exception as exc:
            raise SpecError(f"model config {self.name} fails to build a causal LM: {_one_line(exc)}") from None
        model.train()
        return model

    def make_batch(self, model: Any, *, micro_batch: int, seq_len: int) -> Any:
        import torch

        vocab = int(model.config.vocab_size)
        ids = torch.randint(0, vocab, (micro_batch, seq_len))
        return {"input_ids": ids, "labels": ids}

    def forward_loss(self, model: Any, batch: Any) -> tuple[Any, Any]:
        with _unpacked_sequences():
            out = model(**batch, use_cache=False)
        return out.loss, out.logits

    def eager_attention(self, module: Any) -> Callable | None:
        mod = sys.modules.get(type(module).__module__)
        fn = getattr(mod, "eager_attention_forward", None)
        if fn is None:
            from transformers.integrations import sdpa_attention  # noqa: F401  (makes the error below precise)

            raise SpecError(
                f"{type(module).__name__} has no eager_attention_forward; trace it with flash_attention=True"
            )
        return fn


@dataclass
class TaskSource(TraceSource):
    """A zeroplan task script (``zeroplan_task()`` returns a :class:`zeroplan.spec.task.Task`; loaded
    by :func:`zeroplan.spec.task.load_task`, as the probe worker loads it).

    A task fixes its own sequence length (``Task.seq_len``; its batches come from
    ``make_batch(micro_batch, step, rank)``), so it is traced at that length only.
    """

    task: Any = None
    """The Task object."""

    @classmethod
    def from_path(cls, path: str | Path, args: tuple[str, ...] = ()) -> "TaskSource":
        _require_torch()
        path = Path(path)
        if not path.is_file():
            raise SpecError(f"task script {path} does not exist")
        from zeroplan.spec.task import NotATask, load_task

        try:
            task = load_task(path, args)
        except NotATask as exc:
            raise SpecError(f"{exc}; see examples/gpt_task.py") from None
        except SpecError:
            raise
        except Exception as exc:
            raise SpecError(f"task script {path} fails to load: {_one_line(exc)}") from None
        return cls(name=str(path), task=task)

    @property
    def fixed_seq_len(self) -> int | None:
        return getattr(self.task, "seq_len", None)

    def build(self, *, precision: str, flash_attention: bool) -> Any:
        import torch

        dtype = torch_dtype(precision)
        # DeepSpeed and FSDP mixed precision hold the module in the training dtype. Building it
        # in that default dtype avoids Module.to(), which cannot swap fake parameters.
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = self.task.build_model()
        finally:
            torch.set_default_dtype(previous)
        if any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
            model = model.to(dtype)
        model.train()
        return model

    def blocks(self, model: Any) -> list:
        if getattr(self.task, "blocks", None) is not None:
            return list(self.task.blocks(model))
        return find_blocks(model)

    def make_batch(self, model: Any, *, micro_batch: int, seq_len: int) -> Any:
        if self.fixed_seq_len is not None and seq_len != self.fixed_seq_len:
            raise SpecError(
                f"task {self.name} has seq_len {self.fixed_seq_len}; it cannot be traced at seq_len {seq_len}"
            )
        return self.task.make_batch(micro_batch, 0, 0)

    def forward_loss(self, model: Any, batch: Any) -> tuple[Any, Any]:
        return self.task.loss_fn(model, batch), None


@contextlib.contextmanager
def _unpacked_sequences():
    """Tell transformers' mask builder that our batches are not packed sequences.

    ``masking_utils.find_packed_sequence_indices`` reads the position ids to detect packing; on
    fake tensors it cannot read them and assumes packing, which materialises a causal mask and
    turns off SDPA's ``is_causal`` path and GQA. Our batches are plain ``arange`` positions, for
    which the real function returns None, so return None without reading them.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def resolve_source(source: "str | Path | TraceSource") -> TraceSource:
    """A path to ``config.json`` (or its folder) → :class:`HFConfigSource`; a ``.py`` → :class:`TaskSource`."""
    if isinstance(source, TraceSource):
        return source
    path = Path(source)
    if path.suffix == ".py":
        return TaskSource.from_path(path)
    return HFConfigSource.from_path(path)
