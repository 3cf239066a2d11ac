"""Regression (new-user trial): ``vllm@0.33.0,scheduler_cls=myfork.sched:FairSchedulr`` was
refused only after the driver had imported vLLM (about a minute), and with no suggestion.
``precheck_scheduler_class`` now finds the typo without importing the module or vLLM, with a
"did you mean"; anything it cannot be sure of passes to the driver's full check."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from harness.candidates.vllm.class_precheck import precheck_scheduler_class
from harness.candidates.vllm.spec import VLLMTarget

FORK = '''
from vllm.v1.core.sched.scheduler import Scheduler  # never imported by the pre-check


class FairScheduler(Scheduler):
    pass


if __name__ == "__main__":
    class Debug:
        pass
'''


def _target(tmp_path: Path, cls: str) -> VLLMTarget:
    return VLLMTarget(spec=f"vllm@x,scheduler_cls={cls}", python=Path(sys.executable), version="0.33.0",
                      release=False, scheduler_cls=cls, pythonpath=(str(tmp_path),))


@pytest.fixture
def fork(tmp_path: Path) -> Path:
    (tmp_path / "myfork").mkdir()
    (tmp_path / "myfork" / "__init__.py").write_text("")
    (tmp_path / "myfork" / "sched.py").write_text(FORK)
    return tmp_path


def test_a_misspelled_class_is_named_with_a_suggestion(fork: Path) -> None:
    origin = fork / "myfork" / "sched.py"
    assert precheck_scheduler_class(_target(fork, "myfork.sched:FairSchedulr")) == (
        f"scheduler_cls myfork.sched:FairSchedulr: module 'myfork.sched' ({origin}) defines no "
        "'FairSchedulr' (did you mean 'FairScheduler'?)")
    # vLLM's dotted spelling is read the same way
    assert precheck_scheduler_class(_target(fork, "myfork.sched.FairSchedulr")).endswith(
        "(did you mean 'FairScheduler'?)")


def test_a_misspelled_module_is_named_with_a_suggestion(fork: Path) -> None:
    assert precheck_scheduler_class(_target(fork, "myfork.shed:FairScheduler")) == (
        "scheduler_cls myfork.shed:FairScheduler: module 'myfork.shed' is not found on this "
        "interpreter's path (did you mean 'myfork.sched'?)")
    assert precheck_scheduler_class(_target(fork, "myfrk.sched:FairScheduler")) == (
        "scheduler_cls myfrk.sched:FairScheduler: module 'myfrk.sched' is not found on this "
        "interpreter's path: no module 'myfrk' (did you mean 'myfork'?)")


def test_what_may_be_there_passes_to_the_full_check(fork: Path) -> None:
    assert precheck_scheduler_class(_target(fork, "myfork.sched:FairScheduler")) is None
    assert precheck_scheduler_class(_target(fork, "myfork.sched:Debug")) is None  # bound in a branch
    (fork / "myfork" / "star.py").write_text("from myfork.sched import *\n")
    assert precheck_scheduler_class(_target(fork, "myfork.star:Anything")) is None
    (fork / "myfork" / "lazy.py").write_text("def __getattr__(name):\n    return name\n")
    assert precheck_scheduler_class(_target(fork, "myfork.lazy:Anything")) is None
    (fork / "broken").mkdir()
    (fork / "broken" / "__init__.py").write_text("raise RuntimeError('boom')\n")
    # no package is imported to look: a broken __init__ does not hide what is (not) there
    assert precheck_scheduler_class(_target(fork, "broken.sched:X")) == (
        "scheduler_cls broken.sched:X: module 'broken.sched' is not found on this interpreter's path")
    (fork / "broken" / "sched.py").write_text("class X:\n    pass\n")
    assert precheck_scheduler_class(_target(fork, "broken.sched:X")) is None  # the driver reports the raise
    gone = VLLMTarget(spec="x", python=fork / "no-python", version="0.33.0", release=False,
                      scheduler_cls="myfork.sched:X", pythonpath=(str(fork),))
    assert precheck_scheduler_class(gone) is None


@pytest.mark.parametrize("source", [
    "import sys\nsys.modules[__name__] = object()\n",  # transformers' lazy-module pattern
    "globals()['MyScheduler'] = type('MyScheduler', (), {})\n",
    "import sys\nsetattr(sys.modules[__name__], 'MyScheduler', int)\n",
    "if (MyScheduler := int):\n    pass\n",
    "def make():\n    global MyScheduler\n    MyScheduler = int\nmake()\n",
    "exec('class MyScheduler: pass')\n",
    "vars()['MyScheduler'] = int\n",
])
def test_names_bound_at_run_time_pass(fork: Path, source: str) -> None:
    """Regression (adversarial trial): classes bound dynamically were refused in under 2 s."""
    (fork / "dyn.py").write_text("class Scheduler:\n    pass\n" + source)
    assert precheck_scheduler_class(_target(fork, "dyn:MyScheduler")) is None


def test_a_submodule_bound_by_its_package_passes(fork: Path) -> None:
    (fork / "myfork" / "__init__.py").write_text("from .sched import FairScheduler\n")
    assert precheck_scheduler_class(_target(fork, "myfork:sched.FairScheduler")) is None


def test_suggestions_come_from_the_module_s_own_classes(fork: Path) -> None:
    """Regression (adversarial trial): "did you mean 'Scheduler'" pointed at vLLM's base class,
    imported by the module: following it would run stock vLLM and pass trivially."""
    message = precheck_scheduler_class(_target(fork, "myfork.sched:Schedulerr"))
    assert message.endswith("defines no 'Schedulerr' (did you mean 'FairScheduler'?)"), message


def test_the_caller_s_folder_is_not_looked_in(fork: Path, tmp_path_factory, monkeypatch) -> None:
    """Regression (both trials): ``python -c`` put the caller's folder first on sys.path, so a
    stale ``mysched.py`` there was read (a false refusal); the driver runs elsewhere."""
    cwd = tmp_path_factory.mktemp("cwd")
    (cwd / "myfork.py").write_text("class OldScheduler:\n    pass\n")
    monkeypatch.chdir(cwd)
    assert precheck_scheduler_class(_target(fork, "myfork.sched:FairScheduler")) is None
    assert precheck_scheduler_class(_target(fork, "myfork.sched:FairSchedulr")).endswith(
        "(did you mean 'FairScheduler'?)")


def test_no_parent_package_is_imported(fork: Path) -> None:
    """Regression (adversarial trial): ``find_spec`` imported each parent package (a vLLM fork's
    ``vllm.…``: 30 s, then a timeout that hid the typo)."""
    (fork / "slow").mkdir()
    (fork / "slow" / "__init__.py").write_text("import time\ntime.sleep(60)\n")
    (fork / "slow" / "sched.py").write_text("class MyScheduler:\n    pass\n")
    assert precheck_scheduler_class(_target(fork, "slow.sched:MySchedulr")).endswith(
        "(did you mean 'MyScheduler'?)")


def test_the_candidate_spec_is_refused_before_any_driver_starts(fork: Path, monkeypatch) -> None:
    from harness.candidates import resolve
    from harness.candidates.vllm import candidate, spec

    monkeypatch.setattr(spec, "parse_vllm_spec", lambda s: _target(fork, "myfork.sched:FairSchedulr"))

    def no_driver(*_a, **_k):
        raise AssertionError("the driver was started")
    monkeypatch.setattr(candidate, "probe_scheduler_class", no_driver)
    with pytest.raises(resolve.CandidateSpecError, match=r"did you mean 'FairScheduler'\?"):
        resolve.resolve_candidate("vllm@0.33.0,scheduler_cls=myfork.sched:FairSchedulr")
