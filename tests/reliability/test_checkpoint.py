"""Checkpoints round-trip bitwise whatever the number of writers, survive a crash at every
point of a save, and refuse whatever is corrupt, truncated, unexpected or a pickle.

W writers run as W threads with a threading.Barrier (one process), as W forked ranks with
the runtime's barrier (once), and as a child process that dies (os._exit) mid-save.

The crash-at-every-phase sweep runs three phases by default (one per outcome: before the
commit, finished but uncommitted, the commit itself); every phase runs in the slow set.
"""

import hashlib
import json
import os
import pickle
import struct
import threading

import multiprocess as mp
import numpy as np
import pytest

import minidist
from minidist.reliability.async_checkpoint import AsyncCheckpointer
from minidist.reliability.checkpoint import (PHASES, CheckpointError,
                                             CheckpointState, latest, load, save)
from minidist.reliability import confined
from minidist.runtime import spawn


def _state(step: int) -> CheckpointState:
    """Every awkward case: odd sizes, 0-d, empty, N < W, -0.0, a NaN with a payload, inf,
    int64 near its limits, bool, uint8, float16, a big-endian array, NumPy scalars."""
    rng = np.random.default_rng(step)
    wte = rng.standard_normal((7, 5))
    wte[0, :3] = -0.0, np.inf, np.array(0x7FF8000000000123, np.uint64).view(np.float64)
    params = {"wte": wte, "ln.g": rng.standard_normal(13).astype(np.float32),
              "counts": rng.integers(-2**62, 2**62, size=(3, 4, 2)), "scale": np.array(1.5),
              "empty": np.zeros((0, 3)), "one": np.array([7]), "mask": rng.random(5) > 0.5,
              "u8": rng.integers(0, 255, 11).astype(np.uint8),
              "half": rng.standard_normal(4).astype(np.float16),
              "big_endian": np.arange(5, dtype=">i4")}
    optimizer = {"step": step, "lr": 1e-3, "m.0": rng.standard_normal((7, 5)),
                 "v.0": rng.random(13).astype(np.float32), "loss_scale": np.float32(0.5)}
    return CheckpointState(step, params, optimizer, {"seed": 1234, "data": {"counter": 8 * step}},
                           {"epoch": 0, "sample": 8 * step}, [2.5, 1 / 3, float("inf")][:step],
                           {"plan": "Plan(dp=2, tp=1)", "config": {"lr": 1e-3, "tie": True}})


def _assert_same(got: CheckpointState, want: CheckpointState, what: str = "") -> None:
    assert got.step == want.step, what
    for part in ("params", "optimizer"):
        g, w = getattr(got, part), getattr(want, part)
        assert list(g) == list(w), f"{what} {part}: keys or their order differ"
        for k in w:
            if isinstance(w[k], (np.ndarray, np.generic)):
                assert type(g[k]) is type(w[k]), f"{what} {part}[{k}]: {type(g[k])}"
                assert g[k].dtype.newbyteorder("=") == w[k].dtype.newbyteorder("="), k
                assert g[k].shape == w[k].shape, f"{what} {part}[{k}]: shape"
                assert g[k].astype(g[k].dtype.newbyteorder("<")).tobytes() == \
                    w[k].astype(w[k].dtype.newbyteorder("<")).tobytes(), f"{what} {part}[{k}]"
            else:
                assert type(g[k]) is type(w[k]) and g[k] == w[k], f"{what} {part}[{k}]"
    assert (got.rng, got.data_cursor, got.extra) == (want.rng, want.data_cursor, want.extra)
    assert got.losses == want.losses, what


def _save_threads(state, root, world, keep=3, on_phase=None):
    """Run a W-writer save in this process: one thread per rank, a real barrier."""
    bar, errors, token = threading.Barrier(world, timeout=10), [], confined.token()

    def run(r):
        try:
            save(state, root, rank=r, world=world, barrier=bar.wait, keep=keep,
                 on_phase=on_phase if r == 0 else None, token=token)
        except BaseException as e:  # noqa: BLE001 -- re-raised below, in the test's thread
            errors.append(e)
            bar.abort()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    if errors:
        raise errors[0]


def _parse_safetensors(path):
    """An independent reader of the format: {name: (dtype, shape, bytes)}, header length."""
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__")
    return {k: (e["dtype"], e["shape"], data[8 + n + e["data_offsets"][0]:
                                             8 + n + e["data_offsets"][1]])
            for k, e in header.items()}, n, meta


@pytest.mark.parametrize("world", [1, 2, 3])
def test_round_trip_is_bitwise_and_rank_files_are_safetensors_of_array_split_pieces(
        tmp_path, world):
    state = _state(3)
    _save_threads(state, tmp_path, world)
    found = latest(tmp_path)
    assert found.path == tmp_path / "step00000003" and found.step == 3 and found.skipped == ()
    _assert_same(load(found.path), state)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step00000003"]
    assert (tmp_path / "latest").read_text() == "step00000003\n"

    manifest = json.loads((found.path / "manifest.json").read_text())
    assert manifest["writers"] == world and manifest["step"] == 3
    for r in range(world):
        name = f"rank{r:05d}.safetensors"
        blob = (found.path / name).read_bytes()
        tensors, n, meta = _parse_safetensors(found.path / name)
        assert manifest["files"][name] == {                # the header's bytes: 8 + n
            "size": len(blob), "header_sha256": hashlib.sha256(blob[:8 + n]).hexdigest()}
        assert n % 8 == 0 and meta == {"format": "minidist-checkpoint", "step": "3",
                                       "rank": str(r), "writers": str(world)}
        for key, a in [(f"params/{k}", v) for k, v in state.params.items()] + \
                [(f"optimizer/{k}", v) for k, v in state.optimizer.items()
                 if isinstance(v, (np.ndarray, np.generic))]:
            piece = np.array_split(np.asarray(a).reshape(-1), world)[r]
            dtype, shape, raw = tensors[key]
            assert shape == [piece.size] and raw == piece.astype(piece.dtype.newbyteorder("<")
                                                                 ).tobytes(), (key, r)
            assert manifest["tensors"][key]["dtype"] == dtype


@pytest.mark.multiproc
def test_a_checkpoint_written_by_w_writers_loads_under_any_other_w_and_in_forked_ranks(
        tmp_path):
    """W=2 writers (threads) -> loaded on 3 forked ranks; those 3 save (sync, then async)
    with the runtime's barrier -> loaded here, in one process."""
    _save_threads(_state(4), tmp_path / "w2", world=2)
    got = spawn(3, _ranks_load_then_save, str(tmp_path))
    for r, s in enumerate(got):
        _assert_same(s, _state(4), f"rank {r} of 3 loading a W=2 checkpoint")
    found = latest(tmp_path / "w3")
    assert found.step == 7 and sorted(os.listdir(tmp_path / "w3")) == [
        "latest", "step00000006", "step00000007"]                             # keep=2
    for step in (6, 7):
        path = tmp_path / "w3" / f"step{step:08d}"
        assert json.loads((path / "manifest.json").read_text())["writers"] == 3
        _assert_same(load(path), _state(step), f"step {step} saved by 3 ranks")


def _ranks_load_then_save(ctx, root):
    state = load(latest(os.path.join(root, "w2")).path)
    w3, world = os.path.join(root, "w3"), ctx.world_size
    save(_state(5), w3, rank=ctx.rank, world=world, barrier=lambda: minidist.barrier(), keep=2,
         token="the-token-of-save-5")
    with AsyncCheckpointer(w3, rank=ctx.rank, world=world, barrier=lambda: minidist.barrier(),
                           keep=2, token="the-async-token") as writer:
        writer.snapshot(_state(6))
        writer.snapshot(_state(7))
    return state


def test_a_save_passes_every_phase_in_order_and_retention_keeps_k(tmp_path):
    for step in (1, 2, 3):
        save(_state(step), tmp_path, keep=2)
    seen = []
    (tmp_path / ".tmp-step00000099").mkdir()                  # a crashed save's leftovers
    (tmp_path / ".tmp-step00000099" / "rank00000.safetensors").write_bytes(b"x")
    save(_state(4), tmp_path, keep=2, on_phase=seen.append)
    assert seen == list(PHASES)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step00000003", "step00000004"]
    save(_state(5), tmp_path, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step00000005"]


def _crash_at(phase, root, keep):
    def hook(name):
        if name == phase:
            os._exit(17)                               # dies here: no cleanup, no finally
    _save_threads(_state(3), root, world=2, keep=keep, on_phase=hook)
    os._exit(0)                                        # the save finished: hook never fired


# One phase per outcome by default (a rank file half written -> the previous checkpoint; the
# step directory complete but `latest` not replaced -> the previous, the new one skipped as
# "newer than"; `latest` replaced -> the new one); the other phases in the slow set.
CRASH_DEFAULT = ("rank_file_partial", "dir_renamed", "latest_replaced")


@pytest.mark.parametrize("phase", [p if p in CRASH_DEFAULT else
                                   pytest.param(p, marks=pytest.mark.slow) for p in PHASES])
def test_a_crash_at_any_point_of_a_save_leaves_the_previous_or_the_new_checkpoint(
        tmp_path, phase):
    """Steps 1 and 2 are committed (keep=2); the process saving step 3 with 2 writers dies
    at `phase`. Replacing `latest` is the commit point: step 3 if it was passed, else 2.
    Then the next save (step 4) clears what the crash left."""
    for step in (1, 2):
        _save_threads(_state(step), tmp_path, world=2, keep=2)
    child = mp.get_context("fork").Process(target=_crash_at, args=(phase, tmp_path, 2))
    child.start()
    child.join(30)
    assert child.exitcode == 17, f"the save did not reach {phase} (exit {child.exitcode})"

    committed = PHASES.index(phase) >= PHASES.index("latest_replaced")
    want = 3 if committed else 2
    found = latest(tmp_path)
    assert found.step == want, f"crash at {phase}: {found}"
    _assert_same(load(found.path), _state(want), f"crash at {phase}")
    if phase in ("dir_renamed", "latest_partial"):             # step 3 finished, uncommitted
        assert found.skipped and "step00000003: newer than" in found.skipped[0]
    _save_threads(_state(4), tmp_path, world=2, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["latest", f"step{want:08d}", "step00000004"]
    _assert_same(load(latest(tmp_path).path), _state(4), f"save after a crash at {phase}")


def _corrupt(path, how):
    target = path / "rank00001.safetensors"
    if how == "flip":
        blob = bytearray(target.read_bytes())
        blob[len(blob) // 2] ^= 0x01
        target.write_bytes(bytes(blob))
    elif how == "header":                               # the header's last byte: padding
        blob = bytearray(target.read_bytes())           # that no parser would miss
        blob[8 + struct.unpack("<Q", blob[:8])[0] - 1] ^= 0x01
        target.write_bytes(bytes(blob))
    elif how == "truncate":
        target.write_bytes(target.read_bytes()[:-5])
    elif how == "delete":
        target.unlink()
    else:                                               # one changed character of a sha256
        text = (path / "manifest.json").read_text()
        i = text.index('"sha256": "') + len('"sha256": "')
        (path / "manifest.json").write_text(text[:i] + "0123"[text[i] == "0"] + text[i + 1:])
        target = path / "manifest.json"
    return target.name


@pytest.mark.parametrize("how,check", [("flip", "sha256 check failed"),
                                       ("header", "sha256 check failed: its header"),
                                       ("truncate", "size check failed"),
                                       ("delete", "missing"),
                                       ("manifest", "checksum check failed")])
def test_a_corrupt_checkpoint_is_named_and_skipped_for_the_previous_one(tmp_path, how, check):
    for step in (1, 2, 3):
        _save_threads(_state(step), tmp_path, world=2)
    name = _corrupt(tmp_path / "step00000003", how)
    found = latest(tmp_path)
    assert found.step == 2 and len(found.skipped) == 1
    note = found.skipped[0]
    assert note.startswith("step00000003: ") and name in note and check in note, note
    _assert_same(load(found.path), _state(2))
    with pytest.raises(CheckpointError, match=check):
        load(tmp_path / "step00000003")

    _corrupt(tmp_path / "step00000002", how)
    (tmp_path / "step00000001" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no intact checkpoint") as info:
        latest(tmp_path)
    assert all(f"step0000000{s}: " in str(info.value) for s in (1, 2, 3))


def test_planted_pickles_and_unexpected_files_are_refused_by_name(tmp_path, monkeypatch):
    for step in (1, 2):
        save(_state(step), tmp_path)
    newest = tmp_path / "step00000002"
    for name, write in [("optimizer.pkl", lambda p: p.write_bytes(pickle.dumps({"m": 1}))),
                        ("evil.npy", lambda p: np.save(p, np.array([{}], dtype=object),
                                                       allow_pickle=True)),
                        ("rank00007.safetensors", lambda p: p.write_bytes(b"\0" * 8))]:
        write(newest / name)
        with pytest.raises(CheckpointError, match=f"{name}: unexpected file"):
            load(newest)
        found = latest(tmp_path)
        assert found.step == 1 and name in found.skipped[0]
        (newest / name).unlink()

    def refuse(*_, **__):
        raise AssertionError("the loader unpickled or called np.load")
    for mod, attr in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (np, "load")]:
        monkeypatch.setattr(mod, attr, refuse)
    _assert_same(load(latest(tmp_path).path), _state(2))


def _rewrite_manifest(path, edit):
    """Edit a manifest and re-sign it (its checksum: sha256 of the compact JSON of the
    rest), as someone crafting a hostile checkpoint would."""
    body = json.loads((path / "manifest.json").read_text())
    body.pop("checksum")
    edit(body)
    text = json.dumps(body, separators=(",", ":"))
    body["checksum"] = hashlib.sha256(text.encode()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(body))


def test_a_re_signed_manifest_still_cannot_smuggle_objects_or_altered_pieces(tmp_path):
    path = save(_state(2), tmp_path)
    _rewrite_manifest(path, lambda b: b["tensors"]["params/wte"].update(dtype="O"))
    with pytest.raises(CheckpointError, match="'params/wte' has dtype 'O'"):
        load(path)

    path = save(_state(3), tmp_path)
    blob = bytearray((path / "rank00000.safetensors").read_bytes())
    blob[-1] ^= 0x01                                       # the last piece's last byte
    (path / "rank00000.safetensors").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="the piece of 'optimizer/loss_scale' changed"):
        load(path)

    _rewrite_manifest(path, lambda b: b["files"].update({"../latest": {"size": 1}}))
    with pytest.raises(CheckpointError, match="'../latest', not a rank file name"):
        load(path)


def test_bad_state_is_refused_before_any_write(tmp_path):
    bad = _state(1)
    bad.params["z"] = np.array([1 + 2j])
    with pytest.raises(ValueError, match="params/z has dtype complex128"):
        save(bad, tmp_path)
    bad = _state(1)
    bad.rng["gen"] = np.random.default_rng(0)
    with pytest.raises(ValueError, match="rng is not JSON-able"):
        save(bad, tmp_path)
    with pytest.raises(ValueError, match="world=2 writers need barrier="):
        save(_state(1), tmp_path, rank=1, world=2)
    assert os.listdir(tmp_path) == []
    assert latest(tmp_path / "nothing") is None


class _Gate:
    """An on_phase hook that holds the first write at `rank_file_partial` until released,
    and counts writes in flight."""

    def __init__(self):
        self.entered, self.release, self.waiting, self.committed = (
            threading.Event() for _ in range(4))
        self.active = self.most = 0
        self.commit_threads = []
        self.lock = threading.Lock()

    def __call__(self, phase):
        with self.lock:
            self.active += {"tmp_dir_created": 1, "marker_written": -1}.get(phase, 0)
            self.most = max(self.most, self.active)
        if phase == "rank_file_partial" and not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(10), "never released"
        if phase == "snapshot_waiting":
            self.waiting.set()
        if phase == "latest_replaced":
            self.commit_threads.append(threading.current_thread())
            self.committed.set()


def test_an_owned_snapshot_is_written_without_a_copy_and_loads_the_same(tmp_path):
    """owned=True (train.py's hook: the engine's full state is new arrays): the arrays
    handed over are the ones written, and the checkpoint loads as the state."""
    gate = _Gate()
    writer = AsyncCheckpointer(tmp_path, keep=2, on_phase=gate)
    state = _state(1)
    writer.snapshot(state, owned=True)
    assert gate.entered.wait(10) and writer.busy
    assert writer._thread._args[1] is state             # no copy on the training thread
    gate.release.set()
    assert writer.close() == tmp_path / "step00000001"
    _assert_same(load(latest(tmp_path).path), _state(1))


def test_async_snapshot_returns_while_its_write_is_still_running(tmp_path):
    gate = _Gate()
    writer = AsyncCheckpointer(tmp_path, keep=2, on_phase=gate)
    state = _state(1)
    assert writer.snapshot(state) == 0.0
    assert gate.entered.wait(10) and writer.busy        # the write is held mid-file ...
    assert latest(tmp_path) is None                      # ... so nothing is committed
    state.params["wte"][:] = 0.0                         # training goes on: the copy is saved
    state.optimizer["m.0"] += 1.0
    gate.release.set()
    assert writer.close() == tmp_path / "step00000001"
    _assert_same(load(latest(tmp_path).path), _state(1))
    with pytest.raises(CheckpointError, match="snapshot after close"):
        writer.snapshot(_state(2))


def test_async_never_two_writes_at_once_and_says_how_long_it_waited(tmp_path):
    gate = _Gate()
    writer = AsyncCheckpointer(tmp_path, keep=2, on_phase=gate)
    writer.snapshot(_state(1))
    assert gate.entered.wait(10)
    waited = []
    second = threading.Thread(target=lambda: waited.append(writer.snapshot(_state(2))))
    second.start()
    assert gate.waiting.wait(10)                         # snapshot 2 waits for write 1
    assert latest(tmp_path) is None
    gate.release.set()
    second.join(10)
    assert waited and waited[0] > 0.0
    assert gate.committed.wait(10)                       # snapshot 2's thread commits 1 ...
    assert latest(tmp_path).step == 1
    assert gate.commit_threads[0] not in (threading.main_thread(), second)   # ... not training
    writer.close()
    assert gate.most == 1, f"{gate.most} writes ran at once"
    for step in (1, 2):
        _assert_same(load(tmp_path / f"step{step:08d}"), _state(step))


@pytest.mark.parametrize("surfaces_at", ["snapshot", "close"])
def test_an_error_in_the_background_write_is_raised_on_the_training_thread(tmp_path,
                                                                           surfaces_at):
    def disk_full(phase):
        if phase == "rank_file_written" and not fired:
            fired.append(phase)
            raise OSError(28, "No space left on device (injected)")
    fired = []
    writer = AsyncCheckpointer(tmp_path, on_phase=disk_full)
    writer.snapshot(_state(1))                           # returns: the error comes later
    with pytest.raises(CheckpointError, match="background save failed") as info:
        writer.snapshot(_state(2)) if surfaces_at == "snapshot" else writer.close()
    assert "No space left on device" in str(info.value.__cause__)
    assert latest(tmp_path) is None                      # step 1 never committed
    if surfaces_at == "snapshot":
        writer.snapshot(_state(3))
        writer.close()
        assert sorted(os.listdir(tmp_path)) == ["latest", "step00000003"]
        _assert_same(load(latest(tmp_path).path), _state(3))


def test_the_async_writer_thread_yields_its_core_to_training(tmp_path):
    """The writer runs at nice NICE (Linux: per thread), so on a core shared with training
    the scheduler runs training first; the training thread keeps its own priority."""
    from minidist.reliability import async_checkpoint
    seen = []

    def phase(name):
        if name == "rank_file_written":
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with AsyncCheckpointer(tmp_path, on_phase=phase) as writer:
        writer.snapshot(_state(1))
    if before <= async_checkpoint.NICE:              # raising one's own nice is always allowed
        assert seen == [async_checkpoint.NICE], seen
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
