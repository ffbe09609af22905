#!/usr/bin/env bash
# Makes the base image `kvfleet-base:bookworm` from the Debian archive, for machines
# that reach Debian's packages but no image registry (docker-compose.local.yml builds
# every service on it). Idempotent: an existing image is kept.
#   deploy/local/base.sh            needs root, debootstrap and a running dockerd
set -euo pipefail
IMAGE="${KVFLEET_BASE_IMAGE:-kvfleet-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "[base] $IMAGE exists"; exit 0
fi
command -v debootstrap >/dev/null || { echo "[base] needs debootstrap: apt-get install -y debootstrap" >&2; exit 1; }
root="$(mktemp -d /var/tmp/kvfleet-rootfs.XXXXXX)"
trap 'rm -rf "$root"' EXIT
echo "[base] debootstrap --variant=minbase bookworm $root ($MIRROR)"
debootstrap --variant=minbase --include=ca-certificates bookworm "$root" "$MIRROR" >/dev/null
# Certificate authorities this machine added locally (a TLS-inspecting egress proxy's,
# a company's): builds inside the image reach PyPI and Maven Central through the same
# path as the host, so they must trust the same authorities.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >/dev/null
fi
# apt inside the image reads the same mirror; no recommends keeps the layers small.
echo "deb $MIRROR bookworm main" > "$root/etc/apt/sources.list"
echo 'APT::Install-Recommends "false";' > "$root/etc/apt/apt.conf.d/99norecommends"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import - "$IMAGE" >/dev/null
echo "[base] $IMAGE imported"
