"""The model-output stub: vLLM's ``ModelRunnerOutput`` built from the harness's sampled tokens.

Part of the driver (``driver.py`` and its ``driver_*.py`` siblings): runs
under a vLLM environment's Python, standard library (and vLLM inside
functions) only. No model runs: what a worker's ``GPUModelRunner.execute_model``
returns to ``Scheduler.update_from_output`` (``vllm/v1/outputs.py``:
``ModelRunnerOutput``, and its ``KVConnectorOutput`` of finished and failed
KV loads) is built from the tokens the harness sampled and the output of its
simulated KV-connector worker.
"""

from __future__ import annotations

import dataclasses

from . import events as ev
from .driver_errors import DriverError


class ModelRunnerOutputStub:
    """``Driver``'s half that stands in for the worker's output (reads
    ``ModelRunnerOutput``, ``kv_connector``)."""

    def _kv_connector_output(self, kv: dict | None):
        """vLLM's ``KVConnectorOutput`` for the harness's simulated worker
        output ``{finished_recving: [ids], invalid_block_ids: [ids]}``.

        ``finished_recving`` is a set in vLLM (the worker side aggregates
        sets, so the order ``_update_from_kv_xfer_finished`` frees in is
        hash-dependent); the harness processes transfers in load start order,
        so an insertion-ordered set view (dict keys) is passed: vLLM only
        iterates it."""
        if kv is None:
            return None
        if not self.kv_connector:
            raise DriverError("KV connector output sent with kv_connector off")
        from vllm.v1.outputs import KVConnectorOutput

        return KVConnectorOutput(**ev.kwargs_for(KVConnectorOutput, dict(
            finished_recving=dict.fromkeys(kv.get("finished_recving") or ()).keys(),
            invalid_block_ids=set(kv.get("invalid_block_ids") or ()))))

    def _model_runner_output(self, req_ids: list[str], sampled: dict[str, list[int]],
                             kv_connector_output=None):
        values = {
            "req_ids": req_ids,
            "req_id_to_index": {r: i for i, r in enumerate(req_ids)},
            "sampled_token_ids": [list(sampled.get(r, [])) for r in req_ids],
            "spec_token_ids": None, "logprobs": None, "prompt_logprobs_dict": {},
            "pooler_output": [], "kv_connector_output": kv_connector_output,
            "num_nans_in_logits": None,
        }
        cls = self.ModelRunnerOutput
        if dataclasses.is_dataclass(cls):
            kwargs = {}
            for f in dataclasses.fields(cls):
                if not f.init:
                    continue
                if f.name in values:
                    kwargs[f.name] = values[f.name]
                elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    kwargs[f.name] = None
            return cls(**kwargs)
        return cls(**ev.kwargs_for(cls, values))
