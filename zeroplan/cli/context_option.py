"""The ``--cp`` option (context-parallel degree: PyTorch ring attention under FSDP2, as torchtitan
runs it) shared by estimate, export and tune; parsing and rules live in
:mod:`zeroplan.estimator.context_parallel` and :func:`zeroplan.estimator.layout_space.parse_degrees`."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from zeroplan.spec import SpecError

__all__ = ["CpOpt", "CpRefusedOpt", "refuse_context_parallel"]

CpOpt = Annotated[
    Optional[str],
    typer.Option(
        "--cp",
        help="Context-parallel degree (PyTorch ring attention with FSDP2, torchtitan's context_parallel_degree; "
        "--engine fsdp): 4, a list 1,2,4 or auto [default: 1; estimate --engine fsdp widens to auto when nothing fits at 1].",
        rich_help_panel="Plan",
    ),
]

#: ``--cp`` on the commands that write or run plans (export, tune): accepted so that a degree above 1
#: gets one clear line, not an unknown-option panel.
CpRefusedOpt = Annotated[
    Optional[str],
    typer.Option("--cp", help="Context-parallel degree: estimate only (zeroplan estimate --engine fsdp --cp N); above 1 is refused here.",
                 rich_help_panel="Plan"),
]


def refuse_context_parallel(command: str, degrees) -> None:
    """SpecError when a command that writes or runs plans is given ``--cp`` above 1: context
    parallelism is estimated only (``degrees`` as parsed; None or (1,) passes)."""
    if degrees is None or degrees == (1,):
        return
    given = degrees if isinstance(degrees, str) else ",".join(map(str, degrees))
    raise SpecError(f"--cp {given}: {command} does not write or run context-parallel plans (ring attention is estimated only); "
                    f"use zeroplan estimate --engine fsdp --cp {given}, and torchtitan's --parallelism.context_parallel_degree to run it")
