"""A verifiers taskset played through rlstage's endpoint: ``agent.function: rlstage.engines.agents.verifiers_env:episode``.

The prompts come from ``data.source: verifiers`` (engines/data/verifiers_env.py), one row per task. Each sample is one
episode of its task in the taskset's own environment: verifiers' chat harness sends the model calls to this
sample's endpoint (its requests carry the sample's id), the taskset's rewards score the episode. Which taskset and
which interpreter come from the run's config (``sample.settings``), never from the stored row, which only holds
the task's data.
"""

from __future__ import annotations

import asyncio
import json

from rlstage.engines.agents.endpoint import KEY_HEADER, SAMPLE_HEADER
from rlstage.engines.data.verifiers_env import VerifiersError, VerifiersSettings, sidecar_for


async def episode(client, sample) -> float:
    """The row's task played to its end by the taskset's harness against ``client``'s endpoint; its reward."""
    try:
        s = VerifiersSettings.model_validate(sample.settings)
    except ValueError:
        raise VerifiersError(
            "rlstage.engines.agents.verifiers_env:episode plays data.source: verifiers rows only"
        ) from None
    task = json.loads(sample.row["extra_info"])["verifiers"]
    sidecar = await asyncio.to_thread(
        sidecar_for, s
    )  # starting it (seconds) must not stall the batch's other agents
    return await sidecar.episode(
        task["data"], str(client.base_url), {SAMPLE_HEADER: sample.sample_id, KEY_HEADER: client.api_key}, sample.model
    )
