"""The prefix cache's disk tier without a model (engine/cache/disk/): fake keys and values whose
entries say which token (and which sequence) they were computed for, as in test_prefix_cache.py,
so a wrong read-back shows as wrong numbers. Blocks of 4 tokens keep the prompts short."""

import errno
import logging
import threading

import pytest

from engine.cache.disk import files, keys
from engine.cache.disk.tier import DiskTier
from engine.cache.mlx_caches import CacheLayout
from engine.cache.prefix import PrefixCache
from tests.engine.test_prefix_cache import (
    BYTES_PER_TOKEN,
    hybrid_source_for,
    read_tokens,
    source_for,
    state_after,
)

MODEL = "a" * 64
BLOCK = 4
DENSE = CacheLayout(("kv",), BYTES_PER_TOKEN, 0)
HYBRID = CacheLayout(("kv", "state"), BYTES_PER_TOKEN, 4)  # the state: one float32


@pytest.fixture
def make(tmp_path):
    """A prefix cache with a disk tier under tmp_path/disk (a new one over the same folder is a
    restart); every tier is closed at the end."""
    tiers = []

    def make(*, hybrid=False, model=MODEL, root=None, memory=10**9, **options):
        options.setdefault("max_bytes", 10**9)
        layout = HYBRID if hybrid else DENSE
        tier = DiskTier(root or tmp_path / "disk", model, layout, block_tokens=BLOCK, **options)
        tiers.append(tier)
        return PrefixCache(max_bytes=memory, hybrid=hybrid, disk=tier)

    yield make
    for tier in tiers:
        tier.close()


def spill_all(cache: PrefixCache) -> None:
    cache.evict(cache.nbytes)
    assert cache.nbytes == 0
    assert cache.disk.flush(10)


def scope_files(cache: PrefixCache, scope: str) -> list:
    return sorted((cache.disk.folder / keys.scope_folder(scope)).glob("*" + files.SUFFIX))


@pytest.fixture
def reads(monkeypatch):
    """The paths of every entry file read."""
    seen = []
    read = files.read_entry

    def recording(path):
        seen.append(path)
        return read(path)

    monkeypatch.setattr(files, "read_entry", recording)
    return seen


def test_evicted_entries_are_read_back_token_exact(make):
    cache = make()
    prompt = list(range(100, 118))  # four blocks and an end of two tokens
    cache.insert(prompt, source_for(prompt), scope="a")
    spill_all(cache)
    assert len(scope_files(cache, "a")) == 5
    hit = cache.match([*prompt, 1], limit=19, scope="a")
    assert hit.length == 18 and read_tokens(hit) == prompt
    assert hit.kv[0][1][0, 0, :, 0].tolist() == [t + 0.5 for t in prompt]  # the values too
    # A prompt that leaves the cached one part-way through a block (or an end) uses that part.
    hit = cache.match([*prompt[:10], 5, 6], limit=12, scope="a")
    assert hit.length == 10 and read_tokens(hit) == prompt[:10]
    assert cache.match([*prompt[:17], 0], limit=18, scope="a").length == 17
    assert cache.match([100, 101, 999], limit=2, scope="a").length == 2
    assert cache.match([999, 100], limit=1, scope="a").length == 0
    stats = cache.stats()
    assert (stats.lookups, stats.hits, stats.disk_lookups, stats.disk_hits) == (5, 4, 5, 4)
    assert stats.disk_hit_tokens == stats.hit_tokens == 18 + 10 + 17 + 2
    assert (stats.disk_entries, stats.disk_spills, stats.disk_read_errors) == (5, 5, 0)
    assert stats.disk_bytes == sum(p.stat().st_size for p in scope_files(cache, "a"))


def test_memory_serves_what_it_holds_and_disk_the_rest(make, reads):
    cache = make()
    system = list(range(10, 18))  # two blocks
    turn = [*system, *range(50, 60)]
    cache.insert(turn, source_for(turn), scope="a")
    spill_all(cache)
    cache.insert(system, source_for(system, tag=0.25), scope="a")  # computed again, in memory
    hit = cache.match([*turn, 1], limit=len(turn), scope="a")
    assert hit.length == len(turn)
    keys_read = hit.kv[0][0][0, 0, :, 0].tolist()
    assert keys_read == pytest.approx([t + 0.25 for t in system] + list(range(50, 60)))
    assert len(reads) == 3  # the two blocks after memory's and the end; not memory's blocks
    stats = cache.stats()
    assert (stats.hit_tokens, stats.disk_hit_tokens) == (len(turn), len(turn) - len(system))
    # What memory holds in full is never looked up on disk.
    assert cache.match([*system, 0], limit=len(system), scope="a").length == len(system)
    assert cache.stats().disk_lookups == 1


def test_hybrid_entries_resume_only_where_a_state_was_kept(make):
    cache = make(hybrid=True)
    system = [5, 6, 7, 8, 9]
    turn = [*system, 40, 41, 42]
    cache.insert(turn, hybrid_source_for(turn), state_after(turn), scope="a")
    spill_all(cache)
    # Blocks up to the system prompt's end are on disk, but no state there: a miss.
    assert cache.match([*system, 99, 98], limit=6, scope="a").length == 0
    cache.insert(system, hybrid_source_for(system), state_after(system), scope="a")
    spill_all(cache)
    hit = cache.match([*system, 99, 98], limit=6, scope="a")
    assert hit.length == 5 and read_tokens(hit) == system
    assert float(hit.state[1][0][0]) == sum(system)
    hit = cache.match([*turn, 1], limit=8, scope="a")
    assert hit.length == 8 and read_tokens(hit) == turn and float(hit.state[1][0][0]) == sum(turn)
    # Within a limit that cuts the turn, the deepest state before it.
    assert cache.match([*turn, 1], limit=7, scope="a").length == 5
    assert cache.stats().disk_read_errors == 0


def test_a_scope_never_reads_another_scopes_files(make, reads):
    cache = make()
    secret = list(range(300, 340))
    cache.insert(secret, source_for(secret), scope="team:1")
    spill_all(cache)
    probe = [*secret, 7]
    for scope in ("team:2", "", "team:1/salt:x"):
        assert cache.match(probe, limit=40, scope=scope).length == 0
        assert cache.match(secret[:2], limit=1, scope=scope).length == 0
    assert reads == []  # not one file opened: nothing of another scope is timed either
    hit = cache.match(probe, limit=40, scope="team:1")
    assert hit.length == 40 and read_tokens(hit) == secret
    assert {path.parent.name for path in reads} == {keys.scope_folder("team:1")}
    # The same tokens computed in another scope are that scope's own files and values.
    cache.insert(secret, source_for(secret, tag=0.25), scope="team:2")
    spill_all(cache)
    names = {path.name for path in scope_files(cache, "team:2")}
    assert names and not names & {path.name for path in scope_files(cache, "team:1")}
    keys_read = cache.match(probe, limit=40, scope="team:2").kv[0][0][0, 0, :, 0].tolist()
    assert keys_read == pytest.approx([t + 0.25 for t in secret])
    assert read_tokens(cache.match(probe, limit=40, scope="team:1")) == secret


def test_a_restart_finds_what_the_last_run_kept(make):
    first = make()
    prompt = list(range(500, 523))
    first.insert(prompt, source_for(prompt), scope="a")
    first.close()  # the engine ends: what memory holds goes to disk
    assert first.stats().disk_entries == 6
    second = make()  # a new process over the same folder
    assert second.stats().disk_entries == 6 and second.nbytes == 0
    hit = second.match([*prompt, 1], limit=23, scope="a")
    assert hit.length == 23 and read_tokens(hit) == prompt
    assert second.stats().disk_hits == 1


def test_a_corrupt_file_is_a_miss_and_is_deleted(make, caplog):
    cache = make()
    prompt = list(range(100, 112))  # three blocks
    cache.insert(prompt, source_for(prompt), scope="a")
    spill_all(cache)
    third = cache.disk.store.index.get("a", keys.chain(MODEL, "a", prompt, BLOCK, 3)[3])
    data = bytearray(third.path.read_bytes())
    data[-3] ^= 0x40  # one bit of one value
    third.path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        hit = cache.match([*prompt, 1], limit=12, scope="a")
    # The blocks before it still make a hit (on a dense model), the bad one is gone.
    assert hit.length == 8 and read_tokens(hit) == prompt[:8]
    assert "checksum" in caplog.text
    assert not third.path.exists()
    stats = cache.stats()
    assert (stats.disk_read_errors, stats.disk_entries, stats.disk_hits) == (1, 2, 1)
    hit = cache.match([*prompt, 1], limit=12, scope="a")
    assert hit.length == 8 and read_tokens(hit) == prompt[:8]
    assert cache.stats().disk_read_errors == 1


def test_a_corrupt_state_is_a_miss_on_a_hybrid_model(make):
    cache = make(hybrid=True)
    prompt = list(range(100, 110))
    cache.insert(prompt, hybrid_source_for(prompt), state_after(prompt), scope="a")
    spill_all(cache)
    end = cache.disk.store.index.children("a", keys.chain(MODEL, "a", prompt, BLOCK, 2)[2])[0]
    data = bytearray(end.path.read_bytes())
    data[-1] ^= 0x01  # the state's last byte
    end.path.write_bytes(bytes(data))
    assert cache.match([*prompt, 1], limit=10, scope="a").length == 0  # no state, no hit
    assert cache.stats().disk_read_errors == 1 and not end.path.exists()


def test_a_truncated_file_is_a_miss_at_a_lookup_and_at_start(make):
    cache = make()
    prompt = list(range(100, 110))  # two blocks and an end
    cache.insert(prompt, source_for(prompt), scope="a")
    spill_all(cache)
    end, first_block = scope_files(cache, "a")[0], None
    for path in scope_files(cache, "a"):
        header, _ = files.read_header(path)
        if header.kind == "end":
            end = path
        elif header.start == 0:
            first_block = path
    end.write_bytes(end.read_bytes()[:-5])
    assert cache.match([*prompt, 1], limit=10, scope="a").length == 8  # the blocks before it
    assert not end.exists() and cache.stats().disk_read_errors == 1
    first_block.write_bytes(first_block.read_bytes()[:40])  # cut inside its header
    restarted = make()
    stats = restarted.stats()
    assert (stats.disk_read_errors, stats.disk_entries) == (1, 1)
    assert not first_block.exists()
    assert restarted.match([*prompt, 1], limit=10, scope="a").length == 0


def test_a_file_of_another_scope_or_model_is_never_read(make, tmp_path):
    cache = make()
    prompt = list(range(100, 108))
    cache.insert(prompt, source_for(prompt), scope="a")
    cache.insert(prompt, source_for(prompt, tag=0.25), scope="b")
    spill_all(cache)
    ours, theirs = scope_files(cache, "a"), scope_files(cache, "b")
    # Scope b's first block written over scope a's: same position, same tokens, not a's.
    first = {files.read_header(p)[0].start: p for p in ours}[0]
    first.write_bytes({files.read_header(p)[0].start: p for p in theirs}[0].read_bytes())
    assert cache.match([*prompt, 1], limit=8, scope="a").length == 0
    assert not first.exists() and cache.stats().disk_read_errors == 1
    # A copy of b's file beside a's (under its own name) is refused when the index is rebuilt.
    stray = first.parent / theirs[1].name
    stray.write_bytes(theirs[1].read_bytes())
    restarted = make()
    assert restarted.stats().disk_read_errors == 1 and not stray.exists()
    keys_read = restarted.match([*prompt, 1], limit=8, scope="b").kv[0][0][0, 0, :, 0].tolist()
    assert keys_read == pytest.approx([t + 0.25 for t in prompt])
    # Another model's weights (another key) under the same name: the old entries go at start.
    other = make(model="b" * 64)
    assert other.stats().disk_entries == 0
    assert other.match([*prompt, 1], limit=8, scope="b").length == 0
    assert not cache.disk.folder.exists()


def test_a_full_disk_stops_spilling_and_fails_nothing(make, monkeypatch, caplog):
    write = files._write
    calls = []

    def full(out, data):
        calls.append(1)
        if len(calls) > 1:  # the preamble goes through, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        write(out, data)

    monkeypatch.setattr(files, "_write", full)
    cache = make()
    prompt = list(range(100, 110))
    cache.insert(prompt, source_for(prompt), scope="a")
    with caplog.at_level(logging.WARNING):
        spill_all(cache)
    assert "No space left on device" in caplog.text and "spilling" in caplog.text
    stats = cache.stats()
    assert (stats.disk_spilling, stats.disk_write_errors, stats.disk_entries) == (0, 1, 0)
    assert list(cache.disk.folder.rglob("*")) == [cache.disk.folder / keys.scope_folder("a")]
    # Memory goes on as before; spilling is off, so nothing more is written or queued.
    cache.insert(prompt, source_for(prompt), scope="a")
    assert cache.match([*prompt, 1], limit=10, scope="a").length == 10
    spill_all(cache)
    assert len(calls) == 2 and cache.match([*prompt, 1], limit=10, scope="a").length == 0


def test_an_unwritable_folder_means_no_spilling_and_no_failure(make, tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING):
        cache = make(root=blocker / "disk")
    assert "spilling" in caplog.text and cache.stats().disk_spilling == 0
    prompt = list(range(100, 110))
    cache.insert(prompt, source_for(prompt), scope="a")
    spill_all(cache)
    assert cache.match([*prompt, 1], limit=10, scope="a").length == 0
    assert cache.stats().disk_write_errors == 1


def test_the_disk_budget_is_kept_and_shared_fairly_between_scopes(make):
    entry = files.PREAMBLE.size + 4 * BYTES_PER_TOKEN  # a block's payload and preamble
    cache = make(max_bytes=40 * entry)  # headers included, room for fewer than 40 blocks
    quiet = list(range(900, 908))
    cache.insert(quiet, source_for(quiet), scope="b")
    spill_all(cache)
    for index in range(60):  # team a floods the disk with one-block prompts
        prompt = [10_000 + index, 1, 2, 3]
        cache.insert(prompt, source_for(prompt), scope="a")
        spill_all(cache)
    stats = cache.stats()
    assert stats.disk_bytes <= 40 * entry and stats.disk_evictions > 0
    assert cache.match([*quiet, 0], limit=8, scope="b").length == 8  # b's few bytes stay
    assert cache.match([10_059, 1, 2, 3, 0], limit=4, scope="a").length == 4  # a's newest
    assert cache.match([10_000, 1, 2, 3, 0], limit=4, scope="a").length == 0  # a's oldest
    on_disk = sum(p.stat().st_size for p in cache.disk.folder.rglob("*" + files.SUFFIX))
    assert on_disk == cache.stats().disk_bytes


def test_clear_empties_both_tiers(make):
    cache = make()
    spilled, held = list(range(100, 110)), list(range(200, 210))
    cache.insert(spilled, source_for(spilled), scope="a")
    spill_all(cache)
    cache.insert(held, source_for(held), scope="a")
    on_disk = cache.stats().disk_bytes
    assert on_disk == sum(p.stat().st_size for p in scope_files(cache, "a")) > 0
    assert cache.clear() == 10 * BYTES_PER_TOKEN + on_disk
    assert cache.disk.flush(10)
    assert not list(cache.disk.folder.rglob("*" + files.SUFFIX))
    assert cache.match([*spilled, 1], limit=10, scope="a").length == 0
    assert cache.match([*held, 1], limit=10, scope="a").length == 0  # cleared, not spilled


def test_a_full_queue_drops_spills_instead_of_waiting(make, monkeypatch):
    release = threading.Event()
    write = files.write_entry

    def slow(folder, header, payload):
        release.wait(10)
        return write(folder, header, payload)

    monkeypatch.setattr(files, "write_entry", slow)
    cache = make(max_pending_bytes=8 * BYTES_PER_TOKEN)
    for index in range(4):  # two blocks each: the first prompt fills the queue
        prompt = list(range(1000 * index, 1000 * index + 8))
        cache.insert(prompt, source_for(prompt), scope="a")
        cache.evict(cache.nbytes)  # returns at once though the writer is stuck
    assert cache.stats().disk_spills_dropped == 6
    release.set()
    assert cache.disk.flush(10)
    stats = cache.stats()
    assert (stats.disk_spills, stats.disk_entries) == (2, 2)
    assert cache.match([0, *range(1, 8), 9], limit=8, scope="a").length == 8


def test_a_shared_prefix_outlives_its_continuations_on_disk(make):
    entry = files.PREAMBLE.size + 4 * BYTES_PER_TOKEN
    cache = make(max_bytes=20 * entry)
    system = list(range(900, 908))  # two blocks every conversation continues
    for index in range(40):
        turn = [*system, 10_000 + index, 1, 2, 3]
        cache.insert(turn, source_for(turn), scope="a")
        spill_all(cache)
    assert cache.stats().disk_evictions > 0
    # The oldest blocks on disk are the system prompt's, but the conversations go first.
    hit = cache.match([*system, 10_039, 1, 2, 3, 0], limit=12, scope="a")
    assert hit.length == 12 and read_tokens(hit) == [*system, 10_039, 1, 2, 3]
    assert cache.match([*system, 10_000, 1, 2, 3, 0], limit=12, scope="a").length == 8


def test_one_lookup_reads_at_most_its_share_of_bytes(make, reads):
    cache = make()
    prompt = list(range(100, 124))  # six blocks
    cache.insert(prompt, source_for(prompt), scope="a")
    spill_all(cache)
    sizes = [p.stat().st_size for p in scope_files(cache, "a")]  # headers differ by a few bytes
    cache.disk.max_read_bytes = 3 * max(sizes) + 8  # three blocks' files, not four
    assert cache.disk.max_read_bytes < 4 * min(sizes)
    hit = cache.match([*prompt, 1], limit=24, scope="a")
    # The rest of a long prompt is computed (in chunks, beside the other streams) instead.
    assert hit.length == 12 and read_tokens(hit) == prompt[:12] and len(reads) == 3
    # Memory's part is not read, so a lookup that memory starts goes further.
    cache.insert(prompt[:8], source_for(prompt[:8]), scope="a")
    assert cache.match([*prompt, 1], limit=24, scope="a").length == 20
