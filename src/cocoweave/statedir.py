"""The CLI's state folder `./.cocoweave` (tuning cache, measurement store, calibrations): refused, with a sentence,
when it is a symbolic link, belongs to another user or other users may write into it, since a shared working
directory would otherwise let another local user choose where cocoweave writes and what its tuner picks."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import CocoweaveError

NAME = ".cocoweave"


def state_dir() -> Path:
    """`./.cocoweave` under the current directory, checked (see `check_state_dir`); it may not exist yet."""
    return check_state_dir(Path.cwd() / NAME)


def check_state_dir(folder: Path) -> Path:
    """`folder` if it is absent or a real folder of this user that no other user may write into; else CocoweaveError
    saying which and how to go on (the environment variables choose another place)."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return folder
    except OSError as exc:
        raise CocoweaveError(f"cannot inspect the state folder {folder}: {exc.strerror or exc}") from None
    how = ("remove it, or run from a folder of your own (or point $COCOWEAVE_TUNE_CACHE, $COCOWEAVE_STORE and "
           "$COCOWEAVE_CALIBRATION_DIR elsewhere)")
    if stat.S_ISLNK(st.st_mode):
        raise CocoweaveError(f"the state folder {folder} is a symbolic link (to {os.readlink(folder)}); cocoweave "
                             f"does not follow it: {how}")
    if not stat.S_ISDIR(st.st_mode):
        raise CocoweaveError(f"the state folder {folder} is not a folder: {how}")
    if st.st_uid != os.geteuid():
        raise CocoweaveError(f"the state folder {folder} belongs to another user (uid {st.st_uid}, you are "
                             f"{os.geteuid()}): {how}")
    if st.st_mode & stat.S_IWOTH:
        raise CocoweaveError(f"the state folder {folder} is writable by every user (mode "
                             f"{stat.S_IMODE(st.st_mode):o}): {how}")
    return folder
