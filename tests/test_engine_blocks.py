"""The block pool's bookkeeping on its own: hashing, sharing, LRU eviction, collisions."""

from __future__ import annotations

import subprocess
import sys

from kvfleet.contracts import Sampling
from workers.engine import block_manager as bm_module
from workers.engine.block_manager import BlockManager, block_hash
from workers.engine.hooks import MissingBlock
from workers.engine.sequence import Sequence

BS = 4


def seq(tokens: list[int], rid: str = "s") -> Sequence:
    return Sequence(rid, tokens, 8, Sampling(), priority_rank=1, stop=(), ignore_eos=False, arrival_order=0)


def computed(manager: BlockManager, s: Sequence) -> Sequence:
    """As if a step computed all of `s`'s uncomputed tokens."""
    n = s.num_uncomputed_tokens
    s.num_computed_tokens += n
    manager.cache_computed_blocks(s, n)
    return s


def test_block_hash_is_stable_across_processes():
    here = block_hash("00" * 16, [1, 2, 70000], "fp")
    code = "from workers.engine.block_manager import block_hash; print(block_hash('00' * 16, [1, 2, 70000], 'fp'))"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert here == there
    assert block_hash(None, [1, 2], "fp") != block_hash(None, [1, 2], "other-model")
    assert block_hash(None, [1, 2], "fp") != block_hash(here, [1, 2], "fp")


def test_equal_prefixes_share_computed_blocks_only():
    manager = BlockManager(16, BS, "fp")
    a = seq(list(range(10)), "a")
    manager.allocate(a)
    b = seq(list(range(10)), "b")
    manager.allocate(b)
    assert b.num_computed_tokens == 0  # a's blocks are not computed yet: nothing to share
    computed(manager, a)
    c = seq(list(range(9)) + [99], "c")
    manager.allocate(c)
    assert c.num_computed_tokens == 8 and c.block_table[:2] == a.block_table[:2]
    assert manager.blocks[a.block_table[0]].ref_count == 2
    d = seq(list(range(8)), "d")  # fully cached: the last block is recomputed for its logits
    manager.allocate(d)
    assert d.num_computed_tokens == 4 and d.block_table[0] == a.block_table[0] != d.block_table[1]


def test_hash_collision_never_serves_other_tokens(monkeypatch):
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, tokens, fp: "ab" * 16)  # every block collides
    manager = BlockManager(16, BS, "fp")
    computed(manager, _allocated(manager, seq([1, 2, 3, 4, 5])))
    other = _allocated(manager, seq([9, 9, 9, 9, 5]))
    assert other.num_computed_tokens == 0


def test_free_cached_blocks_are_evicted_least_recent_first_with_the_hook():
    evicted: list[tuple] = []

    class Recorder:
        def on_evict(self, h, tokens, parent, block_id):
            evicted.append((h, tokens, parent, block_id))

        def on_admit(self, missing: list[MissingBlock]) -> int:
            return 0

    manager = BlockManager(4, BS, "fp", Recorder())
    a = computed(manager, _allocated(manager, seq([1, 2, 3, 4, 5, 6, 7, 8, 9])))  # 2 full blocks + 1
    manager.deallocate(a)
    assert manager.num_free_blocks == 4
    b = _allocated(manager, seq([7] * 13))  # 4 blocks: takes the empty one, then evicts a's tail first
    assert [e[1] for e in evicted] == [(5, 6, 7, 8), (1, 2, 3, 4)]
    assert evicted[0][2] == evicted[1][0] and evicted[1][2] is None  # the chain: parent hashes
    assert sorted(b.block_table) == [0, 1, 2, 3] and manager.hash_to_block == {}


class Lender:
    """Hooks that keep every evicted block (a spill sent from the pool) until told."""

    def __init__(self, lend_ahead: int = 0, reclaim_answers: list[bool] | None = None) -> None:
        self.lend_ahead = lend_ahead
        self.lent: list[int] = []
        self.reclaimed: list[int] = []
        self.reclaim_answers = reclaim_answers or []
        self.manager: BlockManager | None = None

    def on_evict(self, h, tokens, parent, block_id) -> bool:
        self.lent.append(block_id)
        return True

    def reclaim(self, block_id: int) -> bool:
        self.reclaimed.append(block_id)
        if self.reclaim_answers and not self.reclaim_answers.pop(0):
            self.manager.give_back(block_id)  # it was being given back as the pool asked
            return False
        return True

    def on_admit(self, missing: list[MissingBlock]) -> int:
        return 0


def _pool_of_freed_blocks(hooks: Lender, num_blocks: int, cached: int) -> tuple[BlockManager, list[int]]:
    """A pool whose first `cached` blocks hold a freed prompt, the rest taken by another."""
    manager = BlockManager(num_blocks, BS, "fp", hooks)
    hooks.manager = manager
    a = computed(manager, _allocated(manager, seq(list(range(1, 4 * cached + 1)), "a")))
    blocks = list(a.block_table)
    manager.deallocate(a)
    _allocated(manager, seq([7] * 4 * (num_blocks - cached), "b"))
    assert manager.num_free_blocks == cached and not manager.free_unhashed
    return manager, blocks


def test_with_nothing_else_free_an_evicted_block_lent_to_a_spill_is_taken_back_at_once():
    hooks = Lender()
    manager, (head, tail) = _pool_of_freed_blocks(hooks, 4, cached=2)
    c = _allocated(manager, seq([5] * 4, "c"))
    assert hooks.lent == [tail] and hooks.reclaimed == [tail] and c.block_table == [tail]
    assert not manager.lent and list(manager.free_hashed) == [head]  # only what was needed was evicted


def test_blocks_lent_ahead_of_need_are_reused_once_given_back_without_a_reclaim():
    hooks = Lender(lend_ahead=2)
    manager, blocks = _pool_of_freed_blocks(hooks, 16, cached=4)  # an eighth of 16: 2 may be lent ahead
    c = _allocated(manager, seq([5] * 4, "c"))  # the tail is lent and taken back; two more lent ahead
    assert c.block_table == [blocks[3]] and hooks.reclaimed == [blocks[3]]
    assert list(manager.lent) == [blocks[2], blocks[1]] and manager.num_free_blocks == 3  # loans count as free
    manager.give_back(blocks[2])  # written: the next taker gets it, and one more is lent ahead
    d = _allocated(manager, seq([6] * 4, "d"))
    assert d.block_table == [blocks[2]] and hooks.reclaimed == [blocks[3]]
    assert list(manager.lent) == [blocks[1], blocks[0]] and not manager.free_hashed


def test_a_reclaim_that_finds_its_block_given_back_takes_it_from_the_returns():
    hooks = Lender(reclaim_answers=[False])
    manager, cached = _pool_of_freed_blocks(hooks, 3, cached=1)
    c = _allocated(manager, seq([5] * 4, "c"))
    assert hooks.lent == cached and hooks.reclaimed == cached
    assert c.block_table == cached and not manager.lent and manager.num_free_blocks == 0


def test_admission_hook_fills_leading_missing_blocks():
    seen: list[list[MissingBlock]] = []

    class Tier:
        def on_evict(self, *args):
            pass

        def on_admit(self, missing: list[MissingBlock]) -> int:
            seen.append(list(missing))
            return 2

    manager = BlockManager(8, BS, "fp", Tier())
    s = _allocated(manager, seq(list(range(14))))
    assert [m.token_ids for m in seen[0]] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert [m.block_id for m in seen[0]] == s.block_table[:3]
    assert s.num_computed_tokens == 8 and manager.outside_hits == 2
    again = _allocated(manager, seq(list(range(9)) + [50], "again"))  # the filled blocks are now shared
    assert again.block_table[:2] == s.block_table[:2]


def _allocated(manager: BlockManager, s: Sequence) -> Sequence:
    assert manager.can_allocate(s)
    manager.allocate(s)
    return s


def test_cache_namespaces_share_no_blocks():
    # Equal prompts under two salts (two tenants' namespaces) hash apart: the second
    # finds nothing cached; the same salt finds the whole prefix.
    manager = BlockManager(num_blocks=16, block_size=BS, fingerprint="fp")
    tokens = list(range(1, 13))  # three full blocks
    salt_a, salt_b = "aa" * 16, "bb" * 16

    def run(rid: str, salt: str | None) -> int:
        s = Sequence(rid, tokens, 8, Sampling(), priority_rank=1, stop=(), ignore_eos=False, arrival_order=0,
                     cache_salt=salt)
        manager.allocate(s)
        cached = s.num_computed_tokens
        computed(manager, s)
        manager.deallocate(s)
        return cached

    assert run("a1", salt_a) == 0
    assert run("b1", salt_b) == 0  # another namespace: no hit, so no timing or cached_tokens signal
    assert run("a2", salt_a) == 2 * BS  # its own: all but the last block (always recomputed)
    assert run("none", None) == 0
    assert manager.prefix_hashes(tokens, salt_a) != manager.prefix_hashes(tokens, salt_b)
    assert manager.prefix_hashes(tokens, salt_a)[:2] == [manager.blocks[b].hash for b in
                                                         manager.cached_block_ids(manager.prefix_hashes(tokens, salt_a))]


def test_reserved_blocks_filled_from_outside_are_adopted_as_cached_and_held_until_released():
    manager = BlockManager(8, BS, "fp")
    prompt = list(range(13))  # 3 full blocks before the last token
    hashes = manager.prefix_hashes(prompt)
    ids = manager.reserve(3)
    assert len(ids) == 3 and manager.num_free_blocks == 5
    assert manager.reserve(100) and manager.num_free_blocks == 0  # never more than the pool has free
    manager.release([b for b in range(8) if b not in ids])
    # Blocks 0 and 1 came in valid; block 2 did not, and is freed unpublished.
    manager.adopt([(ids[j], hashes[j], hashes[j - 1] if j else None, tuple(prompt[j * BS:(j + 1) * BS]))
                   for j in range(2)])
    manager.release(ids[2:])
    s = seq(prompt)
    assert manager.can_allocate(s)
    manager.allocate(s)
    assert s.block_table[:2] == ids[:2] and s.num_computed_tokens == 2 * BS  # found cached
    assert manager.blocks[ids[0]].ref_count == 2  # still held by the loader too
    manager.release(ids[:2])  # the loader lets go once the job is admitted
    manager.deallocate(s)
    assert manager.num_free_blocks == 8 and set(manager.free_hashed) >= set(ids[:2])  # cached for the next one
