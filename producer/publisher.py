"""Puts validated jobs onto the priority topics (acks=all).

The API records a job `queued` and charges its quota in one Redis call, then produces
it (`producer/submission.py`, `producer/records.py`). If the produce fails, the record
is taken back: the client's `503` means "nothing was queued", and a retry with the same
`job_id` simply submits it again. A produce whose outcome is unknown (a timeout after
the broker wrote it) may leave a copy on Kafka too; the retry then produces a second
one, which the scheduler recognises by its id and skips.

A produce holds no thread while it waits. The producer is librdkafka's
(`kvfleet.kafka.make_submit_producer`): `produce` only appends the record to its queue
and never blocks, not even before the topic's metadata is known or while Kafka is
unreachable (a full queue raises at once instead). librdkafka hands the broker's
acknowledgement to whoever calls `poll`; one thread per process does (`_serve`) and
passes each outcome to the event loop that produced it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable, Optional

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from kvfleet import constants
from kvfleet.contracts import JobRequest, encode
from kvfleet.kafka import SUBMIT_DELIVERY_TIMEOUT_MS, make_submit_producer
from kvfleet.settings import KafkaSettings
from producer.errors import QueueUnavailable

log = logging.getLogger(__name__)

#: Seconds a submission waits for the broker's acknowledgement before answering 503. A
#: little longer than librdkafka's own delivery timeout, so normally librdkafka says why
#: first; this only answers for a report that never comes.
ACK_TIMEOUT_S = SUBMIT_DELIVERY_TIMEOUT_MS / 1000 + 1.0

#: How long `poll` waits for a report when there is none, s: only how soon `close` is
#: noticed; a report wakes it at once.
POLL_S = 0.2


class Publisher:
    def __init__(self, kafka: KafkaSettings, *, client_id: str = "kvfleet-api", **overrides) -> None:
        """`overrides`: librdkafka options, for tests."""
        self.kafka = kafka
        self._client_id = client_id
        self._overrides = overrides
        self._producer: Producer | None = None
        self._stop = threading.Event()
        self._server: threading.Thread | None = None
        self._lock = threading.Lock()  # the producer is created on first use, once

    @property
    def producer(self) -> Producer:
        """The producer and its reporting thread, made on first use (never blocks: librdkafka
        connects in the background)."""
        with self._lock:
            if self._producer is None:
                self._producer = make_submit_producer(self.kafka, client_id=self._client_id,
                                                      logger=logging.getLogger("kvfleet.rdkafka"), **self._overrides)
                self._stop.clear()
                self._server = threading.Thread(target=self._serve, args=(self._producer,), daemon=True,
                                                name="kafka-delivery-reports")
                self._server.start()
            return self._producer

    def _serve(self, producer: Producer) -> None:
        """Delivery reports (and librdkafka's log lines) run their callbacks here. `poll`
        waits in C, without the GIL."""
        while not self._stop.is_set():
            try:
                producer.poll(POLL_S)
            except Exception:  # noqa: BLE001 - a callback's failure must not end every later report
                log.exception("a delivery report's callback failed")

    async def publish(self, request: JobRequest, encoded: Optional[bytes] = None, *,
                      timeout_s: float = ACK_TIMEOUT_S) -> bytes:
        """Produce with acks=all and wait for the broker's acknowledgement; the record's
        bytes (`encoded`, or the request encoded now). Raises QueueUnavailable: nothing
        was queued."""
        topic = constants.request_topic(self.kafka.topic_prefix, request.priority)
        value = encode(request) if encoded is None else encoded
        acknowledged, on_delivery = _delivery(timeout_s)
        try:
            self.producer.produce(topic, value=value, key=request.tenant.encode(),  # one tenant: one partition
                                  headers=[("job_id", request.job_id.encode()), ("v", str(request.v).encode())],
                                  on_delivery=on_delivery)
            message = await acknowledged
        except (KafkaException, BufferError, TimeoutError) as exc:
            acknowledged.cancel()  # a produce refused at once: its timer must find it settled
            # BufferError: librdkafka's queue is full (Kafka unreachable for long, or a flood).
            reason = exc.args[0].str() if isinstance(exc, KafkaException) and exc.args else str(exc)
            log.error("produce failed", extra={"job_id": request.job_id, "error": reason})
            raise QueueUnavailable(f"the queue is unavailable ({reason}); nothing was queued: retry later with "
                                   "the same job_id",
                                   job_id=request.job_id) from exc
        log.info("queued", extra={"job_id": request.job_id, "topic": topic, "partition": message.partition(),
                                  "offset": message.offset(), "tenant": request.tenant})
        return value

    def ready(self, timeout_s: float = 5.0) -> bool:
        """Kafka reachable: the cluster lists every request topic with its partitions
        (blocking, up to `timeout_s`)."""
        try:
            topics = self.producer.list_topics(timeout=timeout_s).topics
        except KafkaException:
            return False
        return all(t in topics and topics[t].error is None and topics[t].partitions for t in self.kafka.topics)

    def close(self, timeout_s: float = 5.0) -> None:
        """Waits up to `timeout_s` for what is still queued, then stops the reporting thread."""
        with self._lock:
            if self._producer is None:
                return
            self._producer.flush(timeout_s)  # serves the last reports on this thread
            self._stop.set()
            self._server.join()
            self._producer = self._server = None


def _delivery(timeout_s: float) -> tuple[asyncio.Future, Callable[[KafkaError | None, Message], None]]:
    """An asyncio future for one record's delivery report, and the callback librdkafka
    calls with it (on the reporting thread). The outcome crosses to the loop with
    call_soon_threadsafe; the future fails with TimeoutError after `timeout_s` if no
    report came, and whichever of the two comes first wins."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(error: KafkaError | None, message: Message) -> None:  # on the loop
        if done.done():
            return  # the timer fired first: the client got its 503 already
        timer.cancel()
        if error is not None:
            done.set_exception(KafkaException(error))
        else:
            done.set_result(message)

    def expire() -> None:  # on the loop
        if not done.done():
            done.set_exception(TimeoutError(f"no acknowledgement from Kafka within {timeout_s:g} s"))

    def on_delivery(error: KafkaError | None, message: Message) -> None:  # on the reporting thread
        try:
            loop.call_soon_threadsafe(settle, error, message)
        except RuntimeError:
            pass  # its loop is closed: nobody waits for this report any more

    timer = loop.call_later(timeout_s, expire)
    return done, on_delivery

