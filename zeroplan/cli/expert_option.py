"""The ``--ep`` option (expert-parallel degree, DeepSpeed AutoEP) shared by estimate, export and tune;
parsing and checks live in :mod:`zeroplan.estimator.expert_parallel`."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

__all__ = ["EpOpt"]

EpOpt = Annotated[
    Optional[str],
    typer.Option(
        "--ep",
        help="Expert-parallel degree(s) for an MoE model (DeepSpeed AutoEP, expert_parallel.autoep_size): N, a list "
        "1,2,4, or auto (every degree dividing the GPUs and the expert count) [default: 1].",
        rich_help_panel="Plan",
    ),
]
