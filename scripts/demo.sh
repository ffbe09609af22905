#!/usr/bin/env bash
# The whole fleet end to end on the embedded default model: installs what is needed,
# starts Kafka and Redis, the HTTP API, one scheduler and one worker, submits sample
# jobs at the three priorities and prints their results as they arrive.
# The fleet is left running (try `kvfleet submit "hi" --wait`); `scripts/demo.sh --stop`
# stops it all afterwards, and `scripts/stop.sh` stops it at any time.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$REPO"
# The embedded English model (trained by scripts/train_english.py, shipped in the
# package); builtin:tiny, the tests' model, has random weights and writes noise.
export KVFLEET_MODEL="${KVFLEET_MODEL:-builtin:english}"
"$KVFLEET_PY" -m kvfleet.cli infra up
"$KVFLEET_PY" -m kvfleet.cli fleet up --workers "${KVFLEET_WORKERS:-1}"
status=0
"$KVFLEET_PY" -m kvfleet.cli demo || status=$?
if [ "${1:-}" = "--stop" ]; then
  "$REPO/scripts/stop.sh"
else
  echo "The fleet is still running: API at http://127.0.0.1:8000 (docs at /docs), logs in $KVFLEET_HOME/fleet."
  echo "Stop it with: scripts/stop.sh"
fi
exit $status
