"""kvfleet/heap.py in a process of its own (a freeze is process-wide and would reach
into this test session's heap): what it freezes, and that what comes later is still
collected, cycles included. tests/test_e2e.py checks that every service of a real
fleet freezes its startup heap by default, and none with KVFLEET_GC_FREEZE=0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvfleet.settings import Settings

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import gc, json, weakref
from kvfleet import heap

class Node:
    pass

startup = [Node() for _ in range(1000)]           # lives as long as the process
garbage = Node(); garbage.self = garbage; del garbage  # a cycle nobody holds: collected first
before = len(gc.get_objects())
frozen = heap.freeze_startup_heap("test")
after = len(gc.get_objects())
later = Node(); later.self = later; gone = weakref.ref(later); del later  # a cycle made afterwards
gc.collect()
print(json.dumps({"frozen": frozen, "count": gc.get_freeze_count(), "before": before, "after": after,
                  "later_collected": gone() is None,
                  "startup_frozen": all(not any(o is n for o in gc.get_objects()) for n in startup[:3])}))
"""


def test_the_startup_heap_leaves_the_collector_and_later_cycles_are_still_collected():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["frozen"] == report["count"] >= 1000, report  # the 1,000 startup objects at least
    assert report["after"] < report["before"] - 1000, report  # the collector no longer tracks them
    assert report["startup_frozen"], report
    assert report["later_collected"], report  # a cycle made after the freeze is still freed


def test_the_setting_defaults_on_and_turns_off():
    assert Settings.from_env({}).gc_freeze is True
    assert Settings.from_env({"KVFLEET_GC_FREEZE": "0"}).gc_freeze is False
