"""Every shell block of the README and the docs pages is run here, or says next to it why not.

A block preceded by ``<!-- not run: <why> -->`` is only parsed (tests/docs/test_readme.py); every other block may
hold only ``rlstage`` commands, and this module runs them all, in page order, in one empty directory with its
own home: as written, with the tiny kit's short settings appended where a command trains. What the pages
show a command printing (the learning line, the UI addresses) is checked against what it printed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests_support import REPO, shell_blocks, source_path, tiny_overrides

RLSTAGE = ".venv/bin/rlstage"
TRAINS = ("train", "data-prep")  # subcommands that get the short settings
SHORT = [*tiny_overrides(), "trainer.iterations=2"]
BLOCKS = shell_blocks()
RUN = list(dict.fromkeys(c for b in BLOCKS if b.not_run is None for c in b.commands))  # in page order, once


def test_every_block_is_run_here_or_says_why_not():
    assert RUN and sum(b.not_run is not None for b in BLOCKS) >= 5
    for b in BLOCKS:
        for words in b.commands if b.not_run is None else ():
            assert words[0] == RLSTAGE, f"{b.page}:{b.line}: `{' '.join(words)}` is not an rlstage command: run it in tests/integration/test_docs_commands.py or mark its block <!-- not run: why -->"
        for path in re.findall(r"tests/(?:\w+/)*test_\w+\.py", b.not_run or ""):  # a reason that names a test names one that exists
            assert (REPO / path).is_file(), f"{b.page}:{b.line}: names {path}, which does not exist"


def _shown(block_text: str) -> list[re.Pattern]:
    """What a block's comment lines show a command printing (``# Label: http://...``), numbers left open."""
    shown = re.findall(r"^# (\w[\w ]*: +http\S+)$", block_text, re.M)
    return [re.compile(re.sub(r"\d+", r"\\d+", re.escape(s))) for s in shown]


def _learning_line() -> re.Pattern:
    """The shape of the learning line the README shows, with its numbers left open."""
    shown = re.search(r"^learning: .*$", (REPO / "README.md").read_text(), re.M).group(0)
    return re.compile("^" + re.sub(r"\d+", r"\\d+", re.escape(shown)) + "$", re.M)


def _ui(cwd: Path, env: dict, words: tuple[str, ...]) -> str:
    """``rlstage ui`` blocks until Ctrl-C: started, read until both addresses are out, then interrupted."""
    proc = subprocess.Popen([sys.executable, "-m", "rlstage.flows.cli", *words], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, deadline = [], time.monotonic() + 120
    try:
        while time.monotonic() < deadline and not any(line.startswith("MLflow UI:") for line in out):
            line = proc.stdout.readline()
            if not line:
                break
            out.append(line.rstrip("\n"))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode in (0, 130, -signal.SIGINT), "\n".join(out)
    return "\n".join(out)


def test_the_pages_commands_run_and_print_what_the_pages_show(prefect_api, tmp_path, monkeypatch, capsys):
    import ray

    from rlstage.flows.cli import main

    # The pages' commands start their own Ray where they run: a Ray of an earlier test, started elsewhere, would
    # resolve the pages' relative store (./rlstage-runs) in its own working directory.
    ray.shutdown()
    (tmp_path / "configs").symlink_to(REPO / "configs")  # the pages run from the repository root
    monkeypatch.chdir(tmp_path)
    for key in ("RLSTAGE_HOME", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(key, raising=False)
    # What the README's first command leaves behind, short: a run named demo (`compare demo exp1`)
    assert main(["train", "-c", "configs/demo.yaml", *SHORT]) == 0
    capsys.readouterr()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MLFLOW_TRACKING"))}
    env["PYTHONPATH"] = source_path()
    printed = {}
    for words in RUN:
        args, t0 = list(words[1:]), time.perf_counter()
        if args[0] == "ui":
            printed[words] = _ui(tmp_path, env, tuple(args))
            continue
        if args[0] in TRAINS:
            args += SHORT
        code = main(args)
        out = capsys.readouterr()
        assert code == 0, f"`{' '.join(words)}` exited {code}: {out.err[-2000:]}"
        printed[words] = out.out + out.err
        print(f"{time.perf_counter() - t0:6.1f}s  {' '.join(words)}", file=sys.__stdout__)
    trained = [p for w, p in printed.items() if w[1] == "train"]
    assert trained and all(_learning_line().search(p) for p in trained), trained
    for b in BLOCKS:
        for pattern in _shown(b.text) if b.not_run is None else ():
            ui = [p for w, p in printed.items() if w[1] == "ui"]
            assert ui and all(pattern.search(p) for p in ui), (b.page, b.line, pattern.pattern, ui)
    compared = [w for w in RUN if w[1] == "compare" and "--png" in w]
    for words in compared:
        assert (tmp_path / words[words.index("--png") + 1]).stat().st_size > 0
    assert len(printed) == len(RUN) and Path("rlstage-runs/exp1/iter-000007").is_dir()  # nightly went on to 7
    ray.shutdown()  # its workers run in this directory, which the test removes


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.not_run], ids=lambda b: f"{b.page}:{b.line}")
def test_a_block_not_run_says_why_in_words(block):
    assert len(block.not_run.split()) >= 5, f"{block.page}:{block.line}: say why the block is not run"
