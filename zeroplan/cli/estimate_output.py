"""``zeroplan estimate``'s machine-readable outputs: the CSV rows and the JSON document
(docs/design.md), and the table's one-plan-per-shape summary."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeroplan import __version__

if TYPE_CHECKING:
    from zeroplan.estimator import PlanEstimate

__all__ = ["estimates_to_json", "estimates_to_rows", "summarize"]


def summarize(estimates: "list[PlanEstimate]") -> "list[PlanEstimate]":
    """Best micro-batch per (stage, offloads, checkpointing, layout), kept in ranking order."""
    seen: set[tuple] = set()
    best = []
    for est in estimates:
        p = est.plan
        key = (p.stage, p.offload_optimizer, p.offload_param, p.checkpointing, p.layout_label, p.tiled_mlp)
        if key in seen:
            continue
        seen.add(key)
        best.append(est)
    return best


def estimates_to_rows(estimates: "list[PlanEstimate]") -> list[dict]:
    """Flat rows (one per plan) for CSV: bytes as integers, times in seconds."""
    rows = []
    for est in estimates:
        d = est.plan.as_dict()
        for k, v in est.gpu.as_dict().items():
            d[f"gpu_{k}"] = v
        d["verdict"] = est.verdict
        if est.judgement is not None:
            for side, h in (("gpu", est.judgement.gpu), ("host", est.judgement.host)):
                if h is None:
                    continue
                d[f"{side}_verdict"] = h.verdict
                d[f"{side}_headroom_bytes"] = h.headroom_bytes
                d[f"{side}_headroom_pct"] = round(h.headroom_pct, 1)
                d[f"{side}_uncertain"] = "; ".join(t for t, _ in h.uncertain)
        d.update(
            cpu_per_node=est.cpu_per_node,
            nvme_per_node=est.nvme_per_node,
            comm_per_step=est.comm_per_step,
            pcie_per_step=est.comm.pcie,
            step_time=est.step_time,
            tokens_per_second=est.tokens_per_second,
            fits=est.fits,
            notes="; ".join(est.notes),
        )
        rows.append(d)
    return rows


def estimates_to_json(model, cluster, training, estimates: "list[PlanEstimate]") -> dict:
    """The ``estimate --format json`` document of docs/design.md."""
    return {
        "zeroplan_version": __version__,
        "model": model.as_dict(),
        "cluster": cluster.as_dict(),
        "training": training.as_dict(),
        "plans": [{**e.as_dict(), "layout": e.plan.layout(cluster.gpus)} for e in estimates],
    }
