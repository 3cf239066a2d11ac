"""``ChildPool`` (harness/children.py): the reuse rules the isolated candidate
and the vLLM driver share (they had one copy each)."""

from __future__ import annotations

from harness.children import ChildPool


class _Fake:
    def __init__(self, pool: ChildPool, name: str) -> None:
        self.pool, self.name, self.up, self.killed = pool, name, True, 0
        pool.add(self)

    def alive(self) -> bool:
        return self.up

    def kill(self) -> None:
        self.up = False
        self.killed += 1
        self.pool.forget(self)


def test_released_child_is_reused_for_its_key_only() -> None:
    pool = ChildPool(size=2)
    a = pool.acquire("spec-a", lambda: _Fake(pool, "a"))
    pool.release("spec-a", a, reusable=True)
    assert pool.acquire("spec-a", lambda: _Fake(pool, "new")) is a
    pool.release("spec-a", a, reusable=True)
    assert pool.acquire("spec-b", lambda: _Fake(pool, "b")).name == "b"


def test_unhealthy_dead_or_surplus_children_are_killed() -> None:
    pool = ChildPool(size=1)
    sick, extra, dead = (_Fake(pool, n) for n in ("sick", "extra", "dead"))
    pool.release("k", sick, reusable=False)
    assert sick.killed == 1
    pool.release("k", dead, reusable=True)        # kept: room, alive
    dead.up = False                               # then it died while idle
    pool.release("k", extra, reusable=True)       # no room: the idle list holds one
    assert extra.killed == 1
    fresh = pool.acquire("k", lambda: _Fake(pool, "fresh"))
    assert fresh.name == "fresh" and dead.killed == 1


def test_kill_all_kills_every_live_child_and_keeps_nothing_after() -> None:
    pool = ChildPool(size=2)
    busy, idle = _Fake(pool, "busy"), _Fake(pool, "idle")
    pool.release("k", idle, reusable=True)
    pool.kill_all()
    assert (busy.killed, idle.killed) == (1, 1) and pool.live() == set()
    late = _Fake(pool, "late")
    pool.release("k", late, reusable=True)        # exiting: not kept
    assert late.killed == 1
