#!/usr/bin/env bash
# Shared-memory segments are not bounded by /dev/shm's size (issue #32 item 3; Docker's default is 64 MiB): in a
# private mount namespace with a 1 MiB /dev/shm, reserve and write a 256 MiB segment the way the shm collectives
# do (backends/torch/shm.py: memfd_create + posix_fallocate), while a 2 MiB file in /dev/shm fails. Needs root
# (unshare -m, mount). Exit 0 when the segment works.
#   sudo scripts/shm_small_devshm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD/src
unshare -m bash -c "mount -t tmpfs -o size=1m tmpfs /dev/shm && df -h /dev/shm | tail -1 && \"$PY\" -c '
from cocoweave.backends.torch import shm
fd = shm.create(256 << 20)
t = shm.mapped(fd, 256 << 20)
t.fill_(1)
print(\"a 256 MiB segment reserved and written under a 1 MiB /dev/shm:\", int(t.sum()) == 256 << 20)
try:
    open(\"/dev/shm/cocoweave-probe\", \"wb\").write(bytes(2 << 20))
except OSError as e:
    print(\"while a 2 MiB file in /dev/shm fails:\", e.strerror)
'"
