"""Golden traces (golden/, harness/golden.py, ``harness golden check|update``).

The committed goldens must pass ``golden check``; each scenario's numbers are
pinned here, so a change of the reference's decisions shows up twice: as a
divergence in ``golden check`` and as a changed number below (regenerate with
``harness golden update`` and update the table in the same change).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import reference
from harness.cli import main
from harness.golden import MANIFEST_NAME, check_goldens, manifest_text, update_goldens
from harness.scenarios import SCENARIOS
from harness.candidates.mutants import MUTANTS

GOLDEN = Path(__file__).resolve().parents[1] / "golden"

# scenario: (steps, requests, finished, preemptions, prefix_hit_tokens), as recorded.
EXPECTED = {
    "fcfs-tight": (392, 60, 60, 1, 60),
    "fcfs-roomy": (372, 60, 60, 0, 0),
    "priority-tight": (221, 60, 60, 16, 140),
    "prefix-sharing": (231, 40, 40, 0, 608),
    "no-prefix-caching": (256, 40, 40, 5, 0),
    "chunked-threshold": (183, 30, 30, 0, 0),
    "no-chunked-prefill": (166, 30, 30, 0, 0),
    "eos-stop-abort": (111, 40, 38, 0, 0),
    "preemption-heavy": (230, 60, 60, 18, 436),
    "spec-decode": (127, 40, 40, 5, 176),
    "spec-decode-priority": (134, 40, 40, 8, 188),
    "async-tight": (212, 50, 50, 8, 196),
    "pipeline-3": (530, 40, 40, 4, 80),
    "async-pipeline-3": (183, 40, 40, 15, 88),
    "deferred-frees": (213, 50, 47, 3, 104),
    "prefill-cadence": (193, 40, 40, 0, 0),
    "dp2-throttle": (210, 60, 60, 2, 44),
    "kv-connector": (74, 40, 25, 1, 184),
    "encoder-inputs": (485, 60, 60, 105, 872),
    "async-spec-decode": (176, 50, 50, 14, 264),
}


def run(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def lines_by_scenario(out: str) -> dict[str, str]:
    """``{scenario: line}`` from ``golden check`` / ``golden update`` output."""
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("ok", "FAIL", "new", "unchanged", "changed",
                                            "removed", "unused", "refused"):
            found[parts[1]] = line
    return found


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    target = tmp_path / "golden"
    shutil.copytree(GOLDEN, target)
    return target


def manifest(directory: Path) -> dict:
    return json.loads((directory / MANIFEST_NAME).read_text())


def write_manifest(directory: Path, doc: dict) -> None:
    (directory / MANIFEST_NAME).write_text(json.dumps(doc, sort_keys=True, indent=2) + "\n")


# ---------------------------------------------------------------- committed goldens

def test_committed_goldens_pass_check() -> None:
    code, out = run("golden", "check", "--dir", GOLDEN)
    assert code == 0, out
    lines = lines_by_scenario(out)
    assert set(lines) == set(SCENARIOS)
    assert all(line.startswith("ok") for line in lines.values()), out
    assert f"{len(SCENARIOS)} ok, 0 failed" in out


def test_check_prints_each_golden_as_it_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (new-user trial): with stdout not a terminal (a CI log; the bar shows on a
    terminal only) ``golden check`` printed nothing for minutes, then every golden's line at once.
    Each line now comes as that golden is checked, in scenario order, padded to a width known
    before the first (an unused golden's longer name counts; its line comes after the scenarios');
    the verdict stays the last line."""
    import sys

    import harness.golden as golden_module

    hybrid = tmp_path / "hybrid"
    shutil.copytree(GOLDEN / "hybrid", hybrid)
    shutil.copy(hybrid / "hybrid-mamba.parquet", hybrid / "hybrid-retired-longer.parquet")
    seen: list[str] = []  # stdout so far, each time a golden's check has returned
    original = golden_module.check_goldens

    def spy(*args, on_result, **kwargs):
        def observed(result) -> None:
            on_result(result)
            sys.stdout.flush()
            seen.append(sys.stdout.buffer.getvalue().decode())
        return original(*args, on_result=observed, **kwargs)

    monkeypatch.setattr(golden_module, "check_goldens", spy)
    code, out = run("golden", "check", "--hybrid", "--dir", hybrid)
    assert code == 1, out
    lines = [
        "ok   hybrid-alternating     192 steps, 192 replayed identically",
        "ok   hybrid-five-to-one     244 steps, 244 replayed identically",
        "ok   hybrid-mamba           153 steps, 153 replayed identically",
        "FAIL hybrid-retired-longer  unused golden (file): no scenario named 'hybrid-retired-longer'; remove "
        "with 'harness golden update --prune'",
        f"3 ok, 1 failed ({hybrid}, candidate reference)"]
    assert seen == ["\n".join(lines[:1]) + "\n", "\n".join(lines[:2]) + "\n", "\n".join(lines[:3]) + "\n"]
    assert out.splitlines() == lines


def test_committed_folder_holds_exactly_the_scenarios() -> None:
    names = sorted(p.name for p in GOLDEN.iterdir())
    # README.md: the folder's paragraph (tests/test_layout.py requires one); nothing else but goldens
    # and hybrid/, the hybrid models' goldens (tests/test_hybrid_trace.py).
    assert names == sorted([MANIFEST_NAME, "README.md", "hybrid"] + [f"{s}.parquet" for s in SCENARIOS])
    assert set(EXPECTED) == set(SCENARIOS)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_manifest_entry_pinned(name: str) -> None:
    entry = manifest(GOLDEN)["scenarios"][name]
    steps, requests, finished, preemptions, prefix_hit_tokens = EXPECTED[name]
    assert (entry["steps"], entry["requests"], entry["finished"], entry["preemptions"],
            entry["prefix_hit_tokens"]) == (steps, requests, finished, preemptions, prefix_hit_tokens)
    scenario = SCENARIOS[name]
    assert entry["file"] == f"{name}.parquet"
    assert entry["description"] == scenario.description
    assert entry["config_fingerprint"] == scenario.engine_config().fingerprint()
    assert entry["engine"] == "reference"
    assert entry["engine_version"] == reference.__version__
    assert entry["sha256"] == hashlib.sha256((GOLDEN / entry["file"]).read_bytes()).hexdigest()


def test_manifest_is_canonical_json() -> None:
    text = (GOLDEN / MANIFEST_NAME).read_text()
    doc = json.loads(text)
    assert doc["manifest_version"] == 1
    assert text == manifest_text(doc["scenarios"])
    assert text == json.dumps(doc, sort_keys=True, indent=2) + "\n"


# ---------------------------------------------------------------- check failures

def test_missing_golden_fails(copy: Path) -> None:
    (copy / "fcfs-roomy.parquet").unlink()
    code, out = run("golden", "check", "--dir", copy)
    assert code == 1, out
    lines = lines_by_scenario(out)
    assert lines["fcfs-roomy"].startswith("FAIL")
    assert "missing golden fcfs-roomy.parquet" in lines["fcfs-roomy"]
    assert sum(line.startswith("ok") for line in lines.values()) == len(SCENARIOS) - 1
    assert f"{len(SCENARIOS) - 1} ok, 1 failed" in out


def test_missing_manifest_entry_fails(copy: Path) -> None:
    doc = manifest(copy)
    del doc["scenarios"]["eos-stop-abort"]
    write_manifest(copy, doc)
    results = {r.scenario: r for r in check_goldens(copy)}
    assert not results["eos-stop-abort"].ok
    assert results["eos-stop-abort"].reason == "no manifest entry for eos-stop-abort.parquet"


def test_unused_file_and_entry_fail(copy: Path) -> None:
    shutil.copy(copy / "fcfs-roomy.parquet", copy / "retired.parquet")
    doc = manifest(copy)
    doc["scenarios"]["gone"] = dict(doc["scenarios"]["fcfs-roomy"], file="gone.parquet")
    write_manifest(copy, doc)
    code, out = run("golden", "check", "--dir", copy)
    assert code == 1, out
    lines = lines_by_scenario(out)
    assert lines["retired"].startswith("FAIL") and "unused golden (file)" in lines["retired"]
    assert lines["gone"].startswith("FAIL") and "unused golden (manifest entry)" in lines["gone"]
    assert all(lines[name].startswith("ok") for name in SCENARIOS)


def test_tampered_golden_fails(copy: Path) -> None:
    path = copy / "prefix-sharing.parquet"
    path.write_bytes(path.read_bytes() + b"\0")
    code, out = run("golden", "check", "--dir", copy)
    assert code == 1, out
    line = lines_by_scenario(out)["prefix-sharing"]
    assert line.startswith("FAIL") and "sha256 mismatch" in line


def test_tampered_golden_that_still_reads_fails(copy: Path) -> None:
    # A valid trace, but not the one the manifest pins (another scenario's recording).
    shutil.copy(copy / "fcfs-roomy.parquet", copy / "fcfs-tight.parquet")
    results = {r.scenario: r for r in check_goldens(copy)}
    reason = results["fcfs-tight"].reason
    assert "sha256 mismatch" in reason
    assert "(file -> scenario: num_gpu_blocks 200 -> 30)" in reason
    assert "manifest counts differ: steps 392 in manifest, 372 in file" in reason


def test_stale_scenario_config_fails(copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = SCENARIOS["fcfs-tight"]
    monkeypatch.setitem(SCENARIOS, "fcfs-tight",
                        dataclasses.replace(old, config={**old.config, "num_gpu_blocks": 32}))
    code, out = run("golden", "check", "--dir", copy)
    assert code == 1, out
    lines = lines_by_scenario(out)
    assert lines["fcfs-tight"].startswith("FAIL")
    assert "stale: config changed (num_gpu_blocks 30 -> 32)" in lines["fcfs-tight"]
    assert all(lines[n].startswith("ok") for n in SCENARIOS if n != "fcfs-tight")


def test_stale_manifest_fingerprint_fails(copy: Path) -> None:
    doc = manifest(copy)
    doc["scenarios"]["no-prefix-caching"]["config_fingerprint"] = "0" * 64
    write_manifest(copy, doc)
    results = {r.scenario: r for r in check_goldens(copy)}
    reason = results["no-prefix-caching"].reason
    assert reason.startswith("stale: config changed (manifest fingerprint 000000000000 vs current ")
    assert "differs from the manifest's 000000000000 (file -> scenario: same as the scenario's)" \
        in reason
    assert sum(r.ok for r in results.values()) == len(SCENARIOS) - 1


def test_stale_scenario_workload_fails(copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = SCENARIOS["chunked-threshold"]
    monkeypatch.setitem(SCENARIOS, "chunked-threshold",
                        dataclasses.replace(old, workload={"num_requests": 31}))
    results = {r.scenario: r for r in check_goldens(copy)}
    assert "stale: workload changed (num_requests 30 -> 31)" in results["chunked-threshold"].reason


def test_mutant_candidate_diverges_on_fcfs_tight() -> None:
    code, out = run("golden", "check", "--dir", GOLDEN, "--candidate", "mutant:preempt-head")
    assert code == 1, out
    line = lines_by_scenario(out)["fcfs-tight"]
    assert line.startswith("FAIL") and "candidate diverges at step 148" in line
    results = {r.scenario: r for r in check_goldens(GOLDEN, MUTANTS["preempt-head"])}
    d = results["fcfs-tight"].divergence
    assert d is not None
    assert (d.step, d.request, d.kind, d.field) == (148, "r000025", "preempt", "event")
    assert results["fcfs-roomy"].ok  # no preemption there: the mutant's bug never runs


def test_unusable_folder_or_manifest_exits_2(tmp_path: Path, copy: Path) -> None:
    code, out = run("golden", "check", "--dir", tmp_path / "nope")
    assert code == 2, out
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out = run("golden", "check", "--dir", empty)
    assert code == 2 and "no manifest" in out
    (copy / MANIFEST_NAME).write_text("{ not json")
    code, out = run("golden", "check", "--dir", copy)
    assert code == 2 and "not valid JSON" in out
    write_manifest(copy, {"manifest_version": 1, "scenarios": {"fcfs-tight": {"file": "x"}}})
    code, out = run("golden", "check", "--dir", copy)
    assert code == 2 and "entry 'fcfs-tight' lacks" in out


# ---------------------------------------------------------------- update

def test_update_into_empty_dir_then_unchanged(tmp_path: Path) -> None:
    target = tmp_path / "fresh"
    code, out = run("golden", "update", "--dir", target)
    assert code == 0, out
    lines = lines_by_scenario(out)
    assert set(lines) == set(SCENARIOS)
    assert all(line.startswith("new") for line in lines.values()), out
    # "1 preemption", not "1 preemptions" (issue 27).
    assert "392 steps, 60 requests, 60 finished, 1 preemption, 60 prefix-hit tokens" \
        in lines["fcfs-tight"]
    assert sorted(p.name for p in target.iterdir()) == \
        sorted([MANIFEST_NAME] + [f"{s}.parquet" for s in SCENARIOS])  # no temp files left
    # Same decisions as the committed goldens (bytes may differ with another pyarrow).
    fresh, committed = manifest(target)["scenarios"], manifest(GOLDEN)["scenarios"]
    strip = lambda e: {k: v for k, v in e.items() if k != "sha256"}  # noqa: E731
    assert {k: strip(v) for k, v in fresh.items()} == {k: strip(v) for k, v in committed.items()}

    before = digests(target)
    mtimes = {p.name: p.stat().st_mtime_ns for p in target.iterdir()}
    code, out = run("golden", "update", "--dir", target)
    assert code == 0, out
    lines = lines_by_scenario(out)
    assert all(line.startswith("unchanged") for line in lines.values()), out
    assert digests(target) == before
    assert {p.name: p.stat().st_mtime_ns for p in target.iterdir()} == mtimes
    assert all(r.ok for r in check_goldens(target))


def test_update_reports_changes(copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = SCENARIOS["fcfs-tight"]
    monkeypatch.setitem(SCENARIOS, "fcfs-tight",
                        dataclasses.replace(old, config={**old.config, "num_gpu_blocks": 200}))
    before = digests(copy)
    changes = update_goldens(copy, ["fcfs-tight"])
    assert [(c.scenario, c.status) for c in changes] == [("fcfs-tight", "changed")]
    details = changes[0].details
    # fcfs-tight on fcfs-roomy's pool records exactly fcfs-roomy's run.
    assert "steps 392 -> 372" in details
    assert "preemptions 1 -> 0" in details
    assert "prefix_hit_tokens 60 -> 0" in details
    assert "config: num_gpu_blocks 30 -> 200" in details
    assert changes[0].first_divergence is not None
    assert any(d.startswith(f"first divergent step vs the old golden: step "
                            f"{changes[0].first_divergence.step},") for d in details)
    after = digests(copy)
    assert {k for k in after if after[k] != before[k]} == {"fcfs-tight.parquet", MANIFEST_NAME}
    assert all(r.ok for r in check_goldens(copy))


def test_update_prunes_only_when_asked(copy: Path) -> None:
    shutil.copy(copy / "fcfs-roomy.parquet", copy / "retired.parquet")
    listed = manifest(copy)  # a golden this harness wrote, for a scenario since removed
    listed["scenarios"]["retired"] = {**listed["scenarios"]["fcfs-roomy"], "file": "retired.parquet"}
    (copy / MANIFEST_NAME).write_text(json.dumps(listed, indent=2, sort_keys=True) + "\n")
    code, out = run("golden", "update", "--dir", copy, "--scenario", "fcfs-roomy")
    assert code == 0, out
    lines = lines_by_scenario(out)
    assert lines["fcfs-roomy"].startswith("unchanged")
    assert lines["retired"].startswith("unused")
    assert (copy / "retired.parquet").exists()
    code, out = run("golden", "update", "--dir", copy, "--scenario", "fcfs-roomy", "--prune")
    assert code == 0, out
    assert lines_by_scenario(out)["retired"].startswith("removed")
    assert not (copy / "retired.parquet").exists()
    assert all(r.ok for r in check_goldens(copy))


def test_regression_prune_removed_a_users_own_parquet_files(copy: Path) -> None:
    """--prune removed every *.parquet for no scenario, a user's own traces
    in the folder included; only goldens the manifest lists go."""
    shutil.copy(copy / "fcfs-roomy.parquet", copy / "mine.parquet")
    code, out = run("golden", "update", "--dir", copy, "--scenario", "fcfs-roomy", "--prune")
    assert code == 0, out
    assert lines_by_scenario(out)["mine"].startswith("unused")
    assert "not in the manifest (no golden this harness wrote): kept, --prune or not" in out
    assert (copy / "mine.parquet").read_bytes() == (copy / "fcfs-roomy.parquet").read_bytes()


def test_update_rejects_unknown_scenario_and_bad_partial_manifest(copy: Path) -> None:
    code, out = run("golden", "update", "--dir", copy, "--scenario", "nope")
    assert code == 2 and "unknown scenario 'nope' (harness/scenarios/ holds them)" in out
    (copy / MANIFEST_NAME).write_text("[")
    code, out = run("golden", "update", "--dir", copy, "--scenario", "fcfs-tight")
    assert code == 2 and "without --scenario" in out
    code, out = run("golden", "update", "--dir", copy)  # a full update rebuilds it
    assert code == 0, out
    assert json.loads((copy / MANIFEST_NAME).read_text())["scenarios"].keys() == SCENARIOS.keys()
    assert all(r.ok for r in check_goldens(copy))
