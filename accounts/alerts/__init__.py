"""Budget alerts: when a budget's finished usage reaches one of its thresholds (50 / 80 / 100 % by
default), an alert is recorded once per budget, period and threshold (`BudgetAlert`), emailed
(Django's mail backend) and POSTed, signed, to the team's and the global webhooks.

None of it runs on a request's path: a settlement hands the budgets it spent to `spent`, which
only queues them for this process's background worker (worker.py); the worker reads what each
budget has used (checks.py), writes and sends the alerts (emails.py) and delivers the webhooks,
retrying failures with exponential backoff (webhooks.py). A slow mail server or webhook slows the
worker, never a request; an error there is logged, never raised to one.
"""

from accounts.alerts.checks import alerts_check
from accounts.alerts.webhooks import (
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    deliveries_run_due,
    signature,
)
from accounts.alerts.worker import alert_worker, spent

__all__ = [
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "alert_worker",
    "alerts_check",
    "deliveries_run_due",
    "signature",
    "spent",
]
