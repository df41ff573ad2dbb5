"""TRL's side of benchmarks/bench_trl.py: one GRPOTrainer or PPOTrainer run with the sizes the benchmark gives ours.

Run by bench_trl.py in TRL's own environment (see requirements-trl.txt), never by hand. Its one argument is a JSON
object of sizes. It prints `training begins` as the training loop starts, then one line per iteration in ours'
console format, `iter N | reward R` (GRPO) or `iter N | score S` (PPO), flushed when TRL logs the iteration, so the
benchmark times both the same way: by when each line arrives.
"""

import json
import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_rewards import REWARDS  # the same reward functions ours loads with --reward-fn


class IterationLines(TrainerCallback):
    """`training begins` when the training loop starts (ours prints its column legend there), then one console line
    per iteration: GRPO with one minibatch and one epoch logs each optimizer step, which is one iteration; PPO logs
    once per rollout-and-update."""

    def __init__(self, key: str, label: str):
        self.key, self.label, self.iteration = key, label, 0

    def on_train_begin(self, args, state, control, **kwargs):
        print("training begins", flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and self.key in logs:
            self.iteration += 1
            print(f"iter {self.iteration:>4} | {self.label} {logs[self.key]:.3f}", flush=True)


def rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def common(c: dict) -> dict:
    """TrainingArguments both trainers share: fp32 on CPU, no eval, no checkpoints, no reporting, a constant-then-
    linear schedule like ours (linear decay to 0), log every step."""
    return dict(output_dir=c["output_dir"], learning_rate=c["learning_rate"], lr_scheduler_type="linear",
                adam_epsilon=1e-5, max_grad_norm=1.0, weight_decay=0.0, seed=c["seed"], use_cpu=True, bf16=False,
                report_to="none", save_strategy="no", eval_strategy="no", logging_steps=1, disable_tqdm=True)


def grpo(c: dict) -> None:
    from trl import GRPOConfig, GRPOTrainer

    batch = c["num_prompts"] * c["num_generations"]
    config = GRPOConfig(
        **common(c), per_device_train_batch_size=batch, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=c["num_generations"], max_completion_length=c["max_new_tokens"], num_iterations=1,
        beta=c["kl_coef"], temperature=1.0, top_p=1.0, loss_type="grpo", scale_rewards="group",
        max_steps=c["num_iterations"], disable_dropout=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(c["model"])
    model = AutoModelForCausalLM.from_pretrained(c["model"], dtype=torch.float32)
    dataset = Dataset.from_list(rows(c["prompts"]))
    trainer = GRPOTrainer(model=model, reward_funcs=REWARDS[c["reward"]], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[IterationLines("reward", "reward")])
    trainer.train()
    trainer.save_model(f"{c['output_dir']}/policy")  # ours ends by saving its policy too


def ppo(c: dict) -> None:
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    # TRL 1.0's rollout batch is per_device_train_batch_size x gradient_accumulation_steps, which num_mini_batches
    # splits, one micro-batch of up to per_device_train_batch_size per minibatch and one optimizer step per
    # gradient_accumulation_steps micro-batches: ours' sizes (one step per minibatch) with the whole rollout batch as
    # per_device_train_batch_size and no accumulation; the benchmark gives ours a micro-batch of one minibatch.
    assert c["micro_batch_size"] == c["num_prompts"] // c["num_minibatches"], "TRL's PPO runs one micro-batch per minibatch"
    config = PPOConfig(
        **common(c), per_device_train_batch_size=c["num_prompts"], gradient_accumulation_steps=1,
        num_mini_batches=c["num_minibatches"],
        num_ppo_epochs=c["num_epochs"], total_episodes=c["num_prompts"] * c["num_iterations"],
        local_rollout_forward_batch_size=c["num_prompts"], response_length=c["max_new_tokens"],
        stop_token="eos", temperature=1.0, kl_coef=c["kl_coef"], kl_estimator="k1", missing_eos_penalty=None,
        num_sample_generations=0, whiten_rewards=False, gamma=1.0, lam=0.95, cliprange=0.2, cliprange_value=0.2,
        vf_coef=0.1,
    )
    tokenizer = AutoTokenizer.from_pretrained(c["model"])
    policy = AutoModelForCausalLM.from_pretrained(c["model"], dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(c["model"], dtype=torch.float32)
    reward_model = AutoModelForSequenceClassification.from_pretrained(c["reward_model"], num_labels=1)
    critic = AutoModelForSequenceClassification.from_pretrained(c["reward_model"], num_labels=1)  # ours: --critic-init reward

    def tokenized(path):
        return Dataset.from_list([{"input_ids": tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]}
                                  for r in rows(path)])

    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=reference,
                         reward_model=reward_model, value_model=critic, train_dataset=tokenized(c["prompts"]),
                         eval_dataset=tokenized(c["prompts"]), callbacks=[IterationLines("objective/scores", "score")])
    trainer.train()
    trainer.save_model(f"{c['output_dir']}/policy")  # ours ends by saving its policy too


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    torch.manual_seed(config["seed"])
    {"grpo": grpo, "ppo": ppo}[config["algorithm"]](config)
