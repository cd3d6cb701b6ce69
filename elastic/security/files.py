"""Files and directories only their owner can read, made without following
a symlink someone else planted: state directories (0700), the journal, logs
and keys (0600), and the agent's snapshot directory, which sits at a
predictable path on a shared /dev/shm.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import stat


def private_dir(path: str | os.PathLike[str]) -> pathlib.Path:
    """Create `path` (and missing parents) as 0700, or make an existing
    directory of ours 0700. Returns it. Raises NotADirectoryError when
    `path` is a file or a symlink, PermissionError when it belongs to
    another user or cannot be created."""
    path = pathlib.Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} exists and is not a directory"
                                 + (" (a symlink)" if stat.S_ISLNK(st.st_mode) else ""))
    if st.st_uid != os.geteuid():
        if os.geteuid() == 0:  # root may use another user's directory; it stays theirs
            return path
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def remove_private_dir(path: str | os.PathLike[str]) -> None:
    """Remove `path` without following a symlink: a symlink or file there
    is unlinked, a directory of ours removed with its contents, nothing
    done if it is missing. Raises PermissionError for another user's
    directory."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        if st.st_uid != os.geteuid() and os.geteuid() != 0:
            raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user")
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.unlink(path)


def fresh_private_dir(path: str | os.PathLike[str]) -> pathlib.Path:
    """An empty 0700 directory at `path`, made by us now: whatever was there
    is removed first (`remove_private_dir`), and the directory is created
    with mkdir, which fails if someone recreated the name in between.
    Raises OSError (FileExistsError for that race)."""
    remove_private_dir(path)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkdir(path, 0o700)
    os.chmod(path, 0o700)  # mkdir's mode is masked by the umask
    return path


def open_private(path: str | os.PathLike[str], mode: str = "a", buffering: int = -1):
    """Open `path` for appending ("a", "ab") or writing ("w", "wb"),
    readable by its owner only (created 0600; an existing file is set to
    0600; a symlink is refused); `buffering` as for `open` (0: unbuffered,
    binary modes only). Raises OSError."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, mode, buffering, **({} if "b" in mode else {"encoding": "utf-8"}))


def write_private(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` readable by its owner only (0600), atomically
    (a temporary file in the same directory, then rename). Raises OSError."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
