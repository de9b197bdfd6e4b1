"""How much of a step's communication DeepSpeed hides behind compute, by ZeRO stage.

Sources (DeepSpeed 0.19):

* Stage 0 — ``engine.py`` ``backward`` calls ``allreduce_gradients`` after the loss's backward
  has finished; ``buffered_allreduce_fallback`` all-reduces the buckets on the compute stream:
  nothing is hidden.
* Stages 1–2 with ``overlap_comm`` — ``zero/stage_1_and_2.py``: each gradient hook copies its
  gradient into the IPG bucket; a full bucket is reduced (``reduce_ipg_grads`` →
  ``average_tensor``) on ``self.reduction_stream`` (line 599) while autograd goes on with the
  backward of the earlier layers; the last bucket is reduced only in the epilogue after backward
  (``overlapping_partition_gradients_reduce_epilogue``), which then waits for the reduction
  stream (``get_accelerator().synchronize()``, line 1026). Stage 1 reduces in the boundary
  micro-step's backward only, stage 2 in every one. The gradient-norm and overflow all-reduces
  and the parameter all-gather come after backward (``step``) and stay exposed. Without
  ``overlap_comm`` the reductions run on the compute stream (line 1594): nothing hidden.
* Stage 3 — ``zero/parameter_offload.py`` (line 195) gives the parameter coordinator an
  all-gather stream, and ``stage3.py`` a ``reduce_and_partition_stream`` for the gradient
  reduce-scatter (``overlap_comm`` is on by default at stage 3). A prefetched gather
  (``partitioned_param_coordinator.py`` ``_fetch_sub_module_impl``) runs while the modules
  before it compute; the first gather of each pass has nothing to hide behind. Gradient buckets
  hide behind backward as in stage 2.
* A CPU — DeepSpeed's CPU accelerator is a synchronized device (``is_synchronized_device()``
  true, ``Stream()`` None; ``reduction_stream`` and the all-gather stream are then None and
  every collective runs inline in the hook that issues it): nothing is hidden. The profile
  says which with ``GpuSpec.comm_stream`` (false from ``zeroplan calibrate`` on a CPU).

Earlier versions hid a flat 70 % of stage-3 gathers (a figure with no source) and nothing in
stages 1–2, although zeroplan's configs set ``overlap_comm``.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.estimator.frozen import built

__all__ = ["CommOverlap", "comm_overlap"]


@dataclass(frozen=True)
class CommOverlap:
    """Seconds of collectives per optimizer step, and how much of them compute hides."""

    gradient_reduce_s: float
    """Gradient reductions (all-reduce or reduce-scatter buckets)."""
    gradient_hidden_s: float
    """Of ``gradient_reduce_s``, the part that runs while backward still computes."""
    param_gather_s: float
    """Stage 3: parameter all-gathers of forward and backward (0 for stages 0–2, whose gather is after the step)."""
    gather_hidden_s: float
    """Of ``param_gather_s``, the part that runs while earlier modules compute (prefetch)."""
    other_s: float
    """Everything else (stage 0–2 parameter all-gather, norm and overflow all-reduces, persistent re-gathers): exposed."""

    @property
    def total_s(self) -> float:
        return self.gradient_reduce_s + self.param_gather_s + self.other_s

    @property
    def exposed_s(self) -> float:
        return self.total_s - self.gradient_hidden_s - self.gather_hidden_s


def comm_overlap(
    *,
    stage: int,
    overlap_comm: bool,
    comm_stream: bool,
    communication_s: float,
    gradient_reduce_s: float,
    reduce_calls_per_pass: int,
    reducing_passes: int,
    param_gather_s: float,
    gather_calls: int,
    gather_passes: int,
    forward_s: float,
    backward_s: float,
) -> CommOverlap:
    """Hidden and exposed communication of one step (module docstring for each stage's rule).

    ``gradient_reduce_s`` is the step's gradient reductions over ``reducing_passes`` backward
    passes of ``reduce_calls_per_pass`` bucket calls each; ``param_gather_s`` the stage-3 gathers,
    ``gather_calls`` calls over ``gather_passes`` forward/backward passes; ``forward_s`` and
    ``backward_s`` the step's compute in forward and in backward (recompute included). In each
    reducing pass the buckets before the last one hide behind that pass's backward, at most all
    of it: hidden = min(R·(k−1)/k, B) per pass. In stage 3 every gather but the first of each
    pass hides behind the step's compute left over from the reductions.
    """
    other = max(0.0, communication_s - gradient_reduce_s - param_gather_s)
    if stage == 0 or not comm_stream:
        return built(CommOverlap, gradient_reduce_s=gradient_reduce_s, gradient_hidden_s=0.0, param_gather_s=param_gather_s,
                     gather_hidden_s=0.0, other_s=other)
    grad_hidden = 0.0
    if overlap_comm and reducing_passes > 0:
        per_pass = gradient_reduce_s / reducing_passes
        calls = max(1, reduce_calls_per_pass)
        grad_hidden = reducing_passes * min(per_pass * (calls - 1) / calls, backward_s / reducing_passes)
    gather_hidden = 0.0
    if stage == 3 and gather_calls > 0 and param_gather_s > 0:
        first = param_gather_s * min(gather_passes, gather_calls) / gather_calls
        gather_hidden = min(param_gather_s - first, max(0.0, forward_s + backward_s - grad_hidden))
    return built(CommOverlap, gradient_reduce_s=gradient_reduce_s, gradient_hidden_s=grad_hidden, param_gather_s=param_gather_s,
                 gather_hidden_s=gather_hidden, other_s=other)
