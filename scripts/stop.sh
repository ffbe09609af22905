#!/usr/bin/env bash
# Stops the local fleet (API, scheduler, workers), then Kafka and Redis. Data is kept.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh" >/dev/null
"$KVFLEET_PY" -m kvfleet.cli fleet down
"$KVFLEET_PY" -m kvfleet.cli infra down
