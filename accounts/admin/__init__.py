"""Admin for teams and memberships (teams.py, with the invite page whose parts are in invites.py)
and API keys (api_keys.py); common.py holds what they share and what inference's admin builds on.
The budgets' admin is accounts/budgets_admin.py.

A new or rotated key's raw value is rendered once, in the response to the request that created it
(never through messages, sessions or any other store), with `Cache-Control: no-store`. Keys are
revoked, never deleted (usage rows refer to them). Staff who are not superusers manage only the
teams they own; a member sees their own keys read-only (accounts.selectors). Searches never echo a
raw key: one pasted into a search box is cut to its prefix before the page is built.
"""

from accounts import budgets_admin  # noqa: F401  (registers its admins)
from accounts.admin import api_keys, teams  # noqa: F401  (each registers its admins)
from accounts.admin.api_keys import ERROR_NOT_A_MEMBER, ERROR_PRIORITY_BY_SUPERUSER
from accounts.admin.common import (
    KeySearchMixin,
    ReadOnlyAdmin,
    VisibleTeamFilter,
    model_names_source,
    owns_team,
)
from accounts.admin.invites import ERROR_ADDS_NO_USERS, ERROR_PASSWORD_OF_EXISTING

# What inference's admin and the tests import from here.
__all__ = [
    "ERROR_ADDS_NO_USERS",
    "ERROR_NOT_A_MEMBER",
    "ERROR_PASSWORD_OF_EXISTING",
    "ERROR_PRIORITY_BY_SUPERUSER",
    "KeySearchMixin",
    "ReadOnlyAdmin",
    "VisibleTeamFilter",
    "model_names_source",
    "owns_team",
]
