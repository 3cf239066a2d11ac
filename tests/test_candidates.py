"""Candidates: loading by spec, the protocol, and candidates that misbehave."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.candidates.resolve import CandidateSpecError, resolve_candidate
from harness.cli import main
from reference.candidate import Candidate
from reference.config import EngineConfig
from harness.candidates.mutants import MUTANTS
from reference.scheduler import Scheduler

SMALL = ["--set", "num_gpu_blocks=30", "--set", "max_model_len=96", "--set", "max_num_seqs=4",
         "--set", "block_size=4", "--set", "max_num_batched_tokens=64"]


def run(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def test_reference_and_mutants_satisfy_the_protocol() -> None:
    config = EngineConfig(num_gpu_blocks=30, max_model_len=96, block_size=4, max_num_seqs=4,
                          max_num_batched_tokens=64)
    for factory in [Scheduler, *MUTANTS.values()]:
        assert isinstance(factory(config), Candidate)


def test_resolve_specs() -> None:
    assert resolve_candidate("reference") is Scheduler
    assert resolve_candidate("mutant:preempt-head") is MUTANTS["preempt-head"]
    assert resolve_candidate("reference.scheduler:Scheduler") is Scheduler


@pytest.mark.parametrize("spec, fragment", [
    ("mutant:nope", "unknown mutant 'nope'"),
    ("nosuchmodule_xyz:make", "cannot import 'nosuchmodule_xyz'"),
    ("reference.scheduler:NoSuch", "has no attribute 'NoSuch'"),
    ("reference.config:POLICIES", "is not callable"),
    ("lifo", "unknown candidate 'lifo'"),
])
def test_bad_specs(spec: str, fragment: str) -> None:
    with pytest.raises(CandidateSpecError, match=fragment):
        resolve_candidate(spec)
    code, out = run("record", "synthetic:3", "--engine", spec, "-o", "/tmp/never.parquet")
    assert code == 2 and fragment in out


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch):
    """A user's candidate package on sys.path: one good, one that raises."""
    (tmp_path / "usercand.py").write_text(textwrap.dedent('''
        from reference.scheduler import Scheduler

        class Exploding(Scheduler):
            def schedule(self, throttle_prefills=False):
                if len(self.running) >= 2:
                    raise ZeroDivisionError("boom")
                return super().schedule(throttle_prefills)

        def make(config):
            return Scheduler(config)

        boom = Exploding  # a factory whose SPEC reads "usercand:boom"
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "usercand"
    sys.modules.pop("usercand", None)


def test_module_factory_candidate_records_and_replays(tmp_path: Path, user_module: str) -> None:
    path = tmp_path / "t.parquet"
    code, out = run("record", "synthetic:20", *SMALL, "--engine", f"{user_module}:make", "-o", path)
    assert code == 0, out
    code, out = run("replay", path, "--candidate", f"{user_module}:make", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["engine"] == "usercand:make" and report["divergence"] is None


def test_candidate_that_raises(tmp_path: Path, user_module: str) -> None:
    """A crash is a finding with a trace (tests/test_engine_crash.py has the details)."""
    path = tmp_path / "t.parquet"
    code, out = run("record", "synthetic:20", *SMALL, "--engine", f"{user_module}:Exploding", "-o", path)
    assert code == 1
    assert out.splitlines()[-1] == (
        "engine crashed: usercand:Exploding: candidate raised ZeroDivisionError in schedule() at "
        "step 9: boom (at usercand.py:7) (the trace ends there; harness check reports ENGINE-CRASH)")
    code, out = run("check", path, "--json")
    assert code == 1 and json.loads(out)["violations_by_invariant"] == {"ENGINE-CRASH": 1}
    reference = tmp_path / "ref.parquet"
    assert run("record", "synthetic:20", *SMALL, "-o", reference)[0] == 0
    code, out = run("replay", reference, "--candidate", f"{user_module}:Exploding", "--json")
    assert code == 1
    d = json.loads(out)["divergence"]
    assert (d["step"], d["field"], d["kind"], d["event_index"]) == (9, "exception", "crash", 2)
    assert d["actual"] == "candidate raised ZeroDivisionError in schedule() at step 9: boom (at usercand.py:7)"


def test_a_spec_is_printed_as_written_not_as_an_emoji(tmp_path: Path, user_module: str) -> None:
    """Regression: rich turned ``usercand:boom`` into ``usercand💥`` in the error line."""
    path = tmp_path / "t.parquet"
    code, out = run("record", "synthetic:20", *SMALL, "--engine", f"{user_module}:boom", "-o", path)
    assert code == 1
    assert out.splitlines()[-1].startswith("engine crashed: usercand:boom: candidate raised "
                                           "ZeroDivisionError in schedule() at step 9: boom")


@pytest.fixture
def module_in_cwd_not_on_path(tmp_path: Path, monkeypatch):
    """``mysched.py`` and ``mypkg/`` in the current folder, which is not on
    sys.path (as under the ``harness`` script: its own bin folder is there)."""
    (tmp_path / "mysched.py").write_text("from reference.scheduler import Scheduler\n\n"
                                         "def make(config):\n    return Scheduler(config)\n")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    cwd = str(tmp_path.resolve())
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and str(Path(p).resolve()) != cwd])
    yield tmp_path
    for name in ("mysched", "mypkg"):
        sys.modules.pop(name, None)


def test_candidate_module_in_cwd_not_on_path_suggests_pythonpath(module_in_cwd_not_on_path: Path) -> None:
    """Regression: ``--candidate mysched:make`` with mysched.py in the current
    folder said only "No module named 'mysched'", with no next step."""
    code, out = run("golden", "check", "--candidate", "mysched:make")
    assert code == 2
    assert out == ("error: Invalid value: cannot import 'mysched' for candidate 'mysched:make': "
                   "ModuleNotFoundError: No module named 'mysched'; mysched.py is in the current folder, "
                   "which is not on the import path: run with PYTHONPATH=. (main golden check --help)\n")
    with pytest.raises(CandidateSpecError) as info:
        resolve_candidate("mypkg.sched:make", isolate=False)
    assert str(info.value) == ("cannot import 'mypkg.sched' for candidate 'mypkg.sched:make': ModuleNotFoundError: "
                               "No module named 'mypkg'; mypkg/ is in the current folder, which is not on the "
                               "import path: run with PYTHONPATH=.")
    with pytest.raises(CandidateSpecError) as info:  # nothing of that name here: no hint
        resolve_candidate("nosuchmodule_xyz:make", isolate=False)
    assert str(info.value) == ("cannot import 'nosuchmodule_xyz' for candidate 'nosuchmodule_xyz:make': "
                               "ModuleNotFoundError: No module named 'nosuchmodule_xyz'")
    sys.path.insert(0, str(module_in_cwd_not_on_path))  # on the path: it imports
    assert callable(resolve_candidate("mysched:make", isolate=False))


def test_candidate_attribute_typo_did_you_mean(user_module: str) -> None:
    """Regression: ``usercand:mak`` said "has no attribute 'mak'" without the
    "did you mean 'make'" that docs/reference/exit-codes.md promises."""
    code, out = run("golden", "check", "--candidate", f"{user_module}:mak")
    assert code == 2
    assert out == ("error: Invalid value: module 'usercand' has no attribute 'mak'; did you mean 'make'? "
                   "(main golden check --help)\n")
    with pytest.raises(CandidateSpecError) as info:  # nothing close, few callables: listed
        resolve_candidate(f"{user_module}:zzz", isolate=False)
    assert str(info.value) == "module 'usercand' has no attribute 'zzz'; known: Exploding, Scheduler, boom, make"
