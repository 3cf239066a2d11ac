"""``harness check PATH...`` over a corpus (issue 25, harness/corpus.py):
files, folders and globs expand to traces; one row per trace carrying the
exit code and verdict line ``harness check TRACE`` gives; the corpus exit is
the most severe (0 < 3 < 1 < 2); a bad file is one row and hides nothing;
``--workers 2`` gives the rows of ``--workers 1`` in input order; one trace
keeps the single report.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.check_cli import check_one_json
from harness.cli import main
from harness.corpus import (CorpusError, TraceRow, check_local, corpus_exit, corpus_verdict, expand_paths,
                            totals)

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "golden"
MUTANT = ROOT / "traces" / "mutant-ignore-max-num-seqs.parquet"
OPTIONS = {"semantics": "auto"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two goldens, the mutant's trace (2 MAX-NUM-SEQS violations), a file of
    junk and a truncated trace, in a folder with a subfolder."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "sub").mkdir()
    for name in ("fcfs-tight", "spec-decode"):
        (root / f"{name}.parquet").write_bytes((GOLDEN / f"{name}.parquet").read_bytes())
    (root / "sub" / "mutant.parquet").write_bytes(MUTANT.read_bytes())
    (root / "sub" / "junk.parquet").write_bytes(b"junk\n")
    (root / "cut.parquet").write_bytes((GOLDEN / "pipeline-3.parquet").read_bytes()[:3000])
    (root / "notes.txt").write_text("not a trace")
    return root


def _invoke(*args: object):
    return CliRunner().invoke(main, ["check", *map(str, args)])


def test_folders_recursively_globs_sorted_and_each_trace_once(corpus: Path) -> None:
    paths = expand_paths([str(corpus), str(corpus / "*.parquet"), str(corpus / "fcfs-tight.parquet")])
    assert [os.path.relpath(p, corpus) for p in paths] == [
        "cut.parquet", "fcfs-tight.parquet", "spec-decode.parquet", "sub/junk.parquet", "sub/mutant.parquet"]
    assert expand_paths([str(corpus / "missing.parquet")]) == [str(corpus / "missing.parquet")]
    with pytest.raises(CorpusError, match="no file matches"):
        expand_paths([str(corpus / "*.nothing")])
    (corpus.parent / "empty").mkdir(exist_ok=True)
    with pytest.raises(CorpusError, match="a folder without any"):
        expand_paths([str(corpus.parent / "empty")])


def test_every_trace_one_row_with_checks_exit_and_verdict(corpus: Path) -> None:
    result = _invoke(corpus, corpus / "missing.parquet", "--json")
    assert result.exit_code == 2, result.output
    report = json.loads(result.output)
    rows = {os.path.relpath(t["path"], corpus): t for t in report["traces"]}
    assert list(rows) == ["cut.parquet", "fcfs-tight.parquet", "spec-decode.parquet", "sub/junk.parquet",
                          "sub/mutant.parquet", "missing.parquet"]
    assert {k: r["exit"] for k, r in rows.items()} == {
        "cut.parquet": 2, "fcfs-tight.parquet": 0, "spec-decode.parquet": 0, "sub/junk.parquet": 2,
        "sub/mutant.parquet": 1, "missing.parquet": 2}
    assert rows["sub/mutant.parquet"]["violations"] == {"MAX-NUM-SEQS": 2}
    assert rows["sub/mutant.parquet"]["verdict"] == "2 violations of 1 invariant: MAX-NUM-SEQS ×2 (profile 0.33.0)"
    assert rows["fcfs-tight.parquet"]["verdict"] == "conformant (profile 0.33.0)"
    assert rows["fcfs-tight.parquet"]["steps"] == 392 and rows["spec-decode.parquet"]["steps"] == 127
    assert rows["missing.parquet"]["error"] == f"{corpus / 'missing.parquet'}: no such file"
    assert rows["missing.parquet"]["verdict"] == "no such file"
    assert "not a Parquet file or truncated" in rows["sub/junk.parquet"]["error"]
    # Each row is exactly what `harness check TRACE` says of that trace alone.
    for path in (corpus / "sub" / "mutant.parquet", corpus / "sub" / "junk.parquet"):
        alone = _invoke(path, "--json")
        row = rows[os.path.relpath(path, corpus)]
        assert alone.exit_code == row["exit"]
        if alone.exit_code != 2:
            assert json.loads(alone.output)["verdict"] == row["verdict"]
    assert report["totals"] == {"traces": 6, "by_exit": {"0": 2, "1": 1, "2": 3}, "conformant": 2,
                                "violating": 1, "unusable": 3, "incomplete": 0,
                                "incomplete_allowed": 0, "unsealed": 0,
                                "violations": {"MAX-NUM-SEQS": 2}, "steps": 392 + 127 + rows["sub/mutant.parquet"]["steps"],
                                "cpu_s": report["totals"]["cpu_s"]}
    assert (report["ok"], report["exit"], report["runner"]) == (False, 2, "1 worker")


def test_text_table_and_the_verdict_last(corpus: Path) -> None:
    result = _invoke(corpus / "fcfs-tight.parquet", corpus / "sub" / "mutant.parquet")
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines[-1] == "2 traces: 1 conformant, 1 violating (exit 1)"
    assert lines[-3] == "violations: MAX-NUM-SEQS ×2"
    assert str(corpus / "sub" / "mutant.parquet") in result.output  # paths whole, never cut


def test_one_trace_keeps_the_single_report(corpus: Path) -> None:
    alone = _invoke(GOLDEN / "fcfs-tight.parquet")
    assert alone.exit_code == 0
    assert alone.output.strip().splitlines()[-1] == "conformant (profile 0.33.0)"
    assert "traces:" not in alone.output and "CPU s" not in alone.output
    # A folder or glob naming a single trace is that trace's report too.
    assert _invoke(str(corpus / "fcfs-*.parquet")).output.strip().splitlines()[-1] == "conformant (profile 0.33.0)"
    nothing = _invoke(str(corpus / "*.nothing"))
    assert nothing.exit_code == 2 and "no file matches this pattern" in nothing.output


def test_corpus_exit_most_severe_with_incomplete_and_unknown_codes() -> None:
    def rows(*codes: int) -> list[TraceRow]:
        return [TraceRow(f"t{i}", c, "v") for i, c in enumerate(codes)]

    assert corpus_exit(rows()) == 0
    assert corpus_exit(rows(0, 0)) == 0
    assert corpus_exit(rows(0, 3)) == 3
    assert corpus_exit(rows(3, 1, 0)) == 1
    assert corpus_exit(rows(1, 7)) == 7     # unknown: above a violation...
    assert corpus_exit(rows(7, 2, 3)) == 2  # ...below unusable
    assert corpus_verdict(rows(0, 3, 1, 7, 2)) == \
        "5 traces: 1 conformant, 1 incomplete, 1 violating, 1 exit 7, 1 unusable (exit 2)"
    assert totals(rows(3, 3))["incomplete"] == 2


def test_two_workers_same_rows_in_input_order(corpus: Path) -> None:
    paths = expand_paths([str(corpus)])
    one = check_local(paths, OPTIONS, check_one_json, workers=1)
    two = check_local(paths, OPTIONS, check_one_json, workers=2)
    assert [r.path for r in two] == paths
    assert all(a.same_outcome(b) for a, b in zip(one, two, strict=True))


def kill_own_process_on_spec_decode(path: str, options: dict) -> tuple[int, str, str]:
    """A task whose process dies (SIGKILL) on one trace, every time."""
    if path.endswith("spec-decode.parquet"):
        os.kill(os.getpid(), signal.SIGKILL)
    return check_one_json(path, options)


def test_a_dead_worker_costs_only_its_own_trace(corpus: Path) -> None:
    paths = [str(corpus / "fcfs-tight.parquet"), str(corpus / "spec-decode.parquet"),
             str(corpus / "sub" / "mutant.parquet")]
    rows = check_local(paths, OPTIONS, kill_own_process_on_spec_decode, workers=2)
    assert [(r.exit, r.verdict) for r in rows] == [
        (0, "conformant (profile 0.33.0)"), (2, "the process checking it died"),
        (1, "2 violations of 1 invariant: MAX-NUM-SEQS ×2 (profile 0.33.0)")]


def _cut_with_salvaged_line(tmp_path: Path) -> Path:
    """traces/preemption-heavy.parquet cut at half its steps, a ``salvaged``
    line in its footer, resealed: a run that did not end (issue 26)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from harness.trace import SUMMARY_KEY
    from harness.trace.writer import reseal

    source = ROOT / "traces" / "preemption-heavy.parquet"
    table = pq.read_table(source)
    rows = table.to_pylist()
    steps = sorted({r["step"] for r in rows})
    rows = [r for r in rows if r["step"] <= steps[len(steps) // 2 - 1]]
    kv = dict(pq.ParquetFile(source).metadata.metadata)
    kv.pop(b"ARROW:schema", None)
    summary = json.loads(kv[SUMMARY_KEY])
    summary.pop("trace_sha256", None)
    summary.update(steps=len({r["step"] for r in rows}), events=len(rows),
                   salvaged=f"salvaged from a run cut off after step {rows[-1]['step']}")
    kv[SUMMARY_KEY] = json.dumps(summary, sort_keys=True).encode()
    out = tmp_path / "half.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema).replace_schema_metadata(kv), out)
    return reseal(out, out)


def test_an_incomplete_run_row_is_what_check_says_of_it_alone(tmp_path: Path) -> None:
    """Whatever exit code and verdict check gives an incomplete run (3 once
    issue 26 lands; 0 with a note before), its row carries them, and a
    corpus of it and a conformant golden exits with that code."""
    half = _cut_with_salvaged_line(tmp_path)
    alone = _invoke(half, "--json")
    report = json.loads(_invoke(GOLDEN / "fcfs-tight.parquet", half, "--json").output)
    row = report["traces"][1]
    assert (row["exit"], row["verdict"]) == (alone.exit_code, json.loads(alone.output)["verdict"])
    assert report["exit"] == alone.exit_code
    assert row["steps"] == json.loads(alone.output)["steps"] == 80


def test_a_killed_recordings_segments_are_one_row_saying_salvage(tmp_path: Path) -> None:
    segments = tmp_path / "recordings" / ".run.parquet.1234.tmp"
    segments.mkdir(parents=True)
    for i in range(2):
        (segments / f"seg-{i:06d}.parquet").write_bytes((GOLDEN / "fcfs-tight.parquet").read_bytes())
    (tmp_path / "recordings" / "ok.parquet").write_bytes((GOLDEN / "fcfs-tight.parquet").read_bytes())
    assert expand_paths([str(tmp_path / "recordings")]) == [str(segments), str(tmp_path / "recordings" / "ok.parquet")]
    assert expand_paths([str(segments)]) == [str(segments)]
    report = json.loads(_invoke(tmp_path / "recordings", "--json").output)
    assert [t["exit"] for t in report["traces"]] == [2, 0]
    assert "harness salvage" in report["traces"][0]["error"]


def test_regression_folder_skipped_dangling_links_and_fifos_silently(tmp_path: Path) -> None:
    """A folder's ``*.parquet`` that is no regular file is a row saying why it
    was not read (it was skipped without a word); a link to a trace already
    in the corpus, or a link loop reached by a ``**`` glob, is checked once."""
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.parquet").write_bytes((GOLDEN / "fcfs-tight.parquet").read_bytes())
    (root / "b-again.parquet").symlink_to(root / "a.parquet")
    (root / "dangling.parquet").symlink_to(root / "gone.parquet")
    os.mkfifo(root / "fifo.parquet")
    (root / "loop").symlink_to(root)  # root/loop/loop/... under a ** glob
    result = _invoke(root, str(root / "**" / "*.parquet"), "--json")
    assert result.exit_code == 2, result.output
    rows = [(os.path.relpath(t["path"], root), t["exit"], t["verdict"]) for t in json.loads(result.output)["traces"]]
    assert rows == [
        ("a.parquet", 0, "conformant (profile 0.33.0)"),
        ("dangling.parquet", 2, f"a dangling symbolic link (to {root / 'gone.parquet'}), not a trace"),
        ("fifo.parquet", 2, "not a regular file (a FIFO, device or socket is not a trace)")]


def test_regression_one_path_naming_no_trace_aborted_the_whole_corpus(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    good = GOLDEN / "fcfs-tight.parquet"
    result = _invoke(tmp_path / "*.nothing", good, tmp_path / "empty", "--json")
    assert result.exit_code == 2, result.output
    report = json.loads(result.output)
    assert [(t["path"], t["exit"], t["error"]) for t in report["traces"]] == [
        (str(tmp_path / "*.nothing"), 2, f"{tmp_path / '*.nothing'}: no file matches this pattern"),
        (str(good), 0, None),
        (str(tmp_path / "empty"), 2, f"{tmp_path / 'empty'}: a folder without any *.parquet trace")]
    text = _invoke(tmp_path / "*.nothing", good)
    assert text.output.strip().splitlines()[-1] == "2 traces: 1 conformant, 1 unusable (exit 2)"
    # A lone PATH naming no trace stays one error line.
    alone = _invoke(tmp_path / "empty")
    assert alone.exit_code == 2
    assert alone.output.strip() == f"error: {tmp_path / 'empty'}: a folder without any *.parquet trace"


def test_regression_allow_incomplete_counted_a_crashed_run_conformant(tmp_path: Path) -> None:
    """Rows carry ``sealed`` and ``incomplete``; under --allow-incomplete an
    incomplete run exits 0 but is counted "incomplete (allowed)", never
    conformant."""
    half = _cut_with_salvaged_line(tmp_path)
    good = GOLDEN / "fcfs-tight.parquet"
    unsealed = tmp_path / "unsealed.parquet"
    import pyarrow.parquet as pq

    table = pq.read_table(good)
    kv = dict(pq.ParquetFile(good).metadata.metadata)
    kv.pop(b"ARROW:schema", None)
    summary = json.loads(kv[b"sched_harness_summary"])
    summary.pop("trace_sha256")
    kv[b"sched_harness_summary"] = json.dumps(summary, sort_keys=True).encode()
    meta = json.loads(kv[b"sched_harness"])
    meta["schema_version"] = 6  # before the digest: read, named unsealed
    kv[b"sched_harness"] = json.dumps(meta, sort_keys=True).encode()
    pq.write_table(table.replace_schema_metadata(kv), unsealed)
    report = json.loads(_invoke(good, half, unsealed, "--allow-incomplete", "--json").output)
    rows = [(t["exit"], t["sealed"], t["incomplete"]) for t in report["traces"]]
    assert rows == [(0, True, None),
                    (0, True, f"salvaged from a run cut off after step {79}"),
                    (0, False, None)]
    assert report["exit"] == 0
    t = report["totals"]
    assert (t["conformant"], t["incomplete_allowed"], t["incomplete"], t["unsealed"]) == (2, 1, 0, 1)
    text = _invoke(good, half, unsealed, "--allow-incomplete")
    assert text.exit_code == 0
    assert text.output.strip().splitlines()[-1] == \
        "3 traces: 2 conformant, 1 incomplete (allowed); 1 unsealed (exit 0)"
    strict = _invoke(good, half)
    assert strict.exit_code == 3
    assert strict.output.strip().splitlines()[-1] == "2 traces: 1 conformant, 1 incomplete (exit 3)"


def test_regression_bogus_semantics_was_one_error_row_per_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trial finding: ``harness check A B --semantics bogus`` spawned its
    workers and printed an error row per trace; now one line up front, exit 2,
    no trace checked (a folder, ``--workers`` and a single trace alike)."""
    import harness.corpus

    def no_checking(*_a, **_k):
        raise AssertionError("a trace was checked")
    monkeypatch.setattr(harness.corpus, "check_local", no_checking)
    for paths in ([GOLDEN / "async-tight.parquet", MUTANT], [GOLDEN, "--workers", "2"], [MUTANT]):
        r = CliRunner().invoke(main, ["check", *map(str, paths), "--semantics", "0.33"])
        assert (r.exit_code, r.output) == (2, "error: unknown semantics '0.33'; did you mean '0.33.0'?\n"), paths
    r = CliRunner().invoke(main, ["check", str(GOLDEN), "--semantics", "bogus"])
    assert (r.exit_code, r.output) == (2, "error: unknown semantics 'bogus': expected auto, 0.33.0, 0.29.0, "
                                          "0.25.0, 0.20.2, fork, safety\n")


def test_regression_folder_check_named_a_link_not_its_file_and_skipped_a_parquet_folder(tmp_path: Path) -> None:
    """Trial finding: a folder's row showed a symbolic link's name only, not the
    file checked; a folder named ``dir.parquet`` (no trace in it) was skipped
    without a word. Now the row shows ``LINK -> TARGET`` (``target`` in
    --json), and the folder has its row (exit 2, saying it is a folder); a
    ``*.parquet`` folder holding traces is searched like any other."""
    import shutil

    (tmp_path / "empty.parquet").mkdir()
    (tmp_path / "sub.parquet").mkdir()
    shutil.copy(MUTANT, tmp_path / "sub.parquet" / "m.parquet")
    (tmp_path / "link.parquet").symlink_to(GOLDEN / "async-tight.parquet")
    r = CliRunner().invoke(main, ["check", str(tmp_path), "--json"])
    report = json.loads(r.output)
    assert [(t["path"], t["exit"], t.get("target"), t["error"]) for t in report["traces"]] == [
        (str(tmp_path / "empty.parquet"), 2, None,
         f"{tmp_path / 'empty.parquet'}: a folder, not a trace (named *.parquet, no *.parquet trace in it)"),
        (str(tmp_path / "link.parquet"), 0, str(GOLDEN / "async-tight.parquet"), None),
        (str(tmp_path / "sub.parquet" / "m.parquet"), 1, None, None)]
    assert (r.exit_code, report["exit"]) == (2, 2)
    from harness.corpus import shown_path  # the table's trace column

    assert shown_path(str(tmp_path / "link.parquet")) == f"{tmp_path / 'link.parquet'} -> {GOLDEN / 'async-tight.parquet'}"
    assert shown_path(str(MUTANT)) == str(MUTANT)


def test_regression_report_path_errors_named_dash_o(tmp_path: Path) -> None:
    """Trial finding: ``check --report /dev/null`` said "-o names a device"; it names --report."""
    for report, why in (("/dev/null", "--report names a device, not a regular file; refusing to replace it"),
                        (f"{tmp_path}/r.html/", "--report names a folder (the path ends in '/'), not a file; "
                                                "drop the '/' or name a file in it")):
        r = CliRunner().invoke(main, ["check", str(MUTANT), "--report", report])
        assert (r.exit_code, r.output) == (2, f"error: {report}: {why}\n")
