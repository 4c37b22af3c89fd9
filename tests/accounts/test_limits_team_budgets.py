"""Budgets beyond a key's own tokens, on both limiter backends: a team's and a member's shared by
their keys, in tokens or money (each token reserved at the model's dearest price), monthly or over
a custom period; never exceeded under concurrent load, seeded from the daily roll-ups, refusals
naming the budget, and one team's budget never touching another team's keys."""

import asyncio
import datetime
import random
from decimal import Decimal

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from accounts.limits import CODE_QUOTA, RateLimitExceeded, RedisLimiter
from accounts.limits.base import limits_with_budgets
from accounts.models import Budget
from inference.models import DailyUsage
from tests.accounts.conftest import TEST_REDIS_URL
from tests.factories import ApiKeyFactory, MembershipFactory, TeamFactory, UserFactory

PRICE = 700  # nano-units per token: the dearest token of the request's model


def make_budget(team, *, scope="team", unit="tokens", amount, user=None, api_key=None, **extra):
    return Budget.objects.create(
        team=team,
        scope=scope,
        unit=unit,
        amount=Decimal(amount),
        user=user,
        api_key=api_key,
        **extra,
    )


@sync_to_async
def team_with_keys(n_members=2, keys_each=2):
    team = TeamFactory()
    members = [UserFactory() for _ in range(n_members)]
    keys = {
        member: [ApiKeyFactory(team=team, user=member) for _ in range(keys_each)]
        for member in members
    }
    return team, members, keys


async def drain(limiter, api_keys, *, reserve, token_cost=None, seed=7, clients=50):
    """`clients` tasks admit and release, each on a key picked at random, until refused; returns
    (tokens used, cost used, the refusals)."""
    rng = random.Random(seed)
    used = {"tokens": 0, "cost": 0}
    refusals = []

    async def client(index):
        while True:
            api_key = api_keys[(index + rng.randrange(len(api_keys))) % len(api_keys)]
            try:
                admission = await limiter.admit(
                    api_key, reserved_tokens=reserve, token_cost=token_cost
                )
            except RateLimitExceeded as exc:
                refusals.append(exc)
                return
            await asyncio.sleep(0)
            tokens = rng.randint(0, admission.granted_tokens)
            cost = tokens * rng.randint(0, token_cost or 0)  # at most the dearest token's price
            used["tokens"] += tokens
            used["cost"] += cost
            await admission.release(used_tokens=tokens, used_cost=cost)

    await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(clients))), 60)
    return used["tokens"], used["cost"], refusals


@pytest.mark.django_db(transaction=True)
async def test_a_team_token_budget_holds_across_its_keys_under_load(make_limiter, sync_thread_db):
    team, _, keys = await team_with_keys()
    await sync_to_async(make_budget)(team, amount=5000)
    limiter = make_limiter()
    all_keys = [k for ks in keys.values() for k in ks]
    tokens, _, refusals = await drain(limiter, all_keys, reserve=100)
    assert 5000 - 100 < tokens <= 5000
    refusal = refusals[0]
    assert refusal.code == CODE_QUOTA and refusal.budget.scope == "team"
    assert "team's monthly token budget is exhausted" in refusal.message
    assert f"team {team.name}" in refusal.message


@pytest.mark.django_db(transaction=True)
async def test_a_team_money_budget_reserves_each_token_at_its_dearest_price(
    make_limiter, sync_thread_db
):
    team, _, keys = await team_with_keys()
    await sync_to_async(make_budget)(team, unit="money", amount="0.005")  # 5,000,000 nano-units
    limiter = make_limiter()
    all_keys = [k for ks in keys.values() for k in ks]
    _, cost, refusals = await drain(limiter, all_keys, reserve=100, token_cost=PRICE)
    assert 5_000_000 - 100 * PRICE < cost <= 5_000_000
    refusal = refusals[0]
    assert refusal.budget.unit == "money"
    assert "team's monthly money budget is exhausted" in refusal.message
    assert "requested 0.00007 USD" in refusal.message  # 100 tokens × 700 nano-units


@pytest.mark.django_db(transaction=True)
async def test_a_member_budget_spans_their_keys_and_spares_their_colleague(
    make_limiter, sync_thread_db
):
    team, (mia, carl), keys = await team_with_keys()
    await sync_to_async(make_budget)(team, scope="member", user=mia, amount=1000)
    limiter = make_limiter()
    tokens, _, refusals = await drain(limiter, keys[mia], reserve=50, clients=32)
    assert 1000 - 50 < tokens <= 1000
    assert refusals[0].budget.scope == "member" and "member's monthly token budget" in (
        refusals[0].message
    )
    # Carl, in the same team, is not limited by Mia's budget.
    for _ in range(5):
        admission = await limiter.admit(keys[carl][0], reserved_tokens=500)
        await admission.release(used_tokens=500)


@pytest.mark.django_db(transaction=True)
async def test_one_teams_budget_never_touches_another_teams_keys(make_limiter, sync_thread_db):
    team, _, keys = await team_with_keys(1, 1)
    _, _, other_keys = await team_with_keys(1, 1)
    await sync_to_async(make_budget)(team, amount=100)
    limiter = make_limiter()
    [key] = [k for ks in keys.values() for k in ks]
    [other_key] = [k for ks in other_keys.values() for k in ks]
    await (await limiter.admit(key, reserved_tokens=100)).release(used_tokens=100)
    with pytest.raises(RateLimitExceeded):
        await limiter.admit(key, reserved_tokens=1)
    await (await limiter.admit(other_key, reserved_tokens=1000)).release(used_tokens=1000)


@pytest.mark.django_db(transaction=True)
async def test_every_budget_must_have_room_and_the_tightest_refuses(make_limiter, sync_thread_db):
    """Key, member and team budgets at once: the one with least room refuses, by name."""
    team, (mia, _), keys = await team_with_keys(2, 1)
    key = keys[mia][0]
    await sync_to_async(make_budget)(team, amount=10_000)
    await sync_to_async(make_budget)(team, scope="member", user=mia, amount=300)
    await sync_to_async(make_budget)(team, scope="key", api_key=key, amount=5000)
    limiter = make_limiter()
    held = await limiter.admit(key, reserved_tokens=200)
    with pytest.raises(RateLimitExceeded) as caught:
        await limiter.admit(key, reserved_tokens=200)
    assert caught.value.budget.scope == "member"
    await held.release(used_tokens=100)
    await (await limiter.admit(key, reserved_tokens=200)).release(used_tokens=200)


@pytest.mark.django_db(transaction=True)
async def test_a_budget_is_seeded_from_the_daily_roll_ups(make_limiter, sync_thread_db):
    team, (mia, carl), keys = await team_with_keys(2, 1)
    await sync_to_async(make_budget)(team, unit="money", amount="1")
    today = timezone.now().date()
    # 0.9 spent this month already (by Carl's key), and more last month, which does not count.
    for day, cost in ((today, 900_000_000), (today.replace(day=1) - datetime.timedelta(1), 10**9)):
        await DailyUsage.objects.acreate(
            date=day, team=team, api_key=keys[carl][0], model="m", output_cost=cost
        )
    limiter = make_limiter()
    flexible = await limiter.admit(
        keys[mia][0], reserved_tokens=10**6, min_tokens=1, token_cost=1000
    )
    assert flexible.granted_tokens == 100_000  # 0.1 left at 1,000 nano-units a token
    with pytest.raises(RateLimitExceeded):
        await limiter.admit(keys[mia][0], reserved_tokens=1, token_cost=1000)
    await flexible.release(used_tokens=50_000, used_cost=50_000_000)
    again = await limiter.admit(keys[mia][0], reserved_tokens=10**6, min_tokens=1, token_cost=1000)
    assert again.granted_tokens == 50_000


@pytest.mark.django_db(transaction=True)
async def test_a_free_model_spends_no_money_budget(make_limiter, sync_thread_db):
    team, (mia, _), keys = await team_with_keys(2, 1)
    await sync_to_async(make_budget)(team, unit="money", amount="0.000001")
    limiter = make_limiter()
    admission = await limiter.admit(keys[mia][0], reserved_tokens=10**6, token_cost=0)
    assert admission.granted_tokens == 10**6
    await admission.release(used_tokens=10**6, used_cost=0)


@pytest.mark.django_db(transaction=True)
async def test_a_custom_period_budget_counts_only_inside_its_days(make_limiter, sync_thread_db):
    team, (mia, _), keys = await team_with_keys(2, 1)
    today = timezone.now().date()
    ended = await sync_to_async(make_budget)(
        team,
        amount=1,
        period="custom",
        starts_on=today - datetime.timedelta(10),
        ends_on=today - datetime.timedelta(1),
    )
    limiter = make_limiter()
    await (await limiter.admit(keys[mia][0], reserved_tokens=100)).release(used_tokens=100)
    # Used before it started: not counted by a period from today on.
    await sync_to_async(make_budget)(
        team, amount=150, period="custom", starts_on=today, ends_on=today + datetime.timedelta(6)
    )
    await DailyUsage.objects.acreate(
        date=today - datetime.timedelta(1),
        team=team,
        api_key=keys[mia][0],
        model="m",
        prompt_tokens=10**6,
    )
    fresh = make_limiter()
    await (await fresh.admit(keys[mia][0], reserved_tokens=140)).release(used_tokens=140)
    with pytest.raises(RateLimitExceeded) as caught:
        await fresh.admit(keys[mia][0], reserved_tokens=20)
    assert f"token budget for {today} to {today + datetime.timedelta(6)}" in caught.value.message
    assert ended.pk  # the ended budget never refused anything


@pytest.mark.redis
@pytest.mark.django_db(transaction=True)
async def test_redis_team_budget_is_shared_by_processes_and_a_retry_counts_once(
    redis_namespace, sync_thread_db
):
    team, (mia, carl), keys = await team_with_keys(2, 1)
    await sync_to_async(make_budget)(team, unit="money", amount="0.001")  # 1,000,000 nano-units
    first = RedisLimiter(url=TEST_REDIS_URL, namespace=redis_namespace)
    second = RedisLimiter(url=TEST_REDIS_URL, namespace=redis_namespace)
    try:
        held = await first.admit(keys[mia][0], reserved_tokens=1000, token_cost=700)
        with pytest.raises(RateLimitExceeded):
            await second.admit(keys[carl][0], reserved_tokens=1000, token_cost=700)
        limits = await limits_with_budgets(keys[mia][0])
        for _ in range(3):  # a release whose answer was lost, retried
            await first._release(limits, held.id, 1000, 400_000)
        after = await second.admit(keys[carl][0], reserved_tokens=10**6, min_tokens=1, token_cost=1)
        assert after.granted_tokens == 600_000
    finally:
        first.close()
        second.close()


@pytest.mark.django_db
def test_a_budget_must_name_who_it_is_for():
    team = TeamFactory()
    stranger = UserFactory()
    MembershipFactory(team=TeamFactory(), user=stranger)
    problems = {
        "user": Budget(team=team, scope="member", unit="tokens", amount=1),
        "api_key": Budget(team=team, scope="key", unit="tokens", amount=1),
        "amount": Budget(team=team, scope="team", unit="tokens", amount=Decimal("1.5")),
        "starts_on": Budget(team=team, scope="team", unit="money", amount=1, period="custom"),
    }
    for field, budget in problems.items():
        with pytest.raises(Exception) as caught:
            budget.full_clean()
        assert field in caught.value.message_dict, (field, caught.value)
    foreign = Budget(team=team, scope="member", user=stranger, unit="tokens", amount=1)
    with pytest.raises(Exception) as caught:
        foreign.full_clean()
    assert "member of the team" in str(caught.value)
