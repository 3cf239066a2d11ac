"""The virtual clock a trace records must follow its config's timing model.

Every recorder (the reference engine loop, a vLLM candidate driven through
it, a converted vLLM recording) stamps each step's ``schedule_begin`` (or,
without one, ``update_begin``) with the virtual time at step start
(``clock_s``, seconds), computed by one model (``reference.engine``,
``Engine.run``): a step lasts ``step_fixed_s + step_per_token_s * T`` (T:
the step's ``total_num_scheduled_tokens``, the busiest rank's under data
parallelism), a step number skipped while idle or stuck costs
``step_fixed_s``, and the clock jumps forward only to a timed arrival or
abort it then takes. The clock is the harness's, never an engine's
decision, so a clock off the model is an edit of the trace (issue 26:
``replay`` caught it, ``check`` did not): ``VirtualClock.check_step``
raises RowError, which the reader reports as one line (exit 2).

Memory: the abort times of arrived requests that carry one (a dict), and
the previous step's figures.
"""

from __future__ import annotations

from typing import Any

from harness.trace.validate import RowError

Row = dict[str, Any]
# The kinds ``check_step`` reads.
_CLOCK_KINDS = frozenset({"schedule_begin", "update_begin", "schedule_end", "arrival", "reject", "abort",
                          "finish"})


def _close(a: float, b: float) -> bool:
    """Equal up to float rounding of sums over many steps (1e-9 relative)."""
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


class VirtualClock:
    """Follows the clock step by step (``check_step`` in file order).

    ``step_fixed_s``, ``step_per_token_s``: the config's timing model
    (``reference.config.EngineConfig``)."""

    def __init__(self, step_fixed_s: float, step_per_token_s: float) -> None:
        self.fixed = step_fixed_s
        self.per_token = step_per_token_s
        self._step = -1        # the previous step
        self._end = 0.0        # the clock at its end (its start + its duration)
        self._abort_times: dict[str, float] = {}

    def check_step(self, step: int, rows: list[Row]) -> None:
        """Raise RowError when the step's ``clock_s`` is not the model's (same
        value on every rank; the previous step's end plus ``step_fixed_s``
        per skipped step, or a timed arrival or abort taken in this step)."""
        base = self._end + self.fixed * (step - self._step - 1)
        targets = []
        clocks = []
        total = None  # the busiest schedule_end's total_num_scheduled_tokens
        abort_times = self._abort_times
        for row in rows:  # one pass; most rows (schedule, output, ...) take one set lookup
            kind = row["kind"]
            if kind not in _CLOCK_KINDS:
                continue
            if kind == "schedule_end":
                tokens = row.get("total_num_scheduled_tokens") or 0
                if total is None or tokens > total:
                    total = tokens
            elif kind == "schedule_begin" or kind == "update_begin":
                if row.get("clock_s") is not None:
                    clocks.append((row["event_index"], row["clock_s"]))
            elif kind == "arrival" or kind == "reject":
                if row.get("arrival_time_s") is not None:
                    targets.append(row["arrival_time_s"])
                if kind == "arrival" and row.get("abort_time_s") is not None:
                    abort_times[row["request_id"]] = row["abort_time_s"]
            elif kind == "abort":
                if row.get("request_id") in abort_times:
                    targets.append(abort_times.pop(row["request_id"]))
            else:  # finish
                abort_times.pop(row.get("request_id"), None)
        jumped = max([t for t in targets if t > base], default=None)
        if not clocks:
            start = base if jumped is None else jumped
        else:
            index, start = clocks[0]
            for other_index, other in clocks[1:]:
                if other != start:
                    raise RowError(f"step {step} event {other_index}: clock_s {other!r} differs from "
                                   f"{start!r} at event {index} (every rank starts a step at one time)")
            if not _close(start, base) and not any(t > base and _close(start, t) for t in targets):
                why = (f"the previous step (step {self._step}) ends at {self._end!r}"
                       + (f", plus step_fixed_s {self.fixed} for each of the {step - self._step - 1} "
                          f"skipped step(s)" if step - self._step > 1 else ""))
                raise RowError(f"step {step} event {index}: clock_s {start!r} does not follow the config's "
                               f"timing model: expected {base!r} ({why}; step_fixed_s {self.fixed} + "
                               f"step_per_token_s {self.per_token} x tokens scheduled), or a timed "
                               f"arrival or abort taken in this step")
        if total is None:
            total = 0
        self._step = step
        self._end = start + (self.fixed + self.per_token * total)
