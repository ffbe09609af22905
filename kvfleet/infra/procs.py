"""Small helpers for the local daemons: where their files live, pid files, waiting."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Callable

from kvfleet.settings import Settings


def home() -> Path:
    """Everything installed or started locally lives here, outside the clone, so a second
    clone (CI's) reuses what the first downloaded. Override with KVFLEET_HOME."""
    path = Path(Settings.from_env().home)
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_pid(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if pid_alive(pid) else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); treat it as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_until(check: Callable[[], bool], timeout: float, what: str, *, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    tail = ""
    if log is not None and log.exists():
        tail = "\n--- last lines of " + str(log) + " ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    raise TimeoutError(f"{what} did not come up within {timeout:.0f}s{tail}")


def stop_pid(pidfile: Path, name: str, timeout: float = 30.0) -> bool:
    """SIGTERM, wait, then SIGKILL. Returns True if something was running."""
    pid = read_pid(pidfile)
    if pid is None:
        pidfile.unlink(missing_ok=True)
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)
    print(f"stopped {name} (pid {pid})", flush=True)
    return True
