"""SIGTERM drains the server: ``serve run deployments.app`` and ``nasd-serve`` finish what is in
flight, then stop as on Ctrl-C.

Kubernetes and Docker stop a container with SIGTERM. ``serve run`` handles only
KeyboardInterrupt, and ``ray.init`` replaces any SIGTERM handler set before it: without this
hook the driver dies with a stack dump and every open connection is cut. ``serve.shutdown()``
alone is not a drain either: it stops the HTTP proxy while answers are still streaming through
it. So on SIGTERM the driver first asks each application's ingress to drain (turn new requests
away, wait for the open ones), then raises KeyboardInterrupt for the usual shutdown.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
from types import FrameType

logger = logging.getLogger(__name__)

# Kubernetes' default terminationGracePeriodSeconds is 30: drain within it, with time to stop.
DEFAULT_DRAIN_TIMEOUT_S = 20.0
# Added to the drain's own wait for the call itself to come back.
CALL_MARGIN_S = 5.0


def drain_applications(timeout_s: float) -> dict[str, int | str]:
    """Ask every running Serve application's ingress to drain for up to ``timeout_s`` (in
    parallel). Returns each application's requests still open afterwards, or why it could not
    be asked (an application without a ``drain`` method, an ingress that is gone)."""
    from ray import serve

    calls = {}
    for name in serve.status().applications:
        try:
            calls[name] = serve.get_app_handle(name).drain.remote(timeout_s)
        except Exception as exc:  # an application that is not running, or not ours
            calls[name] = exc
    left: dict[str, int | str] = {}
    for name, call in calls.items():
        try:
            if isinstance(call, Exception):
                raise call
            left[name] = call.result(timeout_s=timeout_s + CALL_MARGIN_S)
        except Exception as exc:
            left[name] = f"{type(exc).__name__}: {exc}"
    return left


def drain_then_interrupt(timeout_s: float, signum: int, frame: FrameType | None) -> None:
    # A second SIGTERM (the orchestrator's patience ending) stops the process at once.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    logger.warning("SIGTERM: draining for up to %.0f s before shutting down", timeout_s)
    left = drain_applications(timeout_s)
    logger.warning("drained (requests still open per application: %s); shutting down", left)
    raise KeyboardInterrupt(f"signal {signum}")


def install_handler(timeout_s: float) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, functools.partial(drain_then_interrupt, timeout_s))


def drain_on_sigterm(timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> bool:
    """In a driver that builds the application before connecting to Ray (``serve run``,
    ``nasd-serve``), make SIGTERM drain and then raise KeyboardInterrupt, once ``ray.init`` has
    installed its own handlers. Returns whether the hook was set: inside Ray workers (KubeRay's
    controller building the app), or off the main thread, nothing is changed."""
    import ray
    from ray._private import worker

    if ray.is_initialized() or threading.current_thread() is not threading.main_thread():
        return False
    # Ray's post-init hooks run right after ray.init connects, on the thread that called it.
    hooks = getattr(worker, "_post_init_hooks", None)
    if hooks is None:
        logger.warning("this Ray has no post-init hooks: SIGTERM will not drain the server")
        return False
    hooks[:] = [hook for hook in hooks if getattr(hook, "func", None) is not install_handler]
    hooks.append(functools.partial(install_handler, timeout_s))
    return True
