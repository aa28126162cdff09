"""The Chrome-trace writer must produce the Trace Event Format exactly: complete events with
microsecond ts/dur, one pid per rank with a label, ordered by time, and read back unchanged."""

import json
import time

import pytest

from minidist.observe.trace import Event, Trace, now_us


def _sample() -> Trace:
    t = Trace(labels={1: "rank 1 (tp)"})
    t.add("step 1", rank=1, start_us=20.0, end_us=35.5, args={"chunk": 3, "bytes": 16},
          cat="reduce-scatter")
    t.add("all_reduce", rank=0, start_us=10.0, end_us=50.0, args={"algo": "ring"})
    t.add("step 0", rank=0, start_us=10.0, end_us=20.0, cat="reduce-scatter")
    t.add("worker", rank=0, start_us=12.25, end_us=13.0, lane=1)
    return t


def test_json_is_the_trace_event_format():
    doc = json.loads(json.dumps(_sample().to_json()))
    assert set(doc) == {"traceEvents", "displayTimeUnit"}
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    assert len(complete) == 4
    for e in complete:
        assert set(e) == {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
        assert e["dur"] >= 0
    step1 = next(e for e in complete if e["name"] == "step 1")
    assert (step1["ts"], step1["dur"], step1["pid"], step1["tid"]) == (20.0, 15.5, 1, 0)
    assert step1["args"] == {"chunk": 3, "bytes": 16} and step1["cat"] == "reduce-scatter"
    names = {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1 (tp)")}       # default and explicit labels
    # metadata first, so viewers label the rows before drawing them
    kinds = [e["ph"] for e in doc["traceEvents"]]
    assert kinds == sorted(kinds, key=lambda k: k != "M")


def test_events_are_ordered_by_time_and_enclosing_first():
    order = [(e.name, e.rank, e.lane) for e in _sample().events()]
    # at ts=10 on rank 0 the 40 us all_reduce encloses the 10 us step 0: it comes first
    assert order == [("all_reduce", 0, 0), ("step 0", 0, 0), ("worker", 0, 1),
                     ("step 1", 1, 0)]
    ts = [e["ts"] for e in _sample().to_json()["traceEvents"] if e["ph"] == "X"]
    assert ts == sorted(ts)


def test_write_and_read_round_trip(tmp_path):
    t = _sample()
    path = t.write(tmp_path / "sub" / "trace.json")
    assert path.exists() and not list(path.parent.glob("*.tmp*"))   # atomic: no temp left
    back = Trace.read(path)
    assert back.labels == {0: "rank 0", 1: "rank 1 (tp)"}
    for a, b in zip(t.events(), back.events(), strict=True):
        assert (a.name, a.rank, a.lane, a.cat, a.args) == (b.name, b.rank, b.lane, b.cat, b.args)
        assert a.start_us == b.start_us and b.end_us == pytest.approx(a.end_us, abs=1e-9)


def test_shifted_moves_time_zero_to_the_first_event():
    s = _sample().shifted()
    assert min(e.start_us for e in s.events()) == 0.0
    assert [e.dur_us for e in s.events()] == [e.dur_us for e in _sample().events()]
    assert s.labels == _sample().labels


def test_span_records_the_wall_time_of_a_block():
    t = Trace()
    before = now_us()
    with t.span("sleep", rank=2, cat="test") as args:
        time.sleep(0.01)
        args["slept_ms"] = 10
    after = now_us()
    (e,) = t.events()
    assert before <= e.start_us and e.end_us <= after
    assert e.dur_us >= 9_000                      # 10 ms asleep, in microseconds
    assert (e.rank, e.cat, e.args) == (2, "test", {"slept_ms": 10})


def test_span_records_a_block_that_raises():
    t = Trace()
    with pytest.raises(KeyError):
        with t.span("lookup", rank=0):
            raise KeyError("x")
    (e,) = t.events()
    assert e.name == "lookup" and e.args == {"error": "KeyError"}


@pytest.mark.parametrize("bad, match", [
    (dict(name="x", rank=0, start_us=5.0, end_us=4.0), "before it starts"),
    (dict(name="x", rank=-1, start_us=0.0, end_us=1.0), "rank"),
    (dict(name="", rank=0, start_us=0.0, end_us=1.0), "name"),
    (dict(name="x", rank=0, start_us=0.0, end_us=float("nan")), "not finite"),
    (dict(name="x", rank=0, start_us=0.0, end_us=1.0, args={"a": object()}), "JSON"),
])
def test_bad_events_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        Trace().add(**bad)
    with pytest.raises(ValueError, match=match):
        Trace([Event(**bad)])


def test_read_refuses_a_file_that_is_not_a_trace(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("[1, 2]")
    with pytest.raises(ValueError, match="traceEvents"):
        Trace.read(p)
