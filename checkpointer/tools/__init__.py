"""Conversions between this library's checkpoints, torch DCP directories and Hugging Face safetensors.

Each format is a *source* of whole tensors, listed up front and fetched one at a time, and a
*writer* that streams them out; a conversion holds at most one tensor in memory.
"""

from .convert import FORMATS, convert, detect_format

__all__ = ["FORMATS", "convert", "detect_format"]
