"""What the accounts admin's pages share, and what inference's admin builds on: who owns a team,
the read-only admin and the visible-team filter, the search that never echoes a raw key, the page
that shows new keys once, and the model picker whose names inference hands in (pickers.py there).
They live apart from the pages that use them so that those pages import them without a circle.
"""

from collections.abc import Callable, Iterable

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.views.main import SEARCH_VAR
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.utils.cache import add_never_cache_headers

from accounts import keys
from accounts.models import ApiKey
from accounts.selectors import teams_owned_by, teams_visible_to

SHOW_ONCE_TEMPLATE = "admin/accounts/apikey/show_once.html"
MESSAGE_SEARCH_REDACTED = (
    "Searched by the key's prefix. Search with the prefix the admin shows (sk-orch-XXXXXXXX), not "
    "the whole key: a URL holding a key ends up in logs and browser history."
)


def owns_team(user, team_id: int | None) -> bool:
    """Whether the user owns the team, or any team when `team_id` is None (the changelist asks
    before there is an object)."""
    owned = teams_owned_by(user=user)
    return (owned if team_id is None else owned.filter(pk=team_id)).exists()


class KeySearchMixin:
    """For changelists searchable by key. A search holding a raw key is redirected to the same
    search by the key's prefix, so the secret is not echoed in the search box, pagination and
    filter links, or the changelist filters that later redirects carry."""

    def changelist_view(self, request, extra_context=None):
        term = request.GET.get(SEARCH_VAR, "")
        if request.method == "GET" and keys.redact_keys(term) != term:
            query = request.GET.copy()
            query[SEARCH_VAR] = keys.redact_keys(term)
            self.message_user(request, MESSAGE_SEARCH_REDACTED, messages.WARNING)
            return HttpResponseRedirect(f"{request.path}?{query.urlencode()}")
        return super().changelist_view(request, extra_context)


def show_once_response(request, created: list[tuple[ApiKey, str]], *, title: str):
    response = TemplateResponse(
        request,
        SHOW_ONCE_TEMPLATE,
        {
            **admin.site.each_context(request),
            "title": title,
            "created": created,
            "opts": ApiKey._meta,
        },
    )
    add_never_cache_headers(response)  # includes no-store: the page must not be kept anywhere
    return response


class ReadOnlyAdmin(admin.ModelAdmin):
    """For records the application writes (usage, roll-ups, stored responses): shown, never
    added, changed or deleted by hand."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class VisibleTeamFilter(admin.RelatedFieldListFilter):
    """A team filter that lists only the teams the user may see."""

    def field_choices(self, field, request, model_admin):
        return [(team.pk, str(team)) for team in teams_visible_to(user=request.user)]


# What the model pickers offer: accounts holds model names but cannot read the registry
# (docs/architecture.md), so inference's admin hands it a reader (inference/admin/pickers.py).
_model_names: Callable[[], Iterable[str]] = tuple


def model_names_source(source: Callable[[], Iterable[str]]) -> None:
    """Where the model pickers take the registered models' names from."""
    global _model_names
    _model_names = source


class ModelPickerField(forms.MultipleChoiceField):
    """Model names as checkboxes of the registered models: a name that is not one is refused.
    `offer` adds the names a value already holds, so that a model removed from the registry
    still shows (ticked) on the keys and teams that name it, and can be unticked."""

    widget = forms.CheckboxSelectMultiple

    def offer(self, held: Iterable[str] = ()) -> None:
        names = sorted({*_model_names(), *held})
        self.choices = [(name, name) for name in names]
        if not names:
            self.help_text = f"{self.help_text} No model is registered yet.".strip()

    def to_python(self, value) -> list[str]:
        return [name for name in super().to_python(value) if name]  # "" from an empty post

    def clean(self, value) -> list[str]:
        return sorted(set(super().clean(value)))
