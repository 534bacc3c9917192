"""A tiny Llama written as a GGUF file, as llama.cpp writes one (for tests)."""

from pathlib import Path

import numpy as np

# ChatML, as SmolLM2-Instruct and Qwen write it: a default system message.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("1", "2"), ("a", "n"), ("<", "|")]


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A tiny Llama in GGUF form, as llama.cpp writes one: float32 tensors, a byte-level
    BPE vocabulary with merges and control tokens, special token ids and a chat template."""
    import gguf
    from tokenizers import pre_tokenizers

    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in MERGES]
    V, D, F, L, H, K = len(tokens), 32, 64, 2, 4, 2
    hd = D // H
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(K)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_token_types([3] * len(SPECIALS) + [1] * (V - len(SPECIALS)))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)

    def t(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    w.add_tensor("token_embd.weight", t(V, D))
    w.add_tensor("output_norm.weight", 1 + t(D))
    for i in range(L):
        for name, shape in (
            ("attn_norm", (D,)),
            ("attn_q", (H * hd, D)),
            ("attn_k", (K * hd, D)),
            ("attn_v", (K * hd, D)),
            ("attn_output", (D, H * hd)),
            ("ffn_norm", (D,)),
            ("ffn_gate", (F, D)),
            ("ffn_up", (F, D)),
            ("ffn_down", (D, F)),
        ):
            w.add_tensor(f"blk.{i}.{name}.weight", (1 + t(*shape)) if "norm" in name else t(*shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
