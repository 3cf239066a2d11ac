"""Data parallelism: the coordinator's routing of arrivals to ranks.

vLLM 0.33.0's DP engine coordinator (spec 7.1): each arrival goes to the rank
with the fewest unfinished requests (ties: the lowest rank). ``check_steps``
(``harness.check.checker``) gives each rank its own model and checker and
calls these with a routing-only model that collects these violations.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.check.model import TraceModel
from harness.check.result import SEMANTICS, Invariant

INVARIANTS = [
    Invariant("DP-ROUTING", "Data parallelism: each arrival goes to the rank with the fewest unfinished requests (ties: the lowest rank), so each rank receives its share of a step's arrivals; every row names a valid rank.", "7.1 (engine coordinator)",
              SEMANTICS, "Routing to the rank with the fewest unfinished requests is the DP coordinator's design."),
]


def check_routing(routing: TraceModel, ranks: Sequence[TraceModel], events: list[dict]) -> None:
    """DP-ROUTING over one step's arrivals, against the ranks' unfinished-request
    counts before the step.

    Least-loaded routing depends on the loads only, never on which request
    comes first, so the number of a step's arrivals each rank receives is
    fixed by the loads and the number of arrivals, whatever their order. The
    trace lists each rank's rows apart (rank 0's first), which loses the order
    of arrivals across ranks: the check compares those counts, on every rank
    (issue 23: comparing request by request in arrival-time order fired on
    the reference's own trace when two requests arrived in one step on two
    ranks). A rank given more than its share is reported with its arrivals
    past that share."""
    load = [len(c.reqs) for c in ranks]
    arrivals = [ev for ev in events if ev["kind"] == "arrival"]
    if not arrivals:
        return
    expected = [0] * len(load)
    filled = list(load)
    for _ in arrivals:
        rank = min(range(len(filled)), key=lambda i: (filled[i], i))
        expected[rank] += 1
        filled[rank] += 1
    got: dict[int, list[str]] = {}
    for ev in arrivals:
        got.setdefault(ev.get("rank") or 0, []).append(ev["request_id"])
    for rank, rids in sorted(got.items()):
        share = expected[rank] if 0 <= rank < len(load) else 0
        for rid in rids[share:]:
            routing.violate("DP-ROUTING", rid,
                            f"routed to rank {rank}, which receives {len(rids)} of this step's "
                            f"{len(arrivals)} arrivals, but least-loaded routing gives it {share} "
                            f"(loads before the step {load}, shares {expected})")


def check_rank(routing: TraceModel, rank: int, dp: int) -> bool:
    """DP-ROUTING: a row names a rank in [0, data_parallel_size). False when not."""
    if not 0 <= rank < dp:
        routing.violate("DP-ROUTING", None, f"row for rank {rank} with data_parallel_size {dp}")
        return False
    return True
