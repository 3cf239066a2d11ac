"""How ``harness check`` and ``harness replay`` present their outcome: a
trace's ``CheckResult`` and, after a replay, the first ``Divergence``, as
one JSON object (``report_dict``) or as a text report (``render_report``).

May import ``harness.check``, ``harness.replay`` and ``harness.trace``
(rendering only: no run, no file written); ``harness.replay_cli`` and ``harness.check_cli`` call it with
its console, as it calls ``harness.diff.render_report``.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.brief import short, short_repr, short_text
from harness.check import MAX_PER_INVARIANT, CheckResult
from harness.check.invariants import INVARIANTS
from harness.replay import Divergence, OwnRun
from harness.trace import Trace
from harness.richtext import keep_words_whole
from reference.words import plural

#: What ``harness.check.profiles.resolve``'s reason says of an engine of unknown
#: origin (a ``module:factory`` fork's trace), which ``auto`` checks under safety.
FORK_TRACE_REASON = "is of unknown origin"


def report_dict(result: CheckResult, divergence: Divergence | None, trace: Trace,
                extra: dict[str, Any] | None = None, exit_code: int | None = None,
                allow_incomplete: bool = False) -> dict[str, Any]:
    """The JSON object of ``--json``: ``ok`` (no violation, no divergence),
    the trace and its engine, the check's counts (steps, requests, tokens,
    blocks), the violations (the first ``MAX_PER_INVARIANT`` of each
    invariant), ``notes`` (checks the trace cannot feed, e.g. "not checkable
    on schema 5") and the divergence (None if none); ``extra`` adds keys
    (``candidate``, ``replayed_steps``; ``divergence_is_information``: a
    replay under a profile without a version's semantics, the fork gate or
    safety, where a decision that differs is information, not a failure;
    ``own_run``: then the candidate's own run of the trace's inputs, an
    ``OwnRun``, written as its ``to_dict``).
    ``ok`` is what exit 0 means: no violation, no divergence (or one that is
    information) and a complete run; ``incomplete`` says why a run did not end
    (None when it did) and ``sealed`` whether the trace carries tamper evidence
    (``Trace.sealed``); ``verdict`` is the text report's last line. With
    ``exit_code`` (the command's): ``exit``, e.g. 0 for an incomplete run under
    ``--allow-incomplete`` (``allow_incomplete``), where ``ok`` stays false."""
    ok = result.ok and _divergence_ok(divergence, extra) and trace.incomplete is None
    return {"ok": ok, **({"exit": exit_code} if exit_code is not None else {}),
            "trace": str(trace.path), "engine": trace.meta.get("engine"),
            "sealed": trace.sealed, "incomplete": trace.incomplete,
            "verdict": verdict(result, divergence, extra, trace, allow_incomplete),
            "steps": result.steps, "requests": result.requests, "finished": result.finished,
            "rejected": result.rejected, "aborted": result.aborted,
            "preemptions": result.preemptions, "prefix_hit_tokens": result.prefix_hit_tokens,
            "draft_tokens": result.draft_tokens,
            "rejected_draft_tokens": result.rejected_draft_tokens,
            "deferred_frees": result.deferred_frees,
            "deferred_prefill_steps": result.deferred_prefill_steps,
            "remote_kv_loads": result.remote_kv_loads,
            "failed_kv_loads": result.failed_kv_loads,
            "profile": result.profile, "profile_reason": result.profile_reason,
            "num_violations": result.num_violations,
            "violations_by_invariant": result.by_invariant,
            "violations": [v.to_dict() for v in result.violations],
            "notes": list(result.notes),
            "divergence": divergence.to_dict() if divergence else None,
            # vllm@PATH / scheduler_cls: the version found, git commit and dirty flag, the class.
            **({"vllm_source": trace.meta["vllm_source"]} if trace.meta.get("vllm_source") else {}),
            **{k: v.to_dict() if isinstance(v, OwnRun) else v for k, v in (extra or {}).items()}}


def own_run_line(own: OwnRun, candidate: str | None) -> str:
    """The replay's line of the candidate's own run (the text report, and
    the HTML report of ``replay --report``): its length in steps, its
    violations or "no violation", why it ended early, and the profile."""
    return (f"own run: {candidate or 'the candidate'} re-run on the trace's workload, "
            f"config and seed from step 0: {plural(own.steps, 'step')}, "
            + ("no violation" if own.result.ok else f"{plural(own.result.num_violations, 'violation')}")
            + (f"; {own.ended}" if own.ended else "") + f" (profile {own.result.profile})")


def _own_run(extra: dict[str, Any] | None) -> OwnRun | None:
    own = (extra or {}).get("own_run")
    return own if isinstance(own, OwnRun) else None


def _divergence_ok(divergence: Divergence | None, extra: dict[str, Any] | None) -> bool:
    """No divergence, or one that is information (a differing decision under
    the fork gate or safety; a crash never is, nor one whose candidate's own
    run of the trace's inputs breaks a rule, crashes or stalls: ``own_run``)."""
    own = _own_run(extra)
    return divergence is None or (bool((extra or {}).get("divergence_is_information"))
                                  and divergence.field != "exception" and (own is None or own.ok))


def _violation_lines(result: CheckResult, console: Console) -> None:
    """Each violation with its rule and history, then the count of those not shown."""
    for v in result.violations:
        console.print(f"[bold red]VIOLATION[/] {v.invariant} at step {v.step}"
                      + (f", request {v.request}" if v.request else "") + f": {v.message}")
        inv = INVARIANTS[v.invariant]
        console.print(f"  rule ({inv.layer}): {inv.statement}", markup=False, highlight=False)
        for line in v.history:
            console.print(f"    {line}")
    if result.num_violations > len(result.violations):
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(result.by_invariant.items()))
        console.print(f"... {result.num_violations} violations in all ({counts}); "
                      f"the first {MAX_PER_INVARIANT} of each are shown")


def _vllm_source_line(source: dict[str, Any]) -> str:
    """``0.33.0 at /x/bin/python, git 1a2b3c4d5e6f (dirty), scheduler_cls m:C``."""
    parts = [str(source.get("version", "?")) + (f" at {source['python']}" if source.get("python") else "")]
    if source.get("git_commit"):
        parts.append(f"git {str(source['git_commit'])[:12]}" + (" (dirty)" if source.get("git_dirty") else ""))
    if source.get("scheduler_cls"):
        parts.append(f"scheduler_cls {source['scheduler_cls']}")
    return ", ".join(parts)


def render_report(result: CheckResult, divergence: Divergence | None, trace: Trace, console: Console,
                  extra: dict[str, Any] | None = None, allow_incomplete: bool = False) -> None:
    """Print the check's counts as a table, each violation with its rule and
    history, the divergence with both sides' rows of that step, and
    "conformant" when there is neither (with ``extra['replayed_steps']``
    after a replay)."""
    ok = result.ok and _divergence_ok(divergence, extra) and trace.incomplete is None
    table = Table(show_header=False, box=None)
    rows = [("trace", str(trace.path)), ("engine", trace.meta.get("engine")),
            *([("vLLM", _vllm_source_line(trace.meta["vllm_source"]))]
              if isinstance(trace.meta.get("vllm_source"), dict) else []),
            # After a replay: what was re-driven (the trace's engine is what recorded it).
            *([("candidate", extra["candidate"])] if extra and extra.get("candidate") else []),
            ("steps", result.steps), ("requests", result.requests),
            ("finished", result.finished), ("rejected", result.rejected),
            ("aborted", result.aborted), ("preemptions", result.preemptions),
            ("prefix-hit tokens", result.prefix_hit_tokens),
            ("profile", f"{result.profile}" + (f" ({result.profile_reason})" if result.profile_reason else ""))]
    if result.draft_tokens:
        rows.append(("draft tokens (rejected)", f"{result.draft_tokens} ({result.rejected_draft_tokens})"))
    if result.deferred_frees:
        rows.append(("deferred frees drained", result.deferred_frees))
    if result.deferred_prefill_steps:
        rows.append(("steps deferring prefills", result.deferred_prefill_steps))
    if result.remote_kv_loads:
        rows.append(("remote KV loads (failed)", f"{result.remote_kv_loads} ({result.failed_kv_loads})"))
    for label, value in rows:
        table.add_row(label, str(value))
    console.print(keep_words_whole(table))
    for note in result.notes:
        # A note that is a warning (e.g. config ids naming no request) says so once.
        label, text = ("warning:", note.removeprefix("warning: ")) if note.startswith("warning: ") else ("note", note)
        console.print(f"[yellow]{label}[/] {escape(text)}")
    _violation_lines(result, console)
    if divergence is not None and divergence.field == "exception":
        console.print(f"[bold red]CRASH[/] at step {divergence.step}: {escape(str(divergence.actual))} "
                      f"(the trace has {escape(str(divergence.expected))} at event #{divergence.event_index})",
                      soft_wrap=True)
    elif divergence is not None and _divergence_ok(divergence, extra):
        # Under the fork gate or safety a differing decision is information,
        # not an alarm (new-user trial: a red DIVERGENCE block above a
        # "conformant (profile fork)" verdict read as a failure in a CI log).
        console.print(f"[bold]decisions differ[/] (information) at step {divergence.step}, event "
                      f"#{divergence.event_index} ({divergence.kind or '-'}), request {divergence.request or '-'}, "
                      f"field {divergence.field}: trace {short_repr(divergence.expected)}, "
                      f"candidate {short_repr(divergence.actual)}")
    elif divergence is not None:
        console.print(f"[bold red]DIVERGENCE[/] at step {divergence.step}, event #{divergence.event_index}"
                      f" ({divergence.kind or '-'}), request {divergence.request or '-'}, "
                      f"field {divergence.field}: expected {short_repr(divergence.expected)}, "
                      f"got {short_repr(divergence.actual)}")
    if divergence is not None:
        if divergence.diff:
            console.print("\n".join(short_text(line) for line in divergence.diff.splitlines()))
        for side, rows in (("trace", divergence.context_expected), ("candidate", divergence.context_actual)):
            console.print(f"  {side} step {divergence.step}:")
            for row in rows[:12]:
                console.print("    " + brief_row(row))
    own = _own_run(extra)
    if own is not None:
        # Under the fork gate or safety, once decisions differ: the candidate's own run, checked.
        console.print(own_run_line(own, extra.get("candidate")), markup=False, highlight=False)
        _violation_lines(own.result, console)
    console.print(verdict(result, divergence, extra, trace, allow_incomplete),
                  style="bold green" if ok else "bold yellow" if allow_incomplete and _incomplete_only(
                      result, divergence, extra, trace) else "bold red",
                  markup=False, highlight=False)


def _incomplete_only(result: CheckResult, divergence: Divergence | None, extra: dict[str, Any] | None,
                     trace: Trace | None) -> bool:
    """An incomplete run with no violation and no divergence that counts."""
    return (trace is not None and trace.incomplete is not None and not result.num_violations
            and _divergence_ok(divergence, extra))


def verdict(result: CheckResult, divergence: Divergence | None, extra: dict[str, Any] | None = None,
            trace: Trace | None = None, allow_incomplete: bool = False) -> str:
    """The last line of ``check`` and ``replay``, naming the profile checked: "conformant
    (profile 0.33.0)", "conformant (profile 0.33.0): 20 steps replayed, identical decisions",
    or "2 violations of 1 invariant: MAX-NUM-SEQS ×2 (profile 0.33.0)", with "; first
    divergence at step 7" after a replay that diverged (``extra``: the replay's keys).
    With ``trace``: a run that did not end (``Trace.incomplete``) and shows no
    violation is "incomplete run (exit 3): no violation in the 80 steps it has
    (profile 0.33.0): salvaged ..." ("incomplete run (allowed by
    --allow-incomplete): ..." under ``allow_incomplete``, which exits 0), and an
    unsealed trace ends on "; unsealed: no tamper evidence" (issue 26)."""
    profile = f"(profile {result.profile or '?'})"
    if result.profile == "safety" and FORK_TRACE_REASON in result.profile_reason:
        # auto gives an engine of unknown origin (a module:factory fork's trace) safety only, by
        # design (docs/explanation/invariants.md, "Profiles"): the line says how to add the
        # progress layer (new-user trial: a progress bug passed the default check unnoticed).
        profile = "(profile safety; a fork's trace: add --semantics fork for the progress rules)"
    incomplete = trace.incomplete if trace is not None else None
    if _incomplete_only(result, divergence, extra, trace):
        how = "allowed by --allow-incomplete" if allow_incomplete else "exit 3"
        line = f"incomplete run ({how}): no violation in the {result.steps} steps it has {profile}: {incomplete}"
        if divergence is not None:  # under the fork gate or safety: information
            line += f"; decisions differ from step {divergence.step} (information: not held to a version's design)"
        elif extra:
            line += f"; {plural(extra['replayed_steps'], 'step')} replayed, identical decisions"
        return line + _seal_note(trace)
    if result.num_violations:
        n, k = result.num_violations, len(result.by_invariant)
        counts = ", ".join(f"{name} ×{count}" for name, count in sorted(result.by_invariant.items()))
        line = f"{n} violation{'s' * (n != 1)} of {k} invariant{'s' * (k != 1)}: {counts} {profile}"
    elif _own_run(extra) is not None and not _own_run(extra).ok:
        own = _own_run(extra)
        if own.result.num_violations:
            n, k = own.result.num_violations, len(own.result.by_invariant)
            counts = ", ".join(f"{name} ×{count}" for name, count in sorted(own.result.by_invariant.items()))
            line = (f"not conformant {profile}: the candidate's own run has {n} violation{'s' * (n != 1)} "
                    f"of {k} invariant{'s' * (k != 1)}: {counts}")
        else:
            line = f"not conformant {profile}: the candidate's own run {own.ended.split(':')[0]}"
    elif not _divergence_ok(divergence, extra):
        line = f"not conformant {profile}"
    else:
        line = f"conformant {profile}"
    if divergence is not None and divergence.field == "exception":
        line += f"; the candidate crashed at step {divergence.step}"
    elif divergence is not None and (_divergence_ok(divergence, extra) or _own_run(extra) is not None):
        line += f"; decisions differ from step {divergence.step} (information: not held to a version's design)"
    elif divergence is not None:
        line += f"; first divergence at step {divergence.step}"
    elif extra:
        line += f"{'; ' if result.num_violations else ': '}{plural(extra['replayed_steps'], 'step')} replayed, " \
                "identical decisions"
    # (A crash the check reports as ENGINE-CRASH needs no second mention.)
    if incomplete is not None and not (trace.summary.get("crashed") is not None
                                       and "ENGINE-CRASH" in result.by_invariant):
        line += f"; incomplete run: {incomplete}"
    return line + _seal_note(trace)


#: What an unsealed trace's verdict line ends on (``Trace.sealed``).
UNSEALED = "unsealed: no tamper evidence"


def _seal_note(trace: Trace | None) -> str:
    return f"; {UNSEALED}" if trace is not None and not trace.sealed else ""


def brief_row(row: dict[str, Any]) -> str:
    """One line for a row of a divergent step: its decision columns that are set."""
    keys = ("kind", "request_id", "schedule_kind", "num_computed_tokens", "num_scheduled_tokens",
            "num_prefix_hit_tokens", "block_ids", "token_ids", "finish_reason", "num_free_blocks")
    if row.get("kind") == "crash":  # status: the call, stop_reason: where
        keys = ("kind", "status", "message", "stop_reason")
    return short_text(" ".join(f"{k}={short(row[k])}" for k in keys if row.get(k) not in (None, [])))
