#!/bin/sh
# Make a local base image for deploy/docker/Dockerfile where no image registry is reachable:
# a minimal Debian bookworm (debootstrap --variant=minbase) with Python 3.11 and venv, from the
# Debian mirror apt uses, imported into podman as TAG. Needs root (debootstrap) and a few
# minutes; does nothing when TAG exists already (FORCE=1 remakes it).
#
#   sudo deploy/docker/podman-base.sh [TAG]        (default localhost/downpour-base:bookworm)
#   deploy/docker/podman-build.sh                  (builds downpour on it)
#
# Environment: MIRROR (default: the first Debian URI of this machine's apt sources, else
# http://deb.debian.org/debian), PODMAN (default: podman).
set -eu

TAG=${1:-localhost/downpour-base:bookworm}
PODMAN=${PODMAN:-podman}

if [ "${FORCE:-0}" != 1 ] && $PODMAN image exists "$TAG"; then
    echo "podman-base: $TAG exists"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "podman-base: debootstrap not installed" >&2; exit 3; }
[ "$(id -u)" = 0 ] || { echo "podman-base: debootstrap needs root" >&2; exit 3; }

if [ -z "${MIRROR:-}" ]; then
    MIRROR=$(sed -n 's/^URIs: *\(http[^ ]*\/debian\)\/*$/\1/p' /etc/apt/sources.list.d/*.sources \
        2>/dev/null | head -n 1)
    MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi

ROOT=$(mktemp -d /var/tmp/downpour-base.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
echo "podman-base: debootstrap bookworm from $MIRROR (a few minutes)"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$ROOT/rootfs" "$MIRROR" > "$ROOT/debootstrap.log" 2>&1 \
    || { tail -n 20 "$ROOT/debootstrap.log" >&2; echo "podman-base: debootstrap failed" >&2; exit 3; }
# what an image does not need: package caches and lists, man pages
rm -rf "$ROOT/rootfs/var/cache/apt/archives/"*.deb "$ROOT/rootfs/var/lib/apt/lists/"* \
    "$ROOT/rootfs/usr/share/man/"* "$ROOT/rootfs/usr/share/doc/"*
tar -C "$ROOT/rootfs" -c . | $PODMAN import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --message "debootstrap --variant=minbase bookworm + python3, python3-venv" \
    - "$TAG"
echo "podman-base: made $TAG"
