"""Run files: reading a run directory's files without trusting them.

`python -m minidist report RUN_DIR` reads files that anyone able to write into RUN_DIR
could have replaced: metrics/rank0.jsonl may be a link to another user's file or to
/dev/zero, summary.json a FIFO that blocks an open forever or a sparse file of 4 GiB,
trace.json JSON nested 100,000 deep, a metrics line a list, or a number where a step
belongs. The report must end in one line that names the file, never in a traceback,
a hang or a machine out of memory. So every read of a run directory's file goes through
this module, which keeps five rules:

    1. no link is followed: a file (or metrics/) is opened relative to its folder's
       descriptor with O_NOFOLLOW, and a link is refused by name, whatever it points at
       (RUN_DIR itself is the user's own choice, and may be a link);
    2. only regular files are read: fstat after the open refuses a FIFO, a device or a
       directory, and the open never blocks (O_NONBLOCK);
    3. every read is bounded: the size from fstat is checked against the file's limit
       (below) before a byte is read, and no more than that size is read, however the
       file grows meanwhile (a running run appends to its metrics);
    4. text is UTF-8, and JSON nests no deeper than Python's parser goes (it stops at
       about sys.getrecursionlimit() levels: RecursionError is caught);
    5. every value the report uses is checked for its type before it is used (`field`).
The report's plots go the other way, and as carefully (`write_file`): no link followed at
plots/ or at the PNG; a new file of a random name is created exclusively and renamed over
the old one, so a link planted at plots/loss.png is replaced, never written through.
Whatever fails is a RunFileError (a ValueError) whose message names the file, the line
of a JSON-lines file, the field and what is wrong; the report prints it as one `error:`
line (exit code 2).

The limits are generous, far above what the runs of this package write; a file above its
limit is refused unread (raise the constant for a run that really is that big).
    MAX_JSON      16 MiB  config.json (~1.5 KiB) or summary.json (~0.5 KiB a rank and
                          ~20 B a step: 16 MiB is ~800,000 steps)
    MAX_METRICS  256 MiB  metrics/rank<r>.jsonl, all of them together (~500 B a line,
                          one line a rank and step: 8 ranks x 60,000 steps)
    MAX_TRACE    256 MiB  trace.json (~150 B an event: 8 ranks at run_dir.MAX_EVENTS)

Reference: reliability/confined.py keeps rules 1-3 inside a checkpoint directory; this
    module reads through it. CWE-59 "Improper Link Resolution Before File Access".
Read next: observe/report.py (the reader), observe/run_dir.py (the writer).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from minidist.reliability import confined

MAX_JSON = 16 << 20
MAX_METRICS = 256 << 20
MAX_TRACE = 256 << 20


class RunFileError(ValueError):
    """A run directory's file is not what it must be; the message names it and the check."""


# --- bounded reads, no link followed -----------------------------------------------------

def read_text(path: Path, limit: int, what: str) -> str | None:
    """The UTF-8 text of the regular file `path` (rules 1-4), None if there is no such
    name; `what` says in the refusal which limit it is ("MAX_JSON", ...)."""
    fd = _open_parent(path)
    try:
        data = _read_at(fd, path.name, path, limit, what)
    finally:
        os.close(fd)
    return None if data is None else _decode(data, path)


def read_json(path: Path, limit: int, what: str) -> Any:
    """The JSON value in the file `path` (read as read_text reads it), None if there is no
    such name; RunFileError if it is not JSON."""
    text = read_text(path, limit, what)
    if text is None:
        return None
    try:
        return parse_json(text, str(path))
    except json.JSONDecodeError as e:
        raise RunFileError(f"{path}: not JSON ({e.msg} at line {e.lineno} column "
                           f"{e.colno})") from None


def read_folder(folder: Path, names: re.Pattern, limit: int,
                what: str) -> Iterator[tuple[str, str]]:
    """(name, text) of each file in `folder` whose name matches `names`, in name order,
    each read as read_text reads one, at most `limit` bytes in all. Nothing if there is no
    `folder`; a link at `folder` or at a matching name is refused (others are not opened)."""
    fd = _open_folder(folder)
    if fd is None:
        return
    try:
        done = 0
        for name, _ in confined.entries(fd):
            if names.fullmatch(name):
                data = _read_at(fd, name, folder / name, limit, what, done)
                if data is not None:
                    done += len(data)
                    yield name, _decode(data, folder / name)
    finally:
        os.close(fd)


def names_in(folder: Path) -> list[str]:
    """The names in `folder` ([] if there is none; a link at `folder` is refused)."""
    fd = _open_folder(folder)
    if fd is None:
        return []
    try:
        return [name for name, _ in confined.entries(fd)]
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    """`data` as the file `path` (its folder made if missing), no link followed at either:
    a file of a random name is created exclusively beside it, then renamed over `path` (a
    link there is replaced, never written through)."""
    parent = _open_parent(path.parent)
    try:
        fd = confined.make_dir(parent, path.parent.name, path.parent, exist_ok=True)
    except OSError as e:
        raise RunFileError(_oserror(e, path.parent)) from None
    finally:
        os.close(parent)
    tmp = f".{path.name}.{confined.token()}"
    try:
        out = confined.create(fd, tmp, path.parent / tmp)
    except OSError as e:
        os.close(fd)
        raise RunFileError(_oserror(e, path)) from None
    try:
        try:
            confined.write_all(out, data)
        finally:
            os.close(out)
        os.replace(tmp, path.name, src_dir_fd=fd, dst_dir_fd=fd)
    except OSError as e:                     # disk full, or a directory at `path`
        confined.remove(fd, tmp, path.parent / tmp)
        raise RunFileError(_oserror(e, path)) from None
    finally:
        os.close(fd)


def _open_parent(path: Path) -> int:
    """A descriptor of the folder that holds `path` (RUN_DIR, or metrics/ ...: links in
    its own path are the caller's, and followed)."""
    try:
        return confined.open_root(path.parent)
    except OSError as e:
        raise RunFileError(f"{path.parent}: {e.strerror or e}") from None


def _open_folder(folder: Path) -> int | None:
    """A descriptor of the folder `folder`, None if there is none; a link is refused."""
    parent = _open_parent(folder)
    try:
        return confined.open_dir(parent, folder.name, folder)
    except FileNotFoundError:
        return None
    except OSError as e:                     # confined.Refused (a link), ENOTDIR, EACCES
        raise RunFileError(_oserror(e, folder)) from None
    finally:
        os.close(parent)


def _read_at(dir_fd: int, name: str, where: Path, limit: int, what: str,
             before: int = 0) -> bytes | None:
    """The bytes of the regular file `name` in `dir_fd`, refused if `before` bytes read
    already and its size (fstat, before a byte is read) make more than `limit`."""
    try:
        fd, size = confined.open_regular(dir_fd, name, where)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise RunFileError(_oserror(e, where)) from None
    try:
        if before + size > limit:
            total = f" (with the files before it, {_bytes(before + size)})" if before else ""
            raise RunFileError(f"{where}: {_bytes(size)}{total}, more than the {limit >> 20} "
                               f"MiB that observe/run_files.py's {what} (no real run comes "
                               "near it); refusing to read it")
        return confined.read_exactly(fd, 0, size, where)     # what fstat saw, no more
    except OSError as e:
        raise RunFileError(_oserror(e, where)) from None
    finally:
        os.close(fd)


def _oserror(e: OSError, where: Path) -> str:
    return str(e) if isinstance(e, confined.Refused) else f"{where}: {e.strerror or e}"


def _bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _decode(data: bytes, where: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise RunFileError(f"{where} line {line}: not UTF-8 text (byte 0x{data[e.start]:02x} "
                           f"at offset {e.start})") from None


def parse_json(text: str, where: str) -> Any:
    """json.loads(text); RunFileError for nesting deeper than the parser goes or a number
    too long to convert. A text that is not JSON raises json.JSONDecodeError: a metrics
    line cut short by a kill is skipped, a whole file that is not JSON is an error."""
    try:
        return json.loads(text)
    except RecursionError:
        raise RunFileError(f"{where}: JSON nested too deep (Python's parser stops at about "
                           f"{sys.getrecursionlimit()} levels; a run directory's files nest "
                           "at most 4 deep)") from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:                  # an int of more than 4300 digits
        raise RunFileError(f"{where}: a number too long to read "
                           f"({str(e).split(';')[0]})") from None


# --- the values in them --------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return type(v) is int and abs(v) < 2**63


def _is_number(v: Any) -> bool:            # nan and inf pass: a diverged run's loss
    return _is_int(v) or type(v) is float


KINDS: dict[str, Callable[[Any], bool]] = {
    "an int": _is_int, "an int or null": lambda v: v is None or _is_int(v),
    "a number": _is_number, "a number or null": lambda v: v is None or _is_number(v),
    "a string": lambda v: type(v) is str, "a list": lambda v: type(v) is list,
    "an object": lambda v: type(v) is dict}


def check(value: Any, kind: str, where: str, name: str = "") -> Any:
    """`value` if it is of `kind` (a key of KINDS); else RunFileError naming `where`, the
    field `name` and what the value is."""
    if not KINDS[kind](value):
        raise RunFileError(f"{where}: {name + ' is ' if name else ''}{_describe(value)}, "
                           f"expected {kind}")
    return value


def field(obj: dict, key: str, kind: str, where: str, at: str = "") -> Any:
    """obj[key] checked to be of `kind`; `at` is the path of `obj` in the file ("ranks.0")."""
    name = f"{at}.{key}" if at else key
    if key not in obj:
        raise RunFileError(f"{where}: {name} is missing")
    return check(obj[key], kind, where, name)


def numbers(obj: dict, key: str, where: str, at: str = "") -> dict:
    """obj[key], an object whose every value is a number ("time_s", "memory", ...)."""
    name = f"{at}.{key}" if at else key
    out = field(obj, key, "an object", where, at)
    for k, v in out.items():
        check(v, "a number", where, f"{name}.{k}")
    return out


def _describe(v: Any) -> str:
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, str):
        return f"the string {json.dumps(v[:24])}{'...' if len(v) > 24 else ''}"
    if isinstance(v, int) and abs(v) >= 2**63:
        return f"an int of {len(str(abs(v)))} digits, wider than 64 bits"
    if isinstance(v, (int, float)):
        return f"the number {v!r}"
    return "a list" if isinstance(v, list) else "an object"
