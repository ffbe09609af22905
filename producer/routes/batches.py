"""OpenAI's Batch API: a file of requests run as ordinary jobs on the fleet.

    POST /v1/batches              {input_file_id, endpoint, completion_window, metadata}
    GET  /v1/batches              ?limit=&after= -> list, newest first
    GET  /v1/batches/{id}         -> the batch (status, request_counts, file ids)
    POST /v1/batches/{id}/cancel  -> the batch, cancelling (then cancelled)

Creating a batch only records it (validating); a driver in one of the API processes
runs it (producer/batches/driver.py). Batches belong to the tenant that created them;
another tenant's answers 404, like a missing one.
"""

from __future__ import annotations

import time
from typing import Optional

import anyio
import msgspec
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from producer.batches.components import batching
from producer.batches.model import Batch, BatchList, BatchSpec, BatchStatus, CreateBatch, new_batch_id, window_seconds
from producer.batches.store import BatchState
from producer.context import context
from producer.errors import BadRequest, Conflict, NotFound
from producer.files.lines import ENDPOINTS
from producer.openapi import body, error_response, response

router = APIRouter()

_ERRORS = {401: error_response("Missing or unknown API key"),
           403: error_response("The key's tenant differs from X-Tenant-ID, or the tenant is not configured")}
_NOT_FOUND = {404: error_response("No such batch for this tenant")}
#: OpenAI's limits on metadata: 16 pairs, keys of 64 and values of 512 characters.
MAX_METADATA, MAX_KEY, MAX_VALUE = 16, 64, 512


@router.post("/v1/batches", openapi_extra=body(CreateBatch),
             responses={200: response(Batch, "The batch, validating"),
                        400: error_response("Bad input file, endpoint, window or metadata: `error.message` "
                                            "says what to fix"), **_ERRORS})
async def create_batch(request: Request) -> Response:
    ctx, parts = context(request), batching(request)
    tenant = ctx.tenant(request.headers)
    try:
        create = msgspec.json.decode(await request.body(), type=CreateBatch)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"invalid batch: {exc}", status=400) from None
    if create.endpoint not in ENDPOINTS:
        raise BadRequest(f"`endpoint` {create.endpoint!r} is not served in batches; use one of "
                         f"{', '.join(ENDPOINTS)}", param="endpoint", status=400)
    window = window_seconds(create.completion_window)
    limits = ctx.settings.batch
    if window is None or not limits.min_window_s <= window <= limits.max_window_s:
        raise BadRequest(f"`completion_window` {create.completion_window!r} must be a duration such as \"24h\", "
                         f"between {limits.min_window_s:g} s and {limits.max_window_s:g} s",
                         param="completion_window", status=400)
    _check_metadata(create.metadata)
    record = await anyio.to_thread.run_sync(parts.index.get, create.input_file_id, tenant.name)
    if record is None:
        raise BadRequest(f"no file {create.input_file_id!r} for tenant {tenant.name!r}: upload it with "
                         "POST /v1/files (purpose=batch) first", param="input_file_id", status=400)
    if record.file.purpose != "batch":
        raise BadRequest(f"file {create.input_file_id!r} has purpose {record.file.purpose!r}; a batch runs a "
                         "file uploaded with purpose=batch", param="input_file_id", status=400)
    if record.endpoint != create.endpoint:
        raise BadRequest(f"the file's lines call {record.endpoint} but `endpoint` is {create.endpoint}: make "
                         "them match", param="endpoint", status=400)
    now = int(time.time())
    spec = BatchSpec(id=new_batch_id(), tenant=tenant.name, input_file_id=create.input_file_id,
                     endpoint=create.endpoint, completion_window=create.completion_window, created_at=now,
                     expires_at=now + int(window), total=record.lines, last_line=record.last_line,
                     model=ctx.model.name, metadata=create.metadata)
    await anyio.to_thread.run_sync(parts.batches.create, spec)
    return await _answer(request, spec.id)


@router.get("/v1/batches", responses={200: response(BatchList, "The tenant's batches, newest first"), **_ERRORS})
async def list_batches(request: Request, limit: int = Query(20, ge=1, le=100), after: Optional[str] = None,
                       ) -> Response:
    ctx, parts = context(request), batching(request)
    tenant = ctx.tenant(request.headers)
    data, more = await anyio.to_thread.run_sync(lambda: parts.batches.page(tenant.name, limit=limit, after=after))
    return _json(BatchList(data=data, has_more=more, first_id=data[0].id if data else None,
                           last_id=data[-1].id if data else None))


@router.get("/v1/batches/{batch_id}", responses={200: response(Batch, "The batch"), **_NOT_FOUND, **_ERRORS})
async def get_batch(batch_id: str, request: Request) -> Response:
    return await _answer(request, batch_id)


@router.post("/v1/batches/{batch_id}/cancel",
             responses={200: response(Batch, "The batch, cancelling: what has not run is stopped, what has is "
                                             "in its output"),
                        409: error_response("The batch has already ended or is finalizing"),
                        **_NOT_FOUND, **_ERRORS})
async def cancel_batch(batch_id: str, request: Request) -> Response:
    parts = batching(request)
    state = await _owned(request, batch_id)
    if state.status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        moved = await anyio.to_thread.run_sync(lambda: parts.batches.move(
            batch_id, BatchStatus.CANCELLING, now=time.time()))
        if moved is None:
            state = await _owned(request, batch_id)
            if state.status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
                raise Conflict(f"batch {batch_id!r} is {state.status.value}; only a validating or in_progress "
                               "batch can be cancelled")
    return await _answer(request, batch_id)


async def _owned(request: Request, batch_id: str) -> BatchState:
    ctx, parts = context(request), batching(request)
    tenant = ctx.tenant(request.headers)
    state = await anyio.to_thread.run_sync(parts.batches.get, batch_id, tenant.name)
    if state is None:
        raise NotFound(f"no batch {batch_id!r} for tenant {tenant.name!r}", param="batch_id")
    return state


async def _answer(request: Request, batch_id: str) -> Response:
    return _json((await _owned(request, batch_id)).batch())


def _check_metadata(metadata: Optional[dict[str, str]]) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA:
        raise BadRequest(f"`metadata` has {len(metadata)} keys; at most {MAX_METADATA}", param="metadata", status=400)
    for key, value in metadata.items():
        if len(key) > MAX_KEY or len(value) > MAX_VALUE:
            raise BadRequest(f"`metadata` key {key[:20]!r}: keys up to {MAX_KEY} and values up to {MAX_VALUE} "
                             "characters", param="metadata", status=400)


def _json(obj: msgspec.Struct) -> Response:
    return Response(msgspec.json.encode(obj), media_type="application/json")
