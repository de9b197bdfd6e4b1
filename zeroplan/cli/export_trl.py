"""``zeroplan export --recipe``: the TRL config values written beside the DeepSpeed config."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from zeroplan.cli.common import write_output

__all__ = ["write_trl_values"]


def write_trl_values(recipe, plan, training, output: Optional[Path]) -> None:
    """With ``--output ds.json``: ``ds.trl.json`` beside it (TRL's field names, ``deepspeed`` pointing at
    ds.json) and a note; without: the values as one JSON line on stderr, stdout keeping the DeepSpeed config."""
    from zeroplan.dsconfig.trl_values import trl_config_values, trl_sidecar_path

    if output is None:
        values = trl_config_values(recipe, plan, training)
        print(f"zeroplan: TRL {recipe.kind} config values: {json.dumps(values)}", file=sys.stderr)
        return
    sidecar = trl_sidecar_path(str(output))
    values = trl_config_values(recipe, plan, training, deepspeed_path=str(Path(output)))
    write_output(json.dumps(values, indent=2), sidecar)
    print(f"zeroplan: wrote {sidecar} (TRL {recipe.kind} config values for this plan: "
          f"{_config_class(recipe.kind)}(**json.load(open({str(sidecar)!r}))))", file=sys.stderr)


def _config_class(kind: str) -> str:
    return {"sft": "SFTConfig", "dpo": "DPOConfig", "grpo": "GRPOConfig", "ppo": "TrainingArguments"}[kind]
