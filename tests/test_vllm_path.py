"""``vllm@PATH``: the vLLM a given interpreter (or venv) imports (issue 14).

The tests marked ``vllm`` need vLLM 0.33.0's CPU venv (built by the fixture
when missing; ``HARNESS_SKIP_VLLM=1`` skips them). ``checkout`` builds a
stand-in for a developer's git checkout without copying vLLM: a venv whose
``.pth`` puts a git repository first on ``sys.path``, holding vLLM 0.33.0's
package as hard links (one file, ``vllm/__init__.py``, a real copy, tracked
and committed), then the 0.33.0 env's site-packages for the dependencies and
vLLM's installed metadata.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.candidates.resolve import CandidateSpecError, resolve_candidate
from harness.candidates.vllm.spec import git_state
from harness.check.profiles import resolve as resolve_profile
from harness.cli import main
from harness.trace import open_trace

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "golden"
SKIP = os.environ.get("HARNESS_SKIP_VLLM") == "1"

vllm = pytest.mark.vllm
needs_vllm = pytest.mark.skipif(SKIP, reason="HARNESS_SKIP_VLLM=1")


@pytest.fixture(scope="module")
def env_python() -> Path:
    from harness.candidates.vllm.env import ensure_env

    return ensure_env("0.33.0", log=lambda line: print(f"vllm-env: {line}", file=sys.stderr))


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@example.com", "-c", "user.name=t", *args],
                          cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def checkout(env_python, tmp_path_factory) -> dict:
    """``{venv, repo, init}``: a venv importing vLLM 0.33.0 from a git repo."""
    root = tmp_path_factory.mktemp("vllm-checkout")
    site = next((env_python.parent.parent / "lib").glob("python3.*/site-packages"))
    venv, repo = root / "venv", root / "repo"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    shutil.copytree(site / "vllm", repo / "vllm", copy_function=os.link)
    init = repo / "vllm" / "__init__.py"
    init.unlink()
    shutil.copyfile(site / "vllm" / "__init__.py", init)  # a real copy: the test edits it
    venv_site = next((venv / "lib").glob("python3.*/site-packages"))
    (venv_site / "zz-vllm-checkout.pth").write_text(f"{repo}\n{site}\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "vllm/__init__.py")
    _git(repo, "commit", "-qm", "vllm checkout")
    return {"venv": venv, "repo": repo, "init": init}


def _invoke(*args: str):
    return CliRunner().invoke(main, list(args), prog_name="harness")


def _steps(path: Path) -> list:
    return [(s, rows) for s, rows in open_trace(path).iter_steps()]


@vllm
@needs_vllm
def test_env_python_records_exactly_the_release_decisions(env_python, tmp_path):
    """vllm@<the 0.33.0 env's bin/python> is vllm@0.33.0: the same rows every step."""
    scenario = REPO / "harness/scenarios/fcfs-tight.toml"
    by_release, by_path = tmp_path / "release.parquet", tmp_path / "path.parquet"
    for spec, out in (("vllm@0.33.0", by_release), (f"vllm@{env_python}", by_path)):
        result = _invoke("record", str(scenario), "-o", str(out), "--engine", spec)
        assert result.exit_code == 0, result.output
    assert _steps(by_path) == _steps(by_release)
    meta = open_trace(by_path).meta
    assert (meta["engine"], meta["engine_version"]) == (f"vllm@{env_python}", "0.33.0")
    assert meta["vllm_source"] == {"version": "0.33.0", "python": str(env_python)}
    assert "vllm_source" not in open_trace(by_release).meta  # a release's bytes as before
    result = _invoke("diff", str(by_release), str(by_path))
    assert result.exit_code == 0, result.output
    # --semantics auto takes the version found, not the path.
    result = _invoke("check", str(by_path), "--json")
    payload = json.loads(result.output)
    assert result.exit_code == 0 and payload["profile"] == "0.33.0"
    assert payload["profile_reason"] == f"recorded by vLLM 0.33.0 at {env_python}"


@vllm
@needs_vllm
def test_venv_folder_replays_a_golden_identically(env_python):
    result = _invoke("replay", str(GOLDEN / "fcfs-tight.parquet"),
                     "--candidate", f"vllm@{env_python.parent.parent}")
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == \
        "conformant (profile 0.33.0): 392 steps replayed, identical decisions"


@vllm
@needs_vllm
def test_git_checkout_names_its_commit_and_dirty_flag(checkout, tmp_path):
    repo, init = checkout["repo"], checkout["init"]
    head = _git(repo, "rev-parse", "HEAD")
    out = tmp_path / "checkout.parquet"
    spec = f"vllm@{checkout['venv']}"
    result = _invoke("record", str(REPO / "harness/scenarios/fcfs-roomy.toml"), "-o", str(out),
                     "--engine", spec)
    assert result.exit_code == 0, result.output
    assert open_trace(out).meta["vllm_source"] == {
        "version": "0.33.0", "python": str(checkout["venv"] / "bin" / "python"),
        "git_commit": head, "git_dirty": False}
    result = _invoke("replay", str(GOLDEN / "fcfs-roomy.parquet"), "--candidate", spec)
    assert result.exit_code == 0, result.output
    original = init.read_text()
    try:
        init.write_text(original + "\n# a local edit\n")
        assert git_state(init.parent) == {"commit": head, "dirty": True, "root": str(repo)}
        result = _invoke("record", str(REPO / "harness/scenarios/fcfs-roomy.toml"),
                         "-o", str(tmp_path / "dirty.parquet"), "--engine", spec)
        assert result.exit_code == 0, result.output
        assert open_trace(tmp_path / "dirty.parquet").meta["vllm_source"]["git_dirty"] is True
        result = _invoke("check", str(tmp_path / "dirty.parquet"))
        assert f"git {head[:12]}, dirty" in " ".join(result.output.split())
    finally:
        init.write_text(original)


# -- no vLLM needed -----------------------------------------------------------

def test_interpreter_without_vllm_is_one_line_exit_2(tmp_path):
    python = Path(sys.executable)  # the harness's own: no vllm there
    with pytest.raises(CandidateSpecError, match=rf"`import vllm` fails under {python}: "
                                                 r"No module named 'vllm'"):
        resolve_candidate(f"vllm@{python}")
    result = _invoke("replay", str(GOLDEN / "fcfs-roomy.parquet"), "--candidate", f"vllm@{python}")
    assert result.exit_code == 2
    assert [ln for ln in result.output.splitlines() if ln.startswith("error:")] == [
        f"error: Invalid value: 'vllm@{python}': `import vllm` fails under {python}: "
        f"No module named 'vllm' (harness replay --help)"]


@pytest.mark.parametrize("make,problem", [
    (lambda p: p / "none", "does not exist (expected a Python interpreter or a virtual environment)"),
    (lambda p: p, "is a folder without bin/python (expected a virtual environment)"),
])
def test_path_that_is_no_python_is_refused(tmp_path, make, problem):
    target = make(tmp_path)
    with pytest.raises(CandidateSpecError) as info:
        resolve_candidate(f"vllm@{target}")
    assert str(info.value) == f"'vllm@{target}': {target} {problem}"


def test_git_state_outside_a_checkout_is_none(tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    assert git_state(tmp_path / "vllm") is None
    _git(tmp_path, "init", "-q")
    assert git_state(tmp_path / "vllm") is None  # a repository, but the package is untracked


def test_auto_profile_uses_the_version_found():
    meta = {"engine": "vllm@/x/bin/python", "engine_version": "0.29.0+cpu",
            "vllm_source": {"version": "0.29.0+cpu", "python": "/x/bin/python",
                            "git_commit": "0123456789abcdef", "git_dirty": True}}
    profile, why = resolve_profile("auto", meta)
    assert profile.name == "0.29.0"
    assert why == "recorded by vLLM 0.29.0+cpu at /x/bin/python (git 0123456789ab, dirty)"
    meta = {"engine": "vllm@/x/bin/python", "engine_version": "0.30.0.dev4+g1234"}
    profile, why = resolve_profile("auto", meta)
    assert profile.name == "safety"
    assert why == "recorded by vLLM 0.30.0.dev4+g1234: no semantics profile was measured for it"
