"""Writing a file so that readers see the old contents or the new, never half of it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text(path: Path, text: str, durable: bool = True) -> Path:
    """Write `text` to `path` through a temporary file in the same folder and a rename. `durable` also
    fsyncs before the rename (state that must survive a crash); caches that are rebuilt when lost skip it.
    Raises OSError; the temporary file never stays behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}-")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
