"""examples/gpt_task.py stays a standalone user script, and `zeroplan calibrate` ships its own GPT
(the examples folder is not installed): the two must stay the same model."""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")

from helpers import example as load_example


def test_calibrate_gpt_is_the_example_gpt():
    from zeroplan.calibrate.gpt import GPT, GPTShape, gpt_model_spec

    gpt_task = load_example("gpt_task")
    sizes = dict(layers=3, hidden=64, heads=4, vocab=512, seq_len=32)
    example = gpt_task.GPT(gpt_task.GPTConfig(**sizes))
    library = GPT(GPTShape(**sizes))
    assert sorted(tuple(p.shape) for p in example.parameters()) == sorted(tuple(p.shape) for p in library.parameters())
    counted = sum(p.numel() for p in example.parameters())
    assert gpt_task.model_spec(gpt_task.GPTConfig(**sizes)).params == gpt_model_spec(GPTShape(**sizes)).params == counted
