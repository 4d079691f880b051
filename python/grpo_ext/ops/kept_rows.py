"""The kept rows of grpo_loss_from_hidden: which token rows go through the LM head, as runs (segments) of the
flattened ``[N]`` problem, cut into chunks of rows, and the gather/scatter of a chunk's pieces.

Only the rows that the masks keep (``completion_mask * sample_mask != 0``) need logits; with right-padded sequences
they form one run per sequence. A chunk is a list of pieces (each a ``[start, end)`` run or part of one), so the
GEMMs run on the kept rows only and each piece's results go back to its own rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..validation.tensors import shapes_only

#: A run of token rows ``[start, end)`` of the flattened ``[N]`` problem.
Segment = tuple[int, int]


class RowPlan(NamedTuple):
    """Which rows go through the LM head: ``segments`` (ordered, disjoint) hold every kept row and ``rows`` rows in
    all; ``bridged`` when some of those rows are masked (their hidden states are zeroed before ``g.T @ hidden``)."""

    segments: list[Segment]
    rows: int
    bridged: bool


def plan_rows(kept: Tensor, gather: bool, max_segments: int) -> RowPlan:
    """The rows to score, from the ``[N]`` bool ``kept``: its runs of True (at most ``max_segments``), or every row.

    Reading ``kept`` on the host is the op's one device sync per call. A meta or fake ``kept`` (shapes only) scores
    every row.
    """
    rows = kept.numel()
    if not gather or shapes_only(kept):
        return RowPlan([(0, rows)] if rows else [], rows, True)
    flags = kept.to("cpu", torch.int8)
    edge = torch.zeros(1, dtype=torch.int8)
    steps = torch.diff(flags, prepend=edge, append=edge)
    starts = (steps == 1).nonzero().flatten()
    ends = (steps == -1).nonzero().flatten()
    bridged = starts.numel() > max_segments
    if bridged:  # split only at the max_segments - 1 widest gaps
        split = (starts[1:] - ends[:-1]).topk(max_segments - 1).indices.sort().values
        starts = torch.cat([starts[:1], starts[1:][split]])
        ends = torch.cat([ends[:-1][split], ends[-1:]])
    segments = list(zip(starts.tolist(), ends.tolist(), strict=True))
    return RowPlan(segments, sum(end - start for start, end in segments), bridged)


def chunk_segments(segments: list[Segment], chunk_size: int) -> list[list[Segment]]:
    """The segments cut into chunks of ``chunk_size`` rows (the last one may be shorter), each a list of pieces."""
    chunks: list[list[Segment]] = []
    pieces: list[Segment] = []
    room = chunk_size
    for start, end in segments:
        while start < end:
            take = min(room, end - start)
            pieces.append((start, start + take))
            start, room = start + take, room - take
            if room == 0:
                chunks.append(pieces)
                pieces, room = [], chunk_size
    if pieces:
        chunks.append(pieces)
    return chunks


def take_rows(rows: Tensor, pieces: list[Segment]) -> Tensor:
    """The pieces' rows of ``rows``, in order: a view for one piece, else a new tensor."""
    if len(pieces) == 1:
        start, end = pieces[0]
        return rows[start:end]
    return torch.cat([rows[start:end] for start, end in pieces])


def put_rows(out: Tensor, pieces: list[Segment], values: Tensor) -> None:
    """``out``'s pieces = consecutive rows of ``values`` (the inverse of :func:`take_rows`)."""
    offset = 0
    for start, end in pieces:
        out[start:end] = values[offset : offset + end - start]
        offset += end - start


def zero_outside(out: Tensor, segments: list[Segment]) -> None:
    """Zeroes the rows of ``out`` that no segment covers (rows never scored)."""
    previous = 0
    for start, end in [*segments, (out.shape[0], out.shape[0])]:
        if start > previous:
            out[previous:start] = 0
        previous = end
