"""pytest plugin: run the conformance suite against any candidate.

Registered as the ``sched_harness`` pytest11 entry point, so it is active
wherever sched-harness is installed. Usage in a user's project::

    pytest --pyargs harness.conformance --harness-candidate mymod:make_scheduler

Options:
  --harness-candidate SPEC   candidate to test (reference, mutant:NAME, vllm@VERSION, vllm@PATH
                             -- e.g. vllm@$(which python) --, either with
                             ,scheduler_cls=package.module:Class, or package.module:factory)
  --harness-golden-dir DIR   golden traces (default: the repository's golden/)
  --harness-update-golden    re-record the goldens with the reference instead of failing
                             (like syrupy's --snapshot-update; only the reference writes goldens)
  --harness-step-timeout S   seconds a call into a module:factory candidate (run in its own
                             process) may take before the run ends as a hang at that step
                             (default harness.candidates.isolated.DEFAULT_STEP_TIMEOUT_S)
  --harness-semantics NAME   what the candidate is held to: auto (default: every rule of the
                             version the reference mirrors, and the goldens' decisions), safety,
                             fork (the fork gate: safety + progress) or a release's profile; under
                             one that does not compare decisions (fork, safety) a decision that
                             differs from the golden's is reported as information (the diff summary
                             at the end), and the candidate's own run of that golden's inputs is
                             checked under the profile instead, as `harness golden check
                             --semantics` does: a violation, crash or stall there fails
  --harness-scenarios DIR    also run every scenario file (*.toml) in DIR, beside the library
                             (traces/scenarios/)
  --harness-fuzz-examples N  generated scenarios of the short fuzz (default 20; 0: no fuzz)
  --harness-allow-unsealed   accept goldens without tamper evidence (no trace_sha256 digest);
                             by default such a golden fails, as in `harness golden check`
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.golden import DEFAULT_DIR as DEFAULT_GOLDEN_DIR  # noqa: E402


#: The conformance suite's module, and the file part its node ids always carry.
CONFORMANCE_FILE = Path(__file__).resolve().parent / "conformance.py"
CONFORMANCE_NODEID = "harness/conformance.py"


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """Collect the conformance suite under the node id ``harness/conformance.py``
    wherever it is installed: run with ``--pyargs`` from a project whose
    rootdir does not contain site-packages, pytest would give its tests node
    ids without a file part (``::test_golden[fcfs-tight]``), which
    ``--deselect``, ``-k`` reports and CI annotations cannot point at."""
    if Path(module_path).resolve() != CONFORMANCE_FILE:
        return None
    return pytest.Module.from_parent(parent, path=Path(module_path), nodeid=CONFORMANCE_NODEID)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("sched-harness", "scheduler conformance (sched-harness)")
    group.addoption("--harness-candidate", default="reference", metavar="SPEC",
                    help="candidate scheduler: reference, mutant:NAME, vllm@VERSION, vllm@PATH "
                         "(an interpreter or venv importing vllm), either with "
                         ",scheduler_cls=package.module:Class, or package.module:factory")
    group.addoption("--harness-golden-dir", default=None, metavar="DIR",
                    help=f"golden trace folder (default {DEFAULT_GOLDEN_DIR})")
    group.addoption("--harness-update-golden", action="store_true",
                    help="re-record golden traces with the reference and report what changed")
    group.addoption("--harness-step-timeout", default=None, type=float, metavar="SECONDS",
                    help="seconds a call into a module:factory candidate may take (a hang ends "
                         "that scenario's run at its step)")
    group.addoption("--harness-semantics", default="auto", metavar="NAME",
                    help="auto (every rule of the version the reference mirrors, and the goldens' "
                         "decisions), safety, fork (safety + progress: the fork gate) or a release's "
                         "profile; under any but auto a differing decision is information, not a failure")
    group.addoption("--harness-scenarios", default=None, metavar="DIR",
                    help="also run the scenario files (*.toml) in DIR, beside the library")
    group.addoption("--harness-fuzz-examples", default=20, type=int, metavar="N",
                    help="generated scenarios of the short fuzz (0: none)")
    group.addoption("--harness-allow-unsealed", action="store_true",
                    help="accept golden traces without tamper evidence (by default they fail)")


#: The candidate factory pytest_configure resolved from --harness-candidate (not
#: for ``reference``, the default): the session fixture reuses it.
CANDIDATE = pytest.StashKey[object]()


def pytest_configure(config: pytest.Config) -> None:
    """Refuse unusable options before any collection or test, each with one
    line (pytest.UsageError: ``ERROR: --harness-...: ...``, exit 4): an unknown
    --harness-semantics, a --harness-step-timeout that is no positive number
    of seconds, a --harness-candidate that does not resolve (new-user trial:
    these ended in a raw ``_pytest.outcomes.Exit`` line after 9 s of
    collection), and a --harness-scenarios file that does not load (a typo'd
    config key, a cycle of ``after``: the user's input, not the candidate's
    failure; before, each such file was a FAILED test with a traceback into the
    harness and pytest exited 1, which a CI cannot tell from a candidate that
    failed: adversarial trial)."""
    _refuse_bad_options(config)
    folder = config.getoption("--harness-scenarios", default=None)
    if not folder or not Path(folder).is_dir():
        return  # none given, or not a folder: the suite's collection says so
    from reference.config import ConfigError
    from workloads.scenario import ScenarioError, load_scenario

    for path in sorted(Path(folder).glob("*.toml")):
        try:
            load_scenario(path).engine_config()
        except (ScenarioError, ConfigError) as exc:
            message = str(exc) if str(path) in str(exc) else f"{path}: {exc}"
            raise pytest.UsageError(f"--harness-scenarios: {message}") from None


def _refuse_bad_options(config: pytest.Config) -> None:
    """Raise pytest.UsageError for an unusable --harness-semantics,
    --harness-step-timeout or --harness-candidate; stash the resolved
    candidate (``CANDIDATE``). Only options given: a plain ``pytest`` run of a
    project with sched-harness installed pays nothing; nor does ``--collect-only``
    resolve a candidate (a ``vllm@...,scheduler_cls=`` one builds its class in
    a driver: vLLM's minute of import)."""
    semantics = config.getoption("--harness-semantics", default="auto")
    if semantics != "auto":
        from harness.check.profiles import ProfileError
        from harness.fuzz.run import fuzz_profile

        try:
            fuzz_profile(semantics)
        except ProfileError as exc:
            raise pytest.UsageError(f"--harness-semantics: {exc}") from None
    timeout = config.getoption("--harness-step-timeout", default=None)
    if timeout is not None and not (timeout > 0 and timeout != float("inf")):
        raise pytest.UsageError(f"--harness-step-timeout: {timeout} is not a positive number of seconds")
    spec = config.getoption("--harness-candidate", default="reference")
    if spec != "reference" and not config.getoption("collectonly", default=False):
        from harness.candidates.resolve import CandidateSpecError, resolve_candidate

        try:
            config.stash[CANDIDATE] = resolve_candidate(spec, step_timeout=timeout)
        except CandidateSpecError as exc:
            raise pytest.UsageError(f"--harness-candidate: {exc}") from None


#: Decisions that differ from the goldens' under a --harness-semantics other
#: than auto: information, printed at the end of the run, never failures.
DIFFERENCES: list[str] = []


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if DIFFERENCES:
        terminalreporter.section("sched-harness: decisions that differ from the goldens (information)")
        for line in DIFFERENCES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def harness_candidate_spec(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--harness-candidate")


@pytest.fixture(scope="session")
def harness_candidate(harness_candidate_spec: str, request: pytest.FixtureRequest):
    """The candidate factory named by --harness-candidate (resolved, and
    refused if unusable, by pytest_configure)."""
    from harness.candidates.resolve import resolve_candidate

    if CANDIDATE in request.config.stash:
        return request.config.stash[CANDIDATE]
    return resolve_candidate(harness_candidate_spec,
                             step_timeout=request.config.getoption("--harness-step-timeout"))


@pytest.fixture(scope="session")
def harness_golden_dir(request: pytest.FixtureRequest) -> Path:
    option = request.config.getoption("--harness-golden-dir")
    return Path(option) if option else DEFAULT_GOLDEN_DIR


@pytest.fixture(scope="session")
def harness_update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--harness-update-golden"))


@pytest.fixture(scope="session")
def harness_profile(request: pytest.FixtureRequest):
    """The profile --harness-semantics names (None for auto: the reference's,
    with the goldens' decisions compared)."""
    from harness.fuzz.run import fuzz_profile

    return fuzz_profile(request.config.getoption("--harness-semantics"))  # (checked by pytest_configure)


@pytest.fixture(scope="session")
def harness_fuzz_examples(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--harness-fuzz-examples"))


@pytest.fixture(scope="session")
def harness_require_sealed(request: pytest.FixtureRequest) -> bool:
    """True unless --harness-allow-unsealed: an unsealed golden fails."""
    return not request.config.getoption("--harness-allow-unsealed")
