"""Placement: dense variables balanced by size, embedding tables split by rows over the servers."""

from __future__ import annotations

import itertools

import pytest
import torch

from spread.ps.placement import VariableInfo, place


def test_dense_variables_are_balanced_by_size():
    variables = [VariableInfo(f"v{i}", (n,), torch.float32) for i, n in enumerate([100, 60, 50, 40, 10])]
    placement = place(variables, 2)
    load = placement.bytes_per_server(variables)
    assert sorted(load) == [4 * 120, 4 * 140]
    assert all(len(s) == 1 for s in placement.shards.values())


def test_large_table_is_split_by_rows_and_small_one_is_not():
    table = VariableInfo("emb", (100_000, 64), torch.float32, sparse=True)
    small = VariableInfo("tiny", (10, 4), torch.float32, sparse=True)
    placement = place([table, small, VariableInfo("w", (64, 8), torch.float32)], 3)
    parts = placement.shards["emb"]
    assert [p.server for p in parts] == [0, 1, 2]
    assert parts[0].row_start == 0 and parts[-1].row_stop == 100_000
    assert all(a.row_stop == b.row_start for a, b in itertools.pairwise(parts))
    assert len(placement.shards["tiny"]) == 1
    assert placement.row_boundaries("emb").tolist() == [parts[1].row_start, parts[2].row_start]


def test_placement_is_deterministic_and_validated():
    variables = [VariableInfo("a", (5, 5), torch.float32), VariableInfo("b", (5, 5), torch.float32)]
    assert place(variables, 2) == place(list(variables), 2)
    with pytest.raises(ValueError, match="num_servers"):
        place(variables, 0)
