"""Storage backends: bytes only, behind one small interface (:class:`Storage`)."""

from .base import Storage, Writer
from .dispatch import open_storage

__all__ = ["Storage", "Writer", "open_storage"]
