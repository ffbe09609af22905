"""Running a test module's `TestUnderInterpreter` class in a child pytest with
TRITON_INTERPRET=1: Triton's jit reads the switch at import, so the Triton half of a
kernel test needs a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_under_interpreter(test_file: str, timeout_s: float) -> None:
    """Fails unless every test of `test_file`'s TestUnderInterpreter ran and passed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", f"{test_file}::TestUnderInterpreter", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]
