"""The members' pages: landing, sign-in, my keys, my usage, models, team reports (with CSV);
and the sign-in throttle around every password form, the admin's included.

Server-rendered, no external requests, no inline scripts (the CSP forbids them); every form
has CSRF. A member sees their own keys and usage; team owners and staff see their teams'
reports. Data comes from services and selectors only.
"""

from __future__ import annotations

import csv
import datetime
import functools
import re
import uuid
from collections.abc import Callable

from asgiref.sync import sync_to_async
from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse_lazy
from django.utils import timezone
from django.views.decorators.csrf import csrf_protect
from django.views.decorators.http import require_http_methods
from django.views.generic import TemplateView

from accounts import signin
from accounts.limits import key_use
from accounts.models import ApiKey, Team
from accounts.selectors import team_summaries_owned_by, teams_for_new_keys, teams_owned_by
from accounts.services import MemberKeyRefused, member_key_create, member_key_revoke
from common.money import currency, from_nanos
from inference.models import ModelEntry
from inference.services import reports
from inference.services.catalog import model_catalog
from inference.services.registry import models_for_key, models_for_user
from inference.services.spend import member_budget_uses

REPORT_GROUPS = ["day", "model", "key", "member", "tier", "batch"]
REPORT_SUMS = ["requests", "prompt_tokens", "cached_tokens", "completion_tokens"]
EARLIEST, LATEST = datetime.date(2000, 1, 1), datetime.date(9000, 1, 1)  # what a range may span


def home(request: HttpRequest) -> HttpResponse:
    return render(request, "web/home.html", {"base_url": _base_url(request)})


def _base_url(request: HttpRequest) -> str:
    return request.build_absolute_uri("/v1").rstrip("/")


def signin_throttled(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """A password form's view, throttled (accounts/signin.py): each POST is counted before the
    view checks its password, refused with a 429 page past the limits (a 503 page when the
    counters cannot be reached), and taken back if it signed someone in. The CSRF check comes
    first, so another site cannot make its visitors' browsers spend an account's attempts."""

    @csrf_protect
    @functools.wraps(view)
    def throttled(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if request.method != "POST":
            return view(request, *args, **kwargs)
        try:
            attempt = signin.attempt_begin(
                username=request.POST.get("username") or "",
                remote_addr=request.META.get("REMOTE_ADDR") or "",
                forwarded_for=request.META.get("HTTP_X_FORWARDED_FOR"),
            )
        except signin.SigninUnavailable:
            return render(request, "web/login_locked.html", {"unavailable": True}, status=503)
        if not attempt.allowed:
            return render(request, "web/login_locked.html", status=429)
        before = request.user
        response = view(request, *args, **kwargs)
        if request.user is not before and request.user.is_authenticated:  # login() ran
            signin.attempt_succeeded(attempt)
        return response

    return throttled


class KeyForm(forms.Form):
    name = forms.CharField(max_length=100, label="Label", required=False)
    team = forms.ModelChoiceField(queryset=Team.objects.none(), empty_label=None)

    def __init__(self, *args, teams, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["team"].queryset = teams


@login_required
@require_http_methods(["GET", "POST"])
def keys(request: HttpRequest) -> HttpResponse:
    teams = teams_for_new_keys(user=request.user)
    form = KeyForm(teams=teams)
    created_key = None
    if request.method == "POST" and request.POST.get("action") == "create":
        form = KeyForm(request.POST, teams=teams)
        token = request.POST.get("creation_token") or ""
        token = token if re.fullmatch(r"[0-9a-f]{32}", token) else None  # the form's own
        if form.is_valid():
            try:
                api_key, created_key = member_key_create(
                    user=request.user,
                    team=form.cleaned_data["team"],
                    name=form.cleaned_data["name"],
                    creation_token=token,
                )
            except MemberKeyRefused as exc:
                messages.error(request, str(exc))
                return redirect("web-keys")
            if created_key is None:  # the same form sent again: no second key
                messages.info(request, f"That key was already created ({api_key.prefix}…).")
                return redirect("web-keys")
            form = KeyForm(teams=teams)
    elif request.method == "POST" and request.POST.get("action") == "revoke":
        key_id = request.POST.get("key") or ""
        if not key_id.isdigit():
            raise Http404("No such key.")
        try:
            api_key = member_key_revoke(user=request.user, key_id=int(key_id))
        except ApiKey.DoesNotExist:
            raise Http404("No such key.") from None
        except MemberKeyRefused as exc:
            raise Http404(str(exc)) from None
        messages.success(request, f"Revoked {api_key.prefix}….")
        return redirect("web-keys")
    own = ApiKey.objects.filter(user=request.user, parent=None)  # not the playground's keys
    own = list(own.select_related("team").order_by("-created_at"))
    used = {key.pk: key_use(key).phrases() for key in own if key.is_active}
    context = {
        "keys": [(key, used.get(key.pk, [])) for key in own],
        "budgets": [(label, use.phrase()) for label, use in member_budget_uses(request.user)],
        "form": form,
        "created_key": created_key,
        "creation_token": uuid.uuid4().hex,
        "base_url": _base_url(request),
        "example_model": _example_model(request.user),
        "can_create": teams.exists(),
    }
    return render(request, "web/keys.html", context)


def _example_model(user) -> str:
    key = ApiKey.objects.active().filter(user=user).first()
    entries = models_for_key(key) if key else list(ModelEntry.objects.filter(enabled=True))
    chat = [e for e in entries if e.kind == ModelEntry.Kind.CHAT]
    default = next((e for e in chat if e.is_default), None)
    return (default or (chat[0] if chat else None)).name if chat else "MODEL"


def _dates(request: HttpRequest) -> tuple[datetime.date, datetime.date]:
    today = timezone.now().date()

    def parse(name: str, default: datetime.date) -> datetime.date:
        try:
            day = datetime.date.fromisoformat(request.GET.get(name) or "")
        except ValueError:
            return default
        return min(max(day, EARLIEST), LATEST)

    since = parse("since", today - datetime.timedelta(days=29))
    until = parse("until", today)
    return min(since, until), max(since, until)


@login_required
def usage(request: HttpRequest) -> HttpResponse:
    since, until = _dates(request)
    rows = reports.daily_rows(since=since, until=until, user_id=request.user.pk)
    context = {
        "since": since,
        "until": until,
        "by_day": reports.grouped(rows, ["day"]),
        "by_model": reports.grouped(rows, ["model"]),
        "by_tier": reports.grouped(rows, ["tier"]),
        "by_batch": reports.grouped(rows, ["batch"]),
        "totals": reports.totals(rows),
        "chart": _bars(_every_day(reports.report(rows, ["day"]).by_day, since, until)),
    }
    return render(request, "web/usage.html", context)


def _every_day(points, since: datetime.date, until: datetime.date) -> list[tuple[object, int]]:
    """The chart's days from `since` to `until`, days without usage at 0 (the last 92 days of a
    longer range, so bars stay readable)."""
    values = dict(points)
    start = max(since, until - datetime.timedelta(days=91))
    days = [start + datetime.timedelta(days=i) for i in range((until - start).days + 1)]
    return [(day, values.get(day, 0)) for day in days]


# The chart's plot area in its 600 × 190 viewBox: the y axis's labels left of CHART_LEFT.
CHART_LEFT, CHART_TOP, CHART_BOTTOM = 56, 24, 170


def _bars(points: list[tuple[object, int]]) -> dict:
    """Bar-chart geometry for an inline SVG (no script): x, height and label per point, and the
    y axis's ticks (round numbers from 0 to at or above the highest bar)."""
    step = _tick_step(max((value for _, value in points), default=0) / 4)
    top = step * max(1, -(-max((value for _, value in points), default=0) // step))
    height = CHART_BOTTOM - CHART_TOP
    width = (600 - CHART_LEFT) / max(len(points), 1)
    bars = [
        {
            "x": round(CHART_LEFT + index * width, 1),
            "width": round(max(width - 2, 1), 1),
            "height": round(height * value / top, 1),
            "y": round(CHART_BOTTOM - height * value / top, 1),
            "label": str(label),
            "value": value,
        }
        for index, (label, value) in enumerate(points)
    ]
    ticks = [
        {"y": round(CHART_BOTTOM - height * value / top, 1), "label": _compact(value)}
        for value in range(0, top + 1, step)
    ]
    return {"bars": bars, "ticks": ticks, "left": CHART_LEFT, "bottom": CHART_BOTTOM}


def _tick_step(least: float) -> int:
    """The smallest of 1, 2 and 5 × 10^k that is at least `least` (and at least 1)."""
    magnitude = 1
    while True:
        for factor in (1, 2, 5):
            if factor * magnitude >= least:
                return factor * magnitude
        magnitude *= 10


def _compact(value: int) -> str:
    """An axis label: 950, 1.5k, 20k, 3M."""
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if value >= size:
            return f"{value / size:.1f}".rstrip("0").rstrip(".") + unit
    return str(value)


@login_required
async def models_page(request: HttpRequest) -> HttpResponse:
    entries = await sync_to_async(models_for_user)(await request.auser())
    catalog = await model_catalog(entries)
    return await sync_to_async(render)(request, "web/models.html", {"models": catalog})


@login_required
def team_reports(request: HttpRequest) -> HttpResponse:
    teams = list(team_summaries_owned_by(user=request.user))  # every team for superusers
    today = timezone.now().date()
    month = reports.daily_rows(since=today.replace(day=1), until=today, teams=teams)
    totals = reports.totals_by_team(month)
    batch = reports.totals_by_team(month.filter(batch=True))
    rows = [
        {"team": team, "month": totals.get(team.pk), "batch": batch.get(team.pk)} for team in teams
    ]
    return render(request, "web/teams.html", {"rows": rows, "month": today.replace(day=1)})


@login_required
def team_report(request: HttpRequest, team_id: int) -> HttpResponse:
    allowed = teams_owned_by(user=request.user)
    team = get_object_or_404(allowed, pk=team_id)
    since, until = _dates(request)
    filters = {
        "model": request.GET.get("model") or None,
        "key_prefix": request.GET.get("key") or None,
        "member": request.GET.get("member") or None,
    }
    rows = reports.daily_rows(since=since, until=until, teams=[team], **filters)
    result = reports.report(rows, REPORT_GROUPS)
    if request.GET.get("format") == "csv":
        return _csv(team, since, until, result)
    everything = reports.daily_rows(since=since, until=until, teams=[team])
    context = {
        "team": team,
        "since": since,
        "until": until,
        "filters": filters,
        "report": result,
        "chart": _bars(_every_day(result.by_day, since, until)),
        "models": sorted({r["model"] for r in reports.grouped(everything, ["model"])}),
        "members": sorted({r["member"] for r in reports.grouped(everything, ["member"])}),
        "query": request.GET.urlencode(),
    }
    return render(request, "web/team_report.html", context)


def _csv(team: Team, since, until, result: reports.Report) -> HttpResponse:
    response = HttpResponse(content_type="text/csv")
    name = f"orchard-{team.name}-{since}-{until}.csv".replace(" ", "_")
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    writer = csv.writer(response)
    columns = [*REPORT_GROUPS, *REPORT_SUMS, "total_tokens"]
    # The cost exactly (a decimal of the currency, to the nano-unit), and its currency.
    writer.writerow([*columns, "cost", "currency"])
    money = [currency()]
    batch_at = columns.index("batch")
    for row in result.rows:
        values = [row[c] for c in columns]
        values[batch_at] = "true" if values[batch_at] else "false"  # as the usage API writes it
        writer.writerow([*values, from_nanos(row["cost"]), *money])
    totals = result.totals
    blanks = [""] * (len(REPORT_GROUPS) - 1)
    sums = [totals[c] for c in columns[len(REPORT_GROUPS) :]]
    writer.writerow(["total", *blanks, *sums, from_nanos(totals["cost"]), *money])
    return response


def login_view():
    view = auth_views.LoginView.as_view(
        template_name="web/login.html", redirect_authenticated_user=True
    )
    return signin_throttled(view)


def admin_login_view():
    """The admin's own sign-in form, under the same throttle (routed before the admin's URLs)."""
    return signin_throttled(admin.site.login)


def logout_view():
    return auth_views.LogoutView.as_view(next_page=settings.LOGIN_URL)


def password_set_view():
    """Where a member invited in the admin sets their password, by the one-time link the
    invite showed (Django's password-reset token: it stops working once the password is set)."""
    return auth_views.PasswordResetConfirmView.as_view(
        template_name="web/password_set.html",
        success_url=reverse_lazy("web-password-set-done"),
        reset_url_token="set",
    )


def password_set_done_view():
    return TemplateView.as_view(template_name="web/password_set_done.html")
