"""record -> check -> replay on real workload slices, bad input, and broken engines.

Every checker must be shown to fire: each mutant of harness/candidates/mutants/ is
recorded on a scenario that exercises its bug and ``harness check`` must exit 1
naming the intended invariant.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.trace import METADATA_KEY
from harness.mutation import kill_matrix, run_candidate
from harness.scenarios import LORA_SCENARIOS, SCENARIOS
from harness.candidates.mutants import MUTANTS
from reference.scheduler import Scheduler

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
AZURE_CODE = DATA / "azure-llm-inference-2023" / "AzureLLMInferenceTrace_code.csv"
MOONCAKE = DATA / "mooncake-fast25" / "conversation_trace.jsonl"
needs_data = pytest.mark.skipif(not DATA.exists(), reason="../shared/data not present")

# A tight pool: decodes run out of blocks, so preemption really happens.
TIGHT = ["--set", "num_gpu_blocks=30", "--set", "max_model_len=96", "--set", "max_num_seqs=4",
         "--set", "block_size=4", "--set", "max_num_batched_tokens=64"]
# A roomy pool where max_num_seqs is the binding limit.
ROOMY = ["--set", "num_gpu_blocks=200", "--set", "max_model_len=96", "--set", "max_num_seqs=4",
         "--set", "block_size=4", "--set", "max_num_batched_tokens=64"]


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def run_json(*args: str) -> tuple[int, dict]:
    code, out = run(*args, "--json")
    return code, json.loads(out)


@pytest.fixture(scope="module")
def azure_trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("azure") / "azure.parquet"
    code, out = run("record", AZURE_CODE, "--limit", 300, "--time-scale", 10, "--set", "num_gpu_blocks=600",
                    "--set", "max_num_seqs=64", "--set", "max_model_len=8192", "-o", path)
    assert code == 0, out
    return path


@needs_data
def test_azure_slice_record_check_replay(azure_trace: Path) -> None:
    code, report = run_json("replay", azure_trace)
    assert code == 0, report
    assert report["ok"] is True
    assert report["requests"] == 300
    assert report["finished"] == 300
    assert report["rejected"] == 0
    assert report["preemptions"] == 6
    assert report["prefix_hit_tokens"] == 14800  # resumed requests re-hit their own blocks
    assert report["steps"] == report["replayed_steps"] == 2824
    assert report["violations"] == [] and report["divergence"] is None


@needs_data
def test_mooncake_slice_has_prefix_hits_and_rejections(tmp_path: Path) -> None:
    path = tmp_path / "mc.parquet"
    code, out = run("record", MOONCAKE, "--limit", 40, "--time-scale", 20, "--set", "num_gpu_blocks=2100",
                    "--set", "max_model_len=32768", "--set", "max_num_seqs=16", "-o", path)
    assert code == 0, out
    code, report = run_json("replay", path)
    assert code == 0, report
    assert report["finished"] == 38
    assert report["rejected"] == 2  # prompts longer than max_model_len, recorded, not clipped
    assert report["prefix_hit_tokens"] == 19920  # hash id 0 and longer shared prefixes hit
    assert report["preemptions"] == 1
    rejects = pq.read_table(path, filters=[("kind", "=", "reject")]).to_pylist()
    assert [len(r["prompt_token_ids"]) > 32768 for r in rejects] == [True, True]
    assert all("longer than max_model_len" in r["message"] for r in rejects)


def test_synthetic_tight_pool_preempts_and_is_conformant(tmp_path: Path) -> None:
    path = tmp_path / "syn.parquet"
    code, out = run("record", "synthetic:60", *TIGHT, "-o", path)
    assert code == 0, out
    code, report = run_json("replay", path)
    assert code == 0, report
    assert (report["steps"], report["finished"], report["preemptions"]) == (392, 60, 1)


def test_record_is_deterministic(tmp_path: Path) -> None:
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    for path in (a, b):
        assert run("record", "synthetic:30", *TIGHT, "--seed", 7, "-o", path)[0] == 0
    assert pq.read_table(a).equals(pq.read_table(b))
    assert pq.ParquetFile(a).metadata.metadata[METADATA_KEY] == pq.ParquetFile(b).metadata.metadata[METADATA_KEY]


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_every_mutant_is_caught_by_its_invariant(name: str) -> None:
    """The mutation self-test: each mutant's target invariant fires on at
    least one canonical scenario (harness/scenarios/*.toml)."""
    (row,) = kill_matrix([name])
    assert row.killed, {s: c.result.by_invariant for s, c in row.cells.items()}
    # Regression (mutants no-draft-rollback, no-stop-on-max-tokens): a mutant
    # overriding a hook with the wrong signature crashed with a TypeError on
    # the kv-connector scenario instead of showing its fault.
    crashes = {s: c.ended for s, c in row.cells.items() if "TypeError" in c.ended}
    assert crashes == {}


def test_reference_violates_nothing_on_any_scenario() -> None:
    for name, scenario in {**SCENARIOS, **LORA_SCENARIOS}.items():
        cell = run_candidate(Scheduler, scenario)
        assert cell.ended == "" and cell.result.ok, (name, cell.result.by_invariant)


def test_mutants_command_prints_kill_matrix() -> None:
    code, out = run("mutants", "--list")
    assert code == 0 and out.split() == list(MUTANTS)
    code, report = run_json("mutants", "--scenario", "fcfs-tight", "--scenario", "priority-tight")
    # Aborts, prefix sharing, the threshold, drafts, pipelining, the KV
    # connector and encoder inputs are exercised only by other scenarios: their
    # mutants' traces are the reference's here, so n/a, and the run exits 0.
    assert code == 0 and report["survivors"] == [] and report["ok"] is True
    # (preempt-keeps-drafts: only a victim holding drafts shows it, under speculative decoding.)
    assert report["not_exercised"] == ["preempt-keeps-drafts", "leak-on-abort", "double-free-shared",
                                   "ignore-threshold",
                                   "drafts-on-prefill", "no-draft-rollback", "free-before-fence",
                                   "no-stale-skip", "no-async-max-tokens-guard",
                                   "ignore-prefill-cadence", "ignore-throttle", "free-while-loading",
                                   "cache-before-load", "no-load-reservation", "promote-early",
                                   "ignore-encoder-budget", "no-encoder-cache-check", "evict-newest-first",
                                   "no-encoder-give-back",
                                   # Only scenarios with a reset_prefix_cache action kill these.
                                   "reset-while-held", "reset-keeps-cache", "reset-preempts-head",
                                   # Only async-spec-decode (async scheduling with drafts).
                                   "stale-spec-output",
                                   # Only deferred-frees (a fenced victim).
                                   "preempt-fenced",
                                   # Only the hybrid scenarios (golden/hybrid/): sliding window, Mamba.
                                   "keep-skipped-blocks", "free-window-ahead",
                                   "mamba-free-state", "mamba-extra-state-block",
                                   # Only the LoRA scenarios (harness/scenarios/lora/): max_loras.
                                   "ignore-max-loras"]
    assert report["reference_violations"] == {}
    cell = report["matrix"]["preempt-head"]["cells"]["fcfs-tight"]
    assert (cell["target_hits"], cell["ended"]) == (1, "")
    code, report = run_json("mutants", "--mutant", "lifo-priority-victim", "--scenario", "fcfs-tight")
    assert (code, report["survivors"], report["not_exercised"]) == (0, [], ["lifo-priority-victim"])
    assert report["matrix"]["lifo-priority-victim"]["exercised"] is False
    # Exercised (its trace differs under priority) but its target never fires: a survivor.
    code, report = run_json("mutants", "--mutant", "preempt-head", "--scenario", "priority-tight")
    assert (code, report["survivors"], report["not_exercised"]) == (1, ["preempt-head"], [])
    code, report = run_json("mutants", "--mutant", "lifo-priority-victim")  # no --scenario: never n/a
    assert (code, report["survivors"], report["not_exercised"]) == (0, [], [])


def test_regression_a_survivor_is_not_called_a_semantics_only_fault() -> None:
    """A new user's trial: ``--scenario kv-connector`` reaches no preemption, and the
    surviving safety mutant no-give-back read "- (a semantics-only fault)"."""
    code, out = run("mutants", "--mutant", "no-give-back", "--mutant", "free-head-first",
                    "--scenario", "kv-connector")
    assert code == 0  # no-give-back's trace is the reference's there: n/a, not a survivor
    kills: dict[str, list[str]] = {}
    assert out.splitlines()[-2:] == [
        "n/a: not exercised by kv-connector (each run's trace is the reference's, row for row: no checker "
        "could tell it from a correct engine)",
        "1/1 exercised mutants killed; 1 n/a: no-give-back"]
    cells = {}
    for line in out.splitlines():
        parts = [c.strip() for c in line.split("│")]
        if len(parts) == 8 and parts[1]:
            name = parts[1]
        if len(parts) == 8:
            cells.setdefault(name, []).append(parts[6])
            kills.setdefault(name, []).append(parts[5])
    assert " ".join(filter(None, cells["no-give-back"])) == "-"
    assert " ".join(filter(None, kills["no-give-back"])) == "n/a"
    assert " ".join(filter(None, cells["free-head-first"])) == "- (a semantics-only fault)"


def test_admit_after_preempt_witness(tmp_path: Path) -> None:
    path = tmp_path / "m.parquet"
    run("record", "synthetic:60", *TIGHT, "--engine", "mutant:admit-after-preempt", "-o", path)
    code, report = run_json("check", path)
    assert code == 1
    v = next(v for v in report["violations"] if v["invariant"] == "NO-ADMIT-AFTER-PREEMPT")
    assert v["step"] == 148
    assert v["request"] == "r000025"
    # The mutant re-admitted the very request it had just preempted.
    assert v["message"] == "admitted (resumed) in a step that preempted ['r000025']"


def test_replay_against_a_mutant_reports_first_divergence(tmp_path: Path) -> None:
    path = tmp_path / "ref.parquet"
    assert run("record", "synthetic:60", *TIGHT, "-o", path)[0] == 0
    code, report = run_json("replay", path, "--candidate", "mutant:preempt-head")
    assert code == 1
    assert report["violations"] == []  # the trace itself is fine
    d = report["divergence"]
    assert d["step"] == 148
    assert d["request"] == "r000025"
    # The reference preempts the running tail; the mutant withdraws the head.
    assert (d["field"], d["expected"], d["actual"]) == ("event", "preempt r000025", "withdraw r000024")
    code, out = run("replay", path, "--candidate", "mutant:preempt-head")
    assert code == 1 and "DIVERGENCE at step 148" in out


# -- unusable input: exit 2 with a one-line message naming the file --------

@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    path = tmp_path / "small.parquet"
    assert run("record", "synthetic:10", *ROOMY, "-o", path)[0] == 0
    return path


def _assert_unusable(path: Path, fragment: str) -> None:
    for command in ("check", "replay"):
        code, out = run(command, path)
        assert code == 2, out
        assert str(path) in out and fragment in out, out


def test_missing_file(tmp_path: Path) -> None:
    _assert_unusable(tmp_path / "nope.parquet", "no such file")


def test_not_parquet(tmp_path: Path) -> None:
    path = tmp_path / "text.parquet"
    path.write_text("step,kind\n0,arrival\n")
    _assert_unusable(path, "not a Parquet file")


def test_truncated_file(small_trace: Path, tmp_path: Path) -> None:
    data = small_trace.read_bytes()
    path = tmp_path / "truncated.parquet"
    path.write_bytes(data[: len(data) // 2])
    _assert_unusable(path, "truncated")


def _rewrite(src: Path, dst: Path, table: pa.Table, meta: dict) -> None:
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(meta)}), dst)


def test_unknown_schema_version(small_trace: Path, tmp_path: Path) -> None:
    table = pq.read_table(small_trace)
    meta = json.loads(pq.ParquetFile(small_trace).metadata.metadata[METADATA_KEY])
    meta["schema_version"] = 99
    path = tmp_path / "v99.parquet"
    _rewrite(small_trace, path, table, meta)
    _assert_unusable(path, "unknown trace schema version 99")


def test_missing_column(small_trace: Path, tmp_path: Path) -> None:
    table = pq.read_table(small_trace)
    meta = json.loads(pq.ParquetFile(small_trace).metadata.metadata[METADATA_KEY])
    path = tmp_path / "nocol.parquet"
    _rewrite(small_trace, path, table.drop_columns(["num_free_blocks"]), meta)
    _assert_unusable(path, "missing column(s) num_free_blocks")


def test_plain_parquet_without_metadata(tmp_path: Path) -> None:
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), path)
    _assert_unusable(path, "without sched-harness metadata")


def test_bad_config_and_workload_exit_2(tmp_path: Path) -> None:
    out_path = tmp_path / "x.parquet"
    code, out = run("record", "synthetic:5", "--set", "max_model_len=100000", "-o", out_path)
    assert code == 2 and "max_model_len 100000 needs" in out
    code, out = run("record", "synthetic:5", "--set", "no_such_key=1", "-o", out_path)
    assert code == 2 and "unknown config key 'no_such_key'" in out
    code, out = run("record", tmp_path / "missing.csv", "-o", out_path)
    assert code == 2 and "missing.csv" in out
    assert not out_path.exists()


def test_failed_record_keeps_existing_trace(small_trace: Path) -> None:
    before = small_trace.read_bytes()
    code, _ = run("record", "synthetic:5", "--set", "policy=lifo", "-o", small_trace)
    assert code == 2
    assert small_trace.read_bytes() == before
    assert not list(small_trace.parent.glob(".*.tmp"))


def test_invariants_listing() -> None:
    code, out = run("invariants")
    assert code == 0
    for inv in ("PREEMPT-ONLY-RUNNING", "NO-ADMIT-AFTER-PREEMPT", "BLOCK-CONSERVATION", "FCFS-VICTIM-TAIL"):
        assert inv in out


# -- regressions found by the adversarial review -----------------------------

def test_abort_in_arrival_step_is_not_a_state_continuity_violation(tmp_path: Path) -> None:
    """A request that arrives and is aborted before the same step starts left
    the checker expecting it in waiting (false STATE-CONTINUITY alarm)."""
    from harness.trace.recorder import record
    from reference.config import EngineConfig
    from workloads import synthetic

    path = tmp_path / "abort.parquet"
    summary = record(synthetic(9, seed=1, abort_fraction=1.0), EngineConfig(), path, seed=1)
    assert (summary.finished, summary.aborted, summary.stalled) == (6, 3, None)
    rows = pq.read_table(path, columns=["step", "kind", "request_id"],
                         filters=[("kind", "in", ["arrival", "abort"])]).to_pylist()
    arrived = {r["request_id"]: r["step"] for r in rows if r["kind"] == "arrival"}
    same_step = [r["request_id"] for r in rows
                 if r["kind"] == "abort" and arrived[r["request_id"]] == r["step"]]
    assert same_step == ["r000008"]
    code, report = run_json("replay", path)
    assert code == 0, report["violations"]
    assert report["aborted"] == 3


def test_prompt_of_exactly_max_model_len_is_rejected_not_stalled(tmp_path: Path) -> None:
    """vLLM 0.33.0's input processor refuses a prompt of exactly max_model_len
    tokens (no room for an output token); accepting it stalled the engine at
    max_model_len - 1 computed tokens forever."""
    path = tmp_path / "mml.parquet"
    code, out = run("record", "synthetic:50", "--set", "max_model_len=64",
                    "--set", "max_num_batched_tokens=32", "--set", "max_num_seqs=4", "-o", path)
    assert code == 0, out
    code, report = run_json("replay", path)
    assert code == 0, report
    rejects = pq.read_table(path, filters=[("kind", "=", "reject")]).to_pylist()
    assert sorted(len(r["prompt_token_ids"]) for r in rejects) == [64, 64]
    assert all("plus at least 1 output token" in r["message"] for r in rejects)


def test_replay_of_a_stalled_trace_matches_the_identical_stall(tmp_path: Path) -> None:
    """Chunked prefill off with a per-step budget below the prompt length is a
    config vLLM 0.33.0 accepts and that never admits the request: record
    writes the trace up to the stall, check reports LIVENESS, and replay sees
    the candidate stall at the same point (no divergence)."""
    path = tmp_path / "stall.parquet"
    code, out = run("record", "synthetic:5", "--set", "enable_chunked_prefill=false",
                    "--set", "max_model_len=64", "--set", "max_num_batched_tokens=64",
                    "--set", "max_num_seqs=4", "--set", "max_num_scheduled_tokens=8", "-o", path)
    assert code == 1 and "engine stalled" in out
    code, report = run_json("replay", path)
    assert code == 1
    assert report["divergence"] is None
    assert {v["invariant"] for v in report["violations"]} == {"LIVENESS"}  # budget 8 < every prompt, chunked prefill off: IDLE-ADMISSION exempt


@pytest.mark.parametrize("setting, fragment", [
    ("step_fixed_s=nan", "step_fixed_s must be a finite number"),
    ("step_per_token_s=inf", "step_per_token_s must be a finite number"),
    ("num_gpu_blocks=99999999999999", "above this harness's limit"),
    ("long_prefill_token_threshold=9000", "cannot be greater than max_model_len"),
])
def test_bad_numbers_in_config_exit_2(tmp_path: Path, setting: str, fragment: str) -> None:
    code, out = run("record", "synthetic:5", "--set", setting, "-o", tmp_path / "x.parquet")
    assert code == 2 and fragment in out, out


def _retag(src: Path, dst: Path, edit) -> None:
    """Copy a trace with edited metadata, keeping the footer summary."""
    pf = pq.ParquetFile(src)
    kv = dict(pf.metadata.metadata)
    meta = json.loads(kv[METADATA_KEY])
    kv[METADATA_KEY] = json.dumps(edit(meta))
    pq.write_table(pq.read_table(src).replace_schema_metadata(kv), dst)


def test_edited_config_without_new_fingerprint_exit_2(small_trace: Path, tmp_path: Path) -> None:
    path = tmp_path / "edited.parquet"
    _retag(small_trace, path, lambda m: {**m, "config": {**m["config"], "block_size": 0}})
    _assert_unusable(path, "bad config in metadata")
    _retag(small_trace, path, lambda m: {**m, "config": {**m["config"], "max_num_seqs": 5}})
    _assert_unusable(path, "does not match its fingerprint")


def test_metadata_that_is_not_an_object_exit_2(small_trace: Path, tmp_path: Path) -> None:
    path = tmp_path / "list.parquet"
    _retag(small_trace, path, lambda m: [1])
    _assert_unusable(path, "not a JSON object")


def test_zero_row_trace_is_incomplete(small_trace: Path, tmp_path: Path) -> None:
    pf = pq.ParquetFile(small_trace)
    path = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(small_trace).slice(0, 0).replace_schema_metadata(pf.metadata.metadata), path)
    _assert_unusable(path, "incomplete trace")


# -- feature presets on real input ---------------------------------------------

AZURE_SLICE = ["--limit", 100, "--time-scale", 30, "--set", "num_gpu_blocks=600",
               "--set", "max_num_seqs=64", "--set", "max_model_len=8192"]


@needs_data
def test_azure_async_deferred_frees_preset(tmp_path: Path) -> None:
    """Async scheduling + deferred frees on the Azure slice, requests ending
    on EOS: every finish happens with a step in flight, so every free is
    fenced and drained later."""
    path = tmp_path / "async.parquet"
    code, out = run("record", AZURE_CODE, *AZURE_SLICE, "--stop-on-eos", "--set", "async_scheduling=true",
                    "--set", "defer_block_free=true", "-o", path)
    assert code == 0, out
    code, report = run_json("replay", path)
    assert code == 0, report["violations"]
    assert (report["steps"], report["finished"], report["preemptions"]) == (836, 100, 1)
    kinds = pq.read_table(path, columns=["kind"]).column("kind").to_pylist()
    assert kinds.count("free_drain") == 100


@needs_data
def test_azure_spec_decode_preset(tmp_path: Path) -> None:
    path = tmp_path / "spec.parquet"
    code, out = run("record", AZURE_CODE, *AZURE_SLICE, "--set", "num_speculative_tokens=3", "-o", path)
    assert code == 0, out
    code, report = run_json("replay", path)
    assert code == 0, report["violations"]
    assert (report["steps"], report["draft_tokens"], report["rejected_draft_tokens"]) == (371, 2742, 1293)


def test_abort_of_every_running_request_in_an_inputs_only_step(tmp_path: Path) -> None:
    """Regression: when aborts leave nothing unfinished, the step has inputs
    only (no schedule part) and the checker kept the aborted requests in its
    idea of `running` (false STATE-CONTINUITY at the next step)."""
    from harness.trace.recorder import record
    from reference.config import EngineConfig
    from reference.workload import RequestSpec, Workload

    def req(i: int, t: float, abort: float | None) -> RequestSpec:
        return RequestSpec(f"r{i:06d}", t, tuple(range(10, 30)), max_tokens=40, abort_time=abort)

    workload = Workload("test", "0" * 64, {}, (req(0, 0.0, 0.02), req(1, 0.0, 0.02), req(2, 5.0, None)))
    config = EngineConfig(num_gpu_blocks=60, block_size=4, max_model_len=96, max_num_seqs=4,
                          max_num_batched_tokens=64)
    path = tmp_path / "aborts.parquet"
    record(workload, config, path)
    rows = pq.read_table(path, columns=["step", "kind"]).to_pylist()
    abort_step = next(r["step"] for r in rows if r["kind"] == "abort")
    assert [r["kind"] for r in rows if r["step"] == abort_step] == ["abort", "abort"]
    code, report = run_json("replay", path)
    assert code == 0, report["violations"]
    assert (report["aborted"], report["finished"]) == (2, 1)


def test_regression_mutants_scenario_accepts_library_scenarios() -> None:
    """A trial: ``mutants --mutant admit-one-per-step --scenario admit-all-that-fit``
    said "unknown scenario" with no hint, though docs/explanation/progress.md pairs
    them: the scenario is the library's (traces/scenarios/). Library names and
    scenario files are accepted; an unknown name says where it looked."""
    code, out = run("mutants", "--mutant", "admit-one-per-step", "--scenario", "admit-all-that-fit")
    assert (code, out.splitlines()[-1]) == (0, "1/1 mutants killed")
    path = Path(__file__).resolve().parents[1] / "traces" / "scenarios" / "admit-all-that-fit.toml"
    code, report = run_json("mutants", "--mutant", "admit-one-per-step", "--scenario", path)
    assert code == 0 and report["matrix"]["admit-one-per-step"]["cells"][str(path)]["target_hits"] == 3
    code, out = run("mutants", "--scenario", "admit-all-that-fi")
    assert (code, out) == (2, "error: Invalid value for --scenario: unknown scenario 'admit-all-that-fi'; "
                              "did you mean 'admit-all-that-fit'? (main mutants --help)\n")
    code, out = run("mutants", "--scenario", "zzzzz")
    library = Path(__file__).resolve().parents[1] / "traces" / "scenarios"
    try:
        shown = str(library.relative_to(Path.cwd())) + "/"
    except ValueError:
        shown = str(library) + "/"
    assert (code, out) == (2, "error: Invalid value for --scenario: unknown scenario 'zzzzz': not a scenario of "
                              f"harness/scenarios/ or of the library ({shown}), nor a .toml file "
                              "(main mutants --help)\n")


def test_regression_mutants_scenario_unexercised_survivors_are_na() -> None:
    """A trial: ``mutants --scenario preemption-heavy`` ended "21/52 mutants
    killed; survivors: ..." with exit 1, though the help called such survivors
    expected. A mutant whose trace is the reference's on the chosen scenario
    is n/a there; every exercised one is killed: exit 0."""
    code, out = run("mutants", "--scenario", "preemption-heavy")
    assert code == 0
    killed = ["admit-after-preempt", "preempt-head", "preempt-waiting", "leak-on-finish", "free-head-first",
              "free-unhashed-to-tail", "hit-evicted-block", "budget-overrun", "preempt-keeps-block",
              "reverse-running-order", "over-allocate", "reuse-held-block", "forget-finished-ids",
              "admission-preempts", "ignore-max-num-seqs", "no-stop-on-max-tokens", "crash-in-schedule",
              "skip-running-tail", "admit-one-per-step", "eager-preempt", "stop-after-preempt"]
    na = [name for name in MUTANTS if name not in killed]
    assert out.splitlines()[-2:] == [
        "n/a: not exercised by preemption-heavy (each run's trace is the reference's, row for row: no "
        "checker could tell it from a correct engine)",
        f"21/21 exercised mutants killed; 32 n/a: {', '.join(na)}"]
