"""Fixtures of the family tests: a clean scenario's rows, to doctor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from harness.scenarios import SCENARIOS
from harness.trace.recorder import run_to_rows

Rows = list[tuple[int, list[dict[str, Any]]]]


@pytest.fixture
def scenario_rows() -> Callable[[str], tuple[dict[str, Any], Rows]]:
    """``scenario_rows(name)``: (engine config dict, rows per step) of the
    reference engine on scenario ``name``, recorded in memory (fresh per call)."""
    def make(name: str) -> tuple[dict[str, Any], Rows]:
        scenario = SCENARIOS[name]
        rows: Rows = []
        run_to_rows(scenario.make_workload(), scenario.engine_config(), seed=scenario.seed,
                    on_step_rows=lambda step, step_rows: rows.append((step, step_rows)))
        return scenario.engine_config().to_dict(), rows
    return make


def _first_row(rows: Rows, kind: str, where: Callable[[dict[str, Any]], bool] = lambda row: True
               ) -> tuple[int, dict[str, Any]]:
    return next((step, row) for step, step_rows in rows for row in step_rows
                if row["kind"] == kind and where(row))


@pytest.fixture
def first_row() -> Callable[..., tuple[int, dict[str, Any]]]:
    """``first_row(rows, kind, where=...)``: the step and the first row of
    ``kind`` satisfying ``where`` (StopIteration if none)."""
    return _first_row
