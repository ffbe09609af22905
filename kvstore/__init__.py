"""Redis-backed caching for kvfleet: a lease, a stampede-safe value cache, and the KV
cold tier behind the engine's paged block pool. See docs/kvstore.md.

Modules, from the bottom up (each imports only those above it):

    lock         Lease: SET NX PX + owner token, renewed, compare-and-delete
    expiry       jitter, logical vs physical TTL, XFetch
    singleflight SingleFlight, Entry, NO_VALUE: one builder, others serve stale or wait
    envelope     the value cache's stored format
    cache        Cache: values in Redis behind SingleFlight
    blob         KVLayout, BlobCodec: the KV block format, validated on read
    buffers      BufferPool: reused wire buffers (a fresh 2 MiB one costs ~1 ms)
    spill        SpillQueue: bounded background writer, batched, drops when full
    coldtier     ColdTier: spill evicted blocks, load prefixes, build a prefix once
    hooks        ColdTierHooks: the cold tier as the engine's on_evict / on_admit

Importing the package does not import torch; `blob`, `coldtier` and `hooks` do.
"""
