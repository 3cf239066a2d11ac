"""``make test``'s first step (tests/prepare_envs.py, issue 27): one line per
vLLM environment, built before pytest, "ready" when built, and the fast tier
named when a first run must build them. Nothing is built here: fake envs."""

from __future__ import annotations

import io
from pathlib import Path


from tests.prepare_envs import ENVS, Env, prepare


class _Fake(Env):
    def ready(self) -> bool:
        return self.version == "ready"

    def where(self) -> Path:
        return Path("/envs") / str(self.version)

    def build(self, log) -> None:
        if self.version == "broken":
            from harness.candidates.vllm.env import VLLMEnvError

            raise VLLMEnvError("installing vllm==9.9.9 failed: PyPI has no vllm==9.9.9 (full log: x.log)")
        log("creating venv ...")
        log("creating venv: done in 0 s")


def test_skip_vllm_builds_nothing_and_says_why(monkeypatch) -> None:
    monkeypatch.setenv("HARNESS_SKIP_VLLM", "1")
    monkeypatch.setenv("HARNESS_SKIP_VLLM_REASON", "CI: only 3 GiB free on disk")
    out = io.StringIO()
    assert prepare(out, envs=(_Fake("x", "new", "1 min"),)) == 0
    assert out.getvalue() == ("vLLM environments: not built (CI: only 3 GiB free on disk): every vllm-marked "
                              "test is skipped\n")


def test_one_line_per_env_ready_or_built_with_elapsed_and_typical_time(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("HARNESS_SKIP_VLLM", raising=False)
    monkeypatch.setenv("HARNESS_VLLM_ENVS", str(tmp_path))
    out = io.StringIO()  # not a terminal: a line per stage
    assert prepare(out, envs=(_Fake("vLLM A env", "ready", "1 min"), _Fake("vLLM B env", "new", "2-3 min"))) == 0
    assert out.getvalue().splitlines() == [
        # Regression (new-user trial): one missing env was announced with all four's "3-4 GB ... 15 min".
        f"make test: the first run builds 1 vLLM environment (new; about 1 GB each under {tmp_path}) before the "
        "tests: typically 2-3 min on an idle 2-core machine, much longer on a loaded one; later runs reuse them. "
        "The fast tier skips every vLLM test: HARNESS_SKIP_VLLM=1 make test",
        "[1/2] vLLM A env: ready (/envs/ready)",
        "[2/2] vLLM B env: starting (0:00 elapsed, typically 2-3 min)",
        "[2/2] vLLM B env: creating venv (0:00 elapsed, typically 2-3 min)",
        "[2/2] vLLM B env: creating venv: done in 0 s (0:00 elapsed, typically 2-3 min)",
        "[2/2] vLLM B env: built in 0:00 (/envs/new)",
    ]


def test_a_failed_build_stops_with_one_line(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("HARNESS_SKIP_VLLM", raising=False)
    monkeypatch.setenv("HARNESS_VLLM_ENVS", str(tmp_path))
    out = io.StringIO()
    assert prepare(out, envs=(_Fake("vLLM Z env", "broken", "1 min"), _Fake("never", "new", "1 min"))) == 2
    assert out.getvalue().splitlines()[-2:] == [
        "[1/2] vLLM Z env: FAILED after 0:00",
        "error: vLLM Z env: installing vllm==9.9.9 failed: PyPI has no vllm==9.9.9 (full log: x.log)"]


def test_the_list_holds_every_release_the_vllm_tests_build() -> None:
    from tests import test_semantics_versions, test_vllm_releases

    releases = [e.version for e in ENVS if e.version is not None]
    # test_semantics_versions.OPTIONAL: releases it checks only where their env exists (not built here).
    built = set(test_semantics_versions.VERSIONS) - test_semantics_versions.OPTIONAL
    assert built | {test_vllm_releases.OLD, "0.33.0"} == set(releases)
    assert not test_semantics_versions.OPTIONAL & set(releases)
    assert [e.version for e in ENVS if e.version is None] == [None]  # the serving env (tests/test_serve.py)
