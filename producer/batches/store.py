"""Batches in Redis: one hash per batch, an index per tenant, the set of active ones.

    kvfleet:batch:{id}            spec (BatchSpec JSON), status, <status>_at, completed,
                                  failed, cursor_offset, cursor_line, output_file_id,
                                  error_file_id, errors, ending
    kvfleet:batch:{id}:errors     line -> LineFailure JSON: lines the fleet refused for good
    kvfleet:batches:{tenant}      sorted set id -> created_at
    kvfleet:batches:active        set of ids not in a final state (what drivers look for)

Every status change is one Lua call that checks the current status first (`MOVES`), so
a cancel racing the driver's own move (to finalizing) leaves exactly one of them done.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import msgspec
import redis

from kvfleet import constants
from kvfleet.constants import Keys
from producer.batches.model import (
    MOVES, Batch, BatchErrors, BatchSpec, BatchStatus, RequestCounts,
)

# KEYS: batch, active set. ARGV: to, allowed-from (comma-joined), now, ttl (0 = keep),
# batch id, then field, value...
_MOVE = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return {0, ''} end
if not string.find(',' .. ARGV[2] .. ',', ',' .. cur .. ',', 1, true) then return {0, cur} end
redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[1] .. '_at', ARGV[3])
for i = 6, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if tonumber(ARGV[4]) > 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('SREM', KEYS[2], ARGV[5])
end
return {1, cur}
"""

_TIMESTAMPS = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")
_decode_spec = msgspec.json.Decoder(BatchSpec).decode
_decode_errors = msgspec.json.Decoder(BatchErrors).decode


class LineFailure(msgspec.Struct, frozen=True):
    """A line that never became a job (refused for good at submission): its error line."""

    status_code: int
    body: dict[str, Any]


class BatchState(msgspec.Struct, frozen=True):
    """A batch as stored: its spec and everything that moves."""

    spec: BatchSpec
    status: BatchStatus
    fields: dict[str, str]

    @property
    def cursor(self) -> tuple[int, int]:
        """(byte offset, line number) up to which every line has been submitted."""
        return int(self.fields.get("cursor_offset", 0)), int(self.fields.get("cursor_line", 0))

    @property
    def ending(self) -> Optional[BatchStatus]:
        """Set on entering finalizing: completed, or expired."""
        raw = self.fields.get("ending")
        return BatchStatus(raw) if raw else None

    def batch(self) -> Batch:
        f, s = self.fields, self.spec
        stamps = {f"{name}_at": int(float(f[f"{name}_at"])) for name in _TIMESTAMPS if f"{name}_at" in f}
        return Batch(
            id=s.id, endpoint=s.endpoint, input_file_id=s.input_file_id, completion_window=s.completion_window,
            status=self.status, created_at=s.created_at, expires_at=s.expires_at, model=s.model,
            metadata=s.metadata,
            request_counts=RequestCounts(total=s.total, completed=int(f.get("completed", 0)),
                                         failed=int(f.get("failed", 0))),
            errors=_decode_errors(f["errors"]) if "errors" in f else None,
            output_file_id=f.get("output_file_id") or None, error_file_id=f.get("error_file_id") or None,
            **stamps)


def _state(fields: Mapping[bytes, bytes]) -> Optional[BatchState]:
    if not fields:
        return None
    f = {k.decode(): v.decode() for k, v in fields.items()}
    return BatchState(spec=_decode_spec(f.pop("spec")), status=BatchStatus(f.pop("status")), fields=f)


class BatchStore:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._move = client.register_script(_MOVE)

    def create(self, spec: BatchSpec) -> None:
        with self.client.pipeline() as pipe:
            pipe.hset(self.keys.batch(spec.id), mapping={"spec": msgspec.json.encode(spec),
                                                         "status": BatchStatus.VALIDATING.value})
            pipe.zadd(self.keys.batches_of(spec.tenant), {spec.id: spec.created_at})
            pipe.sadd(self.keys.batches_active, spec.id)
            pipe.execute()

    def load(self, batch_id: str) -> Optional[BatchState]:
        return _state(self.client.hgetall(self.keys.batch(batch_id)))

    def get(self, batch_id: str, tenant: str) -> Optional[BatchState]:
        """None when there is no such batch *for this tenant* (another's answers the same)."""
        state = self.load(batch_id)
        return state if state is not None and state.spec.tenant == tenant else None

    def move(self, batch_id: str, to: BatchStatus, *, now: float, **fields: Any) -> Optional[BatchStatus]:
        """Move to `to` if the current status allows it, setting `fields` with it; the
        status it had (None: not moved)."""
        args: list[Any] = [to.value, ",".join(s.value for s in MOVES[to]), repr(now),
                           constants.BATCH_TTL_S if to.final else 0, batch_id]
        for name, value in fields.items():
            args += [name, value if isinstance(value, (str, bytes)) else str(value)]
        ok, previous = self._move(keys=[self.keys.batch(batch_id), self.keys.batches_active], args=args)
        return BatchStatus(previous.decode()) if ok else None

    def progress(self, batch_id: str, **fields: Any) -> None:
        """Counts and the cursor: written as the batch goes, read back on a takeover."""
        self.client.hset(self.keys.batch(batch_id), mapping={k: str(v) for k, v in fields.items()})

    def fail_line(self, batch_id: str, line: int, failure: LineFailure) -> None:
        self.client.hset(self.keys.batch_errors(batch_id), str(line), msgspec.json.encode(failure))

    def line_failures(self, batch_id: str) -> dict[int, LineFailure]:
        raw = self.client.hgetall(self.keys.batch_errors(batch_id))
        return {int(k): msgspec.json.decode(v, type=LineFailure) for k, v in raw.items()}

    def expire_failures(self, batch_id: str) -> None:
        self.client.expire(self.keys.batch_errors(batch_id), constants.BATCH_TTL_S)

    def active(self) -> list[str]:
        return sorted(i.decode() for i in self.client.smembers(self.keys.batches_active))

    def forget(self, batch_id: str) -> None:
        """Drop a batch id whose record is gone from the active set."""
        self.client.srem(self.keys.batches_active, batch_id)

    def page(self, tenant: str, *, limit: int, after: Optional[str]) -> tuple[list[Batch], bool]:
        """Newest first, after the id `after`; (batches, more after them)."""
        ids = [i.decode() for i in self.client.zrevrange(self.keys.batches_of(tenant), 0, -1)]
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        out: list[Batch] = []
        for batch_id in ids:
            state = self.load(batch_id)
            if state is None:
                self.client.zrem(self.keys.batches_of(tenant), batch_id)  # expired record
                continue
            out.append(state.batch())
            if len(out) > limit:
                return out[:limit], True
        return out, False
