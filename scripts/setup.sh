#!/usr/bin/env bash
# Installs what kvfleet needs on a fresh Debian machine; a second run reuses it all.
#   - Debian packages: redis-server, a Java 17 runtime and Maven (for the Kafka broker),
#     and gcc where no C compiler is present (the CPU decode kernel, kernels/native.py)
#   - a Python venv in $KVFLEET_HOME/venv (default ~/.cache/kvfleet) with the exact
#     versions pinned (with hashes) in requirements.lock; re-installed only when it changes
#   - the Apache Kafka jars from Maven Central (fetched by `kvfleet infra up` on first use)
# The other scripts source it for $KVFLEET_PY, $REPO and PYTHONPATH.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export KVFLEET_HOME="${KVFLEET_HOME:-$HOME/.cache/kvfleet}"
mkdir -p "$KVFLEET_HOME"

need=()
command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || need+=(redis-server)
command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || need+=(maven)
# A C compiler builds the CPU decode kernel (kernels/native.py); without one the engine
# runs the torch kernels, about 15% slower on a CPU.
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "[setup] installing Debian packages: ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

VENV="$KVFLEET_HOME/venv"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating venv $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
stamp="$VENV/.kvfleet-deps"
want="$(cat "$REPO/requirements.lock" "$REPO/pyproject.toml" | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing Python dependencies (torch is large; the first time takes a few minutes)"
  # Every version and hash comes from the lock; the project itself is installed without
  # resolving anything, so a new machine runs exactly what CI ran.
  if ! { "$VENV/bin/pip" install -q --require-hashes -r "$REPO/requirements.lock" &&
         "$VENV/bin/pip" install -q --no-deps -e "$REPO"; } > "$KVFLEET_HOME/pip.log" 2>&1; then
    tail -40 "$KVFLEET_HOME/pip.log"; echo "[setup] pip install failed; full log: $KVFLEET_HOME/pip.log"; exit 1
  fi
  echo "$want" > "$stamp"
else
  # Dependencies are current; only point the kvfleet entry points at this checkout.
  "$VENV/bin/pip" install -q --no-deps -e "$REPO" >/dev/null 2>&1
fi
export KVFLEET_PY="$VENV/bin/python"
# This checkout's modules come first even if another clone installed itself last.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$VENV/bin:$PATH"
echo "[setup] ready: $("$KVFLEET_PY" -c 'import torch, celery, kafka; print(f"torch {torch.__version__}, celery {celery.__version__}, kafka-python {kafka.__version__}")')"
