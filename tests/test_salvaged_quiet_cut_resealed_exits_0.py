"""Regression (issue 26 residual, adversarial trial): a salvaged trace cut at
a quiet point (every request that had arrived had finished), its ``salvaged``
marker removed and the file resealed, checked as a complete run (exit 0).

A trace's metadata now carries the workload's request count
(``num_requests``, written by ``harness record``); a trace whose arrivals
fall short of it is an incomplete run (exit 3). A trace recorded before the
field (none in its metadata) is read as before, without this check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.trace import METADATA_KEY, SUMMARY_KEY, TraceError, open_trace
from harness.trace.writer import reseal

ROOT = Path(__file__).resolve().parents[1]
# Two waves of four requests; the second arrives at step 20, when the first is done.
SCENARIO = ROOT / "traces" / "scenarios" / "admit-all-that-fit.toml"


def _record(tmp_path: Path) -> Path:
    out = tmp_path / "whole.parquet"
    r = CliRunner().invoke(main, ["record", str(SCENARIO), "-o", str(out)])
    assert r.exit_code == 0, r.output
    return out


def _doctored(source: Path, out: Path, *, cut_before_step: int | None = None,
              meta_edit=None) -> Path:
    """``source`` cut before ``cut_before_step`` (the footer's counts kept
    true, no ``salvaged`` marker), its metadata edited, resealed."""
    table = pq.read_table(source)
    rows = table.to_pylist()
    if cut_before_step is not None:
        rows = [r for r in rows if r["step"] < cut_before_step]
    kv = dict(pq.ParquetFile(source).metadata.metadata)
    kv.pop(b"ARROW:schema", None)
    summary = json.loads(kv[SUMMARY_KEY])
    summary.pop("trace_sha256", None)
    summary.update(steps=len({r["step"] for r in rows}), events=len(rows))
    kv[SUMMARY_KEY] = json.dumps(summary, sort_keys=True).encode()
    if meta_edit is not None:
        meta = json.loads(kv[METADATA_KEY])
        meta_edit(meta)
        kv[METADATA_KEY] = json.dumps(meta, sort_keys=True).encode()
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema).replace_schema_metadata(kv), out)
    return reseal(out, out)


def _second_wave_step(path: Path) -> int:
    rows = pq.read_table(path, columns=["step", "kind", "request_id"]).to_pylist()
    arrivals = [r for r in rows if r["kind"] == "arrival"]
    assert len(arrivals) == 8
    return arrivals[4]["step"]


def test_regression_salvaged_trace_cut_at_a_quiet_point_resealed_is_incomplete(tmp_path: Path) -> None:
    whole = _record(tmp_path)
    trace = open_trace(whole)
    assert trace.meta["num_requests"] == 8 and trace.num_arrivals == 8 and trace.incomplete is None
    cut = _doctored(whole, tmp_path / "cut.parquet", cut_before_step=_second_wave_step(whole))
    assert open_trace(cut).summary.get("salvaged") is None  # the marker is gone, the seal fresh
    r = CliRunner().invoke(main, ["check", str(cut)])
    assert r.exit_code == 3, r.output
    reason = "the trace holds 4 requests of its workload's 8 (metadata num_requests): the run was cut short"
    assert r.output.strip().splitlines()[-1].endswith(reason), r.output
    assert json.loads(CliRunner().invoke(main, ["check", str(cut), "--json"]).output)["incomplete"] == reason
    # Tolerated with --allow-incomplete, still named.
    allowed = CliRunner().invoke(main, ["check", str(cut), "--allow-incomplete"])
    assert allowed.exit_code == 0 and reason in allowed.output
    # The whole recording is complete.
    assert CliRunner().invoke(main, ["check", str(whole)]).exit_code == 0


def test_regression_a_trace_without_num_requests_reads_as_before(tmp_path: Path) -> None:
    """Older traces carry no request count (nor one in the workload's params):
    read, and the cut goes unnoticed (the limit of this check: a forger who
    drops every count)."""
    whole = _record(tmp_path)

    def drop_every_count(meta: dict) -> None:
        meta.pop("num_requests")
        meta["workload"]["params"].pop("request_order")

    older = _doctored(whole, tmp_path / "older.parquet", cut_before_step=_second_wave_step(whole),
                      meta_edit=drop_every_count)
    assert open_trace(older).incomplete is None
    assert CliRunner().invoke(main, ["check", str(older)]).exit_code == 0


def _last_line(path: Path, *flags: str) -> tuple[int, str]:
    r = CliRunner().invoke(main, ["check", str(path), *flags])
    return r.exit_code, r.output.strip().splitlines()[-1]


def test_regression_resealed_num_requests_edited_to_the_cut_disagrees_with_the_workload(tmp_path: Path) -> None:
    """Trial finding: the cut, its footer ``num_requests`` edited to the 4
    requests left (or deleted), resealed: exit 0. The workload's params hold
    the count too (a scenario file's ``request_order``; a synthetic
    workload's ``num_requests``): exit 3, one line naming both."""
    whole = _record(tmp_path)
    cut_at = _second_wave_step(whole)
    edited = _doctored(whole, tmp_path / "edited.parquet", cut_before_step=cut_at,
                       meta_edit=lambda m: m.update(num_requests=4))
    assert _last_line(edited) == (3, "incomplete run (exit 3): no violation in the 8 steps it has (profile "
                                     "0.33.0): metadata num_requests 4 disagrees with its workload's "
                                     "params.request_order 8: tampered, or the run was cut short")
    dropped = _doctored(whole, tmp_path / "dropped.parquet", cut_before_step=cut_at,
                        meta_edit=lambda m: m.pop("num_requests"))
    assert _last_line(dropped) == (3, "incomplete run (exit 3): no violation in the 8 steps it has (profile "
                                      "0.33.0): the trace holds 4 requests of its workload's 8 "
                                      "(params.request_order): the run was cut short")
    # A synthetic workload's params.num_requests: the same, and the whole recording still passes.
    synthetic = tmp_path / "synthetic.parquet"
    assert CliRunner().invoke(main, ["record", "synthetic:6", "-o", str(synthetic)]).exit_code == 0
    assert _last_line(synthetic)[0] == 0
    forged = _doctored(synthetic, tmp_path / "forged.parquet", meta_edit=lambda m: m.update(num_requests=5))
    assert _last_line(forged) == (3, "incomplete run (exit 3): no violation in the "
                                     f"{open_trace(synthetic).summary['steps']} steps it has (profile 0.33.0): "
                                     "metadata num_requests 5 disagrees with its workload's "
                                     "params.num_requests 6: tampered, or the run was cut short")


@pytest.mark.parametrize("value", ["8", -1, 2.5, True])
def test_regression_a_malformed_num_requests_is_refused(tmp_path: Path, value: object) -> None:
    whole = _record(tmp_path)
    bad = _doctored(whole, tmp_path / "bad.parquet", meta_edit=lambda m: m.update(num_requests=value))
    with pytest.raises(TraceError) as info:
        open_trace(bad)
    assert str(info.value) == f"{bad}: metadata 'num_requests' must be an int >= 0, got {value!r}"
