"""The reports of ``ase-shard bench`` read back: plain-text summaries and the PNG.

Everything here reads the JSON-encodable report :func:`run_benchmark
<ase_shard.bench.harness.run_benchmark>` or :func:`run_framework
<ase_shard.bench.framework.run_framework>` returned (or one loaded from a file),
so a summary or plot can be redrawn from a stored report. Times are printed in
ms, memory in MiB.
"""

from __future__ import annotations

import numpy as np

from ase_shard.balance import max_over_mean
from ase_shard.bench.framework import FRAMEWORK_BALANCE, FRAMEWORK_PHASES
from ase_shard.bench.run import KINDS
from ase_shard.timing import PHASES

# largest relative difference from the bare model that is round-off, per dtype
AGREEMENT_TOLERANCE = {"float64": 1e-8, "float32": 1e-3}
# the subjects in the order they are shown, with their labels ({P}: the rank count)
_SUBJECTS = {
    "bare": "bare model (rank 0)",
    "sharded_1": "sharded, 1 rank",
    "sharded": "sharded, {P}",
    "ase": "ASE's own calculator",
}


def _ranks(size: int) -> str:
    return f"{size} rank" if size == 1 else f"{size} ranks"


def _label(name: str, size: int) -> str:
    return _SUBJECTS[name].format(P=_ranks(size))


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def breakdown_rows(
    report: dict, field: str = "breakdown"
) -> list[tuple[str, dict[str, float], float]]:
    """``(label, seconds per phase, step seconds)`` for the breakdown tables and plot.

    ``field`` is ``"breakdown"`` (wall clock) or ``"breakdown_cpu"`` (CPU
    time, MPI calls excluded). One row per subject and kind; the ``P``-rank
    calculator gets rank 0 and, if another, its rank with the most phase time.
    """
    results, size = report["results"], report["ranks"]
    rows = []
    for name in ("bare", "sharded_1", "sharded"):
        if name not in results:
            continue
        for kind in KINDS:
            result = results[name][kind]
            per_rank = result[field]
            totals = np.sum([per_rank[phase] for phase in PHASES], axis=0)
            ranks = [0]
            slowest = int(np.argmax(totals))
            if slowest != 0:
                ranks.append(slowest)
            for rank in ranks:
                suffix = f", rank {rank}" if name == "sharded" and size > 1 else ""
                rows.append(
                    (
                        f"{_label(name, size)}{suffix}, {kind}",
                        {phase: per_rank[phase][rank] for phase in PHASES},
                        result["step_s"],
                    )
                )
    return rows


def _header_lines(report: dict, title: str) -> list[str]:
    """The first lines of a summary: system, model, ranks, threads, device, load."""
    labels, model = report["labels"], report["model"]
    load = report["environment"]["load_average"]
    return [
        f"{title}: {labels.get('system', report['system']['formula'])}, "
        f"{report['system']['n_atoms']} atoms, {labels.get('model', model['class'])} "
        f"({model['class']}, cutoff {model['cutoff']:g} Å, {report['dtype']}), "
        f"{_ranks(report['ranks'])} x {max(report['threads_per_rank'])} thread(s), "
        f"{report['device']}, skin {report['settings']['skin']:g} Å",
        f"  {_cpu_text(report['environment'])}; 1-minute load average at start and end: "
        + ", ".join("-" if x is None else f"{x:.1f}" for x in load),
    ]


def _cpu_text(environment: dict) -> str:
    """The machine's CPUs and those each rank may run on (its affinity)."""
    text = f"{environment['cpus']} CPUs"
    per_rank = environment.get("cpus_per_rank")  # absent from reports before it was added
    if per_rank:
        low, high = min(per_rank), max(per_rank)
        text += f", {low if low == high else f'{low}-{high}'} usable per rank (affinity)"
    return text


def _source_note(report: dict) -> list[str]:
    """A line naming the modified files the report was measured with, if any."""
    source = report["environment"]["source"]
    if source is None or not source["modified"]:
        return []
    return [
        f"  note: measured on commit {source['commit'][:10]} with modified files: "
        + ", ".join(source["modified"])
    ]


def _layout_line(layout: list[list[int]], size: int) -> str:
    """Owned atoms, nodes, rows and padding (``nodes / owned``) over the ranks."""
    layout = np.array(layout)
    padded = layout[:, 2] / np.maximum(layout[:, 1], 1)
    return (
        f"  layout on {_ranks(size)}: owned {layout[:, 1].min()}-{layout[:, 1].max()}, "
        f"nodes {layout[:, 2].min()}-{layout[:, 2].max()}, rows {layout[:, 0].min()}-"
        f"{layout[:, 0].max()}, nodes/owned {padded.min():.2f}-{padded.max():.2f}"
    )


def format_summary(report: dict) -> str:
    """A plain-text summary of a report: step times, ratios, agreement, breakdown."""
    lines = _header_lines(report, "ase-shard bench") + [""]
    lines += _step_table(report) + [""]
    lines += _ratio_lines(report) + [""]
    lines += _agreement_lines(report)
    lines += _source_note(report)
    lines += ["", _layout_line(report["results"]["sharded"]["layout"], report["ranks"])]
    for field, title in (
        ("breakdown", "breakdown, wall ms per step"),
        ("breakdown_cpu", "breakdown, CPU ms per step (CPU, MPI excluded)"),
    ):
        lines += ["", f"  {title}: " + " ".join(PHASES)]
        for label, phases, step in breakdown_rows(report, field):
            values = " ".join(_ms(phases[phase]) for phase in PHASES)
            lines.append(f"    {label}: {values} (step {_ms(step)})")
    lines += _imbalance_lines(report)
    return "\n".join(lines)


def _imbalance_lines(report: dict) -> list[str]:
    """The ``P``-rank calculator's load imbalance per phase and kind of step (CPU time,
    MPI excluded: waiting for the busiest rank is not work)."""
    if report["ranks"] < 2:
        return []
    lines = ["", "  imbalance, busiest rank / mean of CPU per phase: " + " ".join(PHASES)]
    for kind in KINDS:
        per_rank = report["results"]["sharded"][kind]["breakdown_cpu"]
        ratios = [max_over_mean(per_rank[phase]) for phase in PHASES]
        total = max_over_mean(np.sum([per_rank[phase] for phase in PHASES], axis=0))
        values = " ".join(_ratio(ratio) for ratio in ratios)
        lines.append(
            f"    {_label('sharded', report['ranks'])}, {kind}: {values} "
            f"(all phases {_ratio(total)})"
        )
    return lines


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _step_table(report: dict) -> list[str]:
    """Each subject's median step times, first call and largest peak memory over ranks."""
    results, size = report["results"], report["ranks"]
    lines = [
        f"  {'ms per step':<28}{'reuse':>10}{'rebuild':>10}{'first':>10}"
        f"{'first-call MiB':>16}{'peak RSS MiB':>14}"
    ]
    for name in ("bare", "sharded_1", "sharded", "ase"):
        if name not in results:
            continue
        result = results[name]
        memory = {
            field: max((m[field] for m in result["memory"] if m[field] is not None), default=None)
            for field in ("peak_rss_delta_mb", "peak_rss_mb")
        }
        lines.append(
            f"  {_label(name, size):<28}{_ms(result['reuse']['step_s']):>10}"
            f"{_ms(result.get('rebuild', {}).get('step_s')):>10}"
            f"{_ms(result['first_call_s']):>10}{_mib(memory['peak_rss_delta_mb']):>16}"
            f"{_mib(memory['peak_rss_mb']):>14}"
        )
    return lines


def _ratio_lines(report: dict) -> list[str]:
    """The run's ratios (speed-ups, efficiency, ceiling, memory, ASE) that it has."""
    size, ratios = report["ranks"], report["ratios"]
    lines = [f"  {'ratios (median of per-step ratios)':<36}{'reuse':>10}{'rebuild':>10}"]
    rows = [
        ("sharded_1_over_bare", "1-rank sharded / bare"),
        ("speedup", f"speed-up, 1 -> {_ranks(size)}"),
        ("efficiency", "parallel efficiency"),
        ("speedup_vs_bare", f"speed-up, bare -> {_ranks(size)}"),
    ]
    for key, text in rows:
        if key in ratios["reuse"]:
            lines.append(
                f"  {text:<36}{ratios['reuse'][key]:>10.3f}{ratios['rebuild'][key]:>10.3f}"
            )
    lines.append(f"  {f'machine ceiling on {_ranks(size)}':<36}{ratios['ceiling']:>10.3f}")
    for key, text in (
        ("memory_ratio", "first-call memory, max rank / 1 rank"),
        ("rss_ratio", "peak RSS, max rank / 1 rank"),
        ("ase_over_sharded", "ASE calculator / sharded"),
        ("ase_over_sharded_1", "ASE calculator / 1-rank sharded"),
    ):
        if key in ratios:
            lines.append(f"  {text:<36}{ratios[key]:>10.3f}")
    return lines


def _agreement_lines(report: dict) -> list[str]:
    """Each subject's largest difference from the bare model, flagged above round-off."""
    size = report["ranks"]
    lines = ["  agreement with the bare model (max relative difference)"]
    tolerance = AGREEMENT_TOLERANCE[report["dtype"]]
    for name, a in report["agreement"].items():
        flag = "  <- DIFFERS" if max(a.values()) > tolerance else ""
        lines.append(
            f"    {_label(name, size):<26} energy {a['energy']:.1e}, "
            f"forces {a['forces']:.1e}{flag}"
        )
    if any(max(a.values()) > tolerance for a in report["agreement"].values()):
        lines.append(
            f"  WARNING: results differ from the bare model by more than {tolerance:g}; "
            "these timings are of wrong results"
        )
    return lines


def format_framework_summary(report: dict) -> str:
    """A plain-text summary of a :func:`run_framework
    <ase_shard.bench.framework.run_framework>` report: step times, their ratio, the
    CPU per phase and rank (MPI excluded), memory and layout."""
    settings = report["settings"]
    schedule = " ".join("R" if kind == "rebuild" else "u" for kind in report["schedule"])
    lines = _header_lines(report, "ase-shard bench --framework") + [
        f"  ASE VelocityVerlet, {settings['timestep']:g} fs, Maxwell-Boltzmann momenta at "
        f"{settings['temperature']:g} K (seed {settings['seed']})",
        f"  timed steps after a warm-up step: {schedule} (R: rebuild requested, u: reuse)",
        "",
    ]
    lines += _framework_step_table(report)
    lines += _framework_cpu_lines(report)
    lines += _framework_balance_lines(report)
    lines += _source_note(report)
    return "\n".join(lines)


def _framework_step_table(report: dict) -> list[str]:
    """Median step times of both subjects, their ratios and the rebuilds, per kind."""
    results = report["results"]
    lines = [f"  {'ms per step, median over steps':<56}{'reuse':>10}{'rebuild':>10}"]
    ratio = "{:.3f}".format
    rows = [
        ("baseline_s", "ASE step, ZeroCalculator: rank 0", _ms),
        ("baseline_max_s", "ASE step, ZeroCalculator: slowest rank", _ms),
        ("framework_s", "inside ShardedCalculator.calculate: slowest rank", _ms),
        ("sharded_step_s", "ASE step, ShardedCalculator: slowest rank", _ms),
        ("framework_over_baseline", "calculate / ZeroCalculator step, slowest ranks", ratio),
        ("framework_over_baseline_rank0", "calculate / ZeroCalculator step on rank 0", ratio),
        ("rebuilds", "rebuilds in these steps", str),
    ]
    for key, text, show in rows:
        values = "".join(f"{show(results[kind][key]):>10}" for kind in KINDS)
        lines.append(f"  {text:<56}{values}")
    return lines + ["  (ratios: median of per-step ratios)", ""]


def _framework_cpu_lines(report: dict) -> list[str]:
    """Per kind and rank: CPU per phase, the framework's sum, time in and outside them."""
    results, size = report["results"], report["ranks"]
    lines = [
        "  ms per step and rank, mean over steps: CPU per phase (CPU, MPI excluded) and",
        "    framework: their sum over " + " + ".join(FRAMEWORK_PHASES) + ";",
        "    in calc: wall-clock time inside calculate, MPI waits included; outside: the part",
        "    of it outside the phases (ASE's Calculator.calculate, the start barrier, ...)",
    ]
    header = "".join(f"{phase:>10}" for phase in PHASES)
    header += f"{'framework':>11}{'in calc':>10}{'outside':>10}"
    for kind in KINDS:
        result = results[kind]
        lines.append(f"    {kind:<9}{header}")
        for rank in range(size):
            cpu = "".join(f"{1e3 * result['breakdown_cpu'][p][rank]:>10.2f}" for p in PHASES)
            inside = result["calculate_s"][rank]
            outside = inside - sum(result["breakdown"][p][rank] for p in PHASES)
            lines.append(
                f"    rank {rank:<4}{cpu}{1e3 * result['framework_cpu_s'][rank]:>11.2f}"
                f"{1e3 * inside:>10.2f}{1e3 * outside:>10.2f}"
            )
    return lines


def _framework_balance_lines(report: dict) -> list[str]:
    """The framework CPU's balance against its bound, memory, layout, largest force and
    a warning when reuse steps rebuilt on their own."""
    results = report["results"]
    balance = []
    for kind in KINDS:
        value = results[kind]["framework_cpu_max_over_min"]
        flag = " EXCEEDS" if value is not None and value > FRAMEWORK_BALANCE else ""
        balance.append(f"{kind} {'-' if value is None else f'{value:.3f}'}{flag}")
    memory = report["memory"]
    lines = [
        f"  framework CPU, max / min over ranks (bound {FRAMEWORK_BALANCE:g}): "
        + ", ".join(balance),
        "  peak RSS MiB per rank: "
        + ", ".join(_mib(m["peak_rss_mb"]) for m in memory)
        + " (resident before the first calls: "
        + ", ".join(_mib(m["start_rss_mb"]) for m in memory)
        + ")",
        _layout_line(report["layout"], report["ranks"]),
        f"  largest |force| at the last step: {report['max_force']:.3g} eV/Å",
    ]
    automatic = results["reuse"]["rebuilds"]
    if automatic:
        lines.append(
            f"  WARNING: {automatic} reuse step(s) rebuilt on their own (atoms moved more than "
            "skin / 2 since the last build): use fewer reuse steps per rebuild step or a "
            "larger skin"
        )
    return lines


def _subject_ticks(axes, x: np.ndarray, labels: list[str]) -> None:
    """Subject names under the bars, wrapped and slanted: side by side they overlap."""
    wrapped = [label.replace(" (", "\n(").replace(", ", "\n") for label in labels]
    axes.set_xticks(x, wrapped, fontsize=8, rotation=30, ha="right", rotation_mode="anchor")


def _legend_above_bars(axes) -> None:
    """A legend in headroom above the tallest bar, so that it hides none."""
    axes.set_ylim(top=axes.get_ylim()[1] * 1.3)
    axes.legend(fontsize=8, loc="upper right")


def plot_report(report: dict, path: str) -> None:
    """Write a PNG: step times with speed-ups, peak memory per rank and the breakdown.

    The breakdown panel shows CPU time per phase with MPI calls excluded (what
    each rank computed itself); the grey rest of each bar is the remainder of
    the step's wall time: waits in MPI and work outside the phases.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = breakdown_rows(report, "breakdown_cpu")
    fig, (left, middle, right) = plt.subplots(
        1, 3, figsize=(17, 1.8 + 0.35 * len(rows)), gridspec_kw={"width_ratios": [1, 1, 1.6]}
    )
    _plot_steps(left, report)
    _plot_memory(middle, report)
    _plot_breakdown(right, rows, plt.get_cmap("tab10").colors)
    fig.suptitle(
        f"{report['labels'].get('system', report['system']['formula'])}: "
        f"{report['system']['n_atoms']} atoms, {report['labels'].get('model', '')} "
        f"({report['model']['class']}, {report['dtype']})",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _shown(report: dict) -> list[str]:
    """The subjects of ``report`` in the order the plot shows them."""
    return [name for name in ("bare", "sharded_1", "sharded", "ase") if name in report["results"]]


def _plot_steps(axes, report: dict) -> None:
    """Median reuse and rebuild step per subject; the title gives ceiling and speed-up."""
    results, size, ratios = report["results"], report["ranks"], report["ratios"]
    names = _shown(report)
    x = np.arange(len(names))
    for offset, kind in ((-0.2, "reuse"), (0.2, "rebuild")):
        times = [results[n].get(kind, {}).get("step_s") or 0.0 for n in names]
        axes.bar(x + offset, [1e3 * t for t in times], width=0.4, label=f"{kind} step")
    _subject_ticks(axes, x, [_label(n, size) for n in names])
    axes.set_ylabel("ms per step (median)")
    title = f"{_ranks(size)}: ceiling {ratios['ceiling']:.2f}x"
    if "speedup" in ratios["reuse"]:
        title += f", speed-up {ratios['reuse']['speedup']:.2f}x (reuse)"
    axes.set_title(title, fontsize=10)
    _legend_above_bars(axes)


def _plot_memory(axes, report: dict) -> None:
    """Peak RSS and first-call memory of each subject's largest rank."""
    results, size, ratios = report["results"], report["ranks"], report["ratios"]
    names = _shown(report)
    x = np.arange(len(names))
    for offset, (field, label) in (
        (-0.2, ("peak_rss_mb", "peak RSS")),
        (0.2, ("peak_rss_delta_mb", "first call")),
    ):
        peaks = [max((m[field] or 0.0) for m in results[n]["memory"]) for n in names]
        axes.bar(x + offset, peaks, width=0.4, label=label)
    _subject_ticks(axes, x, [_label(n, size) for n in names])
    axes.set_ylabel("MiB, largest rank")
    if "rss_ratio" in ratios:
        axes.set_title(
            f"memory per rank / 1 rank: RSS {ratios['rss_ratio']:.2f}, "
            f"first call {ratios['memory_ratio']:.2f}",
            fontsize=10,
        )
    _legend_above_bars(axes)


def _plot_breakdown(axes, rows: list[tuple[str, dict[str, float], float]], colors) -> None:
    """:func:`breakdown_rows` as stacked bars, the rest of each step's wall time in grey."""
    y = np.arange(len(rows))[::-1]
    start = np.zeros(len(rows))
    for k, phase in enumerate(PHASES):
        widths = np.array([1e3 * phases[phase] for _, phases, _ in rows])
        axes.barh(y, widths, left=start, color=colors[k % 10], label=phase)
        start += widths
    other = np.maximum(np.array([1e3 * step for _, _, step in rows]) - start, 0.0)
    axes.barh(y, other, left=start, color="lightgrey", label="rest of the step (wall)")
    axes.set_yticks(y, [label for label, _, _ in rows], fontsize=8)
    axes.set_xlabel("ms per step")
    axes.set_title("CPU per phase, MPI excluded (mean per step)", fontsize=10)
    axes.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.22))
