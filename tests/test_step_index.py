"""A step's packed index: the native call's addresses and the torch paths' views read the same entries."""

from __future__ import annotations

import ctypes

import pytest
import torch

from workers.step_index import ROW_VECTORS, StepIndex


def test_sections_are_where_their_addresses_say_and_the_views_read_them() -> None:
    vectors = {"ids": [7, 8, 9], "positions": [4, 0, 1], "kv_index": [20, 32, 33], "req": [0, 1, 1], "nvis": [5, 1, 2]}
    rows, tables = [0, 2], [[5, 0], [8, 9]]
    index = StepIndex(*vectors.values(), rows, tables, 5)
    assert (index.T, index.M, index.num_reqs, index.width, index.max_nvis) == (3, 2, 2, 2, 5)

    def read(address: int, n: int) -> list[int]:
        return list((ctypes.c_int64 * n).from_address(address))

    for name in ROW_VECTORS:
        assert read(index.at(name), 3) == vectors[name]
    assert read(index.at("rows"), 2) == rows
    assert read(index.at("block_tables"), 4) == [5, 0, 8, 9]
    *views, rows_t, bt = index.tensors()
    assert [v.tolist() for v in views] == list(vectors.values())
    assert rows_t.tolist() == rows and bt.tolist() == tables
    assert all(v.dtype == torch.long and v.is_contiguous() for v in (*views, rows_t, bt))
    with pytest.raises(ValueError, match="section"):
        index.at("logits")


def test_a_step_without_rows_or_with_ragged_vectors_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        StepIndex([], [], [], [], [], [], [[0]], 0)
    with pytest.raises(ValueError, match="T entries"):
        StepIndex([1, 2], [0], [0], [0], [1], [], [[0]], 1)
    with pytest.raises(ValueError, match="same width"):
        StepIndex([1, 2], [0, 0], [0, 4], [0, 1], [1, 1], [], [[0], [1, 2]], 1)
