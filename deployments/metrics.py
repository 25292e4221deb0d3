"""A replica's Prometheus metrics through Ray's metrics API (``ray.util.metrics``).

Ray exports them, prefixed ``ray_``, on every node's metrics port next to Serve's own
(``ray_serve_*``), so a cluster's Prometheus scrapes them without any extra endpoint. Request
counters are recorded when a request finishes; the policy's draft widths, the queue and the
pool's sync state are sampled from the replica's stats on a timer (they change every step,
and one sample per interval is all a dashboard needs).
"""

from __future__ import annotations

from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from nasd_core.metrics import SpecStats

# Tokens per target forward of a finished request: 1 = no draft ever accepted.
TOKENS_PER_STEP_BOUNDARIES = [1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0]
EXPORT_INTERVAL_S = 5.0


class ReplicaMetrics:
    """The metrics of one replica, tagged with its model and replica id."""

    def __init__(self, model: str, replica_id: str) -> None:
        self.tags = {"model": model, "replica": replica_id}
        keys = ("model", "replica")
        self.requests = Counter(
            "nasd_requests", "Finished requests by finish reason.", tag_keys=(*keys, "finish_reason")
        )
        self.prompt_tokens = Counter(
            "nasd_prompt_tokens", "Prompt tokens of finished requests.", tag_keys=keys
        )
        self.generated_tokens = Counter("nasd_generated_tokens", "Tokens generated.", tag_keys=keys)
        self.target_forwards = Counter(
            "nasd_target_forwards", "Verification steps (target forwards) run for requests.", tag_keys=keys
        )
        self.drafted_tokens = Counter(
            "nasd_drafted_tokens", "Draft tokens proposed, by source.", tag_keys=(*keys, "source")
        )
        self.accepted_tokens = Counter(
            "nasd_accepted_tokens", "Draft tokens accepted, by source.", tag_keys=(*keys, "source")
        )
        self.tokens_per_step = Histogram(
            "nasd_request_tokens_per_step",
            "Tokens per target forward of each finished request (acceptance length).",
            boundaries=TOKENS_PER_STEP_BOUNDARIES,
            tag_keys=keys,
        )
        self.policy_rows = Counter(
            "nasd_policy_rows",
            "Rows the policy stepped, by chosen draft width (0 = no speculation).",
            tag_keys=(*keys, "width"),
        )
        self.running = Gauge("nasd_running_requests", "Requests in the running batch.", tag_keys=keys)
        self.waiting = Gauge("nasd_waiting_requests", "Requests queued or prefilling.", tag_keys=keys)
        self.pool_connected = Gauge(
            "nasd_pool_connected", "1 while the pool namespace syncs, else 0.", tag_keys=(*keys, "namespace")
        )
        self.pool_lag_ms = Gauge(
            "nasd_pool_sync_lag_ms_p99",
            "p99 of finish-to-local-index lag of sequences from other replicas (ms).",
            tag_keys=(*keys, "namespace"),
        )
        self.paged_fallback = Gauge(
            "nasd_paged_attention_fallback",
            "1 where paged attention failed to compile or capture and graph steps gather keys instead.",
            tag_keys=keys,
        )
        self.kv_positions = Gauge("nasd_kv_cache_positions", "Positions the KV-cache holds.", tag_keys=keys)
        self._widths_seen: dict[str, int] = {}

    def record_request(self, finish_reason: str, num_prompt_tokens: int, stats: SpecStats) -> None:
        """Count one finished request."""
        self.requests.inc(1, {**self.tags, "finish_reason": finish_reason})
        self.prompt_tokens.inc(num_prompt_tokens, self.tags)
        if stats.num_emitted:
            self.generated_tokens.inc(stats.num_emitted, self.tags)
        if stats.num_steps:
            self.target_forwards.inc(stats.num_steps, self.tags)
            self.tokens_per_step.observe(stats.tokens_per_step, self.tags)
        for source, count in stats.drafted_by_source.items():
            if count:
                self.drafted_tokens.inc(count, {**self.tags, "source": source})
        for source, count in stats.accepted_by_source.items():
            if count:
                self.accepted_tokens.inc(count, {**self.tags, "source": source})

    def export(self, replica_stats: dict[str, Any]) -> None:
        """Sample the replica's stats (``NASDServer.stats()``) into gauges and counters."""
        self.running.set(replica_stats["num_running"], self.tags)
        runner = replica_stats["runner"]
        graphs = runner["step_graphs"]
        self.paged_fallback.set(1.0 if graphs is not None and graphs["paged_fallback"] else 0.0, self.tags)
        self.kv_positions.set(runner["kv_cache_positions"], self.tags)
        self.waiting.set(replica_stats["num_waiting"], self.tags)
        for width, count in replica_stats["width_histogram"].items():
            # The engine keeps running totals; a Prometheus counter takes increments.
            increment = count - self._widths_seen.get(width, 0)
            if increment > 0:
                self.policy_rows.inc(increment, {**self.tags, "width": width})
            self._widths_seen[width] = count
        for namespace in replica_stats["pool"]["namespaces"]:
            tags = {**self.tags, "namespace": namespace["namespace"]}
            self.pool_connected.set(1.0 if namespace["state"] == "connected" else 0.0, tags)
            if namespace["lag_ms_p99"] is not None:
                self.pool_lag_ms.set(namespace["lag_ms_p99"], tags)


class TenantMetrics:
    """The ingress's per-tenant counters (with API keys): requests by outcome and tokens by kind,
    tagged with the model and the key's tenant; and requests refused for a missing or wrong key."""

    def __init__(self, model: str) -> None:
        self.tags = {"model": model}
        self.requests = Counter(
            "nasd_tenant_requests",
            "Generation requests by tenant and outcome (admitted, rejected_requests, rejected_tokens).",
            tag_keys=("model", "tenant", "outcome"),
        )
        self.tokens = Counter(
            "nasd_tenant_tokens",
            "Tokens by tenant and kind (prompt, completion).",
            tag_keys=("model", "tenant", "kind"),
        )
        self.unauthorized = Counter(
            "nasd_unauthorized_requests",
            "Requests refused for a missing or wrong API key.",
            tag_keys=("model",),
        )
        self.key_file_reloads = Gauge(
            "nasd_key_file_reloads", "Times the API key file was read.", tag_keys=("model",)
        )
        self.key_file_errors = Gauge(
            "nasd_key_file_errors",
            "Versions of the API key file that failed to parse (the last keys were kept).",
            tag_keys=("model",),
        )
        self.key_file_ok = Gauge(
            "nasd_key_file_ok", "1 if the key file's last version parsed, else 0.", tag_keys=("model",)
        )

    def record_outcome(self, tenant: str, outcome: str) -> None:
        self.requests.inc(1, {**self.tags, "tenant": tenant, "outcome": outcome})

    def record_tokens(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        for kind, count in (("prompt", prompt_tokens), ("completion", completion_tokens)):
            if count:
                self.tokens.inc(count, {**self.tags, "tenant": tenant, "kind": kind})

    def record_unauthorized(self) -> None:
        self.unauthorized.inc(1, self.tags)

    def record_key_file(self, reloads: int, errors: int, ok: bool) -> None:
        self.key_file_reloads.set(reloads, self.tags)
        self.key_file_errors.set(errors, self.tags)
        self.key_file_ok.set(1.0 if ok else 0.0, self.tags)
