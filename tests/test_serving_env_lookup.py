"""Regression (a new user's trial): with ``HARNESS_VLLM_ENVS=A:B`` the serving
env was looked for only in A, though the release envs are searched in every
folder; one built in B was "not built"."""

from __future__ import annotations

import json

from harness.serve import env as serve_env


def _fake_build(folder) -> None:
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").write_text("")
    (folder / serve_env.MARKER).write_text(json.dumps({"version": serve_env.SERVING_VERSION,
                                                       "pins_sha256": serve_env._pins_sha256()}))


def test_regression_serving_env_found_in_any_envs_folder(tmp_path, monkeypatch) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    monkeypatch.delenv(serve_env.ENV_OVERRIDE, raising=False)
    monkeypatch.setenv("HARNESS_VLLM_ENVS", f"{a}:{b}")
    name = f"serving-{serve_env.SERVING_VERSION}"
    assert serve_env.serving_env_dir() == a / name and not serve_env.serving_env_ready()
    _fake_build(b / name)
    assert serve_env.serving_env_dir() == b / name and serve_env.serving_env_ready()
    _fake_build(a / name)
    assert serve_env.serving_env_dir() == a / name  # the first folder wins
