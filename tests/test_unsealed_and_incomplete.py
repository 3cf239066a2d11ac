"""Issue 26: no silent holes. An unsealed trace (no ``trace_sha256``, whatever
schema version its metadata claims) is named in the verdict and ``--json``,
and ``--require-sealed`` refuses it (exit 2, one line); a run that did not end
(salvaged, crashed, stalled) never exits 0 as if complete: exit 3 ("incomplete
run ... no violation in the steps it has"), 0 only with ``--allow-incomplete``,
a violation still 1. The attacks are the bad-input sweep's: a downgrade to
schema 6 that drops the digest, a run cut at 50 % with a ``salvaged`` line,
``crashed``/``stalled`` written into a complete trace.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.golden import check_goldens
from harness.trace import METADATA_KEY, SUMMARY_KEY, open_trace
from harness.trace.writer import reseal

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "traces" / "preemption-heavy.parquet"  # 160 steps, 40 requests


def run(*args: Any) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def rewrite(tmp_path: Path, name: str, *, version: int | None = None, keep_steps: float = 1.0,
            summary_edit: dict[str, Any] | None = None, seal: bool = False,
            edit_rows=None) -> Path:
    """SOURCE rewritten with plain pyarrow, as the sweep did: metadata version
    set to ``version``, the first ``keep_steps`` of its steps kept, the footer
    summary updated (``summary_edit``; the digest dropped), resealed if ``seal``."""
    table = pq.read_table(SOURCE)
    rows = table.to_pylist()
    steps = sorted({r["step"] for r in rows})
    last = steps[int(len(steps) * keep_steps) - 1]
    rows = [r for r in rows if r["step"] <= last]
    if edit_rows is not None:
        edit_rows(rows)
    kv = dict(pq.ParquetFile(SOURCE).metadata.metadata)
    kv.pop(b"ARROW:schema", None)
    meta = json.loads(kv[METADATA_KEY])
    if version is not None:
        meta["schema_version"] = version
    kv[METADATA_KEY] = json.dumps(meta, sort_keys=True).encode()
    summary = json.loads(kv[SUMMARY_KEY])
    summary.pop("trace_sha256")
    summary.update(steps=len({r["step"] for r in rows}), events=len(rows), **(summary_edit or {}))
    kv[SUMMARY_KEY] = json.dumps(summary, sort_keys=True).encode()
    out = tmp_path / f"{name}.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema).replace_schema_metadata(kv), out)
    return reseal(out, out) if seal else out


def last_line(out: str) -> str:
    return out.strip().splitlines()[-1]


# -- unsealed ------------------------------------------------------------------------------
def test_regression_downgrade_to_schema_6_without_digest_is_named_unsealed(tmp_path: Path) -> None:
    """The sweep's attack: schema_version 6, trace_sha256 dropped, a value
    edited (a request's priority, which no rule reads under FCFS): the verdict
    says the file carries no tamper evidence, --json says sealed false, and
    --require-sealed refuses it in one line."""
    def edit(rows: list[dict]) -> None:
        next(r for r in rows if r["kind"] == "arrival")["priority"] = 7
    path = rewrite(tmp_path, "downgraded", version=6, edit_rows=edit)
    trace = open_trace(path)
    assert (trace.sealed, trace.digest, trace.incomplete) == (False, None, None)
    for command in ("check", "replay"):
        code, out = run(command, path)
        assert code == 0, out
        assert last_line(out).endswith("; unsealed: no tamper evidence"), out
        code, out = run(command, path, "--json")
        report = json.loads(out)
        assert (code, report["sealed"], report["incomplete"], report["ok"]) == (0, False, None, True)
        assert report["verdict"].endswith("unsealed: no tamper evidence")
        code, out = run(command, path, "--require-sealed")
        assert code == 2 and len(out.strip().splitlines()) == 1, out
        assert "unsealed: no tamper evidence (schema 6 trace without a trace_sha256 digest)" in out
    # The HTML report's line and page say it too (adversarial trial: report dropped it).
    code, out = run("report", path, "-o", tmp_path / "r.html")
    assert code == 0 and last_line(out).endswith("conformant (profile 0.33.0); unsealed: no tamper evidence"), out
    assert ('<td class="k">verdict</td><td>conformant (profile 0.33.0); unsealed: no tamper evidence</td>'
            in (tmp_path / "r.html").read_text())
    # --json of an unusable trace still prints one object (adversarial trial: stdout was empty).
    code, out = run("check", path, "--require-sealed", "--json")
    assert code == 2
    assert json.loads(out.splitlines()[0]) == {
        "ok": False, "exit": 2, "error": f"{path}: unsealed: no tamper evidence (schema 6 trace without a "
        "trace_sha256 digest); --require-sealed refuses it"}


def test_a_digest_is_verified_whatever_version_is_claimed(tmp_path: Path) -> None:
    """A downgrade that keeps the digest: the version claim is a byte the
    digest covers, so the old digest no longer matches (exit 2)."""
    data = SOURCE.read_bytes().replace(b'"schema_version": 8', b'"schema_version": 6', 1)
    path = tmp_path / "claimed6.parquet"
    path.write_bytes(data)
    code, out = run("check", path)
    assert code == 2 and "digest mismatch" in out and len(out.strip().splitlines()) == 1, out


def test_sealed_trace_verdict_has_no_unsealed_note() -> None:
    code, out = run("check", SOURCE, "--require-sealed", "--json")
    report = json.loads(out)
    assert (code, report["sealed"], report["ok"], report["verdict"]) == (
        0, True, True, "conformant (profile 0.33.0)")


def test_golden_check_requires_sealed_goldens_by_default(tmp_path: Path) -> None:
    """``golden check`` and the pytest plugin (``check_goldens``) fail an
    unsealed golden; ``--allow-unsealed`` / ``require_sealed=False`` lets the
    other checks decide."""
    folder = tmp_path / "golden"
    shutil.copytree(ROOT / "golden", folder)
    target = folder / "fcfs-tight.parquet"
    data = target.read_bytes()
    table = pq.read_table(target)
    kv = dict(pq.ParquetFile(target).metadata.metadata)
    kv.pop(b"ARROW:schema", None)
    summary = json.loads(kv[SUMMARY_KEY])
    del summary["trace_sha256"]
    kv[SUMMARY_KEY] = json.dumps(summary, sort_keys=True).encode()
    kv[METADATA_KEY] = kv[METADATA_KEY].replace(b'"schema_version": 8', b'"schema_version": 6')
    pq.write_table(table.replace_schema_metadata(kv), target)
    assert target.read_bytes() != data
    by_name = {r.scenario: r for r in check_goldens(folder)}
    assert any("unsealed: no tamper evidence" in reason for reason in by_name["fcfs-tight"].reasons)
    assert by_name["fcfs-roomy"].ok
    relaxed = {r.scenario: r for r in check_goldens(folder, require_sealed=False)}
    assert not any("unsealed" in reason for reason in relaxed["fcfs-tight"].reasons)


# -- incomplete ----------------------------------------------------------------------------
SALVAGED = "salvaged from a run cut off after step 79: 1 complete row group(s) kept, the rows after them lost"


@pytest.mark.parametrize("seal", [True, False])
def test_regression_run_cut_at_half_with_salvaged_line_exits_3(tmp_path: Path, seal: bool) -> None:
    """The sweep's attack: half the steps, a ``salvaged`` line in the footer
    (sealed, and as an unsealed schema-6 file): no longer "conformant", exit
    0; its own verdict line and exit 3, 0 only with --allow-incomplete."""
    path = rewrite(tmp_path, "half", version=None if seal else 6, keep_steps=0.5,
                   summary_edit={"salvaged": SALVAGED}, seal=seal)
    note = "" if seal else "; unsealed: no tamper evidence"
    for command in ("check", "replay"):
        code, out = run(command, path)
        assert code == 3, out
        assert last_line(out).startswith("incomplete run (exit 3): no violation in the 80 steps it has "
                                          f"(profile 0.33.0): {SALVAGED}"), out
        assert last_line(out).endswith(note or "identical decisions" if command == "replay" else note), out
        code, out = run(command, path, "--allow-incomplete")
        assert code == 0, out
        code, out = run(command, path, "--json")
        report = json.loads(out)
        assert (code, report["ok"], report["incomplete"], report["sealed"]) == (3, False, SALVAGED, seal)


def test_the_same_cut_without_the_line_is_liveness(tmp_path: Path) -> None:
    path = rewrite(tmp_path, "cut", keep_steps=0.5, seal=True)
    code, out = run("check", path)
    assert code == 1 and "LIVENESS" in last_line(out), out


@pytest.mark.parametrize("key,value,shown", [
    ("crashed", "candidate raised ValueError('boom') in schedule() at step 3", "the engine crashed: candidate raised"),
    ("stalled", "step 9: no token sampled and nothing finished for 64 steps (livelock)", "the engine stalled: step 9"),
])
def test_regression_crashed_or_stalled_forged_into_a_complete_trace_is_not_exit_0(
        tmp_path: Path, key: str, value: str, shown: str) -> None:
    """A ``crashed``/``stalled`` line written into a complete, resealed trace:
    the footer's word counts against the run (exit 3), never for it."""
    path = rewrite(tmp_path, key, summary_edit={key: value}, seal=True)
    for command in ("check", "replay"):
        code, out = run(command, path)
        assert code == 3 and shown in last_line(out), out


def test_a_violation_wins_over_incomplete(tmp_path: Path) -> None:
    def edit(rows: list[dict]) -> None:
        next(r for r in rows if r["kind"] == "schedule_begin" and r["step"] == 5)["num_free_blocks"] += 1
    path = rewrite(tmp_path, "both", keep_steps=0.5, summary_edit={"salvaged": SALVAGED}, seal=True,
                   edit_rows=edit)
    code, out = run("check", path)
    assert code == 1 and "BLOCK-CONSERVATION" in last_line(out) and "incomplete run" in last_line(out), out


def test_help_documents_exit_3() -> None:
    for command in ("check", "replay"):
        code, out = run(command, "--help")
        assert code == 0 and "3 an incomplete run" in " ".join(out.split()) and "--allow-incomplete" in out


def test_every_golden_and_example_trace_is_sealed_and_complete() -> None:
    """What the plugin and ``golden check`` compare against (and the example
    traces) is written by ``TraceWriter``: sealed, and of a complete run."""
    paths = sorted((ROOT / "golden").glob("*.parquet")) + sorted((ROOT / "traces").glob("*.parquet"))
    assert len(paths) >= 26
    for path in paths:
        trace = open_trace(path)
        assert (path.name, trace.sealed, trace.incomplete) == (path.name, True, None)


def test_regression_allow_incomplete_said_exit_3_and_json_exit_was_missing(tmp_path: Path) -> None:
    """Trial finding: ``check --allow-incomplete`` of one incomplete trace ended
    on "incomplete run (exit 3)" and exited 0, and ``--json`` had no ``exit``
    (``jq .exit``: null). The line says what happened; ``exit`` is the real code."""
    path = rewrite(tmp_path, "half", keep_steps=0.5, summary_edit={"salvaged": SALVAGED}, seal=True)
    for command in ("check", "replay"):
        code, out = run(command, path, "--allow-incomplete")
        assert code == 0, out
        assert last_line(out).startswith("incomplete run (allowed by --allow-incomplete): no violation in the "
                                          f"80 steps it has (profile 0.33.0): {SALVAGED}"), out
        assert "exit 3" not in out
        for flags, want in ((("--allow-incomplete",), 0), ((), 3)):
            code, out = run(command, path, "--json", *flags)
            report = json.loads(out)
            assert (code, report["exit"], report["ok"]) == (want, want, False), out
            assert report["verdict"].startswith("incomplete run (allowed by --allow-incomplete)" if flags
                                                else "incomplete run (exit 3)"), out
    code, out = run("check", SOURCE, "--json")
    assert (code, json.loads(out)["exit"], json.loads(out)["ok"]) == (0, 0, True)


def test_regression_check_of_a_scenario_file_says_how_to_record_it() -> None:
    """New-user trial: ``harness check scenario.toml`` said only "not a Parquet file"."""
    scenario = ROOT / "traces" / "scenarios" / "abort-running-at-step.toml"
    code, out = run("check", scenario)
    assert code == 2
    assert out.strip().endswith(f"; to run it and check the run: harness record {scenario} -o TRACE.parquet, "
                                "then harness check TRACE.parquet")
