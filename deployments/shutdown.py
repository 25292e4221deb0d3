"""SIGTERM drains the server: ``serve run deployments.app`` and ``nasd-serve`` finish what is in
flight, then stop as on Ctrl-C.

Kubernetes and Docker stop a container with SIGTERM. ``serve run`` handles only
KeyboardInterrupt, and ``ray.init`` replaces any SIGTERM handler set before it: without this
hook the driver dies with a stack dump and every open connection is cut. ``serve.shutdown()``
alone is not a drain either: it stops the HTTP proxy while answers are still streaming through
it. So on SIGTERM a thread asks each application's ingress to drain (turn new requests away,
wait for the open ones), then signals the process again, and the handler raises
KeyboardInterrupt in the main thread for the usual shutdown. The handler itself only starts
that thread: a signal handler must not block on Serve's calls, which may need a lock the
interrupted main thread holds.

A Serve config file (``serve run serve.yaml``, KubeRay's RayService) builds the application in
Serve's controller, not in the driver: no hook is set there, and the platform's own node drain
applies.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
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

    calls: dict = {}
    left: dict[str, int | str] = {}
    for name in serve.status().applications:
        try:
            calls[name] = serve.get_app_handle(name).drain.remote(timeout_s)
        except Exception as exc:  # an application that is not running, or not ours
            left[name] = f"{type(exc).__name__}: {exc}"
    for name, call in calls.items():
        try:
            left[name] = call.result(timeout_s=timeout_s + CALL_MARGIN_S)
        except Exception as exc:
            left[name] = f"{type(exc).__name__}: {exc}"
    return left


class SigtermDrain:
    """The driver's SIGTERM handler. The first SIGTERM starts the drain on a thread; that thread
    sends the second when it is done, and the second (or one from an impatient orchestrator)
    raises KeyboardInterrupt."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        import ray

        if self.draining or not ray.is_initialized():  # drained, out of patience, or shut down
            raise KeyboardInterrupt(f"signal {signum}")
        self.draining = True
        threading.Thread(target=self.drain, name="nasd-drain", daemon=True).start()

    def drain(self) -> None:
        logger.warning("SIGTERM: draining for up to %.0f s before shutting down", self.timeout_s)
        try:
            left = drain_applications(self.timeout_s)
            logger.warning("drained (requests still open per application: %s); shutting down", left)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self)


def drain_on_sigterm(timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> bool:
    """In a driver that builds the application before connecting to Ray (``serve run``,
    ``nasd-serve``), make SIGTERM drain and then raise KeyboardInterrupt, once the next
    ``ray.init`` has installed its own handlers. Returns whether the hook was set: with Ray
    already connected (inside a Ray worker), or off the main thread, nothing is changed."""
    import ray
    from ray._private import worker

    if ray.is_initialized() or threading.current_thread() is not threading.main_thread():
        return False
    # Ray's post-init hooks run right after ray.init connects, on the thread that called it.
    hooks = getattr(worker, "_post_init_hooks", None)
    if hooks is None:
        logger.warning("this Ray has no post-init hooks: SIGTERM will not drain the server")
        return False
    # One drain hook, the latest settings'.
    hooks[:] = [hook for hook in hooks if not isinstance(getattr(hook, "__self__", None), SigtermDrain)]
    hooks.append(SigtermDrain(timeout_s).install)
    return True


def is_serve_run() -> bool:
    """Whether this process is the ``serve run`` command (which builds the app, then connects)."""
    return Path(sys.argv[0]).name == "serve" and sys.argv[1:2] == ["run"]
