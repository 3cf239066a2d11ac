"""``harness scenario extract``: cut a recorded trace down to a scenario file.

``extract(trace, requests=..., steps=...)`` reads a trace (any engine: the
reference, a mutant, a torch-model run, a converted vLLM recording) and
returns the scenario file text (``workloads.scenario.dump_scenario``) whose
recording reproduces the trace's decisions for the chosen requests, plus the
reasons the cut may not be faithful.

What is kept, per chosen request, from its ``arrival`` (or ``reject``) row:
the prompt tokens, sampling parameters, priority, abort time/step, encoder
items, draft acceptance, and the arrival as the trace had it: ``arrival_step``
or ``after`` for a scenario's step-indexed arrivals, ``arrival_time`` for
timed ones. ``after`` naming a request outside the cut becomes
``arrival_step`` = the step it arrived at in the trace (what ``after``
resolved to there). The trace metadata gives ``[config]`` (vLLM names:
``EngineConfig.to_dict``, keys at their default left out, so the fingerprint
is the trace's) and ``seed``. ``output_token_ids`` are fixed from the trace's
``output`` rows when the scripted model cannot give them back: a real model
(metadata ``model``: the torch runner; ``vllm_recording``: a converted vLLM
log) or a request whose EOS position was scripted (``scripted_output_len``,
which has no scenario key).

Faithfulness. The policy: a cut that cannot be faithful is written anyway,
with one ``warning:`` line per reason (the CLI prints them on stderr and
exits 0: a near-miss is still the best start for a hand-edited bug report);
only unusable input is refused (``ExtractError``, exit 2, nothing written):
an unknown ``--requests`` id, a bad or empty ``--steps`` window, a cut with no
request. Reasons, found statically:

- a request outside the cut was live (arrived, not ended) in a step where a
  chosen one was: it held blocks, token budget or batch slots;
- ``--steps A:B`` starts after a chosen request arrived (a scenario cannot
  start a request mid-run: the file replays it from its arrival);
- a config key the format cannot carry (a vLLM recording's
  ``unmapped_config``), or a recording's own warnings;
- ``eos_token_id = None`` (no scenario key: written as the default).

and one found by running: the scenario is run on the reference (in memory,
or on ``verify_factory``) and the chosen requests' decisions are compared with
the trace's (``decisions``): the first difference is a warning. A cut of every
request is compared exactly (steps and block ids); a strict subset with steps
counted from each request's arrival and without block ids (block numbering
and, for timed arrivals, step numbering depend on the requests left out).
"""

from __future__ import annotations

import re

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from reference.candidate import CandidateCrash, CandidateFactory
from reference.config import EngineConfig
from reference.engine import EngineStalled
from reference.scheduler import Scheduler
from reference.words import did_you_mean, plural
from reference.workload import EOS_TOKEN_ID, Action, RequestSpec, Workload, WorkloadError
from workloads.scenario import dump_scenario, write_scenario_text

from harness.trace.reader import Trace
from harness.trace.recorder import run_to_rows, spec_from_row

__all__ = ["ExtractError", "Extraction", "decisions", "extract", "parse_steps"]

# The rows that are a request's decisions and results (what "the same decisions" compares).
_DECISION_KINDS = ("schedule", "withdraw", "preempt", "skip", "output", "finish", "abort", "reject",
                   "kv_load", "kv_promote", "encoder_plan", "draft")
_DECISION_FIELDS = ("schedule_kind", "num_computed_tokens", "num_scheduled_tokens", "num_prefix_hit_tokens",
                    "spec_token_ids", "token_ids", "status", "finish_reason", "stop_reason",
                    "num_output_tokens", "num_external_tokens", "encoder_input_ids")
_END_KINDS = ("finish", "abort", "reject")


class ExtractError(Exception):
    """An extract refused (bad ``--requests``/``--steps``); ``str()`` is one line."""


@dataclass(frozen=True)
class Extraction:
    """An extracted scenario: ``text`` (the TOML), the chosen ``request_ids``
    in file order, ``warnings`` (one line each; empty = faithful: the same
    decisions, verified by a run)."""

    text: str
    request_ids: tuple[str, ...]
    warnings: tuple[str, ...]

    def write(self, path: str | Path) -> Path:
        """Write ``text`` to ``path`` via a temp file renamed into place (``write_scenario_text``)."""
        return write_scenario_text(path, self.text)


def parse_steps(value: str) -> tuple[int, int]:
    """``"A:B"`` -> (A, B): the half-open step window [A, B) (Python slice
    rules; ``A:`` = to the end, ``:B`` = from step 0). Raises ExtractError."""
    a, sep, b = value.partition(":")
    # ASCII digits only: int() would also take "1_0" and full-width digits.
    if not all(re.fullmatch(r"[0-9]*", part.strip()) for part in (a, b)):
        raise ExtractError(f"--steps {value!r}: expected A:B (integers, B > A)")
    lo = int(a) if a.strip() else 0
    hi = int(b) if b.strip() else 2 ** 31
    if not sep or lo < 0 or hi <= lo:
        raise ExtractError(f"--steps {value!r}: expected A:B with 0 <= A < B")
    return lo, hi


def decisions(rows_by_step: Sequence[tuple[int, list[dict[str, Any]]]], request_ids: set[str], *,
              block_ids: bool, relative: bool) -> dict[str, list[tuple[Any, ...]]]:
    """Per request of ``request_ids``: its decision rows (kinds
    ``_DECISION_KINDS``) as tuples (step, kind, fields...) in trace order;
    with ``block_ids``, the row's block ids too. With ``relative``, steps count
    from the request's arrival step: a cut of timed arrivals runs fewer steps
    before a request arrives (an idle engine jumps its clock, not its step
    counter), so only the steps since arrival can be the same."""
    arrived: dict[str, int] = {}
    out: dict[str, list[tuple[Any, ...]]] = {r: [] for r in request_ids}
    for step, rows in rows_by_step:
        for row in rows:
            rid = row.get("request_id")
            if rid not in out:
                continue
            if row["kind"] in ("arrival", "reject"):
                arrived.setdefault(rid, step)
            if row["kind"] in _DECISION_KINDS:
                key = (step - arrived.get(rid, 0) if relative else step, row["kind"]) + tuple(
                    _norm(row.get(f)) for f in _DECISION_FIELDS)
                out[rid].append(key + ((_norm(row.get("block_ids")),) if block_ids else ()))
    return out


def _norm(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@dataclass
class _Life:
    spec: RequestSpec
    arrival_step: int
    end_step: int | None = None  # the step of its finish/abort/reject row; None: still live at the end
    output: list[int] | None = None


def extract(trace: Trace, *, requests: Sequence[str] | None = None, steps: tuple[int, int] | None = None,
            verify: bool = True, verify_factory: CandidateFactory = Scheduler,
            description: str | None = None, comments: Sequence[str] = ()) -> Extraction:
    """Cut ``trace`` down to a scenario (module docstring: what is kept, the
    faithfulness policy). ``requests``: the ids to keep (default all);
    ``steps``: keep only requests live in the half-open window [A, B). With
    ``verify``, run the scenario on ``verify_factory`` and compare decisions.
    ``description`` replaces the file's default one ("N of M requests of
    TRACE"); ``comments`` are added after the provenance comment.

    Raises ExtractError for an unknown request id or an empty cut; TraceError
    from reading the trace."""
    meta = trace.meta
    rows_by_step = list(trace.iter_steps())
    lives: dict[str, _Life] = {}
    order: list[str] = []  # arrival order in the trace
    for step, rows in rows_by_step:
        for row in rows:
            rid = row.get("request_id")
            if row["kind"] in ("arrival", "reject") and rid not in lives:
                lives[rid] = _Life(spec_from_row(row), step)
                order.append(rid)
            if row["kind"] in _END_KINDS and rid in lives:
                lives[rid].end_step = step
            if row["kind"] == "output" and rid in lives:
                lives[rid].output = (lives[rid].output or []) + list(row["token_ids"] or ())
    # File order: the scenario's own (request_order) where the trace has it, else arrival order.
    recorded_order = meta.get("workload", {}).get("params", {}).get("request_order")
    if isinstance(recorded_order, list) and set(recorded_order) == set(lives):
        order = list(recorded_order)
    chosen = list(order)
    if requests is not None:
        unknown = [r for r in requests if r not in lives]
        if unknown:
            raise ExtractError(f"{trace.path}: no request {', '.join(map(repr, unknown))} in the trace "
                               f"({plural(len(lives), 'request')})"
                               + did_you_mean(unknown[0], order, list_whole=False))
        wanted = set(requests)
        chosen = [r for r in order if r in wanted]
    warnings: list[str] = []
    if steps is not None:
        lo, hi = steps
        chosen = [r for r in chosen if lives[r].arrival_step < hi
                  and (lives[r].end_step is None or lives[r].end_step >= lo)]
        early = [r for r in chosen if lives[r].arrival_step < lo]
        if early:
            warnings.append(f"--steps {lo}:{hi} starts after {_ids(early)} arrived (step "
                            f"{min(lives[r].arrival_step for r in early)}): the scenario replays "
                            f"{'it' if len(early) == 1 else 'them'} from arrival")
    if not chosen:
        raise ExtractError(f"{trace.path}: the cut holds no request")
    chosen_set = set(chosen)
    warnings += _interactions(lives, chosen_set)
    recording = meta.get("vllm_recording")
    real_model = "model" in meta or recording is not None
    if recording is not None:
        if recording.get("unmapped_config"):
            warnings.append(f"vLLM config key(s) the scenario format cannot express: "
                            f"{', '.join(sorted(map(str, recording['unmapped_config'])))}")
        warnings += [f"vLLM recording: {w}" for w in recording.get("warnings") or ()]
    actions = _cut_actions(meta, chosen_set, len(chosen) == len(lives), warnings)
    specs = []
    for rid in chosen:
        life = lives[rid]
        spec = life.spec
        if spec.after is not None and spec.after not in chosen_set:
            # What `after` resolved to in the trace: the step it arrived at.
            # An abort_step before that step meant "abort on arrival": it becomes that step.
            abort_step = (None if spec.abort_step is None
                          else max(spec.abort_step, life.arrival_step))
            spec = replace(spec, after=None, arrival_step=life.arrival_step, arrival_time=0.0,
                           abort_step=abort_step)
        if spec.arrival_step is not None or spec.after is not None:
            spec = replace(spec, arrival_time=0.0)  # the clock the engine gave it: not an input
        if spec.output_token_ids is None and (real_model or spec.scripted_output_len is not None) \
                and life.output:
            spec = replace(spec, output_token_ids=tuple(life.output))
        spec = replace(spec, scripted_output_len=None)
        if spec.eos_token_id is None:
            warnings.append(f"{rid}: eos_token_id None has no scenario key: written as "
                            f"{EOS_TOKEN_ID} (the default)")
            spec = replace(spec, eos_token_id=EOS_TOKEN_ID)
        specs.append(spec)
    config = EngineConfig.from_dict(meta["config"])
    defaults = EngineConfig().to_dict()
    # A key at its default is left out, compared with its type: `watermark = 0` (int) fingerprints
    # unlike the default 0.0, so it is written back as the trace had it.
    config_table = {k: v for k, v in config.to_dict().items()
                    if k not in defaults or (type(defaults[k]), defaults[k]) != (type(v), v)}
    # A scenario says what a user sets, in vLLM's keys: batches in flight are derived from
    # async_scheduling and pipeline_parallel_size, never written themselves.
    config_table.pop("max_concurrent_batches", None)
    if config.pipeline_parallel_size != 1:
        config_table["pipeline_parallel_size"] = config.pipeline_parallel_size
    window = f", steps {steps[0]}:{steps[1]}" if steps is not None else ""
    wl = meta.get("workload", {})
    if verify:
        mismatch = _verify(specs, config, meta["seed"], rows_by_step, chosen_set,
                           block_ids=len(chosen) == len(lives), factory=verify_factory, actions=actions)
        if mismatch:
            warnings.append(mismatch)
    head = [f"Extracted by `harness scenario extract` from {trace.path.name}: engine {meta['engine']}, "
            f"workload {wl.get('source')} (sha256 {str(wl.get('sha256'))[:12]}), seed {meta['seed']}.",
            f"{len(chosen)} of {len(lives)} requests{window}.", *comments]
    head += [f"warning: {w}" for w in warnings]
    if description is None:
        description = f"{len(chosen)} of {len(lives)} requests of {trace.path.name}{window}"
    try:
        text = dump_scenario(specs, config_table, seed=meta["seed"], description=description, comments=head,
                             actions=actions)
    except WorkloadError as exc:  # every unexpressible field is replaced above
        raise ExtractError(f"{trace.path}: {exc}") from None
    return Extraction(text, tuple(chosen), tuple(warnings))


def _cut_actions(meta: dict[str, Any], chosen: set[str], whole: bool, warnings: list[str]) -> list[Action]:
    """The recorded workload's actions (``workload.params.actions``) for the cut:
    all of them for a cut of every request; otherwise abort actions keep only
    chosen ids (dropped when none is left), and a prefix-cache reset is kept
    with a warning (whether it succeeds depends on every request's blocks)."""
    out: list[Action] = []
    for d in meta.get("workload", {}).get("params", {}).get("actions") or ():
        action = Action.from_dict(d)
        if not whole and action.kind == "abort":
            ids = tuple(r for r in action.request_ids if r in chosen)
            if not ids:
                continue
            action = replace(action, request_ids=ids)
        elif not whole:
            warnings.append(f"the reset_prefix_cache action at step {action.step} is kept: its result "
                            f"depends on requests outside the cut too")
        out.append(action)
    return out


def _ids(ids: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(ids[:limit])
    return shown + (f" (+{len(ids) - limit} more)" if len(ids) > limit else "")


def _interactions(lives: dict[str, _Life], chosen: set[str]) -> list[str]:
    """Requests outside the cut live in a step where a chosen one was (they
    held blocks, budget or batch slots the chosen ones competed for)."""
    never = 2 ** 63  # a request still live when the trace ends
    spans = [(lives[r].arrival_step, never if lives[r].end_step is None else lives[r].end_step)
             for r in chosen]
    out = []
    for rid, life in lives.items():
        end = never if life.end_step is None else life.end_step
        if rid not in chosen and any(max(a, life.arrival_step) <= min(e, end) for a, e in spans):
            out.append(rid)
    if not out:
        return []
    return [f"{len(out)} request(s) outside the cut were live while chosen ones ran (they held blocks "
            f"and batch slots): {_ids(out)}"]


def _verify(specs: list[RequestSpec], config: EngineConfig, seed: int,
            rows_by_step: list[tuple[int, list[dict[str, Any]]]], chosen: set[str], *,
            block_ids: bool, factory: CandidateFactory, actions: Sequence[Action] = ()) -> str | None:
    """Run the scenario; None if the chosen requests' decisions equal the trace's,
    else a one-line description of the first difference."""
    got: list[tuple[int, list[dict[str, Any]]]] = []
    workload = Workload(source="scenario:extract", sha256="", params={}, requests=tuple(specs),
                        actions=tuple(actions))
    stalled = ""
    try:
        run_to_rows(workload, config, seed=seed, candidate_factory=factory,
                    on_step_rows=lambda step, rows: got.append((step, rows)))
    except EngineStalled as exc:
        stalled = f" (the re-run stalled: {exc})"
    except CandidateCrash as exc:  # its rows, up to the crash, are in `got`
        stalled = f" (the re-run crashed: {exc})"
    full = block_ids  # a cut of every request: absolute steps and block ids
    want = decisions(rows_by_step, chosen, block_ids=block_ids, relative=not full)
    have = decisions(got, chosen, block_ids=block_ids, relative=not full)
    for rid in sorted(chosen, key=lambda r: (want[r][:1], r)):
        w_list, h_list = want[rid], have[rid]
        if w_list == h_list:
            continue
        i = next((i for i, (w, h) in enumerate(zip(w_list, h_list)) if w != h),
                 min(len(w_list), len(h_list)))
        w = w_list[i] if i < len(w_list) else "nothing"
        h = h_list[i] if i < len(h_list) else "nothing"
        where = "since arrival " if not full else ""
        return (f"re-running the scenario gives {rid} other decisions{stalled}: its decision {i} is "
                f"{_show(h, where)}, the trace has {_show(w, where)}")
    return None


def _show(d: Any, where: str) -> str:
    if not isinstance(d, tuple):
        return str(d)
    step, kind = d[:2]
    fields = {k: v for k, v in zip(_DECISION_FIELDS, d[2:]) if v is not None}
    return f"{kind} at step {where}{step} {fields}"
