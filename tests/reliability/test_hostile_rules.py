"""Hostile shard rules (format 2) in a real checkpoint: every loader refuses them, never hangs
or allocates what the rule claims."""

from __future__ import annotations

import pytest
from hostile import check_part, edit_metadata

KEY = "proj.weight"  # [13, 7], FSDP2 over 3 ranks: {"form": "box", "cuts": [[0, 5]], "files": [0, [[1, 3, 1]]]}


def set_rule(copy, **fields) -> None:
    def edit(meta):
        rule = meta["tensors"][KEY]["shard_rule"]
        assert rule == {"form": "box", "cuts": [[0, 5]], "files": [0, [[1, 3, 1]]]}, rule
        rule.update(fields)

    edit_metadata(copy, "model", edit)


@pytest.mark.parametrize(
    "fields",
    [
        {"cuts": [[0, 1], [1, 1]], "files": [0, [[1, 10**12, 1]]]},  # 91 cells named as 10^12 files
        {"cuts": [[0, 5], [0, 5]]},  # a dim cut twice: the pieces would overlap
        {"cuts": [[2, 5]]},  # leaves the tensor
        {"cuts": [[0, 0]]},
        {"files": [0, [[1, 2, 1]]]},  # two pieces in one file
        {"files": [1, [[1, 3, 1]]]},  # rank_3 past the world size
        {"files": [0, [[1, 3, 10**12]]]},
        {"form": "strided"},
    ],
    ids=["10^12_files", "dim_twice", "outside", "chunk_0", "shared_file", "past_world", "huge_mul", "form"],
)
def test_rules_that_metadata_alone_refuses(compact_ckpt, tmp_path, fields):
    set_rule(compact_ckpt, **fields)
    check_part(compact_ckpt, "model", tmp_path, "metadata.json", "proj.weight")


@pytest.mark.parametrize(
    "fields",
    [
        {"cuts": [[0, 6]]},  # pieces of 6 rows: more than rank_0 holds
        {"cuts": [[0, 4]]},  # 4 pieces of 4 rows: fewer than the files hold, and rank_3 is named
        {"cuts": [[0, 7]], "files": [0, [[1, 2, 1]]]},  # 2 pieces: rows 7..12 claimed from rank_1
        {"cuts": [[1, 3]]},  # cut along the other dim: the files' pieces are rows
        {"form": "flat", "cuts": [[0, 31]]},  # 3 ranges of 31, 31, 29 elements: not what the files hold
    ],
    ids=["more_rows", "fewer_rows", "two_pieces", "other_dim", "flat"],
)
def test_rules_the_files_do_not_back(compact_ckpt, tmp_path, fields):
    set_rule(compact_ckpt, **fields)
    check_part(compact_ckpt, "model", tmp_path, "proj.weight", "metadata.json", "rank_", scope="data")


def test_a_file_of_another_save(compact_ckpt, tmp_path):
    edit_metadata(compact_ckpt, "model", lambda meta: meta.update(file_id="0123456789abcdef"))
    check_part(compact_ckpt, "model", tmp_path, "another save", scope="data")
