"""A step's index vectors, packed in one int64 buffer made from Python ints.

Why one buffer and no tensor: a decode step's Python runs on caches its weights have just flushed, where each
torch op (a tensor made from a list, each view of it) costs several times what it costs warm. The fused native
forward reads the buffer through addresses; the other paths view it as tensors (:meth:`StepIndex.tensors`).
"""

from __future__ import annotations

from array import array

import torch

# The sections, in the order the buffer holds them: five [T] vectors, then the logits rows [M], then the block
# tables [num_requests, width].
ROW_VECTORS = ("ids", "positions", "kv_index", "req", "nvis")


class StepIndex:
    """``ids``, ``positions``, ``kv_index`` (where each row's key and value go), ``req`` (each row's request,
    a row of the block tables), ``nvis`` (the keys each row sees): [T] each; ``rows``: [M] the rows whose
    logits the step needs; ``block_tables``: per request its ``width`` block ids (every table as long).
    ``max_nvis``: the largest ``nvis``, which the caller knows without reading the vector."""

    __slots__ = ("buf", "T", "M", "num_reqs", "width", "max_nvis", "address")

    def __init__(
        self,
        ids: list[int],
        positions: list[int],
        kv_index: list[int],
        req: list[int],
        nvis: list[int],
        rows: list[int],
        block_tables: list[list[int]],
        max_nvis: int,
    ) -> None:
        T = len(ids)
        if T == 0 or not (len(positions) == len(kv_index) == len(req) == len(nvis) == T) or not block_tables:
            raise ValueError("a step has at least one row, every row vector has T entries, and one block table")
        width = len(block_tables[0])
        if any(len(t) != width for t in block_tables):
            raise ValueError("every block table must have the same width")
        self.buf = array("q", ids)
        for v in (positions, kv_index, req, nvis, rows):
            self.buf.extend(v)
        for t in block_tables:
            self.buf.extend(t)
        self.T, self.M, self.num_reqs, self.width, self.max_nvis = T, len(rows), len(block_tables), width, max_nvis
        self.address = self.buf.buffer_info()[0]  # the buffer's first entry; it never moves (never resized)

    def at(self, section: str) -> int:
        """The address of a section's first entry: one of ROW_VECTORS, ``rows`` or ``block_tables``."""
        if section in ROW_VECTORS:
            return self.address + 8 * self.T * ROW_VECTORS.index(section)
        if section == "rows":
            return self.address + 8 * 5 * self.T
        if section == "block_tables":
            return self.address + 8 * (5 * self.T + self.M)
        raise ValueError(f"no section {section!r}")

    def tensors(
        self, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids, positions, kv_index, req, nvis, rows, block_table)``: views of the buffer on the CPU (the
        block table [num_requests, width]), copies on another device."""
        flat = torch.frombuffer(self.buf, dtype=torch.long)
        if torch.device(device).type != "cpu":
            flat = flat.to(device)
        T, M = self.T, self.M
        ids, positions, kv_index, req, nvis = flat[: 5 * T].view(5, T)
        rows = flat[5 * T : 5 * T + M]
        return ids, positions, kv_index, req, nvis, rows, flat[5 * T + M :].view(self.num_reqs, self.width)
