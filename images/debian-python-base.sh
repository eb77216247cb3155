#!/usr/bin/env bash
# Make the Debian/Python base image of the CPU images locally, from Debian packages, where no
# container registry is reachable: debootstrap a minimal bookworm with Python 3.11 (the
# Python of the local CPU torch wheel) and `podman import` it as IMAGE.
#
# The image is what python:3.11-slim offers the Dockerfiles: `python3` and pip on PATH,
# installable by root (a venv at /opt/venv: Debian's own Python refuses system-wide pip).
#   usage: debian-python-base.sh IMAGE
set -euo pipefail
image=${1:?usage: $0 IMAGE}
suite=${DEBIAN_SUITE:-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

root=$(mktemp -d /var/tmp/omni-base.XXXXXX)
trap 'rm -rf "$root"' EXIT

# minbase: dpkg, apt and the essential set, no init system or docs. libnuma1 and libstdc++6 are
# what vLLM's CPU extension links against besides libc.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,libnuma1,libstdc++6 \
  "$suite" "$root" "$mirror" >/dev/null
chroot "$root" python3 -m venv /opt/venv
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
  "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/var/log/*.log
# No host name or resolver of this machine in the image (the engine provides its own at run time).
: >"$root/etc/resolv.conf"; : >"$root/etc/hostname"

tar --numeric-owner -C "$root" -c . | podman import --quiet \
  --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  - "$image" >/dev/null
echo "$image"
