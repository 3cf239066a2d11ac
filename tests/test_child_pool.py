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


def test_acquire_waits_for_a_child_started_in_the_background_instead_of_starting_another() -> None:
    """``expect``/``arrived`` (the vLLM drivers' ``prestart_in_background``, which ``fuzz`` calls):
    a candidate needing a child while one is being started gets that one; whichever comes first,
    the release or the acquire, ``start`` is never called."""
    import threading

    pool = ChildPool(size=2)
    pool.expect("k", 1)
    assert pool.pending_count("k") == 1
    child = _Fake(pool, "prestarted")

    def prestart() -> None:
        pool.release("k", child, reusable=True)
        pool.arrived("k")

    thread = threading.Thread(target=prestart)
    thread.start()
    got = pool.acquire("k", lambda: _Fake(pool, "started"))
    thread.join()
    assert (got, pool.pending_count("k")) == (child, 0)


def test_a_background_start_that_failed_lets_acquire_start_its_own() -> None:
    pool = ChildPool(size=2)
    pool.expect("k", 2)
    failed = _Fake(pool, "failed")
    failed.up = False                      # it died during its start
    pool.release("k", failed, reusable=True)
    pool.arrived("k")
    pool.arrived("k")                      # the second never started
    assert pool.acquire("k", lambda: _Fake(pool, "started")).name == "started"
    assert failed.killed == 1 and pool.pending_count("k") == 0


def test_regression_prestarted_drivers_are_started_by_the_calling_thread(monkeypatch) -> None:
    """Regression: ``prestart_in_background`` started the vLLM drivers inside its daemon thread;
    a child's parent-death signal follows the thread that forked it, so the drivers were killed
    (exit 143 during their first ``init``) as soon as that thread ended, and ``fuzz`` reported an
    ENGINE-CRASH on its first example. They are started by the caller now; only the wait for their
    import runs in the thread, and a candidate acquiring one meanwhile gets one of them."""
    import threading
    from types import SimpleNamespace

    from harness.candidates.vllm import candidate as vllm_candidate

    pool = ChildPool(size=2)
    monkeypatch.setattr(vllm_candidate, "POOL", pool)
    started_in: list[str] = []

    class FakeDriver(_Fake):
        def __init__(self, target) -> None:
            super().__init__(pool, f"driver{len(started_in)}")
            started_in.append(threading.current_thread().name)
            self.key, self.started, self.pid = vllm_candidate._pool_key(target), False, len(started_in)

        def call(self, msg):
            self.started = True
            return {}

    monkeypatch.setattr(vllm_candidate, "_DriverProcess", FakeDriver)
    target = SimpleNamespace(version="0.33.0", pool_key="fake")
    monkeypatch.setattr(vllm_candidate, "release_target", lambda version: target)
    thread = vllm_candidate.prestart_in_background("0.33.0", 2)
    got = pool.acquire(vllm_candidate._pool_key(target), lambda: _Fake(pool, "started by acquire"))
    thread.join()
    assert started_in == [threading.current_thread().name] * 2
    assert got.name in ("driver0", "driver1") and got.started
    assert vllm_candidate.prestart_in_background("0.33.0", 1) is None  # one idle: enough
