"""What the benchmarks share: the model under test and its prompts, peak memory, out-of-memory failures, and
tables (printed as markdown, saved as CSV under benchmarks/results/).

Model options (see add_model_options): --device, --dtype, --attn, --shape, --model, --threads. By default the
model is a bundled real one on real text: SmolLM2, or the one `--model` names (e.g. gemma-3-270m). `--shape
llama3-8b` is a randomly initialised Llama with Llama-3-8B's shape, built directly on the device in the dtype,
fed random token ids: its weights are good for timing and memory only.
"""

from __future__ import annotations

import argparse
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from snapkv_lab.core.timing import synchronize

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ATTENTIONS = ("sdpa", "flash_attention_2", "eager")
OUT_OF_MEMORY = "failed: out of memory"

_LLAMA3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    max_position_embeddings=131072,  # Llama 3.1's context: a 32k prompt and its new tokens stay inside it
    rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,  # no EOS: random logits must not end a run early
)
RANDOM_SHAPES = {
    "llama3-8b": _LLAMA3_8B,
    # Llama-3's layout (4 query heads per KV head) at toy size, to smoke-test the random-model path on a CPU.
    "tiny": {**_LLAMA3_8B, "vocab_size": 32000, "hidden_size": 256, "intermediate_size": 896, "num_hidden_layers": 2,
             "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32},
}
SHAPE_NAMES = {"smollm2": "SmolLM2-135M", "llama3-8b": "random Llama-3-8B-shape model", "tiny": "random tiny Llama"}


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--attn", choices=ATTENTIONS, default="sdpa", help="attention backend (flash: CUDA only)")
    parser.add_argument("--shape", choices=list(SHAPE_NAMES), default="smollm2",
                        help="smollm2: the bundled model on real text; llama3-8b: random weights with Llama-3-8B's "
                             "shape on random token ids (timing and memory only); tiny: that layout at toy size")
    parser.add_argument("--model", help="a bundled model by short name, run on real text (default "
                                         "SmolLM2-135M-Instruct; e.g. gemma-3-270m); not with a random --shape")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")


def parse_model_options(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse, fill in the device's default dtype, and refuse a backend the device cannot run before any work."""
    from snapkv_lab.core.models import _check_attn_implementation

    args = parser.parse_args()
    _check_model(parser, args)
    on_gpu = args.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA GPU")
    args.dtype = args.dtype or ("bf16" if on_gpu else "fp32")
    try:
        _check_attn_implementation(args.attn, args.device)
    except (ValueError, ModuleNotFoundError) as err:
        parser.error(str(err))
    return args


def _check_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse --model with a random shape or a name that is not bundled; store the bundled model's own name, or
    None for the default SmolLM2 (so that its tables keep their names)."""
    from snapkv_lab.core.models import BUNDLED_MODELS, DEFAULT_MODEL, bundled_model

    if args.model is None:
        return
    if args.shape in RANDOM_SHAPES:
        parser.error(f"--model {args.model} runs a bundled model: it cannot go with the random --shape {args.shape}")
    bundled = bundled_model(args.model)
    if bundled is None:
        parser.error(f"--model {args.model}: not a bundled model (one of {', '.join(sorted(BUNDLED_MODELS))})")
    args.model = None if bundled.name == DEFAULT_MODEL else bundled.name


def model_key(args: argparse.Namespace) -> str:
    """The model under test in file names: the shape (smollm2, llama3-8b, tiny) or the bundled model's name."""
    return args.model or args.shape


def describe(args: argparse.Namespace) -> str:
    """E.g. 'SmolLM2-135M fp32, CPU, 2 threads' (from the options alone: the parent process never touches CUDA)."""
    where = f"CPU, {args.threads} threads" if args.device == "cpu" else args.device
    return f"{args.model or SHAPE_NAMES[args.shape]} {args.dtype}, {where}"


class IdTokenizer:
    """Stands in for a tokenizer with a random model: token ids print as numbers, and there is no EOS."""

    eos_token_id = None
    bos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(str(int(i)) for i in ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        """Text (e.g. KVzip's instruction) as its bytes: ids any vocabulary holds."""
        return {"input_ids": list(text.encode())}


@dataclass
class Subject:
    """The model under test, its tokenizer, and prompts of any length for it."""

    model: torch.nn.Module
    tokenizer: object
    shape: str

    def prompt(self, length: int) -> torch.Tensor:
        """(1, length) ids: BOS and Paul Graham's essays for a bundled model, fixed random ids for a random model."""
        if self.shape in RANDOM_SHAPES:
            generator = torch.Generator().manual_seed(length)
            return torch.randint(self.model.config.vocab_size, (1, length), generator=generator)
        from snapkv_lab.tasks.corpus import haystack_ids

        return torch.tensor([[self.tokenizer.bos_token_id or 1] + haystack_ids(self.tokenizer, length - 1)])


def load_subject(args: argparse.Namespace, attn: str | None = None) -> Subject:
    """The model of the options (under `attn` if given, else --attn), in eval mode on --device."""
    torch.set_num_threads(args.threads)
    attn = attn or args.attn
    if args.shape not in RANDOM_SHAPES:
        from snapkv_lab import load_model

        model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype, attn_implementation=attn)
        return Subject(model, tokenizer, args.shape)
    from transformers import AutoModelForCausalLM, LlamaConfig

    # Built on the device itself: 8B parameters initialised on a CPU first would take minutes and 32 GB of RAM.
    # Seeded: every process, and a second model in the same process (an eager twin), gets the same weights, so
    # rows that compare tokens or maps across runs compare one model.
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**RANDOM_SHAPES[args.shape]), dtype=DTYPES[args.dtype],
                                                 attn_implementation=attn)
    return Subject(model.eval(), IdTokenizer(), args.shape)


class PeakMemory:
    """Peak memory of a block, in MiB: what torch allocated on a CUDA device (its peak counter is reset on
    entry), else the process's peak RSS, which cannot be reset: one measurement per process on CPU.

        with PeakMemory(device) as memory:
            ...
        memory.peak_mb, memory.extra_mb       # extra: the peak above the memory in use on entry
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.kind = "GPU" if self.device.type == "cuda" else "RSS"
        self.before_mb = self.peak_mb = float("nan")

    def _now_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def __enter__(self) -> "PeakMemory":
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.before_mb = self._now_mb()
        return self

    def __exit__(self, *exc) -> bool:
        synchronize(self.device)
        if self.device.type == "cuda":
            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            self.peak_mb = self._now_mb()
        return False

    @property
    def extra_mb(self) -> float:
        return self.peak_mb - self.before_mb


def is_out_of_memory(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's failure under an address-space cap."""
    return isinstance(err, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(err)


def attempt(run, device):
    """(run(), "ok"), or (None, OUT_OF_MEMORY) when it ran out of memory; any other error propagates.

    After a CUDA failure the cached blocks are released, so that the next run starts from the same memory.
    """
    try:
        return run(), "ok"
    except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(err):
            raise
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return None, OUT_OF_MEMORY


def markdown(table: pd.DataFrame, formats: dict[str, str] | None = None) -> str:
    """A GitHub table (pandas' to_markdown needs the optional tabulate package); numbers right-aligned.

    formats: column -> format spec (e.g. ".1f"); other floats get 3 significant digits.
    """
    formats = formats or {}

    def cell(column, value):
        if column in formats and isinstance(value, (int, float)):
            return format(value, formats[column])
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    numeric = [pd.api.types.is_numeric_dtype(table[c]) for c in table.columns]
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "".join("---:|" if n else "---|" for n in numeric)]
    lines += ["| " + " | ".join(cell(c, v) for c, v in zip(table.columns, row)) + " |"
              for row in table.itertuples(index=False)]
    return "\n".join(lines)


def report(table: pd.DataFrame, name: str, title: str, formats: dict[str, str] | None = None) -> Path:
    """Print `title` and the table as markdown, and save it as benchmarks/results/<name>.csv."""
    print(f"\n{title}\n\n{markdown(table, formats)}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.csv"
    table.to_csv(path, index=False)
    print(f"saved {path}", file=sys.stderr, flush=True)
    return path


def result_name(bench: str, args: argparse.Namespace) -> str:
    """File name of a table: benchmark, model (shape or bundled name), dtype, backend and device type, e.g.
    capture_llama3-8b_bf16_sdpa_cuda or capture_gemma-3-270m_fp32_sdpa_cpu."""
    return f"{bench}_{model_key(args)}_{args.dtype}_{args.attn}_{torch.device(args.device).type}"
