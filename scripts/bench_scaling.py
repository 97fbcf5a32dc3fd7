"""Run ``ase-shard bench`` across rank counts and sizes; draw speed-up and efficiency.

Each (size, ranks) pair is one ``mpirun --oversubscribe -n P ase-shard bench`` run
(bounded by ``timeout``), which writes its own JSON (and PNG) into ``--out-dir``.
Every run measures its speed-up against a one-rank reference *in the same run*
(``ShardedCalculator`` on rank 0 alone, and the bare model), together with the
machine's ceiling on P ranks; the curves plot those in-run ratios, so a shared,
noisy machine shows up in the ceiling rather than biasing the comparison::

    python scripts/bench_scaling.py --model emt --sizes 8 12 16 20 --ranks 1 2
    python scripts/bench_scaling.py --model sevennet --sizes 4 6 --ranks 1 2 \\
        --img docs/img/scaling-sevennet.png -- --ml-layers 3
    python scripts/bench_scaling.py --model emt --sizes 8 20 --plot-only   # redraw

Arguments after ``--`` go to ``ase-shard bench`` unchanged. Prints a Markdown
table of the runs (what docs/performance.md shows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ase_shard.comm import ALLOW_RUN_AS_ROOT

BIN = Path(sys.executable).parent
ENV = {**ALLOW_RUN_AS_ROOT, "HF_HUB_OFFLINE": "1"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="emt", help="ase-shard bench --model (emt)")
    parser.add_argument("--system", default="cu-bulk", help="ase-shard bench --system")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 12, 16, 20])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, default=1, help="threads per rank (1)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run (900)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench-results"))
    parser.add_argument("--img", type=Path, help="default docs/img/scaling-MODEL.png")
    parser.add_argument("--plot-only", action="store_true", help="redraw from existing JSONs")
    parser.add_argument(
        "--max-load",
        type=float,
        help="before each run, wait (up to --patience) until the 1-minute load average is below "
        "this",
    )
    parser.add_argument("--patience", type=float, default=600, help="seconds, for --max-load")
    parser.add_argument("bench_args", nargs="*", help="after --: passed to ase-shard bench")
    return parser.parse_args(argv)


def stem(args: argparse.Namespace, size: int, ranks: int) -> Path:
    return args.out_dir / f"{args.model}-{args.system}-{size}-p{ranks}"


def wait_for_quiet(max_load: float, patience: float) -> None:
    """Wait until the 1-minute load average drops below ``max_load`` (or give up)."""
    deadline = time.monotonic() + patience
    while os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(10)


def run_one(args: argparse.Namespace, size: int, ranks: int) -> None:
    """One ``ase-shard bench`` under ``mpirun -n ranks``; raises if it fails."""
    if args.max_load is not None:
        wait_for_quiet(args.max_load, args.patience)
    out = stem(args, size, ranks)
    command = ["timeout", "-k", "10", str(args.timeout), str(BIN / "mpirun"), "--oversubscribe"]
    command += ["-n", str(ranks), str(BIN / "ase-shard"), "bench", "--model", args.model]
    command += ["--system", args.system, "--size", str(size), "--threads", str(args.threads)]
    command += ["--json", f"{out}.json", "--plot", f"{out}.png", *args.bench_args]
    env = dict(os.environ, **ENV, OMP_NUM_THREADS=str(args.threads))
    print("$", " ".join(command[4:]), flush=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        why = "timed out" if done.returncode in (124, 137) else f"exit {done.returncode}"
        raise SystemExit(f"failed ({why}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def load(args: argparse.Namespace) -> list[dict]:
    reports = []
    for size in args.sizes:
        for ranks in args.ranks:
            path = Path(f"{stem(args, size, ranks)}.json")
            if path.exists():
                reports.append(json.loads(path.read_text()))
    if not reports:
        raise SystemExit(f"no reports in {args.out_dir}")
    return reports


def markdown_table(reports: list[dict]) -> str:
    """One row per run: step times (ms) and the in-run ratios."""
    lines = [
        "| atoms | ranks | bare ms | 1 rank ms | P ranks ms (reuse / rebuild) | 1 rank / bare | "
        "speed-up (reuse) | efficiency | vs bare | ceiling | speed-up / ceiling "
        "| first-call MiB (P / 1) | peak MiB (P / 1) | nodes/owned | max diff from bare |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for report in sorted(reports, key=lambda r: (r["system"]["n_atoms"], r["ranks"])):
        results, ratios, size = report["results"], report["ratios"], report["ranks"]
        one = results["sharded"] if size == 1 else results.get("sharded_1")
        reuse = ratios["reuse"]
        layout = report["results"]["sharded"]["layout"]
        padded = max(nodes / max(owned, 1) for _, owned, nodes in layout)
        memory = {
            field: (
                max(m[field] for m in results["sharded"]["memory"]),
                one["memory"][0][field] if one else float("nan"),
            )
            for field in ("peak_rss_delta_mb", "peak_rss_mb")
        }
        speedup = reuse.get("speedup", float("nan"))
        differs = max(max(a.values()) for a in report["agreement"].values())
        lines.append(
            f"| {report['system']['n_atoms']:,} | {size} "
            f"| {1e3 * results['bare']['reuse']['step_s']:.0f} "
            f"| {1e3 * one['reuse']['step_s']:.0f} "
            f"| {1e3 * results['sharded']['reuse']['step_s']:.0f} / "
            f"{1e3 * results['sharded']['rebuild']['step_s']:.0f} "
            f"| {reuse.get('sharded_1_over_bare', float('nan')):.3f} "
            f"| {speedup:.2f} | {reuse.get('efficiency', float('nan')):.2f} "
            f"| {reuse['speedup_vs_bare']:.2f} | {ratios['ceiling']:.2f} "
            f"| {speedup / ratios['ceiling']:.2f} "
            f"| {memory['peak_rss_delta_mb'][0]:.0f} / {memory['peak_rss_delta_mb'][1]:.0f} "
            f"| {memory['peak_rss_mb'][0]:.0f} / {memory['peak_rss_mb'][1]:.0f} "
            f"| {padded:.2f} | {differs:.0e} |"
        )
    return "\n".join(lines)


def plot(reports: list[dict], path: Path, title: str) -> None:
    """Speed-up (left) and efficiency (right) against ranks, one curve per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    by_size: dict[int, list[dict]] = {}
    for report in reports:
        by_size.setdefault(report["system"]["n_atoms"], []).append(report)
    all_ranks = sorted({r["ranks"] for r in reports})
    left.plot(all_ranks, all_ranks, "k:", label="ideal")
    right.axhline(1.0, color="k", linestyle=":")
    colors = plt.get_cmap("viridis")
    top = 0.0  # the largest efficiency drawn
    for k, (n_atoms, runs) in enumerate(sorted(by_size.items())):
        runs = sorted(runs, key=lambda r: r["ranks"])
        color = colors(k / max(len(by_size) - 1, 1))
        ranks = np.array([r["ranks"] for r in runs])
        speedup = np.array([r["ratios"]["reuse"].get("speedup", np.nan) for r in runs])
        vs_bare = np.array([r["ratios"]["reuse"]["speedup_vs_bare"] for r in runs])
        ceiling = np.array([r["ratios"]["ceiling"] if r["ranks"] > 1 else 1.0 for r in runs])
        left.plot(ranks, speedup, "o-", color=color, label=f"{n_atoms:,} atoms")
        left.plot(ranks, vs_bare, "s--", color=color, alpha=0.6)
        left.plot(ranks, ceiling, "x", color=color, markersize=9)
        right.plot(ranks, speedup / ranks, "o-", color=color)
        right.plot(ranks, ceiling / ranks, "x", color=color)
        top = max(top, np.nanmax(speedup / ranks), np.nanmax(ceiling / ranks))
    left.plot([], [], "ks--", alpha=0.6, label="vs bare model")
    left.plot([], [], "kx", label="machine ceiling")
    left.set_xlabel("ranks (1 thread each)")
    left.set_ylabel("speed-up of a reuse step")
    left.set_xticks(all_ranks)
    left.legend(fontsize=8)
    right.set_xlabel("ranks")
    right.set_ylabel("parallel efficiency (speed-up / ranks)")
    right.set_xticks(all_ranks)
    right.set_ylim(0, max(1.2, 1.1 * top))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if not args.plot_only:
        for size in args.sizes:
            for ranks in args.ranks:
                run_one(args, size, ranks)
    reports = load(args)
    first = reports[0]
    img = args.img or Path("docs/img") / f"scaling-{args.model}.png"
    title = (
        f"{args.system}, {args.model} ({first['model']['class']}, {first['dtype']}), "
        f"speed-up in-run vs 1 rank; {first['environment']['cpus']} CPUs"
    )
    plot(reports, img, title)
    print(markdown_table(reports))
    print(f"wrote {img}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
