"""Issue 26: rows that contradict each other are refused by ``check`` alone
(before, only ``replay`` caught each). Every attack edits a real trace with
plain pyarrow and reseals it (a fresh digest: what a deliberate editor does),
then ``check`` must exit non-zero with a line naming the problem: exit 2 and
one line for what no recorder writes (the validator, ``harness.trace.validate``
and ``harness.trace.clock``), exit 1 and a verdict naming the invariant for
what an engine could decide but must not (the catalogue).

Layers: status/reason mismatch and the clock: consistency refusals of the
trace itself (validator); a finish's count off its output rows: OUTPUT-COUNT
(safety); a victim's missing request_state row: PREEMPT-EFFECTS (safety);
output rows out of scheduling order and two outputs in one batch:
OUTPUT-ORDER (safety); max_tokens inconsistent with the finish: STOP-RULES
(safety).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.trace import SUMMARY_KEY
from harness.trace.writer import reseal

ROOT = Path(__file__).resolve().parents[1]
PREEMPTION = ROOT / "traces" / "preemption-heavy.parquet"  # 160 steps, 15 preemptions
SPEC = ROOT / "golden" / "spec-decode.parquet"
EOS = ROOT / "golden" / "eos-stop-abort.parquet"  # stops on EOS, aborts

Rows = list[dict[str, Any]]


def doctored(tmp_path: Path, source: Path, edit: Callable[[Rows], None]) -> Path:
    table = pq.read_table(source)
    rows = table.to_pylist()
    edit(rows)
    kv = dict(pq.ParquetFile(source).metadata.metadata)
    summary = json.loads(kv[SUMMARY_KEY])
    summary["events"] = len(rows)
    kv[SUMMARY_KEY] = json.dumps(summary, sort_keys=True).encode()
    out = tmp_path / "doctored.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema).replace_schema_metadata(kv), out)
    return reseal(out, out)


def check(path: Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["check", str(path)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def renumber(rows: Rows, step: int) -> None:
    index = 0
    for row in rows:
        if row["step"] == step:
            row["event_index"] = index
            index += 1


def first(rows: Rows, kind: str, where: Callable[[dict], bool] = lambda r: True) -> dict:
    return next(r for r in rows if r["kind"] == kind and where(r))


def _stopped_with_length(rows: Rows) -> None:
    first(rows, "finish", lambda r: r["status"] == "FINISHED_LENGTH_CAPPED")["status"] = "FINISHED_STOPPED"


def _count_off_by_one(rows: Rows) -> None:
    first(rows, "finish", lambda r: r["finish_reason"] == "stop")["num_output_tokens"] -= 1


def _state_row_dropped(rows: Rows) -> None:
    row = first(rows, "request_state", lambda r: r["status"] == "PREEMPTED")
    rows.remove(row)
    renumber(rows, row["step"])


def _outputs_swapped(rows: Rows) -> None:
    step = next(r["step"] for r in rows if r["kind"] == "output"
                and sum(o["kind"] == "output" and o["step"] == r["step"] for o in rows) >= 2)
    i, j = [k for k, r in enumerate(rows) if r["step"] == step and r["kind"] == "output"][:2]
    rows[i], rows[j] = rows[j], rows[i]
    renumber(rows, step)


def _output_twice(rows: Rows) -> None:
    row = first(rows, "output", lambda r: r["step"] > 10)
    at = rows.index(row)
    rows.insert(at + 1, dict(row))
    renumber(rows, row["step"])


def _clock_shifted(rows: Rows) -> None:
    first(rows, "schedule_begin", lambda r: r["step"] == 40)["clock_s"] += 0.25


def _max_tokens_lowered(rows: Rows) -> None:
    # r000008 is length-capped at 12 outputs, its last output row carrying two tokens.
    first(rows, "arrival", lambda r: r["request_id"] == "r000008")["max_tokens"] -= 1


@pytest.mark.parametrize("source,edit,code,fragment", [
    (PREEMPTION, _stopped_with_length, 2,
     "finish status FINISHED_STOPPED with finish_reason 'length' (that status reports 'stop')"),
    (EOS, _count_off_by_one, 1, "1 violation of 1 invariant: OUTPUT-COUNT ×1"),
    (PREEMPTION, _state_row_dropped, 1, "1 violation of 1 invariant: PREEMPT-EFFECTS ×1"),
    (PREEMPTION, _outputs_swapped, 1, "1 violation of 1 invariant: OUTPUT-ORDER ×1"),
    (PREEMPTION, _output_twice, 1, "1 violation of 1 invariant: OUTPUT-ORDER ×1"),
    (PREEMPTION, _clock_shifted, 2, "step 40 event 0: clock_s 0.5015000000000001 does not follow the config's timing model: "
                                   "expected 0.2515"),
    (SPEC, _max_tokens_lowered, 1, "STOP-RULES ×1"),
], ids=["status-reason", "output-count", "state-row", "output-order", "output-twice", "clock", "max-tokens"])
def test_check_alone_refuses_rows_that_contradict_each_other(tmp_path: Path, source: Path, edit, code: int,
                                                             fragment: str) -> None:
    code_, out = check(doctored(tmp_path, source, edit))
    assert code_ == code, out
    line = out.strip().splitlines()[-1]
    assert fragment in line, out
    if code == 2:
        assert len(out.strip().splitlines()) == 1, out
