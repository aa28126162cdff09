"""Checkpoint format: what a checkpoint directory holds, byte by byte, and how it is read back.

A checkpoint is layout-free: it holds the full, global arrays of the single-process model
(parameters in the baseline's order, the optimizer's state_dict) and the non-array state
(step, RNG streams, data cursor, losses, run config), never one rank's shard. So a run
saved under one layout resumes under any other, on any number of ranks. Writing is still
shared: with W writers every array is flattened and cut into W contiguous ranges
(np.array_split order), and writer r writes range r of every array into a file of its own.

One rank's view (writer r of W; checkpoint.py decides when, under which names, and how
each write is made crash-safe):
    writes  rank{r:05d}.safetensors: header, then elements [lo_r, hi_r) of every flat
            array (`rank_file_parts`); rank 0 also manifest.json (`manifest`)
    reads   (`load`, on any rank, whatever W was) the manifest, then every file and
            every piece, each checked before its bytes are used; arrays come back whole

On disk (W = 2):
    D/latest                                "step00000012\\n"
    D/step00000012/manifest.json            the index (`manifest`), checksummed
    D/step00000012/rank00000.safetensors    piece 0 of every array
    D/step00000012/rank00001.safetensors    piece 1 of every array
A rank file is a plain safetensors file (8-byte little-endian header length N, N bytes of
JSON {name: {dtype, shape, data_offsets}} padded with spaces to a multiple of 8, raw
little-endian bytes): tensor "params/wte" holds elements [lo, hi) of the flat wte, shape
[hi - lo]. The reader trusts nothing: the manifest carries a checksum of itself, each file
its size and the sha256 of its header, each piece its sha256. The header and the pieces
tile the file exactly (checked), so every byte is covered by one hash and hashed once when
written and once when read (a reader of one piece can check just that piece);
a directory holding any other file (a planted .pkl, an .npy of objects) is refused by
name. Only json and np.frombuffer touch the bytes; nothing is ever unpickled.

Cost: `load` reads and checks all S bytes of the checkpoint (S its size).
Numbers: arrays are bitwise exact for bool, (u)int8-64, float16/32/64, in any byte order
(loaded as little-endian); JSON floats are exact (repr round trip), every NaN loss comes
back as the standard NaN, and tuples in rng/data_cursor/extra come back as lists.

References:
    safetensors -- github.com/huggingface/safetensors, README "Format".
Read next: reliability/faults.py, reliability/recovery.py
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minidist.reliability import confined

FORMAT, VERSION = "minidist-checkpoint", 2   # 2: files carry header_sha256, not sha256
_DTYPES = {"BOOL": "|b1", "U8": "|u1", "I8": "|i1", "I16": "<i2", "U16": "<u2", "F16": "<f2",
           "I32": "<i4", "U32": "<u4", "F32": "<f4", "F64": "<f8", "I64": "<i8", "U64": "<u8"}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
STEP_DIR, _RANK_FILE = re.compile(r"step(\d{8,})"), re.compile(r"rank\d{5}\.safetensors")
_MAX_HEADER = 100 << 20       # the reference reader's limit on a header's length
MAX_MANIFEST = 64 << 20       # bytes: a manifest of 10^5 tensors x 8 writers is ~40 MiB


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or read; the message names the file and the fix."""


@dataclass
class CheckpointState:
    """A training run after `step` completed steps; arrays are full (global), not shards."""
    step: int
    params: dict[str, np.ndarray]                     # in the single-process model's order
    optimizer: dict[str, Any] = field(default_factory=dict)   # state_dict(): arrays, ints, floats
    rng: dict[str, Any] = field(default_factory=dict)         # JSON-able, e.g. seeds, counters
    data_cursor: dict[str, Any] = field(default_factory=dict)  # JSON-able
    losses: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)       # JSON-able: plan, run config ...


def step_name(step: int) -> str:
    return f"step{step:08d}"


def rank_file(r: int) -> str:
    return f"rank{r:05d}.safetensors"


def _bounds(n: int, world: int) -> list[int]:
    """Start of each of np.array_split's W ranges of n elements, then n (the first n % W
    ranges hold one element more)."""
    return [r * (n // world) + min(r, n % world) for r in range(world + 1)]


def sha256_hex(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


def _checksum(body: dict) -> str:
    return sha256_hex(json.dumps(body, separators=(",", ":")).encode())


def _dtype_name(a: Any, what: str) -> str:
    dt = np.asarray(a).dtype
    name = _NAMES.get(dt if dt.isnative or dt.itemsize == 1 else dt.newbyteorder("="))
    if name is None:
        raise ValueError(f"checkpoint: {what} has dtype {dt}, which safetensors cannot store; "
                         f"use one of bool, (u)int8-64, float16/32/64")
    return name


def state_tensors(state: CheckpointState) -> list[tuple[str, Any]]:
    """[(name in the files, array)]: the params, then the optimizer's arrays, in order."""
    out = [(f"params/{k}", v) for k, v in state.params.items()]
    return out + [(f"optimizer/{k}", v) for k, v in state.optimizer.items()
                  if isinstance(v, (np.ndarray, np.generic))]


def state_meta(state: CheckpointState) -> dict:
    """The non-array state as the manifest stores it; ValueError naming what cannot be."""
    if isinstance(state.step, bool) or not isinstance(state.step, (int, np.integer)) \
            or state.step < 0:
        raise ValueError(f"checkpoint: step must be an int >= 0, got {state.step!r}")
    for k, v in state.params.items():
        if not isinstance(v, np.ndarray):
            raise ValueError(f"checkpoint: params[{k!r}] is a {type(v).__name__}, not an ndarray")
    for name, a in state_tensors(state):
        _dtype_name(a, name)
    optimizer: dict[str, Any] = {}
    for k, v in state.optimizer.items():
        if isinstance(v, np.ndarray):
            optimizer[k] = {"tensor": f"optimizer/{k}"}
        elif isinstance(v, np.generic):
            optimizer[k] = {"tensor": f"optimizer/{k}", "numpy_scalar": True}
        elif isinstance(v, (bool, int, float)):
            optimizer[k] = {"value": v}
        else:
            raise ValueError(f"checkpoint: optimizer[{k!r}] is a {type(v).__name__}; the "
                             f"optimizer state may hold ndarrays, ints and floats only")
    meta = {"params": list(state.params), "optimizer": optimizer,
            "losses": [float(x) for x in state.losses]}
    for key in ("rng", "data_cursor", "extra"):
        try:
            meta[key] = json.loads(json.dumps(getattr(state, key)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"checkpoint: {key} is not JSON-able ({e}); it may hold dicts, "
                             f"lists, str, int, float, bool and None (use int(), float(), "
                             f".tolist() on NumPy values)") from None
    return meta


def rank_file_parts(state: CheckpointState, rank: int,
                     world: int) -> tuple[bytes, dict[str, np.ndarray]]:
    """Writer `rank`'s safetensors file as (header bytes, {tensor: piece}); the file is the
    header, then the pieces' bytes in this order: piece `rank` of every flat array, in
    `tensors` order, little-endian."""
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT, "step": str(state.step),
                                               "rank": str(rank), "writers": str(world)}}
    pieces, start = {}, 0
    for name, a in state_tensors(state):
        flat = np.asarray(a).reshape(-1)
        lo, hi = _bounds(flat.size, world)[rank:rank + 2]
        piece = np.ascontiguousarray(flat[lo:hi], dtype=flat.dtype.newbyteorder("<"))
        header[name] = {"dtype": _dtype_name(a, name), "shape": [hi - lo],
                        "data_offsets": [start, start + piece.nbytes]}
        pieces[name] = piece
        start += piece.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)           # as the reference writer: data 8-byte aligned
    return struct.pack("<Q", len(text)) + text, pieces


def manifest_bytes(state: CheckpointState, world: int, markers: list[dict]) -> bytes:
    """manifest.json: every tensor's global shape, dtype and pieces; every file; the rest.
    `markers[r]` says writer r's file name, size, its header's sha256 and each piece's."""
    tensors = {}
    for name, a in state_tensors(state):
        a, b = np.asarray(a), _bounds(np.asarray(a).size, world)
        tensors[name] = {"dtype": _dtype_name(a, name), "shape": list(a.shape), "pieces": [
            {"file": m["file"], "range": [b[r], b[r + 1]], "sha256": m["pieces"][name]}
            for r, m in enumerate(markers)]}
    body = {"format": FORMAT, "version": VERSION, "step": int(state.step), "writers": world,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "tensors": tensors,
            "files": {m["file"]: {"size": m["size"], "header_sha256": m["header_sha256"]}
                      for m in markers},
            "state": state_meta(state)}
    return _readable_json({**body, "checksum": _checksum(body)})


def _readable_json(body: dict) -> bytes:
    """body as JSON with a line per top-level key, and per tensor and per file inside
    "tensors" and "files": readable, and written by json's C encoder (indent= switches to
    its pure-Python one: 2.4 ms against 0.7 ms for the 150 tensors of bench checkpoint's
    model, CPU taken from training on its core, since an asynchronous save commits in the
    background)."""
    lines = []
    for key, value in body.items():
        if key in ("tensors", "files") and isinstance(value, dict) and value:
            inner = ",\n  ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            lines.append(f"{json.dumps(key)}: {{\n  {inner}\n }}")
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(value)}")
    return ("{\n " + ",\n ".join(lines) + "\n}\n").encode()


def _parse_manifest(path: Path, dir_fd: int) -> dict:
    where = path / "manifest.json"
    try:
        body = json.loads(confined.read_bounded(dir_fd, "manifest.json", where, MAX_MANIFEST))
        ok = body.pop("checksum") == _checksum(body)
        ok, step, version = ok and body["format"] == FORMAT, body["step"], body["version"]
    except FileNotFoundError:
        raise CheckpointError(f"{where}: missing: not a checkpoint directory (for a root "
                              f"of checkpoints use latest({str(path)!r}).path)") from None
    except confined.Refused as e:
        raise CheckpointError(str(e)) from None
    except (ValueError, RecursionError, AttributeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where}: not a valid manifest ({_short(e)}); fall back to "
                              f"an older checkpoint with latest()") from None
    if not ok:
        raise CheckpointError(f"{where}: checksum check failed: the manifest changed "
                              f"after it was written (corruption or an edit)")
    if version != VERSION:
        raise CheckpointError(f"{where}: format version {version!r}, this minidist "
                              f"reads version {VERSION}; load it with a matching minidist")
    m = STEP_DIR.fullmatch(path.name)
    if m and int(m.group(1)) != step:
        raise CheckpointError(f"{where}: says step {step!r}, its directory "
                              f"{path.name}: it was moved or copied into the wrong place")
    return body


def _short(e: BaseException) -> str:
    """An exception as one short line (a hostile manifest may make a long message)."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= 200 else text[:197] + "..."


def _header(path: Path, data: bytes, size: int) -> dict[str, tuple[str, list, int, int]]:
    """A safetensors header (`data`: its bytes after the 8-byte length; `size`: the whole
    file's), checked as the reference reader does: {name: (dtype, shape, first byte, end
    byte)} in file offsets."""
    try:
        header = json.loads(data)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        header.pop("__metadata__", None)
        out, end, n = {}, 0, len(data)
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
            a, b = e["data_offsets"]
            count = _count(e["shape"])
            size_e = count * np.dtype(_DTYPES[e["dtype"]]).itemsize
            if a != end or b - a != size_e:
                raise ValueError(f"tensor {name!r} has bytes [{a}, {b}), expected {size_e} "
                                 f"at {end}")
            out[name], end = (e["dtype"], e["shape"], 8 + n + a, 8 + n + b), b
        if 8 + n + end != size:
            raise ValueError(f"data ends at {8 + n + end}, the file at {size}")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({_short(e)})") from None
    return out


def _count(shape: Any) -> int:
    """The number of elements of `shape`, a list of ints >= 0 (exact: Python ints)."""
    if not isinstance(shape, list) or len(shape) > 64 or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"shape {str(shape)[:60]} is not a list of at most 64 ints >= 0")
    count = 1
    for d in shape:
        count *= d
    return count


def _check_listing(path: Path, dir_fd: int, files: dict) -> None:
    """Refuse a directory holding anything but manifest.json and the rank files it lists,
    each a regular file (a link, even to a valid file, is refused)."""
    for name, mode in confined.entries(dir_fd):
        if name != "manifest.json" and (name not in files or not _RANK_FILE.fullmatch(name)):
            raise CheckpointError(f"{path / name}: unexpected file in a checkpoint directory "
                                  f"(it holds manifest.json and the files it lists, never "
                                  f"pickles); refusing to load it. Remove {name} if you put "
                                  f"it there")
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{path / name}: is not a regular file (a link, a directory "
                                  f"or a device); refusing it")


def _open_file(path: Path, dir_fd: int, name: str, info: dict) -> tuple[int, dict]:
    """(an open descriptor, the parsed header) of rank file `name`, once its name, its size
    (fstat, before a byte is read) and its header's sha256 match what the manifest says
    (`info`); the pieces are checked by `_assemble`. The caller closes the descriptor."""
    where = path / name
    if not isinstance(name, str) or not _RANK_FILE.fullmatch(name):
        raise CheckpointError(f"{path / 'manifest.json'}: lists file {str(name)[:40]!r}, "
                              f"not a rank file name; refusing it")
    try:
        fd, size = confined.open_regular(dir_fd, name, where)
    except FileNotFoundError:
        raise CheckpointError(f"{where}: size check failed: missing, the manifest says "
                              f"{info['size']} bytes (deleted?)") from None
    except confined.Refused as e:
        raise CheckpointError(str(e)) from None
    try:
        if size != info["size"] or size < 8:
            raise CheckpointError(f"{where}: size check failed: {size} bytes, the manifest "
                                  f"says {info['size']} (truncated, grown or replaced)")
        (n,) = struct.unpack("<Q", confined.read_exactly(fd, 0, 8, where))
        if n > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{where}: not a valid safetensors file (header length {n} "
                                  f"exceeds the file)")
        data = confined.read_exactly(fd, 8, n, where)
        if sha256_hex(struct.pack("<Q", n) + data) != info["header_sha256"]:
            raise CheckpointError(f"{where}: sha256 check failed: its header changed after "
                                  f"it was written (disk corruption or an edit)")
        return fd, _header(where, data, size)
    except BaseException:
        os.close(fd)
        raise


def _layout(path: Path, name: str, t: dict, headers: dict[str, dict]) -> tuple[np.dtype, int]:
    """(dtype, element count) of tensor `name` (its manifest entry `t`), once each of its
    pieces is found in its file's header with the right dtype, shape and place: checked
    before anything is allocated, so the arrays never outgrow the files on disk."""
    if t["dtype"] not in _DTYPES:
        raise CheckpointError(f"{path / 'manifest.json'}: tensor {name!r} has dtype "
                              f"{str(t['dtype'])[:20]!r}, not a safetensors dtype; refusing it")
    n, lo = _count(t["shape"]), 0
    for p in t["pieces"]:
        dtype, shape, _, _ = headers.get(p["file"], {}).get(name, (None, None, 0, 0))
        if p["range"][0] != lo or (dtype, shape) != (t["dtype"], [p["range"][1] - lo]):
            raise CheckpointError(f"{path / str(p['file'])[:40]}: piece of {name!r} for "
                                  f"elements {str(p['range'])[:40]} is missing or has another "
                                  f"dtype or shape")
        lo = p["range"][1]
    if lo != n:
        raise CheckpointError(f"{path / 'manifest.json'}: pieces of {name!r} cover {lo} "
                              f"of its {n} elements")
    return np.dtype(_DTYPES[t["dtype"]]), n


def _assemble(path: Path, name: str, t: dict, layout: tuple[np.dtype, int],
              files: dict[str, tuple[int, dict]]) -> np.ndarray:
    """Tensor `name` read piece by piece straight into its array, each piece's sha256
    checked; `files` maps file name to (descriptor, header)."""
    dt, n = layout
    flat = np.empty(n, dt)
    raw = flat.view(np.uint8)
    for p in t["pieces"]:
        fd, header = files[p["file"]]
        lo, hi = p["range"]
        _, _, a, b = header[name]
        view = memoryview(raw[lo * dt.itemsize:hi * dt.itemsize])
        confined.read_into(fd, a, view, path / p["file"])
        if sha256_hex(view) != p["sha256"]:
            raise CheckpointError(f"{path / p['file']}: sha256 check failed: the piece of "
                                  f"{name!r} changed after it was written (disk corruption "
                                  f"or an edit)")
    return flat.reshape(t["shape"])


def _read(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """Check everything at `path`; return its manifest and {tensor: array}. Checks run in
    this order: the directory (not a link), the manifest, the listing, each file (size,
    then header), every tensor's pieces against the headers (nothing allocated yet), the
    memory they need, then each piece as it is read."""
    try:
        dir_fd = _open_checkpoint_dir(path)
    except confined.Refused as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open the directory ({e.strerror})") from None
    files: dict[str, tuple[int, dict]] = {}
    try:
        manifest = _parse_manifest(path, dir_fd)
        _check_listing(path, dir_fd, manifest["files"])
        for name, info in manifest["files"].items():
            files[name] = _open_file(path, dir_fd, name, info)
        headers = {name: header for name, (_, header) in files.items()}
        layouts = {name: _layout(path, name, t, headers)
                   for name, t in manifest["tensors"].items()}
        need = sum(dt.itemsize * n for dt, n in layouts.values())
        _check_memory(path, need)
        arrays = {name: _assemble(path, name, t, layouts[name], files)
                  for name, t in manifest["tensors"].items()}
    except OSError as e:
        raise CheckpointError(f"{path}: {_short(e)}") from None
    finally:
        for fd, _ in files.values():
            os.close(fd)
        os.close(dir_fd)
    return manifest, arrays


def _open_checkpoint_dir(path: Path) -> int:
    """A descriptor of the directory `path`; its last component must not be a link (the
    step directories of a root are never followed out of it)."""
    if not path.name:
        return confined.open_root(path)
    parent = confined.open_root(path.parent)
    try:
        return confined.open_dir(parent, path.name, path)
    finally:
        os.close(parent)


def _check_memory(path: Path, need: int) -> None:
    """Refuse a checkpoint whose arrays need more bytes than this machine's memory: a
    manifest with a shape of [2**40] is refused before anything is allocated."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):            # not on this platform: the files bound it
        return
    if need > total:
        raise CheckpointError(f"{path}: its arrays need {need / 2**30:.1f} GiB, more than "
                              f"this machine's {total / 2**30:.1f} GiB of memory; refusing "
                              f"to load it")


def load(path: str | os.PathLike) -> CheckpointState:
    """The CheckpointState saved at `path`, bitwise, whatever the number of writers was.

    Checks the manifest checksum, every file (size, header sha256), every piece (sha256)
    and that the directory holds nothing else; follows no link below `path` (nor `path`
    itself if it is one), reads nothing that is not a regular file, and allocates only
    what the files on disk hold (reliability/confined.py). Raises CheckpointError naming
    the first failure.
    """
    path = Path(path)
    try:
        manifest, arrays = _read(path)
        meta = manifest["state"]
        params = {k: arrays.pop(f"params/{k}") for k in meta["params"]}
        optimizer = {}
        for k, e in meta["optimizer"].items():
            v = arrays.pop(e["tensor"]) if "tensor" in e else e["value"]
            optimizer[k] = v[()] if e.get("numpy_scalar") else v
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError,
            RecursionError) as e:
        raise CheckpointError(f"{path / 'manifest.json'}: malformed: {_short(e)} (a manifest "
                              f"this code did not write?); refusing it") from None
    if arrays:
        raise CheckpointError(f"{path / 'manifest.json'}: tensors {sorted(arrays)} belong "
                              f"to neither params nor optimizer")
    return CheckpointState(manifest["step"], params, optimizer, meta["rng"],
                           meta["data_cursor"], meta["losses"], meta["extra"])
