"""Reference engine: a readable re-implementation of vLLM v1's scheduler and
KV-cache manager (target semantics: vLLM 0.33.0), with a scripted model runner."""

__version__ = "0.1.0"
VLLM_VERSION = "0.33.0"
