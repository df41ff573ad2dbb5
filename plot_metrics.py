"""Plot a training dashboard from one or more metrics.jsonl files (needs matplotlib).

    python plot_metrics.py runs/ppo/metrics.jsonl runs/grpo/metrics.jsonl --out dashboard.png

Each run keeps one colour in every panel; line styles tell the quantities of a panel apart.
Iterations where the training doctor printed a warning (a "doctor/<signal>" key) are marked
with a triangle on every panel's x-axis and listed under the panels.
"""

import argparse
import itertools
import json
from pathlib import Path

# (title, series); a series is (label, metric keys tried in order, line style, on the right axis).
# PPO and GRPO name the training reward differently; the time panel is filled in from the data.
PANELS = [
    ("reward", [("train", ["objective/scores", "objective/reward"], "-", False),
                ("eval (greedy)", ["eval/reward"], "o--", False)]),
    ("KL to reference (per sequence)", [("KL", ["objective/kl"], "-", False),
                                        ("β", ["objective/kl_coef"], ":", True)]),
    ("policy entropy", [("entropy", ["policy/entropy"], "-", False)]),
    ("clip fraction", [("policy", ["policy/clipfrac"], "-", False),
                       ("value", ["val/clipfrac"], "--", False),
                       ("ratio < 1-ε", ["policy/clip_ratio_low"], ":", False),
                       ("ratio > 1+ε", ["policy/clip_ratio_high"], "-.", False)]),
    ("approx KL (old → new policy)", [("approx KL", ["policy/approx_kl"], "-", False)]),
    ("critic", [("value loss", ["losses/value_loss"], "-", False),
                ("explained variance", ["val/explained_variance"], "--", True)]),
    ("grad norm (before clipping)", [("policy", ["grad/policy_norm"], "-", False),
                                     ("critic", ["grad/critic_norm"], "--", False)]),
    ("response length / EOS rate", [("length", ["rollout/response_length"], "-", False),
                                    ("EOS rate", ["rollout/eos_rate"], "--", True)]),
    ("groups with equal rewards (no advantage)", [("zero-std fraction", ["rollout/zero_std_fraction"], "-", False)]),
]
PHASE_STYLES = ["-", "-.", ":", "s-", "x-", "^-", "d-", "+-"]  # one per time/<phase>; eval (sparse) gets dots, iteration dashes


def read(path: Path) -> list[dict]:
    """Rows of a metrics.jsonl; a line that is not JSON (cut short by a crash) is skipped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "rollout/truncated_fraction" in row:  # GRPO logs the complement of PPO's EOS rate
            row.setdefault("rollout/eos_rate", 1 - row["rollout/truncated_fraction"])
        rows.append(row)
    return rows


def run_names(paths: list[Path]) -> list[str]:
    """A run is named after its folder; folders of the same name get their parent's name too."""
    names = [path.parent.name for path in paths]
    return [f"{path.parent.parent.name}/{name}" if names.count(name) > 1 else name for path, name in zip(paths, names)]


def doctor_marks(rows: list[dict]) -> list[tuple[int, str]]:
    """(iteration, signal) for each warning: the doctor writes "doctor/<signal>" on the row it fired."""
    return [(row["iteration"], key.removeprefix("doctor/")) for row in rows for key in row if key.startswith("doctor/")]


def doctor_summary(rows: list[dict]) -> str:
    """The warnings of one run by signal, e.g. "kl_high @ 12, 15  ·  clipfrac_high @ 15"; empty if none fired."""
    fired = {}
    for iteration, signal in doctor_marks(rows):
        fired.setdefault(signal, []).append(str(iteration))
    return "  ·  ".join(f"{signal} @ {', '.join(iterations)}" for signal, iterations in fired.items())


def pick_panels(runs: list[list[dict]]) -> list[tuple[str, list]]:
    """PANELS with the series no run logged left out, empty panels dropped, and one series per time/<phase>."""
    logged = {key for rows in runs for row in rows for key in row}
    phases = sorted(key for key in logged if key.startswith("time/") and key != "time/iteration")
    styles = itertools.cycle(PHASE_STYLES)
    time_series = [(key.removeprefix("time/"), [key], "o:" if key == "time/eval" else next(styles), False) for key in phases]
    if "time/iteration" in logged:
        time_series.append(("iteration", ["time/iteration"], "--", False))
    panels = [(title, [s for s in series if logged & set(s[1])]) for title, series in PANELS]
    return [(title, series) for title, series in panels + [("seconds per phase", time_series)] if series]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", nargs="+", type=Path, help="metrics.jsonl files (one run each, compared in every panel)")
    parser.add_argument("--out", type=Path, default=Path("curves.png"), help="image to write")
    args = parser.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        raise SystemExit("error: plot_metrics.py needs the matplotlib package: pip install matplotlib") from None

    for path in args.metrics:
        if not path.is_file():
            raise SystemExit(f"error: no metrics file {path}")
    names, runs = run_names(args.metrics), [read(path) for path in args.metrics]
    panels = pick_panels(runs)
    if not panels:
        raise SystemExit(f"error: none of {', '.join(map(str, args.metrics))} holds a metric this dashboard plots")
    ncols = min(len(panels), min((3, 4, 5), key=lambda c: -len(panels) % c))  # whichever leaves fewest empty cells
    nrows = -(-len(panels) // ncols)
    height = 3.1 * nrows + 0.6  # inches, with room for the run legend on top
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.3 * ncols, height), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)

    for ax, (title, series) in zip(axes.flat, panels):
        right = ax.twinx() if any(on_right for *_, on_right in series) else None
        for label, keys, style, on_right in series:
            for color, rows in enumerate(runs):  # colour = run, so a run keeps its colour in panels others lack
                key = next((k for k in keys if any(k in row for row in rows)), None)
                points = [(row["iteration"], row[key]) for row in rows if key in row]
                if points:
                    (right if on_right else ax).plot(*zip(*points), style, color=f"C{color}", markersize=3, lw=1.2)
        if right:
            right.set_ylabel(", ".join(label for label, *_, on_right in series if on_right), color="0.4")
            ax.set_ylabel(", ".join(label for label, *_, on_right in series if not on_right), color="0.4")
        if len(series) > 1:  # a key to the line styles, in grey because colour means run
            for label, _, style, _ in series:
                (right or ax).plot([], [], style, color="0.35", markersize=3, label=label)
            (right or ax).legend(fontsize=7, framealpha=0.8)
        for color, rows in enumerate(runs):
            for iteration, _ in doctor_marks(rows):
                ax.axvline(iteration, color=f"C{color}", lw=0.8, alpha=0.35)
                ax.plot(iteration, 0, "^", color=f"C{color}", markersize=7, clip_on=False, transform=ax.get_xaxis_transform())
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("iteration", fontsize=8)
        ax.grid(alpha=0.3)

    handles = [Line2D([], [], color=f"C{color}", lw=2) for color in range(len(runs))]
    fig.legend(handles, names, loc="upper center", ncol=len(names), frameon=False)
    warnings = [f"▲ doctor warnings, {name}:  {doctor_summary(rows)}" for name, rows in zip(names, runs) if doctor_summary(rows)]
    fig.text(0.01, 0.005, "\n".join(warnings), fontsize=8, va="bottom")
    fig.tight_layout(rect=(0, 0.17 * len(warnings) / height, 1, 1 - 0.35 / height))  # room for legend and warnings
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
