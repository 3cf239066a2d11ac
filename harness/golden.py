"""Golden traces: one reference recording per canonical scenario, pinned by a manifest.

``golden/<scenario>.parquet`` is the reference engine's trace of
``harness.scenarios.SCENARIOS[<scenario>]`` (the file
``harness/scenarios/<scenario>.toml``); ``golden/MANIFEST.json`` pins each
file (sha256) and what it was recorded from and says (config fingerprint,
engine, step and request counts). Recording is byte-deterministic, so a golden
changes only when the reference's decisions, the scenario, or the Parquet
writer change.

- ``check_goldens(dir, candidate_factory)``: every scenario has a golden whose
  bytes match the manifest, recorded from the scenario's current config,
  workload and seed; the trace passes every invariant; its numbers match the
  manifest; and the candidate, re-driven with its inputs, makes the same
  decisions. Goldens or manifest entries for no known scenario fail too.
- ``update_goldens(dir, names, prune)``: the only writer. Re-records each
  scenario to a temporary file, checks it, compares it with the old golden,
  renames it into place, and rewrites the manifest atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

import reference
from reference.candidate import CandidateFactory, CandidateRefused
from reference.config import ConfigError
from reference.scheduler import Scheduler
from reference.words import did_you_mean, plural

from harness.check import CheckResult, check_steps
from harness.paths import arrow_source
from harness.check.profiles import Profile
from harness.trace.recorder import record
from harness.replay import Divergence, OwnRun, first_difference, own_run, replay
from harness.scenarios import SCENARIOS, Scenario
from harness.trace import SCHEMA_VERSION, Trace, TraceError, open_trace
from harness.trace.schema import rows_as_of

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_VERSION = 1
GOLDEN_ENGINE = "reference"
SUFFIX = ".parquet"
# Counts pinned per scenario (CheckResult attribute names).
STATS = ("steps", "requests", "finished", "preemptions", "prefix_hit_tokens")
ENTRY_KEYS = frozenset({"file", "description", "config_fingerprint", "engine", "engine_version",
                        "sha256", *STATS})


#: The checkout's golden folder (``golden/`` beside the ``harness`` package).
CHECKOUT_DIR = Path(__file__).resolve().parents[1] / "golden"
#: Where a non-editable install puts the same files (package data ``harness.goldens``,
#: mapped from ``golden/`` in pyproject.toml): read-only by convention.
PACKAGED_DIR = Path(__file__).resolve().parent / "goldens"
#: The default wherever the command runs: the checkout's folder, else the installed copy.
DEFAULT_DIR = CHECKOUT_DIR if CHECKOUT_DIR.is_dir() else PACKAGED_DIR


class GoldenError(Exception):
    """The golden folder or its manifest is unusable (CLI exit 2). ``str()`` is one line."""


@dataclass
class GoldenResult:
    """Outcome of checking one scenario's golden (or one unused golden).

    ``reasons`` is empty when ok; ``unused`` marks a file or manifest entry
    for no known scenario; ``divergence`` is the candidate's first divergence;
    ``skipped`` says why the candidate could not replay it (it refused the
    config, e.g. a vLLM release without an option): not a failure.
    Under a profile that does not compare decisions (``check_goldens``'
    ``profile``: the fork gate, safety) a divergence is information, not a
    reason, and ``own_run`` is the candidate's own run of the golden's
    inputs, checked under that profile: its violations, crash or stall are
    the reasons then.
    """

    scenario: str
    reasons: list[str] = field(default_factory=list)
    steps: int | None = None
    replayed_steps: int | None = None
    divergence: Divergence | None = None
    unused: bool = False
    skipped: str = ""
    own_run: OwnRun | None = None

    @property
    def information(self) -> bool:
        """The candidate decides differently, which its profile does not hold against it."""
        return self.divergence is not None and self.own_run is not None

    @property
    def information_text(self) -> str:
        """The information line of a divergence its profile does not hold
        against the candidate ("" when there is none): where it first decides
        differently, and its own run's length (the pytest plugin's end-of-run
        section)."""
        if not self.information or self.divergence is None or self.own_run is None:
            return ""
        return (f"candidate diverges at {_describe_divergence(self.divergence)} (information); "
                f"own run: {plural(self.own_run.steps, 'step')}, no violation")

    @property
    def ok(self) -> bool:
        return not self.reasons

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


@dataclass
class GoldenChange:
    """What ``update_goldens`` did to one scenario's golden.

    ``status``: ``new``, ``unchanged``, ``changed``, ``removed`` (pruned),
    ``unused`` (a golden for no known scenario, kept without ``--prune``) or
    ``refused`` (the new recording stalled or broke an invariant; the old
    golden is kept). ``details`` are human-readable lines (counts ``a -> b``,
    the first divergent step vs the old golden, manifest fields changed).
    """

    scenario: str
    status: str
    old: dict[str, Any] | None = None
    new: dict[str, Any] | None = None
    details: list[str] = field(default_factory=list)
    first_divergence: Divergence | None = None


# ---------------------------------------------------------------- helpers

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def golden_path(directory: Path, name: str) -> Path:
    return Path(directory) / f"{name}{SUFFIX}"


def manifest_text(entries: dict[str, dict[str, Any]]) -> str:
    """The manifest's canonical text: sorted keys, indent 2, trailing newline."""
    doc = {"manifest_version": MANIFEST_VERSION, "scenarios": entries}
    return json.dumps(doc, sort_keys=True, indent=2) + "\n"


def read_manifest(directory: Path) -> dict[str, dict[str, Any]]:
    """The manifest's entries by scenario name. Raises GoldenError when the
    folder or manifest is missing or malformed."""
    directory = Path(directory)
    if not directory.is_dir():
        raise GoldenError(f"{directory}: no such golden folder")
    path = directory / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GoldenError(f"{path}: no manifest (create the goldens with 'harness golden update')") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise GoldenError(f"{path}: unreadable manifest ({exc})") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise GoldenError(f"{path}: manifest is not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("scenarios"), dict):
        raise GoldenError(f"{path}: manifest must be a JSON object with a 'scenarios' object")
    if doc.get("manifest_version") != MANIFEST_VERSION:
        raise GoldenError(f"{path}: unknown manifest version {doc.get('manifest_version')!r} "
                          f"(this harness reads version {MANIFEST_VERSION})")
    entries = doc["scenarios"]
    for name, entry in entries.items():
        if not isinstance(entry, dict):
            raise GoldenError(f"{path}: entry {name!r} is not a JSON object")
        missing = sorted(ENTRY_KEYS - set(entry))
        if missing:
            raise GoldenError(f"{path}: entry {name!r} lacks {', '.join(missing)}")
        for key in STATS:
            if not isinstance(entry[key], int) or isinstance(entry[key], bool):
                raise GoldenError(f"{path}: entry {name!r}: {key} must be an integer")
        for key in ENTRY_KEYS - set(STATS):
            if not isinstance(entry[key], str):
                raise GoldenError(f"{path}: entry {name!r}: {key} must be a string")
    return entries


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [f"{k} {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}"
            for k in sorted(set(old) | set(new)) if old.get(k, "(unset)") != new.get(k, "(unset)")]


def _stale_reasons(scenario: Scenario, trace: Trace | None, entry: dict[str, Any]) -> list[str]:
    """Why the golden no longer matches what the scenario would record."""
    config = scenario.engine_config()
    reasons = []
    if entry["config_fingerprint"] != config.fingerprint():
        if trace is not None and trace.meta["config_fingerprint"] == entry["config_fingerprint"]:
            what = ", ".join(_config_changes(trace.meta["config"], config.to_dict()))
        else:
            what = (f"manifest fingerprint {entry['config_fingerprint'][:12]} vs current "
                    f"{config.fingerprint()[:12]}")
        reasons.append(f"stale: config changed ({what}); run 'harness golden update'")
    if trace is None:
        return reasons
    if trace.meta["config_fingerprint"] != entry["config_fingerprint"]:
        what = ", ".join(_config_changes(trace.meta["config"], config.to_dict())) or "same as the scenario's"
        reasons.append(f"file's config fingerprint {trace.meta['config_fingerprint'][:12]} differs "
                       f"from the manifest's {entry['config_fingerprint'][:12]} (file -> scenario: "
                       f"{what})")
    workload = scenario.make_workload()
    recorded = trace.meta.get("workload", {})
    if recorded.get("sha256") != workload.sha256 or recorded.get("params") != workload.params:
        what = ", ".join(_config_changes(recorded.get("params") or {}, workload.params)) \
            or f"sha256 {str(recorded.get('sha256'))[:12]} -> {workload.sha256[:12]}"
        reasons.append(f"stale: workload changed ({what}); run 'harness golden update'")
    if trace.meta.get("seed") != scenario.seed:
        reasons.append(f"stale: seed changed ({trace.meta.get('seed')} -> {scenario.seed}); "
                       f"run 'harness golden update'")
    return reasons


def candidate_crashed(d: Divergence | None) -> bool:
    """True when ``d`` is the candidate raising where the golden run did not
    (``Divergence.field == "exception"``, as ``harness replay`` reads it):
    after the golden's last row (expected ``'no exception'``) or in the
    middle of a step whose golden rows go on (expected: the golden's row
    there, ``harness.replay._as_crash``; adversarial trial, finding 5: that
    case read "candidate diverges ... field exception" under the hint to try
    ``--semantics fork``)."""
    return d is not None and d.field == "exception"


def _describe_crash(d: Divergence) -> str:
    """A crash divergence (``candidate_crashed``) as one reason: the crash's
    line, and what the golden did there instead (nothing when it had no more
    rows or its step ended there)."""
    instead = ("" if d.expected in ("no exception", "end of step", None)
               else f": {d.expected} at event #{d.event_index}")
    return f"the {d.actual} (the golden run did not{instead})"


def _describe_divergence(d: Divergence) -> str:
    where = f"step {d.step}, event #{d.event_index}"
    if d.kind:
        where += f" ({d.kind}{' ' + d.request if d.request else ''})"
    return f"{where}, field {d.field}: expected {d.expected!r}, got {d.actual!r}"


def _check_summary(result: CheckResult) -> str:
    first = result.violations[0] if result.violations else None
    text = f"{result.num_violations} invariant violation(s)"
    if first is not None:
        text += f", first {first.invariant} at step {first.step}" + \
                (f" ({first.request})" if first.request else "") + f": {first.message}"
    return text


# ---------------------------------------------------------------- check

def check_goldens(directory: str | os.PathLike[str],
                  candidate_factory: CandidateFactory = Scheduler,
                  on_result: Callable[[GoldenResult], object] | None = None,
                  require_sealed: bool = True,
                  scenarios: Mapping[str, Scenario] | None = None,
                  profile: Profile | None = None) -> list[GoldenResult]:
    """Check every scenario's golden in ``directory`` (see the module docstring;
    ``on_result`` sees each scenario's result as it comes: progress).
    ``require_sealed`` (the default, as in the pytest plugin): a golden
    without tamper evidence (``Trace.sealed``) fails; a golden of a run that
    did not end (``Trace.incomplete``) always fails. ``scenarios``: the set
    the folder's goldens record (default ``SCENARIOS``; ``HYBRID_SCENARIOS``
    for ``golden/hybrid/``). ``profile`` (``harness golden check
    --semantics``; None: ``auto``, the goldens' decisions compared): under
    one that does not compare decisions (``harness.fuzz.run.compares_decisions``:
    the fork gate, safety) a decision that differs from the golden's is
    information, and the candidate's own run of that golden's inputs
    (``harness.replay.own_run``) is checked under ``profile`` instead: a
    violation, crash or stall there fails (the pytest plugin's
    ``--harness-semantics``).

    One result per scenario in ``SCENARIOS`` order, then one per unused
    golden file or manifest entry (sorted). Raises GoldenError when the
    folder or manifest is unusable.
    """
    directory = Path(directory)
    scenarios = SCENARIOS if scenarios is None else scenarios
    entries = read_manifest(directory)
    results = []
    for name, scenario in scenarios.items():
        results.append(_check_one(directory, scenario, entries.get(name), candidate_factory, require_sealed,
                                  profile))
        if on_result is not None:
            on_result(results[-1])
    files = _golden_files(directory)
    for name in sorted((files | set(entries)) - set(scenarios)):
        where = [w for w, present in (("file", name in files), ("manifest entry", name in entries))
                 if present]
        results.append(GoldenResult(name, [f"unused golden ({' and '.join(where)}): no scenario "
                                           f"named {name!r}; remove with 'harness golden update "
                                           f"--prune'"], unused=True))
    return results


def _golden_files(directory: Path) -> set[str]:
    """The scenario names of the golden files in ``directory`` (hidden ones not)."""
    return {p.name[:-len(SUFFIX)] for p in directory.glob(f"*{SUFFIX}") if not p.name.startswith(".")}


def unused_goldens(directory: str | os.PathLike[str], scenarios: Mapping[str, Scenario] | None = None) -> list[str]:
    """The names ``check_goldens`` reports as unused (a golden file or manifest
    entry in ``directory`` for no scenario in ``scenarios``, default
    ``SCENARIOS``), sorted. Raises GoldenError when the manifest is unusable."""
    directory = Path(directory)
    scenarios = SCENARIOS if scenarios is None else scenarios
    return sorted((_golden_files(directory) | set(read_manifest(directory))) - set(scenarios))


def _check_one(directory: Path, scenario: Scenario, entry: dict[str, Any] | None,
               factory: CandidateFactory, require_sealed: bool = True,
               profile: Profile | None = None) -> GoldenResult:
    name = scenario.name
    path = golden_path(directory, name)
    result = GoldenResult(name)
    if not path.is_file():
        result.reasons.append(f"missing golden {path.name}" +
                              ("" if entry is None else " (listed in the manifest)"))
        return result
    if entry is None:
        result.reasons.append(f"no manifest entry for {path.name}")
        return result
    if entry["file"] != path.name:
        result.reasons.append(f"manifest names file {entry['file']!r}, expected {path.name!r}")
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        result.reasons.append(f"sha256 mismatch: file {digest[:12]}, manifest {entry['sha256'][:12]} "
                              f"(edited or rewritten outside 'harness golden update')")
    try:
        trace = open_trace(path)
    except TraceError as exc:
        result.reasons += _stale_reasons(scenario, None, entry)
        result.reasons.append(str(exc))
        return result
    result.reasons += _stale_reasons(scenario, trace, entry)
    if require_sealed and not trace.sealed:
        result.reasons.append(f"{path.name}: unsealed: no tamper evidence (no trace_sha256 digest; "
                              f"re-record it with 'harness golden update')")
    if trace.incomplete is not None:
        result.reasons.append(f"{path.name}: incomplete run: {trace.incomplete}")
    if trace.meta.get("engine") != GOLDEN_ENGINE or entry["engine"] != GOLDEN_ENGINE:
        result.reasons.append(f"recorded by {trace.meta.get('engine')!r} (manifest "
                              f"{entry['engine']!r}), not {GOLDEN_ENGINE!r}")
    if trace.meta.get("engine_version") != entry["engine_version"]:
        result.reasons.append(f"file's engine_version {trace.meta.get('engine_version')!r} differs "
                              f"from the manifest's {entry['engine_version']!r}")
    try:
        checked = check_steps(trace.meta["config"], trace.iter_steps())
    except (TraceError, KeyError, TypeError) as exc:
        result.reasons.append(f"unreadable trace: {exc}")
        return result
    result.steps = checked.steps
    if not checked.ok:
        result.reasons.append(_check_summary(checked))
    mismatched = [f"{k} {entry[k]} in manifest, {getattr(checked, k)} in file"
                  for k in STATS if getattr(checked, k) != entry[k]]
    if mismatched:
        result.reasons.append("manifest counts differ: " + ", ".join(mismatched))
    try:
        divergence, compared = replay(trace, factory)
    except (TraceError, ConfigError) as exc:
        result.reasons.append(f"replay failed: {exc}")
        return result
    except CandidateRefused as exc:
        result.skipped = str(exc)
        return result
    result.replayed_steps = compared
    if divergence is None:
        return result
    result.divergence = divergence
    from harness.fuzz.run import compares_decisions

    if candidate_crashed(divergence):
        # Not a decision that differs: no semantics excuses it (adversarial
        # trial: a factory raising on every config read "diverges ... field
        # exception" under a hint to try --semantics fork).
        result.reasons.append(_describe_crash(divergence))
        return result
    if profile is None or compares_decisions(profile):
        result.reasons.append("candidate diverges at " + _describe_divergence(divergence))
        return result
    try:
        result.own_run = own = own_run(trace, factory, profile)
    except CandidateRefused as exc:
        result.skipped = str(exc)
        return result
    if own.result.num_violations:
        counts = ", ".join(f"{k} ×{n}" for k, n in sorted(own.result.by_invariant.items()))
        first = own.result.violations[0]
        result.reasons.append(f"the candidate's own run (profile {profile.name}): "
                              f"{plural(own.result.num_violations, 'violation')} ({counts}), first {first.invariant} at step {first.step}"
                              + (f" ({first.request})" if first.request else "") + f": {first.message}")
    if own.ended:
        result.reasons.append(f"the candidate's own run {own.ended}")
    return result


# ---------------------------------------------------------------- update

def update_goldens(directory: str | os.PathLike[str], names: Iterable[str] | None = None,
                   prune: bool = False, scenarios: Mapping[str, Scenario] | None = None) -> list[GoldenChange]:
    """Re-record the goldens of ``names`` (default: every scenario) into ``directory``.

    Each scenario is recorded by the reference to a temporary file in the
    folder and checked; if its bytes differ from the old golden it is renamed
    into place, else the old file is left untouched. The manifest is rewritten
    atomically (temp + rename) when its text changes. Goldens and manifest
    entries of scenarios that no longer exist are removed only with ``prune``,
    and only goldens the old manifest lists (a foreign ``*.parquet`` is kept).
    ``scenarios``: the set the folder records (default ``SCENARIOS``;
    ``HYBRID_SCENARIOS`` for ``golden/hybrid/``).
    Raises GoldenError for an unknown scenario name, or an unreadable
    manifest when only some scenarios are updated.
    """
    directory = Path(directory)
    scenarios = SCENARIOS if scenarios is None else scenarios
    if directory.resolve() == PACKAGED_DIR and not CHECKOUT_DIR.is_dir():
        raise GoldenError(f"{directory}: the installed package's copy of the goldens; "
                          f"re-record into a checkout's golden/ or pass --dir")
    selected = list(scenarios) if names is None else list(dict.fromkeys(names))
    unknown = [n for n in selected if n not in scenarios]
    if unknown:
        raise GoldenError(f"unknown scenario {unknown[0]!r}"
                          + (did_you_mean(unknown[0], scenarios) or " (harness/scenarios/ holds them)"))
    if directory.exists() and not directory.is_dir():
        raise GoldenError(f"{directory}: not a folder")
    directory.mkdir(parents=True, exist_ok=True)
    lock = _lock_folder(directory, scenarios)
    try:
        return _update_locked(directory, selected, names, prune, scenarios)
    finally:
        os.close(lock)


def _lock_folder(directory: Path, scenarios: Mapping[str, Scenario]) -> int:
    """Take the folder's update lock (``flock`` on the folder itself: no lock
    file), then remove what an earlier update killed mid-way (SIGKILL, a power
    cut) left in it (issue 26): the temporary files of ``_update_one`` and
    ``_write_atomic`` (``.NAME.XXXX.tmp``) and the segment folders of their
    recordings (``.NAME.XXXX.tmp.<hex>.tmp/``). Holding the lock, no other
    update is running, so every such name is debris. Returns the lock's file
    descriptor (close it to release). Raises GoldenError when another update
    of the folder is running."""
    import fcntl
    import shutil

    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise GoldenError(f"{directory}: another 'harness golden update' is updating this folder") from None
    owned = tuple(f"{dots}{name}." for name in (*(n + SUFFIX for n in scenarios), MANIFEST_NAME)
                  for dots in (".", ".."))
    for path in directory.iterdir():
        if path.name.startswith(owned) and path.name.endswith(".tmp"):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    return fd


def _update_locked(directory: Path, selected: list[str], names: Iterable[str] | None,
                   prune: bool, scenarios: Mapping[str, Scenario]) -> list[GoldenChange]:
    old_entries: dict[str, dict[str, Any]] = {}
    if (directory / MANIFEST_NAME).exists():
        try:
            old_entries = read_manifest(directory)
        except GoldenError as exc:
            if names is not None:
                raise GoldenError(f"{exc}; run 'harness golden update' without --scenario to "
                                  f"rebuild it") from None
    entries = dict(old_entries)
    changes: list[GoldenChange] = []
    pending: list[tuple[Path, Path]] = []  # (temporary file, golden) to rename into place
    try:
        for name in selected:
            change, tmp = _update_one(directory, scenarios[name], old_entries.get(name))
            changes.append(change)
            if change.new is not None:
                entries[name] = change.new
            if tmp is not None:
                pending.append((tmp, golden_path(directory, name)))
        for tmp, final in pending:
            os.replace(tmp, final)
        pending = []
    finally:
        for tmp, _ in pending:
            tmp.unlink(missing_ok=True)
    files = {p.name[:-len(SUFFIX)] for p in directory.glob(f"*{SUFFIX}") if not p.name.startswith(".")}
    for name in sorted((files | set(entries)) - set(scenarios)):
        if prune and name not in old_entries:
            # Regression (adversarial trial): --prune removed every *.parquet of the folder
            # for no scenario, a user's own traces included; only the manifest's goldens go.
            changes.append(GoldenChange(name, "unused", old=None,
                                        details=["not in the manifest (no golden this harness wrote): "
                                                 "kept, --prune or not"]))
        elif prune:
            golden_path(directory, name).unlink(missing_ok=True)
            changes.append(GoldenChange(name, "removed", old=entries.pop(name, None),
                                        details=["scenario no longer exists: golden removed"]))
        else:
            changes.append(GoldenChange(name, "unused", old=entries.get(name),
                                        details=["no scenario of that name; kept (pass --prune "
                                                 "to remove it)"]))
    text = manifest_text(entries)
    manifest = directory / MANIFEST_NAME
    try:
        current = manifest.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        current = None
    if current != text:
        _write_atomic(manifest, text)
    return changes


def _update_one(directory: Path, scenario: Scenario,
                old_entry: dict[str, Any] | None) -> tuple[GoldenChange, Path | None]:
    """Record ``scenario`` to a temporary file; return the change and the
    temporary file to rename into place (None: keep the old golden)."""
    name = scenario.name
    final = golden_path(directory, name)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        summary = record(scenario.make_workload(), scenario.engine_config(), tmp, seed=scenario.seed,
                         engine=GOLDEN_ENGINE, candidate_factory=Scheduler)
        new_trace = open_trace(tmp)
        checked = check_steps(new_trace.meta["config"], new_trace.iter_steps())
        old_file = final if final.is_file() else None
        if summary.stalled or not checked.ok:
            why = f"engine stalled: {summary.stalled}" if summary.stalled else _check_summary(checked)
            tmp.unlink()
            return GoldenChange(name, "refused", old=old_entry,
                                details=[f"the new recording is not conformant ({why}); old golden "
                                         f"kept"]), None
        entry = {
            "file": final.name,
            "description": scenario.description,
            "config_fingerprint": new_trace.meta["config_fingerprint"],
            "engine": GOLDEN_ENGINE,
            "engine_version": reference.__version__,
            "sha256": sha256_file(tmp),
            **{k: getattr(checked, k) for k in STATS},
        }
        change = GoldenChange(name, "new", old=old_entry, new=entry, details=[_stats_line(entry)])
        same_bytes = old_file is not None and sha256_file(old_file) == entry["sha256"]
        if old_file is None and old_entry is None:
            pass
        elif same_bytes and old_entry == entry:
            change.status = "unchanged"
        else:
            change.status = "changed"
            change.details = _change_details(old_file, old_entry, entry, new_trace, same_bytes, change)
        if same_bytes:
            tmp.unlink()
            return change, None
        return change, tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _stats_line(entry: dict[str, Any]) -> str:
    return (f"{plural(entry['steps'], 'step')}, {plural(entry['requests'], 'request')}, "
            f"{entry['finished']} finished, {plural(entry['preemptions'], 'preemption')}, "
            f"{plural(entry['prefix_hit_tokens'], 'prefix-hit token')}")


def _change_details(old_file: Path | None, old_entry: dict[str, Any] | None, entry: dict[str, Any],
                    new_trace: Trace, same_bytes: bool, change: GoldenChange) -> list[str]:
    details: list[str] = []
    if old_file is None:
        details.append("golden file was missing: recorded afresh")
    if old_entry is None:
        details.append("no manifest entry before")
    else:
        for key in STATS:
            if old_entry[key] != entry[key]:
                details.append(f"{key} {old_entry[key]} -> {entry[key]}")
        for key in ("description", "config_fingerprint", "engine", "engine_version", "file"):
            if old_entry[key] != entry[key]:
                details.append(f"{key} {old_entry[key]!r} -> {entry[key]!r}")
        if old_file is not None and old_entry["sha256"] != sha256_file(old_file):
            details.append("old file did not match its manifest sha256")
    if same_bytes or old_file is None:
        return details
    try:
        old_trace = open_trace(old_file)
    except TraceError as exc:
        details.append(f"old golden unreadable, not compared: {exc}")
        return details
    if old_trace.meta.get("config") != new_trace.meta.get("config"):
        changed = _config_changes(old_trace.meta.get("config") or {}, new_trace.meta["config"])
        details.append("config: " + ", ".join(changed))
    try:
        divergence = _first_divergence(old_trace, new_trace)
    except TraceError as exc:
        details.append(f"old golden unreadable, not compared: {exc}")
        return details
    old_version, new_version = (t.meta.get("schema_version") for t in (old_trace, new_trace))
    if divergence is None and old_version != new_version:
        details.append(f"schema {old_version} -> {new_version}: the same events in every step as "
                       f"schema {old_version} records them (rows and columns added only)")
    elif divergence is None:
        old_writer = pq.ParquetFile(arrow_source(old_file)).metadata.created_by
        new_writer = pq.ParquetFile(arrow_source(new_trace.path)).metadata.created_by
        writer = f" (writer {old_writer!r} -> {new_writer!r})" if old_writer != new_writer else ""
        details.append(f"same events in every step; only the file bytes differ{writer}")
    else:
        change.first_divergence = divergence
        details.append("first divergent step vs the old golden: " + _describe_divergence(divergence))
    return details


def _first_divergence(old: Trace, new: Trace) -> Divergence | None:
    """The first step whose events differ between ``old`` (expected) and
    ``new``, in what ``old``'s schema version records."""
    version = old.meta.get("schema_version", SCHEMA_VERSION)
    for old_step, new_step in zip_longest(old.iter_steps(), new.iter_steps()):
        if old_step is None or new_step is None:
            step = (old_step or new_step)[0]
            expected = f"step {step}" if old_step is not None else "end of trace"
            actual = f"step {step}" if new_step is not None else "end of trace"
            return Divergence(step, None, "event", expected, actual, 0, None, "",
                              old_step[1] if old_step else [], new_step[1] if new_step else [])
        if old_step[0] != new_step[0]:
            return Divergence(min(old_step[0], new_step[0]), None, "step", old_step[0], new_step[0],
                              0, None, "", old_step[1], new_step[1])
        # Compared as the old golden's schema records them: a schema bump
        # alone (added rows or columns) is no divergence.
        found = first_difference(old_step[0], old_step[1], rows_as_of(version, new_step[1]))
        if found is not None:
            return found
    return None
