"""What API keys cost a request: the key check alone, and requests through the real server with
and without keys.

- check: ``ApiKeys.find`` (every valid key's digest compared, in constant time) over key files of
  1, 100 and 1000 keys, microseconds per check, in this process;
- HTTP: three applications on one local Serve, one replica each: open, a second open one (the
  noise floor: two open servers differ by this much) and keyed (a file of 100 keys);
  ``GET /v1/models`` (the ingress alone: the model card is cached) and a one-token chat
  completion, the three in turn request by request over one kept-alive connection each; p50 and
  mean latency, keyed minus open beside control minus open.

    python -m benchmarks.auth_cost            # 300 requests per route and application
    python -m benchmarks.auth_cost --quick    # 60
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import time
from pathlib import Path

import ray
from ray import serve

from benchmarks.common import percentile, run_metadata, write_result
from deployments import build_app
from deployments.auth import ApiKeys
from nasd_core.config import EMBEDDED_MODEL
from pool_service.local_redis import free_port

KEY_COUNTS = (1, 100, 1000)
CHECKS = 20000
HTTP_KEYS = 100
CHAT = {
    "model": EMBEDDED_MODEL,
    "messages": [{"role": "user", "content": "Say yes."}],
    "max_tokens": 1,
    "temperature": 0,
}


def key_file(directory: Path, count: int) -> tuple[Path, str]:
    """A key file of ``count`` keys and one of its keys (the last, so nothing ends early)."""
    keys = [f"sk-bench-{index:06d}-{'x' * 24}" for index in range(count)]
    path = directory / f"keys_{count}"
    path.write_text("".join(f"{key} tenant-{index % 10}\n" for index, key in enumerate(keys)))
    return path, keys[-1]


def time_checks(directory: Path) -> dict[str, float]:
    """Microseconds per ``ApiKeys.find`` of a valid key, by the file's key count."""
    result = {}
    for count in KEY_COUNTS:
        path, key = key_file(directory, count)
        keys = ApiKeys(None, str(path))
        assert keys.find(key) is not None and keys.find("sk-wrong") is None
        started = time.perf_counter()
        for _ in range(CHECKS):
            keys.find(key)
        result[str(count)] = round(1e6 * (time.perf_counter() - started) / CHECKS, 2)
    return result


def timed(
    connection: http.client.HTTPConnection, method: str, path: str, body: dict | None, headers: dict
) -> float:
    """Seconds of one request on ``connection``; it must answer 200."""
    payload = json.dumps(body).encode() if body is not None else None
    started = time.perf_counter()
    connection.request(method, path, body=payload, headers={"Content-Type": "application/json", **headers})
    response = connection.getresponse()
    response.read()
    elapsed = time.perf_counter() - started
    assert response.status == 200, f"{method} {path}: {response.status}"
    return elapsed


def time_http(directory: Path, num_requests: int) -> dict[str, dict[str, float]]:
    """Latency of each route on the open and the keyed application, interleaved."""
    path, key = key_file(directory, HTTP_KEYS)
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"num_cpus_per_replica": 1, "dtype": "float32"}  # as the results are labelled
        serve.run_many(
            [
                serve.RunTarget(build_app(args), name="open", route_prefix="/open"),
                serve.RunTarget(build_app(args), name="control", route_prefix="/control"),
                serve.RunTarget(
                    build_app({**args, "api_keys_file": str(path)}), name="keyed", route_prefix="/keyed"
                ),
            ]
        )
        apps = {"open": {}, "control": {}, "keyed": {"Authorization": f"Bearer {key}"}}
        connections = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=60) for name in apps}
        routes = {
            "models": ("GET", "/v1/models", None),
            "chat_1_token": ("POST", "/v1/chat/completions", CHAT),
        }
        seconds: dict[str, dict[str, list[float]]] = {route: {name: [] for name in apps} for route in routes}
        for route, (method, route_path, body) in routes.items():
            for name, headers in apps.items():  # warm up: first calls load code paths
                for _ in range(5):
                    timed(connections[name], method, f"/{name}{route_path}", body, headers)
            for _ in range(num_requests):
                for name, headers in apps.items():
                    seconds[route][name].append(
                        timed(connections[name], method, f"/{name}{route_path}", body, headers)
                    )
        return {
            route: {
                **{
                    f"{name}_{stat}_ms": round(1000 * value, 3)
                    for name, samples in by_app.items()
                    for stat, value in (
                        ("p50", percentile(samples, 50)),
                        ("mean", sum(samples) / len(samples)),
                    )
                },
                **{
                    f"{name}_minus_open_p50_ms": round(
                        1000 * (percentile(by_app[name], 50) - percentile(by_app["open"], 50)), 3
                    )
                    for name in ("keyed", "control")
                },
            }
            for route, by_app in seconds.items()
        }
    finally:
        serve.shutdown()
        ray.shutdown()


def markdown_table(payload: dict) -> str:
    checks = payload["check_us_by_keys"]
    lines = [
        "| keys in the file | " + " | ".join(checks) + " |",
        "|---|" + "---|" * len(checks),
        "| µs per key check | " + " | ".join(f"{value:.1f}" for value in checks.values()) + " |",
        "",
        f"| route ({payload['requests']} requests each, interleaved) | open p50 ms | keyed p50 ms "
        "| keyed - open p50 ms | second open - open p50 ms (noise) | open mean ms | keyed mean ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for route, cell in payload["http"].items():
        lines.append(
            f"| {route} | {cell['open_p50_ms']:.2f} | {cell['keyed_p50_ms']:.2f} "
            f"| {cell['keyed_minus_open_p50_ms']:+.2f} | {cell['control_minus_open_p50_ms']:+.2f} "
            f"| {cell['open_mean_ms']:.2f} "
            f"| {cell['keyed_mean_ms']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="60 requests per route and application")
    args = parser.parse_args()
    num_requests = 60 if args.quick else 300
    with tempfile.TemporaryDirectory() as directory:
        checks = time_checks(Path(directory))
        print("µs per key check by keys in the file:", checks)
        http_cost = time_http(Path(directory), num_requests)
    payload = {
        "benchmark": "auth_cost",
        "meta": {**run_metadata(None, "float32", "benchmarks.auth_cost"), "http_keys": HTTP_KEYS},
        "requests": num_requests,
        "check_us_by_keys": checks,
        "http": http_cost,
    }
    print(markdown_table(payload))
    print(f"results: {write_result('auth_cost_float32' + ('_quick' if args.quick else ''), payload)}")


if __name__ == "__main__":
    main()
