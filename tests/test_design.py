"""docs/design.md is the contract: the layering it states holds in the imports, the JSON and CSV
it documents are what the code writes, and the code cites it (not an outside file)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from helpers import ROOT
DESIGN = (ROOT / "docs" / "design.md").read_text()

#: docs/design.md "Layers": a package may import only packages of a lower rank (and itself).
RANK = {"spec": 0, "estimator": 1, "profiles": 1, "trace": 1, "dsconfig": 2, "calibrate": 3, "runtime": 3, "tuner": 4, "doctor": 4, "cli": 5}


def _imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "zeroplan":
                continue
            if len(parts) > 1:
                found.add(parts[1])
            else:  # from zeroplan import estimator, profiles
                found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("zeroplan.")}
    return found & set(RANK)


@pytest.mark.parametrize("package", sorted(RANK))
def test_no_layer_imports_a_higher_one(package):
    wrong = {}
    for path in sorted((ROOT / "zeroplan" / package).rglob("*.py")):
        higher = {p for p in _imported_packages(path) if p != package and RANK[p] >= RANK[package]}
        if higher:
            wrong[str(path.relative_to(ROOT))] = sorted(higher)
    assert not wrong, f"imports against docs/design.md's layering: {wrong}"


def test_the_code_cites_the_projects_own_design():
    outside = "DESIGN" + ".md"  # the seed document the project replaced with docs/design.md
    hits = [str(p.relative_to(ROOT)) for folder in ("zeroplan", "tests", "benchmarks", "examples")
            for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".toml") and outside in p.read_text()]
    hits += ["README.md"] if outside in (ROOT / "README.md").read_text() else []
    assert hits == []


#: Common rules: a module stays under ~500 lines; one that grows past it is split by job.
MAX_MODULE_LINES = 500


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "zeroplan").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"split these by job (at most {MAX_MODULE_LINES} lines each): {long}"


def _documented_keys(heading: str) -> set[str]:
    """Backticked names in the first column of the tables under ``heading``."""
    section = DESIGN.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    keys = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            keys |= set(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    return keys


def test_estimate_json_keys_are_documented():
    from zeroplan.cli.estimate import estimates_to_json
    from zeroplan.estimator import estimate_plan
    from zeroplan.profiles import load_gpu
    from zeroplan.spec import ClusterSpec, ModelSpec, Plan, TrainingSpec

    model, training = ModelSpec.from_params(1e9), TrainingSpec()
    cluster = ClusterSpec(gpus=8, gpus_per_node=8, gpu=load_gpu("a100-80gb"))
    doc = estimates_to_json(model, cluster, training, [estimate_plan(model, cluster, training, Plan(stage=3))])
    documented = _documented_keys("JSON: `estimate --format json`")
    assert set(doc) - documented == set()
    assert set(doc["plans"][0]) - documented - {"cpu_checkpointing"} == set()
    section = DESIGN.split("## JSON: `estimate --format json`", 1)[1].split("\n## ", 1)[0]
    for obj in ("model", "cluster", "training"):
        row = next(line for line in section.splitlines() if line.startswith(f"| `{obj}`"))
        assert set(doc[obj]) - set(re.findall(r"`([a-z_]+)`", row.split("|")[2])) == set(), obj
    for obj in ("gpu", "step_time_breakdown"):
        row = next(line for line in section.splitlines() if line.startswith("|") and f"`{obj}`" in line.split("|")[1])
        assert set(doc["plans"][0][obj]) - set(re.findall(r"`([a-z_]+)`", row.split("|")[2])) == set(), obj


def test_probe_json_and_trials_csv_are_documented():
    from zeroplan.runtime import STATUSES, ProbeResult
    from zeroplan.tuner.results import CSV_COLUMNS

    assert set(ProbeResult(status="ok", backend="deepspeed", world_size=2, steps=1).as_dict()) - _documented_keys(
        "JSON: `probe --format json`"
    ) == set()
    csv = DESIGN.split("## CSV: `trials.csv`", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"`([a-z_]+)`", csv.split("\n\n")[1])
    assert [c for c in listed if c in CSV_COLUMNS] == CSV_COLUMNS
    assert all(f"`{s}`" in csv for s in STATUSES)


# --- runtime's parts (docs/design.md "Layers": runtime/ launch, rank, discovery, measure) ------

RUNTIME = ROOT / "zeroplan" / "runtime"


def _runtime_targets(path: Path) -> set[str]:
    """runtime's parts and top modules that ``path`` imports anywhere (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found |= {n.split(".")[2] for n in names if n.startswith("zeroplan.runtime.")}
    return found


def _top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_the_runtime_parts_design_lists_are_the_folders():
    listed = set(re.findall(r"^ {4}(\w+)/ ", DESIGN, re.M))
    folders = {p.name for p in RUNTIME.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert listed == folders == {"launch", "rank", "discovery", "measure"}


def test_a_rank_never_imports_what_starts_it():
    wrong = {str(p.relative_to(ROOT)): sorted(hit) for p in sorted((RUNTIME / "rank").rglob("*.py"))
             if (hit := _runtime_targets(p) & {"launch", "probe"})}
    assert wrong == {}


def test_the_driving_side_of_the_runtime_imports_no_torch_at_module_level():
    driving = [*sorted((RUNTIME / "launch").glob("*.py")), RUNTIME / "api.py", RUNTIME / "probe.py", RUNTIME / "__init__.py"]
    wrong = {str(p.relative_to(ROOT)): sorted(hit) for p in driving if (hit := _top_level_imports(p) & {"torch", "deepspeed"})}
    assert wrong == {}
