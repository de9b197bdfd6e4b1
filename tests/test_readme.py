"""The README's and docs' example outputs are what the commands print today
(benchmarks/readme_examples.py re-runs every marked block: the estimate example, profiles)."""

from __future__ import annotations

from helpers import ROOT, benchmark

readme_examples = benchmark("readme_examples")


def test_the_readme_shows_its_estimate_example():
    examples = readme_examples.find_examples(ROOT / "README.md")
    assert [e.argv.split()[0] for e in examples] == ["estimate"]


def test_every_example_block_matches_todays_output():
    problems = readme_examples.check()
    assert not problems, "\n\n".join(problems) + f"\n\n{len(problems)} stale block(s): {readme_examples.UPDATE_HINT}"


def test_a_stale_block_is_caught(tmp_path):
    """The check can fail: one changed figure in a copy of the README's block is reported."""
    doc = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text()
    doc.write_text(text.replace("plans fit,", "plans fit (edited),", 1))
    assert len(readme_examples.check([doc])) == 1
