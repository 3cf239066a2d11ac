"""Every vLLM release from 0.10.0 (layered envs) and ``harness bisect`` (issue 14).

The ``vllm`` tests build vLLM 0.10.2 (older than 0.20: a layered env, about
1.5 minutes the first time: the shared torch + pins layer, then vLLM alone)
and use the 0.29.0 and 0.33.0 envs CI builds; ``HARNESS_SKIP_VLLM=1`` skips
them. The others need no vLLM (one asks PyPI, through pip, for a release that
does not exist).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.bisect.core import BisectError, BisectResult, Row, parse_versions, verdict_of
from harness.bisect.cli import verdict_line
from harness.candidates.vllm.env import VLLMEnvError, check_version
from harness.cli import main

REPO = Path(__file__).resolve().parent.parent
CLASSES = Path(__file__).resolve().parent / "vllm_classes"
SKIP = os.environ.get("HARNESS_SKIP_VLLM") == "1"
OLD = "0.10.2"

vllm = pytest.mark.vllm
needs_vllm = pytest.mark.skipif(SKIP, reason="HARNESS_SKIP_VLLM=1")


def _one_error_line(output: str) -> str:
    lines = [ln for ln in output.splitlines() if ln.strip() and not ln.startswith("vllm-env:")]
    assert len(lines) == 1, output
    return lines[0]


# -- no vLLM needed -----------------------------------------------------------

def test_every_v1_release_is_a_version_four_part_ones_too():
    for version in ("0.10.0", "0.10.1.1", "0.14.1", "0.33.0"):
        assert check_version(version) == version
    with pytest.raises(VLLMEnvError, match="predates 0.10.0, the first release whose engine core is v1"):
        check_version("0.9.2")
    with pytest.raises(VLLMEnvError, match="newer than the 0.33 series"):
        check_version("0.34.0")
    with pytest.raises(VLLMEnvError, match="bad vLLM version '0.10.1.1.1'"):
        check_version("0.10.1.1.1")


def test_version_ranges_select_known_releases():
    assert parse_versions("0.10.0..0.11.0") == ["0.10.0", "0.10.1", "0.10.1.1", "0.10.2", "0.11.0"]
    assert parse_versions("0.33.0, 0.10.1.1,0.20.2") == ["0.10.1.1", "0.20.2", "0.33.0"]
    assert len(parse_versions("0.10.0..0.33.0")) == 39
    with pytest.raises(BisectError, match="0.20.2 is newer than 0.10.0"):
        parse_versions("0.20.2..0.10.0")
    with pytest.raises(BisectError, match="names 1 release"):
        parse_versions("0.33.0")


def _row(version, verdict="clean", same=True, prev=None, status="ran", step=None) -> Row:
    return Row(version, status, verdict=verdict, same_as_previous=None if prev is None else same,
               compared_with=prev, divergence=None if same else {"step": step})


def test_first_change_is_a_verdict_or_a_decision_change_skipping_refusals():
    rows = [_row("0.10.0"), _row("0.10.2", status="refused", prev=None),
            _row("0.11.0", prev="0.10.0"), _row("0.12.0", same=False, prev="0.11.0", step=7),
            _row("0.17.1", verdict="MAX-NUM-SEQS ×2", prev="0.12.0")]
    result = BisectResult("x.toml", None, rows)
    assert result.first_change.version == "0.12.0"
    assert verdict_line(result) == ("4 of 5 releases ran: first change at 0.12.0 (since 0.11.0): "
                                    "decisions diverge at step 7")
    assert result.to_dict()["first_change"] == {"version": "0.12.0", "previous": "0.11.0",
                                                "verdict_changed": False, "decisions_changed": True}
    same = BisectResult("x.toml", None, [_row("0.29.0"), _row("0.33.0", prev="0.29.0")])
    assert same.first_change is None
    assert verdict_line(same) == "2 of 2 releases ran: no change from 0.29.0 to 0.33.0 (clean)"
    assert verdict_of({"B": 1, "A": 1, "C": 3}) == "C ×3, A ×1, B ×1"
    # Regression (a new user's trial): one release ran, and the line read
    # "no change from 0.33.0 to 0.33.0" (exit 0).
    one = BisectResult("x.toml", None, [_row("0.12.0", status="refused"), _row("0.33.0", verdict="ENGINE-CRASH ×1")])
    assert verdict_line(one) == "1 of 2 releases ran: only 0.33.0 (ENGINE-CRASH ×1), nothing to compare it with"


def test_release_missing_on_pypi_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_VLLM_ENVS", str(tmp_path))
    result = CliRunner().invoke(main, ["vllm-env", "0.10.3"])
    assert result.exit_code == 2
    assert _one_error_line(result.output) == (
        f"error: downloading vllm==0.10.3 failed: PyPI has no vllm==0.10.3 "
        f"(full log: {tmp_path / '0.10.3.build.log'})")
    assert not (tmp_path / "0.10.3").exists() and not list(tmp_path.glob(".tmp-*"))
    assert not list((tmp_path / ".wheels").iterdir())


def test_no_disk_space_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_VLLM_ENVS", str(tmp_path))
    monkeypatch.setenv("HARNESS_VLLM_MIN_FREE_GB", "1e9")
    result = CliRunner().invoke(main, ["vllm-env", OLD])
    assert result.exit_code == 2
    line = _one_error_line(result.output)
    assert line.startswith(f"error: no space left for a vLLM env under {tmp_path}: ")
    assert line.endswith(" GB free, a build needs 1000000000.0 GB (HARNESS_VLLM_MIN_FREE_GB)")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{OLD}.lock"]


def test_bisect_refuses_a_bad_range():
    result = CliRunner().invoke(main, ["bisect", str(REPO / "harness/scenarios/fcfs-roomy.toml"),
                                       "--versions", "0.9.0..0.33.0"])
    assert result.exit_code == 2
    assert _one_error_line(result.output) == (
        "error: --versions 0.9.0..0.33.0: vLLM 0.9.0 is not supported: it predates 0.10.0, "
        "the first release whose engine core is v1 only")


# -- vLLM ----------------------------------------------------------------------

#: What vLLM 0.10.2 makes of the goldens (golden check): the configs it cannot
#: express are refused per option; every golden it runs first differs in
#: schedule_end.prefill_capacity_bound (0.10.2 has no prefill cadence, so no
#: capacity guard), except async-spec-decode, whose first difference is a block.
OLD_SKIPS = {
    "scheduler_reserve_full_isl": ["chunked-threshold", "dp2-throttle", "eos-stop-abort",
                                   "fcfs-roomy", "fcfs-tight", "kv-connector", "no-chunked-prefill",
                                   "pipeline-3", "prefill-cadence", "prefix-sharing"],
    "deferred block frees": ["deferred-frees"],
    "no vLLM mapping": ["encoder-inputs"],
}
OLD_DIVERGENCES = {
    "priority-tight": (2, "prefill_capacity_bound"), "no-prefix-caching": (9, "prefill_capacity_bound"),
    "preemption-heavy": (2, "prefill_capacity_bound"), "spec-decode": (3, "prefill_capacity_bound"),
    "spec-decode-priority": (3, "prefill_capacity_bound"), "async-tight": (2, "prefill_capacity_bound"),
    "async-pipeline-3": (2, "prefill_capacity_bound"), "async-spec-decode": (1, "block_ids"),
}


@pytest.fixture(scope="module")
def old_env():
    from harness.candidates.vllm.env import ensure_env

    return ensure_env(OLD, log=lambda line: print(f"vllm-env: {line}", file=sys.stderr))


@vllm
@needs_vllm
def test_release_older_than_0_20_drives_the_goldens_it_can_express(old_env):
    from harness.candidates.resolve import resolve_candidate
    from harness.golden import DEFAULT_DIR, check_goldens

    marker = json.loads((old_env.parent.parent / ".harness-env.json").read_text())
    assert (marker["version"], marker["layout"], marker["torch"]) == (OLD, "layered", "2.13.0")
    results = {r.scenario: r for r in check_goldens(DEFAULT_DIR, resolve_candidate(f"vllm@{OLD}"))}
    skipped = {name for name, r in results.items() if r.skipped}
    assert skipped == {n for names in OLD_SKIPS.values() for n in names}
    for needle, names in OLD_SKIPS.items():
        for name in names:
            assert needle in results[name].skipped, (name, results[name].skipped)
    diverged = {name: (r.divergence.step, r.divergence.field) for name, r in results.items()
                if r.divergence is not None}
    assert diverged == OLD_DIVERGENCES


@vllm
@needs_vllm
def test_bisect_over_two_releases_with_a_scheduler_class(tmp_path, monkeypatch):
    """HigherSeqCapScheduler on 0.29.0 and 0.33.0: the same violations on both,
    and (fcfs-roomy, no preemption) the same decisions: no change, exit 0."""
    from harness.candidates.vllm.env import ensure_env

    for version in ("0.29.0", "0.33.0"):
        ensure_env(version)
    monkeypatch.setenv("PYTHONPATH", str(CLASSES))
    result = CliRunner().invoke(main, ["bisect", str(REPO / "harness/scenarios/fcfs-roomy.toml"),
                                       "--versions", "0.29.0,0.33.0", "--json",
                                       "--candidate-class", "custom_schedulers.HigherSeqCapScheduler"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["scheduler_cls"] == "custom_schedulers:HigherSeqCapScheduler"
    assert [(r["version"], r["status"], r["verdict"], r["profile"], r["steps"], r["same_as_previous"])
            for r in payload["rows"]] == [
        ("0.29.0", "ran", "MAX-NUM-SEQS ×6", "0.29.0", 371, None),
        ("0.33.0", "ran", "MAX-NUM-SEQS ×6", "0.33.0", 371, True)]
    assert payload["first_change"] is None


@vllm
@needs_vllm
def test_inline_preemption_before_0_12_is_observed(old_env, tmp_path):
    """0.10.2 has no _preempt_request: its preemptions (the free of a RUNNING
    request inside schedule()) are recorded, and every safety invariant holds."""
    out = tmp_path / "old.parquet"
    result = CliRunner().invoke(main, ["record", str(REPO / "harness/scenarios/no-prefix-caching.toml"),
                                       "-o", str(out), "--engine", f"vllm@{OLD}"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["check", str(out), "--json"])
    payload = json.loads(result.output)
    assert result.exit_code == 0, result.output
    assert (payload["steps"], payload["preemptions"], payload["profile"]) == (256, 5, "safety")
    assert payload["profile_reason"] == f"recorded by vLLM {OLD}: no semantics profile was measured for it"
