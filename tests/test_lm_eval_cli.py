"""``loongtrain lm-eval`` refuses a layout the model cannot take in one line, before lm-eval is
imported (so also without the ``lm-eval`` extra)."""

from __future__ import annotations

import argparse
import sys

import pytest

from loongtrain.tools.lm_eval import main

from hf_tiny import make_hf_model


def test_a_layout_the_model_cannot_take_is_one_line_before_lm_eval(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    folder = make_hf_model("llama", tmp_path / "hf", num_attention_heads=9, hidden_size=72,
                           num_key_value_heads=3)  # fmt: skip
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # lm-eval is never reached (an import would fail)
    args = ["--model", "loongtrain", "--model_args", f"path={folder},nproc=2,hp=2", "--tasks", "hellaswag"]
    with pytest.raises(SystemExit) as stop:
        main(argparse.Namespace(), args)
    assert stop.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "Traceback" not in out.err
    assert out.err.startswith("loongtrain lm-eval: ") and "9" in out.err and "hp" in out.err, out.err
    # a layout the model takes passes the check and goes on to lm-eval (here: not importable)
    with pytest.raises(SystemExit):
        main(argparse.Namespace(), ["--model", "loongtrain", "--model_args", f"path={folder},nproc=3,hp=3"])
    assert "lm_eval" in capsys.readouterr().err
