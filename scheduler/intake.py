"""From a Kafka record to a valid `JobRequest`, or to the dead-letter topic with a reason;
and a text prompt to its tokens, for jobs produced without the API.

A message that cannot be decoded, has the wrong schema version, or sits on a topic of
another priority than it claims is not retried (it would fail the same way forever):
it is copied to `<prefix>.dlq` with headers saying why and where it came from, and the
scheduler moves on.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import msgspec
from kafka.consumer.fetcher import ConsumerRecord

from kvfleet.contracts import JobRequest, Priority, decode_request
from kvfleet.modelinfo import load_model_info

log = logging.getLogger("kvfleet.scheduler")


class Rejected(Exception):
    """A record that goes to the dead-letter topic; `reason` is a short code, the message details."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def decode_record(record: ConsumerRecord, topic_priority: Priority) -> JobRequest:
    if record.value is None:
        raise Rejected("empty", "the message has no value")
    try:
        job = decode_request(record.value)
    except msgspec.ValidationError as exc:
        raise Rejected("invalid", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise Rejected("undecodable", f"not JSON: {exc}") from None
    if job.priority is not topic_priority:
        raise Rejected("priority_mismatch",
                       f"job says priority {job.priority.value!r} but was produced to the {topic_priority.value} topic")
    return job


class Tokenize:
    """A job with its prompt as token ids. The API sends every job tokenized; a job
    produced straight to Kafka with a text prompt is tokenized here, once, with the
    served model's tokenizer, and travels on tokenized, so the worker does not tokenize
    it again. The tokenizer is loaded on first need: jobs from the API never need it."""

    def __init__(self, model_source: str) -> None:
        self.model_source = model_source
        self._encode: Optional[Callable[[str], list[int]]] = None

    def __call__(self, job: JobRequest) -> JobRequest:
        if job.prompt_tokens is not None:
            return job
        if self._encode is None:
            self._encode = load_model_info(self.model_source).encode
            log.info("loaded the tokenizer for jobs produced with a text prompt", extra={"model": self.model_source})
        return msgspec.structs.replace(job, prompt=None, prompt_tokens=self._encode(job.prompt or ""), prompt_len=None)


def dlq_headers(record: ConsumerRecord, rejected: Rejected, job_id: Optional[str]) -> list[tuple[str, bytes]]:
    headers = [
        ("reason", rejected.reason.encode()),
        ("detail", rejected.detail[:2000].encode()),
        ("source_topic", record.topic.encode()),
        ("source_partition", str(record.partition).encode()),
        ("source_offset", str(record.offset).encode()),
    ]
    if job_id:
        headers.append(("job_id", job_id.encode()))
    return headers


def job_id_hint(record: ConsumerRecord) -> Optional[str]:
    """The job id from the headers, for logging a message whose body is unreadable."""
    for key, value in record.headers or ():
        if key == "job_id" and value:
            return value.decode(errors="replace")
    return None
