"""What one collective call is, packed into 16 integers that every rank can read.

Two ranks of a group are in the same collective call when they agree on the
call's sequence number in that group, the operation, dtype, shape, root,
reduction op and algorithm. `Call` packs exactly that into a small int64
record. The record is stamped on every message (so a receiver can compare the
sender's call with its own), published in shared memory while the call runs
(so a waiting rank can look at what its peer is doing), and kept in the
flight recorder (so a hang report can show each rank's last calls).

Layout (int64 each):
    0 gid    1 seq    2 op     3 dtype  4 root   5 redop  6 algo   7 nbytes
    8 ndim   9-12 dims (the fifth and later dims fold into dim 12)
    13 state (STARTED, DONE, FAILED)   14 t_start_ns   15 t_end_ns
Fields 1..12 are the identity of a call: equal on every rank, or a mismatch.
A point-to-point pair (collectives `send` / `recv`) keeps the sender's group rank in
the algo field, the receiver's in root and the message tag in redop, on both sides; a
recv's identity is that of the send it expects (`identity`), so the pair matches.
A `sendrecv` (every rank sends to one peer and receives from another, at the same
sequence number) keeps its source in algo and its destination in root; its identity
leaves both out: the two ends of a message hold different pairs (in a shift by s, rank r
receives from r - s and its sender from r - 2s), and the mailbox a message arrives in
names its two ends anyway (runtime/p2p.py). They agree on the rest, tag included.

Read next: runtime/wait.py
"""

from __future__ import annotations

import zlib

import numpy as np

NFIELDS = 16
IDENTITY = slice(1, 13)                       # fields that must agree across ranks
GID, SEQ, OP, DTYPE, ROOT, REDOP, ALGO, NBYTES, NDIM = range(9)
STATE, T_START, T_END = 13, 14, 15
STARTED, DONE, FAILED = 1, 2, 3
STATE_NAMES = {0: "-", STARTED: "started", DONE: "done", FAILED: "failed"}

_NAMES = ["", "p2p", "barrier", "broadcast", "reduce", "all_reduce", "reduce_scatter",
          "all_gather", "gather", "scatter", "all_to_all", "sum", "avg", "max", "min", "prod",
          "ring", "tree", "direct", "halving", "pairwise", "auto", "shared", "exit",
          "new_group", "send", "recv", "sendrecv"]
_CODE = {name: i for i, name in enumerate(_NAMES)}
_P2P_OPS = (_CODE["send"], _CODE["recv"], _CODE["sendrecv"])
_SEEN: dict[int, str] = {}                   # other names this process has encoded
_DTYPES = [np.dtype(t) for t in ("bool", "int8", "uint8", "int16", "uint16", "int32",
                                 "uint32", "int64", "uint64", "float16", "float32",
                                 "float64", "complex64", "complex128")]
_DTYPE_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}


def encode(name: str | None) -> int:
    """Small stable integer for an op/algo name (same on every rank and run)."""
    if not name:
        return 0
    code = _CODE.get(name)
    if code is None:
        code = 1000 + zlib.crc32(name.encode()) % 1_000_000
        _SEEN[code] = name
    return code


def decode(code: int) -> str:
    if 0 <= code < len(_NAMES):
        return _NAMES[code]
    return _SEEN.get(code, f"#{code}")


def dtype_code(dtype) -> int:
    code = _DTYPE_CODE.get(dtype)             # fast path: already an np.dtype we know
    if code is not None:
        return code
    d = np.dtype(dtype)
    return _DTYPE_CODE.get(d, 100 + zlib.crc32(d.str.encode()) % 1_000_000)


def dtype_name(code: int) -> str:
    return str(_DTYPES[code - 1]) if 1 <= code <= len(_DTYPES) else f"dtype#{code}"


def pack(gid: int, seq: int, op: str, x: np.ndarray | None, root: int | None = None,
         redop: str | None = None, algo: str | None = None,
         p2p: tuple[int, int, int] | None = None) -> np.ndarray:
    """The record of one call; `x` gives dtype and shape (None for barrier); p2p =
    (src, dst, tag) of a send, recv or sendrecv (group ranks), kept in the algo, root,
    redop fields."""
    rec = np.zeros(NFIELDS, np.int64)
    rec[GID], rec[SEQ], rec[OP] = gid, seq, encode(op)
    rec[ROOT] = -1 if root is None else root
    rec[REDOP], rec[ALGO] = encode(redop), encode(algo)
    if p2p is not None:
        rec[ALGO], rec[ROOT], rec[REDOP] = p2p
    if x is not None:
        shape = x.shape if len(x.shape) <= 4 else x.shape[:3] + (int(np.prod(x.shape[3:])),)
        rec[DTYPE], rec[NBYTES], rec[NDIM] = dtype_code(x.dtype), x.nbytes, x.ndim
        rec[9:9 + len(shape)] = shape
    return rec


def describe(rec: np.ndarray, group_names: dict[int, str] | None = None) -> str:
    """Human text for a record: "all_reduce #5 on 'world' (float32 (4, 3), op sum, algo ring)",
    "recv #2 on 'pp0' (float64 (2, 8), group rank 0 -> 1, tag 3)", "sendrecv #4 on 'tp'
    (float64 (2, 8), from group rank 3, to group rank 1, tag 0)"."""
    gid = int(rec[GID])
    gname = (group_names or {}).get(gid, f"group#{gid}")
    parts = []
    if rec[DTYPE]:
        ndim = int(rec[NDIM])
        dims = tuple(int(d) for d in rec[9:9 + min(ndim, 4)])
        parts.append(f"{dtype_name(int(rec[DTYPE]))} {dims}")
    if rec[OP] == _CODE["sendrecv"]:
        parts.append(f"from group rank {int(rec[ALGO])}, to group rank {int(rec[ROOT])}, "
                     f"tag {int(rec[REDOP])}")
    elif rec[OP] in _P2P_OPS:
        parts.append(f"group rank {int(rec[ALGO])} -> {int(rec[ROOT])}, tag {int(rec[REDOP])}")
    elif rec[ROOT] >= 0:
        parts.append(f"root {int(rec[ROOT])}")
    if rec[REDOP] and rec[OP] not in _P2P_OPS:
        parts.append(f"op {decode(int(rec[REDOP]))}")
    if rec[ALGO] and rec[OP] not in _P2P_OPS:
        parts.append(f"algo {decode(int(rec[ALGO]))}")
    detail = f" ({', '.join(parts)})" if parts else ""
    return f"{decode(int(rec[OP]))} #{int(rec[SEQ])} on '{gname}'{detail}"


def identity(rec: np.ndarray) -> bytes:
    """The bytes two ranks must agree on (fields 1..12); a recv's are its send's; a
    sendrecv's leave out its source and destination (module docstring)."""
    op = rec[OP]
    if op != _CODE["recv"] and op != _CODE["sendrecv"]:
        return rec[IDENTITY].tobytes()
    ident = rec[IDENTITY].copy()
    if op == _CODE["recv"]:
        ident[OP - 1] = _CODE["send"]
    else:
        ident[ALGO - 1] = ident[ROOT - 1] = -1
    return ident.tobytes()


def same_call(a: np.ndarray, b: np.ndarray) -> bool:
    """True when two records name the same call (or the two ends of one message)."""
    return identity(a) == identity(b)
