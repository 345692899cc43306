"""--model FILE.py:FUNC: loading your workload, and every wrong input as one clear error."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from turbotrain.base.errors import TurbotrainError
from turbotrain.parts.workload import Workload, as_workload, copy_workload, load_workload, rebuild_loader

GOOD = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from turbotrain import Workload

def make():
    model = nn.Linear(4, 2)
    data = TensorDataset(torch.randn(32, 4), torch.randint(2, (32,)))
    return Workload(model=model, train_loader=DataLoader(data, batch_size=8))

def as_dict():
    return {"model": nn.Linear(4, 2), "train_loader": [torch.randn(8, 4)]}

def wrong():
    return nn.Linear(4, 2)

def wrong_key():
    return {"model": nn.Linear(4, 2), "train_loader": [], "lr": 0.1}

def broken():
    return 1 / 0

def not_a_model():
    return {"model": "resnet", "train_loader": []}

value = 3
"""


@pytest.fixture
def wl_file(tmp_path):
    path = tmp_path / "my_workload.py"
    path.write_text(textwrap.dedent(GOOD))
    return path


def test_a_workload_and_a_dict_both_load(wl_file):
    w = load_workload(f"{wl_file}:make")
    assert isinstance(w.model, nn.Linear) and isinstance(w.train_loader, DataLoader)
    assert w.source == f"{wl_file}:make" and "Linear" in w.describe() and "batch_size=8" in w.describe()
    d = load_workload(f"{wl_file}:as_dict")
    assert isinstance(d, Workload) and d.optimizer is None and d.loss_fn is None


def test_the_same_seed_gives_the_same_weights(wl_file):
    a, b = load_workload(f"{wl_file}:make", seed=3), load_workload(f"{wl_file}:make", seed=3)
    assert torch.equal(a.model.weight, b.model.weight)


@pytest.mark.parametrize(
    "func, message",
    [
        ("wrong", "returned a torch.nn.modules.linear.Linear; return turbotrain.Workload"),
        ("wrong_key", "unknown key 'lr'; valid keys: model, train_loader, optimizer, loss_fn, eval_loader"),
        ("broken", "calling broken() raised ZeroDivisionError at my_workload.py:22"),
        ("not_a_model", "model is a str, not a torch.nn.Module"),
        ("nope", "has no function 'nope'; it defines: as_dict, broken, make, not_a_model, wrong, wrong_key"),
        ("value", "value is a int, not a function"),
    ],
)
def test_every_mistake_in_the_function_is_one_line(wl_file, func, message):
    with pytest.raises(TurbotrainError) as exc:
        load_workload(f"{wl_file}:{func}")
    assert message in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "ref, message",
    [
        ("missing.py:make", "there is no file missing.py"),
        ("no_such_package.mod:make", "no module named 'no_such_package'"),
        ("file_without_func.py", "give FILE.py:FUNC or package.module:FUNC"),
    ],
)
def test_a_wrong_reference_is_one_line(ref, message):
    with pytest.raises(TurbotrainError, match=message):
        load_workload(ref)


def test_a_checked_workload_rejects_what_cannot_train():
    with pytest.raises(TurbotrainError, match="train_loader is a int"):
        as_workload({"model": nn.Linear(2, 2), "train_loader": 5})
    with pytest.raises(TurbotrainError, match="optimizer is a str"):
        as_workload({"model": nn.Linear(2, 2), "train_loader": [], "optimizer": "adam"})


def test_a_rebuilt_loader_keeps_the_data_and_changes_only_what_is_asked():
    data = TensorDataset(torch.arange(40.0).view(20, 2), torch.arange(20))
    loader = DataLoader(data, batch_size=4, shuffle=False, drop_last=True)
    more = rebuild_loader(loader, num_workers=2)
    assert more.num_workers == 2 and more.batch_size == 4 and more.persistent_workers
    assert [y.tolist() for _, y in more] == [y.tolist() for _, y in loader]
    bigger = rebuild_loader(loader, batch_size=10)
    assert [len(y) for _, y in bigger] == [10, 10]
    with pytest.raises(TurbotrainError, match="only a torch DataLoader"):
        rebuild_loader([1, 2, 3], num_workers=2)


def test_a_copy_has_its_own_model_and_an_optimizer_over_it():
    model = nn.Linear(2, 2)
    w = Workload(model, [], torch.optim.SGD(model.parameters(), lr=0.1))
    c = copy_workload(w)
    assert c.model is not model and c.optimizer is not w.optimizer
    copied = {id(p) for p in c.model.parameters()}
    assert {id(p) for g in c.optimizer.param_groups for p in g["params"]} == copied
