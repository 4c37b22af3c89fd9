"""The web process's pull runner: one thread that runs pulls one at a time, outside any
request. It claims the oldest queued pull, or one whose runner stopped (claims.py): a pull
made in this process wakes it at once, others are found within POLL_S. At start that includes
the pulls a stopped process left: they resume (huggingface_hub continues the partial files),
or fail with a message once they have been tried MAX_ATTEMPTS times.

One pull at a time per process: a download is light, but a conversion takes a checkpoint's
memory and the CPU the engines serve requests with. At exit the runner stops the pull it runs
without marking it (the next start resumes it), and its conversion process with it.
"""

from __future__ import annotations

import atexit
import logging
import threading

from django.db import close_old_connections, connection

from inference.models import ModelPull
from inference.services.pulls.claims import pull_claim_next, runner_id
from inference.services.pulls.run import RowMonitor, run_pull

logger = logging.getLogger(__name__)

POLL_S = 2.0
EXIT_WAIT_S = 10.0


class PullRunner:
    def __init__(self, runner: str | None = None) -> None:
        self.runner = runner or runner_id()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._monitor: RowMonitor | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="orchard-pulls", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._monitor is not None:
            self._monitor.shutting_down.set()
        if self._thread is not None:
            self._thread.join(EXIT_WAIT_S)

    def run_once(self) -> ModelPull | None:
        """Claim one waiting pull and run it to its end; None when none waits."""
        close_old_connections()
        pull = pull_claim_next(runner=self.runner)
        if pull is None:
            return None
        logger.info("pull %s: %s (attempt %s)", pull.pk, pull, pull.attempts)
        self._monitor = RowMonitor(pull, None)
        try:
            ended = run_pull(pull, runner=self.runner, monitor=self._monitor)
        finally:
            self._monitor = None
        logger.info(
            "pull %s: %s%s", ended.pk, ended.state, f": {ended.error}" if ended.error else ""
        )
        return ended

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    ran = self.run_once()
                except Exception:
                    logger.exception("the pull runner failed; trying again")
                    ran = None
                if ran is None:
                    self._wake.wait(POLL_S)
                    self._wake.clear()
        finally:
            connection.close()


_runner: PullRunner | None = None


def start_pull_runner() -> PullRunner:
    """Start this process's runner (the web process, at start)."""
    global _runner
    if _runner is None:
        _runner = PullRunner()
        _runner.start()
    return _runner


def wake_pull_runner() -> None:
    """A pull was made here: the runner looks now rather than at its next poll."""
    if _runner is not None:
        _runner.wake()
