"""The GPU check, in one command: grpo_llm.py (its default preset and --preset dapo) and ppo_llm.py as users
launch them, with --dtype bfloat16, at a Qwen2.5-0.5B shape on CUDA, side by side with TRL 1.16's GRPOTrainer at the
GRPO shape; with --device cpu --tiny, the same runs and checks at a tiny shape (test_gpu_check.py, in CI).

  python benchmarks/gpu_check.py --device cuda        # the real shape, within --time-limit (480 s)
  python benchmarks/gpu_check.py --device cpu --tiny  # the tiny shape, CI's (test_gpu_check.py)
  benchmarks/gpu_check.sh download-wheels             # where pip works: what the GPU machine lacks, into .whl/
  benchmarks/gpu_check.sh                             # on the GPU machine: install .whl/, then the first line

Models, built from a config with random weights (nothing downloaded) into a temporary directory:
  policy     Qwen2.5-0.5B's shape: 24 layers, hidden 896, 14 heads (2 KV), MLP 4864, a 151,936-token vocabulary, a
             tied head. Random weights rarely sample EOS, so responses run to full length, as a throughput figure needs
  reward     a Qwen2ForSequenceClassification of that shape with one label, PPO's reward model (its critic is the
             policy with a fresh value head, ppo_llm.py's default)
  tokenizer  one token per character of "0123456789+= ", then filler tokens <n> up to the vocabulary's size
  prompts    random strings of those characters, SHAPES' prompt_tokens (96) tokens each
--tiny: the same with 2 layers, hidden 32 and a 1,024-token vocabulary (TINY), and smaller runs (SHAPES).

Runs, each its own process through peak_memory.py (which records its peak memory), in this order:
  ours-grpo  grpo_llm.py, 32 prompts x 8 generations x 256 new tokens, reward bench_rewards.py:even_tokens
  trl-grpo   TRL's GRPOTrainer (gpu_check_trl.py) with ours-grpo's model, prompts, reward, batch and micro-batch;
             skipped, with "trl": "not installed", where `import trl` fails
  ours-dapo  grpo_llm.py --preset dapo at ours-grpo's shape
  ours-ppo   ppo_llm.py, 64 prompts x 256 new tokens, the reward model and the critic
A run still going at --time-limit is stopped, and the runs after it are not started: each fails its exit check.
Each prints one JSON line, medians over the iterations after the first (a warm-up): seconds per iteration; per phase
(generate, update) seconds, tokens/s and MFU; the whole iteration's MFU; peak memory; the checks. Then a last line:
ours-grpo / trl-grpo in time and peak memory, and every check. It exits with 1 if a check failed, with an error line
per failure and the failed run's last console lines.

MFU = model FLOPs / seconds / the device's dense bf16 peak (BF16_PEAK; none on a CPU). With P a model's parameters
that multiply (the policy's, its tied embedding counted once, as the head; a scorer's without its embedding table,
which is only looked up) and T the tokens it runs through, each prompt's once per group and each response's once
(TRL, which runs a prompt once per response, is credited alike, so that MFUs compare as the times do):
  generate   2 P T over every sampled response (DAPO's resampled ones too); attention's own FLOPs left out
  update     6 P T per epoch (forward and backward); PPO's critic adds its own 6 P T
  iteration  both, plus 2 P T per other forward pass of the rollout: GRPO's, those its time/* keys name (pi_old,
             the reference); PPO's pi_old, reference, critic values and reward model; TRL's GRPO the reference
Tokens/s: generate, sampled response tokens over its seconds; update, response tokens trained on (each epoch's) over
its seconds. ppo_llm.py times its rollout as a whole (generation and the forward passes): its line has rollout in
generate's place, and its iteration is its rollout and update.

Checks, each iteration's metrics.jsonl row:
  kl0     the first iteration's KL to the reference is 0 (the policy starts as it): objective/kl per response token
          (TRL: its kl) within KL0_TOLERANCE; not DAPO's, whose --kl-coef 0 has no reference
  finite  every losses/* value of every iteration is finite (the scripts also stop at a non-finite loss)
  ratio1  ours-grpo's mean policy/ratio is 1 within RATIO_TOLERANCE: one epoch of one minibatch is on-policy. Not
          PPO's (its later minibatches are off-policy) nor DAPO's (16 minibatches)
  exit    the run exited with 0 within --time-limit
and a run without a training iteration's row, or without a key the figures need, fails too.
"""

import argparse
import importlib.util
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"

# The wheels the GPU machine's image lacks: tyro and its needs, TRL, and transformers at requirements.txt's tested
# version (the image has 5.17). `gpu_check.sh download-wheels` downloads them into .whl/; gpu_check.sh installs them.
WHEELS = ["tyro==1.0.17", "docstring-parser==0.18.0", "typeguard==4.6.1", "typing-extensions==4.16.0",
          "trl==1.16.0", "transformers==5.24.0"]
# TRL's datasets and what it needs beyond the image, into .whl/datasets/: installed only where `import datasets` fails.
DATASETS_WHEELS = ["datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19"]

# Dense bf16 tensor-core peak in FLOP/s (the datasheet's, without sparsity), by a substring of
# torch.cuda.get_device_name(). --peak-tflops for another device.
BF16_PEAK = {"H200": 989e12, "H100 80GB HBM3": 989e12}

QWEN2_5_0_5B = dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                    rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rope_theta=1e6, rms_norm_eps=1e-6,
            tie_word_embeddings=True)
# Per shape: the model, the prompts' length, iterations per run (the first a warm-up) and each run's sizes and flags.
# The tiny DAPO run takes 2 minibatches, since the preset's 16 do not divide its 8 responses.
SHAPES = {
    "real": dict(model=QWEN2_5_0_5B, prompt_tokens=96, num_prompts_in_file=512, num_iterations=3,
                 grpo=dict(num_prompts=32, num_generations=8, max_new_tokens=256, micro_batch_size=64),
                 ppo=dict(num_prompts=64, num_generations=1, max_new_tokens=256), dapo_flags=[]),
    "tiny": dict(model=TINY, prompt_tokens=16, num_prompts_in_file=64, num_iterations=2,
                 grpo=dict(num_prompts=4, num_generations=2, max_new_tokens=8, micro_batch_size=64),
                 ppo=dict(num_prompts=4, num_generations=1, max_new_tokens=8), dapo_flags=["--num-minibatches", "2"]),
}
# Each run: which sizes, its script's flags beyond them, epochs (the scripts' defaults), and which checks apply.
RUNS = {
    "ours-grpo": dict(sizes="grpo", script="grpo_llm.py", flags=[], epochs=1, checks=["kl0", "finite", "ratio1"]),
    "trl-grpo": dict(sizes="grpo", script="benchmarks/gpu_check_trl.py", epochs=1, checks=["kl0", "finite"]),
    "ours-dapo": dict(sizes="grpo", script="grpo_llm.py", flags=["--preset", "dapo"], epochs=1, checks=["finite"]),
    "ours-ppo": dict(sizes="ppo", script="ppo_llm.py", flags=[], epochs=4, checks=["kl0", "finite"]),
}
KL_COEF = 0.04  # grpo_llm.py's default --kl-coef, given to TRL as beta
LEARNING_RATE = 1e-6  # TRL's GRPO default, given to every run: what it learns does not matter here
KL0_TOLERANCE = 1e-3  # per token: the policy's and the reference's forward passes can round apart in bf16
RATIO_TOLERANCE = 1e-4


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where the scripts run")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape (CI's), instead of Qwen2.5-0.5B's")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="a subset, in this order")
    parser.add_argument("--num-iterations", type=int, help="per run, the first a warm-up (default: the shape's)")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, where BF16_PEAK lacks it")
    parser.add_argument("--time-limit", type=float, default=480, help="seconds for the whole check, models included")
    parser.add_argument("--require-trl", action="store_true", help="fail, rather than skip trl-grpo, without TRL")
    parser.add_argument("--wheels", action="store_true", help="print WHEELS and DATASETS_WHEELS, for gpu_check.sh")
    args = parser.parse_args(argv)
    if args.num_iterations is not None and args.num_iterations < 2:
        parser.error("--num-iterations must be at least 2: the first is a warm-up")
    return args


# ---------------------------------------------------------------------------------------------------------------------
# The models, the tokenizer and the prompts


CHARS = [*"0123456789+= "]


def build_tokenizer(vocab_size: int):
    """<pad>, <eos>, one token per character of CHARS, then filler tokens <n> (only sampling produces them; decoded
    fused, so bench_rewards.even_tokens can count the even ones), as bench_trl.py's real-vocab tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", *CHARS]
    vocab = {token: i for i, token in enumerate(specials + [f"<{n}>" for n in range(len(specials), vocab_size)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>",
                                   padding_side="left")  # unk named, or Qwen2Tokenizer adds its own past the vocab


def build_models(model_config: dict, out: Path, device: str) -> dict:
    """The policy and the reward model (random weights, float32, seeded) and the tokenizer, saved under out. Returns
    their paths and their multiplying parameters (see the module docstring). On a GPU, initialised there: faster."""
    import torch
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    transformers.logging.disable_progress_bar()  # save_pretrained's
    torch.manual_seed(0)
    config = Qwen2Config(**model_config, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    tokenizer = build_tokenizer(config.vocab_size)
    with torch.device(device):
        policy = Qwen2ForCausalLM(config)
    policy_params = sum(p.numel() for p in policy.parameters())  # tied: the embedding once, as the head
    policy.save_pretrained(out / "policy")
    del policy
    with torch.device(device):
        reward = Qwen2ForSequenceClassification(Qwen2Config(**model_config, num_labels=1, pad_token_id=0,
                                                            eos_token_id=1, bos_token_id=None))
    scorer_params = sum(p.numel() for p in reward.parameters()) - config.vocab_size * config.hidden_size
    reward.save_pretrained(out / "reward")
    del reward
    if device == "cuda":
        torch.cuda.empty_cache()  # the runs are other processes
    for name in ("policy", "reward"):
        tokenizer.save_pretrained(out / name)
    return dict(policy=str(out / "policy"), reward=str(out / "reward"), policy_params=policy_params,
                scorer_params=scorer_params)


def write_prompts(path: Path, count: int, length: int) -> Path:
    """count random prompts of exactly length tokens (one per character), one {"prompt": ...} row a line."""
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(count):
            f.write(json.dumps({"prompt": "".join(rng.choice(CHARS) for _ in range(length))}) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------------------------
# The runs


def run_command(name: str, sizes: dict, shape: dict, models: dict, prompts: Path, out: Path, iterations: int,
                device: str) -> list[str]:
    """The command line of one run, through peak_memory.py: ours as users launch them, TRL's side with its JSON."""
    run = RUNS[name]
    if name == "trl-grpo":
        config = dict(sizes, device=device, model=models["policy"], prompts=str(prompts), reward="even_tokens",
                      output_dir=str(out), num_iterations=iterations, kl_coef=KL_COEF, learning_rate=LEARNING_RATE,
                      seed=1)
        script_args = [json.dumps(config)]
    else:
        script_args = ["--model-name-or-path", models["policy"], "--prompts-path", str(prompts),
                       "--output-dir", str(out), "--dtype", "bfloat16",
                       "--num-iterations", str(iterations), "--num-prompts", str(sizes["num_prompts"]),
                       "--max-new-tokens", str(sizes["max_new_tokens"]), "--learning-rate", str(LEARNING_RATE),
                       "--eval-every", "0", "--save-every", "0", "--doctor", "off", *run["flags"]]
        if run["script"] == "grpo_llm.py":
            script_args += ["--num-generations", str(sizes["num_generations"]),
                            "--micro-batch-size", str(sizes["micro_batch_size"]),  # its default, and TRL's here
                            "--reward-fn", f"{BENCHMARKS / 'bench_rewards.py'}:even_tokens"]
            script_args += shape["dapo_flags"] if "--preset" in run["flags"] else []
        else:
            script_args += ["--reward-model-path", models["reward"]]
    return [sys.executable, str(BENCHMARKS / "peak_memory.py"), str(out / "peak.json"), str(ROOT / run["script"]),
            *script_args]


def launch(command: list[str], out: Path, device: str, timeout: float) -> tuple[int | str, list[dict], dict]:
    """Run one command (its console into out/console.log), stopped after timeout seconds; returns its exit status (or
    "timeout"), its metrics.jsonl rows (of training iterations) and its peak memory."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               TRL_EXPERIMENTAL_SILENCE="1", PYTHONUNBUFFERED="1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the scripts take a GPU wherever one is visible
    out.mkdir(parents=True, exist_ok=True)
    with (out / "console.log").open("w") as console:
        try:
            code = subprocess.run(command, cwd=ROOT, env=env, stdout=console, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    metrics = out / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    peak = json.loads((out / "peak.json").read_text()) if (out / "peak.json").exists() else {}
    rows = [row for row in rows if "time/update" in row]  # the training iterations'
    for row in rows:  # ppo_llm.py times its rollout (generation and the forward passes) and its update alone
        row.setdefault("time/iteration", row["time/rollout"] + row["time/update"])
    return code, rows, peak


def phase_flops(row: dict, name: str, sizes: dict, shape: dict, models: dict) -> dict:
    """Model FLOPs of one iteration's phases, by the module docstring's formulas."""
    run, generations = RUNS[name], sizes["num_generations"]
    policy, scorer = models["policy_params"], models["scorer_params"]
    sequences = row.get("rollout/batch_size", sizes["num_prompts"] * generations)  # PPO's: its sizes
    length = row["rollout/response_length"]
    epochs = row.get("policy/epochs_completed", run["epochs"])  # PPO's, which --target-kl can cut
    trained_tokens = shape["prompt_tokens"] * sequences / generations + length * sequences
    sampled_groups = row.get("rollout/groups_sampled", sequences / generations)  # DAPO's resampled groups too
    sampled_tokens = shape["prompt_tokens"] * sampled_groups + length * sampled_groups * generations
    critic = scorer if run["sizes"] == "ppo" else 0
    forwards = {"old_logprobs": policy, "reference": policy, "values": scorer}
    passes = [params for key, params in forwards.items() if f"time/{key}" in row]
    if name == "trl-grpo":
        passes = [policy]  # the reference; on-policy, it computes no pi_old
    if run["sizes"] == "ppo":  # ppo_llm.py times its rollout as a whole: pi_old, the reference, the critic's values
        passes = [policy, policy, scorer, scorer]  # and the reward model, every iteration
    generate = 2 * policy * sampled_tokens
    update = 6 * (policy + critic) * trained_tokens * epochs
    return dict(generate=generate, update=update, iteration=generate + update + 2 * sum(passes) * trained_tokens,
                rollout=generate + 2 * sum(passes) * trained_tokens,
                generated_tokens=length * sampled_groups * generations, trained_tokens=length * sequences * epochs)


def checks(name: str, code: int | str, rows: list[dict]) -> dict:
    """The run's checks (module docstring): {check: {"passed": bool, "value": what was seen, ...}}. A value that is
    missing or not a finite number fails its check."""
    result = {"exit": dict(passed=code == 0, value=code)}
    if not rows:
        result["rows"] = dict(passed=False, value="no metrics.jsonl row of a training iteration")
        return result
    first = rows[0]
    for check in RUNS[name]["checks"]:
        if check == "kl0":
            per_token = first.get("objective/kl_per_token")
            if per_token is None and finite(first.get("objective/kl")) and finite(first.get("rollout/response_length")):
                per_token = first["objective/kl"] / max(first["rollout/response_length"], 1)
            result["kl0"] = dict(passed=finite(per_token) and abs(per_token) <= KL0_TOLERANCE, value=per_token,
                                 tolerance=KL0_TOLERANCE)
        elif check == "finite":
            bad = {f"{key}@{row.get('iteration')}": value for row in rows for key, value in row.items()
                   if key.startswith("losses/") and not finite(value)}
            losses = sorted({key for row in rows for key in row if key.startswith("losses/")})
            result["finite"] = dict(passed=bool(losses) and not bad, value=bad or losses or "no losses/* key")
        elif check == "ratio1":
            ratios = [row.get("policy/ratio") for row in rows]
            worst = max(ratios, key=lambda r: abs(r - 1) if finite(r) else math.inf)
            result["ratio1"] = dict(passed=all(finite(r) and abs(r - 1) <= RATIO_TOLERANCE for r in ratios),
                                    value=worst, tolerance=RATIO_TOLERANCE)
    return result


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def summarise(name: str, rows: list[dict], peak: dict, sizes: dict, shape: dict, models: dict,
              peak_flops: float | None) -> dict:
    """Medians over the iterations after the first: seconds, tokens/s, TFLOP/s and MFU per phase, and peak memory."""
    measured = rows[1:] or rows

    def median(key: str) -> float:
        return statistics.median(row[key] for row in measured)

    flops = [phase_flops(row, name, sizes, shape, models) for row in measured]
    result = {}
    phases = [("generate", "time/generate", "generated_tokens"), ("update", "time/update", "trained_tokens"),
              ("iteration", "time/iteration", None)]
    if "time/generate" not in measured[0]:  # ppo_llm.py's: the rollout as a whole, generation and forward passes
        phases[0] = ("rollout", "time/rollout", "generated_tokens")
    for phase, seconds_key, tokens_key in phases:
        seconds = median(seconds_key)
        rate = statistics.median(f[phase] / row[seconds_key] for f, row in zip(flops, measured))
        result[phase] = dict(seconds=rounded(seconds), tflops=rounded(rate / 1e12),
                             mfu=rounded(rate / peak_flops) if peak_flops else None)
        if tokens_key:
            result[phase]["tokens_per_sec"] = rounded(statistics.median(
                f[tokens_key] / row[seconds_key] for f, row in zip(flops, measured)))
    return dict(seconds_per_iteration=result["iteration"]["seconds"], **result,
                response_length=median("rollout/response_length"), measured_iterations=len(measured),
                peak_memory_gib=rounded(peak["bytes"] / 2**30) if peak else None, peak_memory_kind=peak.get("kind"),
                peak_reserved_gib=rounded(peak["reserved_bytes"] / 2**30) if "reserved_bytes" in peak else None)


def rounded(x: float) -> float:
    """Four significant digits: the JSON lines stay readable, and no figure rounds to 0."""
    return float(f"{x:.4g}")


def device_peak(args: argparse.Namespace) -> tuple[str, float | None]:
    """The device's name and its dense bf16 peak in FLOP/s (None where unknown: MFU is then left out)."""
    if args.device == "cpu":
        return "cpu", args.peak_tflops and args.peak_tflops * 1e12
    import torch

    if not torch.cuda.is_available():
        sys.exit("error: --device cuda, but torch sees no CUDA device; --device cpu --tiny runs on the CPU")
    name = torch.cuda.get_device_name()
    known = next((peak for key, peak in BF16_PEAK.items() if key in name), None)
    return name, args.peak_tflops * 1e12 if args.peak_tflops else known


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.wheels:
        print("\n".join(f"{folder} {spec}" for folder, specs in ((".whl", WHEELS), (".whl/datasets", DATASETS_WHEELS))
                        for spec in specs))
        return 0
    if args.tiny:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # this process's and the runs': tiny models gain nothing from more
    device, peak_flops = device_peak(args)
    shape_name = "tiny" if args.tiny else "real"
    shape = SHAPES[shape_name]
    iterations = args.num_iterations or shape["num_iterations"]
    results, failures, deadline = {}, [], time.monotonic() + args.time_limit
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        tmp = Path(tmp)
        models = build_models(shape["model"], tmp / "models", args.device)
        prompts = write_prompts(tmp / "prompts.jsonl", shape["num_prompts_in_file"], shape["prompt_tokens"])
        for name in args.runs:
            line = dict(run=name, device=device, shape=shape_name, dtype="bfloat16", iterations=iterations)
            if name == "trl-grpo" and importlib.util.find_spec("trl") is None:
                print(json.dumps(dict(line, trl="not installed", skipped=True)), flush=True)
                failures += ["trl-grpo: `import trl` fails, and --require-trl was given"] if args.require_trl else []
                continue
            sizes, out = SHAPES[shape_name][RUNS[name]["sizes"]], tmp / name
            command = run_command(name, sizes, shape, models, prompts, out, iterations, device)
            start = time.monotonic()
            if deadline - start > 1:
                code, rows, peak = launch(command, out, args.device, deadline - start)
            else:
                code, rows, peak = f"not started: --time-limit {args.time_limit:g} s spent", [], {}
            line["wall_seconds"] = rounded(time.monotonic() - start)
            line["checks"] = checks(name, code, rows)
            if code == 0 and rows:
                try:
                    line.update(summarise(name, rows, peak, sizes, shape, models, peak_flops))
                except KeyError as missing:
                    line["checks"]["metrics"] = dict(passed=False, value=f"no {missing} in metrics.jsonl")
            failed = [check for check, seen in line["checks"].items() if not seen["passed"]]
            failures += [f"{name}: {check} failed: {json.dumps(line['checks'][check])}" for check in failed]
            if failed and (out / "console.log").exists():
                console = (out / "console.log").read_text().splitlines()
                print(f"{name}: last lines of its console:\n" + "\n".join(console[-30:]), file=sys.stderr)
            print(json.dumps(dict(line, sizes=sizes, command=" ".join(command[3:]))), flush=True)
            results[name] = line
            shutil.rmtree(out / "policy", ignore_errors=True)  # the final policy, 2 GB at the real shape
    print(json.dumps(dict(summary=True, device=device, shape=shape_name, ours_over_trl=ratios(results),
                          policy_params=models["policy_params"], scorer_params=models["scorer_params"],
                          versions=versions(), checks_passed=not failures, failed=failures)))
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return 1 if failures else 0


def versions() -> dict:
    """The versions the runs imported: Python's and those of the packages that decide their speed."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": sys.version.split()[0]}
    for package in ("torch", "transformers", "trl", "tyro"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def ratios(results: dict) -> dict | str:
    """ours-grpo / trl-grpo, measured in the same call: time per iteration and per phase, and peak memory."""
    ours, trl = results.get("ours-grpo", {}), results.get("trl-grpo", {})
    if "seconds_per_iteration" not in ours or "seconds_per_iteration" not in trl:
        return "trl not installed" if importlib.util.find_spec("trl") is None else "a side did not finish"
    result = {f"{phase}_seconds": rounded(ours[phase]["seconds"] / trl[phase]["seconds"])
              for phase in ("iteration", "generate", "update")}
    if ours["peak_memory_gib"] and trl["peak_memory_gib"]:
        result["peak_memory"] = rounded(ours["peak_memory_gib"] / trl["peak_memory_gib"])
    return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
