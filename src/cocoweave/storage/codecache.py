"""The on-disk cache of generated source (torch step modules, Triton kernels): readable files, bounded in size.

    path = write_source(source, key)      # cache_dir()/KEY.py, or None when the cache cannot be written
    path = source_file(source, key)       # always a real file: the cache, else a private temporary folder

The cache is a convenience: generated code runs from memory (the executable `exec`s its source), so a cache
that cannot be written costs one warning per folder and process, never a run. Triton reads a kernel's source
from its file, so kernels fall back to a private temporary folder (removed when the process exits).
Writing a new file prunes the folder to the newest `max_files()` files and `max_bytes()` bytes (a cache hit
touches its file, so what is in use stays newest).

The cache holds code that runs, so it is trusted as the state folder is (`statedir.check_private_folder`): its
folder, `plans/` and `plans/__pycache__` must be real folders of this user that neither other users nor the group
may write into (cocoweave makes them mode 0700). A cache that fails this is not used at all, with one warning
naming why: step code runs from memory and kernels from a private temporary folder, so nothing planted there (a
module, an unchecked `.pyc`) is ever imported.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from .. import settings
from ..errors import CocoweaveError
from .atomic import write_text
from .statedir import check_private_folder

log = logging.getLogger(__name__)

CACHE_ENV = settings.CODE_CACHE.name
MAX_FILES_ENV = settings.CACHE_MAX_FILES.name
MAX_MB_ENV = settings.CACHE_MAX_MB.name
SUFFIX = ".py"

_WARNED: set[str] = set()  # folders this process has warned about
_PRIVATE: list[Path] = []  # this process's temporary folder, once made


class CacheWarning(UserWarning):
    """The code cache could not be written; generated code runs from memory (or a temporary folder)."""


def cache_dir() -> Path:
    """Where generated modules are kept: $COCOWEAVE_CACHE/plans, else the user's cache folder (the XDG rule:
    $XDG_CACHE_HOME when it is an absolute path, else ~/.cache) /cocoweave/plans."""
    folder = settings.CODE_CACHE.get()
    if folder:
        return folder / "plans"
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "cocoweave" / "plans"


def max_files() -> int:
    """How many files the cache keeps: $COCOWEAVE_CACHE_MAX_FILES, default 1000."""
    return int(settings.CACHE_MAX_FILES.get())


def max_bytes() -> int:
    """How many bytes the cache keeps: $COCOWEAVE_CACHE_MAX_MB megabytes, default 100."""
    return int(settings.CACHE_MAX_MB.get() * 1e6)


def _warn_once(folder: Path, exc: OSError | CocoweaveError) -> None:
    log.debug("the code cache %s cannot be written: %s", folder, exc)
    if str(folder) not in _WARNED:
        _WARNED.add(str(folder))
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        warnings.warn(f"the code cache {folder} cannot be written ({why}); generated code runs "
                      f"from memory (set {CACHE_ENV} to a writable folder to keep it)", CacheWarning, stacklevel=3)


def _write(folder: Path, source: str, key: str) -> Path:
    """`folder/KEY.py` holding `source` (kept if it already does, else written atomically). Raises OSError."""
    path = folder / f"{key}{SUFFIX}"
    try:
        same = path.read_text() == source
    except (OSError, UnicodeDecodeError):
        same = False
    if same:
        try:
            os.utime(path)  # in use: the newest file is pruned last
        except OSError:
            pass
        return path
    write_text(path, source, durable=False)  # a cache: regenerated if lost
    log.debug("generated code cached at %s", path)
    prune(folder, keep=path)
    return path


def trusted_cache_dir() -> Path:
    """cache_dir(), made (mode 0700) if absent and checked: it, its parent and its `__pycache__` must be real
    folders of this user that neither other users nor the group may write into. Raises CocoweaveError naming
    the folder and what is wrong, or OSError when it cannot be made."""
    folder = cache_dir()
    how = f"point ${CACHE_ENV} at a folder of your own that only you may write into (chmod 700)"
    folder.parent.parent.mkdir(parents=True, exist_ok=True)
    for part in (folder.parent, folder):
        part.mkdir(mode=0o700, exist_ok=True)
    for part in (folder.parent, folder, folder / "__pycache__"):  # checked once they exist: no window between
        check_private_folder(part, "the code cache folder", how, group_may_write=False)
    return folder


def write_source(source: str, key: str) -> Path | None:
    """Cache `source` as cache_dir()/KEY.py and return its path; None (with one warning) when the cache
    cannot be written or is not trusted (see `trusted_cache_dir`)."""
    folder = cache_dir()
    try:
        return _write(trusted_cache_dir(), source, key)
    except (OSError, CocoweaveError) as exc:
        _warn_once(folder, exc)
        return None


def source_file(source: str, key: str) -> Path:
    """A real file holding `source` (Triton reads kernel source from files): the cache, or when it cannot be
    written, a temporary folder private to this process."""
    path = write_source(source, key)
    if path is not None:
        return path
    if not _PRIVATE:
        _PRIVATE.append(Path(tempfile.mkdtemp(prefix="cocoweave-code-")))  # mode 0700
        atexit.register(shutil.rmtree, _PRIVATE[0], True)
    return _write(_PRIVATE[0], source, key)


def prune(folder: Path, keep: Path | None = None) -> int:
    """Delete the oldest cached files of `folder` until at most max_files() files and max_bytes() bytes
    remain (never `keep`); returns how many were deleted. Files other processes delete first are skipped."""
    entries = []
    try:
        with os.scandir(folder) as it:
            for e in it:
                if e.name.endswith(SUFFIX) and not e.name.startswith(".") and e.is_file(follow_symlinks=False):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    entries.append((st.st_mtime, e.name, st.st_size))
    except OSError:
        return 0
    entries.sort(reverse=True)  # newest first
    limit_files, limit_bytes = max_files(), max_bytes()
    count = total = removed = 0
    for _, name, size in entries:
        count += 1
        total += size
        if (count > limit_files or total > limit_bytes) and (keep is None or name != keep.name):
            try:
                (folder / name).unlink()
                removed += 1
            except OSError:
                pass
            count -= 1
            total -= size
    if removed:
        log.info("pruned %d old files from the code cache %s (keeping %d files, %d bytes at most)", removed, folder,
                 limit_files, limit_bytes)
    return removed
