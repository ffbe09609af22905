"""What one Celery send and one delivery-and-ack cost with kombu's own Redis transport
and with kvfleet's (kvfleet/broker.py: one redis-py client per channel, not one per
operation), in the same run, alternating: a development tool.

On the local infra (`python -m kvfleet.cli infra up`):

    python scripts/broker_client_cost.py

It prints the median wall time of: the scheduler's send of a one-job message
(`scheduler.dispatch.Dispatcher.send`, the job path's idle case); a message taken from
the queue and acknowledged (kombu's `SimpleQueue.get` + `ack`: the worker's unacked
bookkeeping and its removal); and the CPU of each, per operation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402

from kvfleet.celery_app import make_celery  # noqa: E402
from kvfleet.contracts import JobRequest, Priority  # noqa: E402
from kvfleet.settings import Settings  # noqa: E402
from scheduler.dispatch import Dispatcher  # noqa: E402


def job() -> JobRequest:
    return JobRequest(job_id=str(uuid.uuid4()), tenant="bench", priority=Priority.NORMAL, model="builtin:tiny",
                      max_new_tokens=1, submitted_at=time.time(), prompt_tokens=list(range(64)))


def measure(app, prefix: str, samples: int) -> dict[str, float]:
    """Median ms of a send and of a get+ack, and CPU ms of each, over `samples`."""
    dispatcher = Dispatcher(None, app, prefix, lease_s=30, replica="bench")
    sends, gets, cpu_send, cpu_get = [], [], 0.0, 0.0
    with app.connection_for_write() as conn:
        queue = conn.SimpleQueue(f"{prefix}.cost")
        for i in range(samples + 20):
            c0, t0 = time.process_time(), time.perf_counter()
            dispatcher.send([[job()]])
            t1, c1 = time.perf_counter(), time.process_time()
            queue.put({"n": i})
            c2, t2 = time.process_time(), time.perf_counter()
            queue.get(timeout=5).ack()
            t3, c3 = time.perf_counter(), time.process_time()
            if i >= 20:  # warm-up: connections, declarations
                sends.append(t1 - t0)
                gets.append(t3 - t2)
                cpu_send += c1 - c0
                cpu_get += c3 - c2
            time.sleep(0.002)  # an idle path: one at a time
        queue.close()
    return {"send_ms": 1000 * statistics.median(sends), "get_ack_ms": 1000 * statistics.median(gets),
            "send_cpu_ms": 1000 * cpu_send / samples, "get_ack_cpu_ms": 1000 * cpu_get / samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two transports")
    args = parser.parse_args()
    settings = Settings.from_env()
    prefix = f"broker-cost-{uuid.uuid4().hex[:8]}"
    rows: dict[str, list[dict[str, float]]] = {"kombu": [], "kvfleet": []}
    try:
        for r in range(args.rounds):
            for name in (("kombu", "kvfleet") if r % 2 == 0 else ("kvfleet", "kombu")):
                app = make_celery(settings)
                if name == "kombu":
                    app.conf.broker_transport = "redis"  # kombu's own, chosen by the URL's scheme
                rows[name].append(measure(app, prefix, args.samples))
                app.close()
    finally:
        client = redis.Redis.from_url(settings.redis.url)
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
    print(f"{'transport':<10} {'send ms':>8} {'send CPU ms':>12} {'get+ack ms':>11} {'get+ack CPU ms':>15}"
          f"   (median of {args.rounds} rounds of {args.samples})")
    for name, runs in rows.items():
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        print(f"{name:<10} {med['send_ms']:8.3f} {med['send_cpu_ms']:12.3f} {med['get_ack_ms']:11.3f} "
              f"{med['get_ack_cpu_ms']:15.3f}")


if __name__ == "__main__":
    main()
