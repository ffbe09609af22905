"""What the results relay costs per result, on either Kafka client: a development tool.

    python scripts/relay_cost.py [--results 2000] [--rounds 3]

The results relay (kvfleet/results.py) runs in the scheduler's process, beside its
scheduling loop. This drains an outbox of `--results` 1-token results (the job store's
own entries: `JobStore.finish` writes them) through `ResultRelay`, once with the
relay's producer (`kvfleet.kafka.make_batch_producer`, librdkafka) and once with
kafka-python's (`make_producer`, as the relay had until issue 16's round of
2026-12-07), alternating, `--rounds` times, on the local infra
(`python -m kvfleet.cli infra up`), on topics and keys of its own. Two shapes: in
batches of up to 200 (`BATCH`: a burst of finishing jobs), and one result a step (an
idle fleet: each result is read and produced alone). Prints the CPU this process
spent per result (every thread: the relay's and the client's own), and the wall time
of a one-result step.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402
from kafka import KafkaAdminClient  # noqa: E402

from kvfleet.constants import Keys  # noqa: E402
from kvfleet.contracts import JobRequest, JobResult, JobState, Priority, Timings, Usage  # noqa: E402
from kvfleet.jobstore import JobStore  # noqa: E402
from kvfleet.kafka import ensure_topics, make_batch_producer, make_producer  # noqa: E402
from kvfleet.results import KnownTopics, ResultRelay  # noqa: E402
from kvfleet.settings import KafkaSettings, Settings  # noqa: E402


class KafkaPythonAdapter:
    """kafka-python's producer behind the three calls the relay makes of librdkafka's."""

    def __init__(self, producer) -> None:
        self.producer = producer

    def produce(self, topic, *, key, value, headers, on_delivery) -> None:
        future = self.producer.send(topic, key=key, value=value, headers=headers)
        future.add_callback(lambda metadata: on_delivery(None, metadata))
        future.add_errback(lambda exc: on_delivery(_Error(exc), None))

    def flush(self, timeout: float) -> int:
        self.producer.flush(timeout=timeout)
        return 0

    def poll(self, timeout: float) -> int:
        return 0


class _Error:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def str(self) -> str:
        return str(self.exc)


def fill(store: JobStore, n: int) -> None:
    """`n` results in the outbox, as finishing jobs write them."""
    now = time.time()
    for i in range(n):
        job = JobRequest(job_id=str(uuid.uuid4()), tenant="bench", priority=Priority.NORMAL, model="builtin:tiny",
                         max_new_tokens=1, submitted_at=now, prompt_tokens=[1, 2, 3])
        store.create(job)
        store.start(job.job_id, now=now, worker="relay-cost")
        store.finish(JobResult(job_id=job.job_id, status=JobState.DONE, tenant=job.tenant, priority=job.priority,
                               text=" x", tokens=[7], usage=Usage(3, 1, 0), timings=Timings(finished_at=now)))


def drain(relay: ResultRelay, one_at_a_time: bool) -> tuple[int, float, list[float]]:
    """Results relayed, CPU seconds, and each step's wall time."""
    relay.batch = 1 if one_at_a_time else 200
    relayed, steps = 0, []
    cpu = time.process_time()
    while True:
        began = time.perf_counter()
        n = relay.step()
        if not n:
            break
        steps.append(time.perf_counter() - began)
        relayed += n
    return relayed, time.process_time() - cpu, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    settings = Settings.from_env()
    prefix = f"relaycost{uuid.uuid4().hex[:8]}"
    kafka = KafkaSettings(bootstrap=settings.kafka.bootstrap, topic_prefix=f"{prefix}.requests", partitions=2)
    ensure_topics(kafka)
    client = redis.Redis.from_url(settings.redis.url)
    keys = Keys(prefix)
    store = JobStore(client, keys)
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    clients = {
        "librdkafka (make_batch_producer)": make_batch_producer(kafka, client_id="relay-cost", linger_ms=5,
                                                                 logger=logging.getLogger("rdkafka")),
        "kafka-python (make_producer)": KafkaPythonAdapter(make_producer(kafka, client_id="relay-cost", linger_ms=5)),
    }
    cpu_us: dict[tuple[str, str], list[float]] = {}
    step_ms: dict[str, list[float]] = {}
    try:
        for round_ in range(args.rounds):
            for name, producer in clients.items():
                relay = ResultRelay(client, keys, producer, KnownTopics(admin.list_topics),
                                    results_topic=kafka.results, reserved_topics=kafka.topics, consumer=prefix)
                relay.ensure_group()
                fill(store, 20)
                drain(relay, False)  # warm-up: connections, metadata
                for shape, one in (("batches", False), ("one a step", True)):
                    fill(store, args.results if not one else args.results // 4)
                    relayed, cpu, steps = drain(relay, one)
                    cpu_us.setdefault((name, shape), []).append(1e6 * cpu / relayed)
                    if one:
                        step_ms.setdefault(name, []).extend(1000 * s for s in steps)
                    print(f"[relay-cost] round {round_ + 1} {name:<34} {shape:<10} {relayed} results, "
                          f"{1e6 * cpu / relayed:.0f} us CPU each", flush=True)
    finally:
        for producer in clients.values():
            producer.flush(5)
        client.delete(keys.results_outbox)
        admin.delete_topics([t for t in admin.list_topics() if t.startswith(prefix)])
        admin.close()
    print(f"\n{'client':<34} {'CPU us/result, batches':>24} {'one a step':>12} {'step p50 ms':>12}")
    for name in clients:
        print(f"{name:<34} {statistics.median(cpu_us[(name, 'batches')]):>24.0f} "
              f"{statistics.median(cpu_us[(name, 'one a step')]):>12.0f} {statistics.median(step_ms[name]):>12.2f}")


if __name__ == "__main__":
    main()
