"""Reference engine: a readable re-implementation of vLLM v1's scheduler and
KV-cache manager (target semantics: vLLM 0.33.0), with a scripted model runner.

What lives here is vLLM's semantics and nothing else, one module per vLLM
module it mirrors: ``config`` (``EngineConfig``), ``request``,
``request_queue``, ``kv_cache_utils``, ``block_pool``, ``kv_cache_manager``,
``encoder_cache_manager``, ``kv_connector``, ``scheduler``, ``output`` (the
normalised scheduler output and update types), ``candidate`` (the protocol a
scheduler implements to be recorded or replayed), ``guard`` and ``validate``
(the engine's side of the candidate boundary: every call into a candidate
guarded, its return values checked), ``engine`` (the step loop with a
virtual clock) and ``workload`` (the ``RequestSpec``/``Workload`` types
only; the loaders are in ``workloads/``). The model runners (scripted; a torch
paged-attention runner) are in ``reference/runners/``.

Import rule (``tests/test_layout.py``): ``reference`` never imports ``harness``
or ``workloads``, only the standard library and itself (torch only lazily, in
``reference/runners/torch_*``), so it reads, and runs, on its own. The layers
built on it are described in ``harness/__init__.py``.
"""

__version__ = "0.1.0"
VLLM_VERSION = "0.33.0"
