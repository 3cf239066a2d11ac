"""``harness scenario extract`` (harness/scenario_extract.py) and the scenario writer
(workloads/scenario.py ``dump_scenario``).

Round trips: every scenario file of traces/scenarios/ plus one that uses the
keys none of them does (``ALL_KEYS``) goes file -> ``harness record`` -> trace ->
``harness scenario extract`` -> file -> ``harness record``. The second trace has
the first's rows exactly and its metadata but for the workload's provenance
(``source``, ``sha256``: the file's name and bytes, which legitimately differ:
the extract spells prompts out and carries comments); a second extract of it
gives the same file but for the provenance comment (the fixed point). Goldens extract to files that re-record the same
decisions; a non-interacting subset reproduces its decisions; a cut that
cannot be faithful warns (exit 0) and bad input is refused (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import tomllib
from click.testing import CliRunner

from harness.cli import main
from harness.scenario_extract import decisions
from harness.trace import open_trace
from reference.workload import RequestSpec
from workloads.scenario import SCENARIO_SCHEMA, dump_scenario, load_scenario

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((REPO / "traces" / "scenarios").glob("*.toml"))
GOLDEN = REPO / "golden"

# The keys no file of traces/scenarios/ uses: seed, prefix_len, arrival_time, abort_time,
# mm_positions (and, again, most others).
ALL_KEYS = '''# Every key traces/scenarios/ leaves out.
format_version = 1
description = "timed arrivals, a timed abort, a shared prefix of 8, encoder items, seed 3"
seed = 3

[config]
num_gpu_blocks = 24
block_size = 4
max_model_len = 64
policy = "priority"

[[requests]]
request_id = "A"
prompt_len = 12
prefix_group = "p"
prefix_len = 8
max_tokens = 6
min_tokens = 2
ignore_eos = true
priority = 1
arrival_time = 0.0
mm_positions = [[0, 4]]

[[requests]]
request_id = "B"
prompt_len = 12
prefix_group = "p"
prefix_len = 8
max_tokens = 30
ignore_eos = true
stop_token_ids = [7]
eos_token_id = 5
arrival_time = 0.012
abort_time = 0.05

[[requests]]
request_id = "C"
prompt_token_ids = [11, 12, 13, 14, 15]
max_tokens = 3
output_token_ids = [50256, 9]
draft_acceptance_pattern = "none"
arrival_step = 2
abort_step = 40
'''


def _run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args))
    return res.exit_code, res.stdout, res.stderr


def _record(scenario: Path, out: Path, *extra: str) -> Path:
    code, stdout, stderr = _run("record", str(scenario), "-o", str(out), *extra)
    assert code == 0, stdout + stderr
    return out


def _extract(trace: Path, out: Path, *extra: str) -> tuple[str, list[str]]:
    """Run the CLI; returns (the file's text, the warning lines on stderr)."""
    code, stdout, stderr = _run("scenario", "extract", str(trace), "-o", str(out), *extra)
    assert code == 0, stdout + stderr
    return out.read_text(), [ln for ln in stderr.splitlines() if ln.startswith("warning:")]


def _meta(path: Path) -> dict:
    return json.loads(pq.ParquetFile(path).metadata.metadata[b"sched_harness"])


def _decisions(path: Path, ids: set[str] | None = None, *, full: bool = True) -> dict:
    rows = list(open_trace(path).iter_steps())
    ids = ids if ids is not None else {r["request_id"] for _, rs in rows for r in rs
                                       if r["kind"] in ("arrival", "reject")}
    return decisions(rows, ids, block_ids=full, relative=not full)


def _sources(tmp_path: Path) -> list[Path]:
    all_keys = tmp_path / "all-keys.toml"
    all_keys.write_text(ALL_KEYS)
    return SCENARIOS + [all_keys]


def test_the_round_trip_files_use_every_key(tmp_path):
    """Every top-level, [config]-level and [[requests]] key of the format appears in some file."""
    used, request_keys = set(), set()
    for path in _sources(tmp_path):
        doc = tomllib.loads(path.read_text())
        used |= set(doc)
        request_keys |= {k for r in doc["requests"] for k in r}
    # [synthetic] (a generator instead of [[requests]]) is the canonical scenarios' form; extract
    # always writes requests, and tests/test_canonical_scenarios.py shows each [synthetic] file
    # re-records its golden byte for byte.
    assert used == set(SCENARIO_SCHEMA["properties"]) - {"synthetic"}
    assert request_keys == set(SCENARIO_SCHEMA["properties"]["requests"]["items"]["properties"])


@pytest.mark.parametrize("index", range(len(SCENARIOS) + 1),
                         ids=[p.stem for p in SCENARIOS] + ["all-keys"])
def test_file_trace_extract_file_trace_round_trip(tmp_path, index):
    source = _sources(tmp_path)[index]
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        d.mkdir()
    t1 = _record(source, one / "t.parquet")
    text1, warnings = _extract(t1, one / "s.toml")
    assert warnings == []
    assert "faithful" not in text1  # the stdout line says it; the file carries only provenance
    t2 = _record(one / "s.toml", two / "t.parquet")
    # Same rows, byte for byte; the same metadata but for the workload's provenance.
    assert pq.read_table(t1).equals(pq.read_table(t2))
    m1, m2 = _meta(t1), _meta(t2)
    assert m1["workload"].pop("source") == f"scenario:{source.name}"
    assert m2["workload"].pop("source") == "scenario:s.toml"
    assert m1["workload"].pop("sha256") != m2["workload"].pop("sha256")
    assert m1 == m2
    # The fixed point: extracting the re-recording gives the same file but for the provenance
    # comment (it names the workload file and its sha256).
    text2, _ = _extract(t2, two / "s.toml")
    assert text2 != text1
    assert _body(text2) == _body(text1)


def _body(text: str) -> str:
    return "".join(ln for ln in text.splitlines(keepends=True) if not ln.startswith("# Extracted by"))


def test_written_scenario_loads_back_to_the_same_requests(tmp_path):
    """dump_scenario -> load_scenario: the same RequestSpecs, config and seed; deterministic bytes."""
    path = tmp_path / "all-keys.toml"
    path.write_text(ALL_KEYS)
    sc = load_scenario(path)
    text = dump_scenario(sc.workload.requests, sc.config, seed=sc.seed, description=sc.description,
                         comments=["provenance: a test", "second line"])
    assert text == dump_scenario(sc.workload.requests, sc.config, seed=sc.seed,
                                 description=sc.description, comments=["provenance: a test", "second line"])
    assert text.startswith("# provenance: a test\n# second line\nformat_version = 1\n"
                           'description = "timed arrivals, a timed abort')
    back = tmp_path / "back.toml"
    back.write_text(text)
    again = load_scenario(back)
    assert again.workload.requests == sc.workload.requests
    assert (again.config, again.seed, again.description) == (sc.config, sc.seed, sc.description)
    # Keys at the loader's default are left out; max_tokens and the arrival always written.
    c = tomllib.loads(text)["requests"][2]
    assert list(c) == ["request_id", "prompt_token_ids", "max_tokens", "arrival_step", "abort_step",
                       "output_token_ids", "draft_acceptance_pattern"]


def test_unexpressible_request_fields_are_refused_by_the_writer():
    from reference.workload import WorkloadError

    spec = RequestSpec("x", 0.0, (1, 2), 4, scripted_output_len=2)
    with pytest.raises(WorkloadError, match="x: scripted_output_len has no scenario key"):
        dump_scenario([spec], {})
    with pytest.raises(WorkloadError, match="x: eos_token_id None has no scenario key"):
        dump_scenario([RequestSpec("x", 0.0, (1, 2), 4, eos_token_id=None)], {})
    with pytest.raises(WorkloadError, match="at least one request"):
        dump_scenario([], {})


# Goldens: scripted EOS positions (eos-stop-abort: output_token_ids fixed from the output rows),
# the KV connector, encoder inputs, drafts with priority, pipelining, data parallel.
@pytest.mark.parametrize("name", ["eos-stop-abort", "kv-connector", "encoder-inputs", "spec-decode-priority",
                                  "async-pipeline-3", "dp2-throttle", "fcfs-tight"])
def test_golden_extract_rerecords_the_same_decisions(tmp_path, name):
    golden = GOLDEN / f"{name}.parquet"
    text, warnings = _extract(golden, tmp_path / "s.toml")
    assert warnings == []
    doc = tomllib.loads(text)
    assert len(doc["requests"]) == len(_decisions(golden))  # every request of the golden
    if name == "eos-stop-abort":
        # Scripted EOS positions have no key: the sampled tokens are fixed instead.
        assert sum("output_token_ids" in r for r in doc["requests"]) >= 1
    t = _record(tmp_path / "s.toml", tmp_path / "t.parquet")
    assert _decisions(t) == _decisions(golden)
    assert _meta(t)["config_fingerprint"] == _meta(golden)["config_fingerprint"]


NON_INTERACTING = '''format_version = 1
description = "three requests, each done before the next arrives"

[config]
num_gpu_blocks = 20
block_size = 4
max_model_len = 64

[[requests]]
request_id = "A"
prompt_len = 6
max_tokens = 3
ignore_eos = true
arrival_time = 0.0

[[requests]]
request_id = "B"
prompt_len = 9
max_tokens = 5
ignore_eos = true
arrival_time = 1.0

[[requests]]
request_id = "C"
prompt_len = 7
max_tokens = 4
ignore_eos = true
arrival_time = 2.0
'''


def test_subset_that_does_not_interact_reproduces_its_decisions(tmp_path):
    (tmp_path / "src.toml").write_text(NON_INTERACTING)
    trace = _record(tmp_path / "src.toml", tmp_path / "t.parquet")
    text, warnings = _extract(trace, tmp_path / "s.toml", "--requests", "A,C")
    assert warnings == []
    doc = tomllib.loads(text)
    assert [r["request_id"] for r in doc["requests"]] == ["A", "C"]
    assert [r["arrival_time"] for r in doc["requests"]] == [0.0, 2.0]  # timing kept as the trace had it
    cut = _record(tmp_path / "s.toml", tmp_path / "cut.parquet")
    assert _decisions(cut, {"A", "C"}, full=False) == _decisions(trace, {"A", "C"}, full=False)
    # Counted from arrival: without B's steps, C's run starts at an earlier step number.
    arrival = {r["request_id"]: s for s, rows in open_trace(trace).iter_steps() for r in rows
               if r["kind"] == "arrival"}
    arrival_cut = {r["request_id"]: s for s, rows in open_trace(cut).iter_steps() for r in rows
                   if r["kind"] == "arrival"}
    assert (arrival["C"], arrival_cut["C"]) == (8, 3)


def test_cut_of_interacting_requests_warns_and_still_writes(tmp_path):
    """running-cap-across-steps: A shares the running cap with B, C, D."""
    trace = _record(REPO / "traces" / "scenarios" / "running-cap-across-steps.toml", tmp_path / "t.parquet")
    text, warnings = _extract(trace, tmp_path / "s.toml", "--requests", "A")
    assert warnings == ["warning: 3 request(s) outside the cut were live while chosen ones ran (they held "
                        "blocks and batch slots): B, C, D"]
    assert "# warning: 3 request(s) outside the cut" in text
    assert [r["request_id"] for r in tomllib.loads(text)["requests"]] == ["A"]


def test_a_cut_whose_rerun_decides_otherwise_says_where(tmp_path):
    text, warnings = _extract(GOLDEN / "fcfs-tight.parquet", tmp_path / "s.toml", "--requests",
                              "r000003,r000005")
    assert len(warnings) == 2
    assert warnings[0].startswith("warning: 5 request(s) outside the cut were live while chosen ones ran")
    assert warnings[1] == (
        "warning: re-running the scenario gives r000005 other decisions: its decision 0 is schedule at step "
        "since arrival 0 {'schedule_kind': 'new', 'num_computed_tokens': 0, 'num_scheduled_tokens': 61, "
        "'num_prefix_hit_tokens': 0}, the trace has schedule at step since arrival 9 {'schedule_kind': "
        "'new', 'num_computed_tokens': 0, 'num_scheduled_tokens': 61, 'num_prefix_hit_tokens': 0}")


def test_steps_window_selects_live_requests_and_warns_when_it_starts_after_an_arrival(tmp_path):
    (tmp_path / "src.toml").write_text(NON_INTERACTING)
    trace = _record(tmp_path / "src.toml", tmp_path / "t.parquet")
    # A runs in steps 0-2, B in 3-7, C in 8-11.
    text, warnings = _extract(trace, tmp_path / "s.toml", "--steps", "3:8")
    assert [r["request_id"] for r in tomllib.loads(text)["requests"]] == ["B"]
    assert warnings == []
    text, warnings = _extract(trace, tmp_path / "s.toml", "--steps", "5:9")
    assert [r["request_id"] for r in tomllib.loads(text)["requests"]] == ["B", "C"]
    assert warnings == ["warning: --steps 5:9 starts after B arrived (step 3): the scenario replays it "
                        "from arrival"]


@pytest.mark.parametrize("args, message", [
    (["--requests", "A,nope"], "no request 'nope' in the trace (3 requests)"),
    (["--steps", "5"], "--steps '5': expected A:B with 0 <= A < B"),
    (["--steps", "4:2"], "--steps '4:2': expected A:B with 0 <= A < B"),
    (["--steps", "x:2"], "--steps 'x:2': expected A:B (integers, B > A)"),
    (["--steps", "30:40"], "the cut holds no request"),
    # Regressions: int() took these as 10:20 and 0:3; a repeated id was accepted.
    (["--steps", "1_0:2_0"], "--steps '1_0:2_0': expected A:B (integers, B > A)"),
    (["--steps", "\uff10:\uff13"], "expected A:B (integers, B > A)"),
    (["--requests", "A,A"], "--requests 'A,A': an id is listed twice"),
])
def test_bad_cuts_exit_2_and_write_nothing(tmp_path, args, message):
    (tmp_path / "src.toml").write_text(NON_INTERACTING)
    trace = _record(tmp_path / "src.toml", tmp_path / "t.parquet")
    code, stdout, stderr = _run("scenario", "extract", str(trace), "-o", str(tmp_path / "s.toml"), *args)
    assert code == 2
    assert message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not (tmp_path / "s.toml").exists()


def test_not_a_trace_exits_2(tmp_path):
    bad = tmp_path / "x.parquet"
    bad.write_text("nope")
    code, _, stderr = _run("scenario", "extract", str(bad), "-o", str(tmp_path / "s.toml"))
    assert code == 2 and "not a Parquet file" in stderr
    assert not (tmp_path / "s.toml").exists()


def test_real_model_trace_fixes_the_sampled_tokens(tmp_path):
    """A torch-model trace (metadata ``model``): output_token_ids from the output rows, so the
    scripted model plays the same tokens back."""
    pytest.importorskip("torch")
    source = REPO / "traces" / "scenarios" / "prefix-reuse-after-finish.toml"
    trace = _record(source, tmp_path / "t.parquet", "--model", "torch", "--device", "cpu")
    text, warnings = _extract(trace, tmp_path / "s.toml")
    assert warnings == []
    doc = tomllib.loads(text)
    outputs = {r["request_id"]: [t for _, rows in open_trace(trace).iter_steps() for row in rows
                                 if row["kind"] == "output" and row["request_id"] == r["request_id"]
                                 for t in row["token_ids"]] for r in doc["requests"]}
    assert all(r["output_token_ids"] == outputs[r["request_id"]] for r in doc["requests"])
    replayed = _record(tmp_path / "s.toml", tmp_path / "again.parquet")
    assert _decisions(replayed) == _decisions(trace)


def test_fuzz_witness_scenario_rerecords_the_same_invariant(tmp_path):
    """A fuzz run against a mutant writes NAME.toml beside NAME.parquet/.json; `harness record`
    of it on the mutant gives a trace `harness check` flags with the same invariants."""
    out = tmp_path / "out"
    code, stdout, _ = _run("fuzz", "--candidate", "mutant:leak-on-abort", "--max-examples", "50",
                           "--seed", "0", "-o", str(out))
    assert code == 1
    info = json.loads(next(out.glob("*.json")).read_text())
    toml = Path(info["scenario_file"])
    assert toml == out / "fuzz-mutant-leak-on-abort-seed0.toml" and toml.is_file()
    assert info["scenario_warnings"] == []
    assert info["record_command"] in stdout and str(toml) in stdout
    assert info["record_command"] == (f"harness record {toml} --engine mutant:leak-on-abort -o "
                                      f"{out}/fuzz-mutant-leak-on-abort-seed0.rerecorded.parquet")
    assert tomllib.loads(toml.read_text())["description"].startswith(
        "fuzz witness (mutant:leak-on-abort, seed 0): violation: ")
    rerecorded = tmp_path / "re.parquet"
    code, stdout, stderr = _run("record", str(toml), "--engine", "mutant:leak-on-abort", "-o", str(rerecorded))
    assert code == 0, stdout + stderr
    code, stdout, _ = _run("check", str(rerecorded), "--json")
    assert code == 1
    assert json.loads(stdout)["violations_by_invariant"] == info["failure"]["invariants"]
    # The clean reference on the same file: no violation (the bug is the mutant's).
    _record(toml, tmp_path / "ref.parquet")
    assert _run("check", str(tmp_path / "ref.parquet"))[0] == 0


def test_extracted_config_uses_vllm_keys_and_prompts_stay_readable(tmp_path):
    """An extracted scenario sets what a vLLM user sets: pipeline_parallel_size (or
    async_scheduling), never the derived max_concurrent_batches; token-id arrays
    are folded 16 ids a line instead of tomli_w's one id a line."""
    for name, expected in (("pipeline-3", {"pipeline_parallel_size": 3}),
                           ("async-tight", {"async_scheduling": True})):
        out = tmp_path / f"{name}.toml"
        _extract(GOLDEN / f"{name}.parquet", out)
        text = out.read_text()
        config = tomllib.loads(text)["config"]
        assert "max_concurrent_batches" not in config
        assert {k: config[k] for k in expected} == expected
        assert "pipeline_parallel_size" not in config or name == "pipeline-3"
        prompt = text.split("prompt_token_ids = [\n", 1)[1].split("]", 1)[0].splitlines()
        assert [len(line.split(",")) - 1 for line in prompt[:-1]] == [16] * (len(prompt) - 1)
        prompts = {r["request_id"]: list(r["prompt_token_ids"])
                   for r in pq.read_table(GOLDEN / f"{name}.parquet").to_pylist() if r["kind"] == "arrival"}
        assert {r.request_id: list(r.prompt_token_ids) for r in load_scenario(out).workload.requests} == prompts


def test_regression_a_dropped_zero_suggests_the_id_it_dropped_from_first(tmp_path):
    """New-user trial: ``--requests r00004`` (a dropped zero) offered r000034,
    r000024 and r000014 (difflib breaks its ties on the larger string), never
    r000004: the fewest edits come first, then no new character."""
    code, _, stderr = _run("scenario", "extract", str(GOLDEN / "fcfs-roomy.parquet"), "--requests", "r00004",
                           "-o", str(tmp_path / "s.toml"))
    assert code == 2
    assert stderr.strip().endswith("no request 'r00004' in the trace (60 requests); did you mean 'r000004', "
                                   "'r000044' or 'r000054'?"), stderr
