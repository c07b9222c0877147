"""Data prep through the pipeline: prompts over the length limit stop it in one line, and are not retried."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlstage.engines.data import datasets as D


def test_prompts_over_the_length_limit_stop_data_prep_in_one_line_and_are_not_retried(prefect_api, tmp_path: Path) -> None:
    """verl's default: an overlong prompt is an error, not a silent drop (data.filter_overlong_prompts drops them)."""
    from rlstage.flows.training import train
    from rlstage.schemas.config import load_config
    from rlstage.tasks.runtime import store_for
    from rlstage.tasks.stages import _retryable
    from tests_support import tiny_overrides

    cfg = load_config(None, [f"store.root={tmp_path}", "run_name=long", *tiny_overrides(), "data.max_prompt_length=4"])
    with pytest.raises(D.DatasetError) as err:
        train(config=cfg)
    line = str(err.value).splitlines()[-1]
    assert re.search(r"data\.source=synthetic \(train split\): 400 of 400 prompts are longer than data\.max_prompt_length=4 tokens", line), line
    assert store_for(cfg).manifest("long", None, "data_prep") is None
    assert not _retryable(None, None, SimpleNamespace(data=D.DatasetError("bad data")))  # a retry reads the same rows

