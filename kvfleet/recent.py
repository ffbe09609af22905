"""The last minute's finished jobs, read from the results topic, and what they add up to.

Why the results topic: every terminal `JobResult`, with its usage and its five
timestamps, is produced to `<topic prefix>.results` (kvfleet/results.py) and kept there
a week, so "the jobs that finished in the last minute" is a seek by time and a read to
the end, the same for one frame (`kvfleet status --once`) as for a live view. The
services' Prometheus counters and histograms only count since each process started;
a last-minute rate from them needs two scrapes a minute apart, which one frame does not
have. The one blind spot: a job that named its own `reply_to` topic has its result
produced there instead, and is not counted here.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import msgspec
from kafka import KafkaConsumer, TopicPartition

from kvfleet.contracts import JobResult, decode_result

#: Longest one read to the end of the topic may take before the frame shows what it has.
READ_BUDGET_S = 3.0


@dataclass(frozen=True)
class Latency:
    """Percentiles of one latency over the window's jobs, seconds (None: no sample)."""

    p50: Optional[float] = None
    p95: Optional[float] = None
    samples: int = 0


@dataclass(frozen=True)
class Throughput:
    """The jobs that finished in the last `window_s` seconds."""

    window_s: float
    by_status: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0
    #: queued → started (Kafka, scheduler and Celery queue), queued → first token (what a
    #: client waits for), mean gap between output tokens after the first, queued → finished.
    queue: Latency = Latency()
    ttft: Latency = Latency()
    tpot: Latency = Latency()
    total: Latency = Latency()

    @property
    def finished(self) -> int:
        return sum(self.by_status.values())

    @property
    def jobs_per_minute(self) -> float:
        return self.finished * 60.0 / self.window_s

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.window_s


def _percentile(values: list[float], q: float) -> float:
    """Nearest rank: a value some job really had, not an interpolation between two."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _latency(values: list[float]) -> Latency:
    if not values:
        return Latency()
    return Latency(_percentile(values, 0.50), _percentile(values, 0.95), len(values))


def summarise(results: Iterable[JobResult], *, window_s: float) -> Throughput:
    """Counts, output tokens and latency percentiles of `results` (a pure function)."""
    by_status: dict[str, int] = {}
    tokens = 0
    queue, ttft, tpot, total = [], [], [], []
    for r in results:
        by_status[r.status.value] = by_status.get(r.status.value, 0) + 1
        tokens += r.usage.completion_tokens
        t = r.timings
        if t.queued_at is None:
            continue
        if t.started_at is not None:
            queue.append(t.started_at - t.queued_at)
        if t.first_token_at is not None:
            ttft.append(t.first_token_at - t.queued_at)
            if t.finished_at is not None and r.usage.completion_tokens > 1:
                tpot.append((t.finished_at - t.first_token_at) / (r.usage.completion_tokens - 1))
        if t.finished_at is not None:
            total.append(t.finished_at - t.queued_at)
    return Throughput(window_s, by_status, tokens, _latency(queue), _latency(ttft), _latency(tpot), _latency(total))


class RecentResults:
    """A sliding window over the results topic: `read()` returns the results that
    finished within the last `window_s` seconds, reading only what is new since the
    previous call. No consumer group: it commits nothing and disturbs no one."""

    def __init__(self, kafka_options: dict, topic: str, *, window_s: float = 60.0) -> None:
        """`kafka_options`: KafkaSettings.client_options (bootstrap and security)."""
        self.topic = topic
        self.window_s = window_s
        self._consumer: Optional[KafkaConsumer] = None
        self._options = kafka_options
        self._window: collections.deque[tuple[float, JobResult]] = collections.deque()

    def _assign(self, now: float) -> KafkaConsumer:
        consumer = KafkaConsumer(**self._options, group_id=None, enable_auto_commit=False,
                                 client_id="kvfleet-status", request_timeout_ms=10_000)
        partitions = consumer.partitions_for_topic(self.topic)
        if not partitions:
            consumer.close()
            raise LookupError(f"Kafka has no topic {self.topic!r} (is the fleet's topic prefix right?)")
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        # A partition with nothing as new as the window's start answers None: start at its end.
        starts = consumer.offsets_for_times({tp: int((now - self.window_s) * 1000) for tp in tps})
        ends = consumer.end_offsets(tps)
        for tp in tps:
            found = starts.get(tp)
            consumer.seek(tp, found.offset if found is not None else ends[tp])
        return consumer

    def read(self, now: Optional[float] = None) -> list[JobResult]:
        now = time.time() if now is None else now
        if self._consumer is None:
            self._consumer = self._assign(now)
        consumer = self._consumer
        tps = list(consumer.assignment())
        ends = consumer.end_offsets(tps)
        deadline = time.monotonic() + READ_BUDGET_S
        while time.monotonic() < deadline and any(consumer.position(tp) < ends[tp] for tp in tps):
            for records in consumer.poll(timeout_ms=200).values():
                for record in records:
                    try:
                        result = decode_result(record.value)
                    except msgspec.DecodeError:
                        continue  # not ours to judge here; the view only counts what it can read
                    finished = result.timings.finished_at or record.timestamp / 1000
                    self._window.append((finished, result))
        # Results arrive in finish order only roughly (several partitions, several
        # relays), so the window is filtered by each result's own finish time.
        self._window = collections.deque(sorted((x for x in self._window if x[0] >= now - self.window_s),
                                                key=lambda x: x[0]))
        return [result for _, result in self._window]

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
