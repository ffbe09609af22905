"""The paged KV block pool's bookkeeping: which block holds which tokens, who shares it.

A full block is named by a chained hash of (parent block's hash, its tokens, model
fingerprint), so equal prefixes get equal hash chains in every process of the fleet and
for no other model. A sequence's chain starts from its `cache_salt` (its tenant's cache
namespace, kvfleet/tenancy.py), so equal prompts of two namespaces share no block: no
tenant can learn from a cache hit what another sent. A block's hash is registered only after its K/V were computed (a
chunked prefill fills a block over several steps; sharing it earlier would serve
unwritten slots). Blocks are ref-counted; when the last holder lets go, a hashed block
stays in the pool as a free cache entry until it is reused, least recently freed first.
An evicted block the hooks are still reading (a spill sent straight from the pool) is
on loan: free, but reused only once the hooks give it back, or taken back at once
(`reclaim`) when nothing else is free. Hooks that lend ask for `lend_ahead` blocks to be
evicted before they are needed, so that given-back ones are there when they are.

This module holds no tensors: block ids index the pool the model runner owns.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence as Seq

from workers.engine.hooks import BlockHooks, MissingBlock, NoBlockHooks
from workers.engine.sequence import Sequence


def block_hash(parent_hash: str | None, token_ids: Seq[int], fingerprint: str) -> str:
    """32 hex chars; stable across processes and machines (fixed little-endian layout)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(fingerprint.encode())
    h.update(b"\0" if parent_hash is None else bytes.fromhex(parent_hash))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.hexdigest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: str | None = None  # set once its K/V are computed and it is full
    parent_hash: str | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, fingerprint: str, hooks: BlockHooks | None = None) -> None:
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.hooks = hooks or NoBlockHooks()
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[str, int] = {}
        # Free blocks without a hash are reused first, so cached ones live as long as possible.
        self.free_unhashed: deque[int] = deque(range(num_blocks))
        self.free_hashed: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        # Evicted blocks the hooks still read, oldest first, and those they gave back
        # since (from their own threads: a deque's append is atomic; the step thread
        # moves them to free_unhashed before it takes a block).
        self.lent: OrderedDict[int, None] = OrderedDict()
        self._given_back: deque[int] = deque()
        self.cache_queries = 0  # full prompt blocks looked up
        self.cache_hits = 0  # ... found in the pool
        self.outside_hits = 0  # ... filled by hooks.on_admit

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_unhashed) + len(self.free_hashed) + len(self.lent)

    # --- admission -------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        # Cached blocks someone else holds cost nothing; free cached ones leave the free list.
        shared = sum(1 for b in self._cached_prefix(seq) if self.blocks[b].ref_count > 0)
        return seq.num_blocks(self.block_size) - shared <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all of `seq`'s tokens; sets `num_computed_tokens` to what is cached."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        hashes = self._hashes(seq)
        cached = self._cached_prefix(seq)
        # Appended one by one, so that if a hook raises, `deallocate(seq)` returns all taken.
        for bid in cached:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free_hashed[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
        while len(seq.block_table) < seq.num_blocks(self.block_size):
            seq.block_table.append(self._take_free())

        lookup_limit = self._lookup_limit(seq)
        missing = [
            MissingBlock(hashes[i], hashes[i - 1] if i else seq.cache_salt,
                         tuple(seq.block_tokens(i, self.block_size)), seq.block_table[i])
            for i in range(len(cached), lookup_limit)
        ]
        filled = self.hooks.on_admit(missing) if missing else 0
        if not 0 <= filled <= len(missing):
            raise ValueError(f"on_admit returned {filled} for {len(missing)} missing blocks")
        for m in missing[:filled]:
            self._register(m.block_id, m.block_hash, m.parent_hash, m.token_ids)
        self.cache_queries += lookup_limit
        self.cache_hits += len(cached)
        self.outside_hits += filled
        seq.num_computed_tokens = (len(cached) + filled) * self.block_size

    def deallocate(self, seq: Sequence) -> None:
        self.release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    # --- growth ----------------------------------------------------------------

    def can_append(self, seq: Sequence) -> bool:
        return seq.num_blocks(self.block_size) - len(seq.block_table) <= self.num_free_blocks

    def may_append(self, seq: Sequence, num_lookahead: int = 0) -> None:
        """A block for the token about to be computed, when the last one is full, and
        for `num_lookahead` positions after it (speculative drafts)."""
        needed = (seq.num_tokens + num_lookahead + self.block_size - 1) // self.block_size
        while len(seq.block_table) < needed:
            seq.block_table.append(self._take_free())

    # --- speculation (workers/engine/spec.py) ------------------------------------

    def num_lookahead_slots(self, seq: Sequence) -> int:
        """Positions after `seq`'s tokens that drafts may take without evicting a cached
        block: the rest of its last block and the empty blocks. A draft is a guess, most
        often rolled back a step later; a prefix another request may need is worth more."""
        spare = len(seq.block_table) * self.block_size - seq.num_tokens
        return max(spare, 0) + len(self.free_unhashed) * self.block_size

    def rollback(self, seq: Sequence) -> None:
        """After a step whose rejected drafts took slots past `seq`'s tokens: free the
        blocks that held only those. Their slots were never published (a block's hash is
        registered only once its tokens are computed and kept) and are overwritten before
        they are read (attention stops at the context length), so nothing else is undone."""
        keep = seq.num_blocks(self.block_size)
        while len(seq.block_table) > keep:
            bid = seq.block_table.pop()
            block = self.blocks[bid]
            assert block.ref_count == 1 and block.hash is None, f"block {bid} of rejected drafts is shared"
            block.ref_count = 0
            self.free_unhashed.appendleft(bid)  # back where `_take_free` took it from

    def cache_computed_blocks(self, seq: Sequence, num_new_tokens: int) -> None:
        """After a step computed `num_new_tokens` of `seq`: publish the blocks it filled."""
        hashes = self._hashes(seq)
        first = (seq.num_computed_tokens - num_new_tokens) // self.block_size
        for i in range(first, seq.num_computed_tokens // self.block_size):
            if self.blocks[seq.block_table[i]].hash is None:
                self._register(seq.block_table[i], hashes[i], hashes[i - 1] if i else seq.cache_salt,
                               tuple(seq.block_tokens(i, self.block_size)))

    # --- blocks filled from outside, off the step thread (workers/prefix.py) -------

    def reserve(self, n: int) -> list[int]:
        """Up to `n` free blocks, held (ref 1) by the caller and in no sequence's table:
        nothing reads or writes them until they are adopted or released, so another
        thread may fill them (ColdTier.fetch_into). Fewer than `n` when the pool has
        fewer free; taking a cached block evicts it (the hooks spill it), as any
        allocation does."""
        return [self._take_free() for _ in range(min(n, self.num_free_blocks))]

    def adopt(self, filled: Seq[tuple[int, str, str | None, tuple[int, ...]]]) -> None:
        """Publish reserved blocks that now hold the K/V of (block_id, hash, parent hash,
        tokens): admission finds them cached, as if computed here. They stay held until
        `release`d. A hash computed here meanwhile keeps its first copy (the adopted
        block is then just a held unhashed block)."""
        for bid, h, parent, token_ids in filled:
            self._register(bid, h, parent, token_ids)

    def release(self, block_ids: Seq[int]) -> None:
        """Let go of held blocks (reserved ones, or a sequence's): a published one stays
        in the pool as a free cache entry, one never published is free at once."""
        # Tail first: the end of a prefix is then evicted before its beginning, which
        # every longer prefix needs.
        for bid in reversed(block_ids):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self.free_unhashed.append(bid)
                else:
                    self.free_hashed[bid] = None

    # --- lookups for the shared-prefix step (workers/prefix.py) ------------------

    def prefix_hashes(self, prompt_tokens: Seq[int], cache_salt: str | None = None) -> list[str]:
        """Chained hashes of the prompt's full blocks that a cache could serve (all but
        the block holding the last token, whose logits are always computed), from the
        namespace root `cache_salt`.

        Any thread: reads only block_size and fingerprint, fixed at construction.
        """
        bs = self.block_size
        hashes: list[str] = []
        for i in range((len(prompt_tokens) - 1) // bs):
            hashes.append(block_hash(hashes[-1] if hashes else cache_salt, prompt_tokens[i * bs:(i + 1) * bs],
                                     self.fingerprint))
        return hashes

    def cached_block_ids(self, hashes: Seq[str]) -> list[int]:
        """Pool block ids of the leading run of `hashes` that the pool holds.

        Exact on the step thread (in `Engine.call_soon`). From another thread it is a
        hint that may be stale by the time it returns, but never a failure or a torn
        read: it only calls `dict.get` on `hash_to_block` while the step thread adds and
        removes entries, and each such call is atomic in CPython (the GIL; free-threaded
        builds lock each dict). Do not iterate the pool's dicts from another thread.
        """
        found: list[int] = []
        for h in hashes:
            bid = self.hash_to_block.get(h)
            if bid is None:
                break
            found.append(bid)
        return found

    # --- internals -------------------------------------------------------------

    def _hashes(self, seq: Sequence) -> list[str]:
        """Hashes of all of `seq`'s full blocks, extending the ones already computed."""
        while len(seq.block_hashes) < seq.num_tokens // self.block_size:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else seq.cache_salt
            seq.block_hashes.append(block_hash(parent, seq.block_tokens(i, self.block_size), self.fingerprint))
        return seq.block_hashes

    def _lookup_limit(self, seq: Sequence) -> int:
        # The last token is always computed, since its logits give the next token: a
        # fully cached sequence recomputes its last block.
        return (seq.num_tokens - 1) // self.block_size

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Pool block ids of the leading run of `seq`'s full blocks already computed."""
        hashes = self._hashes(seq)
        found: list[int] = []
        for i in range(self._lookup_limit(seq)):
            bid = self.hash_to_block.get(hashes[i])
            if bid is None:
                break
            block = self.blocks[bid]
            # Compare what the hash stands for, so a collision never serves another prefix's K/V.
            if block.token_ids != tuple(seq.block_tokens(i, self.block_size)) or \
                    block.parent_hash != (hashes[i - 1] if i else seq.cache_salt):
                break
            found.append(bid)
        return found

    def _register(self, bid: int, h: str, parent: str | None, token_ids: tuple[int, ...]) -> None:
        if h in self.hash_to_block:
            return  # computed twice (two equal prompts admitted together): keep the first copy
        block = self.blocks[bid]
        block.hash, block.parent_hash, block.token_ids = h, parent, token_ids
        self.hash_to_block[h] = bid

    def give_back(self, block_id: int) -> None:
        """The hooks are done reading a block they kept after `on_evict`; any thread."""
        self._given_back.append(block_id)

    def _take_free(self) -> int:
        self._collect_given_back()
        if not self.free_unhashed:
            if self.free_hashed:
                self._evict_least_recent()
            if not self.free_unhashed:  # it went on loan, or only loans were left
                self._reclaim_oldest_loan()
        bid = self.free_unhashed.popleft()
        self.blocks[bid].ref_count = 1
        self._lend_ahead()
        return bid

    def _evict_least_recent(self) -> None:
        bid = next(iter(self.free_hashed))  # least recently freed
        block = self.blocks[bid]
        kept = self.hooks.on_evict(block.hash, block.token_ids, block.parent_hash, bid)
        del self.free_hashed[bid]  # only now: a raising hook leaves the block where it was
        del self.hash_to_block[block.hash]
        block.hash, block.parent_hash, block.token_ids = None, None, ()
        if kept:
            self.lent[bid] = None
        else:
            self.free_unhashed.append(bid)

    def _reclaim_oldest_loan(self) -> None:
        """The only way the step thread waits on a spill: when no other block is free,
        and only if the loan's write is under way (a queued one is copied out instead)."""
        bid = next(iter(self.lent))
        if self.hooks.reclaim(bid):
            del self.lent[bid]
            self.free_unhashed.append(bid)
        else:
            self._collect_given_back()  # it was being given back meanwhile: it is there by now

    def _lend_ahead(self) -> None:
        """Keep the hooks' `lend_ahead` blocks (at most an eighth of the pool) free or
        on their way back, by evicting the least recently used ahead of need: a block
        lent only when it is needed would have to be taken back (copied) at once."""
        want = min(getattr(self.hooks, "lend_ahead", 0), len(self.blocks) // 8)  # a small pool keeps its cache
        while self.free_hashed and len(self.free_unhashed) + len(self.lent) < want:
            self._evict_least_recent()

    def _collect_given_back(self) -> None:
        while self._given_back:
            bid = self._given_back.popleft()
            del self.lent[bid]
            self.free_unhashed.append(bid)
