"""Who may call, and as whom: API keys, the tenant each key stands for, and per-key limits.

With keys configured (one ``api_key``, or an ``api_keys_file``, or both), every route but
``/health`` needs ``Authorization: Bearer <key>``; a missing or unknown key is answered 401 in
OpenAI's error shape. The key decides the request's tenant: its pool partition and stream
namespace, its prefix-cache salt and the replica's index it drafts from (with
``tenant_isolation``), and its routing key. The request's ``user`` field stays what OpenAI says
it is, an end-user label, never a boundary. Without keys the server is open and a request's
tenant is its ``user`` field, which any caller may write: that is not isolation.

The key file holds one key per line,
``<key> <tenant> [max_in_flight=N] [tokens_per_minute=N] [admin]`` (blank lines and ``#``
comments skipped), and is re-read when it changes (its modification time, size or inode), so a
key is added, rotated or revoked without a restart. A change is read once the file has been
left alone for ``RELOAD_SETTLE_S`` (an editor's truncate-then-write must not revoke every key
for a moment); a file that fails to parse keeps the keys read before it, with a warning naming
the line, never the key. An ``admin`` key sees every tenant's counters in the stats; others
see their own tenant's.

Keys are kept as SHA-256 digests. A presented key is hashed and its digest compared with every
valid key's (``hmac.compare_digest``, no early exit), so the time a check takes says nothing about
any key's characters. Nothing logged holds a key; stats and metrics name a key by its tenant.

Limits are counted by this ingress (the application runs one ingress replica): rows in flight
per key (a request of 4 prompts x n=2 is 8), and tokens (prompt and completion) per key over the
last 60 seconds. Admission reserves each row's ``max_tokens`` (or the model's context) against
the key's tokens per minute, and the tokens a request used replace its reservation when it ends,
however it ends: a stream the client drops or an answer cut by an error counts what it produced.
A request over a limit is answered 429 with ``Retry-After``.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

TOKEN_WINDOW_S = 60.0
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
# The tenant of the one key given as ``api_key``.
DEFAULT_TENANT = "default"
# How often, at most, the key file's metadata is read (a stat per request is cheap, but a
# request burst need not stat it thousands of times a second).
RELOAD_CHECK_INTERVAL_S = 0.5
# A changed key file is read once it has not changed for this long.
RELOAD_SETTLE_S = 1.0
POSITIVE_INTEGER = re.compile(r"[0-9]+")  # ASCII digits only: "²".isdigit() is true


class KeyFileError(ValueError):
    """A key file line that cannot be read (its line number in the message, never its key)."""


@dataclass(frozen=True)
class KeyLimits:
    """A key's limits; None: unlimited."""

    max_in_flight: int | None = None
    tokens_per_minute: int | None = None


@dataclass(frozen=True)
class ApiKey:
    """What a valid key stands for."""

    tenant: str
    limits: KeyLimits
    key_id: str  # the first hex digits of the key's digest: tells keys of one tenant apart
    admin: bool = False  # sees every tenant's counters


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str, defaults: KeyLimits) -> dict[bytes, ApiKey]:
    """The keys of a key file's ``text`` by digest; raises ``KeyFileError`` on a bad line."""
    keys: dict[bytes, ApiKey] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) < 2:
            raise KeyFileError(
                f"line {number}: expected '<key> <tenant> [max_in_flight=N] [tokens_per_minute=N] [admin]'"
            )
        key, tenant, options = fields[0], fields[1], fields[2:]
        if not TENANT_PATTERN.match(tenant):
            raise KeyFileError(f"line {number}: a tenant is 1-128 of A-Z a-z 0-9 _ . : @ -")
        limits = {"max_in_flight": defaults.max_in_flight, "tokens_per_minute": defaults.tokens_per_minute}
        admin = False
        for option in options:
            if option == "admin":
                admin = True
                continue
            name, _, value = option.partition("=")
            if name not in limits or not POSITIVE_INTEGER.fullmatch(value) or int(value) < 1:
                raise KeyFileError(f"line {number}: unknown option or not a positive integer: {name!r}")
            limits[name] = int(value)
        key_digest = digest(key)
        if key_digest in keys:
            raise KeyFileError(f"line {number}: the same key appears twice")
        keys[key_digest] = ApiKey(tenant, KeyLimits(**limits), key_digest.hex()[:8], admin)
    return keys


class ApiKeys:
    """The valid keys: ``api_key`` (tenant ``DEFAULT_TENANT``) and those of ``keys_file``.

    Args:
        api_key: one key, or None.
        keys_file: path of a key file (see the module's docstring), or None. It must exist at
            start: a server meant to need keys must not start open.
        defaults: limits of keys that set none.
    """

    def __init__(self, api_key: str | None, keys_file: str | None, defaults: KeyLimits | None = None) -> None:
        self.defaults = defaults or KeyLimits()
        self.keys_file = Path(keys_file) if keys_file else None
        self._single: dict[bytes, ApiKey] = {}
        if api_key:
            single_digest = digest(api_key)
            # The one key is the operator's: it sees everything.
            self._single[single_digest] = ApiKey(
                DEFAULT_TENANT, self.defaults, single_digest.hex()[:8], admin=True
            )
        self._from_file: dict[bytes, ApiKey] = {}
        self._all = list(self._single.items())
        self._file_stamp: tuple[int, int, int] | None = None
        self._failed_stamp: tuple[int, int, int] | None = None
        self._checked_at = 0.0
        self._lock = threading.Lock()
        self.num_reloads = 0
        self.num_reload_errors = 0
        self.last_error: str | None = None  # why the last read failed (None: it did not)
        if self.keys_file is not None:
            if not self.keys_file.is_file():
                raise FileNotFoundError(f"API key file {self.keys_file} does not exist")
            self._reload(force=True)

    @property
    def enabled(self) -> bool:
        return bool(self._single) or self.keys_file is not None

    def find(self, presented: str) -> ApiKey | None:
        """The key ``presented`` stands for, or None if it is not a valid key. Every key's
        digest is compared, in constant time and with no early exit."""
        self._reload()
        presented_digest = digest(presented)
        found = None
        for stored, key in self._all:
            if hmac.compare_digest(stored, presented_digest):
                found = key
        return found

    def _reload(self, force: bool = False) -> None:
        """Read the key file again if it changed since it was last read."""
        if self.keys_file is None:
            return
        now = time.monotonic()
        if not force and now - self._checked_at < RELOAD_CHECK_INTERVAL_S:
            return
        with self._lock:
            self._checked_at = now
            try:
                status = os.stat(self.keys_file)
            except OSError as exc:  # removed or unreadable for now: keep the keys we have
                logger.warning(
                    "API key file %s unreadable (%s); keeping the keys read before", self.keys_file, exc
                )
                return
            stamp = (status.st_mtime_ns, status.st_size, status.st_ino)
            if stamp == self._file_stamp:
                return
            if not force and time.time() - status.st_mtime_ns / 1e9 < RELOAD_SETTLE_S:
                return  # still being written: read it once it settles
            try:
                self._from_file = parse_keys(self.keys_file.read_text(), self.defaults)
            except (OSError, UnicodeDecodeError, KeyFileError) as exc:
                if force:
                    raise
                if stamp != self._failed_stamp:  # once per version of the file
                    self._failed_stamp = stamp
                    self.num_reload_errors += 1
                    self.last_error = str(exc)
                    logger.warning("API key file %s not reloaded: %s", self.keys_file, exc)
                return
            self._all = [*self._single.items(), *self._from_file.items()]
            self._file_stamp = stamp
            self.num_reloads += 1
            self.last_error = None
            logger.info("API key file %s read: %d keys", self.keys_file, len(self._from_file))


@dataclass
class Rejection:
    """Why a request over a limit is refused, and when to retry."""

    message: str
    retry_after_s: int
    kind: str  # "requests" or "tokens", as OpenAI's rate-limit errors name them


@dataclass
class TenantCounters:
    """One tenant's counters, as the stats endpoint shows them."""

    requests: int = 0
    in_flight: int = 0
    rejected_requests: int = 0  # 429s for requests in flight
    rejected_tokens: int = 0  # 429s for tokens per minute
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Admission:
    """What a request of a key holds while it runs: rows in flight and tokens reserved."""

    key: ApiKey
    rows: int
    reserved_tokens: int


@dataclass
class KeyLimiter:
    """Rows in flight and tokens over the last minute (used, and reserved by requests running),
    per key; counters per tenant."""

    in_flight: dict[str, int] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)
    token_log: dict[str, collections.deque] = field(default_factory=dict)
    tenants: dict[str, TenantCounters] = field(default_factory=dict)
    num_unauthorized: int = 0

    def admit(
        self, key: ApiKey, rows: int = 1, reserve_tokens: int = 0, now: float | None = None
    ) -> Admission | Rejection:
        """Take ``rows`` slots and reserve ``reserve_tokens`` for a request of ``key``; a
        ``Rejection`` (nothing taken) if that would go over a limit."""
        now = time.monotonic() if now is None else now
        counters = self.tenants.setdefault(key.tenant, TenantCounters())
        limits = key.limits
        running = self.in_flight.get(key.key_id, 0)
        if limits.max_in_flight is not None and running + rows > limits.max_in_flight:
            counters.rejected_requests += 1
            return Rejection(
                f"Rate limit reached: this request's {rows} rows and the {running} in flight are over the "
                f"{limits.max_in_flight} rows this API key may have in flight",
                1,
                "requests",
            )
        if limits.tokens_per_minute is not None:
            used, retry_after = self._tokens_used(key.key_id, limits.tokens_per_minute, now)
            reserved = self.reserved.get(key.key_id, 0)
            if used + reserved + reserve_tokens > limits.tokens_per_minute:
                counters.rejected_tokens += 1
                return Rejection(
                    f"Rate limit reached: {used} tokens used and {reserved} reserved in the last minute, "
                    f"this request reserves {reserve_tokens} (its rows' max_tokens), and this API key "
                    f"has {limits.tokens_per_minute} per minute",
                    retry_after,
                    "tokens",
                )
            self.reserved[key.key_id] = reserved + reserve_tokens
        self.in_flight[key.key_id] = running + rows
        counters.requests += 1
        counters.in_flight += rows
        return Admission(key, rows, reserve_tokens if limits.tokens_per_minute is not None else 0)

    def finish(
        self, admission: Admission, prompt_tokens: int, completion_tokens: int, now: float | None = None
    ) -> None:
        """A request ended (answered, dropped or failed): give back its rows, and count the
        tokens it used in place of what it reserved."""
        key = admission.key
        self.in_flight[key.key_id] = max(0, self.in_flight.get(key.key_id, 0) - admission.rows)
        self.reserved[key.key_id] = max(0, self.reserved.get(key.key_id, 0) - admission.reserved_tokens)
        counters = self.tenants[key.tenant]
        counters.in_flight = max(0, counters.in_flight - admission.rows)
        self.record_tokens(key, prompt_tokens, completion_tokens, now)

    def record_tokens(
        self, key: ApiKey, prompt_tokens: int, completion_tokens: int, now: float | None = None
    ) -> None:
        """Count tokens against a key and its tenant."""
        now = time.monotonic() if now is None else now
        counters = self.tenants.setdefault(key.tenant, TenantCounters())
        counters.prompt_tokens += prompt_tokens
        counters.completion_tokens += completion_tokens
        if key.limits.tokens_per_minute is not None:
            self.token_log.setdefault(key.key_id, collections.deque()).append(
                (now, prompt_tokens + completion_tokens)
            )

    def _tokens_used(self, key_id: str, limit: int, now: float) -> tuple[int, int]:
        """Tokens the key used in the window ending ``now``, and the whole seconds until enough
        of them leave it for the key to be under ``limit``."""
        log = self.token_log.get(key_id)
        if not log:
            return 0, 1
        while log and log[0][0] <= now - TOKEN_WINDOW_S:
            log.popleft()
        used = sum(tokens for _, tokens in log)
        remaining, retry_after = used, 0.0
        for stamp, tokens in log:
            if remaining < limit:
                break
            remaining -= tokens
            retry_after = stamp + TOKEN_WINDOW_S - now
        return used, max(1, math.ceil(retry_after))

    def snapshot(self, tenant: str | None = None) -> dict[str, object]:
        """JSON-able counters: per tenant, and the requests refused for a missing or wrong key;
        with ``tenant``, that tenant's counters alone (what a key that is not an admin's sees)."""
        if tenant is not None:
            counters = self.tenants.get(tenant, TenantCounters())
            return {"tenants": {tenant: vars(counters).copy()}}
        return {
            "unauthorized": self.num_unauthorized,
            "tenants": {name: vars(counters).copy() for name, counters in sorted(self.tenants.items())},
        }


@dataclass(frozen=True)
class AuthSettings:
    """The application's key settings (``AppArgs``): no key and no file = an open server."""

    api_key: str | None = None
    keys_file: str | None = None
    limits: KeyLimits = KeyLimits()


class TenantMetricsSink(Protocol):
    def record_outcome(self, tenant: str, outcome: str) -> None: ...
    def record_tokens(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None: ...
    def record_unauthorized(self) -> None: ...
    def record_key_file(self, reloads: int, errors: int, ok: bool) -> None: ...


class Gate:
    """What the ingress's key middleware checks: the valid keys, each key's limits, per-tenant
    counters and metrics.

    Args:
        settings: the application's key settings.
        new_metrics: makes the tenant metrics sink (called only where keys are configured).
    """

    def __init__(
        self, settings: AuthSettings, new_metrics: Callable[[], TenantMetricsSink] | None = None
    ) -> None:
        self.keys = ApiKeys(settings.api_key, settings.keys_file, settings.limits)
        self.limiter = KeyLimiter()
        self.metrics = new_metrics() if self.keys.enabled and new_metrics is not None else None
        self._exported_key_file: tuple[int, int, bool] | None = None

    def admit(self, key: ApiKey, rows: int, reserve_tokens: int) -> Admission | Rejection:
        admission = self.limiter.admit(key, rows, reserve_tokens)
        if self.metrics is not None:
            outcome = "admitted" if isinstance(admission, Admission) else f"rejected_{admission.kind}"
            self.metrics.record_outcome(key.tenant, outcome)
        return admission

    def finish(self, admission: Admission, prompt_tokens: int, completion_tokens: int) -> None:
        """A request ended: its rows back, its tokens counted against its key and tenant."""
        self.limiter.finish(admission, prompt_tokens, completion_tokens)
        if self.metrics is not None:
            self.metrics.record_tokens(admission.key.tenant, prompt_tokens, completion_tokens)

    def export_key_file(self) -> None:
        """Put the key file's reload counters into the metrics when they changed."""
        state = (self.keys.num_reloads, self.keys.num_reload_errors, self.keys.last_error is None)
        if self.metrics is not None and state != self._exported_key_file:
            self._exported_key_file = state
            self.metrics.record_key_file(*state)

    def key_file_state(self) -> dict[str, object] | None:
        if self.keys.keys_file is None:
            return None
        return {
            "reloads": self.keys.num_reloads,
            "errors": self.keys.num_reload_errors,
            "last_error": self.keys.last_error,
        }


@dataclass
class _GateSlot:
    gate: Gate | None = None


# The gate of this process's ingress. The key middleware belongs to the FastAPI app, not to the
# ingress instance (``serve.ingress`` gives it no way to the instance), and Serve pickles the
# ingress class by value (so a global it names is a copy in the replica); it reaches this
# module's slot through these functions, which pickle by reference. One ingress per process.
_SLOT = _GateSlot()


def install_gate(gate: Gate) -> None:
    _SLOT.gate = gate


def installed_gate() -> Gate | None:
    return _SLOT.gate
