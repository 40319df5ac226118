"""The command line's help reads as plain text: every command and benchmark with its one line,
no reST markup from the modules' docstrings, and what ``eval`` can run. In process: the
parser prints its help and exits."""

from __future__ import annotations

import re

import pytest

from loongtrain import cli

#: reST or Markdown markup: code quotes, roles
MARKUP = re.compile(r"`|:(func|class|mod|meth|attr|data):")


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def _flat(text: str) -> str:
    """``text`` with argparse's wrapping undone (runs of whitespace as one space)."""
    return " ".join(text.split())


def test_top_help_is_one_sentence_and_lists_every_command_and_benchmark(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = _help(capsys, [])
    assert not MARKUP.search(out), out
    description = _flat(out.split("\n\n")[1])  # after the usage: a whole sentence, not a cut one
    assert description == cli.DESCRIPTION and description.endswith(".") and description.count(". ") == 0
    flat = _flat(out)
    for name, (_, help, _) in cli.COMMANDS.items():
        assert f" {name} {help} " in flat, name
    assert re.search(r" bench benchmarks that print tables ", flat)
    for name, (_, help) in cli.BENCHES.items():
        assert f" bench {name} {help} " in flat, name


def test_benchmark_list_wraps_under_its_column(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    text = cli._listing("t:", [("bench x", "word " * 20)])
    lines = text.splitlines()
    assert lines[1].startswith("    bench x") and lines[1].index("word") == 24
    assert len(lines) > 2 and all(line.startswith(" " * 24 + "word") and len(line) <= 58 for line in lines[2:])


@pytest.mark.parametrize("argv", [[name] for name in cli.COMMANDS] + [["bench"]] + [["bench", b] for b in cli.BENCHES])
def test_each_command_help_says_its_line_without_markup(capsys, argv):
    out = _help(capsys, argv)
    assert not MARKUP.search(out), out
    line = cli.BENCHES[argv[1]][1] if len(argv) == 2 else cli.COMMANDS.get(argv[0], (None, "Benchmarks"))[1]
    assert _flat(out.split("\n\n")[1]).startswith(line)  # the description under the usage


def test_eval_help_names_the_generated_tasks_and_their_key(capsys):
    from loongtrain.eval.generated import GENERATED_TASKS, RECALL_TASKS

    flat = _flat(_help(capsys, ["eval"]))
    assert f"TASK one of: {', '.join(GENERATED_TASKS)} " in flat
    assert "--eval.generated TASK[,TASK...] or --eval.generated all" in flat
    assert f"recall task's token ids: {', '.join(RECALL_TASKS)})" in flat
