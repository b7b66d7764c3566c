"""The Hugging Face load's arguments and detection, in one process (plain modules).

``key_map`` as a dict (unlisted names keep their own, None skips) or a callable (a non-str answer
is a ``TypeError``); ``hf://`` URLs parsed or refused; a directory told apart from this library's
checkpoints; ``key_map``/``dtype`` refused for this library's checkpoints; a plain model filled
from ``safetensors.torch.save_file`` output (a tied head not missing, a tensor of another shape
refused by name). Sharded models, transformers, remote storage: ``dist/test_dist_hf_load.py``
and ``remote/test_remote_hf_*.py``.
"""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import checkpointer
from checkpointer import CheckpointMismatchError, IncompleteCheckpointError, load_model_and_optim_state
from checkpointer.models.hf_load import _cast_batches, is_hf_checkpoint, load_hf, map_name
from checkpointer.tools.hub import parse_hf_url


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight
        self.norm = nn.LayerNorm(4)


def test_map_name():
    assert map_name(None, "a.b") == "a.b"
    mapping = {"model.embed": "embed", "drop.me": None}
    assert [map_name(mapping, k) for k in ("model.embed", "drop.me", "other")] == ["embed", None, "other"]
    assert map_name(lambda k: k.removeprefix("model."), "model.x") == "x"
    with pytest.raises(TypeError, match="'k'"):
        map_name(lambda k: 3, "k")


def test_parse_hf_url():
    assert parse_hf_url("hf://org/name") == ("org/name", None, "")
    assert parse_hf_url("hf://org/name@v1.0") == ("org/name", "v1.0", "")
    assert parse_hf_url("hf://org/name@abc/sub/model.safetensors") == ("org/name", "abc", "sub/model.safetensors")
    for bad in ("hf://org", "hf://org/", "hf://org/name@", "hf://org/../x", "hf://org/name/../../etc"):
        with pytest.raises(ValueError):
            parse_hf_url(bad)
    # What cached-path cannot carry: it would fetch another revision or repository (found by a review).
    for bad in ("hf://org/name@release@v2", "hf://org/name@rev@", "hf://org@x/name"):
        with pytest.raises(ValueError, match="holding '@' cannot be fetched through hf://"):
            parse_hf_url(bad)
    with pytest.raises(ValueError, match=r"a revision holding '/' \(refs/pr/1\) cannot be fetched"):
        parse_hf_url("hf://org/name@refs/pr/1")


def test_detection_and_arguments(tmp_path):
    model = Tied()
    torch.manual_seed(0)
    state = {"embed.weight": torch.randn(10, 4), "norm.weight": torch.randn(4), "norm.bias": torch.randn(4)}
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(state, str(hf / "model.safetensors"))
    ours = str(tmp_path / "ours")
    checkpointer.save_model_and_optim_state(ours, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert is_hf_checkpoint(str(hf)) and is_hf_checkpoint(str(hf / "model.safetensors"))
    assert is_hf_checkpoint("hf://org/name")
    assert not is_hf_checkpoint(ours) and not is_hf_checkpoint(os.path.join(ours, "model"))
    assert not is_hf_checkpoint(str(tmp_path / "nowhere"))

    for options in ({"key_map": {"a": "b"}}, {"dtype": torch.float32}):
        with pytest.raises(ValueError, match="Hugging Face"):
            checkpointer.load_model_and_optim_state(ours, model, **options)

    result = checkpointer.load_model_and_optim_state(str(hf), model)  # out.weight is tied: not missing
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    assert torch.equal(model.out.weight, state["embed.weight"]) and torch.equal(model.norm.bias, state["norm.bias"])

    save_file({**state, "norm.bias": torch.zeros(5)}, str(hf / "model.safetensors"))
    with pytest.raises(CheckpointMismatchError, match="norm.bias"):
        checkpointer.load_model_and_optim_state(str(hf), Tied())
    # by the model's name and the source given, not the engine's view (found by a review: the
    # checkpoint key and, for hf://, the cache's blobs/ directory)
    save_file({"model.norm.bias": torch.zeros(5)}, str(hf / "model.safetensors"))
    shown = re.escape(f"shape mismatch for 'norm.bias': {hf} stores 'model.norm.bias' as [5], the model has [4]")
    with pytest.raises(CheckpointMismatchError, match=shown):
        checkpointer.load_model_and_optim_state(str(hf), Tied(), key_map=lambda k: k.removeprefix("model."), strict=False)


def test_a_directory_of_torch_pickles_is_named_as_such(tmp_path):
    """``pytorch_model.bin`` alone: the error said only that ``DIR/model`` does not exist (found by a review)."""
    torch.save({"weight": torch.ones(2, 2)}, str(tmp_path / "pytorch_model.bin"))
    with pytest.raises(IncompleteCheckpointError, match=r"holds pytorch_model\.bin, a Hugging Face checkpoint as torch pickles"):
        load_model_and_optim_state(str(tmp_path), torch.nn.Linear(2, 2, bias=False))


def test_unexpected_keys_are_the_checkpoints_names_not_the_mapped_ones(tmp_path):
    """A key that ``key_map`` renames to a name the model lacks is reported (and refused) by the
    name the checkpoint has, which the user can look up, not by what the map made of it."""
    torch.manual_seed(0)
    state = {"embed.weight": torch.randn(10, 4), "norm.weight": torch.randn(4), "norm.bias": torch.randn(4)}
    save_file(state, str(tmp_path / "model.safetensors"))
    key_map = {"norm.weight": "ln.weight", "norm.bias": "ln.bias"}
    model = Tied()
    norm = {k: v.clone() for k, v in model.norm.state_dict().items()}
    result = load_model_and_optim_state(str(tmp_path), model, key_map=key_map, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["norm.weight", "norm.bias"], ["norm.bias", "norm.weight"])
    assert torch.equal(model.embed.weight, state["embed.weight"])
    assert all(torch.equal(v, norm[k]) for k, v in model.norm.state_dict().items())
    with pytest.raises(CheckpointMismatchError, match=r"2 checkpoint model keys the model lacks: \['norm.bias', 'norm.weight'\]"):
        load_model_and_optim_state(str(tmp_path), Tied(), key_map=key_map)


def test_a_key_map_that_maps_two_checkpoint_keys_to_one_model_key_is_refused(tmp_path):
    torch.manual_seed(0)
    state = {"embed.weight": torch.randn(10, 4), "norm.weight": torch.randn(4), "norm.bias": torch.randn(4),
             "ln.weight": torch.randn(4)}
    save_file(state, str(tmp_path / "model.safetensors"))
    model = Tied()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for strict in (True, False):
        with pytest.raises(CheckpointMismatchError, match=r"key_map maps both 'ln.weight' and 'norm.weight' .* to the model's 'norm.weight'"):
            load_model_and_optim_state(str(tmp_path), model, key_map={"ln.weight": "norm.weight"}, strict=strict)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_casting_an_empty_tensor_first_loads_the_rest(tmp_path):
    """A tensor to cast that counts no bytes per rank (empty, or a few bytes over many ranks) may
    come first: it opens the first batch like any other."""
    torch.manual_seed(0)
    state = {"a.weight": torch.ones(0, 4, dtype=torch.bfloat16), "b.weight": torch.randn(2, 4).to(torch.bfloat16)}
    save_file(state, str(tmp_path / "model.safetensors"))
    model = nn.Sequential()
    model.add_module("a", nn.Linear(4, 0, bias=False))
    model.add_module("b", nn.Linear(4, 2, bias=False))
    assert load_model_and_optim_state(str(tmp_path), model, dtype=torch.float32) == checkpointer.LoadResult()
    assert model.a.weight.shape == (0, 4) and torch.equal(model.b.weight, state["b.weight"].float())
    for budget in (1, 100):
        with torch.no_grad():
            model.b.weight.zero_()
        load_hf(str(tmp_path), model, dtype=torch.float32, cast_batch_bytes=budget)
        assert torch.equal(model.b.weight, state["b.weight"].float())
    sizes = {"empty": (0, 4), "x": (3,), "y": (5,)}
    assert _cast_batches([(0, k, None, "BF16") for k in sizes], sizes, 6) == [
        [(0, "empty", None, "BF16"), (0, "x", None, "BF16")], [(0, "y", None, "BF16")]]


class Untied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.norm = nn.LayerNorm(4)


def test_two_tensors_that_the_model_ties_load_the_first_and_say_so(tmp_path):
    """A checkpoint holding ``embed.weight`` and ``out.weight`` as two tensors, into a model that
    ties them: the model's first name is loaded and the other is not read, with a warning naming
    both (the last one read used to win, silently). Both ours and Hugging Face files; a checkpoint
    of the tied model itself (one tensor, an alias) loads without a warning."""
    torch.manual_seed(0)
    untied = Untied()
    state = {k: v.detach().clone() for k, v in untied.state_dict().items()}
    assert not torch.equal(state["embed.weight"], state["out.weight"].reshape(10, 4))
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(state, str(hf / "model.safetensors"))
    ours = str(tmp_path / "ours")
    checkpointer.save_model_and_optim_state(ours, untied, torch.optim.SGD(untied.parameters(), lr=0.1))
    for source in (str(hf), ours):
        model = Tied()
        with pytest.warns(UserWarning, match=r"holds 'embed.weight', 'out.weight' as separate tensors.*'embed.weight' is loaded"):
            result = load_model_and_optim_state(source, model)
        assert (result.missing_keys, result.unexpected_keys) == ([], [])
        assert torch.equal(model.embed.weight, state["embed.weight"]) and model.out.weight is model.embed.weight
        assert torch.equal(model.norm.weight, state["norm.weight"])

    tied_ckpt = str(tmp_path / "tied")
    saved = Tied()
    checkpointer.save_model_and_optim_state(tied_ckpt, saved, torch.optim.SGD(saved.parameters(), lr=0.1))
    model = Tied()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model_and_optim_state(tied_ckpt, model)
    assert torch.equal(model.embed.weight, saved.embed.weight)
