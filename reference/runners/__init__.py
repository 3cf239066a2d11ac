"""Model runners: what executes a scheduled step and returns sampled tokens.

- ``base``: the ``ModelRunner`` protocol the engine drives, ``RunnerFactory``,
  and the adapter around the scripted runner.
- ``scripted``: the deterministic scripted model (tokens a pure function of
  seed, request and output index; draft proposals and acceptance patterns).
- ``torch_runner`` / ``torch_model``: a paged-attention runner over a small
  random-weight model (needs torch: ``pip install 'sched-harness[torch]'``).

Nothing is imported here: ``reference.config`` imports ``scripted`` and
``base`` imports the config, so eager imports would be circular.
"""
