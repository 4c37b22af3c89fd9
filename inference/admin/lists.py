"""What the admin's long changelists share: the whole width, a capped row count, and what a
user may see of a model in pages built beside the lists (totals)."""

from django.contrib import admin
from django.core.paginator import Paginator
from django.db.models import Model, QuerySet
from django.http import HttpRequest
from django.utils.functional import cached_property

# The changelist counts at most this many matching rows (then filters narrow it down).
USAGE_COUNT_CAP = 10_000


class WideListMixin:
    """A changelist with many columns gets the whole width: no navigation sidebar beside it
    (the breadcrumbs and the home page still lead everywhere)."""

    def changelist_view(self, request, extra_context=None):
        return super().changelist_view(
            request, {**(extra_context or {}), "is_nav_sidebar_enabled": False}
        )


class CappedCountPaginator(Paginator):
    @cached_property
    def count(self) -> int:
        return self.object_list[:USAGE_COUNT_CAP].count()


def admin_list_rows(request: HttpRequest, model: type[Model]) -> QuerySet | None:
    """The rows of `model` its admin list shows this user, or None where they may not view that
    list at all: pages beside the lists (totals) show nothing the lists would not."""
    model_admin = admin.site.get_model_admin(model)
    if not model_admin.has_view_permission(request):
        return None
    return model_admin.get_queryset(request)
