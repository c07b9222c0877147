"""A command whose Prefect server stops answering mid-run says so in one line (flows/cli.py: PrefectLost, exit 3).

Measured by hand (not in CI: ~3.5 minutes with Prefect's default client retries): `rlstage train` against a
server SIGKILLed during iteration 1 stops with that line and no traceback; the rerun reuses what was committed."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flows.cli import PrefectLost, _lost_if_down
from infra.env import free_port


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_failure_while_the_server_is_gone_is_said_as_that():
    url = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    with pytest.raises(PrefectLost) as err, _lost_if_down(url):
        raise ConnectionError("[Errno 111] Connection refused")
    assert str(err.value) == f"the Prefect server {url} stopped answering during the run"
    assert isinstance(err.value.__cause__, ConnectionError)


def test_a_failure_while_the_server_answers_is_the_failure_itself():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ValueError, match="a bug"), _lost_if_down(f"http://127.0.0.1:{server.server_port}/api"):
            raise ValueError("a bug")
    finally:
        server.shutdown()
