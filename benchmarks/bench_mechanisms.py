"""Which performance mechanisms of grpo_llm.py and ppo_llm.py earn their place: each switched off in turn.

A variant is the script with one mechanism switched off by a monkeypatch (applied after importing the module, before
its main() runs) or a flag. Each run is its own process. Per repetition of a (script, shape) the baseline runs before,
between and after the variants (B V1 B V2 ... Vn B), the variants' order rotated by one each repetition; each variant
run is compared with the mean of the two baseline runs beside it (paired ratios), since this machine's speed drifts
by 10-30% over half an hour. --rotate-only runs each configuration once per repetition instead.
Each run waits for a quiet machine, and is redone when other processes took more than QUIET of the CPUs during it.

Shapes:
  tiny:        bench_trl.py's: the demo model (15-token vocabulary) on the demo prompts
  real-vocab:  bench_trl.py's: a Qwen2-shaped policy with a 151,936-token vocabulary, random weights
  smollm2:     SmolLM2-135M-Instruct (demo/make_real_model.py --out DIR) on the arithmetic prompts, 3 iterations

Reported per variant:
  s/iter    median of metrics.jsonl's time/iteration over iterations >= 2, all repetitions (the first: warm-up)
  phases    the same median of each time/<phase>
  peak RSS  the process's resident-memory high-water mark (wait4's ru_maxrss), median over repetitions
  reward    the last iteration's training reward (PPO: score), median over repetitions
  ratios    variant / baseline, time and memory: of the medians above, and the median (and range) of the paired ones
Each run also reports probes (call counts of the patched functions, and how many of their calls a patch turned off):
they show whether a patch took effect.
The mechanisms that measured no win of 10% at either real shape were removed from the scripts, and their variants
from this file with them: benchmarks/README.md keeps their figures. Judge a variant by its time per iteration and by
its phases: on 2026-12-03 two mechanisms that each measured below 10% of the iteration went, and both came back
when PPO's update at the real-vocab shape measured 1.5x as long without them (benchmarks/README.md).

Run (a quiet machine):
  python3 demo/make_real_model.py --out /tmp/smollm2
  python3 benchmarks/bench_mechanisms.py --smollm2 /tmp/smollm2 --json mechanisms.json
  python3 benchmarks/bench_mechanisms.py --shapes tiny --scripts grpo --variants "share prompts off"
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
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trl import DEMO, ROOT, SIZES, build_models, ours_command  # noqa: E402

SHAPES = ("real-vocab", "smollm2", "tiny")
REPEATS = {"real-vocab": 3, "smollm2": 2, "tiny": 5}
QUIET = 0.1  # the share of the CPUs that other processes may use during a run; a run past it is redone
ATTEMPTS = 4
BOTH = ("grpo", "ppo")


class Variant(NamedTuple):
    name: str
    scripts: tuple  # the scripts it applies to
    shapes: tuple  # the shapes it is measured at
    patch: str = ""  # Python run after `import <script>_llm as m`, before m.main()
    flags: tuple = ()  # added to the command line


UNFUSED_ADAMW = """
class _UnfusedAdamW(torch.optim.AdamW):
    def __init__(self, *a, **k):
        super().__init__(*a, **dict(k, fused=False))
torch.optim.AdamW = _UnfusedAdamW"""

VARIANTS = [
    Variant("baseline", BOTH, SHAPES),
    Variant("kept log-softmax off", BOTH, ("real-vocab",), "m.KEPT_LOGPROBS_ELEMENTS = 0"),
    Variant("fused AdamW off", BOTH, ("real-vocab",), UNFUSED_ADAMW),
    Variant("share prompts off", ("grpo",), SHAPES, flags=("--no-share-prompts",)),
    Variant("prompt_cache off", ("grpo",), ("real-vocab", "smollm2"), "m.prompt_cache = lambda *a, **k: None"),
    Variant("chunked log-probs off", BOTH, ("real-vocab",), "m.output_head = lambda model: None"),
    Variant("inverse-CDF sampler off", BOTH, ("real-vocab",),
            "m.sample_from = lambda probs: torch.multinomial(probs, 1).squeeze(1)"),
]

# Run in every child after the patch: counts calls (and None/False results) of the functions the patches replace,
# written when main() returns.
PROBE = """
import functools, json
_probe = dict(calls={}, off={})
def _counted(name, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        out = fn(*a, **k)
        _probe["calls"][name] = _probe["calls"].get(name, 0) + 1
        _probe["off"][name] = _probe["off"].get(name, 0) + (out is None or out is False)
        return out
    return wrapper
for _name in ("prompt_cache", "output_head", "sample_from"):
    if hasattr(m, _name):
        setattr(m, _name, _counted(_name, getattr(m, _name)))
def _dump():
    with open(PROBE_PATH, "w") as f:
        json.dump(_probe, f)
"""


def child_code(script: str, patch: str, argv: list[str], probe_path: Path) -> str:
    return "\n".join([
        f"import sys; sys.path.insert(0, {str(ROOT)!r})",
        f"import torch, {script}_llm as m",
        patch,
        f"PROBE_PATH = {str(probe_path)!r}",
        PROBE,
        f"sys.argv = {[f'{script}_llm.py', *argv]!r}",
        "try:",
        "    m.main()",
        "finally:",
        "    _dump()",
    ])


def smollm2_flags(script: str, model: str) -> list[str]:
    common = ["--model-name-or-path", model, "--chat-template", "--reward-fn", "last_number",
              "--prompts-path", str(DEMO / "real" / "train.jsonl"),
              "--temperature", "0.7", "--num-iterations", "3", "--eval-every", "0", "--save-every", "0",
              "--doctor", "off", "--overwrite"]
    if script == "grpo":
        return common + ["--num-prompts", "8", "--num-generations", "4", "--learning-rate", "3e-5"]
    return common + ["--num-prompts", "16", "--num-epochs", "1", "--num-minibatches", "2", "--micro-batch-size", "4",
                     "--learning-rate", "1e-5", "--critic-learning-rate", "1e-4", "--gae-lambda", "1.0"]


def base_flags(script: str, shape: str, models: dict, smollm2: str) -> list[str]:
    """The command line without --output-dir: bench_trl's for tiny and real-vocab."""
    if shape == "smollm2":
        return smollm2_flags(script, smollm2)
    command = ours_command(script, shape, SIZES[script, shape], models, Path("/unused"))
    i = command.index("--output-dir")
    return command[2:i] + command[i + 2:]


def busy_seconds() -> float:
    """CPU seconds used by every process since boot: /proc/stat's first line less its idle and iowait columns."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(limit: float = 1800.0) -> None:
    """Until the machine, while this runner idles, is under QUIET busy over 5 s (at most `limit` seconds)."""
    deadline = time.time() + limit
    while True:
        before = busy_seconds()
        time.sleep(5)
        if (busy_seconds() - before) / (5 * os.cpu_count()) < QUIET or time.time() > deadline:
            return


def run_when_quiet(script: str, variant: Variant, flags: list[str], work: Path) -> dict:
    """run(), after waiting for a quiet machine, and again (up to ATTEMPTS in all) while other processes used more
    than QUIET of the CPUs during it."""
    for attempt in range(ATTEMPTS):
        wait_for_quiet()
        subprocess.run(["rm", "-rf", str(work)], check=True)
        work.mkdir()
        r = run(script, variant, flags, work)
        r["attempt"] = attempt + 1
        if r["others_cpu"] < QUIET:
            break
        print(f"    others used {r['others_cpu']:.0%} of the CPUs: again", flush=True)
    return r


def run(script: str, variant: Variant, flags: list[str], work: Path) -> dict:
    """One run in its own process: its metrics rows, probes, peak RSS, and the share of the CPUs that other processes
    used meanwhile."""
    out, probe_path, log_path = work / "out", work / "probe.json", work / "log.txt"
    argv = [*flags, *variant.flags, "--output-dir", str(out)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)
    start, busy = time.time(), busy_seconds()
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-c", child_code(script, variant.patch, argv, probe_path)],
                                   stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"{script} {variant.name} failed:\n" + "".join(log_path.read_text().splitlines(True)[-30:]))
    wall = time.time() - start
    others = busy_seconds() - busy - usage.ru_utime - usage.ru_stime
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return dict(rows=rows, probe=json.loads(probe_path.read_text()), peak_rss_mib=usage.ru_maxrss / 1024, wall=wall,
                others_cpu=others / (wall * os.cpu_count()))


def run_median(r: dict) -> float:
    return statistics.median(row["time/iteration"] for row in r["rows"] if row["iteration"] >= 2)


def summarise(script: str, runs: list[dict]) -> dict:
    timed = [row for r in runs for row in r["rows"] if row["iteration"] >= 2]
    keys = sorted({key for row in timed for key in row if key.startswith("time/")})
    reward = "objective/reward" if script == "grpo" else "objective/scores"
    paired = [r["paired"] for r in runs if "paired" in r]
    return dict(
        s_per_iter=statistics.median(row["time/iteration"] for row in timed),
        s_per_iter_per_run=[run_median(r) for r in runs],
        phases={key[5:]: statistics.median(row.get(key, 0.0) for row in timed) for key in keys},
        peak_rss_mib=statistics.median(r["peak_rss_mib"] for r in runs),
        peak_rss_per_run=[r["peak_rss_mib"] for r in runs],
        paired_time=[time_ratio for time_ratio, _ in paired],
        paired_rss=[rss_ratio for _, rss_ratio in paired],
        reward=statistics.median(r["rows"][-1][reward] for r in runs),
        probes=[r["probe"] for r in runs],
    )


def pair_with_neighbours(sequence: list[tuple[str, dict]]) -> None:
    """Each variant run's time and memory over the mean of the baseline runs just before and after it."""
    for i, (name, r) in enumerate(sequence):
        neighbours = [b for k in (i - 1, i + 1) if 0 <= k < len(sequence) and sequence[k][0] == "baseline"
                      for b in [sequence[k][1]]]
        if name != "baseline" and neighbours:
            r["paired"] = (run_median(r) / statistics.fmean(run_median(b) for b in neighbours),
                           r["peak_rss_mib"] / statistics.fmean(b["peak_rss_mib"] for b in neighbours))


def probe_text(p: dict) -> str:
    calls = ", ".join(f"{name} {n}" + (f" ({p['off'][name]} off)" if p["off"][name] else "")
                      for name, n in sorted(p["calls"].items()))
    return calls or "no patched function called"


def table(script: str, shape: str, result: dict) -> str:
    base = result["baseline"]
    phases = [key for key in ("generate", "score", "old_logprobs", "reference", "values", "rollout", "update")
              if any(key in r["phases"] for r in result.values())]
    lines = [f"\n{script} {shape}",
             f"{'variant':<24} {'s/iter':>7} {'ratio':>6} {'paired':>6} {'paired range':>12} {'run range':>11} "
             + " ".join(f"{p[:8]:>8}" for p in phases)
             + f" {'RSS MiB':>8} {'ratio':>6} {'paired':>6} {'paired range':>12} {'reward':>7}"]

    def paired(ratios):  # median and range of the paired ratios
        return (f"{statistics.median(ratios):>6.2f} {f'{min(ratios):.2f}-{max(ratios):.2f}':>12}" if ratios
                else f"{'':>6} {'':>12}")

    for name, r in result.items():
        spread = f"{min(r['s_per_iter_per_run']):.2f}-{max(r['s_per_iter_per_run']):.2f}"
        lines.append(f"{name:<24} {r['s_per_iter']:>7.3f} {r['s_per_iter'] / base['s_per_iter']:>6.2f} "
                     f"{paired(r['paired_time'])} {spread:>11} "
                     + " ".join(f"{r['phases'].get(p, 0.0):>8.3f}" for p in phases)
                     + f" {r['peak_rss_mib']:>8.0f} {r['peak_rss_mib'] / base['peak_rss_mib']:>6.2f} "
                     f"{paired(r['paired_rss'])} {r['reward']:>7.3f}")
    lines.append("probes (first run of each):")
    lines += [f"  {name:<24} {probe_text(r['probes'][0])}" for name, r in result.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scripts", nargs="+", default=list(BOTH), choices=BOTH)
    parser.add_argument("--shapes", nargs="+", default=["real-vocab", "smollm2"], choices=SHAPES)
    parser.add_argument("--variants", nargs="+", help="names from VARIANTS (default: all; the baseline always runs)")
    parser.add_argument("--repeats", type=int, help="default: 3 at real-vocab, 2 at smollm2, 5 at tiny")
    parser.add_argument("--smollm2", default="/tmp/smollm2", help="demo/make_real_model.py's --out")
    parser.add_argument("--json", default="mechanisms.json", help="the raw numbers, written after each (script, shape)")
    parser.add_argument("--rotate-only", action="store_true",
                        help="run each configuration once per repetition, the baseline no more often than the variants")
    a = parser.parse_args()
    results = {}
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPU cores, {sys.executable}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for shape in a.shapes:
            models = build_models(shape, Path(tmp) / shape) if shape != "smollm2" else {}
            for script in a.scripts:
                variants = [v for v in VARIANTS if script in v.scripts and shape in v.shapes
                            and (v.name == "baseline" or not a.variants or v.name in a.variants)]
                flags = base_flags(script, shape, models, a.smollm2)
                runs = {v.name: [] for v in variants}
                baseline, others = variants[0], variants[1:]
                for repeat in range(a.repeats or REPEATS[shape]):
                    k = repeat % len(variants)
                    if a.rotate_only:  # every configuration once, the baseline among them
                        order = variants[k:] + variants[:k]
                    else:  # the baseline before, between and after the variants: B V1 B V2 ... Vn B
                        k = repeat % max(1, len(others))
                        order = [baseline] + [x for v in others[k:] + others[:k] for x in (v, baseline)]
                    sequence = []
                    for v in order:
                        r = run_when_quiet(script, v, flags, Path(tmp) / "run")
                        runs[v.name].append(r)
                        sequence.append((v.name, r))
                        s = [row["time/iteration"] for row in r["rows"]]
                        print(f"  {script} {shape} rep {repeat + 1} {v.name:<24} "
                              f"s/iter {' '.join(f'{x:.2f}' for x in s)} | RSS {r['peak_rss_mib']:.0f} MiB "
                              f"| wall {r['wall']:.0f}s | others {r['others_cpu']:.0%}\n    {probe_text(r['probe'])}",
                              flush=True)
                    pair_with_neighbours(sequence)
                result = {name: summarise(script, r) for name, r in runs.items()}
                kept = ("rows", "peak_rss_mib", "others_cpu", "attempt", "paired")
                raw = {name: [{k: x[k] for k in kept if k in x} for x in r] for name, r in runs.items()}
                results[f"{script} {shape}"] = dict(result, raw=raw)
                print(table(script, shape, result), flush=True)
                Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
