"""The engine's GPU allocations on an ordered step timeline: each item alive from one event to another.

Pure data and arithmetic (stdlib only). A DeepSpeed step is a sequence of events (:data:`STEP_EVENTS`,
in the order they happen); every engine allocation beyond the activations is a
:class:`TimelineItem` — a name, its bytes, the event it is allocated at and the last event it is
still alive at — and the moments a peak can happen at (:func:`~zeroplan.estimator.moments.deepspeed_moments`)
are computed from it: at each event, the items alive then plus that event's activations. So a new
term (an all-to-all buffer, an expert gather) is one item with its span, not a new field and not a
new branch in the moments; the largest moment is found, never declared.

Where the items come from (DeepSpeed 0.19 source, cited per item in
:func:`~zeroplan.estimator.memory.engine_overhead`):

* :class:`EngineOverhead`'s named dicts (``always``, ``during_backward``, …) are the spellings the
  estimator has always used; :data:`FIELD_SPANS` maps each to its span — one table, so an item
  written into a field lands on the timeline. New code adds :class:`TimelineItem` objects to
  ``EngineOverhead.timeline_items`` with their own span.
* model-state bytes DeepSpeed allocates part of the way through (``deferred``: the stage 1–2
  gradient partition, stage 0's ``param.grad``) are :data:`STATE` items: before their first event
  they are absent from the model states, a credit at those moments.

PyTorch's ``MemTracker`` and the CUDA snapshot records carry the same (name, bytes, allocated,
freed) shape; here the clock is the step's events, each measured on real engines
(docs/notes/memory-gaps.md; the events and what is alive at each: :mod:`zeroplan.estimator.moments`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

__all__ = [
    "AFTER_BACKWARD", "EMBEDDING", "ENGINE_START", "EPILOGUE", "EngineOverhead", "FIELD_SPANS", "FIRST_FLUSH", "FIRST_HOOK",
    "GROWN", "LAST_BLOCK", "LISTING_ORDER", "LOSS_BACKWARD", "REBUILD", "STATE", "STEP", "STEP_EVENTS", "Timeline",
    "TimelineItem", "UNALLOCATED",
]

#: Before the first step: buffers the engine allocates at start and keeps (``always``).
ENGINE_START = "the engine's start"
#: The loss's backward: log-softmax's fp32 arrays over the logits at their largest.
LOSS_BACKWARD = "the loss's backward"
#: Stages 1–2: ``setup_buckets`` allocates the reduce buffers, every block's activations alive.
FIRST_HOOK = "the first gradient hook"
#: Stage 3: the blocks' backward begins, every parameter gathered, the head's weight gradient made.
LAST_BLOCK = "the last block's backward"
#: Recomputation: the last checkpointed block's activations rebuilt (the loss's arrays gone).
REBUILD = "the last checkpointed block's rebuild"
#: Stages 1–2: the first bucket flush allocates the gradient partition (bucket smaller than the gradients).
FIRST_FLUSH = "the first bucket flush"
#: Last in the backward: the token embedding's gradients, the activations freed.
EMBEDDING = "the token embedding's backward"
#: Stages 1–2: the backward's epilogue (the first flush when the bucket holds every gradient).
EPILOGUE = "the backward's epilogue"
#: Stage 0: the flattened all-reduce once the backward is done.
AFTER_BACKWARD = "the all-reduce after backward"
#: The optimizer step: the activations freed, the step's gradient copies alive.
STEP = "the optimizer step"

#: The events of one step in the order they happen (what a span's "from" and "until" are ordered by).
#: The last block's backward (stage 3) precedes its rebuild: the block's parameters are gathered and
#: the head's gradient made before ``torch.utils.checkpoint`` replays the block's forward.
STEP_EVENTS = (ENGINE_START, LOSS_BACKWARD, FIRST_HOOK, LAST_BLOCK, REBUILD, FIRST_FLUSH, EMBEDDING, EPILOGUE, AFTER_BACKWARD, STEP)
_POSITION = {name: i for i, name in enumerate(STEP_EVENTS)}

#: The order moments are listed in (``PlanEstimate.moments``, the recipe's ``moments``, the first of
#: equal peaks): the order the estimator has always reported them in, kept so outputs do not move.
LISTING_ORDER = (LOSS_BACKWARD, REBUILD, FIRST_HOOK, EPILOGUE, FIRST_FLUSH, LAST_BLOCK, EMBEDDING, AFTER_BACKWARD, STEP)

#: Moments that happen whenever an item is allocated at them; the loss's backward and the step
#: always happen, the rebuild and the embedding's backward when the activations and the
#: embedding's gradients put them there (:func:`~zeroplan.estimator.moments.deepspeed_moments`).
_OPENED_BY_ITEMS = frozenset({FIRST_HOOK, LAST_BLOCK, FIRST_FLUSH, EPILOGUE, AFTER_BACKWARD})

#: ``TimelineItem.kind``: an engine allocation beyond the model states (counted where alive).
ENGINE = "engine"
#: Model-state bytes already in :class:`~zeroplan.estimator.memory.ModelStates` that do not exist
#: before ``alive_from``: absent (a credit) at the moments before it.
STATE = "state"
#: Memory the process holds that ``max_memory_allocated`` does not report (CUDA context).
UNALLOCATED = "unallocated"

#: ``alive_from`` of a :data:`STATE` item that grows through the backward (stage 0's ``param.grad``
#: tensors appear block by block while the blocks' activations are freed, never beside the loss's
#: arrays over the logits): absent at the loss's backward as far as the logits' bytes, alive at
#: every later moment (docs/notes/memory-gaps.md).
GROWN = "during the backward"


@dataclass(frozen=True)
class TimelineItem:
    """One engine allocation: what it is, its bytes and the events it is alive at (both inclusive)."""

    name: str
    """What it is (``ipg_buffers``, ``gathered_params``); the key in ``overhead_items``."""
    size_bytes: int
    """Bytes per GPU."""
    alive_from: str
    """The event (:data:`STEP_EVENTS`) it is allocated at, or :data:`GROWN`."""
    alive_until: str
    """The last event it is alive at."""
    kind: str = ENGINE
    """:data:`ENGINE`, :data:`STATE` or :data:`UNALLOCATED`."""
    transient: bool = False
    """Allocated for its moment and freed right after it (the caching allocator may strand it)."""

    def __post_init__(self) -> None:
        if self.alive_from not in _POSITION and self.alive_from != GROWN:
            raise ValueError(f"{self.name}: alive_from={self.alive_from!r} is not an event; choose one of {', '.join(STEP_EVENTS)}")
        if self.alive_until not in _POSITION:
            raise ValueError(f"{self.name}: alive_until={self.alive_until!r} is not an event; choose one of {', '.join(STEP_EVENTS)}")
        if self.alive_from != GROWN and _POSITION[self.alive_until] < _POSITION[self.alive_from]:
            raise ValueError(f"{self.name}: alive_until {self.alive_until!r} comes before alive_from {self.alive_from!r}")
        if self.kind not in (ENGINE, STATE, UNALLOCATED):
            raise ValueError(f"{self.name}: kind={self.kind!r}; choose engine, state or unallocated")

    @property
    def resident(self) -> bool:
        """Alive from the engine's start through the step: part of every moment (``always``)."""
        return self.alive_from == ENGINE_START and self.alive_until == STEP

    def alive_at(self, event: str) -> bool:
        if self.alive_from == GROWN:
            return _POSITION[LOSS_BACKWARD] < _POSITION[event] <= _POSITION[self.alive_until]
        return _POSITION[self.alive_from] <= _POSITION[event] <= _POSITION[self.alive_until]


#: The one table from :class:`EngineOverhead`'s fields to spans: (alive from, alive until, transient).
#: ``deferred`` starts where the gradient partition is allocated (:func:`_deferred_from`); a name in
#: ``EngineOverhead.ends_before`` ends just before the event given there instead.
FIELD_SPANS: dict[str, tuple[str, str, bool]] = {
    # Allocated with the engine and kept (stage 3's reduce bucket, ZeRO++'s secondary partition).
    "always": (ENGINE_START, STEP, False),
    # Alive while the blocks run backward (stage 3's gathered parameters, a dequantized weight).
    "during_backward": (LOSS_BACKWARD, EMBEDDING, False),
    # The untied output projection's weight gradient, copied into the bucket at the next hook.
    "at_first_hook": (FIRST_HOOK, FIRST_HOOK, True),
    # Stages 1–2's reduce buffers: setup_buckets at the first hook, _release_ipg_buffers at the epilogue.
    "after_first_hook": (FIRST_HOOK, EPILOGUE, False),
    # Stage 3: the head's weight gradient beside the gathered parameters.
    "after_head_backward": (LAST_BLOCK, LAST_BLOCK, False),
    # Stage 3: the embedding weight, the only parameter still gathered at its backward.
    "gathered_at_embedding": (EMBEDDING, EMBEDDING, False),
    # Stage 0: the flat all-reduce chunk after backward.
    "after_backward": (AFTER_BACKWARD, AFTER_BACKWARD, True),
    # The optimizer step's flat and fp32 gradient copies and the optimizer's temporaries.
    "during_step": (STEP, STEP, True),
    # Model-state bytes allocated part of the way through (:data:`STATE`), until the step frees them.
    "deferred": (FIRST_FLUSH, STEP, False),
    "unallocated": (ENGINE_START, STEP, False),
}

#: The order of :meth:`EngineOverhead.items` (the JSON ``overhead_items``).
_ITEMS_ORDER = ("always", "during_backward", "at_first_hook", "after_first_hook", "after_head_backward", "gathered_at_embedding",
                "after_backward", "during_step", "unallocated")


def _previous(event: str) -> str:
    return STEP_EVENTS[_POSITION[event] - 1]


@dataclass(frozen=True)
class EngineOverhead:
    """What DeepSpeed allocates on the GPU beyond the paper's model states, as named items whose
    spans :data:`FIELD_SPANS` gives by field, plus ``timeline_items`` with their own; the moments
    come from :attr:`timeline` (module docstring)."""

    always: dict[str, int] = field(default_factory=dict)
    during_backward: dict[str, int] = field(default_factory=dict)
    during_step: dict[str, int] = field(default_factory=dict)
    unallocated: dict[str, int] = field(default_factory=dict)
    """Memory the process holds that ``max_memory_allocated`` does not report (CUDA only)."""
    deferred: dict[str, int] = field(default_factory=dict)
    """Model-state bytes (already in :class:`ModelStates`) that do not exist yet when the loss's
    backward runs: allocated by the first bucket flush (the epilogue when ``first_flush_blocks`` is
    None; through the backward without reduce buffers) and freed by the step."""
    after_first_hook: dict[str, int] = field(default_factory=dict)
    at_first_hook: dict[str, int] = field(default_factory=dict)
    first_flush_blocks: Optional[int] = None
    """Stages 1–2: blocks whose backward has run when the first bucket flush allocates the deferred
    gradient partition (:func:`~zeroplan.estimator.memory.first_flush_blocks`); None: the flush comes at the epilogue."""
    after_backward: dict[str, int] = field(default_factory=dict)
    after_head_backward: dict[str, int] = field(default_factory=dict)
    gathered_at_embedding: dict[str, int] = field(default_factory=dict)
    ends_before: dict[str, str] = field(default_factory=dict)
    """Item name → the event it is released before, where that differs from its field's span
    (a tied head's gradient held by autograd until the embedding's backward)."""
    timeline_items: list[TimelineItem] = field(default_factory=list)
    """Items with their own spans (how new terms are added)."""

    def items(self) -> dict[str, int]:
        """Every named item (for the JSON ``overhead_items``): a new dict each call."""
        return dict(self._named_items)

    @cached_property
    def _named_items(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name in _ITEMS_ORDER:
            out.update(getattr(self, name))
        for item in self.timeline_items:
            if item.kind != STATE:
                out[item.name] = item.size_bytes
        return out

    @property
    def deferred_bytes(self) -> int:
        return sum(self.deferred.values())

    @cached_property
    def timeline(self) -> "Timeline":
        """Every item with its span (computed once: an overhead is shared by the plans that differ
        only in micro-batch, so do not change its dicts after the first moments are taken)."""
        items: list[TimelineItem] = []
        for name, (start, until, transient) in FIELD_SPANS.items():
            if name == "deferred":
                start = self._deferred_from()
            kind = STATE if name == "deferred" else UNALLOCATED if name == "unallocated" else ENGINE
            for key, nbytes in getattr(self, name).items():
                end = _previous(self.ends_before[key]) if key in self.ends_before else until
                items.append(TimelineItem(key, nbytes, start, end, kind=kind, transient=transient and end == start))
        return Timeline(tuple(items) + tuple(self.timeline_items))

    def _deferred_from(self) -> str:
        if not self.after_first_hook:
            return GROWN
        return EPILOGUE if self.first_flush_blocks is None else FIRST_FLUSH


@dataclass(frozen=True)
class EventSnapshot:
    """What the timeline's items contribute at one event (shared between plans: read, do not change)."""

    items: dict[str, int]
    """Engine items alive then (not resident), by name."""
    items_bytes: int
    transients: dict[str, int]
    """Items allocated for this event and freed after it."""
    absent_state: int
    """Bytes of :data:`STATE` items not yet allocated then."""
    grown_state: int
    """Bytes of :data:`STATE` items that grow through the backward (absent at the loss's backward)."""


@dataclass(frozen=True)
class Timeline:
    """An ordered set of items on the step's events (module docstring)."""

    items: tuple[TimelineItem, ...]

    @cached_property
    def resident(self) -> dict[str, int]:
        """Engine items alive at every moment (``always``), by name."""
        return {i.name: i.size_bytes for i in self.items if i.kind == ENGINE and i.resident}

    @cached_property
    def unallocated(self) -> dict[str, int]:
        return {i.name: i.size_bytes for i in self.items if i.kind == UNALLOCATED}

    @cached_property
    def opened(self) -> frozenset[str]:
        """Events that are moments because an item is allocated at them."""
        return frozenset(i.alive_from for i in self.items if i.alive_from in _OPENED_BY_ITEMS and i.kind != UNALLOCATED)

    def spanning_bytes(self, alive_from: str, alive_until: Optional[str] = None) -> int:
        """Bytes of the engine items allocated at ``alive_from`` (and, given, freed after ``alive_until``)."""
        key = (alive_from, alive_until)
        found = self._spans.get(key)
        if found is None:
            found = self._spans[key] = sum(
                i.size_bytes for i in self.items
                if i.kind == ENGINE and i.alive_from == alive_from and (alive_until is None or i.alive_until == alive_until)
            )
        return found

    @cached_property
    def _spans(self) -> dict[tuple, int]:
        return {}

    @cached_property
    def state_bytes(self) -> int:
        """Bytes of the :data:`STATE` items (model-state bytes allocated part of the way through)."""
        return sum(i.size_bytes for i in self.items if i.kind == STATE)

    def at(self, event: str) -> EventSnapshot:
        """The items' contribution at ``event`` (cached per event)."""
        found = self._snapshots.get(event)
        if found is None:
            found = self._snapshots[event] = self._snapshot(event)
        return found

    @cached_property
    def _snapshots(self) -> dict[str, EventSnapshot]:
        return {}

    def _snapshot(self, event: str) -> EventSnapshot:
        items: dict[str, int] = {}
        transients: dict[str, int] = {}
        absent = grown = 0
        for i in self.items:
            if i.kind == STATE:
                if i.alive_from == GROWN:
                    grown += i.size_bytes
                if not i.alive_at(event):
                    absent += i.size_bytes
            elif i.kind == ENGINE and not i.resident and i.alive_at(event):
                items[i.name] = i.size_bytes
                if i.transient:
                    transients[i.name] = i.size_bytes
        return EventSnapshot(items=items, items_bytes=sum(items.values()), transients=transients, absent_state=absent, grown_state=grown)
