#!/bin/sh
# A base image for docker/Dockerfile.* made from Debian's packages alone, for a machine that
# reaches a Debian mirror but no image registry: debootstrap's minbase of bookworm (python3 is
# 3.11) with python3-venv, ca-certificates and libjemalloc2 (the servers' malloc), committed by buildah. Run as root:
#   docker/debian-base.sh [IMAGE]          # IMAGE: localhost/nlmserve-base:bookworm
#   buildah bud --isolation chroot --build-arg BASE=localhost/nlmserve-base:bookworm \
#       -f docker/Dockerfile.cpu -t nlmserve:cpu .
# An image of that name already present is kept (`buildah rmi IMAGE` to make it again).
# SUITE (bookworm) and MIRROR (http://deb.debian.org/debian) may be set.
set -eu
image=${1:-localhost/nlmserve-base:bookworm}
suite=${SUITE:-bookworm}
mirror=${MIRROR:-http://deb.debian.org/debian}

if buildah inspect --type image "$image" >/dev/null 2>&1; then
  echo "$image: present, kept"
  exit 0
fi
for tool in buildah debootstrap; do
  command -v "$tool" >/dev/null 2>&1 || { echo "$0: needs $tool (Debian package $tool)" >&2; exit 1; }
done

work=nlmserve-base-work
buildah rm "$work" >/dev/null 2>&1 || true    # left by a run that was killed
container=$(buildah from --name "$work" scratch)
mnt=
cleanup() {
  if [ -n "$mnt" ]; then umount "$mnt/proc" "$mnt/sys" 2>/dev/null || true; fi
  buildah rm "$container" >/dev/null 2>&1 || true
}
trap cleanup EXIT
trap 'exit 1' HUP INT TERM
mnt=$(buildah mount "$container")
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,libjemalloc2 "$suite" "$mnt" "$mirror"
rm -rf "$mnt"/var/cache/apt/archives/*.deb "$mnt"/var/lib/apt/lists/*
buildah umount "$container" >/dev/null
mnt=
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
  --cmd /bin/sh --label "org.opencontainers.image.description=Debian $suite minbase with python3" "$container"
buildah commit --quiet "$container" "$image" >/dev/null
echo "$image: made"
