"""Template tags for the admin index: today's usage totals (from the daily roll-ups the user
may see)."""

from django import template
from django.utils import timezone

from inference.services import reports
from inference.services.usage import daily_usage_visible_to

register = template.Library()


@register.simple_tag(takes_context=True)
def orchard_today_totals(context) -> dict[str, int]:
    request = context["request"]
    today = timezone.now().date()
    rows = daily_usage_visible_to(user=request.user).filter(date=today)
    return reports.totals(rows)
