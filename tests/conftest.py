"""Shared fixtures: a tiny random GQA Llama (unit tests) and the bundled SmolLM2 (integration tests)."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# The suite runs in two pytest-xdist workers (pyproject's addopts), one per core. Each worker, and what it starts (a
# notebook kernel, the kvpress worker, Ray), computes on one thread: on this 2-core machine a torch process with two
# threads beside another busy process runs 5-20x slower (its OpenMP regions wait for a preempted thread;
# docs/performance.md). Run alone (-n 0), a test process has both cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", SNAPKV_LAB_THREADS="1")
    torch.set_num_threads(1)
else:
    torch.set_num_threads(2)


# Files whose tests start Jupyter kernels (the notebooks share one kernel per process; the browser tests start
# JupyterLab) run in one worker, one after the other, as they did before the suite ran in parallel.
KERNEL_FILES = ("test_notebook", "test_browser")
# The groups that take longest (docs/performance.md, summed --durations=0 of a clean-clone run), handed out first so
# that neither worker starts one as the other runs out of work (xdist's own order, pyproject's --no-loadscope-reorder
# aside, would be by number of tests: the kernel group, 300 s in 12 tests, came late).
LONGEST_GROUPS = ("kernels", "test_peer", "test_budgets", "test_gemma", "test_sweep_grid", "test_docs")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Each test file is one xdist group (its module-scoped fixtures, such as the kvpress worker, built once); the
    kernel files are one group between them. The longest groups come first (LONGEST_GROUPS), the rest as collected."""
    groups = {}
    for item in items:
        name = item.path.stem
        groups[item.nodeid] = "kernels" if name.startswith(KERNEL_FILES) else name
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    rank = {group: i for i, group in enumerate(LONGEST_GROUPS)}
    items.sort(key=lambda item: rank.get(groups[item.nodeid], len(rank)))  # stable: a file's tests keep their order


class ByteTokenizer:
    """Just enough tokenizer for the tiny model: one token per byte, no special tokens but EOS = 0."""

    eos_token_id = 0
    vocab_size = 256

    def __call__(self, text, add_special_tokens=True, return_tensors=None):
        ids = list(text.encode())
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}

    def decode(self, ids, skip_special_tokens=False):
        return bytes(int(i) for i in ids).decode(errors="replace")


def make_tiny_llama(attn_implementation: str = "sdpa", seed: int = 0, **overrides) -> LlamaForCausalLM:
    """2 layers, 4 query heads sharing 2 KV heads, head_dim 16; same weights for the same seed."""
    torch.manual_seed(seed)
    settings = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                    eos_token_id=0, bos_token_id=1, pad_token_id=0)
    config = LlamaConfig(**{**settings, **overrides})
    config._attn_implementation = attn_implementation
    return LlamaForCausalLM(config).eval()


def eager_twin(model):
    """Same weights under eager attention: a deep copy (its own config, which it would share otherwise; its parameters
    and buffers copied rather than initialised at random and then overwritten, which took seconds on a real model)."""
    twin = copy.deepcopy(model)
    twin.config._attn_implementation = "eager"
    return twin.eval()


def gguf_reference(path):
    """transformers' own fp32 load of a GGUF file (the reference a converted copy is checked against), its header
    parsed once rather than once for the config and again for the weights (models.gguf_parsed_once)."""
    from transformers import AutoModelForCausalLM

    from snapkv_lab.core.models import gguf_parsed_once

    with gguf_parsed_once():
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def build_with_tail(name: str, tail: int, **settings):
    """The registered policy `name` with a kept tail of `tail` tokens, for prompts too short for the defaults: SnapKV's
    family (and a wrapper's default inner SnapKV) votes with that many queries and keeps them, as SnapKV alone; the
    others keep `tail` last tokens by right. FullCache takes no settings."""
    import dataclasses

    import snapkv_lab

    cls = snapkv_lab.POLICIES[name]
    if name == "FullCache":
        return cls()
    fields = {f.name for f in dataclasses.fields(cls)}
    if "policy" in fields:
        settings.setdefault("policy", snapkv_lab.SnapKV(window_size=tail))
    elif "lookahead_window" in fields:  # LookaheadQCache: its draft SnapKV's window; its own keeps its default
        settings["lookahead_window"] = tail
    elif "window_size" in fields:
        settings["window_size"] = tail
    elif name == "SimLayerKV":  # no tail of its own: its lazy layers keep their last capacity - sinks positions
        pass
    else:
        settings["kept_tail"] = tail
    return cls(**settings)


def synthetic_retrieval_scores(config) -> torch.Tensor:
    """(layers, heads) fixed, uneven retrieval scores for a random model: head h of layer l scores (l + h) % 3, so each
    layer has heads of 0, 1 and 2 and budgets differ across heads and layers."""
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    return ((torch.arange(layers)[:, None] + torch.arange(heads)[None]) % 3).double()


@pytest.fixture(autouse=True)
def random_models_have_retrieval_scores(monkeypatch):
    """A random model copies no needle, so HeadKV (budgets from measured retrieval scores) would refuse it: in tests a
    model without a name (a random one) gets `synthetic_retrieval_scores`; a real model is measured
    (tests/test_retrieval_heads.py checks the measurement, tests/test_head_budgets.py what the policies do with
    scores)."""
    from snapkv_lab.policies import retrieval_heads

    measured = retrieval_heads.retrieval_score_grid
    monkeypatch.setattr(retrieval_heads, "retrieval_score_grid", lambda model, tokenizer: measured(model, tokenizer)
                        if getattr(model.config, "name_or_path", "") else synthetic_retrieval_scores(model.config))


@pytest.fixture(autouse=True, scope="session")
def random_models_have_trained_scorers(tmp_path_factory):
    """KVzap refuses a model it has no trained weights for (the MLPs, tens of MB, are trained on the machine, not
    shipped): in tests a model without them (a random one; SmolLM2's MLP before scripts/train_kvzap.py ran) gets a
    random surrogate of the right shapes, seeded, so that the tests over every policy run it. tests/test_kvzap.py
    trains real ones on a toy setting, and checks the refusal with `find_weights.original`; Fast KVzip's gates
    likewise (tests/test_fastkvzip.py)."""
    from snapkv_lab.policies import kvzap

    found = kvzap.find_weights

    def weights(model, model_type):
        path = found(model, model_type)
        if path is not None:
            return path
        path = tmp_path_factory.getbasetemp() / "kvzap" / kvzap.weights_name(model, model_type)
        if not path.exists():
            config = model.config
            with torch.random.fork_rng():
                torch.manual_seed(0)
                kvzap.Surrogate(list(range(config.num_hidden_layers)), config.hidden_size, config.num_key_value_heads,
                                kvzap.HIDDEN_DIM if model_type == "mlp" else None).save(path)
        return path

    weights.original = found
    from snapkv_lab.policies import fastkvzip

    found_gates = fastkvzip.find_weights

    def gates(model):  # the same for Fast KVzip's gates
        path = found_gates(model)
        if path is not None:
            return path
        path = tmp_path_factory.getbasetemp() / "fastkvzip" / fastkvzip.weights_name(model)
        if not path.exists():
            config = model.config
            fastkvzip.Gates.drawn(list(range(config.num_hidden_layers)), config.hidden_size,
                                  config.num_key_value_heads,
                                  config.num_attention_heads // config.num_key_value_heads).save(path)
        return path

    gates.original = found_gates
    from snapkv_lab.policies import lukv

    found_curve = lukv.find_curve

    def curve(model):  # and for LU-KV's budget curves
        path = found_curve(model)
        if path is not None:
            return path
        config = model.config
        path = tmp_path_factory.getbasetemp() / "lukv" / f"{config.num_hidden_layers}x{config.num_key_value_heads}.npy"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, synthetic_lukv_curve(config.num_hidden_layers, config.num_key_value_heads))
        return path

    curve.original = found_curve  # (none is shipped: every model gets the synthetic curve in tests)
    with pytest.MonkeyPatch.context() as patch:  # session-wide: module fixtures prefill every policy (test_budgets)
        patch.setattr(kvzap, "find_weights", weights)
        patch.setattr(fastkvzip, "find_weights", gates)
        patch.setattr(lukv, "find_curve", curve)
        yield


def synthetic_lukv_curve(layers: int, kv_heads: int) -> np.ndarray:
    """(99, layers, kv_heads) float32 prune ratios for a random model: at ratio r each layer evicts r of its positions
    on average, its heads r + d_h with the d_h spread evenly over [-s, s], s = min(r, 1 - r) / 2 (odd layers the other
    way round), so that heads keep different counts and every layer holds the uniform total."""
    ratios = np.arange(1, 100)[:, None, None] / 100
    spread = np.minimum(ratios, 1 - ratios) / 2
    offsets = np.linspace(-1, 1, kv_heads) if kv_heads > 1 else np.zeros(1)
    signs = np.where(np.arange(layers) % 2, -1.0, 1.0)[:, None]
    return (ratios + spread * signs[None] * offsets[None, None]).astype(np.float32)


@pytest.fixture
def tiny_model():
    return make_tiny_llama()


@pytest.fixture
def byte_tokenizer():
    return ByteTokenizer()


@pytest.fixture(scope="session")
def smollm():
    """The bundled SmolLM2-135M-Instruct (converted once into the cache folder), sdpa, fp32."""
    from snapkv_lab import load_model

    return load_model()


@pytest.fixture(scope="session")
def gemma():
    """The bundled Gemma 3 270M base (converted once into the cache folder), sdpa, fp32: no chat template."""
    from snapkv_lab import load_model

    return load_model("gemma-3-270m")


def pytest_terminal_summary(terminalreporter):
    """The peer tests skip where kvpress's venv is missing (CI sets SNAPKV_LAB_REQUIRE_PEER=1, which fails them
    instead): said in one loud line at the end of a local run, not only in the skip list that -rs shows."""
    skipped = [report for report in terminalreporter.stats.get("skipped", [])
               if report.nodeid.startswith(("tests/test_peer.py", "test_peer.py"))
               and "pending:" not in str(report.longrepr)]
    if skipped:
        reason = skipped[0].longrepr[-1] if isinstance(skipped[0].longrepr, tuple) else str(skipped[0].longrepr)
        terminalreporter.write_line(f"PEER TESTS NOT RUN: {len(skipped)} side-by-side tests against kvpress "
                                    f"skipped. {reason}", red=True, bold=True)
