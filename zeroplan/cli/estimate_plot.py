"""``zeroplan estimate --plot``: the verdict's GPU figure per plan, the tight band, host RAM per node."""

from __future__ import annotations

from pathlib import Path

from zeroplan.estimator.verdict import TIGHT_MARGIN
from zeroplan.spec import GiB, SpecError

__all__ = ["check_plot_target", "plot_plans"]


def check_plot_target(path: Path) -> None:
    """SpecError, before any plan is estimated or printed, when ``--plot PATH`` cannot be written:
    a suffix matplotlib does not write, or matplotlib not installed."""
    import importlib.util

    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise SpecError(f"--plot {path}: give a .png, .svg or .pdf file name")
    if importlib.util.find_spec("matplotlib") is None:
        raise SpecError("--plot needs matplotlib; install it with: pip install 'zeroplan[plot]'")


def plot_plans(path: Path, estimates, cluster) -> None:
    """A stacked bar per plan adding up to the verdict's figure (``gpu.required``), the GPU's
    capacity, the tight band below it, and host RAM per node against the node's on a second axis."""
    check_plot_target(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [e.plan.label_for(e.engine) for e in estimates]
    parts = ("params", "gradients", "optimizer_states", "activations")
    fig, (ax, host_ax) = plt.subplots(2, 1, figsize=(max(6, 0.45 * len(labels) + 2), 8), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    bottoms = [0.0] * len(estimates)
    for part in parts:
        vals = [getattr(e.gpu, part) / GiB for e in estimates]
        ax.bar(labels, vals, bottom=bottoms, label=part.replace("_", " "))
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    extra = [e.gpu.required / GiB - b for e, b in zip(estimates, bottoms)]
    ax.bar(labels, extra, bottom=bottoms, label="engine buffers + CUDA context + rounding")
    cap = cluster.gpu_memory_bytes / GiB
    margin = TIGHT_MARGIN
    ax.axhspan(cap * (1 - margin), cap, color="orange", alpha=0.2, label=f"tight (within {margin:.0%})")
    ax.axhline(cap, color="black", linestyle="--", label=f"{cluster.gpu.name} capacity")
    for i, e in enumerate(estimates):
        ax.text(i, e.gpu.required / GiB, e.verdict, ha="center", va="bottom", fontsize=6)
    ax.set_ylabel("GiB per GPU (gpu.required)")
    ax.set_title("Memory per GPU by plan: the verdict's figure")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    host = [e.cpu_per_node / GiB for e in estimates]
    host_ax.bar(labels, host, color="gray", label="host RAM per node")
    node = cluster.cpu_memory_per_node_bytes / GiB
    if node > 0:
        host_ax.axhspan(node * (1 - margin), node, color="orange", alpha=0.2)
        host_ax.axhline(node, color="black", linestyle="--", label="node RAM")
    host_ax.set_ylabel("GiB per node")
    host_ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    host_ax.tick_params(axis="x", labelrotation=70, labelsize=7)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    try:
        fig.savefig(tmp)
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SpecError(f"--plot {path}: cannot write ({exc.strerror})") from None
    finally:
        plt.close(fig)
