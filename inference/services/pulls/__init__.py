"""Pulls from the Hugging Face hub as managed tasks: asking for one and cancelling it
(requests.py), who runs it (claims.py), running it and registering the model (run.py), and the
web process's runner thread (runner.py). The work itself is the engine's (engine/models/pull.py).
"""

from inference.services.pulls.claims import LEASE_S, pull_claim_next, pull_is_stale, runner_id
from inference.services.pulls.requests import (
    PullRequestError,
    default_name,
    pull_cancel,
    pull_create,
    pull_eta_s,
    pulls_recent,
)
from inference.services.pulls.run import PullProgress, run_pull
from inference.services.pulls.runner import PullRunner, start_pull_runner, wake_pull_runner

__all__ = [
    "LEASE_S",
    "PullProgress",
    "PullRequestError",
    "PullRunner",
    "default_name",
    "pull_cancel",
    "pull_claim_next",
    "pull_create",
    "pull_eta_s",
    "pull_is_stale",
    "pulls_recent",
    "run_pull",
    "runner_id",
    "start_pull_runner",
    "wake_pull_runner",
]
