"""The idle latency floor of the hops a job crosses, on this machine: a development tool.

A 1-token job's round trip (`overhead_p50_ms` in bench/fleet.py) crosses Kafka once on
its way in (the API's produce, acks=all; the scheduler's fetch) and Redis several times.
This times those alone, with the clients the fleet makes (kvfleet/kafka.py: the API's
producer, the scheduler's consumer settings; redis-py), one
call at a time with a pause between, as the idle-fleet measurement sends its jobs, on
the local infra (`python -m kvfleet.cli infra up`):

    python scripts/latency_floor.py

It prints the median and p90 of: a produce with acks=all until acknowledged (kafka-python,
the scheduler's and workers' client); the same produce until a consumer polling the topic
has it; the API's produce (librdkafka, `make_submit_producer`) until acknowledged; a Redis
PING. The overhead cannot go
below the Kafka line plus a few Redis round trips and the process wake-ups between them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402
from kafka.admin import NewTopic  # noqa: E402

from kvfleet.kafka import make_admin, make_consumer, make_producer, make_submit_producer  # noqa: E402
from kvfleet.settings import Settings  # noqa: E402


def summary(ms: list[float]) -> str:
    return f"p50 {statistics.median(ms):.2f} ms, p90 {statistics.quantiles(ms, n=10)[-1]:.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--pause-ms", type=float, default=20.0, help="between calls: an idle client")
    args = parser.parse_args()
    settings = Settings.from_env()
    topic = f"latency-floor-{uuid.uuid4().hex[:8]}"
    kafka = dataclasses.replace(settings.kafka, group=topic)  # a group of its own, not the scheduler's
    admin = make_admin(kafka, client_id="latency-floor")
    admin.create_topics([NewTopic(topic, 1, 1)])
    try:
        producer = make_producer(kafka, client_id="latency-floor")
        consumer = make_consumer(kafka, client_id="latency-floor", max_poll_records=500,
                                 fetch_max_wait_ms=settings.scheduler.fetch_max_wait_ms)
        consumer.subscribe([topic])
        while not consumer.assignment():
            consumer.poll(timeout_ms=100)
        warm_up = 20
        total = warm_up + args.samples
        acked, consumed = [], []

        def consume() -> None:
            while len(consumed) < total:
                for records in consumer.poll(timeout_ms=200).values():
                    consumed.extend(1000 * (time.time() - float(r.value)) for r in records)

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        for _ in range(total):
            began = time.time()
            producer.send(topic, str(began).encode()).get(timeout=10)
            acked.append(1000 * (time.time() - began))
            time.sleep(args.pause_ms / 1000)
        reader.join(timeout=30)
        # The API's producer (librdkafka), the same produce, its report served by a poll thread.
        fast = make_submit_producer(kafka, client_id="latency-floor", logger=logging.getLogger("rdkafka"))
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                fast.poll(0.1)

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        api_acked = []
        for _ in range(total):
            reported = threading.Event()
            began = time.time()
            fast.produce(topic, str(began).encode(), on_delivery=lambda error, message: reported.set())
            reported.wait(10)
            api_acked.append(1000 * (time.time() - began))
            time.sleep(args.pause_ms / 1000)
        stop.set()
        server.join()
        client = redis.Redis.from_url(settings.redis.url)
        pings = []
        for _ in range(total):
            began = time.perf_counter()
            client.ping()
            pings.append(1000 * (time.perf_counter() - began))
            time.sleep(args.pause_ms / 1000)
        print(f"kafka produce, acks=all, until acknowledged:  {summary(acked[warm_up:])}")
        print(f"kafka produce until a polling consumer has it: {summary(consumed[warm_up:])}")
        print(f"the API's produce (librdkafka), acknowledged:  {summary(api_acked[warm_up:])}")
        print(f"redis PING (state instance):                   {summary(pings[warm_up:])}")
        producer.close()
        consumer.close()
    finally:
        admin.delete_topics([topic])
        admin.close()


if __name__ == "__main__":
    main()
