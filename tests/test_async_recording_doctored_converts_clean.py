"""Regression: doctored async recordings that no recorder writes converted, and
checked clean (exit 0):

* the log relabelled format 2 (its ``batch`` numbers dropped): batches were then
  implicit, so the updates of batches 10 and 11 swapped converted to a clean
  trace, although recorders of formats 1 and 2 refuse async scheduling;
* a format 3 log with its ``batch`` numbers dropped: the same, implicitly;
* an ``error`` record inserted after batch 100's update: the 250 steps after it
  were silently dropped (``recording stopped early``, exit 0), although the
  recorder writes nothing after ``error`` but its ``end``;
* records after ``end``: refused only by luck (``update without a schedule``).

All four are now one-line ConvertErrors naming the line; a real ``error`` then
``end`` still converts (tests/test_vllm_recording.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.candidates.vllm import recording_convert as rc
from test_serve_async import SCENARIO, _line_of, _record_async, _records, model  # noqa: F401 - fixture


@pytest.fixture(scope="module")
def lines(model, tmp_path_factory) -> list[str]:  # noqa: F811
    out = tmp_path_factory.mktemp("async-doctored")
    trace = out / "async.parquet"
    _record_async(SCENARIO, model, trace)
    return _records(trace.with_suffix(".jsonl"))


def _refused(tmp_path: Path, name: str, lines: list[str]) -> str:
    bad = tmp_path / f"{name}.jsonl"
    bad.write_text("".join(lines))
    with pytest.raises(rc.ConvertError) as exc:
        rc.convert(bad, tmp_path / f"{name}.parquet")
    assert not (tmp_path / f"{name}.parquet").exists()
    return str(exc.value).replace(str(bad), name)


def _without_batches(lines: list[str], fmt: int) -> list[str]:
    out = []
    for line in lines:
        rec = json.loads(line)
        rec.pop("batch", None)
        if rec["t"] == "meta":
            rec["format"] = fmt
        out.append(json.dumps(rec) + "\n")
    return out


@pytest.mark.vllm
def test_regression_format_2_async_log_with_swapped_updates_is_refused(lines, tmp_path) -> None:
    swapped = list(lines)
    u10, u11 = _line_of(lines, "update", 10), _line_of(lines, "update", 11)
    swapped[u10], swapped[u11] = lines[u11], lines[u10]
    assert _refused(tmp_path, "f2", _without_batches(swapped, 2)) == (
        "f2: a format 2 recording with 2 batches in flight (async scheduling): only format 3 records async "
        "scheduling (its batches numbered); the log was edited")


@pytest.mark.vllm
def test_regression_format_3_log_without_batch_numbers_is_refused(lines, tmp_path) -> None:
    s0 = _line_of(lines, "schedule", 0)
    assert _refused(tmp_path, "f3", _without_batches(lines, 3)) == (
        f"f3:{s0 + 1}: schedule record without its batch (a format 3 recording numbers every batch): "
        f"the log was edited")


@pytest.mark.vllm
def test_regression_records_after_an_error_record_are_refused(lines, tmp_path) -> None:
    u100 = _line_of(lines, "update", 100)
    doctored = lines[:u100 + 1] + ['{"t":"error","step":101,"error":"X: y"}\n'] + lines[u100 + 1:]
    assert _refused(tmp_path, "err", doctored) == (
        f"err:{u100 + 3}: a {json.loads(lines[u100 + 1])['t']!r} record after the recording's error record: "
        f"the log was edited")
    # The recorder's own ending, error then end, still converts (stopped early).
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:u100 + 1] + ['{"t":"error","step":101,"error":"X: y"}\n', lines[-1]]))
    summary = rc.convert(cut, tmp_path / "cut.parquet")
    assert "recording stopped early: X: y" in summary["warnings"]


@pytest.mark.vllm
def test_regression_records_after_the_end_are_refused(lines, tmp_path) -> None:
    s = _line_of(lines, "schedule", 3)
    doctored = lines + [lines[s]]
    assert _refused(tmp_path, "end", doctored) == (
        f"end:{len(lines) + 1}: a 'schedule' record after the recording's end: the log was edited")
