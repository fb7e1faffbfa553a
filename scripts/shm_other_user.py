"""Another local user cannot reach a shared-memory segment (issue #32 item 1): this process makes one the way the
shm collectives do and writes a secret into it; a process of another uid (65534, `setpriv`) then tries to open it
through /proc/PID/fd/N (the only way in: the segment has no name) and to find it in /dev/shm. Needs root (setpriv).
Exit 0 when it could not.

    sudo PYTHONPATH=src python scripts/shm_other_user.py
"""

from __future__ import annotations

import os
import subprocess
import sys

from cocoweave.backends.torch import shm

PROBE = """
import os, sys
path = sys.argv[1]
try:
    os.open(path, os.O_RDWR)
    print("OPENED", path)
except OSError as e:
    print("refused:", path, e.strerror)
print("in /dev/shm:", [n for n in os.listdir("/dev/shm") if n.startswith("cocoweave")])
"""


def main() -> int:
    fd = shm.create(4096)
    seg = shm.mapped(fd, 4096)
    seg[:6] = seg.new_tensor(list(b"secret"))
    path = f"/proc/{os.getpid()}/fd/{fd}"
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", PROBE,
                          path], capture_output=True, text=True, timeout=60)
    print(out.stdout.strip() or out.stderr.strip())
    ok = out.returncode == 0 and "OPENED" not in out.stdout and "in /dev/shm: []" in out.stdout
    print(f"mode {os.fstat(fd).st_mode & 0o777:o}; " + ("ok: another user cannot reach it" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
