"""The views (harness/view): the one derivation of per-step series, spans and
tables, the HTML report, the Perfetto export and the SQL tables, and their
commands (`harness report`, `harness export`, `--report` on check / replay /
diff). Exact values from the goldens and the mutant trace in traces/."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.trace import open_trace
from harness.view.html import figure_data
from harness.view.perfetto import trace_events
from harness.view.series import Scheduled, Span, derive
from harness.view.tables import tables

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "golden"
MUTANT_TRACE = ROOT / "traces" / "mutant-ignore-max-num-seqs.parquet"


@pytest.fixture(scope="module")
def heavy():
    return derive(open_trace(GOLDEN / "preemption-heavy.parquet"))


@pytest.fixture(scope="module")
def mutant():
    return derive(open_trace(MUTANT_TRACE))


def test_series_step_figures_exact(heavy) -> None:
    p = heavy.steps[3]
    assert (p.step, p.clock_s, p.waiting, p.running) == (3, 0.0254, 3, 2)
    assert (p.free_blocks, p.held_blocks, p.cached_blocks, p.token_budget) == (11, 18, 9, 64)
    assert (p.scheduled_tokens, p.prefill_tokens, p.decode_tokens, p.draft_tokens) == (2, 0, 2, 0)
    assert p.victims == ["r000002"] and p.preemptions == 1
    assert [q.step for q in heavy.steps if q.victims][:2] == [3, 15]


@pytest.mark.parametrize("name", sorted(p.stem for p in GOLDEN.glob("*.parquet")))
def test_series_add_up_to_the_check_summary(name: str) -> None:
    """Every golden: the per-step series sum to the check's own counts, the
    token split sums to the step's scheduled tokens and free + held is the
    pool (the null block excluded) on every step."""
    trace = open_trace(GOLDEN / f"{name}.parquet")
    s = derive(trace)
    r = s.result
    cfg = trace.meta["config"]
    pool = (cfg["num_gpu_blocks"] - 1) * cfg.get("data_parallel_size", 1)
    assert len(s.steps) == r.steps
    assert sum(p.preemptions for p in s.steps) == r.preemptions
    assert sum(p.prefix_hit_tokens for p in s.steps) == r.prefix_hit_tokens
    assert sum(p.finished for p in s.steps) == r.finished
    assert sum(p.kv_loads for p in s.steps) == r.remote_kv_loads
    assert sum(p.failed_kv_loads for p in s.steps) == r.failed_kv_loads
    assert sum(p.verified_drafts for p in s.steps) == r.draft_tokens
    assert sum(p.verified_drafts - p.accepted_drafts for p in s.steps) == r.rejected_draft_tokens
    assert [p.step for p in s.steps if p.prefill_tokens + p.decode_tokens + p.draft_tokens
            != p.scheduled_tokens] == []
    assert [p.step for p in s.steps if p.free_blocks + p.held_blocks != pool] == []
    assert sum(c.num_scheduled_tokens for c in s.scheduled) == sum(p.scheduled_tokens for p in s.steps)
    assert len(s.requests) == r.requests


def test_spans_of_a_preempted_request(heavy) -> None:
    spans = [s for s in heavy.spans if s.request_id == "r000002"]
    assert spans == [
        Span("r000002", "running", 2, 3, 0.014, 0.0254, 38, 1),
        Span("r000002", "preempted", 3, 11, 0.0254, 0.06699999999999998, 0, 0),
        Span("r000002", "running", 11, 20, 0.06699999999999998, 0.12159999999999996, 25, 9),
    ]
    info = next(r for r in heavy.requests if r.request_id == "r000002")
    assert (info.arrival_step, info.first_scheduled_step, info.first_token_step, info.end_step) == (2, 2, 11, 19)
    assert (info.end_kind, info.finish_reason, info.num_output_tokens) == ("finish", "length", 9)
    assert (info.preemptions, info.prefix_hit_tokens, info.scheduled_tokens) == (1, 28, 63)
    assert [c for c in heavy.scheduled if c.request_id == "r000002"][:2] == [
        Scheduled(2, 0, "r000002", "new", 0, 38, 38, 0, 0, 0, 10),
        Scheduled(11, 0, "r000002", "resumed", 28, 17, 17, 0, 0, 28, 12)]


def test_loading_spans_with_the_kv_connector() -> None:
    s = derive(open_trace(GOLDEN / "kv-connector.parquet"))
    assert [(x.state, x.start_step, x.end_step) for x in s.spans if x.request_id == "r000000"] == [
        ("loading", 0, 3), ("running", 3, 14)]
    assert [(p.step, p.kv_loads, p.failed_kv_loads) for p in s.steps
            if p.kv_loads or p.failed_kv_loads][:4] == [(0, 1, 0), (1, 4, 0), (3, 1, 1), (13, 1, 0)]


def test_withdrawn_chunks_leave_the_split() -> None:
    """PRIORITY give-back: a withdrawn schedule row was never run; the
    scheduled table and the token split leave it out (regression: the
    drafts of withdrawn chunks were counted, 394 against the check's 390)."""
    s = derive(open_trace(GOLDEN / "spec-decode-priority.parquet"))
    assert sum(p.draft_tokens for p in s.steps) == 390 == s.result.draft_tokens


def test_report_html_is_offline_deterministic_and_plots_every_panel(mutant, tmp_path) -> None:
    out = tmp_path / "r.html"
    r = CliRunner().invoke(main, ["report", str(MUTANT_TRACE), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[-1] == (f"report written to {out}: 71 steps, 12 requests; "
                                         "2 violations of 1 invariant: MAX-NUM-SEQS ×2 (profile 0.33.0)")
    page = out.read_bytes()
    assert b"<script src=" not in page and b"cdn.plot.ly/plotly" not in page.split(b"</script>", 1)[1]
    assert list(tmp_path.iterdir()) == [out]  # no temp file left
    figs = figure_data(page)
    assert sorted(figs) == ["gantt", "timeline"]
    names = [t["name"] for t in figs["timeline"]["data"]]
    assert names == ["free blocks", "held blocks", "cached free blocks", "waiting", "running", "prefill tokens",
                     "decode tokens", "draft tokens", "preemptions", "prefix hit rate (cumulative)",
                     "prefix hit rate (admissions of the step)", "draft acceptance (step)",
                     "remote KV loads started", "failed KV loads", "violations / divergence"]
    assert all(len(t["x"]) == 71 for t in figs["timeline"]["data"][:-1])
    marks = figs["timeline"]["data"][-1]
    assert marks["x"] == [10, 10] and "MAX-NUM-SEQS" in marks["text"][0]
    assert [sh["x0"] for sh in figs["timeline"]["layout"]["shapes"]] == [10]
    assert [t["name"] for t in figs["gantt"]["data"]] == ["waiting", "running", "preempted", "loading"]
    # Regression: autoscaled panels showed axes below 0 for counts that never are.
    layout = figs["timeline"]["layout"]
    assert [layout[f"yaxis{'' if i == 1 else i}"]["rangemode"] for i in range(1, 7)] == ["nonnegative"] * 6
    assert len(figs["gantt"]["data"][1]["y"]) == len([x for x in mutant.spans if x.state == "running"])
    again = tmp_path / "again.html"
    CliRunner().invoke(main, ["report", str(MUTANT_TRACE), "-o", str(again)])
    assert again.read_bytes() == page


def test_report_against_highlights_the_first_divergence(tmp_path) -> None:
    mut = tmp_path / "mut.parquet"
    r = CliRunner().invoke(main, ["record", str(ROOT / "harness/scenarios/fcfs-tight.toml"),
                                  "--engine", "mutant:preempt-head", "-o", str(mut)])
    assert r.exit_code == 0, r.output
    diff = CliRunner().invoke(main, ["diff", str(GOLDEN / "fcfs-tight.parquet"), str(mut), "--json"])
    step = json.loads(diff.output)["first_divergence"]["step"]
    out = tmp_path / "r.html"
    r = CliRunner().invoke(main, ["report", str(GOLDEN / "fcfs-tight.parquet"), "--against", str(mut),
                                  "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[-1] == (
        f"report written to {out}: 392 steps, 60 requests; A: conformant (profile 0.33.0); B: 2 violations "
        f"of 2 invariants: FCFS-VICTIM-TAIL ×1, PRIORITY-GIVE-BACK ×1 (profile 0.33.0); first divergence "
        f"at step {step}")
    page = out.read_bytes()
    assert f"First divergence at step {step}</b>".encode() in page
    timeline = figure_data(page)["timeline"]
    names = [t["name"] for t in timeline["data"]]
    assert "free blocks (A)" in names and "free blocks (B)" in names
    marks = timeline["data"][-1]
    assert marks["x"] == [step, step, step]  # B's two witnesses, then the divergence
    assert [t.split("<br>")[0] for t in marks["text"]] == [
        "<b>PRIORITY-GIVE-BACK</b> (B) at step 148, request r000024",
        "<b>FCFS-VICTIM-TAIL</b> (B) at step 148, request r000024", "<b>first divergence</b> at step 148"]
    assert b"<h2>Violations (A)</h2><p>None: every invariant holds.</p>" in page
    assert page.count(b'<div class="violation"><b>') == 2


def test_report_refuses_unusable_input_and_keeps_the_old_file(tmp_path) -> None:
    out = tmp_path / "r.html"
    out.write_text("old")
    r = CliRunner().invoke(main, ["report", str(tmp_path / "none.parquet"), "-o", str(out)])
    assert r.exit_code == 2 and "none.parquet: no such file" in r.output
    r = CliRunner().invoke(main, ["report", str(MUTANT_TRACE), "--semantics", "9.9.9", "-o", str(out)])
    assert r.exit_code == 2
    r = CliRunner().invoke(main, ["report", str(GOLDEN / "spec-decode.parquet"), "--against",
                                  str(GOLDEN / "fcfs-tight.parquet"), "-o", str(out)])
    assert r.exit_code == 2 and "not the same workload" in r.output
    assert out.read_text() == "old"
    copy = tmp_path / "t.parquet"
    copy.write_bytes(MUTANT_TRACE.read_bytes())
    for args in (["report", str(copy), "-o", str(copy)], ["export", "--perfetto", str(copy), "-o", str(copy)]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 2 and "it would be overwritten" in r.output
    assert copy.read_bytes() == MUTANT_TRACE.read_bytes()


def test_perfetto_export(mutant, tmp_path) -> None:
    doc = trace_events(mutant)
    ev = doc["traceEvents"]
    names = [e["args"]["name"] for e in ev if e["name"] == "thread_name" and e["pid"] == 1]
    assert names == [r.request_id for r in mutant.requests]
    states = [e for e in ev if e.get("cat") == "state"]
    assert len(states) == len(mutant.spans)
    first = next(e for e in states if e["name"] == "running")
    assert first["args"] == {"steps": "0..10", "scheduled_tokens": 49, "chunks": 11}
    assert [e["name"] for e in ev if e["ph"] == "C"].count("KV blocks") == 71
    kv = next(e for e in ev if e["ph"] == "C" and e["name"] == "KV blocks" and e["ts"] == 29300.0)
    assert kv["args"] == {"free": 48, "held": 11, "cached": 0}
    assert [(e["name"], e["args"]["step"]) for e in ev if e.get("cat") == "violation"] == [
        ("violation MAX-NUM-SEQS", 10), ("violation MAX-NUM-SEQS", 10)]
    chunks = [e for e in ev if e.get("cat") == "schedule"]
    assert len(chunks) == len(mutant.scheduled)
    out = tmp_path / "t.json"
    r = CliRunner().invoke(main, ["export", "--perfetto", str(MUTANT_TRACE), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    again = tmp_path / "again.json"
    CliRunner().invoke(main, ["export", "--perfetto", str(MUTANT_TRACE), "-o", str(again)])
    assert again.read_bytes() == out.read_bytes()  # deterministic
    assert r.output.splitlines()[-1].startswith("exported 71 steps, 12 requests; 2 violations")


def test_tables_export(heavy, tmp_path) -> None:
    t = tables(heavy)
    assert t["steps"].num_rows == 230 and t["scheduled"].num_rows == 520 and t["requests"].num_rows == 60
    row = t["steps"].slice(3, 1).to_pylist()[0]
    assert (row["step"], row["preemptions"], row["victims"], row["budget_used"]) == (3, 1, ["r000002"], 0.03125)
    r = CliRunner().invoke(main, ["export", "--tables", str(tmp_path / "tb"), str(GOLDEN / "preemption-heavy.parquet")])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["requests.parquet", "scheduled.parquet",
                                                                   "steps.parquet"]
    req = pq.read_table(tmp_path / "tb" / "requests.parquet").to_pylist()
    assert next(x for x in req if x["request_id"] == "r000002")["preemptions"] == 1
    assert sum(x["preemptions"] for x in req) == heavy.result.preemptions == 18


def test_export_needs_something_to_do() -> None:
    r = CliRunner().invoke(main, ["export", str(MUTANT_TRACE)])
    assert r.exit_code == 2 and "nothing to export" in r.output
    r = CliRunner().invoke(main, ["export", "--perfetto", str(MUTANT_TRACE)])
    assert r.exit_code == 2 and "--perfetto needs -o FILE" in r.output


def test_report_option_on_check_replay_and_diff(tmp_path) -> None:
    """`--report FILE` on check, replay and diff writes the same report as
    `harness report`, the exit code and the verdict line stay the command's own."""
    out = tmp_path / "check.html"
    r = CliRunner().invoke(main, ["check", str(MUTANT_TRACE), "--report", str(out)])
    assert r.exit_code == 1
    assert r.output.splitlines()[-1] == "2 violations of 1 invariant: MAX-NUM-SEQS ×2 (profile 0.33.0)"
    direct = tmp_path / "direct.html"
    CliRunner().invoke(main, ["report", str(MUTANT_TRACE), "-o", str(direct)])
    assert out.read_bytes() == direct.read_bytes()
    golden = str(GOLDEN / "fcfs-tight.parquet")
    out = tmp_path / "replay.html"
    r = CliRunner().invoke(main, ["replay", golden, "--candidate", "mutant:preempt-head", "--report", str(out)])
    assert r.exit_code == 1
    assert r.output.splitlines()[-1] == "not conformant (profile 0.33.0); first divergence at step 148"
    assert (b"First divergence at step 148</b>: replay: event #2 (preempt), request r000025, field event"
            in out.read_bytes())
    mut = tmp_path / "mut.parquet"
    CliRunner().invoke(main, ["record", str(ROOT / "harness/scenarios/fcfs-tight.toml"),
                              "--engine", "mutant:preempt-head", "-o", str(mut)])
    out = tmp_path / "diff.html"
    r = CliRunner().invoke(main, ["diff", golden, str(mut), "--report", str(out)])
    assert r.exit_code == 1
    assert r.output.splitlines()[-1] == "different: first divergence at step 148"
    assert figure_data(out.read_bytes())["timeline"]["data"][-1]["x"] == [148, 148, 148]  # B's two witnesses, the divergence
    out = tmp_path / "same.html"
    r = CliRunner().invoke(main, ["diff", golden, golden, "--report", str(out)])
    assert r.exit_code == 0 and b"The two runs made identical decisions." in out.read_bytes()


def test_replay_report_shows_the_fork_gates_own_run(tmp_path, monkeypatch) -> None:
    """`replay --semantics fork --report FILE`: the report showed only the first divergence (in red, as
    a failure) and not the candidate's own run, which is the fork gate's verdict (`--json`'s
    `own_run`). Now the divergence is marked information and an "Own run" section gives the
    replay's own-run line and its witnesses."""
    from forks import put_on_path

    golden = str(GOLDEN / "fcfs-roomy.parquet")
    out = tmp_path / "fork.html"
    r = CliRunner().invoke(main, ["replay", golden, "--candidate", "mutant:ignore-max-num-seqs",
                                  "--semantics", "fork", "--report", str(out)])
    assert r.exit_code == 1
    page = out.read_bytes().decode()
    assert ('<p class="information" id="first-divergence"><b>Decisions differ from step 10</b> (information: '
            "not held to a version's design): replay: event #7 (schedule_end)") in page
    assert ('<h2>Own run</h2>\n<p id="own-run" class="divergence"><b>own run: mutant:ignore-max-num-seqs re-run on '
            "the trace&#x27;s workload, config and seed from step 0: 371 steps, 6 violations (profile fork)</b></p>"
            ) in page
    assert page.count('<div class="violation"><b>MAX-NUM-SEQS</b>') == 6
    assert '<div class="violation"><b>MAX-NUM-SEQS</b> at step 10, request r000004: ' in page
    put_on_path(monkeypatch)
    out = tmp_path / "spf.html"
    r = CliRunner().invoke(main, ["replay", golden, "--candidate", "forks.shortest_prompt_first:make",
                                  "--semantics", "fork", "--report", str(out)])
    assert r.exit_code == 0
    page = out.read_bytes().decode()
    assert ('<p id="own-run" class="same"><b>own run: forks.shortest_prompt_first:make re-run on the trace&#x27;s '
            "workload, config and seed from step 0: 372 steps, no violation (profile fork)</b></p>") in page
    assert "First divergence" not in page and "Decisions differ from step 10</b>" in page
    out = tmp_path / "auto.html"  # under auto a divergence is a failure, and there is no own run
    CliRunner().invoke(main, ["replay", golden, "--candidate", "mutant:ignore-max-num-seqs", "--report", str(out)])
    assert b"First divergence at step 10</b>" in out.read_bytes() and b"Own run" not in out.read_bytes()
