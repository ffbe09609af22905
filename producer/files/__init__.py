"""OpenAI's Files API: uploaded and generated JSONL files, owned by a tenant.

    store      FileStore: the bytes (a directory by default; an S3-compatible one plugs in)
    index      FileIndex: each file's metadata in Redis, listed per tenant, swept when expired
    upload     a multipart upload streamed to the store, never held in memory
    lines      a batch input line -> a kvfleet job, or an error naming the line
"""
