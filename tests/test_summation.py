"""Compensated sums (ase_shard.summation) against ``math.fsum``, the correctly rounded sum."""

from __future__ import annotations

import math

import numba
import numpy as np

from ase_shard.summation import compensated_row_sums, exact_total, same_sign_step


def _ill_conditioned(rng: np.random.Generator, n: int) -> np.ndarray:
    """Large terms that cancel in pairs, shuffled among small ones: a plain sum keeps
    little of the small ones' total."""
    large = rng.normal(size=n) * 1e10
    return rng.permutation(np.concatenate([large, -large, rng.normal(size=n)]))


def test_rows_are_summed_as_if_in_twice_the_precision() -> None:
    rng = np.random.default_rng(5)
    rows = np.stack([_ill_conditioned(rng, 5000) for _ in range(3)])
    pairs = compensated_row_sums(rows)
    for row, (total, error) in zip(rows, pairs, strict=True):
        exact = math.fsum(row)
        assert abs(total + error - exact) <= math.ulp(exact)
        assert abs(row.sum() - exact) > 100 * math.ulp(exact)  # a plain sum is far off


def test_chosen_rows_and_zeros() -> None:
    """``rows`` picks and orders rows without a copy; zeros (skipped) change no bit."""
    rng = np.random.default_rng(7)
    columns = np.stack([_ill_conditioned(rng, 2000) for _ in range(3)])
    columns[1, ::3] = 0.0
    columns[2] = 0.0
    columns[2, 17] = 3.5
    chosen = compensated_row_sums(columns, [2, 0, 1])
    np.testing.assert_array_equal(chosen, compensated_row_sums(columns[[2, 0, 1]]))
    assert tuple(chosen[0]) == (3.5, 0.0)
    for row, (total, error) in zip(columns[[2, 0, 1]], chosen, strict=True):
        exact = math.fsum(row)
        assert abs(total + error - exact) <= math.ulp(exact)


def test_totals_do_not_depend_on_the_order_of_terms_or_ranks() -> None:
    """Split among ranks in any way and any order, the total is the correctly rounded one
    (to one unit in the last place); plain sums of the same splits differ."""
    rng = np.random.default_rng(6)
    values = _ill_conditioned(rng, 20000)[None]
    exact = math.fsum(values[0])
    plain = set()
    for ranks in (1, 2, 3, 7):
        order = rng.permutation(values.shape[1])
        parts = np.array_split(values[:, order], ranks, axis=1)
        pairs = np.stack([compensated_row_sums(part) for part in parts[::-1]])
        assert abs(exact_total(pairs)[0] - exact) <= math.ulp(exact)
        assert exact_total(pairs[::-1])[0] == exact_total(pairs)[0]  # fsum: any order
        plain.add(sum(part.sum() for part in parts))
    assert len(plain) > 1  # plain sums of the same splits differ


def test_one_pair_per_row_is_the_correctly_rounded_total() -> None:
    """One rank's totals (one pair a row) are ``math.fsum``'s bits, ties included."""
    rng = np.random.default_rng(8)
    pairs = compensated_row_sums(np.stack([_ill_conditioned(rng, 500) for _ in range(200)]))
    ties = np.array([[1.0, 2.0**-53], [1.0, 3 * 2.0**-53], [2.0**53, 1.0], [-1.0, -(2.0**-53)]])
    for every in (pairs, ties):
        expected = [math.fsum(pair) for pair in every]
        np.testing.assert_array_equal(exact_total(every[None]), expected)


@numba.njit(cache=True)
def _same_sign_sum(values):  # pragma: no cover - compiled
    total, error = 0.0, 0.0
    for value in values:
        total, error = same_sign_step(total, error, value)
    return total + error


def test_sums_of_one_sign_are_order_independent_with_the_fast_step() -> None:
    """EMT's densities and pair sums: terms of one sign spanning ten decades, in any order,
    summed to the correctly rounded total within one unit in the last place, where plain
    sums of the same orders differ."""
    rng = np.random.default_rng(7)
    for sign in (1.0, -1.0):
        values = sign * np.exp(rng.uniform(-23.0, 0.0, size=80))
        exact = math.fsum(values)
        plain = set()
        for _ in range(20):
            order = rng.permutation(values)
            assert abs(_same_sign_sum(order) - exact) <= math.ulp(exact)
            plain.add(sum(order.tolist()))
        assert len(plain) > 1
