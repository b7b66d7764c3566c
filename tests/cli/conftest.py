"""Fixtures of the command-line tests: checkpoints of world size 1 and 3, made once per session.

World size 3 runs on the session's pool of gloo processes (``run_distributed``, tests/conftest.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import cli_workers
import pytest
import torch


@dataclass(frozen=True)
class Checkpoints:
    ws1: str  # top-level dir of save_model_and_optim_state, one process, tied head
    ws1_full: dict[str, torch.Tensor]
    ws3: str  # the same model, FSDP2 over 3 ranks
    ws3_full: dict[str, torch.Tensor]
    flat3: str  # a Checkpointer dir of flat-sharded tensors, several ranges per rank
    flat3_full: dict[str, torch.Tensor]
    untied3: str  # FSDP2 over 3 ranks, untied head
    untied3_full: dict[str, torch.Tensor]
    dcp3: str  # torch DCP directory of the FSDP2 model (DTensor chunks from 3 ranks)


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory, run_distributed) -> Checkpoints:
    from checkpointer import save_model_and_optim_state

    root = tmp_path_factory.mktemp("ckpts")
    model, optim = cli_workers.build(0)
    save_model_and_optim_state(str(root / "ws1"), model, optim)
    full3 = run_distributed(cli_workers.save_ws3, 3, str(root / "ws3"), timeout=300)[0]
    return Checkpoints(
        ws1=str(root / "ws1"),
        ws1_full=cli_workers.full_state(model),
        ws3=str(root / "ws3" / "fsdp"),
        ws3_full=full3["fsdp"],
        flat3=str(root / "ws3" / "flat"),
        flat3_full=full3["flat"],
        untied3=str(root / "ws3" / "untied"),
        untied3_full=full3["untied"],
        dcp3=str(root / "ws3" / "dcp"),
    )

