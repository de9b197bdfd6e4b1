"""Host memory rules for the tuner: pure functions of an estimate, a probe outcome and the node.

* :func:`host_fit_reason`: the estimator says the plan's worst host phase does not fit the node's
  RAM → why (phase and numbers), else None. ``tuner.space`` prunes with it like with GPU memory.
* :func:`host_oom_rule`: a plan predicted to need at least as much host RAM per node as one that
  died of host OOM (``memory_limit == "host"``) would die too → why, else None. The tuner applies
  it within one stage and offload (``tuner.admission``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from zeroplan.spec import ClusterSpec, GiB

__all__ = ["host_fit_reason", "host_oom_rule"]


def host_fit_reason(estimate: Any, cluster: ClusterSpec) -> Optional[str]:
    """Why ``estimate`` (a PlanEstimate) does not fit the node's host RAM, naming the phase; None if it fits
    or the node's RAM is unknown (``cpu_memory_per_node_bytes == 0``)."""
    limit = cluster.cpu_memory_per_node_bytes
    need = estimate.cpu_per_node
    if not limit or need <= limit:
        return None
    phase = getattr(estimate, "cpu_worst_phase", "step").replace("_", " ")
    return f"predicted {need / GiB:.2f} GiB host memory per node at {phase} > {limit / GiB:.2f} GiB"


def host_oom_rule(predicted_host_bytes: int, host_ooms: Sequence[tuple[int, str, int]]) -> Optional[str]:
    """Reason to skip a plan predicted to need ``predicted_host_bytes`` of host RAM per node.

    ``host_ooms``: (trial number, plan label, predicted host bytes per node) of every probe that
    ran out of *host* memory. A plan predicted to need more than one of them is skipped. Equal
    predictions say nothing: the host estimate of plans that differ only in micro-batch on a GPU
    is one figure (activations are device memory), so ``>=`` would prune the smaller micro-batches
    with the one that ran out; those are left to the OOM rule (``tuner.admission.oom_rule``).
    """
    for number, label, bytes_ in host_ooms:
        if bytes_ and predicted_host_bytes > bytes_:
            return f"needs more host memory than a host-OOM'd plan (trial #{number}: {label})"
    return None
