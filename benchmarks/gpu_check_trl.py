"""TRL's side of gpu_check.py: one GRPOTrainer (TRL 1.16) run at ours' GRPO shape, with the same model, prompts, reward,
batch and micro-batch, in bfloat16 autocast over float32 weights (ours' --dtype bfloat16), generating with
transformers as ours does (no vLLM), without gradient checkpointing as ours (TRL's default is with), and with its
non-finite losses logged as they are (the Trainer's logging_nan_inf_filter would average them away).

Run by gpu_check.py through peak_memory.py, never by hand; its one argument is a JSON object of sizes (trl_runner.py's,
plus device and micro_batch_size). It writes <output_dir>/metrics.jsonl, one row per optimizer step in ours' keys:
  time/iteration  the step, from the first micro-batch's start to the optimizer step's end
  time/rollout    _generate_and_score_completions: sampling, the rewards and the reference's forward pass
  time/generate   _generate inside it: the sampling alone
  time/update     the rest of the step: the micro-batches' forward and backward passes and the optimizer step
  objective/kl_per_token  TRL's `kl`, the mean of k3 over tokens (ours' objective/kl sums a response's tokens)
each timed after the GPU has done the work queued (torch.cuda.synchronize).
"""

import functools
import json
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rewards import REWARDS  # the reward functions ours loads with --reward-fn
from trl_runner import common, rows  # the TrainingArguments bench_trl.py gives TRL, and the prompts reader


def now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def timed(method, seconds: dict, name: str):
    """The bound method, adding the seconds each call takes to seconds[name]."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        start = now()
        try:
            return method(*args, **kwargs)
        finally:
            seconds[name] = seconds.get(name, 0.0) + now() - start
    return wrapper


class MetricsRows(TrainerCallback):
    """One metrics.jsonl row per logged optimizer step (logging_steps=1), with the phases' seconds of that step."""

    def __init__(self, path: Path, seconds: dict, batch_size: int):
        self.path, self.seconds, self.batch_size, self.start, self.step_seconds = path, seconds, batch_size, 0.0, 0.0

    def on_step_begin(self, args, state, control, **kwargs):  # once per optimizer step, before its micro-batches
        self.start = now()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_seconds = now() - self.start

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "completions/mean_length" not in logs:  # the end-of-training summary
            return
        rollout, generate = self.seconds.pop("rollout", 0.0), self.seconds.pop("generate", 0.0)
        row = {"iteration": state.global_step, "time/iteration": self.step_seconds, "time/rollout": rollout,
               "time/generate": generate, "time/update": self.step_seconds - rollout,
               "rollout/response_length": logs["completions/mean_length"], "rollout/batch_size": self.batch_size,
               "objective/kl_per_token": logs.get("kl"), "losses/policy_loss": logs["loss"]}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def main(c: dict) -> None:
    from trl import GRPOConfig, GRPOTrainer

    batch = c["num_prompts"] * c["num_generations"]
    micro = min(c["micro_batch_size"], batch)
    config = GRPOConfig(
        **dict(common(c), use_cpu=c["device"] == "cpu", bf16=True), per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro, steps_per_generation=batch // micro,
        num_generations=c["num_generations"], max_completion_length=c["max_new_tokens"], num_iterations=1,
        beta=c["kl_coef"], temperature=1.0, top_p=1.0, loss_type="grpo", scale_rewards="group",
        max_steps=c["num_iterations"], disable_dropout=True, gradient_checkpointing=False, use_vllm=False,
        logging_nan_inf_filter=False,
    )
    tokenizer = AutoTokenizer.from_pretrained(c["model"])
    model = AutoModelForCausalLM.from_pretrained(c["model"], dtype=torch.float32)
    seconds, output_dir = {}, Path(c["output_dir"])
    output_dir.mkdir(parents=True, exist_ok=True)
    trainer = GRPOTrainer(model=model, reward_funcs=REWARDS[c["reward"]], args=config,
                          train_dataset=Dataset.from_list(rows(c["prompts"])), processing_class=tokenizer,
                          callbacks=[MetricsRows(output_dir / "metrics.jsonl", seconds, batch)])
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, seconds, "rollout")
    trainer._generate = timed(trainer._generate, seconds, "generate")
    trainer.train()


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    torch.manual_seed(config["seed"])
    main(config)
