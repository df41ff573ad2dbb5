"""Ours against TRL, side by side: time per iteration, peak memory, start-up and reward at equal sizes.

  grpo: grpo_llm.py against TRL's GRPOTrainer (requirements-trl.txt: the current release)
  ppo:  ppo_llm.py against TRL's PPOTrainer (requirements-trl-ppo.txt: 1.0.x, trl.experimental.ppo; later
        releases dropped it)

Two shapes, models built from a config and saved to a temporary directory (random weights but the demo's):
  tiny:        the demo model (Llama, hidden 64, 4 layers, 15-token vocabulary) on the demo prompts: overhead-bound.
  real-vocab:  a Qwen2-shaped model with 151,936 output logits (hidden 256, 2 layers), 64 new tokens: logits-bound.

Both sides get the same prompts, sizes (prompts per iteration, generations per prompt, max new tokens, epochs,
minibatches, micro-batch, KL coefficient, learning rate), reward (bench_rewards.py, or the same saved reward model),
fp32 on CPU, no eval, no checkpoints, the trained policy saved at the end into an empty output directory (the
benchmark removes the previous run's, untimed: ours' --overwrite would delete it at start-up, 1.2 s for the
real-vocab shape's 160 MB policy on our disk, where TRL writes over its files at the end). Each run is its own
process; ours and TRL's alternate, the first side swapping each repetition. The benchmark timestamps each console
line `iter N | ...` as it arrives, so both are timed the same way:
  s/iter    median gap between consecutive iteration lines, over every repetition (load and start-up excluded)
  peak RSS  the process's resident-memory high-water mark (wait4's ru_maxrss), in MiB, median over repetitions
  start-up  launch until the training loop begins: ours' output: line, printed just before its first iteration,
            or TRL's `on_train_begin` (trl_runner.py prints `training begins`); median over repetitions. Each timed
            run follows an untimed warm-up of its side (see warm_up): this machine pages out files that no one has
            read for a minute, and a start-up that read torch back from its slow disk took up to a minute
  start CPU the CPU seconds (user + system, all threads) the process had used by then, which waiting on the disk
            does not add to; median over repetitions
  1st iter  how much longer the first iteration took than that run's median one (lazy initialisation on its
            first forward and backward), median over repetitions
  reward    mean training reward (PPO: reward-model score) of the last 5 iterations, median over repetitions

Setup: each side in a fresh environment of what its own install brings (ours: requirements.txt; TRL's: the same
and the TRL release, with its dependencies), so the same torch and transformers on both. Not the machine's
environment: transformers imports scipy, accelerate or boto3 whenever they are installed, which on our machine added
55-60 MB to each side's peak.
  python -m venv .venv-bench && .venv-bench/bin/pip install -r requirements.txt
  python -m venv .venv-trl && .venv-trl/bin/pip install -r requirements.txt -r benchmarks/requirements-trl.txt
  python -m venv .venv-trl-ppo && .venv-trl-ppo/bin/pip install -r requirements.txt -r benchmarks/requirements-trl-ppo.txt
Run (20 to 45 minutes on 2 CPU cores, by the CPU; a quiet machine, since other load moves these figures 10x):
  .venv-bench/bin/python benchmarks/bench_trl.py
  .venv-bench/bin/python benchmarks/bench_trl.py --algorithms grpo --shapes tiny --repeats 5
  .venv-bench/bin/python benchmarks/bench_trl.py --previous ../checkout-at-an-older-commit
With --previous, a third side ("prev") runs the scripts of another checkout of this repository in the same
alternation, so that what a change did to the ratios is measured on one machine in one run; its line's ratios
are prev / TRL. Where our script has --chunked-logprobs, one more side ("chunk") runs it with that knob on: its
line's ratios are chunk / TRL, and "ours" is the default path; where it also has --share-prompts, another ("share")
runs it with both knobs on.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demo"
ITERATION_LINE = re.compile(r"^iter\s+(\d+) \| (?:reward|score) (-?[\d.]+)")
TRAINING_BEGINS = re.compile(r"^(output:|training begins)")  # ours' last line before training; trl_runner.py's
# on_train_begin

# Sizes per (algorithm, shape). GRPO: ours' defaults (one epoch, one minibatch: on-policy). PPO: ours' defaults
# (4 epochs of 2 minibatches), a micro-batch of one minibatch (see trl_runner.py's ppo). The real-vocab shape uses
# fewer sequences, since every one runs all 64 tokens. The tiny shape's runs take seconds, and the machine's speed
# drifts by 10-30% from one to the next: they are repeated more (REPEATS), for more alternations in each median.
SIZES = {
    ("grpo", "tiny"): dict(num_prompts=16, num_generations=8, max_new_tokens=16, num_epochs=1, num_minibatches=1,
                           micro_batch_size=128, kl_coef=0.04, learning_rate=5e-4, num_iterations=20),
    ("grpo", "real-vocab"): dict(num_prompts=8, num_generations=4, max_new_tokens=64, num_epochs=1, num_minibatches=1,
                                 micro_batch_size=32, kl_coef=0.04, learning_rate=5e-4, num_iterations=6),
    ("ppo", "tiny"): dict(num_prompts=64, num_generations=1, max_new_tokens=16, num_epochs=4, num_minibatches=2,
                          micro_batch_size=32, kl_coef=0.05, learning_rate=3e-4, num_iterations=12),
    ("ppo", "real-vocab"): dict(num_prompts=16, num_generations=1, max_new_tokens=64, num_epochs=2, num_minibatches=2,
                                micro_batch_size=8, kl_coef=0.05, learning_rate=5e-4, num_iterations=5),
}
REWARD = {"tiny": "exact_match", "real-vocab": "even_tokens"}  # GRPO's reward function; PPO scores with a reward model
REPEATS = {"tiny": 5, "real-vocab": 3}  # --repeats' default per shape (see SIZES)


def build_models(shape: str, out: Path) -> dict:
    """The policy and a reward model (a sequence-classification model with a seeded head, saved, so both sides load
    the very same weights; it is also the critic's initialisation)."""
    import torch
    import transformers
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    transformers.logging.set_verbosity_error()  # the fresh score head's load report
    transformers.logging.disable_progress_bar()
    torch.manual_seed(0)
    if shape == "tiny":
        policy = DEMO / "model"
    else:
        policy = out / "policy"
        real_vocab_model(policy)
    reward_model = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1)
    reward_model.config.pad_token_id = 0
    reward_model.save_pretrained(out / "reward")
    AutoTokenizer.from_pretrained(policy).save_pretrained(out / "reward")
    return dict(model=str(policy), reward_model=str(out / "reward"))


def real_vocab_model(path: Path) -> None:
    """A Qwen2-shaped causal LM with Qwen2.5's 151,936-token vocabulary (tied head), random weights, and a tokenizer of
    that size: the demo's characters, then filler tokens <n> that only sampling produces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab_size = 151_936
    chars = ["<pad>", "<eos>", *"0123456789", "+", "=", " "]
    vocab = {token: i for i, token in enumerate(chars + [f"<{n}>" for n in range(len(chars), vocab_size)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left")
    tokenizer.save_pretrained(path)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    Qwen2ForCausalLM(config).save_pretrained(path)


def ours_command(algorithm: str, shape: str, sizes: dict, models: dict, out: Path, root: Path = ROOT) -> list[str]:
    s = sizes
    command = [sys.executable, str(root / f"{algorithm}_llm.py"), "--model-name-or-path", models["model"],
               "--prompts-path", str(DEMO / "train.jsonl"), "--output-dir", str(out), "--overwrite",
               "--num-iterations", str(s["num_iterations"]), "--num-prompts", str(s["num_prompts"]),
               "--max-new-tokens", str(s["max_new_tokens"]), "--num-epochs", str(s["num_epochs"]),
               "--num-minibatches", str(s["num_minibatches"]), "--micro-batch-size", str(s["micro_batch_size"]),
               "--kl-coef", str(s["kl_coef"]), "--learning-rate", str(s["learning_rate"]),
               "--eval-every", "0", "--save-every", "0", "--doctor", "off"]
    if algorithm == "grpo":
        command += ["--num-generations", str(s["num_generations"]),
                    "--reward-fn", f"{ROOT / 'benchmarks' / 'bench_rewards.py'}:{REWARD[shape]}"]
    else:  # TRL's PPO: critic from the reward model, one optimizer and learning rate for policy and critic
        command += ["--reward-model-path", models["reward_model"], "--critic-init", "reward",
                    "--critic-learning-rate", str(s["learning_rate"])]
    return command


def trl_command(python: str, algorithm: str, shape: str, sizes: dict, models: dict, out: Path) -> list[str]:
    config = dict(sizes, algorithm=algorithm, model=models["model"], reward_model=models["reward_model"],
                  prompts=str(DEMO / "train.jsonl"), reward=REWARD[shape], output_dir=str(out), seed=1)
    return [python, str(ROOT / "benchmarks" / "trl_runner.py"), json.dumps(config)]


def warm_up(python: str, imports: str, model: str) -> None:
    """Untimed, just before a timed run: the side's imports and one load of the policy (which imports the model's
    classes), so that its start-up reads its libraries from the page cache, as a second launch on most machines does."""
    code = f"{imports}; from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained({model!r})"
    subprocess.run([python, "-c", code], cwd=ROOT / "benchmarks", check=True, capture_output=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a running process, all its threads (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(command: list[str]) -> dict:
    """Launch, timestamp each iteration line as it arrives, and read the process's peak RSS when it exits."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    arrivals, rewards, tail, begins, begins_cpu = [], [], [], None, None
    for line in process.stdout:
        tail = (tail + [line])[-20:]
        if begins is None and TRAINING_BEGINS.match(line):
            begins, begins_cpu = time.perf_counter() - start, cpu_seconds(process.pid)
        if match := ITERATION_LINE.match(line):
            arrivals.append(time.perf_counter() - start)
            rewards.append(float(match.group(2)))
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode or len(arrivals) < 2 or begins is None:
        sys.exit(f"{' '.join(command[:2])} failed (exit {process.returncode}):\n{''.join(tail)}")
    return dict(begins=begins, begins_cpu=begins_cpu, arrivals=arrivals, rewards=rewards, peak_rss=usage.ru_maxrss * 1024)


def gaps(run: dict) -> list[float]:
    return [b - a for a, b in zip(run["arrivals"], run["arrivals"][1:])]


def summarise(runs: list[dict]) -> dict:
    return dict(
        per_iteration=statistics.median(gap for r in runs for gap in gaps(r)),
        peak_rss=statistics.median(r["peak_rss"] for r in runs),
        startup=statistics.median(r["begins"] for r in runs),
        startup_cpu=statistics.median(r["begins_cpu"] for r in runs),
        # less the run's own median iteration: the machine's speed drifts between runs by 10-35%
        first_extra=statistics.median(r["arrivals"][0] - r["begins"] - statistics.median(gaps(r)) for r in runs),
        reward=statistics.median(statistics.fmean(r["rewards"][-5:]) for r in runs),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=["grpo", "ppo"], choices=["grpo", "ppo"])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "real-vocab"], choices=["tiny", "real-vocab"])
    parser.add_argument("--repeats", type=int, help="runs of each side per pair (default: 5 at tiny, 3 at real-vocab)")
    parser.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"),
                        help="python of the environment with requirements-trl.txt (GRPOTrainer)")
    parser.add_argument("--trl-ppo-python", default=str(ROOT / ".venv-trl-ppo" / "bin" / "python"),
                        help="python of the environment with requirements-trl-ppo.txt (PPOTrainer)")
    parser.add_argument("--previous", type=Path, help="another checkout of this repository, run as a third side")
    a = parser.parse_args()
    repeats = {shape: a.repeats or REPEATS[shape] for shape in a.shapes}
    print(f"# {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, fp32, alternating, repetitions: "
          + ", ".join(f"{n} at {shape}" for shape, n in repeats.items()))
    print(f"# ours: {sys.executable}; TRL: " + ", ".join(
        python for algorithm, python in (("grpo", a.trl_python), ("ppo", a.trl_ppo_python)) if algorithm in a.algorithms))
    print(f"{'algorithm':<9} {'shape':<10} {'side':<5} {'s/iter':>7} {'peak RSS':>9} {'start-up':>9} {'start CPU':>9} "
          f"{'1st iter':>9} {'reward':>7}   ours/TRL: time  memory  start-up  start CPU")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in a.shapes:
            models = build_models(shape, Path(tmp) / shape)
            for algorithm in a.algorithms:
                sizes = SIZES[algorithm, shape]
                python = a.trl_python if algorithm == "grpo" else a.trl_ppo_python
                roots = {"ours": ROOT, **({"prev": a.previous.resolve()} if a.previous else {})}
                knobs = {"chunk": ["--chunked-logprobs"], "share": ["--chunked-logprobs", "--share-prompts"]}
                script = (ROOT / f"{algorithm}_llm.py").read_text()
                roots.update({side: ROOT for side, flags in knobs.items() if all(f in script for f in flags)})
                sides = ["ours", "TRL", *sorted(roots.keys() - {"ours"})]
                outputs = {side: Path(tmp) / side for side in sides}
                commands = {side: ours_command(algorithm, shape, sizes, models, outputs[side], root)
                            + knobs.get(side, []) for side, root in roots.items()}
                commands["TRL"] = trl_command(python, algorithm, shape, sizes, models, outputs["TRL"])
                warm = {side: (sys.executable, f"import sys; sys.path.insert(0, {str(root)!r}); import {algorithm}_llm")
                        for side, root in roots.items()}
                warm["TRL"] = (python, "import trl_runner; " + ("from trl import GRPOTrainer" if algorithm == "grpo"
                                                               else "from trl.experimental.ppo import PPOTrainer"))
                runs = {side: [] for side in sides}
                for repeat in range(repeats[shape]):
                    for side in sides[repeat % len(sides):] + sides[:repeat % len(sides)]:
                        shutil.rmtree(outputs[side], ignore_errors=True)  # see the docstring: "an empty output directory"
                        warm_up(*warm[side], models["model"])
                        runs[side].append(run(commands[side]))
                result = {side: summarise(r) for side, r in runs.items()}
                for side in ("ours", "TRL", "chunk", "share", "prev"):
                    if side not in result:
                        continue
                    r = result[side]
                    line = (f"{algorithm:<9} {shape:<10} {side:<5} {r['per_iteration']:>7.3f} "
                            f"{r['peak_rss'] / 2**20:>7.0f}MB {r['startup']:>8.1f}s {r['startup_cpu']:>8.1f}s "
                            f"{r['first_extra']:>+8.1f}s {r['reward']:>7.3f}")
                    if side != "ours":  # TRL's line: ours / TRL; the others': theirs / TRL
                        o, t = (result["ours"], r) if side == "TRL" else (r, result["TRL"])
                        line += (f"             {o['per_iteration'] / t['per_iteration']:.2f}x   "
                                 f"{o['peak_rss'] / t['peak_rss']:.2f}x   {o['startup'] / t['startup']:.2f}x     "
                                 f"{o['startup_cpu'] / t['startup_cpu']:.2f}x")
                    print(line, flush=True)


if __name__ == "__main__":
    main()
