"""Rank output: every rank's stdout and stderr, line by line, tagged with its rank.

With W ranks writing to one terminal, their lines interleave and nobody can tell
whose line is whose. `python -m minidist run` therefore gives each rank two pipes
of its own, one for stdout and one for stderr, and one thread in the launcher
reads all 2W pipes. It cuts what arrives into whole lines and writes each line to
the launcher's stdout or stderr (the stream the rank used) with a tag in front,
as torchrun --tee does (whose default tag names the role, "[default1]:"):

    [rank0]:step 1 loss 2.31
    [rank1]:step 1 loss 2.31

and, with a log folder, also to that rank's own file, untagged (DIR/rank1.log
holds rank 1's stdout and stderr lines in the order the launcher read them).
A filter (`show`) keeps some ranks off the console; their lines still reach
their log files.

One rank's view (`attach`, first thing in the rank process): point file
descriptors 1 and 2 at its two pipes (dup2), so `print`, C extensions that write
to fd 1 and child processes all go through them; close every other end it
inherited; make sys.stdout line-buffered, as on a terminal, so each line leaves
the rank when it is printed (a rank killed a moment later has still said it), and
point sys.stdout and sys.stderr at fds 1 and 2 where something had replaced them.

The launcher's view:
    1. `RankOutput(W, ...)`: make the pipes and open the log files, before forking
       (the ranks inherit them); start the reader thread. It touches nothing a
       forked child needs (raw os.read/os.write, no Python stream locks), so the
       fork is safe.
    2. the reader keeps a pending partial line per (rank, stream); a line is
       written once its newline arrives (or once it is MAX_LINE long), so lines of
       one rank keep their order and lines of two ranks never mix mid-line.
    3. `close()`, after every rank has been reaped: close the launcher's copies of
       the write ends; the reader drains each pipe to its end (EOF: nothing written
       is lost), ends a last partial line with a newline, and the thread is joined.
       A pipe still held open by a process a rank started and left running is read
       until it is quiet (or for at most DRAIN_S), then closed.
If the launcher's stdout is closed by its reader (`... | head`), the reader stops
writing there and closes the ranks' stdout pipes: a rank's next print raises
BrokenPipeError, as it would on a closed terminal pipe, and `stdout_closed` tells
the caller to end quietly.

Read next: runtime/launch.py (run_script), runtime/process_group_api.py
"""

from __future__ import annotations

import os
import selectors
import sys
import threading
import time

READ_BYTES = 1 << 16
MAX_LINE = 1 << 20       # a line longer than this is cut (ended with a newline) and written
DRAIN_S = 1.0            # at most this long to read pipes that stay open after the ranks end
QUIET_S = 0.05           # ... and stop earlier once they have been quiet this long
OUT, ERR = 0, 1


def log_path(log_dir: str, rank: int) -> str:
    """The file that holds rank `rank`'s lines: DIR/rank<rank>.log."""
    return os.path.join(log_dir, f"rank{rank}.log")


class RankOutput:
    """The pipes, log files and reader thread of one run (see the module docstring).

    prefix: tag each console line with "[rank<r>]:".  log_dir: also write each rank's
    lines, untagged, to log_path(log_dir, r).  show: ranks whose lines reach the
    console (None: all).  console: the launcher's (stdout, stderr) descriptors.
    """

    def __init__(self, world_size: int, *, prefix: bool = True, log_dir: str | None = None,
                 show: set[int] | None = None, console: tuple[int, int] = (1, 2)):
        self.W, self.prefix, self.console = world_size, prefix, console
        self.show = set(range(world_size)) if show is None else set(show)
        self.stdout_closed = False
        self.pipes: list[tuple[int, int]] = []        # index 2*r + stream: (read, write)
        self.logs: list[int] = []
        try:
            for _ in range(2 * world_size):
                self.pipes.append(os.pipe())
            if log_dir is not None:
                os.makedirs(log_dir, exist_ok=True)
                for r in range(world_size):
                    self.logs.append(os.open(log_path(log_dir, r),
                                             os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        except BaseException:
            self._close_fds([fd for pair in self.pipes for fd in pair] + self.logs)
            raise
        self._writers_open = True
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._read_all, name="minidist-rank-output",
                                        daemon=True)
        self._thread.start()

    # --- in the rank process ---
    def attach(self, rank: int) -> None:
        """Make fds 1 and 2 of this process rank `rank`'s pipes; close every other end."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        out_w, err_w = self.pipes[2 * rank + OUT][1], self.pipes[2 * rank + ERR][1]
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        self._close_fds([fd for pair in self.pipes for fd in pair] + self.logs)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            stream = getattr(sys, name)
            try:
                on_fd = stream.fileno() == fd
            except (AttributeError, OSError, ValueError):
                on_fd = False               # e.g. a test runner's capture object
            if not on_fd:                   # print must reach the pipe too
                setattr(sys, name, open(fd, "w", buffering=1, closefd=False,
                                        errors="backslashreplace"))
            elif name == "stdout" and hasattr(stream, "reconfigure"):
                stream.reconfigure(line_buffering=True)

    # --- in the launcher ---
    def close(self) -> None:
        """After the ranks are gone: drain every pipe, join the reader, close the files."""
        if self._writers_open:
            self._writers_open = False
            self._close_fds([w for _, w in self.pipes])
        self._closing.set()
        self._thread.join()
        self._close_fds(self.logs)

    def __enter__(self) -> "RankOutput":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read_all(self) -> None:
        # poll, not epoll: an epoll descriptor would be inherited by every forked rank
        sel = getattr(selectors, "PollSelector", selectors.SelectSelector)()
        pending: dict[int, bytes] = {}
        for i, (rd, _) in enumerate(self.pipes):
            sel.register(rd, selectors.EVENT_READ, i)
            pending[i] = b""
        deadline = None
        while sel.get_map():
            if self._closing.is_set() and deadline is None:
                deadline = time.monotonic() + DRAIN_S
            events = sel.select(timeout=QUIET_S if deadline else 0.1)
            if deadline is not None and (not events or time.monotonic() > deadline):
                break                          # the ranks are gone; only a leftover child
            for key, _ in events:              # of theirs holds these pipes open
                i = key.data
                data = os.read(key.fd, READ_BYTES)
                if not data:                   # EOF: every writer has closed its end
                    self._emit(i, pending.pop(i), final=True)
                    sel.unregister(key.fd)
                    os.close(key.fd)
                    continue
                pending[i] = self._emit(i, pending[i] + data, final=False)
                if len(pending[i]) > MAX_LINE:    # no newline in sight (a progress bar
                    pending[i] = self._emit(i, pending[i], final=True)      # using \r)
            if self.stdout_closed:
                self._stop_stdout(sel, pending)
        for fd, key in list(sel.get_map().items()):
            self._emit(key.data, pending.pop(key.data), final=True)
            sel.unregister(fd)
            os.close(fd)
        sel.close()

    def _emit(self, i: int, data: bytes, final: bool) -> bytes:
        """Write the whole lines of `data` (all of it when final); return what is left."""
        cut = len(data) if final else data.rfind(b"\n") + 1
        if cut == 0:
            return data
        whole, rest = data[:cut], data[cut:]
        if not whole.endswith(b"\n"):
            whole += b"\n"                     # a last line without its newline: end it
        rank, stream = divmod(i, 2)
        if self.logs:
            self._write(self.logs[rank], whole, stream=None)
        if rank in self.show:
            if self.prefix:
                tag = b"[rank%d]:" % rank
                whole = b"".join(tag + line + b"\n" for line in whole[:-1].split(b"\n"))
            self._write(self.console[stream], whole, stream)
        return rest

    def _write(self, fd: int, data: bytes, stream: int | None) -> None:
        if stream == OUT and self.stdout_closed:
            return
        try:
            while data:
                data = data[os.write(fd, data):]
        except BrokenPipeError:
            if stream == OUT:
                self.stdout_closed = True
            # stderr or a log file gone too: nothing is left to tell

    def _stop_stdout(self, sel: selectors.BaseSelector, pending: dict[int, bytes]) -> None:
        """The launcher's stdout reader left: close the ranks' stdout pipes (their next
        print raises BrokenPipeError), keeping what still goes to the log files."""
        for fd, key in list(sel.get_map().items()):
            if key.data % 2 == OUT:
                self._emit(key.data, pending.pop(key.data), final=True)
                sel.unregister(fd)
                os.close(fd)

    @staticmethod
    def _close_fds(fds: list[int]) -> None:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
