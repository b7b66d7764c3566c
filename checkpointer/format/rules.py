"""Shard rules: a tensor's pieces and the files that hold them, described by a rule instead of a list.

A regular layout (``Shard(d)`` over a mesh, even or uneven, HSDP, TP+FSDP, one flattened range
per rank cut at equal steps, a replicated tensor written by one rank) is one small JSON object,
whatever the number of ranks (``docs/format.md`` gives the rules for a reader without this code)::

    {"form": "box" | "flat",
     "cuts": [[dim, chunk], ...],
     "files": [first, [[div, mod, mul], ...]]}

* ``cuts``: each listed dim (ascending, each once) is cut into pieces of ``chunk`` elements (the
  last may be shorter: ``torch.chunk``'s semantics), ``ceil(size / chunk)`` of them; other dims
  are whole. With ``"form": "flat"``, the tensor is its row-major flattening (dim 0 only) and
  each piece is one ``[start, end)`` range. The pieces (cells) are numbered ``j = 0, 1, ...`` in
  row-major order of their positions along the cut dims.
* ``files``: cell ``j`` is stored in ``rank_{f}.safetensors`` with
  ``f = first + sum(((j // div) % mod) * mul)`` over the terms.

:func:`check_rule` validates a rule from untrusted JSON in time linear in its size (a rule of
10**12 cells is refused without counting them); :func:`expand_rule` turns it into per-file
columns; :func:`detect_rule` finds the rule of explicit columns, if they follow one.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

import numpy as np

__all__ = [
    "MAX_RULE_CELLS", "MAX_RULE_VALUES", "MAX_RULE_TERMS", "RuleError", "check_rule", "expand_rule", "detect_rule",
    "rule_cells", "rule_values",
]

MAX_RULE_CELLS = 1 << 22
"""The most pieces one rule may describe (4,194,304 ranks), and the most a document's distinct
rules may describe together: past it, expanding them would be a large allocation."""
MAX_RULE_VALUES = 5 * MAX_RULE_CELLS
"""The most numbers a document's distinct rules may expand into together: a piece of a box rule
is ``2 * ndim + 1`` numbers (its shape, offset and file), of a flat rule 3. So a rule of many
dims describes fewer pieces (a 2-D rule up to :data:`MAX_RULE_CELLS`)."""
MAX_RULE_TERMS = 8
MAX_FILE_INDEX = (1 << 31) - 1
_RANK = re.compile(r"rank_(\d+)\.safetensors")


class RuleError(ValueError):
    """A shard rule that does not describe pieces tiling its tensor, each in its own file."""


def _int(x: Any) -> bool:
    return type(x) is int


def rule_cells(shape: Sequence[int], rule: dict[str, Any]) -> int:
    """The number of pieces of a rule already checked by :func:`check_rule`."""
    extents = [math.prod(shape)] if rule["form"] == "flat" else list(shape)
    return math.prod(-(-extents[d] // chunk) for d, chunk in rule["cuts"])


def rule_values(shape: Sequence[int], rule: dict[str, Any], cells: int) -> int:
    """How many numbers the ``cells`` pieces of a checked ``rule`` expand into."""
    return cells * (3 if rule["form"] == "flat" else 2 * len(shape) + 1)


def check_rule(shape: tuple[int, ...], rule: Any) -> tuple[int, int]:
    """Validate a rule for a tensor of ``shape``: ``(cells, largest file index)``.

    Raises :class:`RuleError` (a ``ValueError``) saying what is wrong: pieces that would overlap,
    leave gaps or leave the tensor, two pieces in one file, too many pieces.
    """
    if type(rule) is not dict or set(rule) != {"form", "cuts", "files"}:
        raise RuleError("a shard rule is an object of exactly form, cuts and files")
    form, cuts, files = rule["form"], rule["cuts"], rule["files"]
    numel = math.prod(shape)
    if form not in ("box", "flat"):
        raise RuleError(f"unknown rule form {form!r}")
    if numel == 0:
        raise RuleError("a tensor without elements has no rule")
    extents = [numel] if form == "flat" else list(shape)
    if form == "box" and not shape:
        raise RuleError("a scalar's rule has form flat")
    if type(cuts) is not list or len(cuts) > len(extents):
        raise RuleError("cuts must be a list of at most one [dim, chunk] per dim")
    cells, last = 1, -1
    for cut in cuts:
        if type(cut) is not list or len(cut) != 2 or not _int(cut[0]) or not _int(cut[1]):
            raise RuleError("each cut is [dim, chunk], two integers")
        dim, chunk = cut
        if not last < dim < len(extents):
            raise RuleError(f"cut dim {dim}: dims must be ascending, each once (pieces would overlap), "
                            f"and inside the tensor's {len(extents)} dims")
        if not 1 <= chunk <= extents[dim]:
            raise RuleError(f"cut chunk {chunk} of dim {dim} must be 1 to the dim's size {extents[dim]}")
        last = dim
        cells *= -(-extents[dim] // chunk)
        if cells > MAX_RULE_CELLS:
            raise RuleError(f"the rule describes more than {MAX_RULE_CELLS} pieces")
    if type(files) is not list or len(files) != 2 or not _int(files[0]) or type(files[1]) is not list:
        raise RuleError("files must be [first, [[div, mod, mul], ...]]")
    first, terms = files
    if not 0 <= first <= MAX_FILE_INDEX or len(terms) > MAX_RULE_TERMS:
        raise RuleError(f"files: first must be 0 to {MAX_FILE_INDEX}, at most {MAX_RULE_TERMS} terms")
    digits = []
    for term in terms:
        if type(term) is not list or len(term) != 3 or not all(map(_int, term)):
            raise RuleError("each files term is [div, mod, mul], three integers")
        div, mod, mul = term
        if not (1 <= div <= MAX_RULE_CELLS and 1 <= mod <= MAX_RULE_CELLS and 1 <= mul <= MAX_FILE_INDEX):
            raise RuleError(f"files term {term}: div, mod and mul must be positive (at most {MAX_RULE_CELLS}, "
                            f"{MAX_RULE_CELLS}, {MAX_FILE_INDEX})")
        digits.append((div, min(mod, -(-cells // div)), mul))
    # Each piece its own file: the digits determine j (their spans chain from 1 up to the cells)...
    reach = 1
    for div, span, _ in sorted(digits):
        if div > reach:
            break
        reach = max(reach, div * span)
    if reach < cells:
        raise RuleError("files: two pieces would share a file (the terms' digits do not tell every piece apart)")
    # ... and no sum of smaller terms reaches the next multiplier.
    top = 0
    for _, span, mul in sorted(digits, key=lambda t: t[2]):
        if span > 1 and mul <= top:
            raise RuleError("files: two pieces would share a file (a term's multiplier is reached by the smaller ones)")
        top += (span - 1) * mul
    if first + top > MAX_FILE_INDEX:
        raise RuleError(f"files: a file index past {MAX_FILE_INDEX}")
    if not _nested(digits) and len(np.unique(_files_of_cells(cells, first, terms))) < cells:
        # The chain above tells pieces apart only where the digits nest, as a writer's do.
        raise RuleError("files: two pieces would share a file (the terms' digits repeat within the pieces)")
    return cells, first + top


def _nested(digits: list[tuple[int, int, int]]) -> bool:
    """Each digit that varies starts where the ones below it end (``div`` the product of their spans)."""
    reach = 1
    for div, span, _ in sorted(d for d in digits if d[1] > 1):
        if div != reach:
            return False
        reach *= span
    return True


def _files_of_cells(cells: int, first: int, terms: list) -> np.ndarray:
    j = np.arange(cells, dtype=np.int64)
    files = np.full(cells, first, dtype=np.int64)
    for div, mod, mul in terms:
        files += (j // div) % mod * mul
    return files


def expand_rule(shape: tuple[int, ...], rule: dict[str, Any]) -> tuple[list[str], list | None, list | None, list | None]:
    """``(names, flat, local_shape, global_offset)`` columns, one entry per piece in cell order,
    of a rule already checked by :func:`check_rule`."""
    form, cuts, (first, terms) = rule["form"], rule["cuts"], rule["files"]
    numel = math.prod(shape)
    extents = [numel] if form == "flat" else list(shape)
    parts = [-(-extents[d] // chunk) for d, chunk in cuts]
    cells = math.prod(parts)
    j = np.arange(cells, dtype=np.int64)
    files = _files_of_cells(cells, first, terms)
    names = [f"rank_{f}.safetensors" for f in files.tolist()]
    coords = np.unravel_index(j, parts) if parts else ()
    starts = [np.zeros(cells, dtype=np.int64) for _ in extents]
    sizes = [np.full(cells, n, dtype=np.int64) for n in extents]
    for (d, chunk), c in zip(cuts, coords):
        starts[d] = c * chunk
        sizes[d] = np.minimum(starts[d] + chunk, extents[d]) - starts[d]
    if form == "flat":
        flat = [((s, s + n),) for s, n in zip(starts[0].tolist(), sizes[0].tolist())]
        return names, flat, None, None
    ls = list(zip(*(s.tolist() for s in sizes)))
    go = list(zip(*(s.tolist() for s in starts)))
    return names, None, ls, go


def detect_rule(
    shape: tuple[int, ...], names: Sequence[str], flat: Sequence[Any] | None, ls: Sequence[Any] | None,
    go: Sequence[Any] | None, *, ranks: Sequence[int] | None = None,
) -> dict[str, Any] | None:
    """The rule these columns follow, or ``None``: keep the list. ``ranks``: the caller's word
    that ``names[i]`` is ``rank_{ranks[i]}.safetensors`` (else the names are read).

    Checked against the columns, as if expanded (:func:`expand_rule`) and compared, in bulk."""
    n, numel = len(names), math.prod(shape)
    if not n or not numel or n > MAX_RULE_CELLS:
        return None
    if ranks is None:
        found = []
        for name in names:
            m = _RANK.fullmatch(name)
            if m is None or m.group(1) != str(int(m.group(1))):
                return None  # not a rank file's own name (``rank_01`` is not ``rank_1``)
            found.append(int(m.group(1)))
        ranks = found
    if flat is not None:
        if ls is not None or go is not None or any(f is None or len(f) != 1 for f in flat):
            return None
        form, extents = "flat", [numel]
        starts = np.array([[f[0][0]] for f in flat], dtype=np.int64)
        sizes = np.array([[f[0][1] - f[0][0]] for f in flat], dtype=np.int64)
    else:
        if ls is None or go is None or not shape or any(s is None or o is None for s, o in zip(ls, go)):
            return None
        form, extents = "box", list(shape)
        sizes, starts = np.array(ls, dtype=np.int64), np.array(go, dtype=np.int64)
        if sizes.shape != (n, len(shape)) or starts.shape != (n, len(shape)):
            return None
    cuts, cell = [], np.zeros(n, dtype=np.int64)
    want_starts, want_sizes = np.zeros_like(starts), np.empty_like(sizes)
    for d, extent in enumerate(extents):
        if (sizes[:, d] == extent).all():
            want_sizes[:, d] = extent
            continue
        chunk = int(sizes[:, d].max())
        if chunk <= 0:
            return None
        parts = -(-extent // chunk)
        coord = starts[:, d] // chunk
        if (coord < 0).any() or (coord >= parts).any():
            return None
        cuts.append([d, chunk])
        want_starts[:, d] = coord * chunk
        want_sizes[:, d] = np.minimum(want_starts[:, d] + chunk, extent) - want_starts[:, d]
        cell = cell * parts + coord
    if not ((starts == want_starts).all() and (sizes == want_sizes).all()):
        return None  # some piece is not its cell
    order = np.argsort(cell, kind="stable")
    if not (cell[order] == np.arange(n)).all():
        return None  # not one piece per cell
    files = np.asarray(ranks, dtype=np.int64)[order]
    terms = _radix_terms(files)
    if terms is None:
        return None
    rule = {"form": form, "cuts": cuts, "files": [int(files[0]), terms]}
    try:
        cells, top = check_rule(shape, rule)
    except RuleError:
        return None
    if cells != n or top != int(files.max()):
        return None  # a reader bounds the files by ``top`` (e.g. files 0, 2, 3 by terms reaching 5)
    return rule


def _radix_terms(files: np.ndarray) -> list[list[int]] | None:
    """``[[div, mod, mul], ...]`` with ``files[j] == files[0] + sum(((j // div) % mod) * mul)``,
    digits nested (each ``div`` the product of the ones before), when such terms exist."""
    n = len(files)
    rel = files - files[0]
    terms: list[list[int]] = []
    div = 1
    while div < n:
        mul = int(rel[div])
        if mul <= 0:
            return None
        # this digit runs while the files step by mul, every div cells
        steps = rel[::div]
        k = 1
        while k < len(steps) and steps[k] == steps[0] + k * mul:
            k += 1
        terms.append([div, k, mul])
        div *= k
    predicted = np.zeros(n, dtype=np.int64)
    j = np.arange(n, dtype=np.int64)
    for d, m, mul in terms:
        predicted += (j // d) % m * mul
    return terms if (predicted == rel).all() else None
