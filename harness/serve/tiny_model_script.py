"""Write a tiny random-weight causal LM with ``save_pretrained`` (runs in the serving env).

Run by ``harness.serve.model.build_tiny_model`` under the serving env's Python
(``harness/serve/env.py``), which has the pinned ``torch`` and ``transformers``:
``python tiny_model_script.py OUT_DIR SEED ARCH VOCAB``. Imports only the standard
library, torch and transformers (no harness module: that env has none of our
dependencies).

The model: 2 layers, hidden size 256, 4 attention heads of 64 (2 KV heads where the
architecture has grouped-query attention), intermediate size 512, bf16, positions
up to 8192, BOS 1 / EOS 2 / PAD 0. Weights are drawn by transformers' own
initialisers after ``torch.manual_seed(SEED)``, on one thread, so the same seed
gives the same bytes (config.json, generation_config.json, model.safetensors).
No tokenizer is written: vLLM runs it with ``skip_tokenizer_init`` and token-id
prompts.
"""

from __future__ import annotations

import sys

ARCHS = ("llama", "qwen2", "opt")
MAX_POSITIONS = 8192


def _config(arch: str, vocab: int):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=MAX_POSITIONS,
                  torch_dtype="bfloat16")
    if arch == "llama":
        return transformers.LlamaConfig(intermediate_size=512, num_key_value_heads=2, head_dim=64, **common), \
            transformers.LlamaForCausalLM
    if arch == "qwen2":
        return transformers.Qwen2Config(intermediate_size=512, num_key_value_heads=2, **common), \
            transformers.Qwen2ForCausalLM
    if arch == "opt":
        common.pop("torch_dtype")
        return transformers.OPTConfig(ffn_dim=512, word_embed_proj_dim=256, torch_dtype="bfloat16",
                                      **common), transformers.OPTForCausalLM
    raise SystemExit(f"unknown arch {arch!r}: expected one of {', '.join(ARCHS)}")


def main(argv: list[str]) -> int:
    out, seed, arch, vocab = argv[0], int(argv[1]), argv[2], int(argv[3])
    import torch
    import transformers

    torch.set_num_threads(1)  # the same reductions in the same order: same bytes
    torch.manual_seed(seed)
    config, cls = _config(arch, vocab)
    model = cls(config).to(torch.bfloat16).eval()
    model.save_pretrained(out, safe_serialization=True)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(out)
    print(sum(p.numel() for p in model.parameters()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
