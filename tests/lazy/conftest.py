"""Fixtures of the lazy-loading and two-stage tests.

``run_distributed`` comes from ``tests/conftest.py`` (one set of pools for every suite);
this directory is put on ``sys.path`` for ``lazy_helpers``.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.dirname(_HERE)
for _p in (os.path.dirname(_TESTS), os.path.join(_TESTS, "dist"), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)
