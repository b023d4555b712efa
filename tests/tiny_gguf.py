"""Tiny GGUF files written by the tests: a SentencePiece-BPE ('llama') vocabulary of 280 tokens (byte fallback, so
any text tokenizes) and, with `weights=True`, a 1-layer random-weight Llama of width 16 that sicl_fast.load turns
into a transformers model (through the verified cache) in well under a second."""
from __future__ import annotations

import numpy as np

TINY_NORMAL = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "▁w", "hell", "or", "▁wor", "hello",
               "▁hello", "▁world", "ld"]
TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\n"] + TINY_NORMAL


def write_tiny_gguf(path, *, model="llama", add_space_prefix=True, merges=None, weights=False, seed=0,
                    d=16, layers=1, heads=2, kv_heads=1, d_ff=32, store="F32"):
    """Write the GGUF file; returns (path, {token: id}). store: the matrices' type, 'F32', 'BF16' (rounded), or
    'Q8_0' (ffn_down quantised, the others BF16); the norms are F32."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64 if not weights else 4096)
    w.add_tokenizer_model(model)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.USER_DEFINED] + [gguf.TokenType.NORMAL] * len(TINY_NORMAL)
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * 260 + [-float(i) for i in range(len(TINY_NORMAL))])
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(not weights)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(add_space_prefix)
    if weights:
        hd = d // heads
        w.add_embedding_length(d)
        w.add_block_count(layers)
        w.add_feed_forward_length(d_ff)
        w.add_head_count(heads)
        w.add_head_count_kv(kv_heads)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_freq_base(10000.0)
        w.add_rope_dimension_count(hd)
        rng = np.random.default_rng(seed)

        def r(*shape):
            return (rng.standard_normal(shape) * 0.2).astype(np.float32)

        def matrix(name, *shape):
            x = r(*shape)
            if store == "Q8_0" and name.startswith("blk.0.ffn_down"):  # rows of d_ff = 32: one Q8_0 block each
                w.add_tensor(name, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                             raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            elif store in ("BF16", "Q8_0"):  # the upper half of each float32: a bf16 value
                w.add_tensor(name, (x.view(np.uint32) >> 16).astype(np.uint16), raw_shape=shape,
                             raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                w.add_tensor(name, x)

        matrix("token_embd.weight", len(TOKENS), d)
        for i in range(layers):
            for name, shape in (("attn_q", (d, d)), ("attn_k", (kv_heads * hd, d)), ("attn_v", (kv_heads * hd, d)),
                                ("attn_output", (d, d)), ("ffn_gate", (d_ff, d)), ("ffn_up", (d_ff, d)),
                                ("ffn_down", (d, d_ff))):
                matrix(f"blk.{i}.{name}.weight", *shape)
            w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, np.float32))
            w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, np.float32))
        w.add_tensor("output_norm.weight", np.ones(d, np.float32))
        matrix("output.weight", len(TOKENS), d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, {t: i for i, t in enumerate(TOKENS)}
