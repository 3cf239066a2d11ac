"""Regression (trial): `harness vllm-env 0.33.0` on a built env printed "ready"
twice, `vllm-env: vLLM 0.33.0 env ready: DIR` on stderr and the verdict on
stdout. The verdict alone says it; the build's other progress lines stay on stderr."""

from __future__ import annotations

from click.testing import CliRunner

from harness.cli import main


def test_regression_vllm_env_said_ready_twice(monkeypatch) -> None:
    import harness.candidates.vllm.env as env

    def fake_ensure_env(version, *, log=None, force=False):
        log("installing vllm==0.33.0 ...")
        log(f"vLLM {version} env ready: /envs/{version}")
        return f"/envs/{version}/bin/python"

    monkeypatch.setattr(env, "ensure_env", fake_ensure_env)
    r = CliRunner().invoke(main, ["vllm-env", "0.33.0"])
    assert r.exit_code == 0
    assert r.stdout == "vLLM 0.33.0 env ready: /envs/0.33.0/bin/python\n"
    assert r.stderr == "vllm-env: installing vllm==0.33.0 ...\n"
