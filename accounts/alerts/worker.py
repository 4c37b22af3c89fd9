"""The alerts' background worker: one thread per process, started by the first budget handed to
it and ended once it has nothing left to do (no budget to check, no webhook delivery pending).

`spent` is all a request does: it adds the budgets it spent to a set (a burst of requests on one
budget is one check) and wakes the thread; it never waits, reads the database or raises. The
thread checks the budgets (checks.py), then attempts the deliveries that are due and sleeps until
the next one, or new budgets, wake it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from django.db import close_old_connections, connections

from accounts.limits import BudgetLimit

logger = logging.getLogger(__name__)

# How long the thread sleeps at most between looks at the pending deliveries.
IDLE_WAIT_S = 60.0
# Between two passes, so that a busy server's requests make one check a pass, not one each.
COALESCE_S = 0.5


class AlertWorker:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._budgets: set[BudgetLimit] = set()
        self._thread: threading.Thread | None = None
        self._deliveries_pending = False

    def submit(self, budgets: Iterable[BudgetLimit] = (), *, deliveries: bool = False) -> None:
        """Queue `budgets` for a check (and, with `deliveries`, a look at the pending webhook
        deliveries), starting the thread if it is not running."""
        with self._lock:
            self._budgets.update(budgets)
            self._deliveries_pending |= deliveries
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="orchard-budget-alerts", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def idle(self, timeout: float = 30.0) -> bool:
        """Wait until the thread has ended (nothing left to do); True if it did (for tests)."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _run(self) -> None:
        from accounts.alerts.checks import alerts_check
        from accounts.alerts.webhooks import deliveries_run_due

        first = True
        while True:
            if not first:
                time.sleep(COALESCE_S)
            first = False
            self._wake.clear()
            with self._lock:
                budgets, self._budgets = self._budgets, set()
                self._deliveries_pending = False
            wait = None
            try:
                close_old_connections()
                if budgets:
                    alerts_check(budgets)
                wait = deliveries_run_due()
            except Exception:
                logger.exception("budget alerts: a check or a delivery failed")
                wait = IDLE_WAIT_S
            finally:
                # Not held while asleep (a test database may be dropped meanwhile).
                connections.close_all()
            with self._lock:
                if wait is None and not self._budgets and not self._deliveries_pending:
                    self._thread = None
                    return
            self._wake.wait(IDLE_WAIT_S if wait is None else min(wait, IDLE_WAIT_S))


alert_worker = AlertWorker()


def spent(budgets: Iterable[BudgetLimit]) -> None:
    """Budgets a finished request spent: checked for their thresholds in the background."""
    try:
        alert_worker.submit(budgets)
    except Exception:  # e.g. no thread can be started: the request must not notice
        logger.exception("budget alerts: could not queue a check")
