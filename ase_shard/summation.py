"""Compensated sums, so that energies do not depend on the order of their terms.

A plain float64 sum of ``n`` terms carries a rounding error that grows with
``n`` and with the size of the terms; the order of the terms changes with the
cell, the neighbour list, a rebuild or the number of ranks, and so would the
energy in its last digits (~1e-13 eV on a 200 eV system), which finite
differences of the energy magnify. Neumaier's compensated summation keeps each
addition's rounding error in a second accumulator: the result is as accurate
as if the sum were formed in twice the precision, whatever the order.

EMT's kernel adds its densities into per-node accumulators with
:func:`add_compensated` (a density feeds an exponential and a logarithm, which
magnify its rounding); the pair potentials' per-node energies are plain sums of
small terms (see :func:`ase_shard.kernels._add_pair_energy_force`). The
calculator sums a rank's result columns with :func:`compensated_row_sums` and
the ranks' partial sums with :func:`exact_total` (``math.fsum``, correctly
rounded, so the total is the same bits for every order of ranks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numba
import numpy as np


@numba.njit(cache=True, inline="always")
def compensated_step(total, error, value):  # pragma: no cover - compiled
    """Neumaier's step: ``(total + value, error + its rounding error)``.

    The rounding error of ``total + value`` is exact in float64; Knuth's
    TwoSum recovers it without asking which of the two is larger (Neumaier's
    test is a branch the processor mispredicts on sums of mixed signs: a
    32,000-atom Lennard-Jones pass took 11.5 ms with it, 10.8 ms without,
    the same bits).
    """
    t = total + value
    rounded_value = t - total
    return t, error + ((total - (t - rounded_value)) + (value - rounded_value))


@numba.njit(cache=True, inline="always")
def same_sign_step(total, error, value):  # pragma: no cover - compiled
    """Dekker's Fast2Sum step, for sums whose terms all have one sign.

    The rounding error of ``total + value`` is ``value - (t - total)``,
    exactly whenever ``|total| >= |value|`` (Neumaier's test, with its
    branch and three more operations, is left out). With terms of one sign
    the running total only grows, so this fails only while the total is still
    smaller than a new term, among the first few; the EMT kernel's densities
    and pair sums are such sums, and this step keeps their compensation at
    about half of Neumaier's cost (32,000 Cu atoms, 1 thread: 44.5 against
    47.6 ms a pass, plain sums 42).
    """
    t = total + value
    return t, error + (value - (t - total))


@numba.njit(cache=True, inline="always")
def add_compensated(sums, row, node, value, error_row):  # pragma: no cover - compiled
    """``sums[row, node] += value``, its rounding error added to ``sums[error_row, node]``."""
    sums[row, node], sums[error_row, node] = compensated_step(
        sums[row, node], sums[error_row, node], value
    )


@numba.njit(cache=True, inline="always")
def add_same_sign(sums, row, node, value, error_row):  # pragma: no cover - compiled
    """:func:`add_compensated` by :func:`same_sign_step`: ``value`` has the sign of the sum."""
    sums[row, node], sums[error_row, node] = same_sign_step(
        sums[row, node], sums[error_row, node], value
    )


@numba.njit(cache=True)
def _row_sums(columns, rows, out):  # pragma: no cover - compiled
    for k in range(len(rows)):
        total, error = 0.0, 0.0
        for value in columns[rows[k]]:
            # adding a zero changes neither number: a compare, not six operations, for
            # the zeros (the virial rows of a kernel that sums its virial in registers
            # are zero but for one node)
            if value != 0.0:
                total, error = compensated_step(total, error, value)
        out[k, 0] = total
        out[k, 1] = error


def compensated_row_sums(columns: np.ndarray, rows: Sequence[int] | None = None) -> np.ndarray:
    """Each row's sum as an unevaluated pair ``(sum, error)``.

    Parameters
    ----------
    columns : (k, n) float64 array
    rows : sequence of int, optional
        The rows to sum, in this order (all by default): no copy of them is made.

    Returns
    -------
    (len(rows), 2) float64 array
        ``sum + error`` is the row's sum to about twice float64's precision;
        pass the pairs of every rank to :func:`exact_total`.
    """
    columns = np.ascontiguousarray(columns, dtype=np.float64)
    rows = np.arange(len(columns)) if rows is None else np.asarray(rows, dtype=np.int64)
    out = np.empty((len(rows), 2))
    _row_sums(columns, rows, out)
    return out


def exact_total(pairs: np.ndarray) -> np.ndarray:
    """Correctly rounded totals of ``(..., k, 2)`` pairs from :func:`compensated_row_sums`.

    Returns
    -------
    (k,) float64 array
        ``math.fsum`` of every pair of each row: the same bits whatever the
        order of the pairs (of the ranks).
    """
    pairs = np.asarray(pairs, dtype=np.float64)
    by_row = np.moveaxis(pairs, -2, 0).reshape(pairs.shape[-2], -1)
    if by_row.shape[1] == 2:
        # one rank's pairs: one float64 addition is correctly rounded already, the
        # same bits as math.fsum's, without a Python call per row
        return by_row[:, 0] + by_row[:, 1]
    return np.array([math.fsum(row) for row in by_row])
