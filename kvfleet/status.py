"""`kvfleet status`: the fleet on one screen, redrawn every couple of seconds like `top`.

    kvfleet status                 live, until Ctrl-C
    kvfleet status --once          one frame on stdout, no terminal control codes

`frame(snapshot)` is a pure function from a `Snapshot` (kvfleet/snapshot.py, which says
where each number comes from) to text, so what an operator reads is unit-tested on
made-up data; `watch` only repeats collect → draw.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from kvfleet.recent import Latency, Throughput
from kvfleet.snapshot import Collector, Snapshot

#: Often enough to follow a burst, rarely enough that the view itself costs nothing.
REFRESH_S = 2.0
#: Home the cursor and clear to the end of the screen: the next frame overwrites the
#: last in place instead of scrolling.
_REDRAW = "\x1b[H\x1b[J"


def _n(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole > 0 else "-"


def _s(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.2f}s"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns, two spaces apart, indented under their section's title."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    return ["  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [headers, *rows]]


def _workers(s: Snapshot) -> list[str]:
    lines = [f"WORKERS ({len(s.workers)} live)"]
    if not s.workers:
        return lines + ["  none: no worker heartbeat in Redis"]
    rows = [[w.worker_id, w.model or "?",
             f"{w.used_tokens:,} / {w.capacity_tokens:,} ({_pct(w.used_tokens, w.capacity_tokens)})", str(w.running),
             w.health + (f" ({w.heartbeat_age_s:.1f}s ago)" if w.heartbeat_age_s is not None else "")]
            for w in s.workers]
    return lines + _table(["ID", "MODEL", "KV USED / TOTAL", "RUNNING", "HEARTBEAT"], rows)


def _classes(s: Snapshot) -> list[str]:
    rows = [[c.priority, _n(c.buffered), _n(c.lag), _n(c.paused),
             "-" if c.holding is None else ("yes" if c.holding else "no"), f"{c.reserved_tokens:,}"] for c in s.classes]
    return ["CLASSES"] + _table(["CLASS", "BUFFERED", "LAG", "PAUSED", "HOLDING", "RESERVED TOKENS"], rows)


def _tenants(s: Snapshot) -> list[str]:
    lines = ["TENANTS"]
    if not s.tenants:
        return lines + ["  none configured, none holding tokens"]
    rows = []
    for t in s.tenants:
        quota = "no quota"
        if t.quota_size is not None:
            quota = f"{t.quota_used:,} / {t.quota_size:,} ({_pct(t.quota_used or 0, t.quota_size)})"
            if t.quota_reset_s:
                quota += f", full in {t.quota_reset_s:.0f}s"
        rows.append([t.name, t.tier, f"{t.reserved_tokens:,}", quota])
    return lines + _table(["TENANT", "TIER", "RESERVED TOKENS", "QUOTA USED / BUCKET"], rows)


def _recent(s: Snapshot) -> list[str]:
    r: Optional[Throughput] = s.recent
    title = f"LAST MINUTE (finished jobs on {s.results_topic or 'the results topic'})"
    if r is None:
        return [title, "  unavailable"]
    statuses = ", ".join(f"{k} {v}" for k, v in sorted(r.by_status.items())) or "none"
    lines = [title, f"  finished {r.finished} ({statuses})   {r.jobs_per_minute:.1f} jobs/min   "
                    f"{r.tokens_per_s:.1f} output tokens/s"]
    named: list[tuple[str, Latency]] = [("queue wait", r.queue), ("first token", r.ttft),
                                        ("per output token", r.tpot), ("total", r.total)]
    return lines + _table(["LATENCY", "P50", "P95", "JOBS"],
                          [[name, _s(lat.p50), _s(lat.p95), str(lat.samples)] for name, lat in named])


def frame(s: Snapshot) -> str:
    """One screen of text for `s`; no control codes, so it can be printed, logged or diffed."""
    api = {True: "ready", False: "not ready", None: "unreachable"}[s.api_ready]
    head = [f"kvfleet status   {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(s.taken_at))}   "
            f"API {s.api_url} {api}",
            f"budget: {s.in_use_tokens:,} / {s.capacity_tokens:,} tokens reserved "
            f"({_pct(s.in_use_tokens, s.capacity_tokens)})   admitted, not started: "
            f"{s.unstarted_jobs} jobs, {s.unstarted_tokens:,} tokens"]
    sections = [head, _workers(s), _classes(s), _tenants(s), _recent(s)]
    if s.errors:
        sections.append(["ERRORS"] + [f"  {e}" for e in s.errors])
    return "\n\n".join("\n".join(lines) for lines in sections) + "\n"


def watch(collector: Collector, *, once: bool = False, out: Optional[TextIO] = None,
          refresh_s: float = REFRESH_S) -> int:
    """Draw frames until Ctrl-C (or one, with `once`) on `out` (default: the
    `sys.stdout` of the moment, so a redirected stdout is honoured); the exit status."""
    out = out or sys.stdout
    try:
        while True:
            text = frame(collector.collect())
            if once:
                out.write(text)
                out.flush()
                return 0
            out.write(_REDRAW + text)
            out.flush()
            time.sleep(refresh_s)  # a display's refresh period, not a wait for a condition
    except KeyboardInterrupt:
        return 0
    finally:
        collector.close()
