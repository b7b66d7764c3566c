"""The public surface against the contract (``shared/API.md``): the names the package exports,
their signatures (parameter names, order, defaults, keyword-only-ness), the error hierarchy and
the command line's subcommands and options.

The contract is copied here as text, in API.md's own notation, so that the test runs without
the shared folder; a change to either side shows up as a failure naming the difference.
"""

from __future__ import annotations

import ast
import re
import inspect
import tomllib
from concurrent.futures import Future
from pathlib import Path

import pytest

import checkpointer
from checkpointer.cli import build_parser

REPO = Path(__file__).resolve().parents[2]

# API.md, "Top-level functions", "fairseq2-style lazy loading" and "Command line" (the export).
FUNCTIONS = {
    "save_model_and_optim_state": "f(dir, model, optim, *, train_state=None, save_overwrite=False)",
    # strategy: API.md's "Two-stage loading" names load_model_and_optim_state(..., strategy="two_stage").
    # key_map, dtype: API.md's "Starting from a Hugging Face model".
    "load_model_and_optim_state": (
        'f(dir, model, optim=None, *, train_state=None, strict=True, validate=True, strategy="default", '
        "key_map=None, dtype=None)"
    ),
    "unshard_model_state": "f(dir, *, device=None, rank0_only=False, no_dist=False)",
    "unshard_optim_state": "f(dir, *, device=None, rank0_only=False, no_dist=False)",
    # stage_in_background: beyond API.md, for issue 29's torchtitan backend (its trainer waits for
    # staging before the optimizer step); keyword-only with a default, so every call API.md shows
    # works unchanged.
    "async_save_model_and_optim_state": (
        "f(dir, model, optim, *, train_state=None, save_overwrite=False, stage_in_background=False)"
    ),
    "latest_checkpoint": "f(run_dir)",
    "prune": "f(run_dir, *, keep_last, keep_every=None)",
    "lazy_load": "f(path, shard_dims=None, *, tp_rank=0, tp_size=1, mmap=False, state_dict_converter=None, restrict=True)",
    "reshard_tensor": "f(key, source_splits, source_shard_sizes, target_shard_sizes, target_shard_ranks, shard_dims)",
    "get_shard_dims": "f(model)",
    "export_safetensors": 'f(dir, out, *, max_shard_size="5GB", dtype=None, keys=None)',
}

# API.md, "Checkpointer: flat state dicts".
METHODS = {
    "save": "f(self, dir, state_dict, *, save_overwrite=False)",
    "load": 'f(self, dir, state_dict, *, no_dist=False, metadata=None, strategy="default", verify=False)',
    "async_save": "f(self, dir, state_dict, *, save_overwrite=False)",
    "unshard": "f(self, dir, *, device=None, rank0_only=False, no_dist=False, num_threads=None)",
    "get_metadata": "f(self, dir, *, no_dist=False)",
}

METADATA_CLASSES = {"StorageMetadata", "TensorStorageMetadata", "TensorShardSpec"}

# API.md, "Training state, partial loads and retention".
TRAINING_CLASSES = {"LoadResult", "PerRank", "RNGState"}

# API.md, "Errors": class -> its base.
ERRORS = {
    "CheckpointError": Exception,
    "CorruptCheckpointError": "CheckpointError",
    "IncompleteCheckpointError": "CorruptCheckpointError",
    "CheckpointMismatchError": "CheckpointError",
}

# Exported beyond the names API.md lists, each for a reason API.md gives:
EXTRAS = {
    # "a flat-sharded tensor (a local 1-D piece of a larger tensor described by flattened
    # offsets)" is a value type of Checkpointer's state dicts: users need a way to make one.
    "FlatShardedTensor",
    # "An error on one rank makes every rank raise": what the other ranks raise (a CheckpointError).
    "RankFailedError",
    # "An error on one rank makes every rank raise", and replicas that disagree refuse a save
    # (issue #26): what every rank raises then, so a training loop can tell it from an I/O error.
    "ReplicaMismatchError",
}


def contract_params(text: str) -> list[tuple[str, str, object]]:
    """``f(a, b=1, *, c=None)`` -> ``[(name, kind, default)]`` (``inspect.Parameter.empty`` when none)."""
    args = ast.parse(f"def {text}: pass").body[0].args  # type: ignore[attr-defined]
    out: list[tuple[str, str, object]] = []
    positional = args.posonlyargs + args.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + [
        ast.literal_eval(d) for d in args.defaults
    ]
    for arg, default in zip(positional, defaults):
        out.append((arg.arg, "POSITIONAL_OR_KEYWORD", default))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        out.append((arg.arg, "KEYWORD_ONLY", inspect.Parameter.empty if default is None else ast.literal_eval(default)))
    return out


def actual_params(fn) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_contract_parser_reads_api_md_notation():
    assert contract_params('f(a, b=None, *, c=1, d="x")') == [
        ("a", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
        ("b", "POSITIONAL_OR_KEYWORD", None),
        ("c", "KEYWORD_ONLY", 1),
        ("d", "KEYWORD_ONLY", "x"),
    ]


def test_exports_exactly_the_contract():
    named = set(FUNCTIONS) | {"Checkpointer"} | METADATA_CLASSES | TRAINING_CLASSES | set(ERRORS)
    assert set(checkpointer.__all__) == named | EXTRAS
    assert len(checkpointer.__all__) == len(set(checkpointer.__all__)), "a name is listed twice in __all__"
    for name in checkpointer.__all__:
        assert getattr(checkpointer, name, None) is not None, f"checkpointer.{name} is in __all__ but missing"
    public = {n for n in vars(checkpointer) if not n.startswith("_") and not inspect.ismodule(getattr(checkpointer, n))}
    assert public == set(checkpointer.__all__), f"public names outside __all__: {sorted(public - set(checkpointer.__all__))}"


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_function_signature(name):
    fn = getattr(checkpointer, name)
    assert inspect.isfunction(fn), f"{name} is not a function"
    assert actual_params(fn) == contract_params(FUNCTIONS[name]), name


@pytest.mark.parametrize("name", sorted(METHODS))
def test_checkpointer_method_signature(name):
    method = getattr(checkpointer.Checkpointer, name)
    assert actual_params(method) == contract_params(METHODS[name]), name


def test_checkpointer_is_constructed_without_arguments():
    assert actual_params(checkpointer.Checkpointer.__init__) == [("self", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty)]


def test_return_annotations_of_the_async_saves_are_futures():
    for fn in (checkpointer.async_save_model_and_optim_state, checkpointer.Checkpointer.async_save):
        assert "Future" in str(inspect.signature(fn).return_annotation), fn.__qualname__


def test_error_hierarchy():
    for name, base in ERRORS.items():
        cls = getattr(checkpointer, name)
        parent = base if isinstance(base, type) else getattr(checkpointer, base)
        assert cls.__bases__ == (parent,), f"{name} derives from {cls.__bases__}, the contract says {parent.__name__}"
    assert issubclass(checkpointer.RankFailedError, checkpointer.CheckpointError)
    assert issubclass(checkpointer.ReplicaMismatchError, checkpointer.CheckpointError)
    assert not issubclass(checkpointer.CheckpointError, OSError)


def test_metadata_classes_are_pydantic_models_with_the_contract_fields():
    from pydantic import BaseModel

    fields = {
        "StorageMetadata": {"tensors"},
        "TensorStorageMetadata": {"shape", "is_sharded", "dtype", "shard_spec_per_file"},
        "TensorShardSpec": {"flattened_offsets", "local_shape", "global_offset"},
    }
    for name, wanted in fields.items():
        cls = getattr(checkpointer, name)
        assert issubclass(cls, BaseModel), name
        assert wanted <= set(cls.model_fields), f"{name} lacks {wanted - set(cls.model_fields)}"


def test_saving_over_a_checkpoint_is_file_exists_error(tmp_path):
    import torch

    ckpt = checkpointer.Checkpointer()
    ckpt.save(str(tmp_path / "c"), {"w": torch.zeros(2)})
    with pytest.raises(FileExistsError):
        ckpt.save(str(tmp_path / "c"), {"w": torch.zeros(2)})


# ---------------------------------------------------------------------------------------------
# Command line: API.md's "Command line"
# ---------------------------------------------------------------------------------------------


def _subparsers(parser):
    import argparse

    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def _positionals(parser) -> list[str]:
    return [a.dest for a in parser._actions if not a.option_strings and a.dest != "help"]


def _options(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def test_cli_subcommands():
    assert set(_subparsers(build_parser())) == {"inspect", "verify", "unshard", "convert", "prune"}


@pytest.mark.parametrize(
    "command, positionals, options",
    [
        ("inspect", ["dir"], {"--json"}),
        ("verify", ["dir"], set()),
        ("unshard", ["dir", "out"], set()),
        ("convert", ["src", "dst"], {"--to"}),
        ("prune", ["dir"], {"--keep-last", "--keep-every", "--dry-run"}),
    ],
)
def test_cli_subcommand_arguments(command, positionals, options):
    sub = _subparsers(build_parser())[command]
    assert _positionals(sub) == positionals
    assert options <= _options(sub)


def test_cli_convert_to_is_required_with_the_four_formats(capsys):
    parser = build_parser()
    (to,) = [a for a in _subparsers(parser)["convert"]._actions if "--to" in a.option_strings]
    assert to.required and tuple(to.choices) == ("checkpointer", "dcp", "hf", "olmo")
    with pytest.raises(SystemExit) as ex:
        parser.parse_args(["convert", "a", "b"])
    assert ex.value.code == 2
    with pytest.raises(SystemExit) as ex:
        parser.parse_args(["convert", "a", "b", "--to", "pt"])
    assert ex.value.code == 2
    capsys.readouterr()


def test_cli_parses_the_contract_examples():
    parser = build_parser()
    assert parser.parse_args(["inspect", "D", "--json"]).json is True
    assert parser.parse_args(["verify", "D"]).dir == "D"
    args = parser.parse_args(["unshard", "D", "out.safetensors"])
    assert (args.dir, args.out) == ("D", "out.safetensors")
    args = parser.parse_args(["convert", "S", "T", "--to", "hf"])
    assert (args.src, args.dst, args.to) == ("S", "T", "hf")
    args = parser.parse_args(["prune", "R", "--keep-last", "3", "--keep-every", "1000", "--dry-run"])
    assert (args.dir, args.keep_last, args.keep_every, args.dry_run) == ("R", 3, 1000, True)


def test_console_script_declared():
    """The console script as packaged (``python -m checkpointer`` runs in tests/cli/test_cli_process.py)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == "checkpointer"
    assert project["scripts"] == {"checkpointer": "checkpointer.cli:main"}
    assert project["requires-python"] == ">=3.11"


# ---------------------------------------------------------------------------------------------
# Docstrings: every public name has one, naming every parameter and the contract's errors
# ---------------------------------------------------------------------------------------------


def _public_callables():
    out = [(name, getattr(checkpointer, name)) for name in sorted(FUNCTIONS)]
    out += [(f"Checkpointer.{name}", getattr(checkpointer.Checkpointer, name)) for name in sorted(METHODS)]
    return out


@pytest.mark.parametrize("name", sorted(checkpointer.__all__))
def test_every_public_name_has_a_docstring(name):
    assert (inspect.getdoc(getattr(checkpointer, name)) or "").strip(), name


@pytest.mark.parametrize("name, fn", _public_callables(), ids=[n for n, _ in _public_callables()])
def test_docstrings_name_every_parameter(name, fn):
    doc = inspect.getdoc(fn) or ""
    missing = [p for p in inspect.signature(fn).parameters if p != "self" and not re.search(rf"\b{p}\b", doc)]
    assert not missing, f"{name}'s docstring does not mention {missing}"


@pytest.mark.parametrize(
    "name, errors",
    [
        ("save_model_and_optim_state", ["FileExistsError"]),
        ("async_save_model_and_optim_state", ["FileExistsError", ".result()"]),
        ("load_model_and_optim_state", ["IncompleteCheckpointError", "CorruptCheckpointError", "CheckpointMismatchError"]),
        ("Checkpointer.save", ["FileExistsError"]),
        ("Checkpointer.load", ["IncompleteCheckpointError", "CorruptCheckpointError", "CheckpointMismatchError"]),
        ("Checkpointer.get_metadata", ["IncompleteCheckpointError"]),
    ],
)
def test_docstrings_name_the_contract_errors(name, errors):
    doc = inspect.getdoc(dict(_public_callables())[name]) or ""
    for error in errors:
        assert error in doc, f"{name}'s docstring does not mention {error}"
