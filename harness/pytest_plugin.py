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
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.golden import DEFAULT_DIR as DEFAULT_GOLDEN_DIR  # noqa: E402


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


@pytest.fixture(scope="session")
def harness_candidate_spec(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--harness-candidate")


@pytest.fixture(scope="session")
def harness_candidate(harness_candidate_spec: str):
    """The candidate factory named by --harness-candidate."""
    from harness.candidates.resolve import CandidateSpecError, resolve_candidate

    try:
        return resolve_candidate(harness_candidate_spec)
    except CandidateSpecError as exc:
        pytest.exit(f"--harness-candidate: {exc}", returncode=4)


@pytest.fixture(scope="session")
def harness_golden_dir(request: pytest.FixtureRequest) -> Path:
    option = request.config.getoption("--harness-golden-dir")
    return Path(option) if option else DEFAULT_GOLDEN_DIR


@pytest.fixture(scope="session")
def harness_update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--harness-update-golden"))
