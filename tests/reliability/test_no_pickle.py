"""No unpickling anywhere on a load path: every supported format loads with pickle's loaders
patched to raise, and torch.load is only ever called with ``weights_only=True``.

Patched: ``pickle.load``/``loads``/``Unpickler`` and their pure-Python twins
(``pickle._load``/``_loads``/``_Unpickler``), and the C module's (``_pickle.*``). The one
pickle reader the library has, the restricted decoder of the optimizer's param groups
(``format.builtins_pickle._NoGlobals``), subclasses the C unpickler when the library is
imported and keeps working; the test counts that it is used, and that nothing else is.
"""

from __future__ import annotations

import _pickle
import contextlib
import io
import os
import pickle
from dataclasses import dataclass, field
from unittest import mock

import pytest

import rel_helpers
import torch

import checkpointer
from checkpointer import Checkpointer
from checkpointer.format import builtins_pickle


class Unpickling(BaseException):
    """Raised by the patched loaders; a BaseException so that no ``except Exception`` hides it."""


@dataclass
class Record:
    forbidden: list[str] = field(default_factory=list)
    restricted: int = 0
    torch_loads: list[dict] = field(default_factory=list)


@contextlib.contextmanager
def no_unpickling():
    """Patch every unrestricted unpickling entry point to record and raise."""
    record = Record()
    real_load = pickle.Unpickler.load
    real_torch_load = torch.load

    def forbid(name):
        def call(*args, **kwargs):
            record.forbidden.append(name)
            raise Unpickling(f"{name} was called on a load path")

        return call

    class ForbiddenUnpickler:
        def __init__(self, *args, **kwargs):
            record.forbidden.append("Unpickler")
            raise Unpickling("pickle.Unpickler was constructed on a load path")

    def restricted_load(self):
        record.restricted += 1
        return real_load(self)

    def torch_load(*args, **kwargs):
        record.torch_loads.append(dict(kwargs))
        if kwargs.get("weights_only") is not True:
            record.forbidden.append(f"torch.load(weights_only={kwargs.get('weights_only')!r})")
            raise Unpickling("torch.load without weights_only=True on a load path")
        return real_torch_load(*args, **kwargs)

    patches = [
        mock.patch.object(pickle, name, forbid(f"pickle.{name}")) for name in ("load", "loads", "_load", "_loads")
    ]
    patches += [mock.patch.object(_pickle, name, forbid(f"_pickle.{name}")) for name in ("load", "loads")]
    patches += [mock.patch.object(pickle, name, ForbiddenUnpickler) for name in ("Unpickler", "_Unpickler")]
    patches += [
        mock.patch.object(_pickle, "Unpickler", ForbiddenUnpickler),
        mock.patch.object(builtins_pickle._NoGlobals, "load", restricted_load),
        mock.patch.object(torch, "load", torch_load),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield record


def test_the_patches_bite():
    """A load path that did unpickle would be caught (and the restricted decoder still works)."""
    data = pickle.dumps({"lr": 0.5})
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    with no_unpickling() as record:
        with pytest.raises(Unpickling):
            pickle.loads(data)
        with pytest.raises(Unpickling):
            pickle.Unpickler(io.BytesIO(data)).load()
        with pytest.raises(Unpickling):
            torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        assert builtins_pickle.decode_builtins(data, where="test") == {"lr": 0.5}
        assert torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["w"].sum() == 2
    assert record.restricted == 1
    assert record.forbidden == ["pickle.loads", "Unpickler", "torch.load(weights_only=False)"]


@pytest.fixture
def formats(ckpt, tmp_path):
    """The checkpoint in every format the library loads, written before the patches."""
    from checkpointer import export_safetensors

    model_dir = ckpt.part("model")
    full = ckpt.expected["model"]
    out = {"ours": ckpt.top}
    out["single"] = str(tmp_path / "model.safetensors")
    export_safetensors(model_dir, out["single"])
    out["hf_index"] = str(tmp_path / "hf")
    export_safetensors(model_dir, out["hf_index"], max_shard_size=200)
    out["pt"] = str(tmp_path / "model.pt")
    torch.save({"model": dict(full)}, out["pt"])
    out["bin"] = str(tmp_path / "pytorch_model.bin")
    torch.save(dict(full), out["bin"])
    os.makedirs(tmp_path / "hf_bin")
    torch.save(dict(full), tmp_path / "hf_bin" / "pytorch_model.bin")
    out["hf_bin"] = str(tmp_path / "hf_bin")
    assert os.path.exists(os.path.join(out["hf_index"], "model.safetensors.index.json"))
    return out


def test_every_format_loads_without_unpickling(ckpt, formats, tmp_path):
    from checkpointer import cli

    full = ckpt.expected["model"]
    expect_pt = {f"model.{k}": v for k, v in full.items()}
    with no_unpickling() as record:
        # This library's checkpoints, every loader.
        for part in ("model", "optim", "flat"):
            for verify in (False, True):
                got = rel_helpers.load_part(ckpt.part(part), ckpt.expected[part], verify=verify)
                assert all(torch.equal(got[k], v) for k, v in ckpt.expected[part].items())
            assert Checkpointer().unshard(ckpt.part(part)).keys() >= ckpt.expected[part].keys()
            assert Checkpointer().get_metadata(ckpt.part(part)).tensors
        got = rel_helpers.load_model_top(ckpt.top)
        assert all(torch.equal(got[k], v) for k, v in full.items())
        groups = checkpointer.unshard_optim_state(ckpt.top)["param_groups"]
        assert groups and groups[0]["lr"] == pytest.approx(1e-2)
        assert checkpointer.unshard_model_state(ckpt.top).keys() == full.keys()
        assert checkpointer.latest_checkpoint(ckpt.run_dir) == ckpt.top
        # lazy_load of every format it detects.
        for name, path in formats.items():
            got = dict(checkpointer.lazy_load(path))
            want = expect_pt if name == "pt" else full
            assert got.keys() == want.keys(), name
            assert all(torch.equal(got[k], v) for k, v in want.items()), name
        got = dict(checkpointer.lazy_load(formats["bin"], mmap=True))
        assert all(torch.equal(got[k], v) for k, v in full.items())
        # The command line's readers.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert cli.main(["verify", ckpt.top]) == 0
            assert cli.main(["inspect", ckpt.top, "--json"]) == 0
            assert cli.main(["convert", ckpt.part("model"), str(tmp_path / "conv_hf"), "--to", "hf"]) == 0
            assert cli.main(["convert", formats["hf_index"], str(tmp_path / "conv_ours"), "--to", "checkpointer"]) == 0
    assert record.forbidden == [], record.forbidden
    assert record.restricted >= 2, "the param groups were not read through the restricted decoder"
    assert record.torch_loads and all(kw.get("weights_only") is True for kw in record.torch_loads)


def _load_everything_without_unpickling(rank, world_size, root):
    """On every rank of the harness: distributed loads (default and two-stage) under the patches."""
    from dist_helpers import build_model, build_optim

    from checkpointer import load_model_and_optim_state

    with no_unpickling() as record:
        for strategy in ("default", "two_stage"):
            model = build_model(world_size, seed=1)
            optim = build_optim(model, "adamw", fresh=True)
            load_model_and_optim_state(root, model, optim, strategy=strategy)
        Checkpointer().unshard(os.path.join(root, "optim"))
        checkpointer.unshard_optim_state(root, rank0_only=True)
    return record.forbidden, record.restricted


def test_distributed_loads_without_unpickling(run_distributed, template):
    results = run_distributed(_load_everything_without_unpickling, 3, template.root, timeout=180)
    for rank, (forbidden, restricted) in enumerate(results):
        assert forbidden == [], f"rank {rank} unpickled: {forbidden}"
        assert restricted >= 2, f"rank {rank} did not decode param groups through the restricted decoder"
