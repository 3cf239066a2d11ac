"""``harness bisect``: a workload over a range of vLLM releases (``core``), and its command (``cli``)."""
