"""The recording scheduler's JSONL formats and writer, without vLLM (issue 15, recording overhead).

``tests/data/vllm-0.32.0-format2.jsonl.gz`` is a format-2 recording made by the recording
scheduler before format 3 existed (``harness serve-record SCENARIO --offline`` on vLLM 0.32.0 with
the tiny llama: 8 requests of 16-64 prompt tokens on 7 blocks of 32 tokens, 148 steps, 3
preemptions). ``convert`` must keep reading it, and the same recording written in format 3 (a
snapshot's ``waiting``/``running`` left out when they are the previous snapshot's, ``request_states``
only in ``after`` and only when not empty) must convert to the same rows. The real recorder's
format-3 output is checked against recorded goldens by tests/test_vllm_recording.py and
tests/test_serve.py.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from harness.candidates.vllm import recording_convert as rc
from harness.candidates.vllm.recording_steps import read_records

from harness.candidates.vllm import recording_scheduler as rs

FORMAT2 = Path(__file__).with_name("data") / "vllm-0.32.0-format2.jsonl.gz"


def _records() -> list[dict]:
    with gzip.open(FORMAT2, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _to_format3(records: list[dict]) -> list[dict]:
    """Format 3's rules: batches numbered (one in flight: an update completes the
    schedule before it), and queues left out by request id (the recorder compares
    Request objects by identity: the same objects in the same order are the same
    ids in the same order)."""
    out, shown, batches = [], {}, 0
    for rec in json.loads(json.dumps(records)):
        if rec["t"] == "meta":
            rec["format"] = 3
        if rec["t"] == "schedule":
            rec["batch"], batches = batches, batches + 1
        elif rec["t"] == "update" or (rec["t"] == "crash" and rec.get("call") == "update_from_output"):
            rec["batch"] = batches - 1
        snaps = []
        if rec["t"] == "schedule":
            snaps = [(rec["before"], False), (rec["after"], True)]
        elif rec["t"] == "crash" and rec.get("before") is not None:
            snaps = [(rec["before"], False)]
        for snap, is_after in snaps:
            for key in ("waiting", "running"):
                if shown.get(key) == snap[key]:
                    del snap[key]
                else:
                    shown[key] = snap[key]
            states = snap.pop("request_states", None)
            if is_after and states:
                snap["request_states"] = states
        out.append(rec)
    return out


def _write(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    return path


def _rows_and_meta(trace: Path) -> tuple[list[dict], dict]:
    table = pq.read_table(trace)
    meta = json.loads(table.schema.metadata[b"sched_harness"])
    return table.to_pylist(), meta


def test_a_format_2_recording_still_converts(tmp_path: Path) -> None:
    summary = rc.convert(_write(tmp_path / "rec.jsonl", _records()), tmp_path / "rec.parquet")
    assert {k: summary[k] for k in ("steps", "events", "requests", "finished", "preemptions",
                                    "prefix_hit_tokens", "dropped_idle_steps", "warnings")} == {
        "steps": 148, "events": 1132, "requests": 8, "finished": 8, "preemptions": 3,
        "prefix_hit_tokens": 352, "dropped_idle_steps": 0, "warnings": []}


def test_the_same_recording_in_format_3_converts_to_identical_rows(tmp_path: Path) -> None:
    records = _records()
    new = _to_format3(records)
    schedules = [r for r in new if r["t"] == "schedule"]
    # The rewrite really leaves queues out (what convert must fill in), mostly:
    assert [sum(key not in r[snap] for r in schedules) for snap in ("before", "after")
            for key in ("waiting", "running")] == [145, 140, 137, 137]
    assert sum("request_states" in r["after"] for r in schedules) == 3  # the preemption steps
    rows2, meta2 = _rows_and_meta(_trace(tmp_path / "f2", records))
    rows3, meta3 = _rows_and_meta(_trace(tmp_path / "f3", new))
    assert len(rows3) == 1132 and rows3 == rows2
    assert meta2["vllm_recording"].pop("format") == 2 and meta3["vllm_recording"].pop("format") == 3
    assert meta3 == meta2


def _trace(folder: Path, records: list[dict]) -> Path:
    rc.convert(_write(folder / "rec.jsonl", records), folder / "rec.parquet")
    return folder / "rec.parquet"


def test_a_format_3_snapshot_with_nothing_to_fill_from_is_refused(tmp_path: Path) -> None:
    new = _to_format3(_records())
    first = next(i for i, r in enumerate(new) if r["t"] == "schedule")
    del new[first]["before"]["waiting"]
    path = _write(tmp_path / "rec.jsonl", new)
    with pytest.raises(rc.ConvertError) as info:
        rc.convert(path, tmp_path / "rec.parquet")
    assert str(info.value) == f"{path}:{first + 1}: a snapshot without 'waiting' and none before it"
    assert not (tmp_path / "rec.parquet").exists()


class _Index:
    """An integer-like value that is not an int (numpy's and torch's scalars are such)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_the_json_fallback_writes_json_lines_once_per_flush(tmp_path: Path) -> None:
    """Our venv has no msgspec: the writer's json path (msgspec's is the next test's)."""
    path = tmp_path / "out.jsonl"
    writer = rs._LineWriter(path, use_msgspec=False)
    writer.write({"t": "arrival", "prompt_token_ids": [1, _Index(7)], "name": "naïve\u2028", "x": 0.1})
    with pytest.raises(TypeError):
        writer.write({"t": "bad", "value": object()})
    assert path.read_bytes() == b""  # buffered until the step's flush
    writer.flush()
    writer.write({"t": "end", "steps": 2**70})  # past 64 bits: msgspec refuses, json's rules apply
    writer.close()
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]
    assert [json.loads(line) for line in lines] == [
        {"t": "arrival", "prompt_token_ids": [1, 7], "name": "naïve\u2028", "x": 0.1},
        {"t": "end", "steps": 2**70}]


WRITE_BOTH = r'''
import json, sys
from pathlib import Path
from harness.candidates.vllm import recording_convert as rc
from harness.candidates.vllm import recording_scheduler as rs
assert rs._MSGSPEC_ENCODER is not None, "msgspec missing from vLLM's env"
records = json.loads(Path(sys.argv[1]).read_text())
records.append({"t": "note", "name": "naïve\u2028", "big": 2**70, "x": 0.1})  # msgspec hands 2**70 to json
for name, flag in (("msgspec", True), ("json", False)):
    writer = rs._LineWriter(Path(sys.argv[2]) / f"{name}.jsonl", use_msgspec=flag)
    for rec in records:
        writer.write(rec)
        writer.flush()
    writer.close()
'''


@pytest.mark.vllm
def test_msgspec_and_json_write_the_same_values(tmp_path: Path) -> None:
    """Under vLLM 0.33.0's env (which has msgspec): the recording written both ways reads back
    to the same records, line for line."""
    import os
    import subprocess
    import sys

    if os.environ.get("HARNESS_SKIP_VLLM") == "1":
        pytest.skip("HARNESS_SKIP_VLLM=1")
    from harness.candidates.vllm.env import ensure_env

    python = ensure_env("0.33.0", log=lambda line: print(f"vllm-env: {line}", file=sys.stderr))
    records = _records()
    (tmp_path / "records.json").write_text(json.dumps(records))
    (tmp_path / "script.py").write_text(WRITE_BOTH)
    proc = subprocess.run([str(python), str(tmp_path / "script.py"), str(tmp_path / "records.json"),
                           str(tmp_path)], env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # (split on "\n" only, as convert's reader does: msgspec leaves U+2028 unescaped)
    fast, plain = ((tmp_path / f"{n}.jsonl").read_text(encoding="utf-8").split("\n")[:-1]
                   for n in ("msgspec", "json"))
    records.append({"t": "note", "name": "naïve\u2028", "big": 2**70, "x": 0.1})
    assert [rec for _, rec in read_records(tmp_path / "msgspec.jsonl")] == records
    assert len(fast) == len(records) == 307
    assert [json.loads(line) for line in fast] == [json.loads(line) for line in plain] == records
