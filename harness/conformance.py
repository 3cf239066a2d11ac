"""The conformance suite, runnable against any candidate through the pytest
plugin (harness/pytest_plugin.py)::

    pytest --pyargs harness.conformance --harness-candidate mymod:make_scheduler

For every canonical scenario (harness/scenarios/*.toml) and every hybrid
model's (harness/scenarios/hybrid/*.toml: sliding-window and Mamba groups
beside full attention): the candidate must violate no invariant and must not
stall or raise; and it must make exactly the decisions recorded in the golden
trace of that scenario (golden/, golden/hybrid/: the ``hybrid`` subfolder of
``--harness-golden-dir``). The same holds
(invariants only) for every scenario of the library (traces/scenarios/: the
bug shapes and the progress scenarios) and of ``--harness-scenarios DIR``,
and for a short fuzz (``--harness-fuzz-examples``). A scenario whose config
the candidate refuses (``CandidateRefused``: a vLLM release without an
option it sets, a config the driver cannot map) is skipped with the reason.

``--harness-semantics`` chooses the rules: ``auto`` every rule of the version
the reference mirrors; ``fork`` (the fork gate) the safety and progress
layers only, and then a golden's decisions that differ are information (the
run's last section), never failures: a fork's deliberate policy passes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.scenarios import HYBRID_SCENARIOS, SCENARIOS

#: Every scenario the suite runs and replays the golden of: the canonical ones, then the hybrid ones.
ALL_SCENARIOS = {**SCENARIOS, **HYBRID_SCENARIOS}

#: The scenario library: the checkout's traces/scenarios/, else the installed copy.
_CHECKOUT_LIBRARY = Path(__file__).resolve().parents[1] / "traces" / "scenarios"
LIBRARY = _CHECKOUT_LIBRARY if _CHECKOUT_LIBRARY.is_dir() else Path(__file__).resolve().parent / "library"


def _library_files(config) -> list[Path]:
    folder = config.getoption("--harness-scenarios", default=None)
    files = sorted(LIBRARY.glob("*.toml")) if LIBRARY.is_dir() else []
    if folder:
        extra = Path(folder)
        if not extra.is_dir():
            raise pytest.UsageError(f"--harness-scenarios: {extra} is not a folder")
        files += sorted(extra.glob("*.toml"))
    return files


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "library_scenario" in metafunc.fixturenames:
        files = _library_files(metafunc.config)
        metafunc.parametrize("library_scenario", files,
                             ids=[f"{p.parent.name}/{p.stem}" for p in files])


def _witness(result) -> str:
    """The first five violations, one line each, as ``harness check`` words them: a step-level
    rule names no request (regression: test_regression_plugin_witness_said_request_none)."""
    lines = [f"{v.invariant} at step {v.step}" + (f", request {v.request}" if v.request is not None else "")
             + f": {v.message}" for v in result.violations[:5]]
    return "\n".join(lines)


def _hint(invariant_ids, diverged: bool = False) -> str:
    """A line saying how a fork that differs on purpose is checked, when every
    fired rule is version semantics (``fork_hint``), else ""."""
    from harness.check.invariants import fork_hint

    hint = fork_hint(invariant_ids, diverged=diverged, option="--harness-semantics fork")
    return f"\nhint: {hint}" if hint else ""


def _reproduce(path: Path, spec: str, profile) -> str:
    """The line that reproduces a scenario's failure on the command line:
    ``reproduce: harness record FILE --engine SPEC -o NAME.parquet && harness
    check NAME.parquet --semantics PROFILE`` (new-user trial: a failing
    test_invariants printed none). The profile is named: ``check``'s auto gives
    a module:factory fork's trace safety only, the suite's auto the reference's
    profile. ``path``: relative to the working folder when under it."""
    import shlex

    from harness.check.profiles import reference_profile

    if path is None:
        return ""
    try:
        shown = str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        shown = str(path)
    out = shlex.quote(f"{Path(path).stem}.parquet")
    name = profile.name if profile is not None else reference_profile().name
    return (f"\nreproduce: harness record {shlex.quote(shown)} --engine {shlex.quote(spec)} -o {out}"
            f" && harness check {out} --semantics {name}")


@pytest.mark.parametrize("scenario", sorted(ALL_SCENARIOS))
def test_invariants(scenario: str, harness_candidate, harness_candidate_spec, harness_profile) -> None:
    """The candidate violates no invariant on the scenario."""
    from harness.mutation import run_candidate

    cell = run_candidate(harness_candidate, ALL_SCENARIOS[scenario], harness_profile)
    if cell.refused:  # e.g. a vLLM release without an option the scenario sets: not compared, not failed
        pytest.skip(f"{scenario}: the candidate cannot run this scenario's config: {cell.refused}")
    reproduce = _reproduce(ALL_SCENARIOS[scenario].path, harness_candidate_spec, harness_profile)
    if cell.ended:
        pytest.fail(f"{scenario}: run ended early: {cell.ended}{reproduce}", pytrace=False)
    if not cell.result.ok:
        pytest.fail(f"{scenario}: {cell.result.by_invariant}\n{_witness(cell.result)}"
                    f"{_hint(cell.result.by_invariant)}{reproduce}", pytrace=False)


class _Goldens:
    """Each golden checked when its test asks for it, once (``check_goldens`` on
    that one scenario, under --harness-semantics's profile as ``harness golden
    check --semantics`` does: under one that does not compare decisions, a
    differing decision is information and the candidate's own run of that
    golden's inputs must break none of the profile's rules, crash or stall).
    New-user trial: a module fixture checked every golden before the first
    test, so ``-k`` selecting 4 tests of a vllm@ candidate took as long as the
    whole golden check (768 s)."""

    def __init__(self, factory, folder: Path, require_sealed: bool, profile) -> None:
        self.factory, self.folder, self.require_sealed, self.profile = factory, folder, require_sealed, profile
        self.results: dict = {}

    def folder_of(self, scenario: str) -> Path:
        """golden/ for a canonical scenario, golden/hybrid/ for a hybrid model's."""
        return self.folder / "hybrid" if scenario in HYBRID_SCENARIOS else self.folder

    def result(self, scenario: str):
        """The GoldenResult of ``scenario``'s golden, or None for a hybrid one
        when the folder has no ``hybrid/`` (a folder of one's own)."""
        from harness.golden import check_goldens

        if scenario not in self.results:
            folder = self.folder_of(scenario)
            if scenario in HYBRID_SCENARIOS and not folder.is_dir():
                return None
            [result] = [r for r in check_goldens(folder, self.factory, require_sealed=self.require_sealed,
                                                 scenarios={scenario: ALL_SCENARIOS[scenario]},
                                                 profile=self.profile)
                        if r.scenario == scenario]
            self.results[scenario] = result
        return self.results[scenario]

    def unused(self) -> list[str]:
        """Golden files and manifest entries no scenario records (nothing run)."""
        from harness.golden import check_goldens

        names = []
        for folder, scenarios in ((self.folder, SCENARIOS), (self.folder / "hybrid", HYBRID_SCENARIOS)):
            if folder.is_dir():
                names += [r.scenario for r in check_goldens(folder, self.factory, scenarios={})
                          if r.scenario not in scenarios]
        return names


@pytest.fixture(scope="session")
def golden_results(harness_candidate, harness_golden_dir, harness_update_golden, harness_require_sealed,
                   harness_profile):
    """The goldens, checked lazily (``_Goldens``); None after
    --harness-update-golden re-recorded them all with the reference."""
    from harness.golden import update_goldens

    hybrid = harness_golden_dir / "hybrid"
    if harness_update_golden:
        for folder, scenarios in ((harness_golden_dir, SCENARIOS), (hybrid, HYBRID_SCENARIOS)):
            for change in update_goldens(folder, scenarios=scenarios):
                print(f"golden {change.scenario}: {change.status} {'; '.join(change.details)}")
        return None
    if not harness_golden_dir.exists():
        # A missing folder fails: skipping would pass a candidate that was never compared.
        pytest.fail(f"no golden folder at {harness_golden_dir} (pass --harness-golden-dir)", pytrace=False)
    return _Goldens(harness_candidate, harness_golden_dir, harness_require_sealed, harness_profile)


@pytest.mark.parametrize("scenario", sorted(ALL_SCENARIOS))
def test_golden(scenario: str, golden_results, harness_golden_dir) -> None:
    """The candidate makes the golden trace's decisions, step by step (under
    a --harness-semantics that does not compare decisions, a difference is
    information, and the candidate's own run of the golden's inputs is held
    to the profile's rules instead: ``_Goldens``)."""
    from harness.pytest_plugin import DIFFERENCES

    if golden_results is None:
        return  # goldens were just re-recorded
    result = golden_results.result(scenario)
    if result is None:
        pytest.skip(f"{scenario}: no hybrid goldens at {harness_golden_dir / 'hybrid'}")
    if result.skipped:
        pytest.skip(f"{scenario}: the candidate cannot replay this golden: {result.skipped}")
    if not result.ok:
        pytest.fail(f"{scenario}: " + "; ".join(result.reasons), pytrace=False)
    if result.information:
        DIFFERENCES.append(f"{scenario}: {result.information_text}")


def test_no_unused_goldens(golden_results) -> None:
    unused = golden_results.unused() if golden_results is not None else []
    if unused:
        pytest.fail(f"golden traces for no scenario: {unused}", pytrace=False)


class _LibraryScenario:
    """A library scenario file as ``harness.mutation.run_candidate`` runs it."""

    def __init__(self, path: Path) -> None:
        from workloads.scenario import load_scenario

        self.loaded = load_scenario(path)
        self.seed = self.loaded.seed
        self.name = path.stem

    def make_workload(self):
        return self.loaded.workload

    def engine_config(self):
        return self.loaded.engine_config()


def test_library(library_scenario: Path, harness_candidate, harness_candidate_spec, harness_profile) -> None:
    """The candidate violates no invariant on a library scenario (the bug
    shapes and the progress scenarios of traces/scenarios/, and the files of
    --harness-scenarios)."""
    from harness.mutation import run_candidate

    cell = run_candidate(harness_candidate, _LibraryScenario(library_scenario), harness_profile)
    name = library_scenario.stem
    if cell.refused:
        pytest.skip(f"{name}: the candidate cannot run this scenario's config: {cell.refused}")
    reproduce = _reproduce(library_scenario, harness_candidate_spec, harness_profile)
    if cell.ended:
        pytest.fail(f"{name}: run ended early: {cell.ended}{reproduce}", pytrace=False)
    if not cell.result.ok:
        pytest.fail(f"{name}: {cell.result.by_invariant}\n{_witness(cell.result)}"
                    f"{_hint(cell.result.by_invariant)}{reproduce}", pytrace=False)


def test_fuzz(harness_candidate, harness_candidate_spec, harness_profile, harness_fuzz_examples) -> None:
    """A short fuzz (--harness-fuzz-examples, seed 0): no generated scenario
    makes the candidate violate a rule it is held to, crash or stall (under
    auto, nor decide differently from the reference). Drawn configs the
    candidate refuses are skipped; the reference's known findings passed over."""
    from harness.fuzz.run import fuzz, known_reference_finding
    from reference.scheduler import Scheduler

    if harness_fuzz_examples <= 0:
        pytest.skip("--harness-fuzz-examples 0")
    factory = None if harness_candidate_spec == "reference" else harness_candidate
    result = fuzz(factory if factory is not Scheduler else None, max_examples=harness_fuzz_examples,
                  seed=0, known=known_reference_finding, profile=harness_profile)
    if result.found:
        pytest.fail(f"fuzz: {result.failure.kind}: {result.failure.message}\n"
                    f"  shrunk to {result.case.describe()}; reproduce with: harness fuzz --candidate "
                    f"{harness_candidate_spec} --max-examples {harness_fuzz_examples} --seed 0 -o DIR"
                    + (_hint(result.failure.invariants or (), result.failure.kind == "divergence")
                       if result.failure.kind in ("violation", "divergence") else ""),
                    pytrace=False)
