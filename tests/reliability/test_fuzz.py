"""A hypothesis fuzzer: mutated metadata.json files and safetensors headers must keep the rule.

The rule (issue 6): every loader returns or raises a CheckpointError; no other exception,
no hang, no allocation beyond what the files justify, no read outside the checkpoint (see
``rel_helpers.guard``). Each example mutates one file of a copy of the template (structure:
values replaced by edge cases, entries dropped, duplicated, swapped, numbers nudged; text:
truncation, flipped bytes, duplicate keys, deep nesting; the header's 8-byte length), runs
the loaders of that part, then puts the file back.

A third fuzzer feeds the decoder of the optimizer's pickled param groups (no loader around it:
it is a pure function) values that share containers, a tree of up to billions of values in a
few hundred bytes, pickled with every protocol and then mutated byte-wise: each decodes or is a
CorruptCheckpointError, within a second.

Two more fuzz a real format-2 checkpoint (``compact_template``): its metadata.json's shard rules
(integers nudged to edge values, cuts and file terms added, dropped or repeated, rules of 10**12
pieces, another tensor's rule, a rule beside a list), and each rank file's checksums tensor
(flipped bytes, too few or too many checksums, its header entry changed or gone, what
metadata.json says of the checksums). Besides the rule, a rule that describes other pieces than
the original (by a brute-force expansion in the test) is refused by every loader that reads the
data, and a checksums tensor whose bytes or extent changed by a verifying load.

``CHECKPOINTER_FUZZ_EXAMPLES`` (default 150) is the number of examples over the first two fuzzers
(and as many again over the two of format 2)
(and as many again for the pickle decoder, which takes milliseconds each);
``make fuzz`` runs 20000. Hits of bugs already known (each has its own strict-xfail test)
are counted, not failed; the count of examples run and of known-bug hits is printed at the
end of the session.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import pytest
import rel_helpers
from hostile import split_rank_file, write_rank_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("CHECKPOINTER_FUZZ_EXAMPLES", "150"))
FUZZ_HANG_S = 20.0

# Loaders per example: all of rel_helpers.part_loaders but latest_checkpoint and unshard_model_state
# (the same paths as get_metadata and unshard).
FUZZ_LOADERS = {"load", "load_verify", "unshard", "get_metadata", "lazy_load", "load_model_and_optim_state", "unshard_optim_state"}

STATS = rel_helpers.FUZZ_STATS
KNOWN_HITS = rel_helpers.FUZZ_KNOWN_HITS

# Violations that strict-xfail tests already track: (bug, exception type, file and function of
# the innermost frame of the library in the traceback).
KNOWN_BUGS: list[tuple[str, str, str, str]] = []  # none open: every bug the fuzzer found is fixed
_FRAME = re.compile(r'File "([^"]*)", line \d+, in (\S+)')


def known_bug(outcome: rel_helpers.Outcome) -> str | None:
    err = outcome.error
    if err is None or isinstance(err, rel_helpers.Hang):
        return None
    ours = [(os.path.basename(f), fn) for f, fn in _FRAME.findall(outcome.traceback) if f"{os.sep}checkpointer{os.sep}" in f]
    if not ours:
        return None
    where = ours[-1]
    for bug, type_name, file, function in KNOWN_BUGS:
        if type(err).__name__ == type_name and where == (file, function):
            return bug
    return None


# --------------------------------------------------------------------------------------
# Mutations
# --------------------------------------------------------------------------------------

NAMES = [
    "rank_0.safetensors", "rank_1.safetensors", "rank_2.safetensors", "rank_3.safetensors", "metadata.json",
    "../rank_0.safetensors", "/etc/passwd", "", ".", "..", "a/b", "rank_0.safetensors\x00", "\u00e9",
]
DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "F128", "U16", "f32"]
INTS = [0, 1, -1, 2, 3, 7, 8, 13, 63, 64, 255, 256, 2**16, 2**24 + 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**62 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30]

json_scalars = st.one_of(
    st.sampled_from(INTS),
    st.integers(min_value=-(2**65), max_value=2**65),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(NAMES + DTYPES),
    st.text(max_size=12),
    st.booleans(),
    st.none(),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(NAMES + ["shape", "dtype", "x"]), inner, max_size=3)),
    max_leaves=8,
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every position in a JSON tree (the root excluded) as a tuple of keys/indices."""
    out = []
    if isinstance(node, dict):
        items = list(node.items())
    elif isinstance(node, list):
        items = list(enumerate(node))
    else:
        return out
    for k, v in items:
        out.append(prefix + (k,))
        out.extend(_paths(v, prefix + (k,)))
    return out


def _parent(root: Any, path: tuple) -> Any:
    node = root
    for k in path[:-1]:
        node = node[k]
    return node


def mutate_tree(data: st.DataObject, root: Any) -> Any:
    """One structural mutation of a JSON tree, in place (returns the root, maybe replaced)."""
    paths = _paths(root)
    if not paths:
        return data.draw(json_values)
    path = data.draw(st.sampled_from(paths))
    parent, key = _parent(root, path), path[-1]
    op = data.draw(st.sampled_from(["replace", "replace", "nudge", "delete", "duplicate", "swap", "wrap"]))
    value = parent[key]
    if op == "replace":
        parent[key] = data.draw(json_values)
    elif op == "nudge" and isinstance(value, int) and not isinstance(value, bool):
        parent[key] = data.draw(st.sampled_from([value + 1, value - 1, value * 2, -value, value + 2**32, value * 2**31, 0]))
    elif op == "nudge" and isinstance(value, list) and value:
        parent[key] = value + [value[-1]] if data.draw(st.booleans()) else value[:-1]
    elif op == "delete":
        del parent[key]
    elif op == "duplicate" and isinstance(parent, dict):
        parent[data.draw(st.sampled_from(NAMES + ["shape", "dtype", "tensors"]))] = json.loads(json.dumps(value))
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(key, json.loads(json.dumps(value)))
    elif op == "swap":
        siblings = list(parent.keys()) if isinstance(parent, dict) else list(range(len(parent)))
        other = data.draw(st.sampled_from(siblings))
        parent[key], parent[other] = parent[other], parent[key]
    else:  # wrap
        parent[key] = data.draw(st.sampled_from([[value], {"x": value}, [value, value]]))
    return root


def mutate_text(data: st.DataObject, text: bytes) -> bytes:
    """A text-level mutation of serialized JSON."""
    op = data.draw(st.sampled_from(["truncate", "flip", "insert", "duplicate_key", "nest", "none"]))
    n = len(text)
    if op == "truncate" and n:
        return text[: data.draw(st.integers(0, n - 1))]
    if op == "flip" and n:
        i = data.draw(st.integers(0, n - 1))
        return text[:i] + bytes([data.draw(st.integers(0, 255))]) + text[i + 1 :]
    if op == "insert":
        i = data.draw(st.integers(0, n))
        return text[:i] + data.draw(st.sampled_from([b",", b"}", b"]", b'"', b"\\", b"\x00", b"\xff", b"1e999", b"NaN", b"-"])) + text[i:]
    if op == "duplicate_key":
        keys = re.findall(rb'"[^"\\]{1,40}":', text)
        if keys:
            k = data.draw(st.sampled_from(keys))
            i = text.index(k)
            return text[:i] + k + b"0," + text[i:]
    if op == "nest":
        depth = data.draw(st.sampled_from([50, 990, 5000, 100_000]))
        if text.startswith(b"{"):
            return b'{"deep": ' + b"[" * depth + b"]" * depth + b", " + text[1:]
    return text


# --------------------------------------------------------------------------------------
# Fixtures and the check
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_copy(template, tmp_path_factory):
    """One copy of the template for all examples; each example restores the file it changed."""
    base = tmp_path_factory.mktemp("fuzz")
    top = base / "run" / "step10"
    shutil.copytree(template.root, top)
    return rel_helpers.Copy(str(top), template.expected), str(base)


def run_and_check(copy: rel_helpers.Copy, part: str, watched: str, what: str) -> None:
    calls = {k: v for k, v in rel_helpers.part_loaders(copy, part).items() if k in FUZZ_LOADERS}
    outcomes = rel_helpers.run_loaders(calls, copy.top, (watched,), hang_s=FUZZ_HANG_S)
    for out in outcomes.values():
        bug = known_bug(out)
        if bug is not None:
            KNOWN_HITS[bug] = KNOWN_HITS.get(bug, 0) + 1
            out.error = None  # tracked by its own strict-xfail test
    problems = rel_helpers.rule_violations(outcomes)
    assert not problems, f"{what}\n" + "\n\n".join(problems)


def _count(name: str) -> None:
    STATS[name] = STATS.get(name, 0) + 1


def fuzz_settings(n: int):
    return settings(
        max_examples=max(1, n),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
        print_blob=True,
    )


@fuzz_settings(EXAMPLES - EXAMPLES // 2)
@given(data=st.data())
def test_fuzz_metadata_json(fuzz_copy, data):
    copy, watched = fuzz_copy
    part = data.draw(st.sampled_from(["model", "optim", "flat"]), label="part")
    path = os.path.join(copy.part(part), "metadata.json")
    with open(path, "rb") as f:
        original = f.read()
    tree = json.loads(original)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        tree = mutate_tree(data, tree)
    text = json.dumps(tree).encode()
    if data.draw(st.integers(0, 3), label="text mutation") == 0:
        text = mutate_text(data, text)
    rel_helpers.rewrite(path, text)
    _count("metadata.json")
    try:
        run_and_check(copy, part, watched, f"{part}/metadata.json mutated to:\n{text[:3000]!r}")
    finally:
        rel_helpers.rewrite(path, original)


@fuzz_settings(EXAMPLES // 2)
@given(data=st.data())
def test_fuzz_safetensors_header(fuzz_copy, data):
    copy, watched = fuzz_copy
    part = data.draw(st.sampled_from(["model", "optim", "flat"]), label="part")
    name = data.draw(st.sampled_from(["rank_0.safetensors", "rank_1.safetensors", "rank_2.safetensors"]), label="file")
    path = os.path.join(copy.part(part), name)
    with open(path, "rb") as f:
        original = f.read()
    header, body = split_rank_file(path)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        header = mutate_tree(data, header)
    text = json.dumps(header, separators=(",", ":")).encode()
    if data.draw(st.integers(0, 3), label="text mutation") == 0:
        text = mutate_text(data, text)
    length = None
    if data.draw(st.integers(0, 4), label="length lie") == 0:
        length = data.draw(st.one_of(st.sampled_from([0, 1, 7, len(text) - 1, len(text) + 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1)))
        length = max(0, min(length, 2**64 - 1))
    cut = data.draw(st.sampled_from([None, None, None, "short", "long"]), label="data area")
    if cut == "short" and body:
        body = body[: data.draw(st.integers(0, len(body) - 1))]
    elif cut == "long":
        body = body + b"\x00" * data.draw(st.integers(1, 4096))
    write_rank_file(path, text, body, length=length)
    _count("safetensors header")
    try:
        run_and_check(copy, part, watched, f"{part}/{name} header mutated to (length {length}):\n{text[:3000]!r}")
    finally:
        rel_helpers.rewrite(path, original)


# --------------------------------------------------------------------------------------
# The optimizer's pickled param groups: shared references
# --------------------------------------------------------------------------------------

PICKLE_SCALARS = [0, 1, -1, 2**31, 2**64, 0.5, float("inf"), "", "lr", "x" * 40, None, True, False]


@st.composite
def shared_values(draw: Any) -> Any:
    """A value built bottom-up, each new container holding earlier values (most often the
    newest ones, so that sharing compounds: a tree of up to 4**34 values)."""
    nodes: list[Any] = list(draw(st.lists(st.sampled_from(PICKLE_SCALARS), min_size=1, max_size=4)))
    sizes = [1] * len(nodes)  # each node's size as a tree
    hashable = [True] * len(nodes)
    doubling = draw(st.booleans())  # each step holds the newest value two or three times
    for _ in range(draw(st.integers(1, 34))):
        near = st.integers(max(0, len(nodes) - 3), len(nodes) - 1)
        pick = st.one_of(near, near, st.integers(0, len(nodes) - 1))
        picked = draw(st.lists(pick, min_size=0, max_size=3))
        if doubling:
            picked = [len(nodes) - 1] * draw(st.integers(2, 3)) + picked[:1]
        children = [nodes[i] for i in picked]
        size = 1 + sum(sizes[i] for i in picked)
        kind = draw(st.sampled_from(["list", "list", "tuple", "dict", "tuple_key"]))
        if kind == "list":
            nodes.append(children)
            hashable.append(False)
        elif kind == "tuple":
            nodes.append(tuple(children))
            hashable.append(all(hashable[i] for i in picked))
        elif kind == "dict":
            nodes.append({f"k{i}": c for i, c in enumerate(children)})
            size += len(children)
            hashable.append(False)
        else:  # a small tuple as a dict key (hashing a large one here would take as long as the attack)
            keys = [i for i in picked if hashable[i] and sizes[i] <= 1000]
            nodes.append({tuple(nodes[i] for i in keys): len(nodes)})
            size = 3 + sum(sizes[i] for i in keys)
            hashable.append(False)
        sizes.append(size)
    return nodes[-1]


def mutate_pickle(data: st.DataObject, raw: bytes) -> bytes:
    op = data.draw(st.sampled_from(["none", "none", "flip", "truncate", "insert", "repeat"]), label="pickle mutation")
    n = len(raw)
    if op == "flip" and n:
        i = data.draw(st.integers(0, n - 1))
        return raw[:i] + bytes([data.draw(st.integers(0, 255))]) + raw[i + 1 :]
    if op == "truncate" and n:
        return raw[: data.draw(st.integers(0, n - 1))]
    if op == "insert":
        i = data.draw(st.integers(0, n))
        opcode = data.draw(st.sampled_from([b"0", b"1", b"2", b"(", b"a", b"e", b"s", b"u", b"t", b"\x85", b"\x86", b"\x87", b"\x94", b"h\x00", b"h\x01", b"]", b"}", b")", b"\x8f", b"\x90", b"\x91"]))
        return raw[:i] + opcode + raw[i:]
    if op == "repeat" and n > 4:
        i = data.draw(st.integers(2, n - 2))
        j = data.draw(st.integers(i, min(n - 1, i + 16)))
        return raw[:j] + raw[i:j] * data.draw(st.integers(1, 8)) + raw[j:]
    return raw


def _tree_size(value: Any, limit: int) -> int:
    """Values in ``value`` counted as a tree, stopping past ``limit``."""
    count, todo = 0, [value]
    while todo and count <= limit:
        v = todo.pop()
        count += 1
        if isinstance(v, (list, tuple)):
            todo.extend(v)
        elif isinstance(v, dict):
            for kv in v.items():
                todo.extend(kv)
    return count


@fuzz_settings(EXAMPLES)
@given(data=st.data())
def test_fuzz_param_group_pickle(data):
    import pickle
    import time

    from checkpointer.errors import CorruptCheckpointError
    from checkpointer.format.builtins_pickle import decode_builtins, node_budget

    value = data.draw(shared_values(), label="value")
    protocol = data.draw(st.integers(0, pickle.HIGHEST_PROTOCOL), label="protocol")
    try:
        raw = pickle.dumps(value, protocol=protocol)
    except RecursionError:  # protocols 0 and 1 recurse on the tree's depth when writing
        return
    payload = mutate_pickle(data, raw)
    _count("param group pickle")
    t0 = time.perf_counter()
    try:
        got = decode_builtins(payload, where="optim/param_group0")
    except CorruptCheckpointError as ex:
        assert "optim/param_group0" in str(ex)
        got = ex
    took = time.perf_counter() - t0
    assert took < 1.0, f"decoding {len(payload)} bytes took {took:.2f}s: {payload[:400]!r}"
    if not isinstance(got, CorruptCheckpointError):
        assert _tree_size(got, node_budget(len(payload))) <= node_budget(len(payload))
        if payload == raw:
            assert got == value


# --------------------------------------------------------------------------------------
# Format 2: shard rules and the checksums tensor of a real compact checkpoint
# --------------------------------------------------------------------------------------
#
# ``CHECKPOINTER_FUZZ_EXAMPLES`` examples again, two thirds mutating the shard rules of
# metadata.json, one third a rank file's checksums tensor. Besides the rule above, a rule
# mutated to describe other pieces than the files hold (by a brute-force expansion here, not the
# library's) must be refused by every loader that reads the data; and a checksums tensor whose
# bytes or extent changed must be refused by a verifying load.

DATA_LOADERS = FUZZ_LOADERS - rel_helpers.METADATA_ONLY
RULE_INTS = [0, 1, -1, 2, 3, 4, 5, 6, 7, 8, 13, 35, 2**22, 2**22 + 1, 2**31 - 1, 2**31, 10**12, 2**63, 2**64]
RULE_ODD = [True, 1.0, "1", None, [], {}, [1], -0.0]
_BRUTE_CELLS = 10**5
_BRUTE_NUMEL = 10**6


@pytest.fixture(scope="module")
def compact_fuzz_copy(compact_template, tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz_compact")
    top = base / "run" / "step10"
    shutil.copytree(compact_template.root, top)
    return rel_helpers.Copy(str(top), compact_template.expected), str(base)


def rule_pieces(shape: list[int], rule: Any) -> dict[int, tuple[int, ...]] | None:
    """Brute force: the flat elements of each file's piece, or None when the rule is not one
    that tiles the tensor with one piece per file (or too large to expand here)."""
    import math

    import numpy as np

    def ints(*xs: Any) -> bool:
        return all(type(x) is int for x in xs)

    if type(rule) is not dict or set(rule) != {"form", "cuts", "files"} or rule["form"] not in ("box", "flat"):
        return None
    numel = math.prod(shape)
    if numel == 0 or numel > _BRUTE_NUMEL or (rule["form"] == "box" and not shape):
        return None
    extents = [numel] if rule["form"] == "flat" else list(shape)
    cuts, files = rule["cuts"], rule["files"]
    if type(cuts) is not list or not all(type(c) is list and len(c) == 2 and ints(*c) for c in cuts):
        return None
    dims = [d for d, _ in cuts]
    if dims != sorted(set(dims)) or not all(0 <= d < len(extents) and 1 <= k <= extents[d] for d, k in cuts):
        return None
    counts = [-(-extents[d] // k) for d, k in cuts]
    if math.prod(counts) > _BRUTE_CELLS:
        return None
    if type(files) is not list or len(files) != 2 or not ints(files[0]) or type(files[1]) is not list:
        return None
    if not all(type(t) is list and len(t) == 3 and ints(*t) and min(t) >= 1 for t in files[1]) or files[0] < 0:
        return None
    index = np.arange(numel).reshape(extents)
    out: dict[int, tuple[int, ...]] = {}
    seen = np.zeros(numel, dtype=np.int64)
    for j, pos in enumerate(np.ndindex(*counts)):
        box = [slice(None)] * len(extents)
        for (d, k), p in zip(cuts, pos):
            box[d] = slice(p * k, min(extents[d], (p + 1) * k))
        f = files[0] + sum(((j // div) % mod) * mul for div, mod, mul in files[1])
        if f in out:
            return None
        elements = index[tuple(box)].reshape(-1)
        out[f] = tuple(elements.tolist())
        seen[elements] += 1
    return out if bool((seen == 1).all()) else None


def mutate_rule(data: st.DataObject, entry: dict, others: list[dict]) -> None:
    """One mutation of a tensor's ``shard_rule`` (or of how the entry gives it), in place."""
    rule = entry["shard_rule"]
    op = data.draw(st.sampled_from(["int", "int", "int", "form", "cut", "cut", "term", "term", "huge", "tree", "other", "both"]))
    if op == "int" and type(rule) is dict:
        paths = [p for p in _paths(rule) if type(_parent(rule, p)[p[-1]]) is int]
        if paths:
            path = data.draw(st.sampled_from(paths))
            parent, key = _parent(rule, path), path[-1]
            v = parent[key]
            parent[key] = data.draw(st.one_of(
                st.sampled_from(RULE_INTS), st.sampled_from([v + 1, v - 1, v * 2, v * 2**20, -v]), st.sampled_from(RULE_ODD)
            ))
            return
    if op == "form" and type(rule) is dict:
        rule["form"] = data.draw(st.sampled_from(["box", "flat", "strided", "", None, ["box"]]))
    elif op == "cut" and type(rule) is dict and type(rule.get("cuts")) is list:
        cuts = rule["cuts"]
        how = data.draw(st.sampled_from(["add", "drop", "dup", "reverse"]))
        if how == "add":
            cuts.append([data.draw(st.integers(-1, 3)), data.draw(st.sampled_from(RULE_INTS))])
        elif how == "drop" and cuts:
            cuts.pop(data.draw(st.integers(0, len(cuts) - 1)))
        elif how == "dup" and cuts:
            cuts.append(list(cuts[-1]))
        else:
            cuts.reverse()
    elif op == "term" and type(rule) is dict and type(rule.get("files")) is list and len(rule["files"]) == 2:
        terms = rule["files"][1]
        how = data.draw(st.sampled_from(["add", "drop", "first", "many"]))
        if how == "add" and type(terms) is list:
            terms.append([data.draw(st.sampled_from(RULE_INTS)) for _ in range(3)])
        elif how == "drop" and type(terms) is list and terms:
            terms.pop()
        elif how == "many":
            rule["files"][1] = [[1, 2, 1]] * data.draw(st.sampled_from([2, 8, 9, 1000]))
        else:
            rule["files"][0] = data.draw(st.sampled_from(RULE_INTS + RULE_ODD))
    elif op == "huge":  # every element its own piece, or 10**12 of them
        dims = data.draw(st.sampled_from(["all", "flat"]))
        rule.clear() if type(rule) is dict else None
        entry["shard_rule"] = {
            "form": "box" if dims == "all" and entry["shape"] else "flat",
            "cuts": [[d, 1] for d in range(len(entry["shape"]))] if dims == "all" and entry["shape"] else [[0, 1]],
            "files": [0, [[1, data.draw(st.sampled_from([2**22, 10**12, 2**31 - 1])), 1]]],
        }
    elif op == "other" and any("shard_rule" in o for o in others):
        rules = [o["shard_rule"] for o in others if "shard_rule" in o]
        entry["shard_rule"] = json.loads(json.dumps(data.draw(st.sampled_from(rules))))
    elif op == "both":
        entry["shard_spec_per_file"] = {"rank_0.safetensors": {"flattened_offsets": [[0, 1]]}}
        if data.draw(st.booleans()):
            del entry["shard_rule"]
    else:
        entry["shard_rule"] = mutate_tree(data, rule) if isinstance(rule, (dict, list)) else data.draw(json_values)


@fuzz_settings(EXAMPLES - EXAMPLES // 3)
@given(data=st.data())
def test_fuzz_shard_rules(compact_fuzz_copy, data):
    copy, watched = compact_fuzz_copy
    part = data.draw(st.sampled_from(["model", "optim", "flat"]), label="part")
    path = os.path.join(copy.part(part), "metadata.json")
    with open(path, "rb") as f:
        original = f.read()
    tree = json.loads(original)
    assert tree["format_version"] == 2
    ruled = sorted(k for k, t in tree["tensors"].items() if "shard_rule" in t)
    assert ruled, f"{part}: no tensor has a shard rule"
    keys = data.draw(st.lists(st.sampled_from(ruled), min_size=1, max_size=3, unique=True), label="tensors")
    before = {k: json.loads(json.dumps(tree["tensors"][k])) for k in keys}
    for key in keys:
        mutate_rule(data, tree["tensors"][key], [tree["tensors"][k] for k in ruled if k != key])
    changed = [
        k for k in keys
        if tree["tensors"][k].keys() != before[k].keys()
        or rule_pieces(before[k]["shape"], tree["tensors"][k].get("shard_rule"))
        != rule_pieces(before[k]["shape"], before[k]["shard_rule"])
    ]
    text = json.dumps(tree).encode()
    rel_helpers.rewrite(path, text)
    _count("shard rules")
    try:
        calls = {k: v for k, v in rel_helpers.part_loaders(copy, part).items() if k in FUZZ_LOADERS}
        outcomes = rel_helpers.run_loaders(calls, copy.top, (watched,), hang_s=FUZZ_HANG_S)
        must = DATA_LOADERS & set(calls) if changed else set()
        problems = rel_helpers.rule_violations(outcomes, must_raise=must)
        assert not problems, f"{part}: rules of {keys} mutated (pieces changed: {changed}):\n" + "\n".join(
            f"{k}: {json.dumps(tree['tensors'][k])[:600]}" for k in keys
        ) + "\n\n" + "\n\n".join(problems)
    finally:
        rel_helpers.rewrite(path, original)


@fuzz_settings(EXAMPLES // 3)
@given(data=st.data())
def test_fuzz_checksums_tensor(compact_fuzz_copy, data):
    from checkpointer.format.layout import CHECKSUMS_KEY

    copy, watched = compact_fuzz_copy
    part = data.draw(st.sampled_from(["model", "optim", "flat"]), label="part")
    name = data.draw(st.sampled_from(["rank_0.safetensors", "rank_1.safetensors", "rank_2.safetensors"]), label="file")
    path = os.path.join(copy.part(part), name)
    meta_path = os.path.join(copy.part(part), "metadata.json")
    with open(path, "rb") as f:
        original = f.read()
    with open(meta_path, "rb") as f:
        original_meta = f.read()
    header, body = split_rank_file(path)
    entry = header[CHECKSUMS_KEY]
    begin, end = entry["data_offsets"]
    assert entry["dtype"] == "U8" and end == len(body) and end - begin >= 4
    op = data.draw(st.sampled_from(["flip", "flip", "shorter", "longer", "entry", "entry", "drop", "rename", "metadata"]), label="op")
    must: set[str] = set()
    if op == "flip":  # a stored checksum no longer matches its chunk
        i = data.draw(st.integers(begin, end - 1))
        body = body[:i] + bytes([body[i] ^ data.draw(st.integers(1, 255))]) + body[i + 1 :]
        must = {"load_verify"}
    elif op in ("shorter", "longer"):  # too few or too many checksums for the file's chunks
        n = data.draw(st.sampled_from([1, 3, 4, 8, 4096]))
        n = min(n, end - begin) if op == "shorter" else n
        body = body[: end - n] if op == "shorter" else body + bytes(n)
        entry["data_offsets"], entry["shape"] = [begin, len(body)], [len(body) - begin]
        must = {"load_verify"}
    elif op == "entry":
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        if field == "dtype":
            entry["dtype"] = data.draw(st.sampled_from(DTYPES))
        elif field == "shape":
            entry["shape"] = data.draw(st.sampled_from([[], [0], [end - begin + 1], [end - begin - 1], [2**62], [4, (end - begin) // 4]]))
        else:
            entry["data_offsets"] = [begin + data.draw(st.sampled_from([0, 1, -1, 4])), end + data.draw(st.sampled_from([0, 1, -1, 4]))]
    elif op in ("drop", "rename"):
        header.pop(CHECKSUMS_KEY)
        if op == "rename":
            header[data.draw(st.sampled_from(["__checkpointer_crc32c", "crc", CHECKSUMS_KEY.upper()]))] = entry
        else:
            body = body[:begin]
        must = {"load_verify"}
    else:  # what metadata.json says of the checksums
        meta = json.loads(original_meta)
        field = data.draw(st.sampled_from(["checksum_chunk_bytes", "checksums_in_files", "checksum_algorithm"]))
        meta[field] = data.draw(st.one_of(st.sampled_from(RULE_INTS + RULE_ODD), st.sampled_from([False, "crc32", "crc32c"])))
        rel_helpers.rewrite(meta_path, json.dumps(meta).encode())
    write_rank_file(path, header, body)
    _count("checksums tensor")
    try:
        calls = {k: v for k, v in rel_helpers.part_loaders(copy, part).items() if k in FUZZ_LOADERS}
        outcomes = rel_helpers.run_loaders(calls, copy.top, (watched,), hang_s=FUZZ_HANG_S)
        problems = rel_helpers.rule_violations(outcomes, must_raise=must)
        assert not problems, f"{part}/{name}: checksums tensor mutated ({op}): {entry}\n\n" + "\n\n".join(problems)
    finally:
        rel_helpers.rewrite(path, original)
        rel_helpers.rewrite(meta_path, original_meta)
