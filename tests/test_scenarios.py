"""Scenario files (workloads/scenario.py, docs/scenario-format.md): every file in
traces/scenarios/ records clean on the reference with its exact figures and
replays identically (on vllm@0.33.0 too, marked ``vllm``); arrivals land on
the exact step; every bad input exits 2 with ``file:line: problem``."""

from __future__ import annotations

from reference.words import plural

import os
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.replay import replay
from harness.trace import SCHEMA_VERSION, open_trace
from reference.scheduler import Scheduler
from workloads.scenario import FORMAT_VERSION, ScenarioError, load_scenario

SCENARIOS = Path(__file__).resolve().parents[1] / "traces" / "scenarios"

# name: (steps, {request: arrival step}, {request: prefix-hit tokens}, {request: (end step, kind,
#        finish_reason, num_output_tokens)}, [(step, preempted request)])
EXPECTED = {
    # A aborted while its load is in flight (step 2): its blocks [1-4] stay held until the load
    # ends (kv_finished + kv_free at step 3); B's load got other blocks.
    "abort-while-kv-load-in-flight": (10, {"A": 0, "B": 2}, {}, {"A": (2, "abort", "abort", 0),
                                                                "B": (9, "finish", "length", 4)}, []),
    # A's blocks are fenced by the step in flight (freed at step 4's update): B, arriving at
    # step 4, is admitted only at step 5.
    "freed-block-reused-while-in-flight": (9, {"A": 0, "B": 4}, {}, {"A": (3, "finish", "stop", 3),
                                                                    "B": (7, "finish", "length", 2)}, []),
    "abort-running-at-step": (6, {"A": 0, "B": 4}, {}, {"A": (3, "abort", "abort", 3),
                                                       "B": (5, "finish", "length", 2)}, []),
    "chunked-long-prefill-threshold": (5, {"L": 0, "S": 0}, {}, {"L": (4, "finish", "length", 2),
                                                                "S": (3, "finish", "length", 4)}, []),
    "min-tokens-eos": (1, {"A": 0}, {}, {"A": (0, "finish", "stop", 1)}, []),
    "preempt-and-recompute": (11, {"A": 0, "B": 0}, {"B": 12}, {"A": (9, "finish", "length", 10),
                                                               "B": (10, "finish", "length", 10)}, [(9, "B")]),
    "prefix-reuse-after-finish": (2, {"A": 0, "B": 1}, {"B": 48}, {"A": (0, "finish", "length", 1),
                                                                  "B": (1, "finish", "length", 1)}, []),
    "priority-preemption": (15, {"L": 0, "H": 2}, {"L": 16}, {"H": (5, "finish", "length", 4),
                                                             "L": (14, "finish", "length", 12)}, [(3, "L")]),
    "reset-prefix-cache-preempt-running": (7, {"A": 0, "B": 1, "C": 1}, {"B": 32},
                                           {"C": (3, "abort", "abort", 2), "A": (5, "finish", "length", 6),
                                            "B": (6, "finish", "length", 6)}, [(3, "B"), (3, "A")]),
    "reset-prefix-cache-while-running": (6, {"A": 0, "B": 2, "C": 4}, {"C": 32},
                                         {"A": (1, "finish", "length", 2), "B": (3, "finish", "length", 2),
                                          "C": (5, "finish", "length", 2)}, []),
    "running-cap-across-steps": (5, {"A": 0, "B": 0, "C": 0, "D": 0}, {},
                                 {"A": (1, "finish", "length", 2), "B": (2, "finish", "length", 3),
                                  "C": (3, "finish", "length", 2), "D": (4, "finish", "length", 2)}, []),
    "single-block-prompt-no-hit": (2, {"A": 0, "B": 1}, {}, {"A": (0, "finish", "length", 1),
                                                            "B": (1, "finish", "length", 1)}, []),
    "spec-decode-fixed-acceptance": (6, {"A": 0, "B": 0}, {}, {"A": (3, "finish", "length", 12),
                                                              "B": (5, "finish", "length", 6)}, []),
    "stop-token": (2, {"A": 0}, {}, {"A": (1, "finish", "stop", 2)}, []),
    "too-long-at-queue-head": (2, {"Y": 0, "X": 0}, {}, {"Y": (1, "finish", "length", 2)}, []),
    # The progress layer's scenarios (issue 23): each records clean on the reference.
    "admit-all-that-fit": (16, {"A": 0, "B": 0, "C": 0, "D": 0, "E": 20, "F": 20, "G": 20, "H": 20}, {},
                           {"A": (7, "finish", "length", 8), "B": (7, "finish", "length", 8),
                            "C": (7, "finish", "length", 8), "D": (7, "finish", "length", 8),
                            "E": (27, "finish", "length", 8), "F": (27, "finish", "length", 8),
                            "G": (27, "finish", "length", 8), "H": (27, "finish", "length", 8)}, []),
    "deferred-free-pipeline": (27, {"A": 0, "B": 0, "C": 2, "D": 3, "E": 4}, {"E": 8},
                               {"A": (2, "abort", "abort", 0), "B": (3, "abort", "abort", 0),
                                "C": (15, "finish", "length", 6), "D": (18, "finish", "length", 6),
                                "E": (25, "finish", "length", 6)}, [(10, "E")]),
    "preempt-fenced-victim": (15, {"A": 0, "B": 0}, {"B": 12},
                              {"A": (11, "finish", "length", 10), "B": (13, "finish", "length", 10)}, [(10, "B")]),
    "preempt-only-when-full": (11, {"A": 0, "B": 0}, {},
                               {"A": (10, "finish", "length", 11), "B": (10, "finish", "length", 11)}, []),
    "running-after-preemption": (23, {"A": 0, "B": 0, "C": 0}, {"B": 20},
                                 {"A": (13, "finish", "length", 14), "B": (14, "finish", "length", 14),
                                  "C": (22, "finish", "length", 14)}, [(5, "C"), (13, "B")]),
    "running-skipped-with-room": (12, {"A": 0, "B": 0, "C": 0}, {},
                                  {"A": (11, "finish", "length", 12), "B": (11, "finish", "length", 12),
                                   "C": (11, "finish", "length", 12)}, []),
}


def record(path: Path, out: Path, *extra: str) -> Path:
    r = CliRunner().invoke(main, ["record", str(path), "-o", str(out), *extra])
    assert r.exit_code == 0, r.output
    return out


def figures(trace: Path):
    rows = pq.read_table(trace).to_pylist()
    return (len({r["step"] for r in rows}),
            {r["request_id"]: r["step"] for r in rows if r["kind"] in ("arrival", "reject")},
            {r["request_id"]: r["num_prefix_hit_tokens"] for r in rows
             if r["kind"] == "schedule" and r["num_prefix_hit_tokens"]},
            {r["request_id"]: (r["step"], r["kind"], r["finish_reason"], r["num_output_tokens"])
             for r in rows if r["kind"] in ("finish", "abort")},
            [(r["step"], r["request_id"]) for r in rows if r["kind"] == "preempt"])


def test_every_scenario_file_is_listed_and_cites_a_source() -> None:
    assert sorted(p.stem for p in SCENARIOS.glob("*.toml")) == sorted(EXPECTED)
    for p in SCENARIOS.glob("*.toml"):
        assert "# Source" in p.read_text(), p.name
        assert load_scenario(p).description


def test_regression_readme_said_fifteen_bug_shapes() -> None:
    """Trial finding: README and the tutorial said "Fifteen public bug shapes"
    while the library held 21 scenarios. The counts they give are the files':
    a progress scenario's first line is "# Progress (RULE-ID): ..."."""
    files = sorted(SCENARIOS.glob("*.toml"))
    progress = sum(p.read_text().startswith("# Progress (") for p in files)
    assert (len(files), progress) == (21, 5)
    root = SCENARIOS.parents[1]
    sentence = f"{len(files)} scenarios are in `traces/scenarios/` ({len(files) - progress} public bug shapes, {progress} progress"
    for doc in (root / "README.md", root / "docs" / "tutorials" / "write-a-scenario.md"):
        text = " ".join(doc.read_text().split())
        assert sentence in text and "Fifteen" not in text, doc


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_scenario_records_clean_with_exact_figures_and_replays(name: str, tmp_path: Path) -> None:
    out = record(SCENARIOS / f"{name}.toml", tmp_path / "t.parquet")
    assert figures(out) == EXPECTED[name]
    r = CliRunner().invoke(main, ["check", str(out)])
    assert r.exit_code == 0 and r.output.rstrip().endswith("conformant (profile 0.33.0)"), r.output
    trace = open_trace(out)
    assert trace.meta["schema_version"] == SCHEMA_VERSION
    assert replay(trace, Scheduler) == (None, EXPECTED[name][0])
    # Recording is deterministic: the same file gives the same bytes.
    assert record(SCENARIOS / f"{name}.toml", tmp_path / "u.parquet").read_bytes() == out.read_bytes()


@pytest.mark.vllm
@pytest.mark.skipif(os.environ.get("HARNESS_SKIP_VLLM") == "1", reason="HARNESS_SKIP_VLLM=1")
def test_scenarios_replay_identically_on_vllm(tmp_path: Path) -> None:
    for name in sorted(EXPECTED):
        out = record(SCENARIOS / f"{name}.toml", tmp_path / f"{name}.parquet")
        r = CliRunner().invoke(main, ["replay", str(out), "--candidate", "vllm@0.33.0"])
        assert r.exit_code == 0, (name, r.output)
        assert f"conformant (profile 0.33.0): {plural(EXPECTED[name][0], 'step')} replayed, identical decisions" in r.output, name


IDLE = """format_version = 1
[config]
num_gpu_blocks = 16
block_size = 16
max_model_len = 128
[[requests]]
request_id = "A"
prompt_len = 8
max_tokens = 2
arrival_step = 0
[[requests]]
request_id = "B"
prompt_len = 8
max_tokens = 2
arrival_step = 10
[[requests]]
request_id = "C"
prompt_len = 8
max_tokens = 1
arrival_step = 10
[[requests]]
request_id = "D"
prompt_len = 8
max_tokens = 1
after = "C finishes"
"""


def idle_figures(tmp_path: Path) -> tuple[Path, tuple]:
    src = tmp_path / "idle.toml"
    src.write_text(IDLE)
    out = record(src, tmp_path / "idle.parquet")
    rows = pq.read_table(out).to_pylist()
    arrivals = [(r["step"], r["event_index"], r["request_id"]) for r in rows if r["kind"] == "arrival"]
    return out, (arrivals, sorted({r["step"] for r in rows}))


def test_step_arrivals_land_on_the_exact_step_and_idle_steps_are_skipped(tmp_path: Path) -> None:
    out, found = idle_figures(tmp_path)
    # A runs steps 0-1; the idle engine jumps to step 10, where B and C arrive in
    # file order; C ends at step 10, so D arrives at step 11 (B and D end there).
    assert found == ([(0, 0, "A"), (10, 0, "B"), (10, 1, "C"), (11, 0, "D")], [0, 1, 10, 11])
    assert replay(open_trace(out), Scheduler)[0] is None


@pytest.mark.vllm
@pytest.mark.skipif(os.environ.get("HARNESS_SKIP_VLLM") == "1", reason="HARNESS_SKIP_VLLM=1")
def test_step_arrivals_on_vllm(tmp_path: Path) -> None:
    src = tmp_path / "idle.toml"
    src.write_text(IDLE)
    out = record(src, tmp_path / "v.parquet", "--engine", "vllm@0.33.0")
    rows = pq.read_table(out).to_pylist()
    assert [(r["step"], r["request_id"]) for r in rows if r["kind"] == "arrival"] == \
        [(0, "A"), (10, "B"), (10, "C"), (11, "D")]
    r = CliRunner().invoke(main, ["replay", str(out)])
    assert r.exit_code == 0 and "identical decisions" in r.output, r.output


def test_every_key_round_trips(tmp_path: Path) -> None:
    src = tmp_path / "keys.toml"
    src.write_text("""format_version = 1
description = "every request key"
seed = 3
[config]
num_gpu_blocks = 32
block_size = 4
max_model_len = 64
num_speculative_tokens = 2
[[requests]]
request_id = "A"
prompt_token_ids = [5, 50256, 2147483647, 7, 8, 9, 10, 11]
max_tokens = 6
min_tokens = 1
ignore_eos = false
eos_token_id = 50256
stop_token_ids = [999]
priority = 1
arrival_time = 0.0
output_token_ids = [40, 41, 42]
mm_positions = [[1, 2]]
draft_acceptance_pattern = "prefix-1"
[[requests]]
request_id = "B"
prompt_len = 12
prefix_group = "g"
prefix_len = 4
max_tokens = 20
ignore_eos = true
arrival_step = 1
abort_step = 3
[[requests]]
request_id = "C"
prompt_len = 6
prefix_group = "g"
after = "B finishes"
abort_time = 5.0
""")
    scenario = load_scenario(src)
    out = record(src, tmp_path / "k.parquet")
    trace = open_trace(out)
    assert trace.meta["seed"] == 3
    from harness.replay import workload_from_trace
    assert workload_from_trace(trace).requests == scenario.workload.requests
    assert replay(trace, Scheduler)[0] is None
    b, c = scenario.workload.requests[1:]
    assert b.prompt_token_ids[:4] == c.prompt_token_ids[:4] and b.prompt_token_ids[4:6] != c.prompt_token_ids[4:]


BASE = 'format_version = 1\n[config]\nnum_gpu_blocks = 16\nmax_model_len = 128\n'
REQ = '[[requests]]\nrequest_id = "{rid}"\nprompt_len = 8\n{extra}\n'


@pytest.mark.parametrize("body, line, problem", [
    (BASE + REQ.format(rid="A", extra="arrival_step = 0\ncolour = 1"), 9, "unknown key 'colour'"),
    ("bogus = 1\n" + BASE + REQ.format(rid="A", extra="arrival_step = 0"), 1, "unknown key 'bogus'"),
    (BASE + "bogus = 1\n" + REQ.format(rid="A", extra="arrival_step = 0"), 5,
     "unknown config key 'bogus' (no key is close; 42 keys: EngineConfig in reference/config.py)"),
    (BASE + REQ.format(rid="A", extra="arrival_step = 0") + REQ.format(rid="A", extra="arrival_step = 0"),
     10, "duplicate request_id 'A'"),
    (BASE + REQ.format(rid="A", extra='after = "Z finishes"'), 8, "unknown request 'Z'"),
    (BASE + REQ.format(rid="A", extra='after = "B finishes"') + REQ.format(rid="B", extra="arrival_step = 0"),
     8, "comes later"),
    (BASE + REQ.format(rid="A", extra='after = "B finishes"') + REQ.format(rid="B", extra='after = "A finishes"'),
     8, "cycle A -> B -> A"),
    (BASE + '[[requests]]\nrequest_id = "A"\nprompt_token_ids = [1, -2]\narrival_step = 0\n', 7,
     "-2 is less than the minimum of 0"),
    (BASE + '[[requests]]\nrequest_id = "A"\nprompt_token_ids = [1, 2.5]\narrival_step = 0\n', 7,
     "2.5 is not of type 'integer'"),
    (BASE + '[[requests]]\nrequest_id = "A"\nprompt_token_ids = [2147483648]\narrival_step = 0\n', 7,
     "traces store int32"),
    (BASE + REQ.format(rid="A", extra="arrival_step = 4\nabort_step = 2"), 9, "abort_step 2 is in the past"),
    (BASE + REQ.format(rid="A", extra="arrival_step = 4\narrival_time = 1.0"), 8, "exactly one of"),
    (BASE + "max_num_seqs = 0\n" + REQ.format(rid="A", extra="arrival_step = 0"), 5, "bad config: max_num_seqs"),
    (BASE + "[[requests]\n", 5, "TOML syntax error"),
    # Regressions from an adversarial review: each crashed, was silently accepted, or changed meaning.
    (BASE + REQ.format(rid="A", extra="arrival_step = 0\npriority = 2147483648"), 9,
     "2147483648 is greater than the maximum of 2147483647"),  # crashed the int32 writer
    (BASE + REQ.format(rid="A", extra="arrival_step = 0\nmax_tokens = 9223372036854775807"), 9,
     "is greater than the maximum of 2147483647"),
    (BASE + '[[requests]]\nrequest_id = "A"\nprompt_len = 8.0\narrival_step = 0\n', 7,
     "8.0 is not of type 'integer'"),  # a TypeError traceback
    ('format_version = 1\nseed = 1.0\n' + BASE[len('format_version = 1\n'):] + REQ.format(rid="A", extra="arrival_step = 0"),
     2, "1.0 is not of type 'integer'"),  # accepted; the trace then failed to replay
    (BASE + '[[requests]]\nrequest_id = "A"\nprompt_len = 2147483647\narrival_step = 0\n', 7,
     "greater than the maximum of 16777216"),  # hung synthesising the prompt
    (BASE + REQ.format(rid="A", extra='arrival_step = 0\nprefix_group = "g"\nprefix_len = 20'), 10,
     "prefix_len 20 is longer than the prompt (8 tokens)"),  # accepted with an 8-token prompt
    (BASE + "max_concurrent_batches = 2\n" + REQ.format(rid="A", extra="arrival_step = 0"), 5,
     "max_concurrent_batches is not a config key"),  # accepted, unlike --set
    (BASE + REQ.format(rid="A finishes", extra="arrival_step = 0"), 6,
     "request_id must have no white space"),  # an id `after` could never name
])
def test_bad_input_exits_2_with_file_line_problem(refused_scenario, body: str, line: int, problem: str) -> None:
    refused_scenario(body, line, problem)


def test_json_duplicate_keys_are_refused_as_toml_refuses_them(tmp_path: Path) -> None:
    """Regression: json.loads kept the last of two ``max_tokens`` silently."""
    src = tmp_path / "dup.json"
    src.write_text('{"format_version": 1,\n "requests": [\n  {"request_id": "A", "prompt_len": 8,\n'
                   '   "max_tokens": 2,\n   "max_tokens": 5, "arrival_step": 0}]}\n')
    r = CliRunner().invoke(main, ["record", str(src), "-o", str(tmp_path / "t.parquet")])
    assert r.exit_code == 2
    assert r.output == f"error: {src}:5: JSON: duplicate key 'max_tokens' (TOML refuses it too)\n"


def test_output_naming_the_input_is_refused(tmp_path: Path) -> None:
    """Regression: ``record S.toml -o S.toml`` replaced the scenario with its trace, and
    ``scenario extract T.parquet -o T.parquet`` the trace with TOML."""
    src = tmp_path / "s.toml"
    src.write_bytes((SCENARIOS / "stop-token.toml").read_bytes())
    r = CliRunner().invoke(main, ["record", str(src), "-o", str(src)])
    assert r.exit_code == 2 and "-o names the input file" in r.output
    assert src.read_bytes() == (SCENARIOS / "stop-token.toml").read_bytes()
    trace = record(src, tmp_path / "t.parquet")
    before = trace.read_bytes()
    r = CliRunner().invoke(main, ["scenario", "extract", str(trace), "-o", str(trace)])
    assert r.exit_code == 2 and "-o names the input file" in r.output and trace.read_bytes() == before


def test_set_cannot_slip_a_forced_reset_past_the_loader(tmp_path: Path) -> None:
    """Regression: ``--set async_scheduling=true`` on a file with ``reset_running_requests``
    recorded a trace its own check then flagged (STALE-OUTPUT)."""
    out = tmp_path / "t.parquet"
    r = CliRunner().invoke(main, ["record", str(SCENARIOS / "reset-prefix-cache-preempt-running.toml"),
                                  "--set", "async_scheduling=true", "-o", str(out)])
    assert r.exit_code == 2 and not out.exists()
    assert r.output == ("error: bad config: reset_running_requests needs a synchronous engine without a KV "
                        "connector (async_scheduling, batches in flight or kv_connector are not supported)\n")


def test_json_scenario_gives_the_same_workload_and_line_numbers(tmp_path: Path) -> None:
    import json
    import tomllib
    doc = tomllib.loads((SCENARIOS / "prefix-reuse-after-finish.toml").read_text())
    src = tmp_path / "s.json"
    src.write_text(json.dumps(doc, indent=2))
    assert load_scenario(src).workload.requests == \
        load_scenario(SCENARIOS / "prefix-reuse-after-finish.toml").workload.requests
    doc["requests"][1]["max_tokens"] = 0
    src.write_text(json.dumps(doc, indent=2))
    r = CliRunner().invoke(main, ["record", str(src), "-o", str(tmp_path / "t.parquet")])
    line = next(i + 1 for i, text in enumerate(src.read_text().splitlines()) if '"max_tokens": 0' in text)
    assert r.exit_code == 2 and f"{src}:{line}: requests[1].max_tokens: 0 is less than the minimum of 1" \
        in r.output, r.output


def test_set_overrides_the_file_config(tmp_path: Path) -> None:
    out = record(SCENARIOS / "prefix-reuse-after-finish.toml", tmp_path / "t.parquet",
                 "--set", "enable_prefix_caching=false")
    assert figures(out)[2] == {}


def test_scenario_without_format_version_reads_as_the_current_version(tmp_path: Path) -> None:
    # Issue 27: a hand-written file without `format_version` was refused ("'format_version' is a
    # required property"); it reads as FORMAT_VERSION, and a wrong one is still refused.
    src = tmp_path / "s.toml"
    src.write_text('[config]\nnum_gpu_blocks = 16\nmax_model_len = 128\n\n[[requests]]\nrequest_id = "A"\nprompt_len = 8\n'
                   'arrival_step = 0\n')
    scenario = load_scenario(src)
    assert scenario.workload.params == {"format_version": FORMAT_VERSION, "request_order": ["A"]}
    src.write_text("format_version = 2\n" + src.read_text())
    with pytest.raises(ScenarioError, match=rf"^{re.escape(str(src))}:1: format_version: format_version must be 1 "
                                            rf"\(this harness reads version 1\)$"):
        load_scenario(src)
