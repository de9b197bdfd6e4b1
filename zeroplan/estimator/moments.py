"""The moments of a DeepSpeed step whose live bytes can be the GPU peak, and what is alive at each.

Pure arithmetic (stdlib only). DeepSpeed allocates some buffers only part of the way through the
backward, so the peak is the largest of several moments, not model states + activations + every
buffer. Each moment below is a snapshot measured on real engines (DeepSpeed 0.19, 2 CPU ranks,
live tensor storage; docs/notes/memory-gaps.md):

* **the loss's backward**: log-softmax's fp32 arrays over the logits at their largest; no reduce
  buffer yet and, in stages 1–2, no gradient partition.
* **the last checkpointed block's rebuild** (recomputation only): the loss's fp32 arrays are gone,
  the last block's activations are rebuilt.
* **the first gradient hook** (stages 1–2): ``setup_buckets`` allocates the reduce buffers
  (stage_1_and_2.py; two with ``overlap_comm``) while every block's activations are still alive,
  beside the output projection's fresh weight gradient; the gradient partition does not exist yet.
* **the first bucket flush** (stages 1–2, before the epilogue when the bucket is smaller than the
  trainable parameters): ``copy_grads_in_partition`` allocates the gradient partition while the
  blocks whose backward has not run keep their activations
  (:func:`~zeroplan.estimator.memory.first_flush_blocks`).
* **the last block's backward** (stage 3): every parameter still gathered (with a complete trace,
  from the second step on) beside every block's activations and the output projection's weight
  gradient, which a tied head keeps in autograd until the embedding's backward.
* **the token embedding's backward** (stages 1–3): last in the backward, the embedding's gradients
  (:mod:`~zeroplan.estimator.embedding_backward`) beside the buffers, the activations freed; at
  stage 3 beside the gathered embedding weight only.
* **the backward's epilogue** (stages 1–2 when the bucket holds every gradient): the first flush
  comes only here, with every gradient and the buffers, the activations freed.
* **the all-reduce after backward** (stage 0): a flat copy of the gradients.
* **the optimizer step**: the step's flat and fp32 copies of the gradients, activations freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from zeroplan.estimator.activations import ActivationMemory
from zeroplan.estimator.embedding_backward import EmbeddingBackward
from zeroplan.estimator.frozen import once
from zeroplan.estimator.timeline import (
    AFTER_BACKWARD, EMBEDDING, EPILOGUE, FIRST_FLUSH, FIRST_HOOK, LAST_BLOCK, LISTING_ORDER, LOSS_BACKWARD, REBUILD, STEP, EngineOverhead,
)
from zeroplan.spec import GiB, ModelSpec

__all__ = ["Moment", "deepspeed_moments", "moment_parts", "ipg_buffer_written_elements", "traced_after_loss", "STEP_MOMENT", "EMBEDDING_MOMENT",
           "STAGE3_HEAD_MOMENT"]

#: The moment name of the optimizer step (the only moment with ``peak_phase`` = ``step``).
STEP_MOMENT = STEP
#: The moment name of stage 3's last block's backward, the head's weight gradient made.
STAGE3_HEAD_MOMENT = LAST_BLOCK
#: The moment name of the token embedding's backward (:mod:`zeroplan.estimator.embedding_backward`).
EMBEDDING_MOMENT = EMBEDDING


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB // 10 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Moment:
    """Bytes alive at one moment of a step, beyond the model states and the always-resident extras."""

    name: str
    """The moment, as the notes name it (e.g. ``the first gradient hook``)."""
    activations: int
    """Activation bytes alive then."""
    absent_gradients: int = 0
    """Model-state gradient bytes DeepSpeed has not allocated yet (or has freed) then."""
    items: dict[str, int] = field(default_factory=dict)
    """Engine items alive then (beyond ``EngineOverhead.always``), by name."""
    transients: dict[str, int] = field(default_factory=dict)
    """Tensors allocated for this moment and freed soon after (the CUDA allocator may strand them)."""
    why: str = ""
    """What is alive then, for the note."""

    @once
    def allocated_above_states(self) -> int:
        """Live bytes at this moment minus the model states and ``always``."""
        return self.activations - self.absent_gradients + sum(self.items.values())

    def note(self, activations_total: int) -> str:
        """One sentence naming the moment, for the plan's notes."""
        if self.name == STEP_MOMENT:
            return (f"peak is in the optimizer step ({', '.join(self.items) or 'model states'} "
                    f"{_gib(sum(self.items.values()))}); activations ({_gib(activations_total)}) are freed before it")
        return f"peak at {self.name}" + (f": {self.why}" if self.why else "")


def _moment(name: str, activations: int, absent_gradients: int, items: dict[str, int], transients: dict[str, int], why: str,
            above: int) -> Moment:
    """A :class:`Moment` without the frozen dataclass's ``__init__``, which sets each field through
    ``object.__setattr__`` (1.4 µs a moment, ~5 moments a plan: a tenth of a plan's estimate);
    ``above`` (its :attr:`~Moment.allocated_above_states`, the items' bytes known beforehand) is kept
    so the property does not add them up again."""
    moment = object.__new__(Moment)
    moment.__dict__.update(name=name, activations=activations, absent_gradients=absent_gradients, items=items, transients=transients, why=why,
                           allocated_above_states=above)
    return moment


def moment_parts(
    model: ModelSpec, extra: EngineOverhead, *, embedding: Optional[EmbeddingBackward] = None, rebuild: bool = False,
) -> tuple[tuple, ...]:
    """What :func:`deepspeed_moments` takes from the timeline at each moment, apart from the
    activations: (event, engine items alive, their bytes, transients, absent model-state bytes,
    grown model-state bytes, the note's sentence), in
    :data:`~zeroplan.estimator.timeline.LISTING_ORDER`. ``rebuild``: the plan recomputes a block
    (its working set is not 0), which makes the rebuild a moment. The same for every plan that
    shares ``extra`` and ``embedding`` (they differ in micro-batch only): computed once for those.
    The loss's backward keeps its sentence empty (its absent gradients depend on the logits)."""
    timeline = extra.timeline
    events = set(timeline.opened)
    if rebuild:
        events.add(REBUILD)
    if embedding is not None:
        events.add(EMBEDDING)
    buffers = timeline.spanning_bytes(FIRST_HOOK, EPILOGUE)
    deferred = timeline.state_bytes
    parts = []
    for event in LISTING_ORDER:
        if event not in events and event not in (LOSS_BACKWARD, STEP):
            continue
        at = timeline.at(event)
        items, items_bytes, transients = at.items, at.items_bytes, at.transients
        why = ""
        if event == FIRST_HOOK:
            why = (f"DeepSpeed's reduce buffers ({_gib(buffers)}) beside every block's activations"
                   + (f", before the {_gib(deferred)} gradient partition exists" if deferred else ""))
        elif event == EPILOGUE:
            why = (f"the first bucket flush allocates the {_gib(deferred)} gradient partition beside the reduce "
                   f"buffers ({_gib(buffers)}) once the activations are freed")
        elif event == FIRST_FLUSH:
            k = extra.first_flush_blocks or 0
            blocks_left = model.num_layers - k
            why = (f"the {_gib(deferred)} gradient partition is allocated while {blocks_left} of {model.num_layers} "
                   f"blocks keep their activations, beside the reduce buffers ({_gib(buffers)})")
        elif event == LAST_BLOCK:
            why = (f"the output projection's weight gradient ({_gib(timeline.spanning_bytes(LAST_BLOCK))}) "
                   "beside the gathered parameters and every block's activations")
        elif event == EMBEDDING:
            grads = embedding.items()
            items = {**items, **grads}
            items_bytes = sum(items.values())
            # The embedding's new tensors; the loss's (or the rebuild's) cached transients join them per plan.
            transients = {k: v for k, v in grads.items() if k in ("embedding_gradient", "summed_embedding_gradient")}
            why = (f"activations freed, {_gib(embedding.total)} of gradients ({', '.join(grads)}) "
                   "beside the model states" + (f" and the reduce buffers ({_gib(buffers)})" if buffers else ""))
        elif event == AFTER_BACKWARD:
            why = f"a flat copy of the gradients ({_gib(timeline.spanning_bytes(AFTER_BACKWARD))}) beside all of them"
        parts.append((event, items, items_bytes, transients, at.absent_state, at.grown_state, why))
    return tuple(parts)


def deepspeed_moments(
    model: ModelSpec, extra: EngineOverhead, acts: Optional[ActivationMemory], activations_total: int,
    *, embedding: Optional[EmbeddingBackward] = None, traced_after_loss: Optional[int] = None,
    parts: Optional[tuple[tuple, ...]] = None,
) -> list[Moment]:
    """Every candidate peak moment of a DeepSpeed step (module docstring), listed in
    :data:`~zeroplan.estimator.timeline.LISTING_ORDER`: at each event of ``extra.timeline`` on this
    step, the engine items alive then (:class:`~zeroplan.estimator.timeline.Timeline`) beside the
    activations alive then; ``embedding`` adds the token embedding's backward (stages 1–3) and its
    gradients as items of that event.

    ``acts`` is None when activations were traced as one total (``--trace``): the loss's backward
    keeps that total, and the moments after it (the first gradient hook, the first bucket flush,
    where the reduce buffers exist) keep ``traced_after_loss`` — the total less the loss's arrays,
    which autograd frees before the output projection's backward fires the first hook
    (:func:`traced_after_loss`) — so the buffers are not stacked on the loss's peak. Without it
    they keep the total too (conservative).

    ``parts``: :func:`moment_parts` of the same ``model``, ``extra``, ``embedding`` and recomputation,
    when the caller keeps them for plans that share those (computed here otherwise).
    """
    if acts is not None:
        layers, embeddings, logits, held = acts.layers, acts.embeddings, acts.logits, acts.logits_held
        working = acts.recompute_working_set
        at_loss = layers + embeddings + logits
    else:
        layers, embeddings, logits, held, working = activations_total, 0, 0, 0, 0
        if traced_after_loss is not None:
            layers = min(activations_total, traced_after_loss)
        at_loss = activations_total
    if parts is None:
        parts = moment_parts(model, extra, embedding=embedding, rebuild=bool(working))
    moments = []
    for event, items, items_bytes, transients, absent, grown, why in parts:
        if event == LOSS_BACKWARD:
            # Gradients that grow through the backward replace the loss's arrays over the logits
            # (timeline.GROWN): counting them all with every block's activations bounds the moments between.
            absent += min(grown, logits) - grown
            activations = at_loss
            transients = {"loss_gradients": acts.loss_transients} if acts is not None else {}
            why = f"DeepSpeed has not allocated {_gib(absent)} of gradients yet" if absent else ""
        elif event == REBUILD:
            # Conservative as before the buffers were a moment: the gradients may exist by then.
            absent = 0
            activations = layers + embeddings + working + held
            transients = {"rebuilt_block": working}
        elif event == FIRST_HOOK or event == LAST_BLOCK:
            # Stage 3's last block: each block's parameters are released after its backward, so the
            # first block's (the last one's) is the largest.
            activations = layers + embeddings + held
        elif event == FIRST_FLUSH:
            # Blocks done at the flush; a flush item added without that count keeps every block's activations.
            k = extra.first_flush_blocks or 0
            remaining = max(0, layers - k * acts.per_layer) if acts is not None else layers
            activations = remaining + embeddings + held + (working if model.num_layers - k else 0)
        elif event == EMBEDDING:
            # Last in the backward: every activation freed (the logits a loop holds stay). The
            # loss's (or the rebuild's) cached transients stay reserved; the embedding's new
            # tensors come on top.
            transients = {**moments[1 if working else 0].transients, **transients}
            activations = held
        elif event == EPILOGUE or event == AFTER_BACKWARD:
            activations = held
        else:
            activations = 0
        moments.append(_moment(event, activations, absent, items, transients, why, activations - absent + items_bytes))
    return moments


def ipg_buffer_written_elements(model: ModelSpec, *, reduce_bucket_size: int, overlap_comm: bool) -> tuple[int, ...]:
    """Elements of each stage-1/2 reduce buffer that DeepSpeed ever writes, buffer by buffer.

    ``setup_buckets`` (stage_1_and_2.py) allocates each buffer with ``torch.empty`` of
    ``reduce_bucket_size`` elements; only ``reduce_independent_p_g_buckets_and_remove_grads``
    writes into it — ``bucket.buffer[bucket.index].narrow(0, bucket.elements, param.numel())
    .copy_(grad)`` for a gradient no larger than the bucket (a larger one bypasses it:
    ``extra_large_param_to_reduce``) — and ``reduce_ipg_grads`` reduces the filled
    ``narrow(0, 0, bucket.elements)``. With ``overlap_comm`` the fills alternate between the two
    buffers (``bucket.index = 1 - bucket.index`` after each flush). So the first buffer is filled
    with min(bucket, G) elements and the second with min(bucket, G − bucket), G the trainable
    elements that pass through the buckets: the trainable parameters less the token embedding
    (and an untied output projection) when V·h exceeds the bucket. Other parameters over the
    bucket are counted as passing through (an upper bound). Pages of a buffer never written are
    not resident: host RSS on a CPU probe counts only these.
    """
    through = model.trainable_params
    if model.peft is None and model.embedding_params > reduce_bucket_size:
        through -= model.embedding_params * (1 if model.tied_embeddings else 2)
    through = max(0, through)
    first = min(reduce_bucket_size, through)
    if not overlap_comm:
        return (first,)
    return first, min(reduce_bucket_size, max(0, through - reduce_bucket_size))


def traced_after_loss(parts: dict[str, int], *, logits_held: int) -> Optional[int]:
    """Traced activation bytes still alive once the loss's backward is done, from a trace's
    breakdown (``TracedActivationOverride.breakdown``: ``layers``, ``embeddings``, ``logits``,
    ``recompute``, ``loss_gradients``, ``total``): the total less the loss's fp32 gradients and the
    logits the trace counts, keeping the logits a loop holds through backward (``logits_held``, the
    formula's :attr:`~zeroplan.estimator.activations.ActivationMemory.logits_held`). One block's
    recompute stays (the last block's rebuild comes after the first hook, beside the buffers).
    None when the breakdown does not separate the logits (a ``measure="peak"`` trace)."""
    if "logits" not in parts or "total" not in parts:
        return None
    logits = parts["logits"]
    return parts["total"] - parts.get("loss_gradients", 0) - logits + min(logits_held, logits)
