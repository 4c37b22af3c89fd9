"""The small things of the pages: the team reports list, what each key used of its limits (the
member's keys page and the key's admin page), the usage chart's scale, the pages' titles and
icon, and the admin keeping the member pages' stylesheet (whose colours clash with its own)
out."""

import re

import pytest
from django.contrib.staticfiles import finders
from django.urls import reverse

from tests.factories import ApiKeyFactory, StaffUserFactory
from tests.inference.web.test_pages import (  # noqa: F401  (world: a fixture)
    batch_used,
    signed_in,
    used,
    world,
)

pytestmark = pytest.mark.django_db


def cells(page: str, table_id: str) -> list[list[str]]:
    body = page.split(f'id="{table_id}"')[1].split("</table>")[0]
    rows = re.findall(r"<tr>(.*?)</tr>", body.split("<tbody>")[1], re.S)
    return [
        [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td>(.*?)</td>", r, re.S)]
        for r in rows
    ]


def test_the_team_reports_list_is_a_table_of_each_teams_month(world):  # noqa: F811
    used(world["keys"]["member"], "m1", 10)
    used(world["keys"]["colleague"], "m1", 5)
    used(world["keys"]["stranger"], "m1", 999)
    batch_used(world["keys"]["member"], "m1", 6)
    page = signed_in(world["owner"]).get(reverse("web-teams")).content.decode()
    assert cells(page, "team-list") == [
        ["alpha", "3", "2", "3", "21", "0.00 USD", "6 tokens, 0.00 USD"]  # unpriced
    ]
    assert f'href="{reverse("web-team-report", args=[world["team"].pk])}"' in page


def test_each_key_shows_what_it_used_of_its_limits(world):  # noqa: F811
    key = world["keys"]["member"]
    key.rpm, key.max_parallel, key.budget_tokens = 60, 2, 1000
    key.save()
    used(key, "m1", 10)
    page = signed_in(world["member"]).get(reverse("web-keys")).content.decode()
    row = page.split("mia&#x27;s")[1].split("</tr>")[0]
    assert "10 of 1,000 tokens this month (990 left)" in row
    assert "0 of 60 requests this minute" in row and "0 of 2 running" in row
    admin_page = signed_in(StaffUserFactory()).get(
        reverse("admin:accounts_apikey_change", args=[key.pk])
    )
    used_now = admin_page.content.decode().split("field-used")[1].split("</div>\n")[0]
    assert "10 of 1,000 tokens this month (990 left)" in used_now
    plain = ApiKeyFactory(team=world["team"], user=world["member"])  # no limits: the month only
    plain_page = signed_in(world["member"]).get(reverse("web-keys")).content.decode()
    assert "0 tokens this month<" in plain_page.split(plain.prefix)[1].split("</tr>")[0]


def test_the_usage_chart_has_a_scale(world):  # noqa: F811
    used(world["keys"]["member"], "m1", 15)
    page = signed_in(world["member"]).get(reverse("web-usage")).content.decode()
    chart = page.split('<svg class="chart"')[1].split("</svg>")[0]
    labels = re.findall(r'text-anchor="end" dominant-baseline="middle">([^<]+)<', chart)
    assert labels == ["0", "5", "10", "15"]
    assert ">tokens</text>" in chart


def test_titles_the_icon_and_the_admins_own_styles(world):  # noqa: F811
    home = signed_in(world["member"]).get("/").content.decode()
    assert "<title>Home · Orchard</title>" in home
    assert 'rel="icon" href="/static/web/favicon.svg"' in home
    assert finders.find("web/favicon.svg")
    admin_index = signed_in(StaffUserFactory()).get(reverse("admin:index")).content.decode()
    assert "web/orchard.css" not in admin_index  # its --accent painted the title green on blue
    assert "web/admin.css" in admin_index and 'rel="icon"' in admin_index
    assert "Orchard administration" in admin_index
