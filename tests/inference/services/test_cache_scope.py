"""A request's prefix-cache scope (inference/services/cache_scope.py): the key's team, unless the
model shares its cache; narrowed by the caller's salt."""

from accounts.models import ApiKey
from inference.models import ModelEntry
from inference.services.cache_scope import prefix_cache_scope

PRIVATE, SHARED = ModelEntry(name="m"), ModelEntry(name="m", prefix_cache_shared=True)


def scope(team_id: int, entry: ModelEntry = PRIVATE, salt: str | None = None) -> str:
    return prefix_cache_scope(api_key=ApiKey(team_id=team_id), entry=entry, salt=salt)


def test_keys_of_one_team_share_a_scope_and_other_teams_never_do():
    assert scope(1) == scope(1)
    assert len({scope(1), scope(2), scope(12), scope(21)}) == 4


def test_a_salt_narrows_the_scope_and_never_reaches_the_engine_as_text():
    salted = scope(1, salt="user-42")
    assert len({scope(1), salted, scope(1, salt="user-43"), scope(2, salt="user-42")}) == 4
    assert salted == scope(1, salt="user-42") and "user-42" not in salted


def test_a_shared_model_drops_the_team_but_keeps_the_salt():
    assert scope(1, SHARED) == scope(2, SHARED) != scope(1)
    assert scope(1, SHARED, salt="s") == scope(2, SHARED, salt="s") != scope(1, SHARED)
    assert scope(1, SHARED, salt="s") != scope(1, salt="s")
