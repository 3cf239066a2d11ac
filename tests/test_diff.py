"""``harness diff A B``: compare two traces of the same workload.

Traces are recorded in tmp_path through the CLI (the TIGHT/ROOMY scenarios of
test_end_to_end.py); pinned values were observed with the reference engine
and cross-checked by hand from the trace rows with pyarrow.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.diff import TraceStats, percentile
from harness.trace import METADATA_KEY
from harness.trace.writer import reseal

TIGHT = ["--set", "num_gpu_blocks=30", "--set", "max_model_len=96", "--set", "max_num_seqs=4",
         "--set", "block_size=4", "--set", "max_num_batched_tokens=64"]
ROOMY = ["--set", "num_gpu_blocks=200", "--set", "max_model_len=96", "--set", "max_num_seqs=4",
         "--set", "block_size=4", "--set", "max_num_batched_tokens=64"]


def without(scenario: list[str], key: str) -> list[str]:
    """The scenario's ``--set`` pairs minus the one for ``key``."""
    pairs = [scenario[i:i + 2] for i in range(0, len(scenario), 2)]
    return [a for pair in pairs if not pair[1].startswith(key + "=") for a in pair]


def run(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def diff_json(a: Path, b: Path) -> tuple[int, dict]:
    code, out = run("diff", a, b, "--json")
    assert code in (0, 1), out
    return code, json.loads(out)


def record(path: Path, *args: object) -> Path:
    code, out = run("record", *args, "-o", path)
    assert code == 0, out
    return path


@pytest.fixture(scope="module")
def tight(tmp_path_factory) -> tuple[Path, Path]:
    """The TIGHT scenario recorded by the reference and by mutant:preempt-head."""
    d = tmp_path_factory.mktemp("tight")
    ref = record(d / "ref.parquet", "synthetic:60", *TIGHT)
    mut = record(d / "mut.parquet", "synthetic:60", *TIGHT, "--engine", "mutant:preempt-head")
    return ref, mut


# -- (1) identical recordings ------------------------------------------------

def test_same_recording_twice_is_same(tmp_path: Path) -> None:
    a = record(tmp_path / "a.parquet", "synthetic:30", *TIGHT, "--seed", 7)
    b = record(tmp_path / "b.parquet", "synthetic:30", *TIGHT, "--seed", 7)
    code, report = diff_json(a, b)
    assert code == 0
    assert report["same"] is True
    assert report["config_differs"] is False and report["config_diff"] == {}
    assert report["first_divergence"] is None
    assert report["a"] == report["b"]
    assert set(report["delta"]) == set(TraceStats.FIELDS)
    assert all(v == 0 for v in report["delta"].values()), report["delta"]
    code, out = run("diff", a, b)
    assert code == 0 and "same: identical events on all" in out and "DIVERGENCE" not in out


# -- (2) reference vs a broken engine -----------------------------------------

def test_reference_vs_preempt_head_mutant(tight: tuple[Path, Path]) -> None:
    ref, mut = tight
    code, report = diff_json(ref, mut)
    assert code == 1
    assert report["same"] is False and report["config_differs"] is False
    # The same first divergence `harness replay --candidate mutant:preempt-head` finds:
    # both schedule r000024; the reference then preempts the running tail, the
    # mutant withdraws the head's schedule (and preempts it). `request` and
    # `kind` are A's row's.
    assert report["first_divergence"] == {
        "step": 148, "event_index": 2, "request": "r000025", "field": "event",
        "a": "preempt r000025", "b": "withdraw r000024", "kind": "preempt"}
    a, b, delta = report["a"], report["b"], report["delta"]
    assert (a["steps"], b["steps"], delta["steps"]) == (392, 393, 1)
    assert (a["finished"], b["finished"], delta["finished"]) == (60, 60, 0)
    assert (a["preemptions"], b["preemptions"]) == (1, 1)
    assert (a["prefix_hit_tokens"], b["prefix_hit_tokens"], delta["prefix_hit_tokens"]) == (60, 40, -20)
    assert (a["output_tokens"], b["output_tokens"]) == (506, 506)
    assert (a["latency_steps_p50"], a["latency_steps_p99"]) == (8, 22)
    assert (b["latency_steps_p50"], b["latency_steps_p99"]) == (8, 23)
    assert a["latency_steps_mean"] == pytest.approx(523 / 60)
    assert b["latency_steps_mean"] == pytest.approx(527 / 60)
    assert delta["latency_steps_mean"] == pytest.approx(4 / 60)
    assert delta["finished_per_1000_steps"] == pytest.approx(60_000 / 393 - 60_000 / 392)


def test_divergence_text_report(tight: tuple[Path, Path]) -> None:
    ref, mut = tight
    code, out = run("diff", ref, mut)
    assert code == 1
    assert ("DIVERGENCE at step 148, event #2 (preempt), request r000025, field event: "
            "A 'preempt r000025', B 'withdraw r000024'") in out
    # The deepdiff of the decision rows, and the context.
    assert "Value of root[4]['preempted_req_ids'][0] changed from \"r000025\" to \"r000024\"." in out
    assert "step 147 schedule_end (same in A and B): waiting ['r000026'] running ['r000024', 'r000025']" in out
    assert "A step 148:" in out and "B step 148:" in out
    assert ">#2 preempt request_id=r000025" in out and ">#2 withdraw request_id=r000024" in out
    assert "different: first divergence at step 148" in out
    for stat in ("steps", "prefix_hit_tokens", "latency_steps_p99", "output_tokens_per_s"):
        assert stat in out


# -- (3) different configs -----------------------------------------------------

def test_different_config_is_reported_and_still_compared(tmp_path: Path) -> None:
    base = without(TIGHT, "max_num_seqs")
    s3 = record(tmp_path / "s3.parquet", "synthetic:60", *base, "--set", "max_num_seqs=3")
    s4 = record(tmp_path / "s4.parquet", "synthetic:60", *base, "--set", "max_num_seqs=4")
    code, report = diff_json(s3, s4)
    assert report["config_differs"] is True
    assert report["config_diff"] == {"max_num_seqs": {"a": 3, "b": 4}}
    # On this pool the KV blocks bind, never max_num_seqs: identical decisions.
    assert code == 0 and report["same"] is True and report["first_divergence"] is None
    code, out = run("diff", s3, s4)
    assert code == 0 and "CONFIG DIFFERS" in out and "max_num_seqs: A 3, B 4" in out


def test_config_that_changes_decisions(tmp_path: Path) -> None:
    base = without(ROOMY, "max_num_seqs")
    r2 = record(tmp_path / "r2.parquet", "synthetic:10", *base, "--set", "max_num_seqs=2")
    r4 = record(tmp_path / "r4.parquet", "synthetic:10", *base, "--set", "max_num_seqs=4")
    code, report = diff_json(r2, r4)
    assert code == 1
    assert report["config_diff"] == {"max_num_seqs": {"a": 2, "b": 4}}
    # A schedules 2 requests and ends the step; B admits a third: A's row is
    # schedule_end (no request), so the request named is B's.
    assert report["first_divergence"] == {
        "step": 9, "event_index": 4, "request": "r000002", "field": "event",
        "a": "schedule_end", "b": "schedule r000002", "kind": "schedule_end"}
    assert (report["a"]["steps"], report["b"]["steps"], report["delta"]["steps"]) == (62, 57, -5)
    assert (report["a"]["latency_steps_mean"], report["b"]["latency_steps_mean"]) == \
        (pytest.approx(12.7), pytest.approx(8.8))


# -- (4) different workloads: exit 2 -------------------------------------------

def test_different_workloads_exit_2(tmp_path: Path) -> None:
    w10 = record(tmp_path / "w10.parquet", "synthetic:10")
    w12 = record(tmp_path / "w12.parquet", "synthetic:12")
    for args in ((w10, w12), (w10, w12, "--json")):
        code, out = run("diff", *args)
        assert code == 2, out
        assert "not the same workload" in out and "workload sha256:" in out
        assert len(out.strip().splitlines()) == 1


def _copy_with(src: Path, dst: Path, table: pa.Table | None = None, edit_meta=None) -> Path:
    """Copy a trace keeping its footer summary, with an edited table or metadata."""
    kv = dict(pq.ParquetFile(src).metadata.metadata)
    if edit_meta is not None:
        kv[METADATA_KEY] = json.dumps(edit_meta(json.loads(kv[METADATA_KEY])))
    pq.write_table((table if table is not None else pq.read_table(src)).replace_schema_metadata(kv), dst)
    reseal(dst, dst)  # a deliberate edit: a fresh digest, so diff sees the edited rows
    return dst


def test_edited_prompt_or_seed_is_not_the_same_workload(tmp_path: Path) -> None:
    a = record(tmp_path / "a.parquet", "synthetic:10", *ROOMY)
    rows = pq.read_table(a).to_pylist()
    arrival = next(r for r in rows if r["kind"] == "arrival" and r["request_id"] == "r000003")
    arrival["prompt_token_ids"] = [t + 1 for t in arrival["prompt_token_ids"]]
    b = _copy_with(a, tmp_path / "b.parquet", pa.Table.from_pylist(rows, schema=pq.read_schema(a)))
    code, out = run("diff", a, b)
    assert code == 2 and "not the same workload (request r000003: prompt differ)" in out, out
    c = _copy_with(a, tmp_path / "c.parquet", edit_meta=lambda m: {**m, "seed": 5})
    code, out = run("diff", a, c)
    assert code == 2 and "not the same workload (seed: 0 vs 5)" in out, out


# -- (5) unusable files: exit 2 naming the file --------------------------------

def test_missing_or_corrupt_file_exit_2(tight: tuple[Path, Path], tmp_path: Path) -> None:
    ref, _ = tight
    missing = tmp_path / "nope.parquet"
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(ref.read_bytes()[:1000])
    for args, name, fragment in (((missing, ref), missing, "no such file"),
                                 ((ref, missing), missing, "no such file"),
                                 ((ref, corrupt), corrupt, "not a Parquet file or truncated"),
                                 ((corrupt, ref, "--json"), corrupt, "not a Parquet file or truncated")):
        code, out = run("diff", *args)
        assert code == 2, out
        assert str(name) in out and fragment in out, out


# -- (6) the statistics, pinned and cross-checked from the rows ----------------

def test_stats_pinned_and_cross_checked(tmp_path: Path) -> None:
    # 12 requests, prompts up to 64 tokens, max_model_len 48: two are rejected.
    path = record(tmp_path / "small.parquet", "synthetic:12", *ROOMY, "--set", "max_model_len=48")
    code, report = diff_json(path, path)
    assert code == 0
    s = report["a"]
    assert {k: s[k] for k in ("steps", "requests", "finished", "rejected", "aborted", "preemptions",
                              "prefix_hit_tokens", "output_tokens", "latency_steps_p50",
                              "latency_steps_p99")} == {
        "steps": 73, "requests": 12, "finished": 10, "rejected": 2, "aborted": 0, "preemptions": 0,
        "prefix_hit_tokens": 0, "output_tokens": 91, "latency_steps_p50": 8, "latency_steps_p99": 12}
    assert s["latency_steps_mean"] == pytest.approx(8.1)
    assert s["virtual_time_s"] == pytest.approx(0.6737750784699575)
    assert s["finished_per_1000_steps"] == pytest.approx(10_000 / 73)
    assert s["output_tokens_per_step"] == pytest.approx(91 / 73)
    assert s["finished_per_s"] == pytest.approx(10 / 0.6737750784699575)
    assert s["output_tokens_per_s"] == pytest.approx(91 / 0.6737750784699575)

    # By hand, from the rows.
    rows = pq.read_table(path, columns=["step", "kind", "request_id", "token_ids", "clock_s"]).to_pylist()
    arrived = {r["request_id"]: r["step"] for r in rows if r["kind"] == "arrival"}
    latencies = [r["step"] - arrived[r["request_id"]] for r in rows if r["kind"] == "finish"]
    assert len(latencies) == s["finished"]
    assert statistics.mean(latencies) == pytest.approx(s["latency_steps_mean"])
    assert sorted(latencies)[4] == s["latency_steps_p50"]  # nearest rank: ceil(0.5 * 10) = 5th
    assert max(latencies) == s["latency_steps_p99"]        # ceil(0.99 * 10) = 10th
    assert sum(len(r["token_ids"]) for r in rows if r["kind"] == "output") == s["output_tokens"]
    assert sum(r["kind"] == "reject" for r in rows) == s["rejected"]
    assert rows[-1]["step"] + 1 == s["steps"]
    last_clock = [r["clock_s"] for r in rows if r["kind"] == "schedule_begin"][-1]
    assert last_clock == s["virtual_time_s"]


def test_aborted_requests_have_no_latency(tmp_path: Path) -> None:
    from harness.trace.recorder import record as record_api
    from reference.config import EngineConfig
    from workloads import synthetic

    path = tmp_path / "abort.parquet"
    record_api(synthetic(9, seed=1, abort_fraction=1.0), EngineConfig(), path, seed=1)
    code, report = diff_json(path, path)
    s = report["a"]
    assert (code, s["requests"], s["finished"], s["aborted"]) == (0, 9, 6, 3)
    rows = pq.read_table(path, columns=["step", "kind", "request_id"]).to_pylist()
    arrived = {r["request_id"]: r["step"] for r in rows if r["kind"] == "arrival"}
    latencies = [r["step"] - arrived[r["request_id"]] for r in rows if r["kind"] == "finish"]
    assert s["latency_steps_mean"] == pytest.approx(statistics.mean(latencies))


def test_trace_stats_unit() -> None:
    assert percentile([], 50) is None
    assert percentile([3], 99) == 3
    assert [percentile(list(range(1, 101)), p) for p in (1, 50, 99, 100)] == [1, 50, 99, 100]
    empty = TraceStats().to_dict()
    assert empty["steps"] == 0 and empty["latency_steps_mean"] is None
    assert empty["finished_per_1000_steps"] is None and empty["finished_per_s"] is None
    st = TraceStats()
    st.add_step(0, [{"kind": "arrival", "request_id": "r0"}, {"kind": "arrival", "request_id": "r1"},
                    {"kind": "schedule_begin", "clock_s": 0.0},
                    {"kind": "schedule", "num_prefix_hit_tokens": 16},
                    {"kind": "output", "token_ids": [5]}])
    st.add_step(1, [{"kind": "schedule_begin", "clock_s": 0.5}, {"kind": "preempt"},
                    {"kind": "output", "token_ids": [6]},
                    {"kind": "finish", "request_id": "r1", "num_output_tokens": 1}])
    st.add_step(2, [{"kind": "schedule_begin", "clock_s": 2.0}, {"kind": "output", "token_ids": [7]},
                    {"kind": "finish", "request_id": "r0", "num_output_tokens": 2}])
    d = st.to_dict()
    assert (d["steps"], d["requests"], d["finished"], d["preemptions"], d["prefix_hit_tokens"],
            d["output_tokens"]) == (3, 2, 2, 1, 16, 3)
    assert (d["latency_steps_mean"], d["latency_steps_p50"], d["latency_steps_p99"]) == (1.5, 1, 2)
    assert (d["virtual_time_s"], d["finished_per_s"], d["output_tokens_per_s"]) == (2.0, 1.0, 1.5)
    assert d["finished_per_1000_steps"] == pytest.approx(2000 / 3)
    assert d["output_tokens_per_step"] == 1.0
