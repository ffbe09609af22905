"""Each file's metadata, in Redis: who owns it, what it is, when it goes.

    kvfleet:file:{id}          FileRecord JSON (with a TTL a little past its expiry)
    kvfleet:files:{tenant}     sorted set id -> created_at, for listing
    kvfleet:files:expiry       sorted set id -> expires_at, for the retention sweep

Redis rather than a sidecar JSON next to the bytes: every API replica reads the same
records, listing a tenant's files is one range read, and a store without a directory
(S3) needs no second kind of object.
"""

from __future__ import annotations

import secrets
from typing import Literal, Optional

import msgspec
import redis

from kvfleet.constants import Keys

Purpose = Literal["batch", "batch_output"]
#: Seconds a record outlives its expiry in Redis, so the sweep (not the TTL) removes it
#: and deletes the bytes with it.
_SWEEP_GRACE_S = 24 * 3600


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


class FileObject(msgspec.Struct, frozen=True):
    """OpenAI's file object."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: Purpose
    expires_at: Optional[int] = None
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: Optional[str] = None
    object: Literal["file"] = "file"


class FileList(msgspec.Struct, frozen=True):
    data: list[FileObject]
    has_more: bool
    first_id: Optional[str] = None
    last_id: Optional[str] = None
    object: Literal["list"] = "list"


class FileDeleted(msgspec.Struct, frozen=True):
    id: str
    deleted: bool = True
    object: Literal["file"] = "file"


class FileRecord(msgspec.Struct, frozen=True):
    """What the index keeps: the object a client sees, and what only kvfleet reads."""

    file: FileObject
    tenant: str
    lines: int = 0  # requests in a batch input file
    last_line: int = 0  # its last request's line number (blank lines count)
    endpoint: Optional[str] = None  # the one `url` every line of a batch input file names


_decode = msgspec.json.Decoder(FileRecord).decode


class FileIndex:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def add(self, record: FileRecord) -> None:
        f = record.file
        ttl = max(1, int((f.expires_at or 0) - f.created_at) + _SWEEP_GRACE_S)
        with self.client.pipeline() as pipe:
            pipe.set(self.keys.file(f.id), msgspec.json.encode(record), ex=ttl)
            pipe.zadd(self.keys.files_of(record.tenant), {f.id: f.created_at})
            if f.expires_at is not None:
                pipe.zadd(self.keys.files_expiry, {f.id: f.expires_at})
            pipe.execute()

    def get(self, file_id: str, tenant: str) -> Optional[FileRecord]:
        """The record, or None when there is none *for this tenant*: another tenant's
        file answers exactly like a missing one."""
        raw = self.client.get(self.keys.file(file_id))
        record = _decode(raw) if raw else None
        return record if record is not None and record.tenant == tenant else None

    def remove(self, record: FileRecord) -> None:
        with self.client.pipeline() as pipe:
            pipe.delete(self.keys.file(record.file.id))
            pipe.zrem(self.keys.files_of(record.tenant), record.file.id)
            pipe.zrem(self.keys.files_expiry, record.file.id)
            pipe.execute()

    def page(self, tenant: str, *, limit: int, after: Optional[str], newest_first: bool,
             purpose: Optional[str] = None) -> tuple[list[FileObject], bool]:
        """One page of the tenant's files, after the id `after`; (files, more after them)."""
        ids = [i.decode() for i in (self.client.zrevrange if newest_first else self.client.zrange)(
            self.keys.files_of(tenant), 0, -1)]
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        out: list[FileObject] = []
        for start in range(0, len(ids), 100):
            chunk = ids[start:start + 100]
            for file_id, raw in zip(chunk, self.client.mget([self.keys.file(i) for i in chunk])):
                if raw is None:
                    self.client.zrem(self.keys.files_of(tenant), file_id)  # expired under us
                    continue
                record = _decode(raw)
                if purpose is None or record.file.purpose == purpose:
                    out.append(record.file)
                if len(out) > limit:
                    return out[:limit], True
        return out, False

    def expired(self, now: float, *, limit: int = 100) -> list[str]:
        return [i.decode() for i in self.client.zrangebyscore(self.keys.files_expiry, 0, now, start=0, num=limit)]

    def raw(self, file_id: str) -> Optional[FileRecord]:
        """Whoever owns it (the retention sweep)."""
        raw = self.client.get(self.keys.file(file_id))
        return _decode(raw) if raw else None
