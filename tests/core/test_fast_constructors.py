"""The positional constructors the resolver and the planner make their objects with build what the dataclasses'
own constructors build: equal, hashing alike, frozen, and pickled alike."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from reshard.core.geometry import Box
from reshard.core.layout import Fragment, Item, ItemInfo, LogicalTensor, new_fragment, new_item, new_item_info, new_logical
from reshard.core.planner import Copy, _new_copy

ITEM = ("optim", (("pp", 1), ("dp", 3)), 0, "exp_avg", "optimizer.distributed.bucket_0.exp_avg")


def test_new_item_equals_and_hashes_as_the_item_of_its_fields():
    made, want = new_item(*ITEM), Item(*ITEM)
    assert made == want and hash(made) == hash(want) and {want: 1}[made] == 1
    assert pickle.loads(pickle.dumps(made)) == want
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.key = "other"  # type: ignore[misc]


def test_new_fragment_equals_the_fragment_of_its_fields():
    box = Box((0, 4), (2, 8))
    fields = {"tensor": "w", "state": "master", "box": box, "item": Item(*ITEM), "offset": 16, "strides": (8, 1)}
    made, want = new_fragment(*fields.values()), Fragment(**fields)
    assert made == want and repr(made) == repr(want)
    assert new_fragment(*fields.values(), True) == Fragment(**fields, fill=True)
    assert pickle.loads(pickle.dumps(made)) == want
    assert dataclasses.replace(made, offset=0) == Fragment(**{**fields, "offset": 0})
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.offset = 0  # type: ignore[misc]


def test_new_copy_equals_the_copy_of_its_fields():
    item = Item(*ITEM)
    fields = {"src": item, "src_offset": 3, "src_strides": (1,), "dst": item, "dst_offset": 5, "dst_strides": (1,),
              "lengths": (4,), "tensor": "w", "state": "param", "box": Box((2,), (4,))}
    made = _new_copy(*fields.values())
    assert made == Copy(**fields) and made.numel == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.dst_offset = 0  # type: ignore[misc]


def test_an_items_label_is_made_once_and_follows_its_fields():
    made, want = new_item(*ITEM), Item(*ITEM)
    assert str(made) == str(want) == "optim[pp=1,dp=3] exp_avg:optimizer.distributed.bucket_0.exp_avg"
    assert str(made) is str(made)  # cached, not made again
    assert made == want and repr(made) == repr(want)  # the cached label takes no part in equality or repr
    other = dataclasses.replace(made, chunk=2, key="w")
    assert str(other) == "optim[pp=1,dp=3,chunk=2] exp_avg:w"
    assert str(pickle.loads(pickle.dumps(made))) == str(want)


def test_new_item_info_and_new_logical_equal_the_dataclasses_of_their_fields():
    made = new_item_info((3, 4), 12, "w")
    assert made == ItemInfo(shape=(3, 4), mapped=12, rule="w") and made.numel == 12
    assert pickle.loads(pickle.dumps(made)) == made
    t = new_logical("w", (3, 4), ("d0", "d1"))
    assert t == LogicalTensor(name="w", shape=(3, 4), axes=("d0", "d1"), view=(3, 4), dim_axes=(1, 1))
    assert new_logical("s", (), ()) == LogicalTensor(name="s", shape=(), axes=(), view=())  # a scalar
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.shape = (12,)  # type: ignore[misc]
