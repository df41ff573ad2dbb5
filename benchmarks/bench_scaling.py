"""Where ours' time goes, and how it grows: time per iteration and per phase as max new tokens doubles and as prompts
per iteration double, at bench_trl.py's real-vocab shape (a Qwen2-shaped model with 151,936 output logits, random
weights, so no response stops early and every one runs all its tokens).

Each row is one run of grpo_llm.py or ppo_llm.py (fp32, no eval, no checkpoints); its figures are medians over its
iterations after the first, read from metrics.jsonl (time/iteration and the per-phase time/generate, time/reference,
time/old_logprobs, time/values, time/update). Run:
    python benchmarks/bench_scaling.py                    # both algorithms, about 10 minutes on 2 CPU cores
    python benchmarks/bench_scaling.py --algorithms grpo
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trl import SIZES, build_models, ours_command

PHASES = ["rollout", "generate", "reference", "old_logprobs", "values", "update"]  # ppo_llm.py: rollout and update


def measure(algorithm: str, sizes: dict, models: dict, out: Path) -> dict:
    command = ours_command(algorithm, "real-vocab", sizes, models, out)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]  # the first warms up
    for row in rows:  # ppo_llm.py times its rollout (generation and the forward passes) and its update alone
        row.setdefault("time/iteration", row["time/rollout"] + row["time/update"])
    return {key: statistics.median(row.get(f"time/{key}", 0.0) for row in rows) for key in ["iteration", *PHASES]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=["grpo", "ppo"], choices=["grpo", "ppo"])
    parser.add_argument("--iterations", type=int, default=4)
    a = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, fp32, real-vocab shape, seconds (median of "
          f"iterations 2..{a.iterations})")
    print(f"{'algorithm':<9} {'prompts':>7} {'new tokens':>10} {'s/iter':>7} " + " ".join(f"{p:>12}" for p in PHASES))
    with tempfile.TemporaryDirectory() as tmp:
        models = build_models("real-vocab", Path(tmp))
        for algorithm in a.algorithms:
            base = dict(SIZES[algorithm, "real-vocab"], num_iterations=a.iterations)
            prompts, tokens = base["num_prompts"], base["max_new_tokens"]
            for num_prompts, max_new_tokens in [(prompts, tokens // 2), (prompts, tokens), (prompts, tokens * 2),
                                                (prompts * 2, tokens), (prompts * 4, tokens)]:
                sizes = dict(base, num_prompts=num_prompts, max_new_tokens=max_new_tokens)
                sizes["micro_batch_size"] = min(sizes["micro_batch_size"], num_prompts * sizes["num_generations"]
                                                // sizes["num_minibatches"])
                t = measure(algorithm, sizes, models, Path(tmp) / "ours")
                print(f"{algorithm:<9} {num_prompts:>7} {max_new_tokens:>10} {t['iteration']:>7.2f} "
                      + " ".join(f"{t[p]:>12.2f}" for p in PHASES), flush=True)


if __name__ == "__main__":
    main()
