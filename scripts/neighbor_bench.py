"""Time and peak memory of the neighbour searches (numba and torch cell lists, vesin).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/neighbor_bench.py time --sizes 100000 1000000
    OMP_NUM_THREADS=1 .venv/bin/python scripts/neighbor_bench.py memory --size 256000

Points are fcc Cu (3.61 Å) rattled by 0.02 Å, so no distance ties the cutoff.
``time`` takes turns between the searches ``--repeat`` times on the same points
and prints medians and their ratios to vesin: on a shared machine the ratio of
interleaved medians is what holds, not the seconds. ``memory`` runs each
search once in a fresh interpreter and prints the growth of its peak resident
set over the set it had just before the call (``ru_maxrss``, which sees torch's
allocations, unlike ``tracemalloc``).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time

import numpy as np
import torch

from ase_shard.neighbors import neighbor_pairs

PATHS = ("vesin", "numba", "torch")


def fcc_copper(size: int, seed: int = 0) -> torch.Tensor:
    """``(4 k^3, 3)`` float64 positions in Å, ``k`` the smallest with ``4 k^3 >= size``."""
    k = int(np.ceil((size / 4) ** (1 / 3) - 1e-9))
    basis = np.array([[0, 0, 0], [0, 0.5, 0.5], [0.5, 0, 0.5], [0.5, 0.5, 0]])
    cells = np.stack(np.meshgrid(*[np.arange(k)] * 3, indexing="ij"), axis=-1).reshape(-1, 1, 3)
    points = ((cells + basis) * 3.61).reshape(-1, 3)
    points += np.random.default_rng(seed).normal(0.0, 0.02, points.shape)
    return torch.from_numpy(points)


def compare_times(sizes: list[int], cutoffs: list[float], repeat: int) -> None:
    """Interleaved median seconds of every search and their ratios to vesin."""
    header = "".join(f"{path + ' s':>9}" for path in PATHS)
    ratios = "".join(f"{path + '/vesin':>12}" for path in PATHS[1:])
    print(f"{'points':>9} {'cutoff':>6} {'pairs':>11}{header}{ratios}")
    for size in sizes:
        positions = fcc_copper(size)
        for cutoff in cutoffs:
            samples: dict[str, list[float]] = {path: [] for path in PATHS}
            for index in range(repeat):
                # rotate which goes first, so none always runs on a warmer cache
                for path in PATHS[index % 3 :] + PATHS[: index % 3]:
                    start = time.perf_counter()
                    pairs = neighbor_pairs(positions, cutoff, neighbor_list=path)
                    samples[path].append(time.perf_counter() - start)
                    del pairs
            seconds = {path: float(np.median(samples[path])) for path in PATHS}
            n_pairs = neighbor_pairs(positions, cutoff).shape[1]
            print(
                f"{len(positions):>9} {cutoff:>6.2f} {n_pairs:>11}"
                + "".join(f"{seconds[path]:>9.3f}" for path in PATHS)
                + "".join(f"{seconds[path] / seconds['vesin']:>12.2f}" for path in PATHS[1:])
            )


def peak_growth(path: str, size: int, cutoff: float, n_centres: int | None) -> None:
    """Print the peak resident set growth (MB) of one search in this interpreter."""
    positions = fcc_copper(size)
    neighbor_pairs(positions[:1000], cutoff, neighbor_list=path)  # load lazy libraries first
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    pairs = neighbor_pairs(positions, cutoff, n_centres, neighbor_list=path)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{path} {(after - before) / 1024:.0f} {pairs.shape[1]}")


def compare_memory(size: int, cutoff: float, n_centres: int | None) -> None:
    """Peak growth of each search, each in a fresh interpreter."""
    print(f"{'search':>6} {'points':>8} {'cutoff':>6} {'pairs':>10} {'peak MB':>8} {'B/pair':>7}")
    for path in PATHS:
        command = [sys.executable, __file__, "_peak", path, str(size), str(cutoff)]
        if n_centres is not None:
            command.append(str(n_centres))
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        _, megabytes, n_pairs = out.split()
        per_pair = f"{float(megabytes) * 2**20 / int(n_pairs):.1f}" if int(n_pairs) else "-"
        print(f"{path:>6} {size:>8} {cutoff:>6.2f} {n_pairs:>10} {megabytes:>8} {per_pair:>7}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_peak":  # one measurement, for compare_memory
        path, size, cutoff, *n_centres = sys.argv[2:]
        peak_growth(path, int(size), float(cutoff), int(n_centres[0]) if n_centres else None)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    timing = sub.add_parser("time", help="interleaved median times and their ratio")
    timing.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    timing.add_argument("--cutoffs", type=float, nargs="+", default=[0.8, 5.5], help="Å")
    timing.add_argument("--repeat", type=int, default=5)
    memory = sub.add_parser("memory", help="peak resident set growth, fresh process per search")
    memory.add_argument("--size", type=int, default=256_000)
    memory.add_argument("--cutoff", type=float, default=5.5, help="Å")
    memory.add_argument("--n-centres", type=int, default=None, help="default: every row")
    args = parser.parse_args()
    torch.set_num_threads(1)  # single-threaded like vesin and numba; set OMP_NUM_THREADS=1 too
    if args.mode == "time":
        compare_times(args.sizes, args.cutoffs, args.repeat)
    else:
        compare_memory(args.size, args.cutoff, args.n_centres)


if __name__ == "__main__":
    main()
