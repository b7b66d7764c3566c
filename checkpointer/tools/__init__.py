"""The offline tools, above the engine: lazy_load, convert, export, verify, inspect.

Every format is read through one interface, a *tensor source* (:mod:`.sources`): one class per
format, each with a ``supports(where)`` check, asked in order by :func:`.detect.open_source`
(the one format detector). Conversions stream tensors from a source to a *writer*, one at a
time. ``hf://`` URLs are fetched into the Hugging Face cache first (:mod:`.hub`).
"""

from .convert import FORMATS, convert, detect_format
from .detect import open_source
from .sources import TensorSource

__all__ = ["FORMATS", "convert", "detect_format", "open_source", "TensorSource"]
