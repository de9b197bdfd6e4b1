"""Which DeepSpeed config the Hugging Face Ulysses blog's documented launch produces, through
accelerate's own launch code (no GPU, no process started).

The blog (huggingface/blog ulysses-sp.md, published 2026-03-09) documents one launch:
``accelerate launch --config_file alst_ulysses_4gpu.yaml trl/scripts/sft.py ...`` with an
accelerate config whose ``deepspeed_config`` holds ``zero_stage: 3`` and
``seq_parallel_communication_data_type: bf16``; its Best Practices add ZeRO offload as a nested
block, ``offload_optimizer: {device: cpu}``, under ``deepspeed_config``. Its Benchmarks section
says "CPU optimizer offloading". This script runs each form through accelerate's
``launch_command_parser`` → ``_validate_launch_command`` (commands/launch.py, which copies the
config's ``deepspeed_config`` entries onto the launch arguments) → ``prepare_deepspeed_cmd_env``
(utils/launch.py, which exports ``ACCELERATE_DEEPSPEED_*`` for the ranks; the optimizer offload only
from ``args.offload_optimizer_device``) → ``DeepSpeedPlugin()`` in that environment (what
``Accelerator`` builds on every rank; utils/dataclasses.py), and prints the resulting
``zero_optimization`` block. The spelling accelerate documents, ``offload_optimizer_device: cpu``,
is run as the control. TRL's own config for this launch
(examples/accelerate_configs/alst_ulysses_4gpu.yaml at v0.29.0) sets ``offload_optimizer_device: none``.

    python benchmarks/blog_accelerate_offload.py > benchmarks/results/blog_accelerate_offload.txt
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import accelerate
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin, patch_environment
from accelerate.utils.launch import prepare_deepspeed_cmd_env

#: The blog's "Accelerate Config File" (alst_ulysses_4gpu.yaml), with the Benchmarks section's
#: layout (SP=4, DP=1 on 4 GPUs) in place of the snippet's sp 2 × dp 2.
BLOG_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
mixed_precision: bf16
num_processes: 4
deepspeed_config:
  zero_stage: 3
  seq_parallel_communication_data_type: bf16
{extra}parallelism_config:
  parallelism_config_sp_size: 4
  parallelism_config_sp_backend: deepspeed
  parallelism_config_dp_shard_size: 1
  parallelism_config_sp_seq_length_is_variable: true
  parallelism_config_sp_attn_implementation: flash_attention_2
"""

FORMS = {
    "blog's alst_ulysses_4gpu.yaml as printed": "",
    "+ Best Practices #3 (offload_optimizer: device: cpu, nested)": "  offload_optimizer:\n    device: cpu\n",
    "control: accelerate's spelling (offload_optimizer_device: cpu)": "  offload_optimizer_device: cpu\n",
}


def deepspeed_config_for(yaml_text: str, folder: Path) -> tuple[dict, dict]:
    """(the ACCELERATE_DEEPSPEED_* environment the launcher exports, the DeepSpeed config a rank's
    DeepSpeedPlugin builds from it), as ``accelerate launch --config_file`` does."""
    path = folder / "accelerate.yaml"
    path.write_text(yaml_text)
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, defaults, mp_from_config_flag = _validate_launch_command(args)
    assert args.use_deepspeed, "the config is a DeepSpeed launch"
    # launch_command's own lines before deepspeed_launcher (commands/launch.py)
    fields = list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mp_from_config_flag else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = prepare_deepspeed_cmd_env(args)
    exported = {k: v for k, v in env.items() if k.startswith("ACCELERATE_DEEPSPEED_") and k not in os.environ}
    with patch_environment(**exported):
        plugin = DeepSpeedPlugin()
    return exported, plugin.deepspeed_config


def main() -> None:
    print(f"accelerate {accelerate.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in FORMS.items():
            exported, config = deepspeed_config_for(BLOG_YAML.format(extra=extra), Path(tmp))
            print(f"\n## {name}")
            print("deepspeed_config:\n" + "".join(f"  {line}\n" for line in extra.splitlines()) if extra else "", end="")
            print("exported:", json.dumps(dict(sorted(exported.items()))))
            print("zero_optimization:", json.dumps(config["zero_optimization"]))


if __name__ == "__main__":
    main()
