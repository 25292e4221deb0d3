"""`serve run` of ``deployments.app`` (what `make serve` runs) in a subprocess: it answers the
OpenAI API with no arguments and stops cleanly on Ctrl-C (SIGINT).

`serve run IMPORT_PATH` always binds port 8000 (Ray 2.60's CLI has no port option), so the
test runs the same import path through a Serve config file that only moves the port.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deployments.builder import ENV_VARS
from nasd_core.config import EMBEDDED_MODEL, EMBEDDED_MODEL_ALIASES
from tests.deployments.conftest import ServedApp
from tests.redis_server import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180
STOP_TIMEOUT_S = 60


def readme_client_example() -> str:
    """The first Python block of the README's "Serve (OpenAI API)" section."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("## Serve (OpenAI API)") :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def is_listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_serve_run_answers_with_defaults_and_stops_on_sigint(tmp_path):
    port = free_port()
    config = {
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "default", "route_prefix": "/", "import_path": "deployments.app"}],
    }
    config_path = tmp_path / "serve.yaml"
    config_path.write_text(json.dumps(config))  # JSON is YAML
    # A fresh local Ray, and the defaults: no NASD_* setting, no cluster address.
    env = {
        key: value
        for key, value in os.environ.items()
        if key != "RAY_ADDRESS" and key not in ENV_VARS.values()
    }
    log_path = tmp_path / "serve.log"
    serve_bin = Path(sys.executable).parent / "serve"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [str(serve_bin), "run", str(config_path)],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            # A child inherits an ignored SIGINT, and Python then installs no KeyboardInterrupt
            # handler: in the full suite something before this test left SIGINT ignored and
            # `serve run` never saw the signal. A shell's Ctrl-C reaches it with the default.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    app = ServedApp(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (is_listening(port) and app.request("GET", "/v1/models").status == 200):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"serve run did not come up (exit {process.poll()}):\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(1)
        assert [model["id"] for model in app.request("GET", "/v1/models").body["data"]] == [
            EMBEDDED_MODEL,
            *EMBEDDED_MODEL_ALIASES,
        ]
        completion = app.client().completions.create(model=EMBEDDED_MODEL, prompt="Hello", max_tokens=4)
        assert completion.usage.completion_tokens >= 1
        # The README's first client example, as a new user runs it against `make serve`.
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            exec(readme_client_example().replace("http://127.0.0.1:8000/v1", app.api_url), {})
        answer, tokens_per_step = output.getvalue().rstrip("\n").rsplit(" ", 1)
        assert answer.strip() and float(tokens_per_step) >= 1.0

        process.send_signal(signal.SIGINT)
        try:
            exit_code = process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log_tail = log_path.read_text()[-3000:]
            pytest.fail(f"serve run still running {STOP_TIMEOUT_S} s after SIGINT:\n{log_tail}")
        assert exit_code == 0, log_path.read_text()[-3000:]
        assert not is_listening(port), "the HTTP proxy outlived serve run"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
