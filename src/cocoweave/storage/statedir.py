"""The CLI's state folder `./.cocoweave` (tuning cache, measurement store, calibrations) and the code cache's
folders: refused, with a sentence, when one is a symbolic link, belongs to another user or other users may write
into it, since a shared working directory (or a shared cache) would otherwise let another local user choose where
cocoweave writes, what its tuner picks, or what code it runs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import CocoweaveError

NAME = ".cocoweave"


def state_dir() -> Path:
    """`./.cocoweave` under the current directory, checked (see `check_state_dir`); it may not exist yet."""
    return check_state_dir(Path.cwd() / NAME)


def check_state_dir(folder: Path) -> Path:
    """`folder` if it is absent or a real folder of this user that no other user may write into; else CocoweaveError
    saying which and how to go on (the environment variables choose another place)."""
    how = ("remove it, or run from a folder of your own (or point $COCOWEAVE_TUNE_CACHE, $COCOWEAVE_STORE and "
           "$COCOWEAVE_CALIBRATION_DIR elsewhere)")
    return check_private_folder(folder, "the state folder", how)


def check_private_folder(folder: Path, what: str, how: str, group_may_write: bool = True) -> Path:
    """`folder` if it is absent or a real folder of this user that no other user (nor, unless `group_may_write`, its
    group) may write into; else CocoweaveError naming `what` is wrong and saying `how` to go on."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return folder
    except OSError as exc:
        raise CocoweaveError(f"cannot inspect {what} {folder}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise CocoweaveError(f"{what} {folder} is a symbolic link (to {os.readlink(folder)}); cocoweave "
                             f"does not follow it: {how}")
    if not stat.S_ISDIR(st.st_mode):
        raise CocoweaveError(f"{what} {folder} is not a folder: {how}")
    if st.st_uid != os.geteuid():
        raise CocoweaveError(f"{what} {folder} belongs to another user (uid {st.st_uid}, you are "
                             f"{os.geteuid()}): {how}")
    if st.st_mode & stat.S_IWOTH:
        raise CocoweaveError(f"{what} {folder} is writable by every user (mode "
                             f"{stat.S_IMODE(st.st_mode):o}): {how}")
    if not group_may_write and st.st_mode & stat.S_IWGRP:
        raise CocoweaveError(f"{what} {folder} is writable by its group (mode {stat.S_IMODE(st.st_mode):o}): {how}")
    return folder
