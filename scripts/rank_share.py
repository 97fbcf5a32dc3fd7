"""One rank's own share of a step at many ranks, measured without the other ranks.

    .venv/bin/python scripts/rank_share.py --size 63 --ranks 64

This machine cannot run 64 ranks, but under SPMD no rank does another rank's
work, so one rank's share is the cost of the functions the calculator calls for
that rank alone. This script builds fcc Cu (``--size`` cells per side, 4 atoms
each), decomposes it for ``--ranks`` ranks exactly as ``ShardedCalculator``
does (spatial partition, EMT's halo width), and times, for rank 0 and for a
middle rank, every piece of framework work one calculation does on that rank.
MPI calls are not timed: the bytes they move are printed instead. Times are
medians of ``--repeat`` runs, in ms and in ns per atom of the whole system.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from ase.build import bulk

from ase_shard.halo import local_rows
from ase_shard.partition import choose_grid, frame_coordinates, spatial_owners
from ase_shard.system import fingerprint, validate_numbers, validate_positions

EMT_HALO = 6.4 + 0.5  # Å: EMT's cutoff plus the default skin


def timed(repeat: int, work) -> float:
    """Median seconds of ``work()`` over ``repeat`` runs."""
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def rank_share(atoms, n_ranks: int, rank: int, repeat: int) -> dict[str, float]:
    """Seconds of each piece of ``rank``'s framework work, reuse and rebuild."""
    positions, cell, pbc = atoms.positions, atoms.cell.array, atoms.pbc
    coords = frame_coordinates(positions, cell, pbc)
    grid = choose_grid(coords, pbc, n_ranks, EMT_HALO)
    owners = spatial_owners(coords, grid)
    rows = local_rows(coords, pbc, owners, rank, n_ranks, EMT_HALO, True)
    owned = rows.ids[: rows.n_owned]
    nodes = rows.ids[: rows.n_nodes]
    reference = positions[owned].copy()
    order = np.argsort(owners, kind="stable")
    gathered = np.random.default_rng(0).normal(size=(len(atoms), 3))

    def displacement() -> None:
        moved = positions[owned] - reference
        np.einsum("ij,ij->i", moved, moved).max(initial=0.0)

    def place_results() -> None:
        forces = np.empty_like(gathered)
        forces[order] = gathered

    reuse = {
        "node positions from own Atoms": lambda: positions[nodes],
        "validate owned + rebuild test": lambda: (
            validate_positions(positions[owned], owned),
            displacement(),
        ),
        "same-Atoms check (whole copy)": lambda: fingerprint(atoms),
        "place allgathered forces (N x 3)": place_results,
    }
    rebuild = {
        "frame coordinates": lambda: frame_coordinates(positions, cell, pbc),
        "owners (spatial, all atoms)": lambda: spatial_owners(coords, grid),
        "own ghosts (local_rows)": lambda: local_rows(
            coords, pbc, owners, rank, n_ranks, EMT_HALO, True
        ),
        "elements": lambda: validate_numbers(atoms.numbers, [29]),
        "result order (argsort of owners)": lambda: np.argsort(owners, kind="stable"),
    }
    out = {f"reuse: {k}": timed(repeat, v) for k, v in reuse.items()}
    out.update({f"rebuild: {k}": timed(repeat, v) for k, v in rebuild.items()})
    out["owned"], out["nodes"] = rows.n_owned, rows.n_nodes
    out["ghost ids sent at a rebuild (int64)"] = len(rows.requests)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=63, help="fcc cells per side (63: 1M atoms)")
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(args.size)
    atoms.rattle(0.02, seed=1)
    n = len(atoms)
    ranks = (0, args.ranks // 2)
    shares = {rank: rank_share(atoms, args.ranks, rank, args.repeat) for rank in ranks}
    print(f"{n:,} atoms, {args.ranks} ranks, EMT halo {EMT_HALO} Å; ms (ns per atom of N)")
    print(f"{'':44s}" + "".join(f"{'rank ' + str(r):>22s}" for r in ranks))
    for key, value in shares[ranks[0]].items():
        if isinstance(value, float):
            cells = "".join(
                f"{shares[r][key] * 1e3:12.2f} ({shares[r][key] / n * 1e9:5.1f})" for r in ranks
            )
        else:
            cells = "".join(f"{shares[r][key]:>22,}" for r in ranks)
        print(f"{key:44s}{cells}")
    for kind in ("reuse", "rebuild"):
        totals = [
            sum(v for k, v in shares[r].items() if k.startswith(kind + ":")) for r in ranks
        ]
        cells = "".join(f"{t * 1e3:12.2f} ({t / n * 1e9:5.1f})" for t in totals)
        print(f"{kind + ' total':44s}{cells}")
    nodes = shares[ranks[0]]["nodes"]
    print(
        f"MPI per reuse step and rank: forces allgather {n * 24 / 1e6:.1f} MB in, "
        f"ghost force sums ~{(nodes - shares[ranks[0]]['owned']) * 24 / 1e6:.2f} MB each way"
    )


if __name__ == "__main__":
    main()
