"""Reading configs: JSON with positions, duplicate keys with paths, DeepSpeed's hjson leniency,
size and nesting limits — every unreadable input a one-line SpecError."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zeroplan.dsconfig import load_config, parse_config_text
from zeroplan.dsconfig.parse import MAX_CONFIG_BYTES, MAX_NESTING
from zeroplan.spec import SpecError

from helpers import ROOT


def test_plain_json_round_trips():
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, "x": [1, {"y": 2}]}
    parsed = parse_config_text(json.dumps(cfg))
    assert parsed.config == cfg and parsed.duplicate_keys == () and parsed.syntax == "json"


def test_duplicate_keys_found_at_every_depth_with_their_paths():
    text = """{
      "train_batch_size": 8, "train_batch_size": 16,
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "device": "nvme"}},
      "list": [{"a": 1, "a": 2}]
    }"""
    parsed = parse_config_text(text)
    assert sorted(parsed.duplicate_keys) == ["list[0].a", "train_batch_size", "zero_optimization.offload_optimizer.device"]
    assert parsed.config["train_batch_size"] == 16  # json keeps the last one, as the finding says


def test_duplicates_inside_a_discarded_value_do_not_leak_to_other_paths():
    # The first "z" (with its own duplicate) is thrown away by json; its id must not be reused.
    text = '{"z": {"k": 1, "k": 2}, "z": {"m": 1}, ' + ", ".join(f'"o{i}": {{"q": {i}}}' for i in range(200)) + "}"
    assert parse_config_text(text).duplicate_keys == ("z",)


def test_syntax_error_has_line_and_column():
    with pytest.raises(SpecError, match=r"^cfg.json is not valid JSON: Expecting ',' delimiter at line 4 column 1$"):
        parse_config_text('{\n  "a": 1,\n  "b": [1, 2\n}', source="cfg.json")


def test_missing_comma_at_line_end_is_hjson_like_deepspeed_reads_it():
    # hjson (DeepSpeed's reader) takes a newline as a separator; JSON readers do not.
    parsed = parse_config_text('{\n  "a": 1\n  "b": 2\n}')
    assert parsed.config == {"a": 1, "b": 2} and parsed.syntax == "hjson"


def test_hjson_comments_and_trailing_commas_as_deepspeed_reads_them():
    text = '# DeepSpeed accepts this\n{\n  // ZeRO\n  "zero_optimization": {"stage": 3,}, /* x */\n  "a": [1, 2,],\n}\n'
    parsed = parse_config_text(text)
    assert parsed.syntax == "hjson"
    assert parsed.config == {"zero_optimization": {"stage": 3}, "a": [1, 2]}
    pytest.importorskip("hjson")
    import hjson

    assert hjson.loads(text) == parsed.config  # what deepspeed's DeepSpeedConfig(path) would read


def test_hjson_fallback_does_not_accept_bare_words_or_yaml():
    for text in ("hello world", "stage: 3\nzero: true\n", "train_batch_size = 8"):
        with pytest.raises(SpecError, match="not valid JSON"):
            parse_config_text(text)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "is empty"),
        ("  \n\t", "is empty"),
        ("[]", "holds an array"),
        ('"x"', "holds a string"),
        ("3", "holds a number"),
        ("null", "holds null"),
        ("true", "holds a boolean"),
        ('{"lr": NaN}', "NaN is not a JSON number"),
        ('{"lr": -Infinity}', "Infinity is not a JSON number"),
        ("[" * (MAX_NESTING + 1) + "]" * (MAX_NESTING + 1), "levels deep"),
        ('{"a": "' + "[" * 500 + '"}', None),  # brackets inside a string are not nesting
    ],
)
def test_bad_text(text, needle):
    if needle is None:
        assert parse_config_text(text).config == {"a": "[" * 500}
        return
    with pytest.raises(SpecError, match=needle) as info:
        parse_config_text(text)
    assert "\n" not in str(info.value)


def test_nesting_at_the_limit_is_fine():
    text = '{"a": ' + "[" * (MAX_NESTING - 1) + "]" * (MAX_NESTING - 1) + "}"
    value = parse_config_text(text).config["a"]
    for _ in range(MAX_NESTING - 2):
        (value,) = value
    assert value == []


def test_file_errors(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_config(tmp_path / "missing.json")
    with pytest.raises(SpecError, match="is a directory"):
        load_config(tmp_path)
    big = tmp_path / "big.json"
    with big.open("wb") as fh:
        fh.truncate(MAX_CONFIG_BYTES + 1)
    with pytest.raises(SpecError, match="a DeepSpeed config is a few KB"):
        load_config(big)
    binary = tmp_path / "b.json"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(SpecError, match="not UTF-8"):
        load_config(binary)
    bom = tmp_path / "bom.json"
    bom.write_bytes(b'\xef\xbb\xbf{"train_batch_size": 8}')
    assert load_config(bom).config == {"train_batch_size": 8}
    assert load_config(bom).source == str(bom)


def test_validate_path_does_not_import_torch_or_deepspeed():
    """`zeroplan validate`/`export` stay light: the rules use static tables, not DeepSpeed."""
    code = (
        "import sys; from zeroplan.cli import app; "
        "from zeroplan.dsconfig import validate_config, build_config, load_config; "
        "from zeroplan.spec import Plan, TrainingSpec; "
        "cfg = build_config(Plan(stage=3, offload_param='cpu'), world_size=8, training=TrainingSpec()); "
        "assert validate_config(cfg, world_size=8) == []; "
        "heavy = [m for m in ('torch', 'deepspeed', 'optuna', 'pandas') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
