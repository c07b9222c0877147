"""A data source: prompts from a CSV file with a header row.

``data.source: csv_qa`` with ``data.train_path``, ``data.test_path`` and, in ``data.source_settings``, the
columns that hold the question and the answer.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from rlstage.engines.data.datasets import DatasetError, register_data_source
from rlstage.schemas.artifacts import PROMPTS, conform


class CsvSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    question_column: str = "question"
    answer_column: str = "answer"
    data_source: str = "my_org/arith"  # the rows' data_source: metrics are grouped by it, and it picks a reward
    chat: bool = False  # send the question as a user message, so that a chat model's template applies


@register_data_source("csv_qa", settings=CsvSettings)
def load_csv(path, split=None, **settings):
    """One prompt per row of the CSV file ``path``; ``split`` (default: the file's stem) names the prompt ids."""
    s = CsvSettings(**settings)
    p = Path(path)
    split = split or p.stem
    with p.open(newline="", encoding="utf-8") as f:
        records = list(csv.DictReader(f))
    rows = []
    for i, rec in enumerate(records):
        question, answer = rec.get(s.question_column), rec.get(s.answer_column)
        if not question or not answer:
            raise DatasetError(f"{p}: row {i + 1} has no {s.question_column!r} or no {s.answer_column!r}")
        rows.append(
            {
                "prompt_id": f"csv-{split}-{i}",
                "prompt": question,
                "messages": [{"role": "user", "content": question}] if s.chat else None,
                "data_source": s.data_source,
                "ground_truth": answer.strip(),
                "extra_info": json.dumps({"split": split, "index": i}),  # a JSON object the reward receives
            }
        )
    if not rows:
        raise DatasetError(f"{p}: no rows")
    return conform(pa.Table.from_pylist(rows, schema=PROMPTS), PROMPTS)
