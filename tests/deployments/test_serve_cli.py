"""`serve run deployments.app` (what `make serve` runs) and the ``nasd-serve`` command, each in
a subprocess: they answer the OpenAI API, drain on SIGTERM (what Kubernetes and Docker send)
and stop cleanly on Ctrl-C (SIGINT).

`serve run IMPORT_PATH` always binds port 8000 (Ray 2.60's CLI has no port option), so that
test needs the port free (it fails in CI, and skips elsewhere, when it is taken).
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
from collections.abc import Iterator
from pathlib import Path

import pytest

from deployments.builder import ENV_VARS, AppArgs
from deployments.cli import app_args, parser
from nasd_core.config import EMBEDDED_MODEL, EMBEDDED_MODEL_ALIASES
from tests.deployments.conftest import ServedApp, server_port
from tests.redis_server import require
from tests.test_readme import readme_python_blocks

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180
STOP_TIMEOUT_S = 60
SERVE_RUN_PORT = 8000
# Tokens streamed across the SIGTERM: several seconds of decoding on 2 CPU cores.
DRAIN_TOKENS = 128


def is_listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def clean_env() -> dict[str, str]:
    """A fresh local Ray, and the defaults: no NASD_* setting, no cluster address."""
    return {
        key: value
        for key, value in os.environ.items()
        if key != "RAY_ADDRESS" and key not in ENV_VARS.values()
    }


def launch(command: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """``command`` started in the repository, its output to ``log_path``."""
    with log_path.open("w") as log:
        return subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            # A child inherits an ignored SIGINT, and Python then installs no KeyboardInterrupt
            # handler: in the full suite something before this test left SIGINT ignored and
            # `serve run` never saw the signal. A shell's Ctrl-C reaches it with the default.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )


def stop(process: subprocess.Popen) -> None:
    """Stopped as a user stops it (Ctrl-C), killed only if that fails: a killed `serve run`
    leaves its Ray cluster running, and the rest of the suite would share the cores with it."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def served(
    process: subprocess.Popen,
    port: int,
    log_path: Path,
    stop_signal: signal.Signals | None = signal.SIGINT,
):
    """The app ``process`` serves once it answers on ``port``; at the end the process must stop
    (exit 0, the port closed) on ``stop_signal``, or on the signal the body sent (None)."""
    name = Path(process.args[0]).name
    app = ServedApp(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (is_listening(port) and app.request("GET", "/v1/models").status == 200):
            if process.poll() is not None or time.monotonic() > deadline:
                log_tail = log_path.read_text()[-3000:]
                pytest.fail(f"{name} did not come up (exit {process.poll()}):\n{log_tail}")
            time.sleep(1)
        yield app
        if stop_signal is not None:
            process.send_signal(stop_signal)
        try:
            exit_code = process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log_tail = log_path.read_text()[-3000:]
            pytest.fail(f"{name} still running {STOP_TIMEOUT_S} s after it was stopped:\n{log_tail}")
        assert exit_code == 0, log_path.read_text()[-3000:]
        assert not is_listening(port), "the HTTP proxy outlived the command"
    finally:
        stop(process)


@pytest.fixture(scope="module")
def nasd_serve(tmp_path_factory) -> Iterator[tuple[subprocess.Popen, int, Path]]:
    """``nasd-serve`` with options, started with the module: its Ray and replica come up while
    `serve run`'s test runs (each start is half waiting, on 2 cores)."""
    port = server_port()
    log_path = tmp_path_factory.mktemp("nasd_serve") / "nasd-serve.log"
    command = [
        str(Path(sys.executable).parent / "nasd-serve"),
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--speculation",
        "off",
    ]
    process = launch(command, log_path, clean_env())
    try:
        yield process, port, log_path
    finally:
        stop(process)


@pytest.mark.usefixtures("nasd_serve")  # started now, to come up beside this test
def test_serve_run_answers_with_defaults_and_drains_on_sigterm(tmp_path):
    port = SERVE_RUN_PORT
    require(not is_listening(port), f"`serve run` binds port {port}, which something else holds")
    serve_bin = Path(sys.executable).parent / "serve"
    command = [str(serve_bin), "run", "deployments.app"]
    log_path = tmp_path / "serve.log"
    process = launch(command, log_path, clean_env())
    with served(process, port, log_path, stop_signal=None) as app:
        assert [model["id"] for model in app.request("GET", "/v1/models").body["data"]] == [
            EMBEDDED_MODEL,
            *EMBEDDED_MODEL_ALIASES,
        ]
        completion = app.client().completions.create(model=EMBEDDED_MODEL, prompt="Hello", max_tokens=4)
        assert completion.usage.completion_tokens >= 1
        # The README's Python examples in order, as a new user runs them against `make serve`.
        namespace: dict = {}
        outputs = []
        for block in readme_python_blocks():
            output = io.StringIO()
            with contextlib.redirect_stdout(output):
                exec(block.replace("http://127.0.0.1:8000/v1", app.api_url), namespace)
            outputs.append(output.getvalue())
        chat, streamed, tools, library = outputs
        answer, tokens_per_step = chat.rstrip("\n").rsplit(" ", 1)
        assert answer.strip() and float(tokens_per_step) >= 1.0
        assert streamed.rstrip("\n").endswith(" tokens")
        name, rest = tools.split(" ", 1)
        arguments, _ = json.JSONDecoder().raw_decode(rest)
        assert name == "get_weather" and "city" in arguments
        assert library.strip() and float(library.rstrip("\n").rsplit(" ", 1)[1]) >= 1.0

        # SIGTERM with an answer streaming: it ends whole, and a request sent meanwhile is told
        # to retry (503) rather than cut.
        stream = app.client().completions.create(
            model=EMBEDDED_MODEL,
            prompt="Count: 1, 2,",
            max_tokens=DRAIN_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            # One token a step, so the answer outlasts the drain's start (a handle call).
            extra_body={"ignore_eos": True, "speculation": "off"},
        )
        chunks = iter(stream)
        next(chunks)
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while app.request("GET", "/health").status != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        turned_away = app.request("POST", "/v1/completions", {"model": EMBEDDED_MODEL, "prompt": "Hi"})
        assert turned_away.status == 503 and turned_away.body["error"]["code"] == "shutting_down"
        rest = list(chunks)
        assert [
            choice.finish_reason for chunk in rest for choice in chunk.choices if choice.finish_reason
        ] == ["length"]
        assert rest[-1].usage.completion_tokens == DRAIN_TOKENS
    log = log_path.read_text()
    assert (
        "SIGTERM received" not in log
        and "drained (requests still open per application: {'default': 0})" in log
    )


def test_nasd_serve_help_lists_every_setting_with_its_default_and_variable():
    text = parser().format_help()
    for name, variable in ENV_VARS.items():
        if name != "model":
            assert f"--{name.replace('_', '-')}" in text, name
        assert variable in text, variable
    assert "default: auto" in text and "[NASD_SPECULATION; default: auto]" in " ".join(text.split())


def test_nasd_serve_options_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("NASD_SPECULATION", "off")
    monkeypatch.setenv("NASD_NUM_REPLICAS", "2")
    options = parser().parse_args(["my/model", "--speculation", "on", "--redis-url", "redis://h:1"])
    args = AppArgs.model_validate(app_args(options))
    assert (args.model, args.speculation, args.num_replicas, args.redis_url) == (
        "my/model",
        "on",
        2,
        "redis://h:1",
    )


def test_nasd_serve_refuses_an_invalid_setting(capsys):
    from deployments.cli import main

    assert main(["--speculation", "sometimes"]) == 2
    assert "speculation" in capsys.readouterr().err


def test_nasd_serve_serves_with_its_options_and_stops_on_sigint(nasd_serve):
    process, port, log_path = nasd_serve
    with served(process, port, log_path) as app:
        assert app.request("GET", "/v1/models").body["data"][0]["id"] == "tiny"
        completion = app.client().completions.create(model="tiny", prompt="Hello", max_tokens=4)
        assert completion.usage.completion_tokens >= 1 and completion.nasd["num_drafted"] == 0
