"""A batch's output and error files, written in input-line order, whole, in one pass.

Each line of either file is OpenAI's:

    {"id": "batch_req_...", "custom_id": "...",
     "response": {"status_code": 200, "request_id": "<job id>", "body": <what the online
                  endpoint answers>} | null,
     "error": {"code": "batch_expired", "message": "..."} | null}

A line whose job is done goes to the output file, with the body `/v1/completions` or
`/v1/chat/completions` would have answered (the same builders). Every other line goes
to the error file: a job that failed, with the error answer the online endpoint gives
(its status and body); a line never run because the batch expired or was cancelled,
with `error.code` batch_expired / batch_cancelled and `response` null. Jobs still
queued or running when the batch expires or is cancelled are cancelled here first
(which releases their tokens), so nothing runs for a batch that has ended.

File ids are derived from the batch id: writing again (a driver that took over a
half-finalized batch) replaces the same files instead of leaving orphans.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Optional

import msgspec

from kvfleet.contracts import JobResult, JobState
from kvfleet.jobstore import result_from_hash
from producer.batches.model import line_job_id
from producer.batches.store import BatchState, BatchStore, LineFailure
from producer.context import ApiContext
from producer.files import lines as batch_lines
from producer.files.index import FileIndex, FileObject, FileRecord
from producer.files.store import FileStore
from producer.openai import responses

#: Lines whose jobs are read from Redis in one round trip.
CHUNK = 256
_encode = msgspec.json.Encoder().encode


class Written(NamedTuple):
    output_file_id: Optional[str]
    error_file_id: Optional[str]
    completed: int
    failed: int


def output_file_ids(batch_id: str) -> tuple[str, str]:
    suffix = batch_id.removeprefix("batch_")
    return f"file-out{suffix}", f"file-err{suffix}"


def write_outputs(ctx: ApiContext, batches: BatchStore, files: FileStore, index: FileIndex, state: BatchState, *,
                  fingerprint: Optional[str], reason: str) -> Written:
    """Blocking (file and Redis I/O): run on a worker thread. `reason`: the error code of
    lines the batch's end left unrun (batch_expired or batch_cancelled)."""
    spec = state.spec
    out_id, err_id = output_file_ids(spec.id)
    failures = batches.line_failures(spec.id)
    outputs, errors = files.create(out_id), files.create(err_id)
    completed = failed = 0
    try:
        with files.open(spec.input_file_id) as f:
            chunk: list[batch_lines.Line] = []
            for item in batch_lines.read_lines(f):
                chunk.append(item)
                if len(chunk) == CHUNK:
                    c, e = _write_chunk(ctx, spec.id, chunk, failures, outputs, errors, fingerprint, reason)
                    completed, failed, chunk = completed + c, failed + e, []
            if chunk:
                c, e = _write_chunk(ctx, spec.id, chunk, failures, outputs, errors, fingerprint, reason)
                completed, failed = completed + c, failed + e
    except BaseException:
        outputs.abort()
        errors.abort()
        raise
    now = int(time.time())
    ids = []
    for writer, file_id, count, kind in ((outputs, out_id, completed, "output"), (errors, err_id, failed, "error")):
        if not count:  # OpenAI names no file that would be empty
            writer.abort()
            ids.append(None)
            continue
        size = writer.commit()
        index.add(FileRecord(file=FileObject(
            id=file_id, bytes=size, created_at=now, filename=f"{spec.id}_{kind}.jsonl", purpose="batch_output",
            expires_at=now + int(ctx.settings.batch.file_retention_s)), tenant=spec.tenant))
        ids.append(file_id)
    return Written(ids[0], ids[1], completed, failed)


def _write_chunk(ctx: ApiContext, batch_id: str, chunk: list[batch_lines.Line], failures: dict[int, LineFailure],
                 outputs, errors, fingerprint: Optional[str], reason: str) -> tuple[int, int]:
    job_ids = [line_job_id(batch_id, item.number) for item in chunk]
    results = _read(ctx, job_ids)
    unfinished = [job_id for job_id, r in zip(job_ids, results) if r is not None and not r.status.terminal]
    if unfinished:
        # The batch has ended (expired or cancelled): stop what has not run. A job that
        # ends meanwhile keeps its result (fail() moves only a job not yet terminal).
        for job_id in unfinished:
            ctx.store.fail(job_id, JobState.CANCELLED, reason, _reason_message(reason), now=time.time())
        results = _read(ctx, job_ids)
    completed = failed = 0
    for item, job_id, result in zip(chunk, job_ids, results):
        envelope = batch_lines.parse(item)  # checked on upload: it parses
        response, error = _answer(ctx, envelope, job_id, result, failures.get(item.number), fingerprint, reason)
        line = {"id": f"batch_req_{job_id.removeprefix('batch_')}", "custom_id": envelope.custom_id,
                "response": response, "error": error}
        ok = error is None and response is not None and response["status_code"] == 200
        (outputs if ok else errors).write(_encode(line) + b"\n")
        completed, failed = completed + ok, failed + (not ok)
    return completed, failed


def _read(ctx: ApiContext, job_ids: list[str]) -> list[Optional[JobResult]]:
    with ctx.sync_redis.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hgetall(ctx.settings.redis.keys.job(job_id))
        raw = pipe.execute()
    return [result_from_hash(job_id, fields) for job_id, fields in zip(job_ids, raw)]


def _reason_message(reason: str) -> str:
    if reason == "batch_cancelled":
        return "the batch was cancelled before this request ran"
    if reason == "job_lost":
        return "this request's job record is gone (Redis lost it); send the request again"
    return "the batch's completion window ended before this request ran"


def _answer(ctx: ApiContext, envelope: batch_lines.BatchLine, job_id: str, result: Optional[JobResult],
            failure: Optional[LineFailure], fingerprint: Optional[str], reason: str,
            ) -> tuple[Optional[dict[str, Any]], Optional[dict[str, str]]]:
    """(response, error) of one line."""
    if failure is not None:
        return {"status_code": failure.status_code, "request_id": job_id, "body": failure.body}, None
    if result is None:
        # Never submitted: the batch ended first (or, on a finished batch, the job's
        # record is gone, which only a Redis loss does).
        return None, {"code": reason, "message": _reason_message(reason)}
    if result.status is JobState.DONE:
        if envelope.url == "/v1/chat/completions":
            tier = envelope.body.get("service_tier")
            body = responses.chat_completion(result, ctx.model.name, fingerprint, tier)
        else:
            body = responses.completion(result, ctx.model.name, fingerprint)
        return {"status_code": 200, "request_id": job_id, "body": msgspec.to_builtins(body)}, None
    code = result.error.code if result.error else ""
    if result.status is JobState.EXPIRED or code in ("batch_expired", "batch_cancelled"):
        # Ended by the batch's end (its window is every job's deadline), not by the request.
        return None, {"code": code if code.startswith("batch_") else "batch_expired",
                      "message": result.error.message if result.error else _reason_message(reason)}
    error = responses.not_done(result)
    return {"status_code": error.status, "request_id": job_id, "body": error.body()}, None
