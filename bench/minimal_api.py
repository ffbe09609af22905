"""The baseline of bench/fleet.py: the least an HTTP endpoint can do to take a job.

    python bench/minimal_api.py --port P --kafka HOST:PORT --redis URL --topic T --prefix K --job JSON

One uvicorn process, one FastAPI route, `POST /v1/jobs`: a new id, one Redis hash write
(redis.asyncio: the job's record, state `queued`), then one produce with acks=all
awaited through the event loop (no thread per request), then 202. No validation,
tokenization, tenants, admission or quota: what is left is the essential work of a
front door, and the API's figures are measured against it. The producer is the API's
own (`kvfleet.kafka.make_submit_producer`: librdkafka, acks=all, idempotence, no
linger), so the comparison is of the endpoints, not of Kafka clients. (Issue 16 first
named a kafka-python produce here; since the API moved to librdkafka, a kafka-python
baseline would flatter the API.)

Every request queues `--job` (a JobRequest as JSON: bench/fleet.py passes one the API
recorded for the same body) under a new id, on the fleet's own topic and keys, so the
fleet runs the minimal endpoint's jobs exactly as it runs the API's. It did not at
first (its own topic, which nobody read): the fleet then sat nearly idle during the
minimal endpoint's rounds and busy during the API's, and the ratio measured the fleet's
share of the two cores more than the endpoints (docs/benchmarks.md, "The same fleet
behind both endpoints"). The record is written before the produce, as the API does, so
the scheduler never finds a job it then sees overwritten.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time
import uuid

import msgspec
import redis.asyncio as aredis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvfleet.contracts import decode_request, encode
from kvfleet.kafka import make_submit_producer
from kvfleet.settings import KafkaSettings


def create_app(kafka: str, redis_url: str, topic: str, prefix: str, job: bytes) -> FastAPI:
    template = decode_request(job)
    producer = make_submit_producer(KafkaSettings(bootstrap=kafka), client_id="bench-minimal",
                                    logger=logging.getLogger("rdkafka"))

    def serve() -> None:  # librdkafka calls back from poll(): one thread serves the reports, as the API's does
        while True:
            producer.poll(0.2)

    threading.Thread(target=serve, daemon=True).start()
    client = aredis.Redis.from_url(redis_url)
    app = FastAPI()

    @app.post("/v1/jobs")
    async def submit(request: Request) -> JSONResponse:
        await request.body()
        job_id = str(uuid.uuid4())
        value = encode(msgspec.structs.replace(template, job_id=job_id, submitted_at=time.time()))
        await client.hset(f"{prefix}:job:{job_id}", mapping={
            "state": "queued", "tenant": template.tenant, "priority": template.priority.value, "request": value,
            "queued_at": repr(time.time()), "attempts": 0})
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(error, message) -> None:  # on the loop
            if error is not None:
                done.set_exception(RuntimeError(error.str()))
            else:
                done.set_result(message)

        producer.produce(topic, key=template.tenant.encode(), value=value,
                         on_delivery=lambda error, message: loop.call_soon_threadsafe(settle, error, message))
        await done
        return JSONResponse({"job_id": job_id, "status": "queued"}, status_code=202)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kafka", required=True)
    parser.add_argument("--redis", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--prefix", required=True, help="Redis key prefix")
    parser.add_argument("--job", required=True, help="the JobRequest (JSON) every request queues, under a new id")
    args = parser.parse_args()
    uvicorn.run(create_app(args.kafka, args.redis, args.topic, args.prefix, args.job.encode()), host="127.0.0.1", port=args.port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
