"""Fail points: named places in the code where a fault can be injected on purpose.

For chaos runs and fault tests that need a real process to misbehave the way hardware
or a driver does (a CUDA error in every step, say), without a mock in its place. Off
unless `KVFLEET_FAILPOINTS` names one, e.g.

    KVFLEET_FAILPOINTS="engine.step=raise"        every hit raises InjectedFault
    KVFLEET_FAILPOINTS="engine.step=raise:3"      the next 3 hits raise, then it is off

The idea (and the name) is FreeBSD's fail(9) and TiKV's fail-rs. A hit costs one dict
lookup when nothing is configured.
"""

from __future__ import annotations

import os
import threading

ENV = "KVFLEET_FAILPOINTS"


class InjectedFault(RuntimeError):
    """Raised by a fail point; looks to its caller like any infrastructure fault."""


class _Point:
    def __init__(self, spec: str) -> None:
        action, _, count = spec.partition(":")
        if action != "raise":
            raise ValueError(f"{ENV}: unknown action {action!r}; use 'raise' or 'raise:N'")
        self.left = int(count) if count else None  # None: for ever

    def fire(self) -> bool:
        if self.left is None:
            return True
        if self.left <= 0:
            return False
        self.left -= 1
        return True


_lock = threading.Lock()
_points: dict[str, _Point] = {}


def configure(spec: str) -> None:
    """Replace the configured points with `spec` ("name=action,name=action"; '' = none)."""
    points = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, action = item.partition("=")
        if not sep:
            raise ValueError(f"{ENV}: {item!r} is not name=action (e.g. engine.step=raise)")
        points[name.strip()] = _Point(action.strip())
    with _lock:
        _points.clear()
        _points.update(points)


def hit(name: str) -> None:
    """Raise InjectedFault if the point `name` is armed."""
    if not _points:
        return
    with _lock:
        point = _points.get(name)
        fire = point is not None and point.fire()
    if fire:
        raise InjectedFault(f"fail point {name!r} ({ENV})")


configure(os.environ.get(ENV, ""))
