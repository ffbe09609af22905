#!/usr/bin/env bash
# Makes Docker usable on a Debian machine for `./scripts/test.sh -m docker`: installs
# Debian's docker.io, docker-compose (1.29) and debootstrap if missing, and starts
# dockerd if no engine answers. Exits non-zero, saying why, where that cannot be done
# (then the docker test skips with the reason).
set -euo pipefail
need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
if [ ${#need[@]} -gt 0 ]; then
  echo "[docker] installing Debian packages: ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  echo "[docker] starting dockerd (log: /var/log/kvfleet-dockerd.log)"
  $SUDO sh -c 'nohup dockerd >/var/log/kvfleet-dockerd.log 2>&1 &'
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
docker info >/dev/null 2>&1 || { echo "[docker] no Docker engine: see /var/log/kvfleet-dockerd.log" >&2; exit 1; }
echo "[docker] ready: $(docker version --format 'engine {{.Server.Version}}'), $(docker-compose version --short)"
