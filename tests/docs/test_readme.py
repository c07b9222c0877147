"""The commands of the README and the docs pages, as written: each `rlstage` line parses with the CLI's own parser and its config
and overrides validate; each `prefect deployment run` names a deployment of prefect.yaml and parameters
its flow takes, with a config that loads; each `infra/stack.sh` and `scripts/` command exists. This catches a
page that drifted from the code; tests/integration/test_docs_commands.py runs the blocks not marked `<!-- not run: why -->`."""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import re
from pathlib import Path

import pytest
import yaml

from rlstage.flows.cli import build_parser
from rlstage.schemas.config import load_config, parse_overrides
from rlstage.schemas.stages import REPLAYABLE
from tests_support import REPO, shell_blocks

# Shell command lines of the pages' bash blocks (continuations joined, comments dropped: tests/integration/test_docs_commands.py
# reads them), and the page and line of the first block that holds each.
BLOCKS = shell_blocks()
COMMANDS = [list(words) for block in BLOCKS for words in block.commands]
WHERE = {}
for block in BLOCKS:
    for words in block.commands:
        WHERE.setdefault(words, f"{block.page}:{block.line}")


def _write(folder: Path, text: str) -> str:
    path = folder / "written.yaml"
    path.write_text(text)
    return str(path)


def _of(program: str) -> list[list[str]]:
    return [c for c in COMMANDS if c[0] == program]


def test_the_readme_has_the_commands_a_user_runs():
    assert ["bash", "scripts/demo.sh"] in COMMANDS and ["bash", "scripts/test.sh"] in COMMANDS
    assert len(_of(".venv/bin/rlstage")) >= 6 and len(_of("prefect")) >= 2 and len(_of("infra/stack.sh")) >= 3


@functools.cache
def _init_configs() -> dict[str, str]:
    """The config each page's `rlstage init` writes (its --out: the text), for the commands that train with it."""
    from rlstage.flows.init import InitChoices, render

    out = {}
    for words in _of(".venv/bin/rlstage"):
        args = build_parser().parse_args(words[1:])
        if args.cmd == "init":
            choices = InitChoices(args.model, args.train, args.test, args.reward, args.prompt_column, args.answer_column, args.run_name or args.out.stem)
            out[str(args.out)] = render(choices)
    return out


@pytest.mark.parametrize("words", _of(".venv/bin/rlstage"), ids=lambda w: f"{WHERE[tuple(w)]} {' '.join(w[1:3])}")
def test_each_rlstage_command_parses_and_its_settings_validate(words, tmp_path):
    args = build_parser().parse_args(words[1:])  # a usage error exits (one line, status 2): the test fails
    overrides = getattr(args, "overrides", [])
    written = _init_configs()
    if args.cmd == "init":  # the config it writes loads (its files and model are the user's)
        load_config(_write(tmp_path, written[str(args.out)]))
    if args.cmd in ("train", "data-prep", "demo"):
        if args.config is not None and str(args.config) in written:  # written by an init command of the page
            config = _write(tmp_path, written[str(args.config)])
        else:
            config = args.config if args.config is None else str(REPO / args.config)
        load_config(config, overrides)  # an unknown key or a bad value raises, naming the field
    elif args.cmd == "reward-model":  # the config of the run the RM is for, its RM itself not built yet
        load_config(str(REPO / args.config), [*overrides, "reward_model.enable=false"])
    elif args.cmd in ("replay", "eval"):
        load_config(None, overrides)  # changed settings on a stored config: the same fields
    if args.cmd == "replay":
        assert args.stage in REPLAYABLE, args.stage


@pytest.mark.parametrize("words", _of("prefect"), ids=lambda w: f"{WHERE[tuple(w)]} {w[3]}")
def test_each_deployment_run_names_a_deployment_and_parameters_of_its_flow(words):
    assert words[1:3] == ["deployment", "run"], words
    flow_name, deployment = words[3].split("/")
    declared = {d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    assert deployment in declared, sorted(declared)
    module, attr = declared[deployment]["entrypoint"].split(":")
    flow = getattr(importlib.import_module(module), attr)
    assert flow.name == flow_name
    params = {}
    for i, w in enumerate(words):
        if w in ("-p", "--param"):
            key, value = words[i + 1].split("=", 1)
            try:
                params[key] = json.loads(value)
            except json.JSONDecodeError:
                params[key] = value  # Prefect takes a value that is not JSON as a string
    assert set(params) <= set(inspect.signature(flow.fn).parameters), params
    if "config_path" in params:
        load_config(str(REPO / params["config_path"]), params.get("overrides", []))
    else:
        parse_overrides(params.get("overrides", []))


def test_stack_and_script_commands_exist():
    usage = re.search(r"usage: \$0 ([\w|]+)", (REPO / "infra/stack.sh").read_text()).group(1).split("|")
    for words in _of("infra/stack.sh"):
        assert words[1] in usage, words
    for words in _of("bash"):
        assert (REPO / words[1]).is_file(), words
