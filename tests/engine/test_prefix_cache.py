"""The prefix cache's policy without a model: fake per-layer keys and values whose entries say
which token (and which sequence) they were computed for, so a wrong hit shows as wrong numbers."""

import gc

import mlx.core as mx
import pytest

from engine.cache.prefix import PrefixCache

HEADS, DIM = 2, 4
BYTES_PER_TOKEN = 2 * HEADS * DIM * 4  # keys + values, one attention layer, float32


def kv_for(tokens, tag=0.0):
    """One attention layer's keys/values for `tokens`: every entry is token + tag, so a value
    read back says which token and which sequence it came from."""
    values = mx.array([float(t) + tag for t in tokens])[None, None, :, None]
    keys = mx.contiguous(mx.broadcast_to(values, (1, HEADS, len(tokens), DIM)))
    return keys, keys + 0.5


def source_for(tokens, tag=0.0):
    def source(start, end):
        keys, values = kv_for(tokens[start:end], tag)
        return [(keys, values)]

    return source


def hybrid_source_for(tokens, tag=0.0):
    def source(start, end):
        keys, values = kv_for(tokens[start:end], tag)
        return [(keys, values), None]  # an attention layer and a recurrent layer

    return source


def state_after(tokens, tag=0.0):
    return [None, (mx.array([float(sum(tokens)) + tag]),)]


def read_tokens(hit):
    keys, _ = hit.kv[0]
    return [round(x) for x in keys[0, 0, :, 0].tolist()]


def test_match_finds_the_longest_prefix_within_the_limit():
    cache = PrefixCache(max_bytes=10**9)
    prompt = list(range(100, 120))
    cache.insert(prompt, source_for(prompt))
    hit = cache.match([*prompt, 7, 8], limit=21)
    assert hit.length == 20 and read_tokens(hit) == prompt
    # A resend of the same prompt resumes one token before its end.
    hit = cache.match(prompt, limit=len(prompt) - 1)
    assert hit.length == 19 and read_tokens(hit) == prompt[:19]
    # A prompt that diverges part-way along an edge still reuses what it shares.
    assert cache.match([*prompt[:5], 999], limit=5).length == 5
    assert cache.match([1, 2, 3], limit=2).length == 0
    stats = cache.stats()
    assert (stats.lookups, stats.hits, stats.hit_tokens) == (4, 3, 44)


def test_sequences_that_share_a_prefix_keep_their_own_continuations():
    cache = PrefixCache(max_bytes=10**9)
    shared = [1, 2, 3, 4]
    first, second = [*shared, 10, 11, 12], [*shared, 20, 21]
    cache.insert(first, source_for(first, tag=0.0))
    cache.insert(second, source_for(second, tag=0.25))  # another sequence computed this one
    hit = cache.match([*first, 0], limit=7)
    assert hit.length == 7
    keys = hit.kv[0][0][0, 0, :, 0].tolist()
    assert keys == pytest.approx([1, 2, 3, 4, 10, 11, 12])  # first's own values, never second's
    hit = cache.match([*second, 0], limit=6)
    keys = hit.kv[0][0][0, 0, :, 0].tolist()
    # The shared part was stored once (by first); the rest is second's.
    assert keys == pytest.approx([1, 2, 3, 4, 20.25, 21.25])
    assert cache.stats().nodes == 3  # shared prefix, and one edge each after the split


def test_bytes_are_counted_through_inserts_splits_and_evictions():
    cache = PrefixCache(max_bytes=10**9)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9]
    cache.insert(a, source_for(a))
    assert cache.nbytes == 6 * BYTES_PER_TOKEN
    cache.insert(b, source_for(b))  # splits a's edge after 3 tokens
    assert cache.nbytes == 8 * BYTES_PER_TOKEN
    freed = cache.evict(1)
    assert freed in (2 * BYTES_PER_TOKEN, 3 * BYTES_PER_TOKEN)
    assert cache.nbytes == 8 * BYTES_PER_TOKEN - freed


def test_least_recently_used_leaves_go_first_and_locked_ones_never():
    cache = PrefixCache(max_bytes=10**9)
    prompts = [[i, i + 1, i + 2, i + 3] for i in (10, 20, 30)]
    for prompt in prompts:
        cache.insert(prompt, source_for(prompt))
    held = cache.match([*prompts[0], 0], limit=4)
    cache.lock(held)
    cache.match([*prompts[1], 0], limit=4)  # used after prompts[2]
    cache.evict(4 * BYTES_PER_TOKEN)
    assert cache.match([*prompts[2], 0], limit=4).length == 0  # oldest unlocked: gone
    assert cache.match([*prompts[1], 0], limit=4).length == 4
    cache.clear()
    assert cache.match([*prompts[0], 0], limit=4).length == 4  # locked: kept through clear
    assert cache.nbytes == 4 * BYTES_PER_TOKEN
    cache.unlock(held)
    cache.clear()
    assert cache.nbytes == 0 and cache.stats().nodes == 0


def test_the_budget_is_never_exceeded():
    cache = PrefixCache(max_bytes=10 * BYTES_PER_TOKEN)
    for start in range(0, 100, 4):
        prompt = list(range(start + 1000, start + 1004))
        cache.insert(prompt, source_for(prompt))
        assert cache.nbytes <= 10 * BYTES_PER_TOKEN
    assert cache.stats().evictions > 0


def test_a_hit_is_unchanged_by_later_inserts_that_split_its_edges():
    cache = PrefixCache(max_bytes=10**9)
    prompt = list(range(1, 9))
    cache.insert(prompt, source_for(prompt))
    hit = cache.match([*prompt, 0], limit=8)
    cache.lock(hit)
    other = [1, 2, 777]
    cache.insert(other, source_for(other, tag=0.5))  # splits the edge the hit reads
    assert read_tokens(hit) == prompt
    cache.unlock(hit)  # along the new upper half too: everything is evictable again
    cache.clear()
    assert cache.nbytes == 0


def test_hybrid_hits_end_only_where_a_recurrent_state_was_kept():
    cache = PrefixCache(max_bytes=10**9, hybrid=True)
    system = [5, 6, 7, 8]
    turn = [*system, 40, 41, 42]
    cache.insert(turn, hybrid_source_for(turn), state=None)  # no state: not resumable, not kept
    assert cache.nbytes == 0
    cache.insert(turn, hybrid_source_for(turn), state_after(turn))
    # A prompt sharing only the system part: no snapshot there, so a miss, never a wrong hit.
    assert cache.match([*system, 99, 98], limit=5).length == 0
    cache.insert(system, hybrid_source_for(system), state_after(system))  # a checkpoint
    hit = cache.match([*system, 99, 98], limit=5)
    assert hit.length == 4 and float(hit.state[1][0][0]) == sum(system)
    hit = cache.match([*turn, 1], limit=7)
    assert hit.length == 7 and float(hit.state[1][0][0]) == sum(turn)
    # Within a limit that cuts an edge, the deepest snapshot before it.
    assert cache.match([*turn, 1], limit=6).length == 4


def test_clear_returns_the_memory():
    cache = PrefixCache(max_bytes=10**10)
    gc.collect()
    before = mx.get_active_memory()
    for start in range(0, 4000, 1000):
        prompt = list(range(start, start + 1000))
        cache.insert(prompt, lambda s, e, p=prompt: [kv_for(p[s:e]) for _ in range(8)])
    mx.eval([])
    assert mx.get_active_memory() - before >= cache.nbytes > 0
    assert cache.clear() > 0
    gc.collect()
    assert mx.get_active_memory() - before < 64 * 1024


def test_many_entries_are_evicted_oldest_first():
    cache = PrefixCache(max_bytes=200 * 4 * BYTES_PER_TOKEN)  # room for 200 of these prompts
    for index in range(2000):
        prompt = [10_000 + index, 1, 2, 3]
        cache.insert(prompt, source_for(prompt))
        if index % 50 == 0:
            cache.match([10_000, 1, 2, 3, 0], limit=4)  # the first one stays in use
    stats = cache.stats()
    assert stats.nodes == 200 and stats.evictions == 1800
    assert cache.match([10_000, 1, 2, 3, 0], limit=4).length == 4
    newest = range(1801, 2000)
    assert all(cache.match([10_000 + i, 1, 2, 3, 0], limit=4).length == 4 for i in newest)
    assert cache.match([10_000 + 1800, 1, 2, 3, 0], limit=4).length == 0


def test_a_scope_never_matches_another_scopes_entries():
    cache = PrefixCache(max_bytes=10**9)
    secret = list(range(300, 340))
    cache.insert(secret, source_for(secret, tag=0.0), scope="team:1")
    probe = [*secret, 7]
    # Not the whole prompt, not one token of it, in any other scope (the unscoped one too).
    for scope in ("team:2", "", "team:1/salt:x"):
        assert cache.match(probe, limit=40, scope=scope).length == 0
        assert cache.match(secret[:2], limit=1, scope=scope).length == 0
    hit = cache.match(probe, limit=40, scope="team:1")
    assert hit.length == 40 and read_tokens(hit) == secret
    # The same tokens computed in another scope are its own entry, read back as its own values.
    cache.insert(secret, source_for(secret, tag=0.25), scope="team:2")
    keys = cache.match(probe, limit=40, scope="team:2").kv[0][0][0, 0, :, 0].tolist()
    assert keys == pytest.approx([t + 0.25 for t in secret])
    assert read_tokens(cache.match(probe, limit=40, scope="team:1")) == secret
    assert cache.nbytes == 2 * 40 * BYTES_PER_TOKEN


def test_scopes_share_one_budget_and_one_eviction_order():
    cache = PrefixCache(max_bytes=8 * BYTES_PER_TOKEN)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    cache.insert(a, source_for(a), scope="a")
    cache.insert(b, source_for(b), scope="b")
    cache.match([*a, 0], limit=4, scope="a")  # a is now more recent than b
    cache.insert(c, source_for(c), scope="c")  # over budget: the least recent, b, goes
    assert cache.nbytes == 8 * BYTES_PER_TOKEN
    assert cache.match([*b, 0], limit=4, scope="b").length == 0
    assert cache.match([*a, 0], limit=4, scope="a").length == 4
    assert cache.match([*c, 0], limit=4, scope="c").length == 4
    # A scope whose last entry went leaves nothing behind (scopes are per team or salt: many).
    assert set(cache._roots) == {"a", "c"}
    held = cache.match([*a, 0], limit=4, scope="a")
    cache.lock(held)
    cache.clear()
    assert set(cache._roots) == {"a"} and cache.nbytes == 4 * BYTES_PER_TOKEN
    cache.unlock(held)
    cache.clear()
    assert cache._roots == {} and cache.stats().nodes == 0


def test_hybrid_snapshots_are_scoped_too():
    cache = PrefixCache(max_bytes=10**9, hybrid=True)
    system = [5, 6, 7, 8]
    turn = [*system, 40, 41, 42]
    cache.insert(turn, hybrid_source_for(turn), state_after(turn), scope="team:1")
    cache.insert(system, hybrid_source_for(system), state_after(system), scope="team:1")
    assert cache.match([*turn, 1], limit=7, scope="team:2").length == 0
    assert cache.match([*system, 99], limit=4, scope="team:2").length == 0
    # Another scope's own checkpoint of the same tokens is its own snapshot.
    cache.insert(system, hybrid_source_for(system), state_after(system, tag=0.5), scope="team:2")
    hit = cache.match([*turn, 1], limit=7, scope="team:2")
    assert hit.length == 4 and float(hit.state[1][0][0]) == sum(system) + 0.5
    hit = cache.match([*turn, 1], limit=7, scope="team:1")
    assert hit.length == 7 and float(hit.state[1][0][0]) == sum(turn)
