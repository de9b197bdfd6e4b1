"""Regenerate the zeroplan-*.log fixtures: zeroplan's own fault scripts run as real probes
(tests/test_runtime_faults.py does the same), each probe's full log copied here.

    PYTHONPATH=. python tests/data/doctor/make_zeroplan_logs.py
"""

from __future__ import annotations

import json
import shutil
import tempfile
import textwrap
from pathlib import Path

from zeroplan.runtime import ProbeRequest, run_probe

HERE = Path(__file__).resolve().parent
CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0}}

#: name → (script, expected class, timeout seconds)
FAULTS = {
    "crash": ("raise RuntimeError('the data loader found no shards under /data/train')\n", "crash", 300),
    "oom": ("import torch\nx = torch.empty(1 << 46, dtype=torch.uint8)\n", "host-oom", 300),
    "host-oom": (textwrap.dedent("""
        import resource
        import psutil
        limit = psutil.Process().memory_info().vms + (1 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
        hog = bytearray(16 << 30)
    """), "host-oom", 300),
    "killed": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "host-oom", 300),
    "hang": ("import time\ntime.sleep(600)\n", "hang", 90),
}


def main() -> None:
    for name, (source, expected, timeout_s) in FAULTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            script = tmp / "script.py"
            script.write_text(source)
            r = run_probe(ProbeRequest(script=script, ds_config=CONFIG, timeout_s=timeout_s, workdir=tmp / "w"))
            logs = sorted((tmp / "w").glob("probe*.log"))
            text = "".join(p.read_text(errors="replace") for p in logs)
            text = text.replace(str(tmp), "/tmp/zeroplan-probe")
            (HERE / f"zeroplan-{name}.log").write_text(text)
            (HERE / f"zeroplan-{name}.json").write_text(json.dumps({
                "source": "zeroplan fault script (tests/data/doctor/make_zeroplan_logs.py), run as a probe",
                "class": expected, "probe_status": r.status,
            }, indent=2) + "\n")
            print(name, r.status, (r.error or "")[:120], flush=True)


if __name__ == "__main__":
    main()
