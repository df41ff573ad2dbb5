"""Plot training curves from one or more metrics.jsonl files (needs matplotlib).

    python plot_metrics.py runs/ppo/metrics.jsonl runs/grpo/metrics.jsonl --out curves.png
"""

import argparse
import json
from pathlib import Path

PANELS = [  # (title, metric keys tried in order: PPO's name, then GRPO's)
    ("eval/reward (greedy)", ["eval/reward"]),
    ("training reward", ["objective/scores", "objective/reward"]),
    ("KL to reference (per sequence)", ["objective/kl"]),
    ("policy entropy", ["policy/entropy"]),
    ("clip fraction", ["policy/clipfrac"]),
    ("critic explained variance", ["val/explained_variance"]),
]


def read(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", nargs="+", type=Path, help="metrics.jsonl files (one curve each)")
    parser.add_argument("--out", type=Path, default=Path("curves.png"), help="image to write")
    args = parser.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: plot_metrics.py needs the matplotlib package: pip install matplotlib") from None

    runs = {path.parent.name: read(path) for path in args.metrics}
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for color, (name, rows) in enumerate(runs.items()):  # a run keeps its colour in panels other runs lack
            key = next((k for k in keys if any(k in row for row in rows)), None)
            if key is None:
                continue
            points = [(row["iteration"], row[key]) for row in rows if key in row]
            ax.plot(*zip(*points), marker="o" if key == "eval/reward" else None, markersize=3, label=name, color=f"C{color}")
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
