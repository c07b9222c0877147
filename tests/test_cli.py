"""The CLI's own surface: version, help with choices and defaults."""

from __future__ import annotations

import pytest

from flows.cli import main
from schemas.stages import REPLAYABLE


def _out(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


def test_version(capsys):
    assert _out(capsys, ["--version"]).startswith("rlstage ")


def test_help_lists_choices_and_defaults(capsys):
    replay = " ".join(_out(capsys, ["replay", "--help"]).split())
    assert f"one of: {', '.join(REPLAYABLE)}" in replay
    assert "store root of the run (default: ./rlstage-runs)" in replay
    nightly = " ".join(_out(capsys, ["nightly", "--help"]).split())
    assert "iterations to add (default: 1)" in nightly
    assert "(default: None)" not in nightly
