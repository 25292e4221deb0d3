"""A replica SIGKILLed under load: what the clients lost, and how soon the replacement serves warm.

Two replicas (one CPU each) behind one application, sharing a pool on the machine's Redis. A
round sends ``NUM_REQUESTS`` greedy requests at once, half streamed and half whole. The first
round runs undisturbed and gives the reference answers. In the next round, once half the
streams have sent a token, the process of the replica running the most requests gets SIGKILL.

Each request of the killed round ends one of these ways:
- whole, answered: the ingress sent it again to the other replica, since the client had
  nothing of it yet. The answer is checked against the undisturbed one.
- whole, error: lost.
- stream completed.
- stream cut: it had sent tokens, so it ends with an error event and ``[DONE]``. The client
  knows it was cut.
- hung: no end within ``HANG_S``. This must be zero.

Then: seconds until Serve's replacement answers, and whether it started warm (its pool index
held entries at its first report).

    python -m benchmarks.replica_kill      # 2 replicas, 32 requests: about 3 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from typing import Any

import openai
import ray
from ray import serve

from benchmarks.common import new_figure, publish_run, result_name, run_metadata, suite_parser
from benchmarks.workloads import distinct_prompts
from deployments import build_app
from deployments.builder import REPLICA_DEPLOYMENT
from nasd_core.config import EMBEDDED_MODEL
from pool_service.local_redis import free_port, is_up

REDIS_URL = os.environ.get("NASD_TEST_REDIS_URL", "redis://127.0.0.1:6379")
NUM_REPLICAS = 2
NUM_REQUESTS = 32
MAX_TOKENS = 96
HANG_S = 180
REPLACE_WAIT_S = 180
APP = "kill"


def replica_reports(api_url: str, calls: int = 8) -> dict[str, dict[str, Any]]:
    """Each replica's latest report by its id. A stats call asks one replica, chosen by Serve,
    so several calls are made for every replica to answer at least one (stale ones dropped)."""
    reports: dict[str, dict[str, Any]] = {}
    for _ in range(calls):
        with urllib.request.urlopen(f"{api_url}/nasd/stats", timeout=30) as response:
            reports.update(
                {report["replica_id"]: report for report in json.loads(response.read())["replicas"]}
            )
    return {key: report for key, report in reports.items() if time.time() - report["updated_at"] < 30}


def one_request(
    client: openai.OpenAI, messages: list[dict], stream: bool, started: threading.Event
) -> dict[str, Any]:
    """One chat request's outcome: ``ended`` (answered, completed, cut, error) and its text;
    ``started`` is set once it has sent a token (or ended)."""
    outcome: dict[str, Any] = {"stream": stream, "text": ""}
    try:
        if stream:
            for chunk in client.chat.completions.create(
                model=EMBEDDED_MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
            ):
                outcome["text"] += "".join(choice.delta.content or "" for choice in chunk.choices)
                started.set()
            outcome["ended"] = "completed"
        else:
            answer = client.chat.completions.create(
                model=EMBEDDED_MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
            )
            outcome["text"], outcome["ended"] = answer.choices[0].message.content, "answered"
    except openai.APIError as exc:
        outcome["ended"], outcome["error"] = ("cut" if stream else "error"), str(exc)[:200]
    started.set()
    return outcome


def run_round(api_url: str, prompts: list[list[dict]], kill: bool) -> tuple[list[dict], dict]:
    """Every prompt at once (odd ones streamed); with ``kill``, SIGKILL the busiest replica once
    half the streams have sent a token. The outcomes in prompt order, and what was killed."""
    client = openai.OpenAI(base_url=api_url, api_key="unused", max_retries=0, timeout=HANG_S)
    outcomes: list[dict] = [{} for _ in prompts]
    started = [threading.Event() for _ in prompts]

    def send(index: int) -> None:
        outcomes[index].update(one_request(client, prompts[index], index % 2 == 1, started[index]))

    threads = [threading.Thread(target=send, args=(index,), daemon=True) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    killed: dict[str, Any] = {}
    if kill:  # mid-run: half the streams have sent tokens, the rest and the whole ones not yet
        streams = started[1::2]
        deadline = time.monotonic() + HANG_S
        while sum(event.is_set() for event in streams) < len(streams) // 2:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        killed = kill_busiest_replica(api_url)
    deadline = time.monotonic() + HANG_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    for index, outcome in enumerate(outcomes):
        outcome.setdefault("ended", "hung")
        outcome.setdefault("stream", index % 2 == 1)
    return outcomes, killed


def kill_busiest_replica(api_url: str) -> dict[str, Any]:
    """SIGKILL the process of the replica running the most requests; which one, and when."""
    reports = replica_reports(api_url)
    busiest = max(reports.values(), key=lambda report: report["num_running"])
    (name,) = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if REPLICA_DEPLOYMENT in actor["name"] and actor["name"].endswith(busiest["replica_id"])
    ]
    actor = ray.get_actor(name, namespace="serve")
    pid = ray.get(actor.__ray_call__.remote(lambda replica: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    return {
        "replica_id": busiest["replica_id"],
        "num_running": busiest["num_running"],
        "at": time.time(),
        "known": sorted(reports),
    }


def wait_for_replacement(api_url: str, killed: dict[str, Any]) -> dict[str, Any]:
    """Seconds from the kill until the application is healthy again with a new replica that
    answers; whether that replica's pool index held entries when it first reported."""
    client = openai.OpenAI(base_url=api_url, api_key="unused", max_retries=0, timeout=60)
    deadline = time.monotonic() + REPLACE_WAIT_S
    while time.monotonic() < deadline:
        status = serve.status().applications[APP].deployments[REPLICA_DEPLOYMENT]
        healthy = status.status == "HEALTHY" and status.replica_states.get("RUNNING", 0) == NUM_REPLICAS
        if healthy:
            new = [report for key, report in replica_reports(api_url).items() if key not in killed["known"]]
            if new:
                client.chat.completions.create(
                    model=EMBEDDED_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
                )
                return {
                    "replaced_after_s": round(time.time() - killed["at"], 1),
                    "warm_index_entries": new[0]["pool"]["namespaces"][0]["index_entries"],
                }
        time.sleep(0.5)
    return {"replaced_after_s": None, "warm_index_entries": None}


def tally(reference: list[dict], killed: list[dict]) -> dict[str, int]:
    counts = {"requests": len(killed), "whole": 0, "streamed": 0}
    for before, after in zip(reference, killed):
        counts["streamed" if after["stream"] else "whole"] += 1
        counts[after["ended"]] = counts.get(after["ended"], 0) + 1
        if after["ended"] in ("answered", "completed"):
            counts["identical"] = counts.get("identical", 0) + (after["text"] == before["text"])
    return counts


def markdown_table(payload: dict) -> str:
    rows = payload["rounds"]
    lines = [
        "| round | whole: answered / lost | streams: completed / cut (error event) / hung "
        "| answers identical to the undisturbed run | replacement serving after "
        "| replacement's pool index at start |",
        "|---|---|---|---|---|---|",
    ]
    for number, row in enumerate(rows, 1):
        counts, replaced = row["counts"], row["replacement"]
        lines.append(
            f"| {number} | {counts.get('answered', 0)} / {counts.get('error', 0)} of {counts['whole']} "
            f"| {counts.get('completed', 0)} / {counts.get('cut', 0)} / {counts.get('hung', 0)} of "
            f"{counts['streamed']} | {counts.get('identical', 0)} of "
            f"{counts.get('answered', 0) + counts.get('completed', 0)} "
            f"| {replaced['replaced_after_s']} s | {replaced['warm_index_entries']} entries |"
        )
    return "\n".join(lines)


def plot(payload: dict):
    figure, (axis,) = new_figure(1)
    labels = ("answered", "error", "completed", "cut", "hung")
    for number, row in enumerate(payload["rounds"]):
        axis.bar(
            [offset + 0.4 * number for offset in range(len(labels))],
            [row["counts"].get(label, 0) for label in labels],
            width=0.4,
            label=f"round {number + 1}",
        )
    axis.set_xticks(range(len(labels)), labels)
    axis.set_ylabel("requests")
    axis.set_title(f"a replica SIGKILLed under {NUM_REQUESTS} requests")
    axis.legend()
    return figure


def main() -> None:
    parser = suite_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=2, help="killed rounds (each after a reference round)")
    args = parser.parse_args()
    if not is_up(REDIS_URL):
        raise SystemExit(f"no Redis at {REDIS_URL}")
    ray.init(address="local", num_cpus=NUM_REPLICAS, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app_args = {
            "num_replicas": NUM_REPLICAS,
            "num_cpus_per_replica": 1,
            "dtype": "float32",  # as the results are labelled
            "redis_url": REDIS_URL,
            "pool_namespace": f"bench-kill-{time.time_ns()}",
        }
        serve.run(build_app(app_args), name=APP, route_prefix=f"/{APP}")
        api_url = f"http://127.0.0.1:{port}/{APP}/v1"
        rounds = []
        for number in range(args.rounds):
            prompts = distinct_prompts(("code_edit", "creative"), NUM_REQUESTS, seed=number)
            reference, _ = run_round(api_url, prompts, kill=False)
            outcomes, killed = run_round(api_url, prompts, kill=True)
            replacement = wait_for_replacement(api_url, killed)
            rounds.append(
                {"killed": killed, "counts": tally(reference, outcomes), "replacement": replacement}
            )
            print(rounds[-1], flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    payload = {
        "benchmark": "replica_kill",
        "meta": {
            **run_metadata(None, "float32", "benchmarks.replica_kill"),
            "replicas": NUM_REPLICAS,
            "requests": NUM_REQUESTS,
            "max_tokens": MAX_TOKENS,
        },
        "rounds": rounds,
    }
    publish_run(result_name("replica_kill", "float32", False), payload, markdown_table, plot)


if __name__ == "__main__":
    main()
