"""Regression (adversarial trial, finding 3): PREFIX-HIT-RULES (safety) took a
block to hold a request's prefix only if the checker's model had registered it
at one of vLLM 0.33.0's moments (allocation, or update-time caching of a
request still running once the block's tokens are out of flight). A correct
fork that registers blocks only after the step's output
(``tests/forks/cache_after_output.py``) registers, on golden async-tight, the
last block of r000010 (its own tokens 36-39, KV scheduled at steps 38-40)
before step 41 preempts it; at step 42 r000010 resumes with a 40-token hit on
it, and the fork gate reported ``hit block 6 (#9) does not hold this request's
prefix block``. What a hit block holds is safety; when the engine registers it
is the version's design: the hit is now accepted under the fork gate, vLLM's
timing is PREFIX-HIT-LONGEST's (semantics), and a hit on a block reallocated
since (mutant hit-evicted-block) still fails PREFIX-HIT-RULES under the fork
gate."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from harness.cli import main

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _own_run(make, golden: str, semantics: str):
    from harness.check.profiles import resolve
    from harness.replay import own_run
    from harness.trace import open_trace

    trace = open_trace(GOLDEN / f"{golden}.parquet")
    profile, _ = resolve(semantics, trace.meta)
    return own_run(trace, make, profile).result


def test_regression_a_fork_caching_after_the_output_passes_the_fork_gate(monkeypatch) -> None:
    from forks import put_on_path

    put_on_path(monkeypatch)
    out = CliRunner().invoke(main, ["replay", str(GOLDEN / "async-tight.parquet"), "--candidate",
                                    "forks.cache_after_output:make", "--semantics", "fork"])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines()[-1] == ("conformant (profile fork); decisions differ from step 42 "
                                           "(information: not held to a version's design)")
    assert "PREFIX-HIT-RULES" not in out.output


def test_regression_vllm_registration_timing_stays_a_semantics_rule(monkeypatch) -> None:
    from forks import put_on_path
    from forks.cache_after_output import make

    put_on_path(monkeypatch)
    result = _own_run(make, "async-tight", "0.33.0")
    assert result.by_invariant == {"PREFIX-HIT-LONGEST": 1}
    (v,) = result.violations
    assert (v.step, v.request, v.message) == (42, "r000010", "hit of 40 tokens but 36 tokens of its prefix are cached")


def test_regression_a_hit_on_a_reallocated_block_still_fails_the_fork_gate() -> None:
    from harness.candidates.mutants import MUTANTS_AND_TARGETS

    result = _own_run(MUTANTS_AND_TARGETS["hit-evicted-block"][0], "preemption-heavy", "fork")
    assert result.by_invariant == {"PREFIX-HIT-RULES": 1}
    (v,) = result.violations
    assert (v.step, v.request, v.message) == (11, "r000002", "hit block 26 (#7) does not hold this request's prefix block")
