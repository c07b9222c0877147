"""infra/prefect_server.py's client-side settings, without a server."""

from __future__ import annotations

import prefect.client.base as base
import pytest


@pytest.fixture
def restore_backoff():
    """Prefect's own backoff during the test (a run earlier in this process may have made it quick), then as was."""
    before = base.clamped_poisson_interval
    base.clamped_poisson_interval = getattr(before, "__wrapped__", before)
    yield
    base.clamped_poisson_interval = before


def test_a_local_servers_503_is_retried_at_once_and_a_restart_still_waited_for(restore_backoff, monkeypatch) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from rlstage.infra.prefect_server import quick_retries_on_a_local_server

    with temporary_settings(updates={PREFECT_API_URL: "https://prefect.example.com/api"}):
        monkeypatch.delenv("PREFECT_API_URL", raising=False)
        quick_retries_on_a_local_server()
        assert not getattr(base.clamped_poisson_interval, "_rlstage_local", False)  # another server: Prefect's waits
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        quick_retries_on_a_local_server()
        quick_retries_on_a_local_server()  # once: not scaled twice
    waits = [base.clamped_poisson_interval(2.0**n, 0.01) for n in range(1, 6)]  # Prefect's 2**n s, retries 1..5
    assert waits == pytest.approx([0.125, 0.5, 2.0, 8.0, 32.0], rel=0.05)  # with Prefect's jitter of 1 %
    assert sum(waits) > 40  # a server the command restarts (~10 s) is still waited for
