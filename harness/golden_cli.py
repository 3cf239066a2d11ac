"""``harness scenario extract``, ``harness golden check|update`` and ``harness mutants``:
the canonical scenarios, their pinned reference recordings and the kill matrix.

Registered on ``main`` by ``harness/cli.py``.
"""

from __future__ import annotations

import json
import sys

import click
from rich.markup import escape

from reference.words import did_you_mean, plural

from harness.check.invariants import fork_hint
from harness.progress import progress
from harness.trace import TraceError
from harness.cli_common import (EXIT_FOUND, EXIT_OK, _SEMANTICS_GOLDEN, _candidate, _fail, _open,
                                _refuse_overwriting_input, _refuse_unknown_semantics, _step_timeout, console, err)


@click.group()
def scenario() -> None:
    """Scenario files (docs/scenario-format.md): cut one out of a trace."""


@scenario.command("extract")
@click.argument("trace_path", metavar="TRACE")
@click.option("--requests", "request_ids", metavar="ID,...",
              help="Keep only these requests (comma-separated ids); default: all.")
@click.option("--steps", metavar="A:B",
              help="Keep only requests live in steps A..B-1 (half-open, as a Python slice).")
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False),
              help="Scenario file to write (TOML).")
def scenario_extract(trace_path: str, request_ids: str | None, steps: str | None, output: str) -> None:
    """Cut TRACE down to a scenario file that reproduces its decisions for the chosen requests.

    A cut that cannot be faithful (requests outside it held blocks, a window
    starting after a chosen request arrived, a config key the format cannot
    carry, a re-run on the reference that decides otherwise) is written
    anyway: one warning line each on stderr, exit 0. An unknown id or an
    empty cut: exit 2, nothing written.
    """
    from harness.scenario_extract import ExtractError, extract, parse_steps

    _refuse_overwriting_input(output, trace_path)
    trace = _open(trace_path)
    try:
        window = parse_steps(steps) if steps is not None else None
        ids = [r.strip() for r in request_ids.split(",") if r.strip()] if request_ids is not None else None
        if ids is not None and len(set(ids)) != len(ids):
            _fail(f"--requests {request_ids!r}: an id is listed twice")
        result = extract(trace, requests=ids, steps=window)
    except ExtractError as exc:
        _fail(str(exc))
    except TraceError as exc:
        _fail(str(exc))
    result.write(output)
    for warning in result.warnings:
        err.print(f"[bold yellow]warning:[/] {escape(warning)}")
    console.print(f"wrote [bold]{output}[/]: {plural(len(result.request_ids), 'request')}"
                  + (", faithful (same decisions on a re-run)" if not result.warnings
                     else f", {plural(len(result.warnings), 'warning')}"))


@click.group()
def golden() -> None:
    """Golden traces: one reference recording per canonical scenario (harness/scenarios/*.toml),
    pinned by MANIFEST.json."""


@golden.command("check")
@click.option("--dir", "golden_dir", default=None,
              type=click.Path(file_okay=False),
              help="Folder holding the goldens and MANIFEST.json (default: the repository's golden/).")
@click.option("--candidate", default="reference", show_default=True,
              help="Engine to re-drive with each golden's inputs: 'reference', 'mutant:NAME', "
                   "'vllm@VERSION' (a release; build its env with `harness vllm-env VERSION`), 'vllm@PATH' (the vLLM a Python interpreter or venv at PATH imports), either with ',scheduler_cls=package.module:Class' (a vLLM Scheduler subclass, found on PYTHONPATH) or 'package.module:factory'.")
@_step_timeout
@click.option("--require-sealed/--allow-unsealed", default=True, show_default=True,
              help="A golden without tamper evidence (no trace_sha256 digest) fails.")
@click.option("--hybrid", is_flag=True,
              help="The hybrid models' goldens (golden/hybrid/, harness/scenarios/hybrid/*.toml: several KV-cache "
                   "groups) instead of the canonical ones.")
@_SEMANTICS_GOLDEN
def golden_check(golden_dir: str, candidate: str, step_timeout: float, require_sealed: bool, hybrid: bool,
                 semantics: str) -> None:
    """Check every scenario's golden: present, sha256 and config fingerprint as in the manifest,
    sealed and complete, invariants hold, and CANDIDATE makes identical decisions (under
    --semantics fork or safety: a differing decision is information, and CANDIDATE's own run of
    that golden's inputs must break no rule of the profile, crash or stall). Exit 0 all ok,
    1 any failure or nothing compared (the candidate refused every golden's config: each one
    skipped), 2 unusable folder or manifest, or an unknown --semantics."""
    from rich.markup import escape

    from harness.fuzz.run import fuzz_profile
    from harness.golden import DEFAULT_DIR, GoldenError, candidate_crashed, check_goldens, unused_goldens
    from harness.scenarios import HYBRID_SCENARIOS, SCENARIOS

    _refuse_unknown_semantics(semantics)
    profile = fuzz_profile(semantics)
    scenarios = HYBRID_SCENARIOS if hybrid else SCENARIOS
    golden_dir = golden_dir or str(DEFAULT_DIR / "hybrid" if hybrid else DEFAULT_DIR)
    factory = _candidate(candidate, step_timeout)
    try:
        # Each golden's line as soon as it is checked (the bar shows only on a
        # terminal: a CI log would otherwise see nothing for minutes), in
        # SCENARIOS order (check_goldens is sequential), padded to a width known
        # before the first: the scenarios' and any unused golden's names. With
        # stdout a terminal the bar goes there too (rich prints the lines above
        # it; on stderr it would be drawn over them).
        width = max(len(name) for name in (*scenarios, *unused_goldens(golden_dir, scenarios)))
        with progress(f"checking goldens on {candidate}", len(scenarios),
                      console=console if console.is_terminal else None) as update:
            def on_result(r) -> None:
                console.print(_golden_line(r, width))
                update(advance=1)
            results = check_goldens(golden_dir, factory, on_result=on_result,
                                    require_sealed=require_sealed, scenarios=scenarios, profile=profile)
    except GoldenError as exc:
        _fail(str(exc))
    for r in results:
        if r.unused:  # found after the scenarios (check_goldens does not report them as it goes)
            console.print(_golden_line(r, width))
    failed = sum(not r.ok for r in results)
    skipped = sum(r.ok and bool(r.skipped) for r in results)
    if results and skipped == len(results):
        # Nothing was compared: no verdict to give, and certainly not exit 0 (issue 17).
        console.print(f"[bold red]0 ok, {skipped} skipped, 0 failed[/] ({golden_dir}, candidate {candidate}): "
                      f"the candidate refused every golden, nothing was compared")
        sys.exit(EXIT_FOUND)
    hint = fork_hint((), diverged=True) if failed and profile is None and all(
        r.divergence is not None and not candidate_crashed(r.divergence) for r in results if not r.ok) else None
    if hint:  # every failure is a divergence: say how a fork that decides differently is checked
        console.print(f"hint: {escape(hint)}")
    colour = "red" if failed else "green"
    console.print(f"[bold {colour}]{len(results) - failed - skipped} ok, "
                  + (f"{skipped} skipped, " if skipped else "")
                  + f"{failed} failed[/] ({golden_dir}, candidate {candidate}"
                  + (f", profile {semantics}" if profile is not None else "") + ")")
    sys.exit(EXIT_FOUND if failed else EXIT_OK)


def _golden_line(r, width: int) -> str:
    """One golden's line of ``golden check`` (rich markup): FAIL, skip or ok, the
    scenario name padded to ``width`` characters."""
    if not r.ok:
        return f"[bold red]FAIL[/] {r.scenario:<{width}}  {escape(r.reason)}"
    if r.skipped:
        return (f"[yellow]skip[/] {r.scenario:<{width}}  {plural(r.steps, 'step')} checked; not replayed: "
                f"{escape(r.skipped)}")
    if r.information:
        return (f"[bold green]ok  [/] {r.scenario:<{width}}  {plural(r.steps, 'step')}, decisions "
                f"differ from step {r.divergence.step} (information); own run: "
                f"{plural(r.own_run.steps, 'step')}, no violation")
    return (f"[bold green]ok  [/] {r.scenario:<{width}}  {plural(r.steps, 'step')}, "
            f"{r.replayed_steps} replayed identically")


@golden.command("update")
@click.option("--dir", "golden_dir", default=None,
              type=click.Path(file_okay=False),
              help="Folder holding the goldens and MANIFEST.json (default: the repository's golden/).")
@click.option("--scenario", "names", multiple=True, metavar="NAME",
              help="Re-record only this scenario (repeatable); default: all.")
@click.option("--prune", is_flag=True, help="Remove goldens of scenarios that no longer exist (those the manifest lists; any other *.parquet in the folder is kept).")
@click.option("--hybrid", is_flag=True,
              help="The hybrid models' goldens (golden/hybrid/, harness/scenarios/hybrid/*.toml: several KV-cache "
                   "groups) instead of the canonical ones.")
def golden_update(golden_dir: str, names: tuple[str, ...], prune: bool, hybrid: bool) -> None:
    """Re-record goldens with the reference (temp file + rename), rewrite MANIFEST.json
    atomically, and report per scenario: new, unchanged or changed (and how)."""
    from rich.markup import escape

    from harness.golden import DEFAULT_DIR, GoldenError, update_goldens
    from harness.scenarios import HYBRID_SCENARIOS, SCENARIOS

    golden_dir = golden_dir or str(DEFAULT_DIR / "hybrid" if hybrid else DEFAULT_DIR)
    try:
        changes = update_goldens(golden_dir, list(names) or None, prune=prune,
                                 scenarios=HYBRID_SCENARIOS if hybrid else SCENARIOS)
    except GoldenError as exc:
        _fail(str(exc))
    styles = {"new": "cyan", "unchanged": "green", "changed": "yellow", "removed": "magenta",
              "unused": "red", "refused": "bold red"}
    width = max((len(c.scenario) for c in changes), default=0)
    for c in changes:
        first = f"  {escape(c.details[0])}" if c.details else ""
        console.print(f"[{styles.get(c.status, 'white')}]{c.status:<9}[/] "
                      f"{c.scenario:<{width}}{first}".rstrip())
        for line in c.details[1:]:
            console.print(f"          {' ' * width}  {escape(line)}")
    counts: dict[str, int] = {}
    for c in changes:
        counts[c.status] = counts.get(c.status, 0) + 1
    console.print(", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "nothing to update",
                  markup=False)
    sys.exit(EXIT_FOUND if any(c.status == "refused" for c in changes) else EXIT_OK)


@click.command()
@click.option("--list", "list_only", is_flag=True, help="Print the mutant names, one per line, and exit.")
@click.option("--mutant", "mutant_names", multiple=True, metavar="NAME", help="Run only these mutants.")
@click.option("--scenario", "scenario_names", multiple=True, metavar="NAME",
              help="Run only these scenarios: a name of harness/scenarios/ or of the library "
                   "(traces/scenarios/), or a scenario file (default: all of harness/scenarios/).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the matrix.")
def mutants(list_only: bool, mutant_names: tuple[str, ...], scenario_names: tuple[str, ...],
            as_json: bool) -> None:
    """Run every mutant on every scenario and print the kill matrix.

    Shows, per mutant, the scenarios where its intended invariant fired.
    Exit 1 if any mutant survives (its invariant fired on no scenario), or if
    the clean reference violates anything. With --scenario, a mutant whose
    trace is the reference's on every chosen scenario is n/a (not exercised
    there), not a survivor.
    """
    from harness.mutation import UnknownScenario, mutation_scenario, render_matrix, run_mutation
    from workloads.scenario import ScenarioError
    from harness.candidates.mutants import MUTANTS_AND_TARGETS

    if list_only:
        for name in MUTANTS_AND_TARGETS:
            click.echo(name)
        return
    for name in mutant_names:
        if name not in MUTANTS_AND_TARGETS:
            raise click.BadParameter(f"unknown mutant {name!r}" + (did_you_mean(name, MUTANTS_AND_TARGETS)
                                                                   or " (--list lists them)"),
                                     param_hint="--mutant")
    for name in scenario_names:
        try:
            mutation_scenario(name)
        except (UnknownScenario, ScenarioError) as exc:
            raise click.BadParameter(str(exc), param_hint="--scenario") from None
    chosen = list(mutant_names) or list(MUTANTS_AND_TARGETS)
    from harness.mutation import MUTATION_SCENARIOS
    scenarios = list(scenario_names) or list(MUTATION_SCENARIOS)
    with progress("running mutants", (len(chosen) + 1) * len(scenarios), enabled=not as_json) as update:
        def on_cell(mutant: str, scenario: str) -> None:
            update(advance=1, description=f"running mutants: {mutant} on {scenario}")
        report = run_mutation(list(mutant_names) or None, list(scenario_names) or None, on_cell=on_cell)
    if as_json:
        click.echo(json.dumps(report.to_dict()))
    else:
        render_matrix(report, console)
    sys.exit(EXIT_OK if report.ok else EXIT_FOUND)
