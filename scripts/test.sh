#!/usr/bin/env bash
# Installs what is needed, starts the real Kafka broker and Redis, runs the test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k jobstore, or -m slow).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$REPO"
"$KVFLEET_PY" -m kvfleet.cli infra up
exec "$KVFLEET_PY" -m pytest "$@"
