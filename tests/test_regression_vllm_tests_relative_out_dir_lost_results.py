"""Regression (new-user trial): ``harness vllm-tests 0.33.0 --files ... -o out/vt``, the
documented example, ended on "error: pytest in the 0.33.0 env exited 0 with no results" although
both tests passed: pytest runs in the sdist's folder, so the relative ``--junitxml=out/vt/plain.xml``
(and the recordings folder) were written under the shared vLLM env root and the harness, in its own
folder, found no JUnit file. ``-o`` is made absolute before any run."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from harness.candidates.vllm import own_tests
from harness.cli import main


def test_regression_vllm_tests_relative_out_dir_lost_results(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "sdist"
    (root / "tests" / "v1" / "core").mkdir(parents=True)
    (root / "tests" / "v1" / "core" / "test_async_scheduler.py").write_text("")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    seen: list[tuple[Path | None, Path]] = []

    def fake_run(version, root_, files, k, record_dir, junit, log=None, label=""):
        seen.append((record_dir, junit))
        raise own_tests.OwnTestsError("stop here")

    monkeypatch.setattr(own_tests, "prepare", lambda version, log=None: root)
    monkeypatch.setattr(own_tests, "run_pytest", fake_run)
    r = CliRunner().invoke(main, ["vllm-tests", "0.33.0", "--files", "tests/v1/core/test_async_scheduler.py",
                                  "-o", "out/vt"])
    assert r.exit_code == 2, r.output
    assert seen == [(None, work / "out" / "vt" / "plain.xml")]
