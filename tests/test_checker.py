"""Every invariant in the catalogue is shown to fire.

Scheduler bugs are shown by the mutants (harness mutants). ARRIVAL-ADMISSIBLE
guards the engine's input processor, not the scheduler, so it is shown on a
hand-made trace.
"""

from __future__ import annotations

from harness.check import TraceChecker
from harness.invariants import INVARIANTS
from harness.mutation import kill_matrix
from reference.config import EngineConfig

CONFIG = EngineConfig(num_gpu_blocks=30, block_size=4, max_model_len=96, max_num_seqs=4,
                      max_num_batched_tokens=64).to_dict()


def _arrival(rid: str, n: int) -> dict:
    return {"kind": "arrival", "request_id": rid, "prompt_token_ids": list(range(10, 10 + n)),
            "priority": 0, "arrival_time_s": 0.0, "max_tokens": 4, "min_tokens": 0,
            "ignore_eos": True, "eos_token_id": 2, "stop_token_ids": []}


def test_arrival_admissible_fires_on_an_overlong_accepted_prompt() -> None:
    checker = TraceChecker(CONFIG)
    checker.check_step(0, [_arrival("r0", 96)])
    (v,) = checker.result.violations
    assert (v.invariant, v.step, v.request) == ("ARRIVAL-ADMISSIBLE", 0, "r0")
    assert v.message == "accepted a prompt of 96 tokens with max_model_len 96"


def test_arrival_admissible_fires_on_a_needless_rejection() -> None:
    checker = TraceChecker(CONFIG)
    checker.check_step(0, [{**_arrival("r0", 95), "kind": "reject"}])
    (v,) = checker.result.violations
    assert v.message == "rejected a 95-token prompt that fits max_model_len 96"


def test_every_invariant_is_shown_to_fire() -> None:
    fired = {"ARRIVAL-ADMISSIBLE"}  # the two tests above
    for row in kill_matrix():
        for cell in row.cells.values():
            fired |= set(cell.result.by_invariant)
    assert sorted(set(INVARIANTS) - fired) == []
