"""``harness.replay._same`` (issue 24: compared at C speed) is exactly
``_normalise(expected) == _normalise(actual)``, on rows shaped as replay
meets them: a trace's row holds every column (nulls included), a fresh
run's only some, and either may hold a null or a value the other lacks."""

from __future__ import annotations

import random

import pytest

from harness.replay import _normalise, _same

KEYS = ["kind", "step", "request_id", "waiting", "running", "num_free_blocks", "message", "time"]
VALUES = [None, 0, 1, 1.5, "a", "b", [], ["r1", "r2"], ["r2", "r1"], [1, 2], True, float("nan")]


@pytest.mark.parametrize("seed", range(20))
def test_same_is_normalised_equality(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(500):
        expected = {k: rng.choice(VALUES) for k in KEYS}
        actual = {k: rng.choice(VALUES) for k in rng.sample(KEYS, rng.randint(0, len(KEYS)))}
        if rng.random() < 0.5:  # mostly equal rows, as in a replay that matches
            actual = {k: v for k, v in expected.items() if v is not None or rng.random() < 0.3}
            if actual and rng.random() < 0.5:
                key = rng.choice(list(actual))
                actual[key] = rng.choice(VALUES)
        assert _same(expected, actual) == (_normalise(expected) == _normalise(actual)), (expected, actual)


def test_same_examples() -> None:
    assert _same({"a": 1, "b": None}, {"a": 1})
    assert _same({"a": 1, "b": None}, {"a": 1, "b": None})
    assert not _same({"a": 1, "b": 2}, {"a": 1})          # a value the run lacks
    assert not _same({"a": 1, "b": 2}, {"a": 1, "b": None})
    assert not _same({"a": 1}, {"a": 1, "c": 3})          # a value the trace lacks
    assert not _same({"a": [1, 2]}, {"a": [2, 1]})
