"""``zeroplan profiles``: the shipped GPU profiles and model presets."""

from __future__ import annotations

import io
import json
from typing import Annotated

import typer

from zeroplan.cli import app
from zeroplan.cli.common import OutputOpt, check_choice_option, stdout_console, write_output

_FORMATS = ("table", "json")

ProfilesFormatOpt = Annotated[str, typer.Option("--format", help="table | json.", rich_help_panel="Output")]


def _model_row(name: str) -> dict:
    from zeroplan import profiles

    info = profiles.model_preset_info(name)
    row = profiles.load_model_preset(name).as_dict()
    row["display_name"] = info.get("display_name", "")
    row["reference"] = info.get("source", "")
    return row


def profiles_document() -> dict:
    """Everything `zeroplan profiles --format json` prints (also the data behind the tables)."""
    from zeroplan import __version__, profiles

    gpu, note = profiles.default_gpu()
    return {
        "zeroplan_version": __version__,
        "gpus": [profiles.load_gpu(n).as_dict() for n in profiles.gpu_names()],
        "models": [_model_row(n) for n in profiles.model_names()],
        "nodes": [profiles.load_node(n).as_dict() for n in profiles.node_names()],
        "supported_model_types": list(profiles.SUPPORTED_MODEL_TYPES),
        "detected_gpu": {"profile": gpu.name, "memory_bytes": gpu.memory_bytes, "note": note},
    }


def _params_short(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _render_tables(doc: dict, console) -> None:
    from rich import box
    from rich.table import Table

    from zeroplan.spec import GiB

    gpus = Table(title="GPU profiles (--gpu NAME)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    gpus.add_column("name", no_wrap=True)
    for col in ("memory\nGiB", "bf16\nTFLOP/s", "fp32\nTFLOP/s", "HBM\nTB/s", "NVLink\nGB/s", "PCIe\nGB/s", "network\nGB/s"):
        gpus.add_column(col, justify="right", no_wrap=True)
    for g in doc["gpus"]:
        gpus.add_row(
            g["name"],
            f"{g['memory_bytes'] / GiB:.1f}",
            f"{g['peak_flops']['bf16'] / 1e12:.1f}",
            f"{g['peak_flops']['fp32'] / 1e12:.1f}",
            f"{g['memory_bandwidth'] / 1e12:.2f}",
            f"{g['intra_node_bandwidth'] / 1e9:g}",
            f"{g['host_bandwidth'] / 1e9:g}",
            f"{g['inter_node_bandwidth'] / 1e9:g}",
        )
    console.print(gpus)
    console.print(
        "Per GPU, one direction. NVLink = link to peers in the node (PCIe for PCIe cards); "
        "network = inter-node share per GPU. Datasheets: --format json, field source."
    )
    console.print()

    models = Table(title="Model presets (--model NAME)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    models.add_column("name", no_wrap=True)
    for col in ("params", "active", "h", "L", "heads", "kv\nheads", "ffn", "V"):
        models.add_column(col, justify="right", no_wrap=True)
    for m in sorted(doc["models"], key=lambda m: m["params"]):
        models.add_row(
            m["name"],
            _params_short(m["params"]),
            _params_short(m["active_params"]) if m.get("moe") else "",
            str(m["hidden_size"]),
            str(m["num_layers"]),
            str(m["num_heads"]),
            str(m["num_kv_heads"]),
            str(m["ffn_size"]),
            str(m["vocab_size"]),
        )
    console.print(models)
    console.print(
        "active: parameters one token runs through in a mixture of experts (FLOPs); ffn there is the MLP width a token "
        "goes through (top-k experts plus shared ones). Exact parameter counts, tied embeddings, gated MLP, experts "
        "and sources: --format json. Any Hugging Face config.json also works with "
        "--model PATH (model_type: " + ", ".join(doc["supported_model_types"]) + ")."
    )
    console.print()

    nodes = Table(title="Node profiles (--node NAME): host RAM and NVMe per node", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    nodes.add_column("name", no_wrap=True)
    nodes.add_column("GPUs", no_wrap=True)
    for col in ("RAM\nGiB", "NVMe\nTB", "network\nGb/s"):
        nodes.add_column(col, justify="right", no_wrap=True)
    for n in doc["nodes"]:
        nodes.add_row(
            n["name"] + (" *" if n["default_for_gpu"] else ""),
            f"{n['gpus_per_node']}× {n['gpu']}",
            f"{n['cpu_memory_bytes'] / GiB:,.0f}",
            f"{n['nvme_bytes'] / 1e12:.1f}",
            f"{n['network_gbps']:g}",
        )
    console.print(nodes)
    console.print(
        "* stands for its GPU when that GPU is not on this machine (docs/host-memory.md). NICs and vendor pages: --format json."
    )
    console.print(f"{doc['detected_gpu']['note']}: the GPU that estimate, export, validate and tune take without --gpu")


@app.command()
def profiles(
    fmt: ProfilesFormatOpt = "table",
    output: OutputOpt = None,
) -> None:
    """List the GPU profiles and model presets (sources: docs/profiles.md and each TOML's `source`)."""
    check_choice_option("--format", fmt, _FORMATS)
    doc = profiles_document()
    if fmt == "json":
        write_output(json.dumps(doc, indent=2), output)
        return
    from rich.console import Console

    if output is None:
        _render_tables(doc, stdout_console())
        return
    buffer = io.StringIO()
    _render_tables(doc, Console(file=buffer, width=100, no_color=True, highlight=False))
    write_output(buffer.getvalue(), output)


__all__ = ["profiles", "profiles_document"]
