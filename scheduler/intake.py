"""From a Kafka record to a valid `JobRequest`, or to the dead-letter topic with a reason;
and from a request to the tokens its prompt takes.

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


class PromptLength:
    """A prompt's length in tokens: the API's count (`prompt_len`), else the number of
    token ids, else the text tokenized with the served model's tokenizer. The tokenizer
    is loaded on first need, as it imports the model code: jobs from the API never
    need it."""

    def __init__(self, model_source: str) -> None:
        self.model_source = model_source
        self._encode: Optional[Callable[[str], list[int]]] = None

    def __call__(self, job: JobRequest) -> int:
        if job.prompt_len is not None:
            return job.prompt_len
        if job.prompt_tokens is not None:
            return len(job.prompt_tokens)
        if self._encode is None:
            from workers.model.loader import load_tokenizer_and_config

            self._encode = load_tokenizer_and_config(self.model_source)[0].encode
            log.info("loaded the tokenizer for jobs produced without prompt_len", extra={"model": self.model_source})
        return len(self._encode(job.prompt or ""))


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
