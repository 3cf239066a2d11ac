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
    Invariant("DP-ROUTING", "Data parallelism: each arrival goes to the rank with the fewest unfinished requests (ties: the lowest rank); every row names a valid rank.", "7.1 (engine coordinator)",
              SEMANTICS, "Routing to the rank with the fewest unfinished requests is the DP coordinator's design."),
]


def check_routing(routing: TraceModel, ranks: Sequence[TraceModel], events: list[dict]) -> None:
    """DP-ROUTING over one step's arrivals, in (arrival_time, id) order, against
    the ranks' unfinished-request counts before the step."""
    load = [len(c.reqs) for c in ranks]
    arrivals = sorted((ev for ev in events if ev["kind"] == "arrival"),
                      key=lambda ev: (ev["arrival_time_s"], ev["request_id"]))
    for ev in arrivals:
        rank = ev.get("rank") or 0
        expected = min(range(len(load)), key=lambda i: (load[i], i))
        if rank != expected:
            routing.violate("DP-ROUTING", ev["request_id"],
                            f"routed to rank {rank}, but rank {expected} had the fewest unfinished "
                            f"requests (loads {load})")
        if 0 <= rank < len(load):
            load[rank] += 1


def check_rank(routing: TraceModel, rank: int, dp: int) -> bool:
    """DP-ROUTING: a row names a rank in [0, data_parallel_size). False when not."""
    if not 0 <= rank < dp:
        routing.violate("DP-ROUTING", None, f"row for rank {rank} with data_parallel_size {dp}")
        return False
    return True
