"""snapkv_lab: see where an LLM's attention goes, and what a SnapKV-compressed KV cache keeps."""

from .ab import compare
from .capture import capture
from .compression import H2O, FullCache, Policy, RandomKeep, SnapKV, SnapKVNoPooling, StreamingLLM, compress, generate
from .hooks import intercept_attention
from .models import load_model
from .trace import AttentionTrace

__all__ = ["AttentionTrace", "capture", "intercept_attention", "load_model"]
__all__ += ["FullCache", "H2O", "Policy", "RandomKeep", "SnapKV", "SnapKVNoPooling", "StreamingLLM", "compare",
            "compress", "generate"]
__version__ = "0.1.0"
