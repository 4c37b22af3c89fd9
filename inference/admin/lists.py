"""What the admin's long changelists share: the whole width, and a capped row count."""

from django.core.paginator import Paginator
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
