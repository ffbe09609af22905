"""The `kvfleet` command.

    kvfleet submit "Once upon a time" --priority high --tenant acme --wait
    kvfleet get JOB_ID [--wait 30]
    kvfleet cancel JOB_ID
    kvfleet batch submit FILE [--wait] [--output PATH]   OpenAI Batch API, with a progress bar
    kvfleet batch status BATCH_ID
    kvfleet infra up|down|status        local Kafka (KRaft) and Redis
    kvfleet fleet up|down|status        API + scheduler + workers in the background
    kvfleet status [--once]             workers, classes, tenants, the last minute, like `top`
    kvfleet demo                        submit sample jobs at all priorities, print results
    kvfleet api | scheduler | worker    run one service in the foreground
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Optional

import msgspec

from kvfleet.contracts import JobResult


def _result_line(r: JobResult) -> str:
    t = r.timings
    latency = f"{(t.finished_at - t.queued_at):.2f}s" if t.finished_at and t.queued_at else "-"
    ttft = f"{(t.first_token_at - t.started_at) * 1000:.0f}ms" if t.first_token_at and t.started_at else "-"
    if r.error is not None:
        return f"{r.job_id} [{r.priority.value:<6}] {r.status.value}: {r.error.code}: {r.error.message}"
    return (f"{r.job_id} [{r.priority.value:<6}] {r.status.value} tokens={r.usage.completion_tokens} "
            f"ttft={ttft} total={latency} text={(r.text or '')[:60]!r}")


def cmd_submit(args: argparse.Namespace) -> int:
    from producer.client import Client, ClientError

    with Client(args.url, tenant=args.tenant, api_key=args.api_key) as client:
        try:
            job_id = client.submit(args.prompt, priority=args.priority, max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                   seed=args.seed, stop=args.stop, job_id=args.job_id)
        except ClientError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if not args.wait:
            print(job_id)
            return 0
        result = client.wait(job_id, timeout=args.timeout)
        print(msgspec.json.format(msgspec.json.encode(result)).decode() if args.json else _result_line(result))
        return 0 if result.status.value == "done" else 1


def cmd_get(args: argparse.Namespace) -> int:
    from producer.client import Client, ClientError

    with Client(args.url, tenant=args.tenant, api_key=args.api_key) as client:
        try:
            result = client.get(args.job_id, wait=args.wait)
        except ClientError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(msgspec.json.format(msgspec.json.encode(result)).decode())
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from producer.client import Client, ClientError

    with Client(args.url, tenant=args.tenant, api_key=args.api_key) as client:
        try:
            result = client.cancel(args.job_id)
        except ClientError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(_result_line(result))
    return 0


def _batch_client(args: argparse.Namespace):
    import httpx

    headers = {}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    if args.tenant:
        headers["X-Tenant-ID"] = args.tenant
    return httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=120)


def _batch_call(response) -> dict:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise SystemExit(f"error: {response.status_code}: {message}")
    return response.json()


def cmd_batch(args: argparse.Namespace) -> int:
    """Upload a JSONL file, create a batch, and with --wait follow it and download its output."""
    with _batch_client(args) as http:
        if args.action == "status":
            print(json.dumps(_batch_call(http.get(f"/v1/batches/{args.target}")), indent=2))
            return 0
        with open(args.target, "rb") as f:
            first = json.loads(f.readline() or b"{}")
            f.seek(0)
            file = _batch_call(http.post("/v1/files", data={"purpose": "batch"},
                                         files={"file": (args.target.rsplit("/", 1)[-1], f, "application/jsonl")}))
        batch = _batch_call(http.post("/v1/batches", json={
            "input_file_id": file["id"], "endpoint": args.endpoint or first.get("url", "/v1/chat/completions"),
            "completion_window": args.window}))
        print(f"{batch['id']} ({file['id']}, {batch['request_counts']['total']} requests)", file=sys.stderr)
        if not args.wait:
            print(batch["id"])
            return 0
        batch = _follow(http, batch)
        print(f"{batch['id']}: {batch['status']}, {batch['request_counts']}", file=sys.stderr)
        for key, suffix in (("output_file_id", ""), ("error_file_id", ".errors")):
            if batch.get(key):
                path = (args.output or f"{batch['id']}.jsonl") + suffix
                with http.stream("GET", f"/v1/files/{batch[key]}/content") as response, open(path, "wb") as out:
                    for chunk in response.iter_bytes():
                        out.write(chunk)
                print(f"{key.split('_')[0]} lines: {path}", file=sys.stderr)
        return 0 if batch["status"] == "completed" else 1


def _follow(http, batch: dict) -> dict:
    """Poll the batch until it ends, with a bar of lines done / total, the rate and the ETA."""
    from tqdm import tqdm

    final = {"completed", "failed", "expired", "cancelled"}
    with tqdm(total=batch["request_counts"]["total"], unit="line", desc=batch["id"]) as bar:
        while batch["status"] not in final:
            time.sleep(1.0)
            batch = _batch_call(http.get(f"/v1/batches/{batch['id']}"))
            counts = batch["request_counts"]
            bar.update(counts["completed"] + counts["failed"] - bar.n)
            bar.set_postfix(status=batch["status"], failed=counts["failed"])
    return batch


def cmd_infra(args: argparse.Namespace) -> int:
    import kvfleet.infra as infra

    if args.action == "up":
        print(json.dumps(infra.up()))
    elif args.action == "down":
        infra.down()
    else:
        print(json.dumps(infra.status()))
    return 0


def cmd_fleet(args: argparse.Namespace) -> int:
    from kvfleet import fleet
    from kvfleet.settings import Settings

    if args.action == "up":
        fleet.up(Settings.from_env(), workers=args.workers)
    elif args.action == "down":
        fleet.down()
    else:
        print(json.dumps(fleet.status()))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from kvfleet.settings import Settings
    from kvfleet.snapshot import Collector
    from kvfleet.status import watch

    settings = Settings.from_env()
    if args.redis_url:
        settings = settings.replace(redis=dataclasses.replace(settings.redis, url=args.redis_url))
    if args.kafka:
        settings = settings.replace(kafka=dataclasses.replace(settings.kafka, bootstrap=args.kafka))
    metrics = args.scheduler_metrics or [f"http://127.0.0.1:{settings.scheduler.metrics_port}/metrics"]
    collector = Collector(settings, api_url=args.url or settings.api.base_url, scheduler_metrics=metrics)
    return watch(collector, once=args.once, refresh_s=args.interval)


#: Openings in the voice of the demo's model, builtin:english, which learnt English from
#: fortune(6)'s quotations (scripts/train_english.py).
DEMO_PROMPTS = [
    ("high", "acme", "The best way to"),
    ("normal", "acme", "Life is"),
    ("low", "globex", "A man who"),
    ("high", "globex", "Never trust a"),
    ("normal", "globex", "You will"),
    ("low", "acme", "Once upon a time"),
]


def cmd_demo(args: argparse.Namespace) -> int:
    from producer.client import Client

    start = time.monotonic()
    pending: dict[str, Client] = {}
    clients = {t: Client(args.url, tenant=t) for t in {t for _, t, _ in DEMO_PROMPTS}}
    for i, (priority, tenant, prompt) in enumerate(DEMO_PROMPTS):
        job_id = clients[tenant].submit(prompt, priority=priority, max_new_tokens=args.max_new_tokens,
                                        temperature=0.0 if i % 2 == 0 else 0.8, seed=i)
        pending[job_id] = clients[tenant]
        print(f"submitted {job_id} priority={priority} tenant={tenant} prompt={prompt!r}", flush=True)
    failures = 0
    while pending:
        for job_id, client in list(pending.items()):
            result = client.get(job_id, wait=0.5)
            if result.status.terminal:
                print(_result_line(result), flush=True)
                failures += result.status.value != "done"
                del pending[job_id]
        if time.monotonic() - start > args.timeout:
            print(f"timed out with {len(pending)} job(s) unfinished", file=sys.stderr)
            return 1
    print(f"{len(DEMO_PROMPTS)} jobs finished in {time.monotonic() - start:.1f}s, {failures} failed", flush=True)
    for client in clients.values():
        client.close()
    return 1 if failures else 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfleet", description="An asynchronous LLM inference fleet.")
    sub = parser.add_subparsers(dest="command", required=True)

    def client_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", default="http://127.0.0.1:8000", help="the API's base URL")
        p.add_argument("--tenant", default=None, help="X-Tenant-ID (without API keys)")
        p.add_argument("--api-key", default=None)

    p = sub.add_parser("submit", help="queue a job")
    p.add_argument("prompt")
    client_opts(p)
    p.add_argument("--priority", default="normal", choices=["high", "normal", "low"])
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--job-id", default=None, help="your own id, for idempotent retries")
    p.add_argument("--wait", action="store_true", help="wait for the result and print it")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("get", help="a job's state and result")
    p.add_argument("job_id")
    client_opts(p)
    p.add_argument("--wait", type=float, default=0.0, help="long-poll up to this many seconds")
    p.set_defaults(func=cmd_get)

    p = sub.add_parser("cancel", help="cancel a job that has not ended")
    p.add_argument("job_id")
    client_opts(p)
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("batch", help="OpenAI Batch API: submit a JSONL file, or a batch's status")
    p.add_argument("action", choices=["submit", "status"])
    p.add_argument("target", help="submit: the JSONL file; status: the batch id")
    client_opts(p)
    p.add_argument("--endpoint", default=None, help="default: the first line's url")
    p.add_argument("--window", default="24h", help="completion window, e.g. 24h")
    p.add_argument("--wait", action="store_true", help="show progress, then download the output")
    p.add_argument("--output", default=None, help="where the output goes (default: BATCH_ID.jsonl; errors "
                                                  "next to it with .errors)")
    p.set_defaults(func=cmd_batch)

    p = sub.add_parser("infra", help="local Kafka and Redis")
    p.add_argument("action", choices=["up", "down", "status"])
    p.set_defaults(func=cmd_infra)

    p = sub.add_parser("fleet", help="local API, scheduler and workers in the background")
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--workers", type=int, default=1)
    p.set_defaults(func=cmd_fleet)

    p = sub.add_parser("status", help="a live view of the fleet (workers, classes, tenants, last minute)")
    p.add_argument("--once", action="store_true", help="print one frame, without terminal control codes, and exit")
    p.add_argument("--url", default=None, help="the API's base URL (default: from KVFLEET_API_HOST/PORT)")
    p.add_argument("--redis-url", default=None, help="the state Redis (default: KVFLEET_REDIS_URL)")
    p.add_argument("--kafka", default=None, help="Kafka bootstrap servers (default: KVFLEET_KAFKA_BOOTSTRAP)")
    p.add_argument("--scheduler-metrics", action="append", default=None, metavar="URL",
                   help="a scheduler's /metrics (repeat for each replica; default: port KVFLEET_SCHEDULER_METRICS_PORT "
                        "on this host)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between frames")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("demo", help="submit sample jobs at the three priorities and print their results")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=300.0)
    p.set_defaults(func=cmd_demo)

    for name, target in (("api", "producer.api"), ("scheduler", "scheduler.service"), ("worker", "workers.service")):
        p = sub.add_parser(name, help=f"run the {name} in the foreground")
        p.set_defaults(func=lambda _a, t=target: __import__(t, fromlist=["main"]).main() or 0)

    args = parser.parse_args(argv)
    import httpx

    try:
        return args.func(args)
    except httpx.TransportError as exc:
        url = getattr(args, "url", "the API")
        print(f"error: cannot reach {url} ({exc}); is the fleet up? (`kvfleet fleet up` or scripts/demo.sh)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
