"""OpenAI's Files API, for batch input and output files.

    POST   /v1/files               multipart: file (JSONL), purpose=batch -> file object
    GET    /v1/files               ?limit=&after=&order=&purpose= -> list
    GET    /v1/files/{id}          -> file object
    GET    /v1/files/{id}/content  -> the bytes, streamed
    DELETE /v1/files/{id}          -> {"id", "object": "file", "deleted": true}

An upload is streamed to the file store (never held in memory) and, before it is kept,
every line is checked as the batch will run it (producer/files/lines.py): the answer to
a bad file is a 400 naming the first bad lines, each with what to change. Files belong
to the tenant that uploaded them; another tenant's file answers 404, like a missing one.
"""

from __future__ import annotations

import time
from typing import Iterator, Literal, Optional

import anyio
import msgspec
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from producer.batches.components import Batching, batching
from producer.context import ApiContext, context
from producer.errors import BadRequest, NotFound
from producer.files import lines as batch_lines
from producer.files.index import FileDeleted, FileList, FileObject, FileRecord, new_file_id
from producer.files.store import FileMissing
from producer.files.upload import receive
from producer.openapi import error_response, response

router = APIRouter()

#: Bad lines named in one answer: enough to see a pattern, few enough to read.
MAX_REPORTED = 5
_READ_CHUNK = 1 << 16

_ERRORS = {401: error_response("Missing or unknown API key"),
           403: error_response("The key's tenant differs from X-Tenant-ID, or the tenant is not configured")}
_UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary", "description": "a JSONL file of requests"},
                   "purpose": {"type": "string", "enum": ["batch"]}}}}}}}


@router.post("/v1/files", openapi_extra=_UPLOAD_BODY,
             responses={200: response(FileObject, "The file, checked and kept"),
                        400: error_response("Not multipart, purpose is not batch, or bad lines: "
                                            "`error.message` names each with what to fix"),
                        413: error_response("Over the size limit"), **_ERRORS})
async def upload_file(request: Request) -> Response:
    ctx, parts = context(request), batching(request)
    tenant = ctx.tenant(request.headers)
    limits = ctx.settings.batch
    file_id = new_file_id()
    writer = await anyio.to_thread.run_sync(parts.files.create, file_id)
    try:
        upload = await receive(request.headers.get("content-type", ""), request.stream(), writer,
                               max_bytes=limits.max_file_bytes)
        purpose = upload.fields.get("purpose")
        if purpose != "batch":
            raise BadRequest(f"`purpose` is {purpose!r}: kvfleet keeps files for batches; send purpose=batch",
                             param="purpose", status=400)
        size = await anyio.to_thread.run_sync(writer.commit)
    except BaseException:
        await anyio.to_thread.run_sync(writer.abort)
        raise
    try:
        lines, last_line, endpoint = await anyio.to_thread.run_sync(_check_lines, ctx, parts, file_id, tenant)
    except BaseException:
        await anyio.to_thread.run_sync(parts.files.delete, file_id)
        raise
    now = int(time.time())
    file = FileObject(id=file_id, bytes=size, created_at=now, filename=upload.filename or "upload.jsonl",
                      purpose="batch", expires_at=now + int(limits.file_retention_s))
    record = FileRecord(file=file, tenant=tenant.name, lines=lines, last_line=last_line, endpoint=endpoint)
    await anyio.to_thread.run_sync(parts.index.add, record)
    return _json(file)


def _check_lines(ctx: ApiContext, parts: Batching, file_id: str, tenant) -> tuple[int, int, str]:
    """Every line as the batch will run it: (requests, the last one's line, its url).
    Blocking (reads the file, tokenizes): a worker thread."""
    limits = ctx.settings.batch
    bad: list[batch_lines.LineError] = []
    seen: dict[str, int] = {}  # custom_id -> its line: the ids, not the file, are held
    count = last = 0
    urls: dict[str, int] = {}
    now = time.time()
    with parts.files.open(file_id) as f:
        for item in batch_lines.read_lines(f):
            count, last = count + 1, item.number
            if count > limits.max_file_lines:
                raise BadRequest(f"line {item.number}: the file holds more than {limits.max_file_lines} requests, "
                                 "the most one batch takes; split it into several files", param="file",
                                 code="too_many_lines", status=400)
            try:
                line = batch_lines.parse(item)
                first = seen.setdefault(line.custom_id, item.number)
                if first != item.number:
                    raise batch_lines.LineError(item.number, f"`custom_id` {line.custom_id!r} is already used on "
                                                             f"line {first}; give every line its own custom_id",
                                                param="custom_id", code="duplicate_custom_id")
                urls.setdefault(line.url, item.number)
                batch_lines.build_job(line, item.number, model=ctx.model, settings=ctx.settings, tenant=tenant,
                                      job_id="validate", now=now, deadline=now + limits.max_window_s,
                                      quotas=ctx.gate.quotas is not None)
            except batch_lines.LineError as exc:
                bad.append(exc)
                if len(bad) >= MAX_REPORTED:
                    break
    if not bad and len(urls) > 1:
        (a, la), (b, lb) = sorted(urls.items(), key=lambda kv: kv[1])[:2]
        bad.append(batch_lines.LineError(lb, f"`url` is {b} but line {la} says {a}: one batch runs one endpoint; "
                                             "put each endpoint's requests in its own file", param="url"))
    if bad:
        more = " (and maybe more after these)" if len(bad) >= MAX_REPORTED else ""
        raise BadRequest("the file has invalid lines" + more + ": " + "; ".join(str(e) for e in bad),
                         param=bad[0].param, code="invalid_batch_file", status=400,
                         lines=[{"line": e.line, "message": e.message, "param": e.param} for e in bad])
    if count == 0:
        raise BadRequest("the file holds no requests: one JSON object per line", param="file", status=400)
    return count, last, next(iter(urls))


@router.get("/v1/files", responses={200: response(FileList, "The tenant's files, newest first"), **_ERRORS})
async def list_files(request: Request, limit: int = Query(20, ge=1, le=10_000), after: Optional[str] = None,
                     order: Literal["asc", "desc"] = "desc", purpose: Optional[str] = None) -> Response:
    ctx, parts = context(request), batching(request)
    tenant = ctx.tenant(request.headers)
    data, more = await anyio.to_thread.run_sync(lambda: parts.index.page(
        tenant.name, limit=limit, after=after, newest_first=order == "desc", purpose=purpose))
    return _json(FileList(data=data, has_more=more, first_id=data[0].id if data else None,
                          last_id=data[-1].id if data else None))


@router.get("/v1/files/{file_id}", responses={200: response(FileObject, "The file"),
                                              404: error_response("No such file for this tenant"), **_ERRORS})
async def get_file(file_id: str, request: Request) -> Response:
    return _json((await _owned(request, file_id)).file)


@router.get("/v1/files/{file_id}/content",
            responses={200: response(None, "The file's bytes (JSONL)", media_type="application/jsonl",
                                     schema={"type": "string"}),
                       404: error_response("No such file for this tenant"), **_ERRORS})
async def file_content(file_id: str, request: Request) -> Response:
    record = await _owned(request, file_id)
    parts = batching(request)
    try:
        f = await anyio.to_thread.run_sync(parts.files.open, file_id)
    except FileMissing:
        raise NotFound(f"file {file_id!r}'s content is gone", param="file_id") from None

    def chunks() -> Iterator[bytes]:  # a sync iterator: Starlette runs it on a worker thread
        with f:
            while chunk := f.read(_READ_CHUNK):
                yield chunk

    return StreamingResponse(chunks(), media_type="application/octet-stream",
                             headers={"Content-Length": str(record.file.bytes),
                                      "Content-Disposition": f'attachment; filename="{record.file.filename}"'})


@router.delete("/v1/files/{file_id}", responses={200: response(FileDeleted, "Deleted"),
                                                 404: error_response("No such file for this tenant"), **_ERRORS})
async def delete_file(file_id: str, request: Request) -> Response:
    record = await _owned(request, file_id)
    parts = batching(request)
    await anyio.to_thread.run_sync(parts.index.remove, record)
    await anyio.to_thread.run_sync(parts.files.delete, file_id)
    return _json(FileDeleted(id=file_id))


async def _owned(request: Request, file_id: str) -> FileRecord:
    ctx, parts = context(request), batching(request)
    tenant = ctx.tenant(request.headers)
    record = await anyio.to_thread.run_sync(parts.index.get, file_id, tenant.name)
    if record is None:
        raise NotFound(f"no file {file_id!r} for tenant {tenant.name!r}", param="file_id")
    return record


def _json(obj: msgspec.Struct) -> Response:
    return Response(msgspec.json.encode(obj), media_type="application/json")
