"""snapkv_lab: see where an LLM's attention goes, and what a SnapKV-compressed KV cache keeps."""

from .capture import capture
from .hooks import intercept_attention
from .models import load_model
from .trace import AttentionTrace

__all__ = ["AttentionTrace", "capture", "intercept_attention", "load_model"]
__version__ = "0.1.0"
