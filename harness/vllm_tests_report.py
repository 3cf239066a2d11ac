"""The report of ``harness vllm-tests``: each recording converted, checked, replayed.

Input: the plain and injected runs (``own_tests.RunResult``) and the recordings
folder (``manifest.jsonl``: one line per scheduler a test built). For every
recording: ``recording_convert.convert`` to a trace; ``check_trace`` under
``auto`` and ``safety``; when it checks clean and the release is one its profile
was measured on, ``replay`` on the reference (identical or diverged).

Artefacts (what is not a finding, by kind): a protocol break or a run stopped
by the driver (the footer's ``protocol``), rules not judged for a feature the
model cannot follow, a recording without a complete step, a configuration the
recorder does not record. A violation left after that is unexplained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

#: A protocol line's kind, by the words the converter writes (recording_convert).
_PROTOCOL_KINDS = (
    ("schedule() called with", "schedule-twice"),
    ("update_from_output() without a schedule", "update-without-schedule"),
    ("no schedule() returned", "hand-built-output"),
    ("running queue changed", "queue-edited"),
    ("called outside schedule()", "preempted-by-hand"),
    ("the scheduler was paused", "paused"),
    ("added again after it finished", "request-id-reused"),
    ("model output omits", "model-output-incomplete"),
    ("model output samples no token", "model-output-no-token"),
    ("model output samples a token for", "model-output-partial-prefill-token"),
    ("finish_requests() with", "finished-by-hand"),
    ("entered the waiting queue outside", "preempted-by-hand"),
    ("aborted between schedule", "mid-step-abort"),
    ("prefix cache was reset", "prefix-cache-reset"),
    ("streaming-input", "streaming-input"),
    ("stopped by the driver", "stopped-by-driver"),
    ("by hand (vLLM derived", "scheduler-flag-set-by-hand"),
    ("replaced on the instance by hand", "method-stubbed-by-hand"),
    ("set by hand (EngineCore adds a request with none computed)", "computed-set-by-hand"),
    ("an AsyncScheduler under a synchronous config", "async-scheduler-sync-config"),
)


def protocol_kind(line: str) -> str:
    """The kind of a footer ``protocol`` line (``other`` for one not listed)."""
    return next((kind for words, kind in _PROTOCOL_KINDS if words in line), "other")


@dataclass
class FileRow:
    """One test file's figures."""

    tests: int = 0
    plain_passed: int = 0
    injected_passed: int = 0
    recordings: int = 0
    converted: int = 0
    checkable: int = 0
    clean: int = 0
    artefacts: dict[str, int] = field(default_factory=dict)
    violations: int = 0
    replay_identical: int = 0
    replay_diverged: int = 0


def replay_blocked_by(trace) -> list[str]:
    """The recording's unmodelled features (``vllm_recording.unmodelled``) that
    keep the reference from re-driving it. A KV connector whose answers the
    trace recorded (its config's ``kv_connector_matches``: the reference
    answers as vLLM's connector did, ``reference.kv_connector.RecordedKVConnector``)
    is replayed, identical or diverged, not skipped; so are streaming-input
    sessions the config names (``resumable_request_ids``: the reference parks
    them when they stop, as vLLM does; the checker still skips the stop and
    liveness rules for them)."""
    unmodelled = set((trace.meta.get("vllm_recording") or {}).get("unmodelled") or {})
    if trace.config.kv_connector_matches is not None:
        unmodelled.discard("kv_connector")
    if trace.config.resumable_request_ids is not None:
        unmodelled.discard("streaming_input")
    return sorted(unmodelled)


def _file_of(nodeid: str | None) -> str:
    return (nodeid or "?").split("::", 1)[0]


def analyse(plain: dict[str, str], injected: dict[str, str], record_dir: Path, trace_dir: Path,
            version: str, log: Callable[[str], None] = lambda _: None,
            plain_messages: dict[str, str] | None = None) -> dict[str, Any]:
    """The report as a dict: ``plain_passed``, ``injected_passed``,
    ``broken_by_recorder`` (node ids passing plain and failing injected),
    ``recordings``, ``converted``, ``checkable``, ``clean``, ``artefacts``
    (``{kind: count}``), ``violations`` (unexplained: one dict each, with the
    test, recording, step, rule, message), ``replay_identical``,
    ``replay_diverged`` (counts; ``divergences``: each one), ``recorder_errors``
    (the recorder failed to start or stopped: defects of ours), ``refused`` (recordings that did not convert, with the
    reason), ``failed_plain`` (tests failing without the recorder, each with
    pytest's first message line from ``plain_messages``: not findings, but
    named, e.g. a test that needs a model the offline cache lacks),
    ``files`` (``{file: FileRow as a dict}``)."""
    from harness.candidates.resolve import resolve_candidate
    from harness.candidates.vllm.recording_convert import ConvertError, convert, recording_path
    from harness.check.checker import check_trace
    from harness.check.profiles import resolve as resolve_profile
    from harness.replay import replay
    from harness.trace.reader import TraceError, open_trace

    files: dict[str, FileRow] = {}
    for nodeid in sorted(set(plain) | set(injected)):
        row = files.setdefault(_file_of(nodeid), FileRow())
        row.tests += 1
        row.plain_passed += plain.get(nodeid) == "passed"
        row.injected_passed += injected.get(nodeid) == "passed"
    broken = sorted(n for n, o in plain.items() if o == "passed" and injected.get(n) != "passed")
    report: dict[str, Any] = {
        "version": version,
        "plain_passed": sum(o == "passed" for o in plain.values()),
        "injected_passed": sum(o == "passed" for o in injected.values()),
        "broken_by_recorder": broken, "recordings": 0, "converted": 0, "checkable": 0, "clean": 0,
        "artefacts": {}, "violations": [], "replay_identical": 0, "replay_diverged": 0, "divergences": [],
        "refused": [], "unrecorded": 0, "recorder_errors": [], "not_replayed": [],
        "failed_plain": [{"test": n, "reason": (plain_messages or {}).get(n, "")}
                         for n, o in sorted(plain.items()) if o == "failed"],
    }
    manifest = record_dir / "manifest.jsonl"
    entries = [json.loads(line) for line in manifest.read_text().splitlines()] if manifest.is_file() else []
    trace_dir.mkdir(parents=True, exist_ok=True)
    reference = resolve_candidate("reference")

    def not_replayed(entry: dict, reason: str) -> None:
        report["not_replayed"].append({"test": entry.get("nodeid"), "recording": entry["file"],
                                       "reason": reason})

    def artefact(row: FileRow, kind: str) -> None:
        row.artefacts[kind] = row.artefacts.get(kind, 0) + 1
        report["artefacts"][kind] = report["artefacts"].get(kind, 0) + 1

    for i, entry in enumerate(entries):
        if i and i % 25 == 0:
            log(f"checking recordings: {i} of {len(entries)}")
        row = files.setdefault(_file_of(entry.get("nodeid")), FileRow())
        if "unrecorded" in entry:
            report["unrecorded"] += 1
            if not str(entry["unrecorded"]).startswith("failed: "):  # a configuration it does not record
                artefact(row, "unrecorded-config")
            else:  # the recorder could not start: a defect of ours
                report["recorder_errors"].append({"test": entry.get("nodeid"), "recording": entry["file"],
                                                  "error": entry["unrecorded"]})
            continue
        row.recordings += 1
        report["recordings"] += 1
        src = record_dir / entry["file"]
        out = trace_dir / (Path(entry["file"]).stem + ".parquet")
        try:
            summary = convert(recording_path(src), out)
        except ConvertError as exc:
            report["refused"].append({"test": entry.get("nodeid"), "recording": entry["file"],
                                      "reason": str(exc)})
            continue
        except Exception as exc:  # the converter failed on a recording: a defect of ours, named
            report["refused"].append({"test": entry.get("nodeid"), "recording": entry["file"],
                                      "reason": f"converter error: {type(exc).__name__}: {exc}"})
            report["recorder_errors"].append({"test": entry.get("nodeid"), "recording": entry["file"],
                                              "error": f"convert raised {type(exc).__name__}: {exc}"})
            continue
        row.converted += 1
        report["converted"] += 1
        stopped = [w for w in summary["warnings"] if w.startswith("recording stopped early")]
        if stopped:  # the recorder raised while vLLM ran on (non-strict): a defect of ours
            report["recorder_errors"].append({"test": entry.get("nodeid"), "recording": entry["file"],
                                              "error": stopped[0]})
        try:
            trace = open_trace(out)
        except TraceError:  # no complete step (a test that never completed one)
            artefact(row, "no-complete-step")
            not_replayed(entry, _no_step_reason(out))
            continue
        row.checkable += 1
        report["checkable"] += 1
        protocol = trace.summary.get("protocol")
        if protocol:
            artefact(row, protocol_kind(protocol))
        for feature in sorted((trace.meta.get("vllm_recording") or {}).get("unmodelled") or {}):
            artefact(row, f"unmodelled-{feature}")
        try:
            results = {s: check_trace(trace, s) for s in ("auto", "safety")}
        except Exception as exc:  # the checker failed on a converted trace: a defect of ours
            report["recorder_errors"].append({"test": entry.get("nodeid"), "recording": entry["file"],
                                              "error": f"check raised {type(exc).__name__}: {exc}"})
            continue
        seen = set()
        for semantics, result in results.items():
            for v in result.violations:
                key = (v.invariant, v.step, v.request)
                if key in seen:
                    continue
                seen.add(key)
                row.violations += 1
                report["violations"].append({"test": entry.get("nodeid"), "recording": entry["file"],
                                             "semantics": semantics, "step": v.step,
                                             "invariant": v.invariant, "request": v.request,
                                             "message": v.message})
        if not all(r.ok for r in results.values()):
            not_replayed(entry, "violations")
            continue
        row.clean += 1
        report["clean"] += 1
        profile, _ = resolve_profile("auto", trace.meta)
        if version not in profile.versions:
            not_replayed(entry, f"vLLM {version} is not a release of the {profile.name} profile")
            continue
        blocked = replay_blocked_by(trace)
        if blocked:
            unmodelled = (trace.meta.get("vllm_recording") or {}).get("unmodelled") or {}
            artefact(row, "not-replayed-unmodelled")  # the reference cannot re-drive that feature
            not_replayed(entry, "unmodelled: " + "; ".join(f"{k}: {unmodelled.get(k, k)}" for k in blocked))
            continue
        try:
            divergence, _ = replay(trace, reference)
        except Exception as exc:  # a replay that cannot run is a divergence, named
            divergence = f"{type(exc).__name__}: {exc}"
        if divergence is None:
            row.replay_identical += 1
            report["replay_identical"] += 1
        else:
            row.replay_diverged += 1
            report["replay_diverged"] += 1
            report["divergences"].append({"test": entry.get("nodeid"), "recording": entry["file"],
                                              "divergence": str(divergence)[:300]})
    report["files"] = {name: vars(row) for name, row in sorted(files.items())}
    return report


def _no_step_reason(trace_path: Path) -> str:
    """Why a converted trace that ``open_trace`` refuses (no complete step) was
    not replayed: "no complete step", then the kind of the protocol break that
    ended it (``protocol_kind``) and its ``unmodelled`` features with their
    reasons, read from its Parquet metadata where it has them."""
    reason = "no complete step"
    try:
        import pyarrow.parquet as pq

        md = pq.read_metadata(trace_path).metadata or {}
        meta = json.loads(md.get(b"sched_harness", b"{}"))
        footer = json.loads(md.get(b"sched_harness_summary", b"{}"))
    except Exception:  # not a trace: nothing more to name
        return reason
    if footer.get("protocol"):
        reason += f" ({protocol_kind(footer['protocol'])})"
    unmodelled = (meta.get("vllm_recording") or {}).get("unmodelled") or {}
    if unmodelled:
        reason += "; unmodelled: " + "; ".join(f"{k}: {v}" for k, v in sorted(unmodelled.items()))
    return reason


def render(report: dict[str, Any]) -> list[str]:
    """The report as text lines: one table row per file, then totals and lists."""
    head = ("file", "tests", "plain", "injected", "recordings", "converted", "checkable", "clean",
            "violations", "replay =/≠", "artefacts")
    rows = []
    for name, r in report["files"].items():
        arts = ", ".join(f"{k} {v}" for k, v in sorted(r["artefacts"].items())) or "-"
        rows.append((name.removeprefix("tests/v1/core/"), r["tests"], r["plain_passed"], r["injected_passed"],
                     r["recordings"], r["converted"], r["checkable"], r["clean"], r["violations"],
                     f"{r['replay_identical']}/{r['replay_diverged']}", arts))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)) for line in (head, *rows)]
    lines.append(f"vLLM {report['version']}: {report['plain_passed']} passed plain, "
                 f"{report['injected_passed']} injected; {report['recordings']} recordings, "
                 f"{report['converted']} converted, {report['checkable']} checkable, {report['clean']} clean; "
                 f"replay {report['replay_identical']} identical, {report['replay_diverged']} diverged")
    for item in report["refused"]:
        lines.append(f"refused: {item['test']} ({item['recording']}): {item['reason']}")
    for v in report["violations"]:
        lines.append(f"violation: {v['test']} ({v['recording']}) step {v['step']} {v['invariant']} "
                     f"[{v['semantics']}]: {v['message']}")
    reasons: dict[str, int] = {}
    for item in report.get("not_replayed", ()):
        reasons[item["reason"]] = reasons.get(item["reason"], 0) + 1
    for reason, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"not replayed ({n}): {reason}")
    for d in report["divergences"]:
        lines.append(f"replay diverged: {d['test']} ({d['recording']}): {d['divergence']}")
    for e in report["recorder_errors"]:
        lines.append(f"recorder error: {e['test']} ({e['recording']}): {e['error']}")
    for item in report.get("failed_plain", ()):
        lines.append(f"failed without the recorder (not a finding): {item['test']}"
                     + (f": {item['reason']}" if item["reason"] else ""))
    for nodeid in report["broken_by_recorder"]:
        lines.append(f"broken by the recorder: {nodeid}")
    return lines
