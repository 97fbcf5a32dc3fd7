"""Which ase_shard modules one force call passes through, and how often it changes module.

Runs a small MD-like step (a move of every atom, then ``atoms.get_forces()``)
under ``sys.setprofile`` and follows the innermost frame that belongs to the
``ase_shard`` package. Each time that frame's file changes is a *move*: *down*
when a function of another module is called, *up* when control returns to a
caller in another module. A layered design goes down a path and comes back
once; a hub is re-entered after each call it makes.

Usage (one rank, or under mpirun; rank 0 prints)::

    python scripts/call_path.py [--model emt] [--reuse | --rebuild] [--sequence]

The first call (which builds the decomposition) is not counted unless
``--rebuild``; by default the step reuses it, as most MD steps do.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np
from ase.build import bulk

import ase_shard
from ase_shard import ShardedCalculator
from ase_shard.models import EMT, LennardJones

PACKAGE = os.path.dirname(ase_shard.__file__) + os.sep


def _module(filename: str) -> str | None:
    """``calculator.py``, ``models/emt.py``, ... for files of the package, else ``None``."""
    return filename[len(PACKAGE) :] if filename.startswith(PACKAGE) else None


class PathRecorder:
    """Follows the innermost ase_shard frame through profile events."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # ase_shard module of each ase_shard frame, outermost first
        self.sequence: list[tuple[str, str]] = []  # (direction, module) per move
        self.current: str | None = None

    def _moved(self, direction: str) -> None:
        here = self.stack[-1] if self.stack else None
        if here is not None and here != self.current:
            if self.current is not None:
                self.sequence.append((direction, here))
            self.current = here

    def __call__(self, frame, event: str, arg) -> None:
        if event not in ("call", "return"):
            return
        module = _module(frame.f_code.co_filename)
        if module is None:
            return
        if event == "call":
            self.stack.append(module)
            self._moved("down")
        elif self.stack:
            self.stack.pop()
            self._moved("up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("emt", "lj"), default="emt")
    parser.add_argument("--size", type=int, default=4, help="fcc cubic repeats (4: 256 atoms)")
    parser.add_argument("--rebuild", action="store_true", help="count a step that rebuilds")
    parser.add_argument("--sequence", action="store_true", help="print every move")
    args = parser.parse_args()

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(args.size)
    model = EMT() if args.model == "emt" else LennardJones(sigma=2.3, epsilon=0.4, rc=5.0)
    atoms.calc = ShardedCalculator(model)
    atoms.get_forces()
    atoms.positions += np.random.default_rng(0).normal(scale=1e-3, size=atoms.positions.shape)
    if args.rebuild:
        atoms.calc.request_rebuild()
    recorder = PathRecorder()
    sys.setprofile(recorder)
    try:
        atoms.get_forces()
    finally:
        sys.setprofile(None)
    if atoms.calc.comm.rank:
        return
    moves = recorder.sequence
    visited = collections.Counter(module for _, module in moves)
    up = sum(direction == "up" for direction, _ in moves)
    print(f"one {'rebuild' if args.rebuild else 'reuse'} step, {args.model}, "
          f"{atoms.calc.comm.size} rank(s):")
    print(f"  modules entered: {len(visited)}; moves: {len(moves)} ({up} up)")
    print("  entries per module: " + ", ".join(f"{m} {n}" for m, n in visited.most_common()))
    if args.sequence:
        for direction, module in moves:
            print(f"  {'->' if direction == 'down' else '<-'} {module}")


if __name__ == "__main__":
    main()
