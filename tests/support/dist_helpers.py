"""Models, sharding layouts and exact comparisons shared by the multi-process tests.

Everything here runs inside the workers of ``harness.py``; functions take explicit
arguments and the only state kept per process is a cache of device meshes (building a
2-D mesh creates process groups, a collective; doing it once per layout keeps tests fast).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from typing import Any, Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

_MESHES: dict[tuple, Any] = {}


def saved_once(run_distributed, tmp_path_factory, save, world_size_of, prefix: str):
    """``get(layout)``: the directory of a checkpoint ``save`` wrote in ``layout`` at
    ``world_size_of(layout)`` ranks, written once per module (for a module-scoped fixture)."""
    cache: dict[str, str] = {}

    def get(layout: str) -> str:
        if layout not in cache:
            ckpt = str(tmp_path_factory.mktemp(f"{prefix}-{layout.replace('@', '-')}"))
            run_distributed(save, world_size_of(layout), ckpt, layout)
            cache[layout] = ckpt
        return cache[layout]

    return get


def mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None):
    """A CPU device mesh over all ranks, built once per process per shape (and dim names)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


# ---------------------------------------------------------------------------------------
# A tiny model with uneven shapes: Embedding(11, 6), Linear(7, 13), a bias of 5, a buffer.
# ---------------------------------------------------------------------------------------


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.proj = nn.Linear(7, 13)
        self.bias = nn.Parameter(torch.randn(5))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = torch.cat([h, h.mean(-1, keepdim=True)], dim=-1)
        h = self.proj(h)
        return h[..., :5] * self.scale + self.bias


def build_model(world_size: int, seed: int = 0, fsdp: bool | None = None) -> nn.Module:
    """The tiny model; wrapped with FSDP2 over all ranks when ``world_size > 1``."""
    torch.manual_seed(seed)
    model = TinyModel()
    if fsdp is None:
        fsdp = world_size > 1
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        m = mesh((world_size,))
        fully_shard(model.embed, mesh=m)
        fully_shard(model.proj, mesh=m)
        fully_shard(model, mesh=m)
    return model


def build_optim(model: nn.Module, kind: str, fresh: bool = False) -> torch.optim.Optimizer:
    """AdamW (weight decay on, so a hidden zero-gradient step would show) or SGD with momentum.

    ``fresh`` uses different hyper-parameters, which a load must overwrite.
    """
    params = list(model.parameters())
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.5 if fresh else 1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5 if fresh else 0.05, momentum=0.9, weight_decay=0.01)
    raise ValueError(kind)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch on every rank (so results do not depend on the world size)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 11, (4, 3), generator=g)
    target = torch.randn(4, 3, 5, generator=g)
    return ids, target


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids, target = batch(step)
        loss = (model(ids) - target).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach().item())
    return losses


# ---------------------------------------------------------------------------------------
# Full (unsharded) views and exact comparisons
# ---------------------------------------------------------------------------------------


def full(t: Any) -> Any:
    if isinstance(t, DTensor):
        return t.full_tensor().detach().clone()
    if isinstance(t, torch.Tensor):
        return t.detach().clone()
    return t


def model_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full(v) for k, v in model.state_dict().items()}


def param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def optim_full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Optimizer state keyed by parameter name (``name.exp_avg``), plus the param groups."""
    names = param_names(model)
    out: dict[str, Any] = {}
    for p, st in optim.state.items():
        for k, v in st.items():
            out[f"state:{names[id(p)]}.{k}"] = full(v)
    for i, g in enumerate(optim.param_groups):
        for k, v in g.items():
            out[f"group{i}:{k}"] = [names[id(p)] for p in v] if k == "params" else v
    return out


def diff(expected: dict[str, Any], actual: dict[str, Any], exact: bool = True) -> list[str]:
    """Every difference between two flat dicts of tensors / plain values."""
    problems = []
    for k in sorted(set(expected) | set(actual)):
        if k not in actual:
            problems.append(f"{k}: missing")
            continue
        if k not in expected:
            problems.append(f"{k}: unexpected")
            continue
        e, a = expected[k], actual[k]
        if isinstance(e, torch.Tensor) or isinstance(a, torch.Tensor):
            if not (isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor)):
                problems.append(f"{k}: {type(e).__name__} vs {type(a).__name__}")
            elif e.dtype != a.dtype or e.shape != a.shape:
                problems.append(f"{k}: {e.dtype}{tuple(e.shape)} vs {a.dtype}{tuple(a.shape)}")
            elif exact and not torch.equal(e, a):
                problems.append(f"{k}: values differ\n  expected {e}\n  actual   {a}")
            elif not exact and not torch.allclose(e, a, rtol=1e-5, atol=1e-6):
                problems.append(f"{k}: values not close\n  expected {e}\n  actual   {a}")
        elif e != a:
            problems.append(f"{k}: {e!r} vs {a!r}")
    return problems


def assert_same(expected: dict[str, Any], actual: dict[str, Any], what: str = "state", exact: bool = True) -> None:
    problems = diff(expected, actual, exact)
    if problems:
        raise AssertionError(f"{what} differs in {len(problems)} entries:\n" + "\n".join(problems))


def local_data_ptrs(model: nn.Module) -> dict[str, int]:
    out = {}
    for k, v in model.state_dict().items():
        t = v.to_local() if isinstance(v, DTensor) else v
        out[k] = t.data_ptr()
    return out


# ---------------------------------------------------------------------------------------
# Tensor-parallel layouts of a flat state dict
# ---------------------------------------------------------------------------------------

# name -> (world size, mesh shape or None for plain tensors, placements)
LAYOUTS: dict[str, tuple[int, tuple[int, ...] | None, tuple]] = {
    "plain": (1, None, ()),
    "shard0@2": (2, (2,), (Shard(0),)),
    "shard0@3": (3, (3,), (Shard(0),)),
    "shard0@4": (4, (4,), (Shard(0),)),
    "shard1@2": (2, (2,), (Shard(1),)),
    "shard1@4": (4, (4,), (Shard(1),)),
    "rep_shard0@2x2": (4, (2, 2), (Replicate(), Shard(0))),
    "shard0_shard1@2x2": (4, (2, 2), (Shard(0), Shard(1))),
}


def reference_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(7, 13, generator=g),
        "v": torch.randn(5, 9, generator=g).to(torch.bfloat16),
        "k": torch.randint(-100, 100, (3, 5), generator=g),
    }


def local_piece(full_tensor: torch.Tensor, mesh_obj, placements) -> torch.Tensor:
    """This rank's piece of ``full_tensor`` under ``placements`` (``torch.chunk`` semantics, as DTensor)."""
    piece = full_tensor
    coord = mesh_obj.get_coordinate()
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            n = mesh_obj.size(mesh_dim)
            chunks = list(torch.chunk(piece, n, dim=placement.dim))
            while len(chunks) < n:
                empty_shape = list(piece.shape)
                empty_shape[placement.dim] = 0
                chunks.append(piece.new_empty(empty_shape))
            piece = chunks[coord[mesh_dim]]
    return piece.contiguous().clone()


def to_layout(full_tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """``full_tensor`` in a layout of ``LAYOUTS``, built locally (no collective, any dtype)."""
    _, shape, placements = LAYOUTS[layout]
    if shape is None:
        return full_tensor.clone()
    m = mesh(shape)
    local = local_piece(full_tensor, m, placements)
    return DTensor.from_local(
        local, m, list(placements), run_check=False, shape=full_tensor.shape, stride=full_tensor.stride()
    )


def lay_out(full_tensors: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    return {k: to_layout(v, layout) for k, v in full_tensors.items()}


def zeros_like_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(
                torch.zeros_like(v.to_local()), v.device_mesh, v.placements, shape=v.shape, stride=v.stride()
            )
        else:
            out[k] = torch.zeros_like(v)
    return out


# ---------------------------------------------------------------------------------------
# Files on disk
# ---------------------------------------------------------------------------------------


def files_under(top: str) -> set[str]:
    out = set()
    for root, _, names in os.walk(top):
        for n in names:
            out.add(os.path.relpath(os.path.join(root, n), top))
    return out


def normalize_created(paths: list[Any], top: str) -> set[str]:
    """Files returned by a save, as paths relative to ``top``."""
    out = set()
    for p in paths:
        p = str(p)
        if p.startswith("file://"):
            p = p[len("file://") :]
        out.add(os.path.relpath(p, top) if os.path.isabs(p) else os.path.normpath(p))
    return out


def stored_numel_per_key(ckpt_dir: str) -> dict[str, int]:
    """How many elements of each key the rank files hold in total (counting duplicates)."""
    from safetensors import safe_open

    from checkpointer.format.layout import CHECKSUMS_KEY

    totals: dict[str, int] = {}
    for name in sorted(os.listdir(ckpt_dir)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(ckpt_dir, name), framework="pt") as f:
            for key in f.keys():
                if key == CHECKSUMS_KEY:  # the file's own checksums, not a saved tensor
                    continue
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                totals[key] = totals.get(key, 0) + n
    return totals


def read_metadata_json(ckpt_dir: str) -> dict[str, Any]:
    with open(os.path.join(ckpt_dir, "metadata.json")) as f:
        return json.load(f)


@contextlib.contextmanager
def metadata_form(compact: bool) -> Iterator[None]:
    """Saves inside write format 2 (``compact``, the default) or format 1 (every piece listed)."""
    from checkpointer.engine import save as engine_save

    before, engine_save.COMPACT_METADATA = engine_save.COMPACT_METADATA, compact
    try:
        yield
    finally:
        engine_save.COMPACT_METADATA = before


def read_metadata_listed(ckpt_dir: str) -> dict[str, Any]:
    """``metadata.json`` with every tensor's pieces listed file by file (shard rules expanded)."""
    from checkpointer.format.metadata_parse import parse_metadata

    with open(os.path.join(ckpt_dir, "metadata.json"), "rb") as f:
        return json.loads(parse_metadata(f.read(), where=ckpt_dir).verbose().to_json_bytes())


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def catch(fn, *args, **kwargs) -> dict[str, Any] | None:
    """Run ``fn``; what it raised (class names of its MRO, message, seconds taken), or None."""
    import time
    import traceback

    t0 = time.monotonic()
    try:
        fn(*args, **kwargs)
    except Exception as e:  # the tests assert on the class and the message
        return {
            "type": type(e).__name__,
            "mro": [c.__name__ for c in type(e).__mro__],
            "msg": str(e),
            "seconds": time.monotonic() - t0,
            "traceback": traceback.format_exc(),
        }
    return None


def local_diff(expected_full: dict[str, torch.Tensor], actual: dict[str, Any]) -> list[str]:
    """Compare each rank's local pieces with the matching pieces of full tensors (no collective)."""
    problems = []
    for k in sorted(set(expected_full) | set(actual)):
        if k not in actual or k not in expected_full:
            problems.append(f"{k}: {'missing' if k not in actual else 'unexpected'}")
            continue
        a = actual[k]
        e = expected_full[k]
        if isinstance(a, DTensor):
            if tuple(a.shape) != tuple(e.shape):
                problems.append(f"{k}: global shape {tuple(a.shape)} vs {tuple(e.shape)}")
                continue
            e = local_piece(e, a.device_mesh, a.placements)
            a = a.to_local()
        if a.dtype != e.dtype or a.shape != e.shape:
            problems.append(f"{k}: {a.dtype}{tuple(a.shape)} vs expected {e.dtype}{tuple(e.shape)}")
        elif not torch.equal(a, e):
            problems.append(f"{k}: values differ\n  expected {e}\n  actual   {a}")
    return problems


def assert_local_same(expected_full: dict[str, torch.Tensor], actual: dict[str, Any], what: str = "state") -> None:
    problems = local_diff(expected_full, actual)
    if problems:
        raise AssertionError(f"{what} differs in {len(problems)} entries:\n" + "\n".join(problems))


_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "barrier",
    "broadcast", "broadcast_object_list", "gather", "irecv", "isend", "recv", "reduce", "scatter", "send",
)


@contextlib.contextmanager
def collectives_called() -> Iterator[list[str]]:
    """The names of the ``torch.distributed`` collectives this thread calls inside the block,
    in order (other threads' calls, such as an async save's writer's, are not counted)."""
    caller = threading.current_thread()
    calls: list[str] = []

    def counted(name):
        real = getattr(dist, name)

        def call(*args, **kwargs):
            if threading.current_thread() is caller:
                calls.append(name)
            return real(*args, **kwargs)

        return call

    with contextlib.ExitStack() as patches:
        for name in _COLLECTIVES:
            patches.enter_context(mock.patch.object(dist, name, counted(name)))
        yield calls
