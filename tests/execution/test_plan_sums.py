"""A plan report's byte sums and the destination dtypes, worked out once per run of an item's copies, equal the
copy-by-copy sums."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

import reshard
from reshard.core.dtypes import ITEMSIZE
from reshard.execution.executor import destination_dtypes
from reshard.fixtures import make_fixture


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    base = tmp_path_factory.mktemp("sums")
    make_fixture(base / "meg", format="megatron", to="tp=2,pp=2")
    return reshard.plan(base / "meg", format="hf", max_shard_size="300KB")


def _copy_bytes(report, c) -> int:
    return c.numel * ITEMSIZE[report.source.where[c.src].dtype]


def test_needed_bytes_of_every_file_and_of_each_are_the_copies_bytes(report):
    per: dict[str, int] = defaultdict(int)
    for c in report.plan.copies:
        per[report.dst_file(c.dst)] += _copy_bytes(report, c)
    assert len(per) > 2
    assert report.needed_bytes() == sum(per.values())
    names = sorted(per)
    assert [report.needed_bytes([n]) for n in names] == [per[n] for n in names]
    assert report.needed_bytes(names[::2]) == sum(per[n] for n in names[::2])
    assert report.needed_bytes([]) == 0


def test_files_rows_add_up_each_files_copies(report):
    rows = {r["destination"]: r for r in report.files()}
    for name, row in rows.items():
        mine = [c for c in report.plan.copies if report.dst_file(c.dst) == name]
        assert row["bytes"] == sum(_copy_bytes(report, c) for c in mine)
        assert row["copies"] == len(mine)
        assert row["sources"] == sorted({report.src_file(c.src) for c in mine})
        assert all(Path(s).name for s in row["sources"])


def test_destination_dtypes_are_those_of_each_items_sources(report):
    dtypes = destination_dtypes(report.plan, report.source.where)
    want = {c.dst: report.source.where[c.src].dtype for c in report.plan.copies}
    assert {it: dtypes[it] for it in want} == want
    assert set(dtypes) == set(report.plan.dst_items)
