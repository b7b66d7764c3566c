"""Strict and non-strict loads of a model and its optimizer, in one process (plain modules).

``strict=True`` refuses a key of either side the other lacks, naming the difference only;
``strict=False`` loads what both have (fine-tuning with a new head) and reports the rest; an
optimizer of another kind is refused in both modes, by the recorded class name or, for a
checkpoint without it, by the state keys. The same under FSDP2 is ``dist/test_dist_strict.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import checkpointer
from checkpointer import CheckpointMismatchError, Checkpointer, LoadResult
from checkpointer.api import flatten_optim_state, model_state_dict


class Net(nn.Module):
    """A body of ``depth`` linear layers and a head, named ``head_name``, of ``classes`` outputs."""

    def __init__(self, depth: int = 3, head_name: str = "head", classes: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(*[nn.Linear(6, 6) for _ in range(depth)])
        self.head_name = head_name
        setattr(self, head_name, nn.Linear(6, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.head_name)(torch.tanh(self.body(x)))


def step(model: nn.Module, optim: torch.optim.Optimizer, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 6, generator=g)).square().mean().backward()
    optim.step()
    optim.zero_grad()


def saved(tmp_path, optim_cls=torch.optim.AdamW, **optim_kw) -> tuple[str, Net, torch.optim.Optimizer]:
    ckpt = str(tmp_path / "ckpt")
    model = Net()
    optim = optim_cls(model.parameters(), **(optim_kw or {"lr": 1e-2}))
    step(model, optim)
    step(model, optim, 1)
    checkpointer.save_model_and_optim_state(ckpt, model, optim)
    return ckpt, model, optim


def clone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def optim_by_name(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v.clone() for k, v in st.items()} for p, st in optim.state.items()}


def test_strict_refuses_a_model_key_either_side_lacks_naming_only_the_difference(tmp_path):
    ckpt, model, _ = saved(tmp_path)
    # The model has a key the checkpoint lacks, and lacks two the checkpoint has.
    renamed = Net(head_name="classifier", seed=1)
    with pytest.raises(CheckpointMismatchError) as ex:
        checkpointer.load_model_and_optim_state(ckpt, renamed)
    msg = str(ex.value)
    assert "2 model keys the checkpoint lacks: ['classifier.weight', 'classifier.bias']" in msg, msg
    assert "2 checkpoint model keys the model lacks: ['head.bias', 'head.weight']" in msg, msg
    assert "body.0.weight" not in msg and "strict=False" in msg, msg
    # Only an extra checkpoint key (the model is smaller): no longer ignored.
    shallow = Net(depth=2, seed=1)
    before = clone_state(shallow)
    with pytest.raises(CheckpointMismatchError, match=r"2 checkpoint model keys the model lacks: \['body.2.bias', 'body.2.weight'\]\.") as ex:
        checkpointer.load_model_and_optim_state(ckpt, shallow)
    assert "the checkpoint lacks" not in str(ex.value)
    # Nothing was written by the refused load.
    assert all(torch.equal(v, before[k]) for k, v in shallow.state_dict().items())
    # Only a missing key (the model is deeper).
    with pytest.raises(CheckpointMismatchError, match=r": 2 model keys the checkpoint lacks: \['body.3.weight', 'body.3.bias'\]\.") as ex:
        checkpointer.load_model_and_optim_state(ckpt, Net(depth=4))
    assert "model lacks" not in str(ex.value)


def test_strict_message_is_short_for_a_model_with_many_keys(tmp_path):
    ckpt, _, _ = saved(tmp_path)
    deep = Net(depth=300, head_name="classifier")  # 602 keys, 596 of them missing from the checkpoint
    full_list = str([k for k in deep.state_dict()])
    with pytest.raises(CheckpointMismatchError) as ex:
        checkpointer.load_model_and_optim_state(ckpt, deep)
    msg = str(ex.value)
    assert len(full_list) > 8000 and len(msg) < 800, (len(full_list), msg)
    assert "596 model keys the checkpoint lacks: ['body.3.weight', " in msg and "... and 586 more]" in msg, msg
    assert "'body.7.bias'" in msg and "'body.8.weight'" not in msg, msg


def test_strict_refuses_an_optimizer_over_other_parameters(tmp_path):
    ckpt, model, optim = saved(tmp_path)
    fresh = Net(seed=1)
    body_only = torch.optim.AdamW(fresh.body.parameters(), lr=0.5)
    with pytest.raises(CheckpointMismatchError) as ex:
        checkpointer.load_model_and_optim_state(ckpt, fresh, body_only)
    msg = str(ex.value)
    assert "optimizer's param group 0 does not match the checkpoint" in msg, msg
    assert "2 checkpoint parameters the optimizer's param group 0 lacks: ['head.weight', 'head.bias']" in msg, msg
    assert "body.0.weight" not in msg and "the checkpoint lacks" not in msg, msg
    # Non-strict: the body's state loads, the saved head's is reported and not read.
    fresh = Net(seed=1)
    body_only = torch.optim.AdamW(fresh.body.parameters(), lr=0.5)
    result = checkpointer.load_model_and_optim_state(ckpt, fresh, body_only, strict=False)
    assert result == LoadResult(missing_keys=[], unexpected_keys=["optim:head.weight", "optim:head.bias"])
    assert body_only.param_groups[0]["lr"] == 1e-2
    saved_state = optim_by_name(model, optim)
    got = optim_by_name(fresh, body_only)
    assert sorted(got) == [f"body.{i}.{w}" for i in range(3) for w in ("bias", "weight")]
    for name, st in got.items():
        assert all(torch.equal(v, saved_state[name][k]) for k, v in st.items()), name


def test_fine_tuning_with_a_new_head(tmp_path):
    ckpt, model, optim = saved(tmp_path)
    saved_model = clone_state(model)
    saved_optim = optim_by_name(model, optim)
    tuned = Net(head_name="classifier", classes=5, seed=7)
    new_head = {k: v.clone() for k, v in tuned.classifier.state_dict().items()}
    tuned_optim = torch.optim.AdamW(tuned.parameters(), lr=0.5, weight_decay=0.3)
    result = checkpointer.load_model_and_optim_state(ckpt, tuned, tuned_optim, strict=False)
    assert result.missing_keys == ["classifier.weight", "classifier.bias", "optim:classifier.weight", "optim:classifier.bias"]
    assert result.unexpected_keys == ["head.bias", "head.weight", "optim:head.weight", "optim:head.bias"]
    # The body is the saved one, bit for bit; the new head is untouched.
    for k, v in tuned.body.state_dict().items():
        assert torch.equal(v, saved_model[f"body.{k}"]), k
    for k, v in tuned.classifier.state_dict().items():
        assert torch.equal(v, new_head[k]), k
    # The body's optimizer state is the saved one; the head has none; the hyperparameters are saved ones.
    got = optim_by_name(tuned, tuned_optim)
    assert sorted(got) == sorted(k for k in saved_optim if k.startswith("body."))
    for name, st in got.items():
        assert st.keys() == saved_optim[name].keys() and all(torch.equal(v, saved_optim[name][k]) for k, v in st.items())
    assert tuned_optim.param_groups[0]["lr"] == 1e-2 and tuned_optim.param_groups[0]["weight_decay"] == 1e-2
    # Training goes on: the head gets fresh state, the body's goes on from the saved step.
    step(tuned, tuned_optim, 2)
    after = optim_by_name(tuned, tuned_optim)
    assert float(after["classifier.weight"]["step"]) == 1.0 and float(after["body.0.weight"]["step"]) == 3.0
    assert not torch.equal(tuned.classifier.weight, new_head["weight"])


def test_fine_tuning_with_the_new_head_in_a_param_group_of_its_own(tmp_path):
    """The usual set-up: the new head trains at its own rate, in a second param group. Without
    ``strict`` the body's group takes the saved group's hyperparameters and state, the head's
    group keeps its own; with it, the groups' count differing is refused."""
    ckpt, model, optim = saved(tmp_path)
    saved_optim = optim_by_name(model, optim)
    tuned = Net(head_name="classifier", classes=5, seed=7)
    same = Net(seed=2)
    with pytest.raises(CheckpointMismatchError, match="1 optimizer param groups, the optimizer has 2"):
        checkpointer.load_model_and_optim_state(
            ckpt, same, torch.optim.AdamW([{"params": same.body.parameters()}, {"params": same.head.parameters()}]))
    tuned_optim = torch.optim.AdamW([{"params": tuned.body.parameters(), "lr": 0.5},
                                     {"params": tuned.classifier.parameters(), "lr": 0.25, "weight_decay": 0.0}])
    result = checkpointer.load_model_and_optim_state(ckpt, tuned, tuned_optim, strict=False)
    assert result.missing_keys == ["classifier.weight", "classifier.bias", "optim:classifier.weight", "optim:classifier.bias"]
    body, head = tuned_optim.param_groups
    assert (body["lr"], body["weight_decay"]) == (1e-2, 1e-2)  # the saved group's
    assert (head["lr"], head["weight_decay"]) == (0.25, 0.0)  # its own
    got = optim_by_name(tuned, tuned_optim)
    assert sorted(got) == sorted(k for k in saved_optim if k.startswith("body."))
    for name, st in got.items():
        assert all(torch.equal(v, saved_optim[name][k]) for k, v in st.items()), name
    step(tuned, tuned_optim, 2)
    after = optim_by_name(tuned, tuned_optim)
    assert float(after["classifier.weight"]["step"]) == 1.0 and float(after["body.0.weight"]["step"]) == 3.0


def test_param_groups_regrouped_take_the_hyperparameters_of_the_group_that_held_them(tmp_path):
    """Saved with two groups, loaded into an optimizer whose groups list them the other way
    round: each group's hyperparameters follow its parameters, not its index."""
    ckpt = str(tmp_path / "ckpt")
    model = Net()
    optim = torch.optim.AdamW([{"params": model.body.parameters(), "lr": 0.1}, {"params": model.head.parameters(), "lr": 0.2}])
    step(model, optim)
    checkpointer.save_model_and_optim_state(ckpt, model, optim)
    fresh = Net(seed=3)
    swapped = torch.optim.AdamW([{"params": fresh.head.parameters(), "lr": 9.0}, {"params": fresh.body.parameters(), "lr": 9.0}])
    assert checkpointer.load_model_and_optim_state(ckpt, fresh, swapped, strict=False) == LoadResult()
    assert [g["lr"] for g in swapped.param_groups] == [0.2, 0.1]
    saved_state, got = optim_by_name(model, optim), optim_by_name(fresh, swapped)
    assert sorted(got) == sorted(saved_state)
    for name, st in got.items():
        assert all(torch.equal(v, saved_state[name][k]) for k, v in st.items()), name


def test_a_parameter_the_checkpoint_lacks_keeps_the_state_it_has(tmp_path):
    """Non-strict, into an optimizer that has stepped: the new head's own state stays as it was."""
    ckpt, model, optim = saved(tmp_path)
    saved_optim = optim_by_name(model, optim)
    tuned = Net(head_name="classifier", classes=5, seed=7)
    tuned_optim = torch.optim.AdamW(tuned.parameters(), lr=1e-2)
    step(tuned, tuned_optim, 5)
    before = optim_by_name(tuned, tuned_optim)
    checkpointer.load_model_and_optim_state(ckpt, tuned, tuned_optim, strict=False)
    got = optim_by_name(tuned, tuned_optim)
    assert sorted(got) == sorted(before)
    for name, st in got.items():
        want = before[name] if name.startswith("classifier.") else saved_optim[name]
        assert st.keys() == want.keys() and all(torch.equal(v, want[k]) for k, v in st.items()), name


def test_a_shape_mismatch_is_an_error_in_both_modes(tmp_path):
    ckpt, _, _ = saved(tmp_path)
    for strict in (True, False):
        wider = Net(classes=5)
        with pytest.raises(CheckpointMismatchError, match=r"shape mismatch for 'head.weight'.*\[3, 6\].*\[5, 6\]"):
            checkpointer.load_model_and_optim_state(ckpt, wider, torch.optim.AdamW(wider.parameters()), strict=strict)
        double = Net().double()
        with pytest.raises(CheckpointMismatchError, match="dtype mismatch for 'body.0.weight'"):
            checkpointer.load_model_and_optim_state(ckpt, double, strict=strict)


@pytest.mark.parametrize("saved_kind, given_kind", [("AdamW", "SGD"), ("SGD", "AdamW"), ("AdamW", "Adam")])
def test_an_optimizer_of_another_kind_is_refused_by_name(tmp_path, saved_kind, given_kind):
    kw = {"lr": 0.1, "momentum": 0.9} if saved_kind == "SGD" else {"lr": 1e-2}
    ckpt, _, _ = saved(tmp_path, getattr(torch.optim, saved_kind), **kw)
    fresh = Net(seed=1)
    given = getattr(torch.optim, given_kind)(fresh.parameters(), lr=0.5)
    for strict in (True, False):
        with pytest.raises(CheckpointMismatchError) as ex:
            checkpointer.load_model_and_optim_state(ckpt, fresh, given, strict=strict)
        assert f"the state of a {saved_kind} optimizer" in str(ex.value) and f"kind, {given_kind}:" in str(ex.value)
    assert not given.state


def _save_without_class_record(dir: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """A checkpoint as OLMo-core or an older save writes it: no ``optim_class``."""
    state = model_state_dict(model)
    flat = flatten_optim_state(model, optim, state)
    assert flat.pop("optim_class") is not None
    Checkpointer().save(f"{dir}/model", state)
    Checkpointer().save(f"{dir}/optim", flat)


class NeedsTag(torch.optim.SGD):
    """An optimizer whose class cannot be built from its defaults alone (no probe possible)."""

    def __init__(self, params, tag: str, **kw) -> None:
        super().__init__(params, **kw)
        self.tag = tag


def test_without_a_class_record_the_kind_is_judged_by_state_keys(tmp_path):
    model = Net()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, adamw)
    adamw_ckpt = str(tmp_path / "adamw")
    _save_without_class_record(adamw_ckpt, model, adamw)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step(model, sgd)
    sgd_ckpt = str(tmp_path / "sgd")
    _save_without_class_record(sgd_ckpt, model, sgd)

    def load(ckpt, optim_of):
        fresh = Net(seed=1)
        optim = optim_of(fresh)
        return checkpointer.load_model_and_optim_state(ckpt, fresh, optim), fresh, optim

    refusals = [
        (adamw_ckpt, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), "['momentum_buffer']"),
        (adamw_ckpt, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "[]"),
        (sgd_ckpt, lambda m: torch.optim.AdamW(m.parameters()), "['exp_avg', 'exp_avg_sq', 'step']"),
    ]
    for ckpt, optim_of, holds in refusals:
        with pytest.raises(CheckpointMismatchError) as ex:
            load(ckpt, optim_of)
        msg = str(ex.value)
        saved_keys = "['exp_avg', 'exp_avg_sq', 'step']" if ckpt == adamw_ckpt else "['momentum_buffer']"
        assert f"holds optimizer state {saved_keys}" in msg and f"optimizer holds {holds}" in msg, msg
        assert "records no class name" in msg, msg
    # The same kind loads, state and all.
    _, fresh, optim = load(adamw_ckpt, lambda m: torch.optim.AdamW(m.parameters(), lr=0.5))
    want = optim_by_name(model, adamw)
    assert {n: {k: v for k, v in st.items()} for n, st in optim_by_name(fresh, optim).items()}.keys() == want.keys()
    for name, st in optim_by_name(fresh, optim).items():
        assert all(torch.equal(v, want[name][k]) for k, v in st.items()), name
    # No probe of the class: its own state is the measure.
    stepped = Net(seed=1)
    tagged = NeedsTag(stepped.parameters(), "t", lr=0.1, momentum=0.9)
    step(stepped, tagged)
    with pytest.raises(CheckpointMismatchError, match=r"holds optimizer state \['exp_avg', 'exp_avg_sq', 'step'\]; the given NeedsTag optimizer holds \['momentum_buffer'\]"):
        checkpointer.load_model_and_optim_state(adamw_ckpt, stepped, tagged)


def test_without_a_class_record_regrouped_groups_are_judged_by_the_groups_that_held_them(tmp_path):
    """Saved by SGD in two groups, only the head's with momentum (the only state); loaded into one
    group with momentum: the kind is judged with the hyperparameters that group takes (its own:
    its parameters came from both saved groups), not those of saved group 0 (no momentum, so no
    state, read as another kind of optimizer)."""
    ckpt = str(tmp_path / "ckpt")
    model = Net()
    optim = torch.optim.SGD([{"params": model.body.parameters(), "momentum": 0.0},
                             {"params": model.head.parameters(), "momentum": 0.9}], lr=0.1)
    step(model, optim)
    _save_without_class_record(ckpt, model, optim)
    fresh = Net(seed=2)
    one_group = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.5)
    assert checkpointer.load_model_and_optim_state(ckpt, fresh, one_group, strict=False) == LoadResult()
    saved_state, got = optim_by_name(model, optim), optim_by_name(fresh, one_group)
    assert sorted(saved_state) == sorted(got) == ["head.bias", "head.weight"]
    for name, st in got.items():
        assert all(torch.equal(v, saved_state[name][k]) for k, v in st.items()), name
    assert one_group.param_groups[0]["momentum"] == 0.5


def test_without_a_class_record_new_and_merged_groups_are_not_read_as_another_kind(tmp_path):
    """Judged by the saved groups over the parameters they held: a new head in a group of its
    own with other hyperparameters (Adam's amsgrad, which would add a state key) and a merged
    group with momentum off (which would hold none) both load."""
    model = Net()
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    step(model, adam)
    adam_ckpt = str(tmp_path / "adam")
    _save_without_class_record(adam_ckpt, model, adam)
    fresh = Net(head_name="new_head", seed=1)
    tuned = torch.optim.Adam([{"params": fresh.body.parameters()},
                              {"params": fresh.new_head.parameters(), "amsgrad": True}], lr=1e-2)
    result = checkpointer.load_model_and_optim_state(adam_ckpt, fresh, tuned, strict=False)
    assert sorted(result.missing_keys) == ["new_head.bias", "new_head.weight", "optim:new_head.bias", "optim:new_head.weight"]
    step(fresh, tuned)

    sgd_model = Net()
    sgd = torch.optim.SGD([{"params": sgd_model.body.parameters()}, {"params": sgd_model.head.parameters()}],
                          lr=0.1, momentum=0.9)
    step(sgd_model, sgd)
    sgd_ckpt = str(tmp_path / "sgd")
    _save_without_class_record(sgd_ckpt, sgd_model, sgd)
    merged_model = Net(seed=2)
    merged = torch.optim.SGD(merged_model.parameters(), lr=0.1, momentum=0.0)
    assert checkpointer.load_model_and_optim_state(sgd_ckpt, merged_model, merged, strict=False) == LoadResult()
    assert optim_by_name(merged_model, merged).keys() == optim_by_name(sgd_model, sgd).keys()


def test_tied_parameters_and_aliases_are_neither_missing_nor_unexpected(tmp_path):
    class Tied(nn.Module):
        def __init__(self, lm_head: bool = True) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            if lm_head:
                self.lm_head = nn.Linear(4, 10, bias=False)
                self.lm_head.weight = self.embed.weight

    tied = Tied()
    ckpt = str(tmp_path / "tied")
    checkpointer.save_model_and_optim_state(ckpt, tied, torch.optim.SGD(tied.parameters(), lr=0.1))
    assert checkpointer.load_model_and_optim_state(ckpt, Tied()) == LoadResult()
    # The checkpoint's alias lm_head.weight is the embedding the model loads: not unexpected.
    no_head = Tied(lm_head=False)
    assert checkpointer.load_model_and_optim_state(ckpt, no_head) == LoadResult()
    assert torch.equal(no_head.embed.weight, tied.embed.weight)
    # A checkpoint without lm_head.weight: the tied model's lm_head.weight is not missing.
    headless = str(tmp_path / "headless")
    checkpointer.save_model_and_optim_state(headless, no_head, torch.optim.SGD(no_head.parameters(), lr=0.1))
    again = Tied()
    assert checkpointer.load_model_and_optim_state(headless, again) == LoadResult()
    assert torch.equal(again.lm_head.weight, tied.embed.weight)


def test_unshard_optim_state_has_param_names(tmp_path):
    ckpt, model, optim = saved(tmp_path)
    got = checkpointer.unshard_optim_state(ckpt, no_dist=True)
    names = [n for n, _ in model.named_parameters()]
    assert [g["param_names"] for g in got["param_groups"]] == [names]
    assert got["param_groups"][0]["params"] == list(range(len(names)))
    assert "_param_names" not in got["param_groups"][0]
    # A named optimizer's state dict has the same form.
    named = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    assert named.state_dict()["param_groups"][0]["param_names"] == names
    # Loading it names an unnamed optimizer, and a save of that optimizer stores its names once.
    fresh = Net(seed=1)
    plain = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    plain.load_state_dict(got)
    assert plain.param_groups[0]["param_names"] == names
    again = str(tmp_path / "again")
    checkpointer.save_model_and_optim_state(again, fresh, plain)
    group = checkpointer.unshard_optim_state(again, no_dist=True)["param_groups"][0]
    assert group["param_names"] == names and "_param_names" not in group


def test_unshard_optim_state_numbers_the_params_of_every_group_apart(tmp_path):
    """With two param groups the second group's ids follow the first's: the state of each
    parameter comes back under its own id, and loads into a fresh optimizer as saved."""
    model = Net()
    optim = torch.optim.AdamW([{"params": model.body.parameters(), "lr": 0.1}, {"params": model.head.parameters(), "lr": 0.2}])
    step(model, optim)
    ckpt = str(tmp_path / "ckpt")
    checkpointer.save_model_and_optim_state(ckpt, model, optim)
    got = checkpointer.unshard_optim_state(ckpt, no_dist=True)
    assert [g["params"] for g in got["param_groups"]] == [list(range(6)), [6, 7]]
    names = [n for g in got["param_groups"] for n in g["param_names"]]
    assert names == [n for n, _ in model.named_parameters()]
    saved_state = optim_by_name(model, optim)
    assert sorted(got["state"]) == list(range(8))
    for pid, st in got["state"].items():
        assert st.keys() == saved_state[names[pid]].keys()
        assert all(torch.equal(v, saved_state[names[pid]][k]) for k, v in st.items()), names[pid]


def test_a_compiled_model_saves_and_loads_under_the_plain_models_names(tmp_path):
    """``torch.compile`` wraps the model (``_orig_mod.`` before every name): the checkpoint has the
    plain names, so the plain model and the compiled one load each other's saves, optimizer too."""
    model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, optim)
    compiled = torch.compile(model)
    ckpt = str(tmp_path / "ckpt")
    checkpointer.save_model_and_optim_state(ckpt, compiled, optim)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(checkpointer.unshard_model_state(ckpt, no_dist=True)) == sorted(names)
    assert [g["param_names"] for g in checkpointer.unshard_optim_state(ckpt, no_dist=True)["param_groups"]] == [names]
    plain = Net(seed=1)
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=0.5)
    assert checkpointer.load_model_and_optim_state(ckpt, plain, plain_optim) == LoadResult()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in plain.state_dict().items())
    saved_optim, got = optim_by_name(model, optim), optim_by_name(plain, plain_optim)
    assert sorted(got) == sorted(saved_optim)
    for name, st in got.items():
        assert all(torch.equal(v, saved_optim[name][k]) for k, v in st.items()), name
    again = torch.compile(Net(seed=2))
    assert checkpointer.load_model_and_optim_state(ckpt, again) == LoadResult()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in again._orig_mod.state_dict().items())


def test_wrapper_names_are_dropped_only_as_whole_parts_of_a_name(tmp_path):
    """``x_orig_mod.w`` is a module of the user's, not a wrapper: it kept its name only by
    luck before (found by a review: it saved as ``xw``, where a real ``xw`` would collide)."""
    model = nn.Module()
    model.x_orig_mod = nn.Linear(2, 2)
    model.xw = nn.Linear(2, 2, bias=False)
    model._orig_mod_head = nn.Linear(2, 1)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(i)
    ckpt = str(tmp_path / "ckpt")
    checkpointer.save_model_and_optim_state(ckpt, model, torch.optim.SGD(model.parameters(), lr=0.1))
    saved = checkpointer.unshard_model_state(ckpt, no_dist=True)
    assert sorted(saved) == sorted(model.state_dict())
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
