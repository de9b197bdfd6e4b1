"""One rank of ``bench_generation_time.py``: examples/train_trl_grpo.py with TRL's generation call
timed. ``GRPOTrainer._generate_single_turn`` (grpo_trainer.py:1763, the ``unwrap_model_for_generation``
+ ``model.generate`` block at 1861-1875) is wrapped at class level; every call's wall time and the
completion tokens it produced are appended to ``$GEN_TIMER_OUT.rank<R>.json``. Completions are held
at ``max_completion_length`` (``generation_kwargs={"min_new_tokens": L}``, merged into the trainer's
GenerationConfig at grpo_trainer.py:1171-1173) so every call decodes the same number of tokens.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_trl_grpo.py"


def main() -> None:
    from transformers import HfArgumentParser
    from trl import GRPOTrainer

    calls: list[dict] = []
    rank = int(os.environ.get("RANK", "0"))
    out = Path(f"{os.environ['GEN_TIMER_OUT']}.rank{rank}.json")
    original_turn = GRPOTrainer._generate_single_turn

    profile = os.environ.get("GEN_TIMER_PROFILE")  # a path: cProfile the calls after the first into it (rank 0)

    def timed(self, prompt_ids, *args, **kwargs):
        profiler = None
        if profile and rank == 0 and calls:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        start = time.perf_counter()
        result = original_turn(self, prompt_ids, *args, **kwargs)
        seconds = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(f"{profile}.{len(calls)}")
        completion = result[0] if isinstance(result, tuple) else result
        calls.append({"seconds": seconds, "sequences": len(prompt_ids), "prompt_tokens": max(len(p) for p in prompt_ids),
                      "completion_tokens": max((len(c) for c in completion), default=0)})
        out.write_text(json.dumps(calls))
        return result

    GRPOTrainer._generate_single_turn = timed
    parse = HfArgumentParser.parse_args_into_dataclasses

    def parse_fixed_length(self, *args, **kwargs):
        parsed = parse(self, *args, **kwargs)
        for obj in parsed:
            if hasattr(obj, "max_completion_length"):
                obj.generation_kwargs = {"min_new_tokens": obj.max_completion_length}
        return parsed

    HfArgumentParser.parse_args_into_dataclasses = parse_fixed_length
    sys.path.insert(0, str(EXAMPLE.parent))  # the example imports tiny_llama from its folder
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
