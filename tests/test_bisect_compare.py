"""``harness bisect`` compares releases by behaviour: a crash that only moved to
another source line is the same crash (harness/bisect/core.py ``first_divergence``).

Regression: bisect of priority-tight over 0.10.0..0.33.0 named 0.10.1.1 the first
change, for vLLM's closing ``assert`` of ``schedule()`` reported at scheduler.py:521
in 0.10.0 and :530 in 0.10.1.1, the same crash at the same step."""

from __future__ import annotations

from harness.bisect.core import first_divergence


class _Steps:
    def __init__(self, steps):
        self._steps = steps

    def iter_steps(self):
        return iter(self._steps)


def _crash(where: str, message: str = "AssertionError: `assert (len(scheduled_new_reqs) <= len(self.running))`"):
    return {"kind": "crash", "step": 3, "event_index": 1, "status": "schedule", "message": message,
            "stop_reason": where}


BEGIN = {"kind": "schedule_begin", "step": 3, "event_index": 0, "waiting": ["r000001"]}


def test_regression_a_crash_on_another_line_is_the_same_crash() -> None:
    a = _Steps([(3, [BEGIN, _crash("vllm/v1/core/sched/scheduler.py:521")])])
    b = _Steps([(3, [BEGIN, _crash("vllm/v1/core/sched/scheduler.py:530")])])
    assert first_divergence(a, b) is None


def test_a_crash_with_another_message_or_step_is_a_change() -> None:
    a = _Steps([(3, [BEGIN, _crash("vllm/v1/core/sched/scheduler.py:521")])])
    b = _Steps([(3, [BEGIN, _crash("vllm/v1/core/sched/scheduler.py:521", "KeyError: 'r000001'")])])
    assert first_divergence(a, b) == {"step": 3, "event_index": 1, "kind": "crash", "request": None,
                                      "field": "message", "a": _crash("")["message"], "b": "KeyError: 'r000001'"}
    c = _Steps([(3, [BEGIN, {**BEGIN, "kind": "schedule_end", "event_index": 1}]), (4, [BEGIN, _crash("x:1")])])
    assert first_divergence(a, c)["step"] == 3


def test_regression_a_piped_table_keeps_invariant_ids_whole() -> None:
    """Piped (80 columns), the table wrapped ``OUTPUT-ONLY-COMPLET`` / ``E ×1`` and printed
    ``step 3 crash  event`` (two spaces for a divergence without a request)."""
    import io

    from rich.console import Console

    from harness.bisect.cli import render
    from harness.bisect.core import BisectResult, Row

    verdict = ("SCHEDULED-SPAN ×7, COMPUTED-CONTINUITY ×2, OUTPUT-ONLY-COMPLETE ×1, "
               "SCHEDULED-NOT-PREEMPTED ×1")
    rows = [Row("0.10.1.1", "ran", verdict="ENGINE-CRASH ×1", profile="safety", steps=4, seconds=62.0),
            Row("0.10.2", "ran", verdict=verdict, profile="safety", steps=221, same_as_previous=False,
                compared_with="0.10.1.1", seconds=72.0,
                divergence={"step": 3, "kind": "crash", "request": None, "field": "event",
                            "a": "crash", "b": "schedule r000000"})]
    out = io.StringIO()
    render(BisectResult("priority-tight.toml", None, rows), Console(file=out, width=80, soft_wrap=True))
    text = out.getvalue()
    for word in ("OUTPUT-ONLY-COMPLETE", "SCHEDULED-NOT-PREEMPTED", "COMPUTED-CONTINUITY"):
        assert word in text, text
    decisions = " ".join(filter(None, (ln.split("│")[5].strip() for ln in text.splitlines() if ln.startswith("│"))))
    assert decisions == "(first) vs 0.10.1.1: step 3 crash event: crash -> schedule r000000", text
    assert text.rstrip().splitlines()[-1] == ("2 of 2 releases ran: first change at 0.10.2 (since 0.10.1.1): "
                                              f"verdict ENGINE-CRASH ×1 -> {verdict}; decisions diverge at step 3")
