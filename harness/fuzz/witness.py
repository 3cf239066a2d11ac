"""Writing replayable witnesses: a found failure's minimal case as a Parquet
trace, a scenario file (TOML, docs/scenario-format.md: human-readable,
editable, re-run with ``harness record``) and a JSON description
(``write_failure``), one set per distinct shrunk case of a parallel run
(``write_witnesses``), each with the ``harness replay`` command that
reproduces it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reference.candidate import CandidateFactory
from reference.scheduler import Scheduler

from harness.scenario_extract import extract
from harness.trace.reader import open_trace
from harness.trace.recorder import record
from harness.fuzz.parallel import ParallelFuzzResult, WorkerResult
from harness.fuzz.run import FuzzResult


def _slug(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", spec).strip("-") or "candidate"


def _pythonpath_prefix(spec: str) -> str:
    """``PYTHONPATH=... `` (shell-quoted, with its trailing space) for a
    ``package.module:factory`` candidate when PYTHONPATH is set, else ""."""
    pythonpath = os.environ.get("PYTHONPATH")
    user_module = ":" in spec and not spec.startswith("mutant:")
    return f"PYTHONPATH={shlex.quote(pythonpath)} " if user_module and pythonpath else ""


def witness_names(spec: str, seed: int, workers: int) -> list[str]:
    """Every file name ``write_witnesses`` may write for a run of ``workers``
    workers fuzzing ``spec`` with ``seed`` (``NAME.parquet``, ``.toml``,
    ``.json``, ``.rerecorded.parquet`` is the record command's, not written):
    what ``harness fuzz`` checks it can write before it starts."""
    bases = ([f"fuzz-{_slug(spec)}-seed{seed}"] if workers <= 1 else
             [f"fuzz-{_slug(spec)}-seed{seed}-worker{i}of{workers}" for i in range(workers)])
    return [f"{b}.{ext}" for b in bases for ext in ("parquet", "toml", "json")]


def _semantics_flag(semantics: str) -> str:
    """`` --semantics X`` for the profile the fuzz run held the candidate to.

    ``auto`` in ``harness fuzz`` means the reference's profile (every rule of the
    release it mirrors), while ``auto`` in ``replay``/``check`` gives an engine
    of unknown origin (``module:factory``) safety only: the command names the
    reference's profile so it gives the run's verdict (regression: a fork's
    ADMISSION-ORDER witness replayed "conformant (profile safety)")."""
    if semantics == "auto":
        from harness.check.profiles import reference_profile

        semantics = reference_profile().name
    return f" --semantics {shlex.quote(semantics)}"


def _write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_failure(out_dir: str | Path, spec: str, factory: CandidateFactory, result: FuzzResult,
                  seed: int, *, name: str | None = None, extra: dict[str, Any] | None = None,
                  semantics: str = "auto") -> tuple[Path, Path, str, Path]:
    """Write the minimal case's trace, its scenario file and a JSON
    description; returns (trace path, JSON path, the replay command, scenario
    path).

    Files are ``DIR/NAME.parquet``, ``DIR/NAME.toml`` and ``DIR/NAME.json``,
    NAME defaulting to ``fuzz-<candidate>-seed<seed>`` (an existing set of
    that name is replaced); ``extra`` adds keys to the JSON (e.g. the worker).
    ``semantics``: what the fuzz run held the candidate to (``harness fuzz
    --semantics``); the replay and check commands carry it, so they give the
    run's verdict (regression: the printed command dropped it).
    The scenario is ``harness scenario extract`` of the trace (every request;
    checked by re-running it on the trace's engine: any difference is listed
    in the JSON's ``scenario_warnings``), so ``harness record NAME.toml
    --engine <trace engine>`` records the same decisions.

    The trace is recorded with the candidate (engine=SPEC) when the candidate
    violates an invariant or stalls: replaying it checks it and fails. When
    the candidate only diverges from the reference, or raises, the trace is
    the reference's (engine=reference): replaying it with ``--candidate SPEC``
    reports the divergence.
    """
    assert result.case is not None and result.failure is not None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = name or f"fuzz-{_slug(spec)}-seed{seed}"
    trace_path = out / f"{base}.parquet"
    case, failure = result.case, result.failure
    engine, rec_factory = spec, factory
    if failure.kind in ("divergence", "exception", "reference-violation"):
        engine, rec_factory = "reference", Scheduler
    summary = record(case.workload(), case.engine_config(), trace_path, seed=case.seed,
                     engine=engine, candidate_factory=rec_factory)
    # A module:factory candidate is found through PYTHONPATH: the hint keeps it.
    env = _pythonpath_prefix(spec)
    flag = _semantics_flag(semantics)
    command = f"{env}harness replay {shlex.quote(str(trace_path))} --candidate {shlex.quote(spec)}{flag}"
    toml_path = out / f"{base}.toml"
    extraction = extract(open_trace(trace_path), verify_factory=rec_factory,
                         description=f"fuzz witness ({spec}, seed {seed}): {failure.kind}: {failure.message}",
                         # The header's commands carry the PYTHONPATH a module:factory candidate
                         # needs, as the JSON's do (regression: copied from the header, they failed
                         # with "no module named ...").
                         comments=[f"Re-run: {_pythonpath_prefix(engine)}harness record {base}.toml "
                                   f"--engine {shlex.quote(engine)} -o T.parquet, then "
                                   + (f"harness check T.parquet{flag}" if engine == spec
                                      else f"{env}harness replay T.parquet --candidate {shlex.quote(spec)}{flag}")])
    extraction.write(toml_path)
    record_command = (f"{_pythonpath_prefix(engine)}harness record {shlex.quote(str(toml_path))} "
                      f"--engine {shlex.quote(engine)} -o {shlex.quote(f'{out / base}.rerecorded.parquet')}")
    info = {"candidate": spec, "fuzz_seed": seed, "trace": str(trace_path), "trace_engine": engine,
            "replay_command": command, "semantics": semantics, "scenario_file": str(toml_path), "record_command": record_command,
            "scenario_warnings": list(extraction.warnings), "failure": failure.to_dict(),
            "examples_before_failure": result.examples, "shrink_calls": result.shrink_calls,
            "num_requests": len(case.requests), "num_steps": summary.steps,
            "summary": case.describe(), **(extra or {}),
            # Ctrl-C (or SIGTERM) during shrinking: the smallest failing case found before it.
            **({"shrink_interrupted": signal.Signals(result.interrupted).name} if result.interrupted else {}),
            "scenario": case.to_dict()}
    json_path = out / f"{base}.json"
    _write_text(json_path, json.dumps(info, indent=2, default=str) + "\n")
    return trace_path, json_path, command, toml_path


@dataclass
class Witness:
    """A written failure: the worker that wrote it, every worker whose shrunk
    case is the same, and the files and replay command ``write_failure`` gave
    (``scenario``: the scenario file, re-run by ``harness record``)."""

    worker: WorkerResult
    found_by: list[int]
    trace: Path
    json: Path
    command: str
    scenario: Path

    @property
    def record_command(self) -> str:
        """The ``harness record`` command that re-runs the scenario file (from the JSON)."""
        return json.loads(self.json.read_text())["record_command"]


def write_witnesses(out_dir: str | Path, spec: str, factory: CandidateFactory,
                    result: ParallelFuzzResult, semantics: str = "auto") -> list[Witness]:
    """Write each distinct shrunk case found by ``result``'s workers (see
    ``write_failure``), in worker order; workers that shrank to the same case
    share one set of files. One worker: ``fuzz-<candidate>-seed<S>.*``;
    N > 1 workers: ``fuzz-<candidate>-seed<S>-worker<i>of<N>.*`` (no clashes
    within a run, nor with runs of another worker count). Returns [] if
    nothing was found."""
    n = len(result.workers)
    groups: list[tuple[WorkerResult, list[int]]] = []
    for w in result.found:
        same = next((g for g in groups if g[0].result.case == w.result.case), None)
        if same is None:
            groups.append((w, [w.worker]))
        else:
            same[1].append(w.worker)
    out: list[Witness] = []
    for w, found_by in groups:
        name = None
        extra: dict[str, Any] = {}
        if n > 1:
            name = f"fuzz-{_slug(spec)}-seed{result.seed}-worker{w.worker}of{n}"
            extra = {"worker": w.worker, "workers": n, "worker_seed": w.seed,
                     "worker_max_examples": w.max_examples, "found_by_workers": found_by}
        trace, json_path, command, scenario = write_failure(out_dir, spec, factory, w.result, result.seed,
                                                            name=name, extra=extra, semantics=semantics)
        out.append(Witness(w, found_by, trace, json_path, command, scenario))
    return out
