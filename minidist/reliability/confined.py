"""Confined files: reading and writing inside a directory that someone else may have tampered with.

A checkpoint directory is input like any other: whoever can write into it can plant a
symbolic link where a save will write (`step9/.tmp` -> /home/you), a `latest` that points
at /etc/passwd, a manifest that is really /dev/zero, or a file grown sparsely to a
terabyte. A path-based `open(root / name)` follows every such link, and `read()` reads
whatever is there. So every access below the root goes through a directory file
descriptor, never through a path, and obeys four rules:

    1. no link is followed: each name is opened relative to its parent's descriptor with
       O_NOFOLLOW (a link is refused with ELOOP, whatever it points at);
    2. only regular files are read (fstat after the open: a FIFO, a device such as
       /dev/zero or a directory is refused), and opening never blocks (O_NONBLOCK);
    3. every read is bounded: the size is checked with fstat before a byte is read, and
       at most `limit` bytes are read however the file grows meanwhile;
    4. files are created exclusively (O_CREAT | O_EXCL: an existing name, link or not, is
       an error, never overwritten) under names with a random token (`token`), and
       published by renaming within one directory descriptor (os.replace with dir_fd).
       Permissions are what the umask leaves of 0o666 (files) and 0o777 (directories):
       never wider than the user's own.

Removing a name never follows it either: a link is unlinked itself, a directory is
removed with shutil.rmtree, which refuses a link at its top and walks by descriptors.

The root itself is the caller's choice (a --checkpoint-dir given by the user may be a
link); everything below it is confined.

Reference: the openat(2) family and O_NOFOLLOW, POSIX.1-2008; CWE-59 "Improper Link
    Resolution Before File Access".
Read next: reliability/checkpoint.py
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from pathlib import Path

_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(OSError):
    """A name below the root is not what it must be (a link, not a regular file, too big);
    the message names the path and the check."""


def token() -> str:
    """A fresh random name part: 16 hex digits (64 bits), so a temporary name cannot be
    guessed and planted before it is made."""
    return secrets.token_hex(8)


def _what(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse_link(e: OSError, where: Path, dir_fd: int, name: str) -> OSError:
    """ELOOP from O_NOFOLLOW means `name` is a link: say so (or pass other errors on)."""
    try:
        mode = os.lstat(name, dir_fd=dir_fd).st_mode
    except OSError:
        return e
    if stat.S_ISLNK(mode):
        return Refused(f"{where}: is a symbolic link; refusing to follow it out of the "
                       f"directory")
    return e


def open_root(root: str | os.PathLike) -> int:
    """A descriptor of the directory `root` (the caller's own path: links in it are
    followed, as the caller asked for that directory)."""
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def open_dir(dir_fd: int, name: str, where: Path) -> int:
    """A descriptor of the directory `name` inside `dir_fd`, refused if it is a link."""
    try:
        return os.open(name, _DIR, dir_fd=dir_fd)
    except OSError as e:
        raise _refuse_link(e, where, dir_fd, name) from None


def open_regular(dir_fd: int, name: str, where: Path) -> tuple[int, int]:
    """(descriptor, size in bytes) of the regular file `name` inside `dir_fd`, opened for
    reading without following a link and without blocking on a FIFO."""
    try:
        fd = os.open(name, _READ, dir_fd=dir_fd)
    except OSError as e:
        raise _refuse_link(e, where, dir_fd, name) from None
    return fd, _regular_size(fd, where)


def read_bounded(dir_fd: int, name: str, where: Path, limit: int) -> bytes:
    """The bytes of the regular file `name` (rules 1-3), refused above `limit` bytes."""
    fd, size = open_regular(dir_fd, name, where)
    return _read_and_close(fd, size, where, limit)


def read_named(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of a file the user named on the command line (a schedule, a trace): the
    path is theirs, so a link in it is followed, but rules 2 and 3 hold: a FIFO or a device
    such as /dev/zero is refused, and so is a file above `limit` bytes, unread."""
    where = Path(path)
    fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    return _read_and_close(fd, _regular_size(fd, where), where, limit)


def _regular_size(fd: int, where: Path) -> int:
    """The size of the open file `fd`, which must be a regular file (closed if not)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise Refused(f"{where}: is {_what(st.st_mode)}, not a regular file; refusing it")
    return st.st_size


def _read_and_close(fd: int, size: int, where: Path, limit: int) -> bytes:
    """The `size` bytes of the open regular file `fd` (refused above `limit`, or if it
    grew meanwhile); closes `fd`."""
    try:
        if size > limit:
            raise Refused(f"{where}: {size} bytes, more than the {limit} such a file can "
                          f"hold; refusing to read it")
        data = read_exactly(fd, 0, size, where)
        if os.pread(fd, 1, size):
            raise Refused(f"{where}: grew while it was read; refusing it")
        return data
    finally:
        os.close(fd)


def read_exactly(fd: int, offset: int, n: int, where: Path) -> bytes:
    """n bytes at `offset` of an open file (short files are an error, not a short read)."""
    out = bytearray(n)
    read_into(fd, offset, memoryview(out), where)
    return bytes(out)


def read_into(fd: int, offset: int, view: memoryview, where: Path,
              chunk: int = 16 << 20) -> None:
    """Fill the byte view `view` from `offset` of an open file, `chunk` bytes a call."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:done + chunk]], offset + done)
        if got == 0:
            raise Refused(f"{where}: ends after {offset + done} bytes; it was cut short "
                          f"while it was read")
        done += got


def make_dir(dir_fd: int, name: str, where: Path, exist_ok: bool = False) -> int:
    """Create the directory `name` in `dir_fd` (mode 0o777 less the umask) and return its
    descriptor. exist_ok: another writer of the same save may have made it first; what
    exists must then be a directory, not a link."""
    try:
        os.mkdir(name, 0o777, dir_fd=dir_fd)
    except FileExistsError:
        if not exist_ok:
            raise
    return open_dir(dir_fd, name, where)


def create(dir_fd: int, name: str, where: Path) -> int:
    """A descriptor of the new file `name` in `dir_fd`, opened for writing (rule 4)."""
    try:
        return os.open(name, _CREATE, 0o666, dir_fd=dir_fd)
    except FileExistsError:
        raise Refused(f"{where}: exists already (a link or a file this save did not make); "
                      f"refusing to write through it") from None


def write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until every byte of `data` is written."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def entries(dir_fd: int) -> list[tuple[str, int]]:
    """(name, lstat mode) of every entry of the directory, sorted by name."""
    out = []
    with os.scandir(dir_fd) as it:
        for e in it:
            try:
                out.append((e.name, e.stat(follow_symlinks=False).st_mode))
            except FileNotFoundError:     # removed since the listing
                continue
    return sorted(out)


def remove(dir_fd: int, name: str, where: Path) -> None:
    """Remove the entry `name` of `dir_fd` without following it: a link or a file is
    unlinked, a directory removed with everything in it (shutil.rmtree, which refuses a
    link at its top and walks by descriptors)."""
    try:
        mode = os.lstat(name, dir_fd=dir_fd).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(where)
    else:
        os.unlink(name, dir_fd=dir_fd)
