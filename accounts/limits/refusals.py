"""A limiter's answers in OpenAI's shape: the refusal (its message, code and retry headers) and the
x-ratelimit-* headers of a verdict."""

from __future__ import annotations

from accounts.limits.budgets import BudgetLimit
from accounts.limits.verdicts import Limits, Verdict

CODE_RATE_LIMIT = "rate_limit_exceeded"
CODE_QUOTA = "insufficient_quota"

ERROR_REQUESTS = "Rate limit reached for requests per minute (limit {limit}). Try again in {reset}."
ERROR_TOKENS = (
    "Rate limit reached for tokens per minute (limit {limit}, in use {used}, requested "
    "{requested}). Try again in {reset}."
)
ERROR_TOO_LARGE = (
    "Request too large for tokens per minute (limit {limit}, requested {requested}). Lower "
    "max_tokens or shorten the prompt."
)
ERROR_PARALLEL = "Too many parallel requests for this key (limit {limit}). Try again shortly."
# `budget` says whose and which: "key's monthly token budget", "team's monthly money budget"
# (accounts/limits/budgets.py), and `name` who that is.
ERROR_BUDGET = (
    "This {budget} is exhausted ({name}: budget {limit}, used or reserved {used}, requested "
    "{requested})."
)


class RateLimitExceeded(Exception):
    def __init__(
        self,
        message: str,
        *,
        code: str,
        limit: str,
        headers: dict[str, str],
        budget: BudgetLimit | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.code = code
        self.limit = limit  # which limit refused: "requests", "tokens", "parallel", "budget"
        self.headers = headers
        self.budget = budget  # the budget that ran out, when one did


def format_duration(ms: int) -> str:
    """OpenAI's (Go's) duration format: "20ms", "1s", "1.5s", "6m0s", "1h0m0s"."""
    ms = max(0, int(ms))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{seconds}s"
    if minutes:
        return f"{minutes}m{seconds}s"
    return f"{seconds}s"


def ratelimit_headers(limits: Limits, verdict: Verdict) -> dict[str, str]:
    headers = {}
    if limits.rpm is not None:
        headers["x-ratelimit-limit-requests"] = str(limits.rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(0, limits.rpm - verdict.requests))
        headers["x-ratelimit-reset-requests"] = format_duration(verdict.requests_reset_ms)
    if limits.tpm is not None:
        headers["x-ratelimit-limit-tokens"] = str(limits.tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, limits.tpm - verdict.tokens))
        headers["x-ratelimit-reset-tokens"] = format_duration(verdict.tokens_reset_ms)
    return headers


def refusal(
    limits: Limits, verdict: Verdict, reserved: int, rates: tuple[int, ...]
) -> RateLimitExceeded:
    headers = ratelimit_headers(limits, verdict)
    reset = format_duration(verdict.retry_ms)
    budget = None
    if verdict.reason == "budget":
        budget = limits.counters[verdict.budget_index]
        requested = reserved * rates[verdict.budget_index]
        message = ERROR_BUDGET.format(
            budget=budget.describe(),
            name=budget.name,
            limit=budget.amount(budget.limit),
            used=budget.amount(verdict.budget_used),
            requested=budget.amount(requested),
        )
        code, limit = CODE_QUOTA, "budget"
    elif verdict.reason == "too_large":
        message = ERROR_TOO_LARGE.format(limit=limits.tpm, requested=reserved)
        code, limit = CODE_RATE_LIMIT, "tokens"
    elif verdict.reason == "tokens":
        message = ERROR_TOKENS.format(
            limit=limits.tpm, used=verdict.tokens, requested=reserved, reset=reset
        )
        code, limit = CODE_RATE_LIMIT, "tokens"
    elif verdict.reason == "requests":
        message = ERROR_REQUESTS.format(limit=limits.rpm, reset=reset)
        code, limit = CODE_RATE_LIMIT, "requests"
    else:
        message = ERROR_PARALLEL.format(limit=limits.max_parallel)
        code, limit = CODE_RATE_LIMIT, "parallel"
    if verdict.reason in ("budget", "too_large"):
        # Waiting cannot help; the official clients honour this header and don't retry.
        headers["x-should-retry"] = "false"
    elif verdict.retry_ms >= 0:
        headers["retry-after-ms"] = str(verdict.retry_ms)
        headers["retry-after"] = str(max(1, -(-verdict.retry_ms // 1000)))
    return RateLimitExceeded(message, code=code, limit=limit, headers=headers, budget=budget)
