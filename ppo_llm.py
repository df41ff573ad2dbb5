"""PPO for language models in one file: a policy, a frozen reference, a reward (model or function) and a critic.

One iteration (run_iteration):
  1. rollout: sample a response to each prompt of the batch, mask what follows its first EOS, score it, and compute
     on the sampled tokens log pi_old, log pi_ref and the critic's values V(s_t);
  2. rewards: r_t = -beta * KL_t on every response token, plus the score on its last token;
  3. advantages: GAE over those rewards and values, whitened over the batch;
  4. update: --num-epochs passes over the batch, each split into --num-minibatches optimizer steps on the clipped
     policy loss + c1 * the clipped value loss - c2 * the entropy (+ PPO-ptx's language-modelling loss), gradients
     accumulated over micro-batches.
Part 1, the algorithm, follows that order: Args, the formulas (one pure function each), the rollout, rewards and
advantages, the update, the training loop. It reads as if there were one process and a plain log-softmax: each piece
of machinery is one call whose name says what it returns, defined in Part 2's appendices (A arguments, B data and
rewards, C models and LoRA, D performance, E distributed, F the run directory, G logging and the doctor).

With no flags it trains the tiny addition model in demo/ on a CPU and prints eval accuracy before and after. On a real
model:
    python ppo_llm.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --prompts-path data.jsonl \
        --reward-fn last_number --chat-template --dtype bfloat16 --learning-rate 1e-6
Papers: PPO (Schulman et al. 2017, arXiv:1707.06347); GAE (Schulman et al. 2015, arXiv:1506.02438); KL-shaped rewards
and the adaptive KL controller (Ziegler et al. 2019, arXiv:1909.08593); InstructGPT and PPO-ptx (Ouyang et al. 2022,
arXiv:2203.02155); "The 37 implementation details of PPO" (Huang et al. 2022, ICLR blog track); Dual-Clip (Ye et al.
2020, arXiv:1912.09729); Clip-Higher (DAPO, Yu et al. 2025, arXiv:2503.14476); VC-PPO (Yuan et al. 2025,
arXiv:2503.01491); VAPO (Yue et al. 2025, arXiv:2504.05118).
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import importlib.util
import json
import math
import os
import pickle
import re
import shutil
import signal
import statistics
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, make_dataclass, replace
from pathlib import Path
from typing import Callable, Literal, NamedTuple, Optional

import huggingface_hub
import torch
import torch.distributed as dist
import torch.nn as nn
import transformers
import tyro
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

DEMO = Path(__file__).resolve().parent / "demo"


# ---------------------------------------------------------------------------------------------------------------------
# Part 1: the algorithm
# ---------------------------------------------------------------------------------------------------------------------
# Args: every knob, one dataclass per section of --help, the algorithm's first. Args inherits them all, so the code
# reads args.kl_coef and the flags stay flat (--kl-coef). Their ranges and checks: appendix A.


@dataclass
class RewardsAndKL:
    """the per-token reward: the score minus beta times the KL to the reference (Ziegler et al. 2019)"""

    kl_coef: float = 0.05
    """beta in r_t = -beta * KL_t; 0.01-0.2"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """per-token KL estimator: k1 = log(p/q), k2 = (log(p/q))^2 / 2, k3 = q/p - 1 - log(q/p)"""
    kl_schedule: Literal["fixed", "linear", "adaptive"] = "fixed"
    """fixed beta; linear anneal to --kl-coef-final; adaptive: a controller towards --kl-target (Ziegler et al.)"""
    kl_coef_final: float = 0.1
    """beta at the last iteration with --kl-schedule linear"""
    kl_target: float = 0.1
    """per-sequence KL the adaptive controller steers towards"""
    kl_horizon: int = 10000
    """adaptive controller horizon in sequences: larger = slower beta changes (Ziegler et al. use 10000)"""
    whiten_rewards: bool = False
    """normalise scores with a running mean/std over all iterations so far"""
    reward_clip: Optional[float] = None
    """clip scores to [-c, c] after whitening; None = off (e.g. 5)"""
    missing_eos_penalty: float = 0.0
    """subtracted from the score of a response that ends without EOS (e.g. 1.0)"""
    ref_sync_every: int = 0
    """TR-DPO: every this many iterations pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref; 0 = never"""
    ref_sync_alpha: float = 0.6
    """with --ref-sync-every: alpha, the policy's share of the mix (1 = copy the policy)"""


@dataclass
class Advantages:
    """generalized advantage estimation, GAE (Schulman et al. 2015)"""

    gamma: float = 1.0
    """discount; 1.0 for LLMs (a late token is worth as much as an early one)"""
    gae_lambda: float = 0.95
    """policy GAE lambda: 0 = one-step TD error, 1 = Monte Carlo R - V(s_t); 0.9-0.95"""
    critic_gae_lambda: Optional[float] = None
    """lambda for the critic's returns; None = same as --gae-lambda (VC-PPO decouples: 1.0)"""
    length_adaptive_alpha: Optional[float] = None
    """VAPO: policy lambda = 1 - 1/(alpha * length); None = off (VAPO: 0.05, with --critic-gae-lambda 1.0)"""
    recompute_advantages: bool = False
    """recompute values and advantages with the updated critic each epoch (value clipping then centres on them)"""
    advantage_whitening: Literal["batch", "minibatch", "none"] = "batch"
    """normalise advantages to mean 0, std 1 over the batch, each minibatch, or not at all"""


@dataclass
class Losses:
    """the clipped policy loss, the value loss and the entropy bonus (Schulman et al. 2017)"""

    clip_eps: float = 0.2
    """PPO clip epsilon; 0.1-0.3, 0.2 is standard"""
    clip_eps_high: Optional[float] = None
    """upper clip epsilon (DAPO Clip-Higher, e.g. 0.28); None = --clip-eps"""
    dual_clip: Optional[float] = None
    """Dual-Clip c (about 3): for A < 0 the loss is capped at -c*A; c must exceed 1 + the upper clip eps; None = off"""
    value_clip_eps: Optional[float] = 0.2
    """value clipping around the rollout values (pessimistic max); None = off"""
    vf_coef: float = 0.5
    """c1, weight of the value loss; 0.5-1.0"""
    ent_coef: float = 0.0
    """c2, entropy bonus; 0 for LLMs, 0.01 in classic RL"""
    entropy_target: Optional[float] = None
    """Skywork-OR1: the entropy coefficient rises by --ent-coef-delta while the entropy is below this; None = off"""
    ent_coef_delta: float = 0.005
    """with --entropy-target: the coefficient's step per iteration"""
    ent_coef_min: float = 0.0
    """with --entropy-target: the coefficient's lower bound"""
    ent_coef_max: float = 1.0
    """with --entropy-target: the coefficient's upper bound"""
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    """mean over all response tokens, or mean per sequence then over sequences"""


@dataclass
class Critic:
    """the value model and how it is trained before and beside the policy"""

    critic_init: Literal["policy", "reward"] = "policy"
    """the critic starts from the policy with a fresh value head, or from the reward model, head included"""
    shared_critic: bool = False
    """value head on the policy's backbone instead of a separate critic, trained with --vf-coef in one loss"""
    critic_learning_rate: Optional[float] = None
    """critic (or shared value head) AdamW learning rate; None = by the policy's size (default_learning_rates)"""
    critic_warmup_iterations: int = 0
    """the first iterations (counted in --num-iterations) train only the critic, the policy frozen"""
    value_pretrain_steps: int = 0
    """VC-PPO: before RL, this many rollouts regress the critic on Monte Carlo returns (lambda = 1)"""


@dataclass
class Optimisation:
    """iterations, batch sizes and the optimizer"""

    num_iterations: int = 40
    """rollout -> update cycles"""
    num_prompts: int = 64
    """prompts per iteration (batch = num_prompts * num_generations responses)"""
    num_epochs: int = 4
    """K: passes over each batch; 1-4 for LLMs"""
    num_minibatches: int = 2
    """optimizer steps per epoch; the batch is reshuffled every epoch"""
    micro_batch_size: int = 32
    """sequences per forward pass; gradients accumulate over a minibatch"""
    learning_rate: Optional[float] = None
    """policy AdamW learning rate; None = by the policy's size (default_learning_rates: 3e-4 for the demo)"""
    adam_eps: float = 1e-5
    """AdamW epsilon (1e-5 is one of the 37 details)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    lr_warmup_iterations: int = 0
    """linear learning-rate warmup over this many iterations"""
    anneal_lr: bool = True
    """linearly anneal the learning rates to 0 over the run"""
    max_grad_norm: float = 1.0
    """global gradient-norm clip, separately for policy and critic"""
    target_kl: Optional[float] = None
    """stop the epoch loop when approx KL(pi_old || pi_theta) of a minibatch exceeds this; None = off"""


@dataclass
class Generation:
    """how responses are sampled"""

    num_generations: int = 1
    """responses sampled per prompt"""
    max_new_tokens: int = 16
    """longest response in tokens; responses without EOS by then are truncated (the demo's answers need 5)"""
    temperature: float = 1.0
    """sampling temperature; log-probs are computed from logits / temperature so they match the sampler"""
    top_p: float = 1.0
    """nucleus sampling; 1.0 = off (log-probs ignore top-p/top-k truncation, as in most RLHF code)"""
    top_k: int = 0
    """top-k sampling; 0 = off"""
    min_p: float = 0.0
    """min-p sampling: drop tokens less likely than min_p times the most likely one; 0 = off"""


@dataclass
class PolicyAndReward:
    """the policy (also the frozen reference), the reward, and LoRA"""

    model_name_or_path: str = str(DEMO / "model")
    """policy and reference: a local directory or a Hub name of an AutoModelForCausalLM"""
    reward_model_path: Optional[str] = None
    """an AutoModelForSequenceClassification with one label, scored on prompt+response at the last real token"""
    reward_fn: Optional[str] = None
    """reward without a reward model: exact_match (default), last_number, module:function or file.py:function"""
    lora_r: int = 0
    """LoRA rank: policy and critic train low-rank adapters (peft); the reference is the policy without them; 0 = off"""
    lora_alpha: float = 16.0
    """LoRA scale: the adapters add alpha/r * B A to each target weight"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input in the update; 0 keeps the update's log-probs equal to the sampler's"""
    lora_target_modules: Optional[list[str]] = None
    """module names that get adapters (e.g. q_proj v_proj); None = every linear layer but the output heads"""


@dataclass
class Data:
    """prompts to train and evaluate on, and PPO-ptx's pretraining text"""

    prompts_path: str = str(DEMO / "train.jsonl")
    """training prompts: a .jsonl, .json, .parquet or .csv file, or a Hugging Face dataset name"""
    eval_prompts_path: str = str(DEMO / "eval.jsonl")
    """prompts greedy-decoded for eval/reward, in any form --prompts-path takes"""
    prompt_field: str = "prompt"
    """the rows' field holding the prompt (gsm8k: question); every other field reaches the reward function"""
    answer_field: str = "answer"
    """the rows' field that exact_match and last_number compare with; it reaches them as 'answer'"""
    dataset_split: str = "train"
    """split of a Hugging Face dataset named by --prompts-path"""
    eval_dataset_split: str = "test"
    """split of a Hugging Face dataset named by --eval-prompts-path"""
    dataset_config: Optional[str] = None
    """configuration of a Hugging Face dataset (gsm8k: main); None = its default"""
    chat_template: bool = False
    """wrap each prompt as a user turn with the tokenizer's chat template"""
    max_prompt_length: int = 256
    """prompts longer than this many tokens are truncated from the left (with a counted warning)"""
    ptx_path: Optional[str] = None
    """plain-text file, one document per line, for the PPO-ptx language-modelling loss"""
    ptx_coef: float = 0.0
    """PPO-ptx: weight of the pretraining LM loss mixed into the policy loss (InstructGPT); 0 = off"""


@dataclass
class Experiment:
    """where the run writes, how often it evaluates and saves, what it reports"""

    output_dir: str = "runs/ppo"
    """where metrics.jsonl, checkpoints and the final policy go; an earlier run there needs --overwrite"""
    overwrite: bool = False
    """replace the earlier run in --output-dir (metrics, checkpoints, policy) once this one has logged an iteration"""
    seed: int = 1
    """random seed; the same seed gives the same metrics on CPU"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """compute dtype of the forward passes (autocast; bfloat16 on GPUs); trained weights stay float32"""
    gradient_checkpointing: bool = False
    """trade compute for memory in the policy and critic forward passes"""
    fsdp: bool = False
    """under torchrun: shard weights, gradients and optimizer states over the ranks with FSDP2 (else replicate them)"""
    track: bool = False
    """also write TensorBoard logs to <output-dir>/tb (needs the tensorboard package)"""
    wandb_project: Optional[str] = None
    """with --track, also log to this Weights & Biases project (needs the wandb package)"""
    eval_every: int = 5
    """greedy-decode --eval-prompts-path every this many iterations (and before the first update); 0 = never"""
    sample_every: int = 10
    """print a few sampled completions every this many iterations; 0 = never"""
    save_every: int = 20
    """write <output-dir>/checkpoint-N every this many iterations; 0 = only the final policy"""
    save_total_limit: Optional[int] = None
    """keep only the newest this many checkpoints; None = keep all"""
    resume_from: Optional[str] = None
    """a checkpoint-N directory to continue from; training flags must match its run's (--num-iterations may grow)"""
    doctor: Literal["warn", "off"] = "warn"
    """watch the metrics for instability signals and print the knob to turn; off = silent"""


# --help shows one group per section, in this order
SECTIONS = dict(rewards_and_kl=RewardsAndKL, advantages=Advantages, losses=Losses, critic=Critic,
                optimisation=Optimisation, generation=Generation, policy_and_reward=PolicyAndReward, data=Data,
                experiment=Experiment)


@dataclass
class Args(Experiment, Data, PolicyAndReward, Generation, Optimisation, Critic, Losses, Advantages, RewardsAndKL):
    """Every knob, flat. The last two are not flags: derived_args computes them from the flags."""

    batch_size: tyro.conf.Suppress[int] = 0
    """responses per iteration: num_prompts * num_generations"""
    minibatch_size: tyro.conf.Suppress[int] = 0
    """responses per optimizer step on each rank: batch_size / ranks / num_minibatches"""


# ---------------------------------------------------------------------------------------------------------------------
# The formulas: one pure function each, tensors in and tensors out. A tensor over response tokens is (B, T) and
# travels with its response_mask (1 up to and including the first EOS); every mean over tokens is a masked mean.


def pick(table: dict, name: str, what: str) -> Callable:
    """table[name], the function a knob names; an unknown name is an error, never a fall-through to a default."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}: expected one of {', '.join(table)}")
    return table[name]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum(x * m) / sum(m), over all tokens (dim=None) or along dim."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the unmasked tokens of the whole batch; masked entries become 0."""
    m = mask.to(x.dtype)
    count, total = all_sum(torch.stack([m.sum(), (x * m).sum()]))  # all_sum: over every rank's part of the batch
    count = count.clamp(min=1)
    mean = total / count
    var = all_sum(((x - mean) ** 2 * m).sum()) / count
    return (x - mean) * torch.rsqrt(var + eps) * mask


def response_mask_from_eos(responses: torch.Tensor, eos_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(response_mask, has_eos): 1 up to and including the first EOS, 0 after it; a response without EOS is all ones.
    Right even when pad == EOS: only the first EOS counts."""
    is_eos = torch.isin(responses, torch.tensor(eos_token_ids, device=responses.device))
    after_first_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0
    return ~after_first_eos, is_eos.any(1)


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """H = -sum_a p_a * log p_a from log p = log_softmax(z), per position, without a gradient (the in-place product
    saves a vocabulary-sized temporary; appendix D's backward pass gives H's gradient). The equal form
    logsumexp(z) - sum p*z subtracts two large numbers and loses float32 precision on peaked distributions."""
    return -logp.exp().mul_(logp).sum(-1)


# Per-token estimates of KL(pi_theta || pi_ref) from tokens y sampled by pi_theta, as functions of
# log r = log pi_ref(y) - log pi_theta(y) (Schulman 2020, "Approximating KL divergence"): k1 is unbiased but negative
# on some tokens, k2 biased with low variance, k3 unbiased and never negative. In a reward, whose policy gradient
# treats it as a constant, only k1 gives the KL's own gradient; k2 and k3 estimate its value.
KL_ESTIMATORS = {
    "k1": lambda log_r: -log_r,
    "k2": lambda log_r: 0.5 * log_r**2,
    "k3": lambda log_r: torch.expm1(log_r) - log_r,
}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """KL_t, the per-token KL(pi_theta || pi_ref) of the estimator named (KL_ESTIMATORS)."""
    return pick(KL_ESTIMATORS, estimator, "KL estimator")(ref_logprobs - logprobs)


def kl_shaped_rewards(scores: torch.Tensor, kl: torch.Tensor, kl_coef: float,
                      response_mask: torch.Tensor) -> torch.Tensor:
    """r_t = -beta * KL_t on every response token, plus the score on the last one (Ziegler et al. 2019): the reward
    model judges the whole response, so its verdict lands where the response ends."""
    rewards = -kl_coef * kl * response_mask
    last = response_mask.long().sum(1).clamp(min=1) - 1
    rewards[torch.arange(len(scores)), last] += scores
    return rewards


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float,
                lam) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2015):  A_t = delta_t + gamma*lambda*A_{t+1},  delta_t = r_t + gamma*V(s_{t+1}) - V(s_t),
    with V = 0 after the last real token; lam is a float or a per-sequence (B,) tensor. Returns (advantages,
    returns = A + V), zero on masked tokens. With gamma = lambda = 1, A_t = R - V(s_t): the return minus the value."""
    mask = response_mask.to(values.dtype)
    rewards, values = rewards * mask, values * mask
    lam = torch.as_tensor(lam, dtype=values.dtype, device=values.device).expand(values.shape[0])
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def length_adaptive_lambda(response_lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO (Yue et al. 2025): lambda = 1 - 1 / (alpha * l) per sequence, so that longer responses look further ahead
    (floored at 0)."""
    return (1.0 - 1.0 / (alpha * response_lengths.float().clamp(min=1))).clamp(min=0.0)


def clipped_surrogate_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                           clip_eps: float, clip_eps_high: Optional[float] = None, dual_clip: Optional[float] = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's per-token loss  max(-A*w, -A*clip(w, 1-eps_low, 1+eps_high)),  w = pi_theta / pi_old  (Schulman et al.
    2017; a separate eps_high is DAPO's Clip-Higher). Dual-Clip (Ye et al. 2020, arXiv:1912.09729) caps the loss at
    -c*A for A < 0. Returns (loss, ratio, clipped), clipped marking the tokens whose gradient a bound removed."""
    ratio = torch.exp(logprobs - old_logprobs)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        clipped = clipped | dual
    return loss, ratio, clipped


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip_eps: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token  0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2),  the pessimistic max of the
    clipped and unclipped errors (Huang et al. 2022, detail 9). Returns (loss, clipped)."""
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    clipped_sq = (clipped_values - returns) ** 2
    # Clipped: the bound's loss won. Inside the range V_old + (V - V_old) can differ from V by rounding: not counted.
    clipped = (clipped_sq > unclipped) & ((values - old_values).abs() > clip_eps)
    return 0.5 * torch.maximum(unclipped, clipped_sq), clipped


# A per-token loss l (B, T) and its mask m (float) to a scalar, num_tokens and num_seqs being the whole minibatch's
# counts: summed over micro-batches, these add up to the minibatch's loss, so gradient accumulation is exact.
LOSS_AGGREGATIONS = {
    "token-mean": lambda l, m, num_tokens, num_seqs: (l * m).sum() / num_tokens,
    "seq-mean-token-mean": lambda l, m, num_tokens, num_seqs: ((l * m).sum(1) / m.sum(1).clamp(min=1)).sum() / num_seqs,
}


def aggregate_loss(loss: torch.Tensor, response_mask: torch.Tensor, mode: str, num_tokens, num_seqs) -> torch.Tensor:
    """A per-token loss reduced as --loss-aggregation says: token-mean = sum over all tokens / num_tokens;
    seq-mean-token-mean = each sequence's token mean, summed / num_seqs."""
    return pick(LOSS_AGGREGATIONS, mode, "loss aggregation")(loss, response_mask.to(loss.dtype), num_tokens, num_seqs)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over response tokens: near 1 the critic is useful, near 0 or below it is noise."""
    var_returns = masked_mean((returns - masked_mean(returns, response_mask)) ** 2, response_mask)
    residual = returns - values
    var_residual = masked_mean((residual - masked_mean(residual, response_mask)) ** 2, response_mask)
    return float("nan") if var_returns == 0 else float(1 - var_residual / var_returns)


def adaptive_kl_coef(kl_coef: float, kl: float, kl_target: float, num_seqs: int, horizon: int) -> float:
    """Ziegler et al. 2019's proportional controller: e = clip(KL / target - 1, -0.2, 0.2),
    beta <- beta * (1 + e * n / horizon), KL being the mean per-response sum. KL above target raises beta."""
    error = min(max(kl / kl_target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * num_seqs / horizon)


def linear_kl_coef(iteration: int, num_iterations: int, kl_coef: float, kl_coef_final: float) -> float:
    """KL annealing: beta goes linearly from --kl-coef to --kl-coef-final over the run."""
    progress = iteration / max(num_iterations - 1, 1)
    return kl_coef + (kl_coef_final - kl_coef) * progress


# beta for the next iteration, given this one's mean KL per response
KL_SCHEDULES = {
    "fixed": lambda args, state, kl: state["kl_coef"],
    "linear": lambda args, state, kl: linear_kl_coef(state["iteration"], args.num_iterations, args.kl_coef,
                                                     args.kl_coef_final),
    "adaptive": lambda args, state, kl: adaptive_kl_coef(state["kl_coef"], kl, args.kl_target, args.batch_size,
                                                         args.kl_horizon),
}


def entropy_coefficient(coef: float, entropy: float, target: float, delta: float, low: float, high: float) -> float:
    """Adaptive entropy control (He et al. 2025, Skywork-OR1, arXiv:2505.22312): the next iteration's coefficient of the
    entropy bonus,  c + delta  while the policy's entropy is below the target and  c - delta  otherwise, within
    [low, high]."""
    return min(high, max(low, coef + (delta if entropy < target else -delta)))


@torch.no_grad()
def sync_reference(reference: nn.Module, policy: nn.Module, alpha: float) -> None:
    """TR-DPO's soft update of the reference (Gorbatovski et al. 2024, arXiv:2404.09656), parameter by parameter:
    pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref, on the separate reference model (LoRA's is refused). Under FSDP2
    both models are sharded alike: each rank mixes its own shards."""
    for ref, own in zip(reference.parameters(), policy.parameters(), strict=True):
        ref.lerp_(own.detach(), alpha)


def update_running_moments(mean: float, var: float, count: int, batch: torch.Tensor) -> tuple[float, float, int]:
    """Merge a batch into a running mean and variance (Chan et al. 1979's parallel algorithm)."""
    batch = batch.double()
    n, batch_mean, batch_var = batch.numel(), batch.mean().item(), batch.var(unbiased=False).item()
    total = count + n
    delta = batch_mean - mean
    new_mean = mean + delta * n / total
    new_var = (var * count + batch_var * n + delta**2 * count * n / total) / total
    return new_mean, new_var, total


# ---------------------------------------------------------------------------------------------------------------------
# The rollout: 1. sample, 2. mask after EOS, 3. score, 4. the forward passes of pi_old, pi_ref and the critic


class PolicyOutput(NamedTuple):
    logprobs: torch.Tensor  # (B, T) log pi(y_t) of each response token, at the sampling temperature
    entropy: Optional[torch.Tensor]  # (B, T) entropy H_t of the distribution y_t was drawn from, if asked for
    hidden: Optional[torch.Tensor]  # (B, T, d) the final hidden states that predict the y_t, if asked for


def policy_forward(model, batch: dict, rows, temperature: float, entropy: Optional[bool] = None,
                   hidden: bool = False) -> PolicyOutput:
    """A causal LM's forward pass over the rows' prompts and responses:
        log pi(y_t) = log_softmax(z_{t-1} / T)[y_t],   H_t = -sum_a pi(a) log pi(a),   z = model(prompt + response)
    where z_{t-1} are the logits at the position before response token y_t. The same numbers as that plain form,
    computed without holding the (B, T, vocab) logits (appendix D). entropy: None = not computed, False = without a
    gradient, True = with one. hidden: also the final hidden states, for a shared critic's value head."""
    states, head, hidden_states = response_states(model, batch["query_responses"][rows], batch["attention_mask"][rows],
                                                  batch["context_length"], hidden)
    logprobs, h = logprobs_and_entropy(states, head, batch["responses"][rows], temperature, entropy)
    return PolicyOutput(logprobs, h, hidden_states)


def rollout(models: Models, reward: Reward, rows: list[dict], prompt_ids: list[list[int]], args: Args) -> dict:
    """The batch of one iteration: --num-generations responses to each prompt, their masks and scores, and on their
    tokens log pi_old ("logprobs"), log pi_ref ("ref_logprobs") and V(s_t) ("values")."""
    rows = [row for row in rows for _ in range(args.num_generations)]
    prompt_ids = [ids for ids in prompt_ids for _ in range(args.num_generations)]
    with models.autocast():  # every forward pass computes in --dtype
        with phase("generate"):
            batch = generate(models, prompt_ids, args, greedy=False)  # 1 and 2
        with phase("score"):
            batch["raw_scores"] = score_responses(models, reward, batch, rows, args)  # 3
        batch.update(forward_rollout(models, batch, args))  # 4
    batch["rows"] = rows
    return batch


@torch.no_grad()
def generate(models: Models, prompt_ids: list[list[int]], args: Args, greedy: bool) -> dict:
    """Left-padded prompts, each followed by a sampled (or greedy) response. Everything after a response's first EOS
    is masked out and set to pad."""
    input_ids, prompt_mask = left_pad(prompt_ids, models.tokenizer.pad_token_id, models.device)
    responses = sample(models.policy, input_ids, prompt_mask, args.max_new_tokens, models.eos_token_ids, greedy,
                       args.temperature, args.top_p, args.top_k, args.min_p)
    response_mask, has_eos = response_mask_from_eos(responses, models.eos_token_ids)
    responses = responses.masked_fill(~response_mask, models.tokenizer.pad_token_id)
    return dict(query_responses=torch.cat([input_ids, responses], 1),
                attention_mask=torch.cat([prompt_mask, response_mask.long()], 1), context_length=input_ids.shape[1],
                responses=responses, response_mask=response_mask, has_eos=has_eos)


@torch.no_grad()
def forward_rollout(models: Models, batch: dict, args: Args) -> dict:
    """log pi_old, log pi_ref and V(s_t) on the sampled tokens, micro-batch by micro-batch, one model after the other.
    A shared critic's values come from the policy's pass."""
    out = {"logprobs": [], "ref_logprobs": [], "values": []}
    with phase("old_logprobs"):
        for rows in micro_batches(len(batch["responses"]), args.micro_batch_size):
            policy = policy_forward(models.policy, batch, rows, args.temperature, hidden=args.shared_critic)
            out["logprobs"].append(policy.logprobs)
            if models.value_head is not None:
                out["values"].append(critic_values(models, batch, rows, policy.hidden))
    with phase("reference"), models.reference() as ref_policy:
        for rows in micro_batches(len(batch["responses"]), args.micro_batch_size):
            out["ref_logprobs"].append(policy_forward(ref_policy, batch, rows, args.temperature).logprobs)
    if models.value_head is None:
        with phase("values"):
            out["values"] = [critic_values(models, batch, rows)
                             for rows in micro_batches(len(batch["responses"]), args.micro_batch_size)]
    return {key: torch.cat(parts) for key, parts in out.items()}


def critic_values(models: Models, batch: dict, rows, policy_hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
    """V(s_t) for each response token t of the rows, s_t being the prompt and the response before token t: the separate
    critic's scalar head at the position before t, or the shared value head on the policy's hidden state there."""
    if models.value_head is not None:
        return models.value_head(policy_hidden.to(models.value_head.weight.dtype)).squeeze(-1).float()
    c = batch["context_length"]
    return scalar_forward(models.critic, batch["query_responses"][rows], batch["attention_mask"][rows])[:, c - 1 : -1]


@torch.no_grad()
def recompute_values(models: Models, batch: dict, args: Args) -> torch.Tensor:
    """V(s_t) under the current critic, for --recompute-advantages."""
    values = []
    with models.autocast():
        for rows in micro_batches(len(batch["responses"]), args.micro_batch_size):
            hidden = policy_forward(models.policy, batch, rows, args.temperature, hidden=True).hidden \
                if args.shared_critic else None
            values.append(critic_values(models, batch, rows, hidden))
    return torch.cat(values)


# ---------------------------------------------------------------------------------------------------------------------
# Rewards and advantages


def shape_rewards(batch: dict, args: Args, kl_coef: float, state: dict) -> None:
    """The scores (minus the missing-EOS penalty, whitened with running moments, clipped), then the per-token reward
    r_t = -beta * KL_t, plus the score on the last token."""
    scores = batch["raw_scores"] - args.missing_eos_penalty * (~batch["has_eos"]).float()
    if args.whiten_rewards:
        state["reward_mean"], state["reward_var"], state["reward_count"] = update_running_moments(
            state["reward_mean"], state["reward_var"], state["reward_count"], gather_cat(scores))  # the whole batch
        scores = (scores - state["reward_mean"]) / math.sqrt(state["reward_var"] + 1e-8)
    if args.reward_clip is not None:
        scores = scores.clamp(-args.reward_clip, args.reward_clip)
    batch["scores"] = scores
    batch["kl"] = kl_penalty(batch["logprobs"], batch["ref_logprobs"], args.kl_estimator) * batch["response_mask"]
    batch["rewards"] = kl_shaped_rewards(scores, batch["kl"], kl_coef, batch["response_mask"])


def compute_advantages(batch: dict, args: Args, critic_lambda: float) -> None:
    """GAE advantages for the policy, with --gae-lambda or VAPO's length-adaptive lambda, and returns for the critic,
    with critic_lambda (VC-PPO's decoupled GAE: the critic trains on lambda = 1 returns, the policy on lower-variance
    lambda < 1 advantages), then the advantages whitened over the batch."""
    mask = batch["response_mask"]
    policy_lambda = args.gae_lambda
    if args.length_adaptive_alpha is not None:
        policy_lambda = length_adaptive_lambda(mask.sum(1), args.length_adaptive_alpha)
    advantages, returns = compute_gae(batch["rewards"], batch["values"], mask, args.gamma, policy_lambda)
    if args.length_adaptive_alpha is not None or critic_lambda != args.gae_lambda:
        _, returns = compute_gae(batch["rewards"], batch["values"], mask, args.gamma, critic_lambda)
    if args.advantage_whitening == "batch":
        advantages = masked_whiten(advantages, mask)
    batch["advantages"], batch["returns"] = advantages, returns


# ---------------------------------------------------------------------------------------------------------------------
# The update: K epochs x minibatches (one optimizer step each) x micro-batches (gradients accumulated)


def ppo_update(models: Models, optimizers: dict, batch: dict, args: Args, train_policy: bool, critic_lambda: float,
               generator: torch.Generator, ptx: dict) -> dict:
    """K epochs over the batch, reshuffled each epoch into minibatches; returns the mean of minibatch statistics.
    With --target-kl the update stops at the first minibatch that strayed too far from pi_old."""
    models.train()
    history = {}
    for epoch in range(args.num_epochs):
        if epoch > 0 and args.recompute_advantages:
            batch["values"] = recompute_values(models, batch, args)
            compute_advantages(batch, args, critic_lambda)
        batch_size = len(batch["responses"])  # this rank's part of the batch
        permutation = torch.randperm(batch_size, generator=generator).to(batch["responses"].device)
        for start in range(0, batch_size, args.minibatch_size):
            progress(f"updating: epoch {epoch + 1}/{args.num_epochs}, minibatch {start // args.minibatch_size + 1}/"
                     f"{math.ceil(batch_size / args.minibatch_size)}")
            stats = minibatch_step(models, optimizers, batch, permutation[start : start + args.minibatch_size], args,
                                   train_policy, ptx)
            for key, value in stats.items():
                history.setdefault(key, []).append(value)
            if stats["early_stop"]:
                break
        if stats["early_stop"]:
            break
    models.eval()
    summary = {key: sum(v) / len(v) for key, v in history.items() if key != "early_stop"}
    summary["policy/early_stopped"] = float(bool(history["early_stop"][-1]))
    summary["policy/epochs_completed"] = epoch + (0.0 if stats["early_stop"] else 1.0)
    return summary


def minibatch_step(models: Models, optimizers: dict, batch: dict, mb_inds: torch.Tensor, args: Args,
                   train_policy: bool, ptx: dict) -> dict:
    """One optimizer step on one minibatch. Each micro-batch's loss is divided by the whole minibatch's token and
    sequence counts, so that the micro-batches' gradients add up to the minibatch loss's. Returns its statistics."""
    mask = batch["response_mask"][mb_inds]
    advantages = batch["advantages"][mb_inds]
    if args.advantage_whitening == "minibatch":
        advantages = masked_whiten(advantages, mask)
    num_tokens, num_seqs = all_sum(torch.stack([mask.sum(), torch.tensor(len(mb_inds), device=mask.device)]))
    num_tokens = num_tokens.clamp(min=1)
    totals = {}  # tensors, read once per minibatch: no wait for the device inside the micro-batch loop
    for rows in micro_batches(len(mb_inds), args.micro_batch_size):
        stats = micro_batch_backward(models, batch, mb_inds[rows], advantages[rows], num_tokens, num_seqs, args,
                                     train_policy, ptx)
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + value
    stats = dict(zip(totals, all_sum(torch.stack(list(totals.values()))).tolist()))  # every rank's part of the sums
    if not (math.isfinite(stats["losses/policy_loss"]) and math.isfinite(stats["losses/value_loss"])):
        raise NonFiniteLoss(f"policy loss {stats['losses/policy_loss']:.4g}, "
                            f"value loss {stats['losses/value_loss']:.4g}")
    stats.update(optimizer_step(models, optimizers, args, train_policy, stats["policy/approx_kl"]))
    return stats


def micro_batch_backward(models: Models, batch: dict, inds: torch.Tensor, advantages: torch.Tensor, num_tokens,
                         num_seqs, args: Args, train_policy: bool, ptx: dict) -> dict:
    """Forward one micro-batch, and backward its part of the minibatch loss
        L = L_clip - c2 * H + ptx_coef * L_ptx + c1 * L_V    (with the policy frozen: c1 * L_V alone).
    Returns its parts of the minibatch's statistics: losses, and token statistics over the minibatch's tokens."""
    mask, old_logprobs = batch["response_mask"][inds], batch["logprobs"][inds]
    with models.autocast():
        with torch.set_grad_enabled(train_policy or args.shared_critic):  # a shared critic backpropagates into it
            policy = policy_forward(models.policy, batch, inds, args.temperature, hidden=args.shared_critic,
                                    entropy=train_policy and args.ent_coef != 0)  # with a gradient if trained on
        values = critic_values(models, batch, inds, policy.hidden)
        ptx_lm_loss = ptx_loss(models, ptx["ids"], ptx["generator"], len(inds)) if ptx and train_policy else 0.0
    pg_tokens, ratio, clipped = clipped_surrogate_loss(policy.logprobs, old_logprobs, advantages, args.clip_eps,
                                                       args.clip_eps_high, args.dual_clip)
    vf_tokens, vf_clipped = clipped_value_loss(values, batch["values"][inds], batch["returns"][inds],
                                               args.value_clip_eps)
    pg_loss, entropy_bonus, vf_loss = (aggregate_loss(x, mask, args.loss_aggregation, num_tokens, num_seqs)
                                       for x in (pg_tokens, policy.entropy, vf_tokens))
    ptx_lm_loss = ptx_lm_loss * len(inds) / num_seqs  # a mean over this micro-batch: weighted by its share
    loss = args.vf_coef * vf_loss
    if train_policy:
        loss = loss + pg_loss - args.ent_coef * entropy_bonus + args.ptx_coef * ptx_lm_loss
    backward(loss)
    # approx KL(pi_old || pi_theta): k3 with the roles swapped, since the tokens were sampled by pi_old
    approx_kl = kl_penalty(old_logprobs, policy.logprobs.detach(), "k3")
    stats = {"losses/policy_loss": pg_loss.detach(), "losses/value_loss": vf_loss.detach()}
    if ptx and train_policy:
        stats["losses/ptx_loss"] = ptx_lm_loss.detach()
    for key, x in (("policy/approx_kl", approx_kl), ("policy/clipfrac", clipped), ("policy/ratio", ratio.detach()),
                   ("policy/entropy", policy.entropy.detach()), ("val/clipfrac", vf_clipped)):
        stats[key] = (x * mask).sum() / num_tokens
    return stats


def ptx_loss(models: Models, ptx_ids: list[list[int]], generator: torch.Generator, count: int) -> torch.Tensor:
    """PPO-ptx (Ouyang et al. 2022): the policy's next-token cross-entropy on `count` random pretraining texts."""
    picked = torch.randint(len(ptx_ids), (count,), generator=generator).tolist()
    input_ids, attention_mask = left_pad([ptx_ids[i] for i in picked], models.tokenizer.pad_token_id, models.device)
    # A token is a target only when the token before it is real: with left padding the first one follows a pad.
    is_target = attention_mask.bool()
    is_target[:, 1:] &= attention_mask[:, :-1].bool()
    return models.policy(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids_from(attention_mask),
                         labels=input_ids.masked_fill(~is_target, -100)).loss


def optimizer_step(models: Models, optimizers: dict, args: Args, train_policy: bool, minibatch_kl: float) -> dict:
    """Clip each network's gradient norm and step. With --target-kl, a minibatch that already strayed too far from
    pi_old is not applied and the update stops (the check comes before the step, as in Spinning Up)."""
    stats = {}
    early_stop = args.target_kl is not None and train_policy and minibatch_kl > args.target_kl
    if train_policy and not early_stop:
        stats["grad/policy_norm"] = clip_grad_norm(models.policy.parameters(), args.max_grad_norm, "policy")
        optimizers["policy"].step()
    if not early_stop:
        if models.value_head is not None:
            average_gradients(models.value_head)  # under torchrun: a plain module, whose gradients FSDP does not see
        stats["grad/critic_norm"] = clip_grad_norm(models.critic_parameters(), args.max_grad_norm, "critic")
        optimizers["critic"].step()
    for optimizer in optimizers.values():
        optimizer.zero_grad(set_to_none=True)
    models.policy.zero_grad(set_to_none=True)  # a frozen policy still gets a shared critic's gradient
    stats["early_stop"] = float(early_stop)
    return stats


# ---------------------------------------------------------------------------------------------------------------------
# The training loop


def run_iteration(run: Run, train_policy: bool, critic_lambda: float, step: int) -> dict:
    """One iteration on the prompts of `step` in the data order (value pretraining takes the first steps, then each
    iteration the next): rollout -> rewards -> advantages -> update. Returns its metrics."""
    models, state = run.models, run.state
    args = replace(run.args, ent_coef=state["ent_coef"])  # in use: --ent-coef, moved by --entropy-target
    phase_times.clear()
    with phase("iteration"):
        with phase("rollout"):
            rows, prompt_ids = prompts_of_step(run.prompts, step, args)  # this rank's share of them
            batch = rollout(models, run.reward, rows, prompt_ids, args)
        shape_rewards(batch, args, state["kl_coef"], state)
        compute_advantages(batch, args, critic_lambda)
        metrics = rollout_metrics(batch, state["kl_coef"])
        generator = run.generator(step)  # the minibatches' order (and PPO-ptx's texts)
        ptx = dict(ids=run.prompts.ptx_ids, generator=generator) if args.ptx_coef > 0 else {}
        with phase("update"):
            metrics.update(ppo_update(models, run.optimizers, batch, args, train_policy, critic_lambda, generator, ptx))
    metrics.update({f"time/{name}": seconds for name, seconds in phase_times.items()})
    metrics["train/ent_coef"] = args.ent_coef
    metrics["samples"] = samples_to_show(models, batch, batch["raw_scores"])
    return metrics


def train(args: Args) -> dict:
    """The run: checks, data, models, optimizers (or a checkpoint's), then VC-PPO's value pretraining if asked, then
    --num-iterations iterations, each followed by its eval (every --eval-every), its log line and metrics row, the
    doctor's warnings and its checkpoint (every --save-every). Returns the eval reward before and after."""
    with start_run(args) as run:  # appendix F: until it returns, the output directory is locked and Ctrl-C is caught
        args, state, optimizers = run.args, run.state, run.optimizers
        critic_lambda = args.gae_lambda if args.critic_gae_lambda is None else args.critic_gae_lambda
        if state["iteration"] == 0 and args.value_pretrain_steps > 0:
            for step in range(args.value_pretrain_steps):  # regress the critic on Monte Carlo returns (lambda = 1)
                run.stop_if_asked(saved=False)
                run.report_pretraining(step, run_iteration(run, train_policy=False, critic_lambda=1.0, step=step))
        run.stop_if_asked(saved=True)
        if state["iteration"] == 0 and args.eval_every > 0:
            run.report(dict(iteration=0, **evaluate(run)))  # row 0: the eval before the first update
        print(LEGEND, flush=True)  # what the columns of each iteration's line mean
        while state["iteration"] < args.num_iterations:
            iteration = state["iteration"]
            for name, optimizer in optimizers.items():
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate_at(iteration, args.num_iterations, run.learning_rates[name],
                                                   args.lr_warmup_iterations, args.anneal_lr)
            train_policy = iteration >= args.critic_warmup_iterations  # critic warmup: the policy is frozen
            metrics = run_iteration(run, train_policy, critic_lambda, step=args.value_pretrain_steps + iteration)
            metrics.update({"iteration": iteration + 1, "episodes": (iteration + 1) * args.batch_size,
                            "lr": optimizers["policy"].param_groups[0]["lr"],
                            "train/policy_frozen": float(not train_policy)})
            state["iteration"] = iteration + 1
            state["kl_coef"] = pick(KL_SCHEDULES, args.kl_schedule, "KL schedule")(args, state, metrics["objective/kl"])
            if args.entropy_target is not None:
                state["ent_coef"] = entropy_coefficient(state["ent_coef"], metrics["policy/entropy"],
                                                        args.entropy_target, args.ent_coef_delta, args.ent_coef_min,
                                                        args.ent_coef_max)
            if args.ref_sync_every and state["iteration"] % args.ref_sync_every == 0:
                sync_reference(run.models.ref_policy, run.models.policy, args.ref_sync_alpha)
            if args.eval_every > 0 and (state["iteration"] % args.eval_every == 0 or
                                        state["iteration"] == args.num_iterations):
                metrics.update(evaluate(run))
            run.report(metrics)  # the console line, the doctor's warnings, metrics.jsonl
            saved = args.save_every > 0 and (state["iteration"] % args.save_every == 0 or
                                             state["iteration"] == args.num_iterations)
            if saved:
                save_checkpoint(run)
            if state["iteration"] < args.num_iterations:  # after the last one the run ends anyway
                run.stop_if_asked(saved)
        return run.finish()  # saves the final policy, prints the run's last line


# ---------------------------------------------------------------------------------------------------------------------
# Part 2: the machinery
# ---------------------------------------------------------------------------------------------------------------------
# Appendix A. Arguments: --help's groups, the valid range of every knob, the checks, the values derived from the flags.
# Part 1 reaches it through start_run (appendix F), which checks the flags before anything loads.


def parse_args(argv: list[str]) -> Args:
    """The flags, parsed as one group per section (--help's groups) without a prefix, then made flat."""
    Flags = make_dataclass("Flags", list(SECTIONS.items()))
    defaults = Args()
    default = Flags(**{name: section(**{f.name: getattr(defaults, f.name) for f in fields(section)})
                       for name, section in SECTIONS.items()})
    flags = tyro.cli(Flags, default=default, args=argv, config=(tyro.conf.OmitArgPrefixes,))
    return Args(**{key: value for name in SECTIONS for key, value in vars(getattr(flags, name)).items()})


# The valid range of every numeric knob, as an interval. None (off) is always valid for an Optional knob; NaN never is.
RANGES = {
    "seed": "[0, 2**64)", "eval_every": "[0, inf)", "sample_every": "[0, inf)", "save_every": "[0, inf)",
    "save_total_limit": "(0, inf)", "max_prompt_length": "(0, inf)", "ptx_coef": "[0, inf)",
    "max_new_tokens": "(0, inf)", "temperature": "[0.001, inf)", "top_p": "(0, 1]", "top_k": "[0, inf)",
    "num_generations": "(0, inf)", "missing_eos_penalty": "[0, inf)",
    "kl_coef": "[0, inf)", "kl_coef_final": "[0, inf)", "kl_target": "(0, inf)", "kl_horizon": "(0, inf)",
    "reward_clip": "(0, inf)", "gamma": "[0, 1]", "gae_lambda": "[0, 1]", "critic_gae_lambda": "[0, 1]",
    "length_adaptive_alpha": "(0, inf)", "clip_eps": "(0, 1)", "clip_eps_high": "(0, inf)", "dual_clip": "(1, inf)",
    "value_clip_eps": "(0, inf)", "vf_coef": "[0, inf)", "ent_coef": "[0, inf)", "entropy_target": "[0, inf)",
    "ent_coef_delta": "(0, inf)", "ent_coef_min": "[0, inf)", "ent_coef_max": "[0, inf)", "ref_sync_every": "[0, inf)",
    "ref_sync_alpha": "(0, 1]", "min_p": "[0, 1)",
    "critic_warmup_iterations": "[0, inf)", "value_pretrain_steps": "[0, inf)",
    "num_iterations": "(0, inf)", "num_prompts": "(0, inf)", "num_epochs": "(0, inf)", "num_minibatches": "(0, inf)",
    "micro_batch_size": "(0, inf)", "learning_rate": "[0, inf)", "critic_learning_rate": "[0, inf)",
    "adam_eps": "(0, inf)", "weight_decay": "[0, inf)", "lr_warmup_iterations": "[0, inf)",
    "max_grad_norm": "(0, inf]", "target_kl": "(0, inf)", "lora_r": "[0, inf)", "lora_alpha": "(0, inf)",
    "lora_dropout": "[0, 1)",
}

# A flag set to anything but its default while this condition is false would do nothing: an error, not a silent no-op.
ONLY_WITH = [
    ("wandb_project", "does nothing without --track", lambda a: a.track),
    ("ptx_path", "does nothing without --ptx-coef > 0", lambda a: a.ptx_coef > 0),
    ("reward_fn", "does nothing with --reward-model-path, which gives the reward",
     lambda a: a.reward_model_path is None),
    ("kl_coef_final", "does nothing without --kl-schedule linear", lambda a: a.kl_schedule == "linear"),
    *((name, "does nothing without --entropy-target", lambda a: a.entropy_target is not None)
      for name in ("ent_coef_delta", "ent_coef_min", "ent_coef_max")),
    ("ref_sync_every", "does nothing with --kl-coef 0 (the reference only enters through the KL)",
     lambda a: a.kl_coef > 0),
    ("ref_sync_alpha", "does nothing without --ref-sync-every", lambda a: a.ref_sync_every > 0),
    ("kl_target", "does nothing without --kl-schedule adaptive", lambda a: a.kl_schedule == "adaptive"),
    ("kl_horizon", "does nothing without --kl-schedule adaptive", lambda a: a.kl_schedule == "adaptive"),
    ("save_total_limit", "does nothing with --save-every 0", lambda a: a.save_every > 0),
    ("dataset_split", "does nothing unless --prompts-path names a Hugging Face dataset",
     lambda a: is_dataset_name(a.prompts_path)),
    ("eval_dataset_split", "does nothing unless --eval-prompts-path names a Hugging Face dataset",
     lambda a: is_dataset_name(a.eval_prompts_path)),
    ("dataset_config", "does nothing unless --prompts-path or --eval-prompts-path names a Hugging Face dataset",
     lambda a: is_dataset_name(a.prompts_path) or is_dataset_name(a.eval_prompts_path)),
    ("fsdp", "does nothing in one process (launch with torchrun --nproc_per_node N)", lambda a: launched_ranks() > 1),
    ("lora_alpha", "does nothing with --lora-r 0", lambda a: a.lora_r > 0),
    ("lora_dropout", "does nothing with --lora-r 0", lambda a: a.lora_r > 0),
    ("lora_target_modules", "does nothing with --lora-r 0", lambda a: a.lora_r > 0),
]

# What --resume-from accepts differently from the run that wrote the checkpoint: nothing that changes what is trained.
RESUME_MAY_CHANGE = {"num_iterations", "output_dir", "overwrite", "resume_from", "eval_every", "save_every",
                     "save_total_limit", "sample_every", "track", "wandb_project", "doctor",
                     "gradient_checkpointing", "micro_batch_size", "fsdp"}


class ConfigError(Exception):
    """Bad input from the user: printed as one line starting with "error:", exit code 1."""


def as_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_range(name: str, value, interval: str) -> None:
    """Raise unless low <(=) value <(=) high for an interval written like "(0, 1]"."""
    low, high = (float(b) if b != "2**64" else 2**64 for b in interval[1:-1].split(", "))
    above = low < value if interval[0] == "(" else low <= value
    below = value < high if interval[-1] == ")" else value <= high
    if not (above and below):
        rules = {"(0, inf)": "must be positive", "(0, inf]": "must be positive", "[0, inf)": "must be >= 0"}
        rule = rules.get(interval, f"must be in {interval}")
        finite = "" if math.isfinite(value) or interval[-1] == "]" else " and finite"
        raise ConfigError(f"{as_flag(name)} {rule}{finite}, got {value}")


def exact_div(a: int, b: int, what: str) -> int:
    if a % b != 0:
        raise ConfigError(f"{what}: {a} is not divisible by {b}")
    return a // b


def check_args(args: Args) -> None:
    """Fail fast, with one line naming the flag, before any model loads: ranges, then combinations. It only reads."""
    for flag, value in (("--output-dir", args.output_dir), ("--resume-from", args.resume_from)):
        if value is not None and not value.strip():  # '' from an unset shell variable would mean "here"
            raise ConfigError(f"{flag} is empty: name a directory")
    for name, interval in RANGES.items():
        if getattr(args, name) is not None:
            check_range(name, getattr(args, name), interval)
    defaults = Args()
    for name, why, needed in ONLY_WITH:
        if getattr(args, name) != getattr(defaults, name) and not needed(args):
            raise ConfigError(f"{as_flag(name)} {why}")
    high = args.clip_eps if args.clip_eps_high is None else args.clip_eps_high
    if args.dual_clip is not None and args.dual_clip <= 1 + high:
        raise ConfigError(f"--dual-clip {args.dual_clip} must exceed 1 + the upper clip epsilon ({1 + high:g}): a "
                          "lower cap would act inside the clip range")
    ranks = launched_ranks()  # each rank samples and trains on its 1/N of the batch
    exact_div(args.num_prompts, ranks, f"--num-prompts (the whole batch's prompts) must split over the {ranks} "
              "torchrun ranks")
    minibatch = exact_div(args.num_prompts * args.num_generations // ranks, args.num_minibatches, "--num-prompts x "
                          f"--num-generations (the batch{' of each rank' if ranks > 1 else ''}) must split into "
                          "--num-minibatches")
    exact_div(minibatch, min(args.micro_batch_size, minibatch), "the minibatch (batch / --num-minibatches) must split "
              "into --micro-batch-size")
    if args.kl_schedule == "adaptive" and args.kl_coef == 0:
        raise ConfigError("--kl-schedule adaptive scales --kl-coef up and down, so it needs --kl-coef > 0")
    if args.kl_schedule == "adaptive" and args.kl_horizon <= 0.2 * args.num_prompts * args.num_generations:
        raise ConfigError(f"--kl-horizon {args.kl_horizon} must exceed 0.2 x the batch "
                          f"({args.num_prompts * args.num_generations} responses), or one step of the adaptive "
                          "controller can make beta negative")
    if args.critic_init == "reward" and not args.reward_model_path:
        raise ConfigError("--critic-init reward needs --reward-model-path")
    if args.critic_init == "reward" and args.shared_critic:
        raise ConfigError("--critic-init reward needs a separate critic; drop --shared-critic")
    if args.ptx_coef > 0 and not args.ptx_path:
        raise ConfigError("--ptx-coef > 0 needs --ptx-path")
    if args.lora_r and ranks > 1:  # FSDP2's units would have to be placed around peft's
        raise ConfigError("--lora-r under torchrun is not supported yet: train LoRA adapters in one process")
    if args.ref_sync_every and args.lora_r:
        raise ConfigError("--ref-sync-every with --lora-r: the reference is the policy with its adapters off, which "
                          "cannot be mixed toward the policy apart from it")
    if args.entropy_target is not None and not args.ent_coef_min <= args.ent_coef <= args.ent_coef_max:
        raise ConfigError(f"--ent-coef {args.ent_coef} must lie in [--ent-coef-min {args.ent_coef_min}, "
                          f"--ent-coef-max {args.ent_coef_max}]: it is where adaptive entropy control starts")
    for option, wanted, package in (("--track", args.track, "tensorboard"), ("--lora-r", args.lora_r, "peft"),
                                    ("--wandb-project", args.wandb_project, "wandb")):
        if wanted and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{option} needs the {package} package: pip install {package}")
    if not args.prompt_field or not args.answer_field or args.prompt_field == args.answer_field:
        raise ConfigError(f"--prompt-field {args.prompt_field!r} and --answer-field {args.answer_field!r} must be two "
                          "different, non-empty field names")
    check_model_path(args.model_name_or_path, "--model-name-or-path")
    if args.reward_model_path:
        check_model_path(args.reward_model_path, "--reward-model-path")


def derived_args(args: Args) -> Args:
    """The flags with the values derived from them: batch and minibatch sizes, the micro-batch capped at the
    minibatch, exact_match as the reward when neither a reward model nor a function is named, and the output and
    resume paths made absolute (a reward function may change the working directory)."""
    resume_from = args.resume_from and os.path.abspath(args.resume_from)
    batch_size = args.num_prompts * args.num_generations
    minibatch_size = batch_size // launched_ranks() // args.num_minibatches
    reward_fn = args.reward_fn or (None if args.reward_model_path else "exact_match")
    return replace(args, batch_size=batch_size, minibatch_size=minibatch_size, reward_fn=reward_fn,
                   micro_batch_size=min(args.micro_batch_size, minibatch_size),
                   output_dir=os.path.abspath(args.output_dir), resume_from=resume_from)


def default_learning_rates(num_params: int) -> tuple[float, float]:
    """(policy, critic) learning rates when the flags give none, by the policy's parameter count: RL steps are about
    ten times smaller than fine-tuning's, which shrink as models grow; the critic, its head new, learns faster."""
    for limit, rates in ((10e6, (3e-4, 1e-3)), (300e6, (1e-5, 1e-4)), (3e9, (3e-6, 1e-5))):
        if num_params < limit:
            return rates
    return 1e-6, 5e-6


# ---------------------------------------------------------------------------------------------------------------------
# Appendix B. Data and rewards: prompt files and datasets, tokenization, the reward functions and the reward model.
# Part 1 reaches it through prompts_of_step and score_responses.


@torch.no_grad()
def score_responses(models: Models, reward: Reward, batch: dict, rows: list[dict], args: Args) -> torch.Tensor:
    """Raw scores: the reward model's if there is one, else the reward function's on the prompt and completion text."""
    completions = models.tokenizer.batch_decode(batch["responses"], skip_special_tokens=True)
    if models.reward_model is not None:
        return reward_model_scores(models, batch, rows, completions, args)
    return call_reward_fn(reward.fn, reward.name, [row["prompt"] for row in rows], completions, rows).to(models.device)


def read_lines(path: str, flag: str) -> list[tuple[int, str]]:
    """(line number, text) of every non-blank line of a UTF-8 file (a leading byte-order mark is fine)."""
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: file not found")
    with open(path, "rb") as f:
        raw_lines = f.read().removeprefix(b"\xef\xbb\xbf").split(b"\n")
    lines = []
    for line_number, raw in enumerate(raw_lines, 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{flag} {path}, line {line_number}: not UTF-8 text "
                              f"(byte {e.start + 1} is {raw[e.start]:#04x})") from None
        if text.strip():
            lines.append((line_number, text.rstrip("\r")))
    return lines


class PromptFile(NamedTuple):
    """The rows of a prompts file, and where each came from, so that every later error can name its file and line
    (or, for what the datasets package read, its row)."""
    flag: str
    path: str
    rows: list[dict]
    line_numbers: list[int]
    unit: str = "line"

    def where(self, i: int) -> str:
        return f"{self.flag} {self.path}, {self.unit} {self.line_numbers[i]}"


REWARD_FN_ARGUMENTS = ("prompts", "completions")  # a row field with one of these names would collide with them
DATASET_FILES = {".parquet": "parquet", ".csv": "csv", ".json": "json"}  # read by the datasets package


def is_dataset_name(path: str) -> bool:
    """A Hugging Face dataset (a local directory laid out like one, or a Hub name: 'gsm8k', 'openai/gsm8k') rather than
    a file; what looks like a file path (a suffix such as .jsonl, or a path of several parts) is read as a file."""
    if os.path.exists(path):
        return os.path.isdir(path)
    looks_like_a_file = Path(path).suffix[1:].isalpha() or path.startswith((".", "/", "~")) or path.count("/") > 1
    return not looks_like_a_file


def read_jsonl_rows(path: str, flag: str) -> tuple[list, list[int]]:
    rows, line_numbers = [], []
    for line_number, line in read_lines(path, flag):
        try:
            rows.append(json.loads(line))
        except (ValueError, RecursionError) as e:  # malformed, an integer of >4300 digits, nested too deep
            reason = getattr(e, "msg", None) or f"{type(e).__name__}: {str(e).split(';')[0]}"
            raise ConfigError(f"{flag} {path}, line {line_number}: not valid JSON ({reason})") from None
        line_numbers.append(line_number)
    return rows, line_numbers


def read_dataset_rows(path: str, flag: str, split: str, config: Optional[str]) -> list[dict]:
    """The rows of a .parquet, .csv or .json file, or of a split of a Hugging Face dataset, through `datasets`."""
    suffix = Path(path).suffix.lower()
    if suffix in DATASET_FILES and not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: file not found")
    try:
        import datasets  # optional: only these inputs need it
    except ImportError:
        raise ConfigError(f"{flag} {path}: reading it needs the datasets package: pip install datasets") from None
    datasets.disable_progress_bars()  # stderr keeps to our one error line: no bars, retries, schema or card messages
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    huggingface_hub.utils.logging.set_verbosity_error()
    text_cells = {}
    if suffix == ".csv":  # cells stay the text they hold: "2" must not become 2.0 because another row's cell is empty
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            header = next(csv.reader(f), [])
        text_cells = dict(features=datasets.Features({column: datasets.Value("string") for column in header}),
                          keep_default_na=False)
    try:
        if suffix in DATASET_FILES:
            dataset = datasets.load_dataset(DATASET_FILES[suffix], data_files=path, split="train", **text_cells)
        else:
            dataset = datasets.load_dataset(path, config, split=split)
    except Exception as e:  # offline, no such dataset, config or split, a malformed file (which the cause names)
        reasons = [f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
                   for error in (e, e.__cause__) if error is not None]
        raise ConfigError(f"{flag} {path}: cannot be read as a dataset ({'; '.join(reasons)})") from None
    return list(dataset)


def load_prompts(path: str, flag: str, prompt_field: str = "prompt", answer_field: str = "answer",
                 split: str = "train", config: Optional[str] = None) -> PromptFile:
    """Prompt rows from a JSONL file or, through the datasets package, a .parquet, .csv or .json file or a Hugging Face
    dataset; --prompt-field and --answer-field name the fields read as 'prompt' and 'answer'. Errors name the file and
    line (the row, for what datasets read)."""
    if Path(path).suffix.lower() in DATASET_FILES or is_dataset_name(path):
        rows = read_dataset_rows(path, flag, split, config)
        prompts = PromptFile(flag, path, rows, list(range(1, len(rows) + 1)), unit="row")
    else:  # JSONL, whatever the file is called
        prompts = PromptFile(flag, path, *read_jsonl_rows(path, flag))
    for i, row in enumerate(prompts.rows):
        for given, name in ((prompt_field, "prompt"), (answer_field, "answer")):
            if given != name and isinstance(row, dict) and name in row:  # which of the two is meant?
                raise ConfigError(f"{prompts.where(i)}: row has a field {name!r} besides {as_flag(name + '_field')} "
                                  f"{given!r}; rename one")
            if given != name and isinstance(row, dict) and given in row:
                row[name] = row.pop(given)
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            named = "" if prompt_field == "prompt" else " (--prompt-field)"
            fields_there = f" (its fields: {', '.join(map(str, row))})" if isinstance(row, dict) and row else ""
            raise ConfigError(f"{prompts.where(i)}: row has no string field {prompt_field!r}{named}{fields_there}")
        clash = next((key for key in REWARD_FN_ARGUMENTS if key in row), None)
        if clash:
            raise ConfigError(f"{prompts.where(i)}: field {clash!r} collides with the reward function's argument of "
                              "that name; rename it")
    if not prompts.rows:
        raise ConfigError(f"{flag} {path}: {'file' if prompts.unit == 'line' else 'dataset'} has no rows")
    return prompts


def load_ptx_texts(path: str) -> PromptFile:
    """The PPO-ptx corpus: one document per non-blank line, kept as a PromptFile of {"prompt": text} rows."""
    lines = read_lines(path, "--ptx-path")
    if not lines:
        raise ConfigError(f"--ptx-path {path}: file has no text")
    return PromptFile("--ptx-path", path, [{"prompt": text} for _, text in lines], [n for n, _ in lines])


def read_prompt_files(args: Args) -> list[Optional[PromptFile]]:
    """[the training prompts, the eval prompts (None with --eval-every 0), PPO-ptx's texts (None without it)], read
    and checked before any model loads."""
    fields_and_config = (args.prompt_field, args.answer_field)
    train = load_prompts(args.prompts_path, "--prompts-path", *fields_and_config, args.dataset_split,
                         args.dataset_config)
    held_out = load_prompts(args.eval_prompts_path, "--eval-prompts-path", *fields_and_config,
                            args.eval_dataset_split, args.dataset_config) if args.eval_every > 0 else None
    return [train, held_out, load_ptx_texts(args.ptx_path) if args.ptx_coef > 0 else None]


class Prompts(NamedTuple):
    """Every prompt of the run as token ids beside its row (the fields the reward reads), and PPO-ptx's texts."""
    rows: list[dict]
    ids: list[list[int]]
    eval_rows: list[dict]
    eval_ids: list[list[int]]
    ptx_ids: list[list[int]]


def tokenize_files(files: list[Optional[PromptFile]], tokenizer, args: Args) -> Prompts:
    train, held_out, ptx = files
    # A pretraining text is cut to the longest sequence the rollout makes, and ends with EOS.
    ptx_ids = [ids[: args.max_prompt_length + args.max_new_tokens - 1] + [tokenizer.eos_token_id]
               for ids in encode(tokenizer, [row["prompt"] for row in ptx.rows], ptx, True)] if ptx else []
    return Prompts(train.rows, tokenize_prompts(tokenizer, train, args), held_out.rows if held_out else [],
                   tokenize_prompts(tokenizer, held_out, args) if held_out else [], ptx_ids)


def prompts_of_step(prompts: Prompts, step: int, args: Args) -> tuple[list[dict], list[list[int]]]:
    """The rows and token ids of the prompts of `step` in the data order, this rank's share of them."""
    share = args.num_prompts // world_size()
    inds = batch_indices(step, args.num_prompts, len(prompts.rows), args.seed)[rank() * share : (rank() + 1) * share]
    return [prompts.rows[i] for i in inds], [prompts.ids[i] for i in inds]


def batch_indices(iteration: int, num_prompts: int, dataset_size: int, seed: int) -> list[int]:
    """Prompts for an iteration: walk a fresh seeded permutation of the dataset per pass. Stateless, so a resumed run
    draws exactly the prompts the uninterrupted run would have drawn."""
    indices, permutations = [], {}
    for position in range(iteration * num_prompts, (iteration + 1) * num_prompts):
        data_epoch, offset = divmod(position, dataset_size)
        if data_epoch not in permutations:
            generator = torch.Generator().manual_seed((seed * 100_003 + data_epoch) % 2**64)
            permutations[data_epoch] = torch.randperm(dataset_size, generator=generator)
        indices.append(int(permutations[data_epoch][offset]))
    return indices


def format_prompt(tokenizer, prompt: str, chat_template: bool) -> str:
    if chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return prompt


def encode(tokenizer, texts: list[str], source: PromptFile, add_special_tokens: bool) -> list[list[int]]:
    """Token ids of each text. A text the tokenizer cannot encode, or that encodes to nothing, is an error naming its
    file and line, and the first character that cannot be encoded on its own (a vocabulary without <unk>)."""
    def encodes(text: str) -> bool:
        try:
            tokenizer(text, add_special_tokens=False)
            return True
        except Exception:
            return False

    encoded = []
    try:  # a few hundred texts a call: one call holds the encodings (ids, offsets, masks) of all it is given
        for start in range(0, len(texts), 256):
            encoded += tokenizer(texts[start : start + 256], add_special_tokens=add_special_tokens)["input_ids"]
    except Exception as e:
        bad = next((i for i, text in enumerate(texts) if not encodes(text)), None)
        if bad is None:
            raise ConfigError(f"{source.flag} {source.path}: the tokenizer failed ({type(e).__name__}: {e})") from None
        char = next((c for c in dict.fromkeys(texts[bad]) if not encodes(c)), None)
        what = f"the character {char!r} (U+{ord(char):04X})" if char else "this text"
        raise ConfigError(f"{source.where(bad)}: the tokenizer cannot encode {what}") from None
    empty = next((i for i, ids in enumerate(encoded) if not ids), None)
    if empty is not None:
        raise ConfigError(f"{source.where(empty)}: the text is empty after tokenization")
    return encoded


def tokenize_prompts(tokenizer, prompts: PromptFile, args: Args) -> list[list[int]]:
    """Token ids of every prompt, truncated from the left to --max-prompt-length (the end of a prompt matters most)."""
    texts = [format_prompt(tokenizer, row["prompt"], args.chat_template) for row in prompts.rows]
    encoded = encode(tokenizer, texts, prompts, add_special_tokens=not args.chat_template)
    truncated = sum(len(ids) > args.max_prompt_length for ids in encoded)
    if truncated:
        print(f"warning: {truncated} of {len(encoded)} prompts in {prompts.flag} are longer than --max-prompt-length="
              f"{args.max_prompt_length} tokens and were truncated from the left")
    return [ids[-args.max_prompt_length :] for ids in encoded]


def left_pad(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of the sequences, padded on the left to the longest."""
    width = max(len(s) for s in sequences)
    input_ids = torch.tensor([[pad_id] * (width - len(s)) + s for s in sequences], device=device)
    attention_mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], device=device)
    return input_ids, attention_mask


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match_reward(prompts: list[str], completions: list[str], answer: list, **_) -> list[float]:
    """1.0 if the completion, stripped, equals the row's answer, else 0.0. Numbers compare as numbers: "982", 982 and
    982.0 (as parquet or CSV may hold the answer) are equal, and "982.5" and 982 are not."""
    def as_number(x) -> Optional[float]:
        text = str(x).strip()
        return float(text) if _NUMBER.fullmatch(text) else None

    def equal(c, a):
        n, m = as_number(c), as_number(a)
        return c.strip() == str(a).strip() if n is None or m is None else n == m

    return [float(equal(c, a)) for c, a in zip(completions, answer)]


def last_number_reward(prompts: list[str], completions: list[str], answer: list, **_) -> list[float]:
    """1.0 if the last number in the completion equals the last number in the row's answer (math-style)."""
    def last_number(text):
        found = _NUMBER.findall(str(text).replace(",", ""))
        return float(found[-1]) if found else None

    scores = []
    for completion, a in zip(completions, answer):
        predicted, expected = last_number(completion), last_number(a)
        scores.append(float(predicted is not None and expected is not None and abs(predicted - expected) < 1e-6))
    return scores


BUILTIN_REWARD_FNS = {"exact_match": exact_match_reward, "last_number": last_number_reward}


class Reward(NamedTuple):
    fn: Optional[Callable]  # None: the reward model gives the reward
    name: str


def load_reward(args: Args, prompt_files: list[PromptFile]) -> Reward:
    """--reward-fn, imported, after checking that a built-in one finds its answer in every row."""
    if args.reward_model_path:
        return Reward(None, args.reward_model_path)
    if args.reward_fn in BUILTIN_REWARD_FNS:
        for prompts in prompt_files:
            missing = next((i for i, row in enumerate(prompts.rows) if row.get("answer") is None), None)
            if missing is not None:
                raise ConfigError(f"{prompts.where(missing)}: --reward-fn {args.reward_fn} needs the field "
                                  f"{args.answer_field!r} (--answer-field) in every row")
    return Reward(load_reward_fn(args.reward_fn), args.reward_fn)


def load_reward_fn(spec: str) -> Callable:
    """A built-in name, 'package.module:function' or 'path/to/file.py:function'."""
    if spec in BUILTIN_REWARD_FNS:
        return BUILTIN_REWARD_FNS[spec]
    module_name, _, function_name = spec.rpartition(":")
    if not module_name or not function_name:
        raise ConfigError(f"--reward-fn {spec!r}: expected one of {sorted(BUILTIN_REWARD_FNS)}, module:function or "
                          "file.py:function")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise FileNotFoundError(f"no file {module_name}")
            module_spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        fn = getattr(module, function_name)
    except Exception as e:
        raise ConfigError(f"--reward-fn {spec!r} cannot be imported: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"--reward-fn {spec!r} is not callable")
    return fn


def call_reward_fn(fn: Callable, name: str, prompts: list[str], completions: list[str], rows: list[dict]
                   ) -> torch.Tensor:
    """fn(prompts, completions, **row_fields), checked to be one finite float32 number per completion."""
    keys = dict.fromkeys(key for row in rows for key in row if key != "prompt")
    try:
        # its own copies: a function that edits its lists in place changes nothing the next one sees
        returned = fn(list(prompts), list(completions), **{key: [row.get(key) for row in rows] for key in keys})
        returned = returned.tolist() if hasattr(returned, "tolist") else returned  # a tensor or array
        # a dict would be read as its keys, a set in no particular order
        in_order = isinstance(returned, Iterable) and not isinstance(returned, (str, bytes, dict, set))
        scores = list(returned) if in_order else None  # a generator runs here
    except SecondCtrlC:
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # sys.exit() in a reward function ends no run silently
        raise ConfigError(f"reward function {name!r} raised {type(e).__name__}: {e}") from None
    if scores is None:
        shown = repr(returned) if len(repr(returned)) <= 40 else type(returned).__name__
        raise ConfigError(f"reward function {name!r} returned {shown}, expected a list of {len(completions)} numbers")
    if len(scores) != len(completions):
        raise ConfigError(f"reward function {name!r} returned {len(scores)} values for {len(completions)} completions")
    text = next((s for s in scores if isinstance(s, (str, bytes))), None)
    if text is not None:  # float("1.5") would succeed: a score must be a number, not text that looks like one
        raise ConfigError(f"reward function {name!r} returned a non-number: {text!r} is text")
    try:
        scores = [float(s) for s in scores]
    except OverflowError:
        raise ConfigError(f"reward function {name!r} returned an integer too large for float32") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"reward function {name!r} returned a non-number: {e}") from None
    for i, score in enumerate(scores):
        if not math.isfinite(score):
            raise ConfigError(f"reward function {name!r} returned a non-finite value ({score}) at index {i}")
        if abs(score) > torch.finfo(torch.float32).max:
            raise ConfigError(f"reward function {name!r} returned {score:g} at index {i}, too large for float32")
    return torch.tensor(scores, dtype=torch.float32)


def reward_model_texts(models: Models, rows: list[dict], completions: list[str], has_eos: torch.Tensor, args: Args
                       ) -> tuple[list[str], bool]:
    """Prompt + response as text in the reward model's own format, and whether that format already holds the special
    tokens: its chat template when the run uses one (a response cut off before EOS leaves the assistant turn open),
    else plain concatenation ending with its EOS token when the response ended with EOS."""
    tokenizer = models.reward_tokenizer
    if args.chat_template and tokenizer.chat_template:
        return [tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]},
                                               {"role": "assistant", "content": c}],
                                              tokenize=False, continue_final_message=not ended)
                for row, c, ended in zip(rows, completions, has_eos.tolist())], True
    eos = tokenizer.eos_token or ""
    return [format_prompt(models.tokenizer, row["prompt"], args.chat_template) + c + (eos if ended else "")
            for row, c, ended in zip(rows, completions, has_eos.tolist())], False


@torch.no_grad()
def reward_model_scores(models: Models, batch: dict, rows: list[dict], completions: list[str], args: Args
                        ) -> torch.Tensor:
    """The reward model's scalar at the last real token of prompt + response (the EOS when there is one). With the
    policy's vocabulary it scores the sampled ids; otherwise the text, tokenized anew for the reward model."""
    if models.same_vocab:
        sequences, mask = batch["query_responses"], batch["attention_mask"]
    else:
        texts, templated = reward_model_texts(models, rows, completions, batch["has_eos"], args)
        encoded = models.reward_tokenizer(texts, padding=True, return_tensors="pt", padding_side="left",
                                          add_special_tokens=not templated)  # a template already holds BOS
        sequences, mask = encoded["input_ids"].to(models.device), encoded["attention_mask"].to(models.device)
    scores = []
    for rows_ in micro_batches(len(sequences), args.micro_batch_size):
        per_position = scalar_forward(models.reward_model, sequences[rows_], mask[rows_])
        last = mask.shape[1] - 1 - mask[rows_].flip(1).long().argmax(1)  # the last position attended
        scores.append(per_position[torch.arange(len(per_position)), last])
    return torch.cat(scores)


# ---------------------------------------------------------------------------------------------------------------------
# Appendix C. Models and LoRA: the tokenizer, the policy, the reference, the reward model and the critic, loaded and
# held in Models, and the optimizers' schedule. Part 1 reaches it through models.reference(), models.autocast() and
# learning_rate_at.


def learning_rate_at(iteration: int, num_iterations: int, base_lr: float, warmup: int, anneal: bool) -> float:
    """The base rate times a linear warmup over the first `warmup` iterations and, with anneal, times a linear decay
    from 1 at the first iteration to 0 after the last."""
    lr = base_lr * min(1.0, (iteration + 1) / warmup) if warmup > 0 else base_lr
    return lr * (1.0 - iteration / num_iterations) if anneal else lr


@dataclass
class Models:
    """The four models of RLHF PPO and the tokenizer. With LoRA, three: the reference is the policy with its adapters
    off. With --shared-critic the critic is a value head on the policy's last hidden state."""
    tokenizer: transformers.PreTrainedTokenizerBase
    policy: nn.Module
    ref_policy: Optional[nn.Module]  # None with LoRA
    reward_model: Optional[nn.Module]  # None with a reward function
    reward_tokenizer: Optional[transformers.PreTrainedTokenizerBase]
    critic: Optional[nn.Module]  # None with --shared-critic
    value_head: Optional[nn.Linear]  # only with --shared-critic
    eos_token_ids: list[int]
    device: torch.device
    autocast_dtype: Optional[torch.dtype]  # bfloat16, or None for float32
    lora: bool
    same_vocab: bool  # the reward model reads the policy's token ids as they are

    def critic_parameters(self) -> list[nn.Parameter]:
        critic = self.value_head if self.value_head is not None else self.critic
        return [p for p in critic.parameters() if p.requires_grad]  # with LoRA, the adapters and the score head

    @contextlib.contextmanager
    def reference(self):
        """pi_ref: the frozen copy of the initial policy, or with LoRA the policy with its adapters off."""
        if self.ref_policy is not None:
            yield self.ref_policy
        else:
            with self.policy.disable_adapter():
                yield self.policy

    def autocast(self):
        """Forward passes compute in --dtype; trained weights stay float32 (see load_model)."""
        return torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None)

    def train(self) -> None:
        """Train mode for the update: dropout stays off (but --lora-dropout), gradient checkpointing turns on."""
        for model in (self.policy, self.critic):
            if model is not None:
                model.train()

    def eval(self) -> None:
        for model in (self.policy, self.critic):
            if model is not None:
                model.eval()


def load_models(args: Args, device: torch.device, resume: Optional[Path]) -> Models:
    """The models of the run, from --model-name-or-path and --reward-model-path, or from the checkpoint resumed (which
    holds the whole policy and critic, or with LoRA only their adapters). Under torchrun every rank loads the full
    weights, then keeps its shard (or, without --fsdp, its replica)."""
    tokenizer, lora = load_tokenizer(args), args.lora_r > 0
    from_checkpoint = resume is not None and not lora
    policy = load_model(AutoModelForCausalLM, str(resume / "policy") if from_checkpoint else args.model_name_or_path,
                        "--resume-from" if from_checkpoint else "--model-name-or-path", args, device, trainable=True)
    stop_ids = eos_token_ids(tokenizer, policy, args.chat_template)
    if lora:
        policy = add_lora(policy, args, resume / "policy" if resume else None)
    policy = shard(policy, args)  # each model sharded as soon as it is loaded: one model's full weights at a time
    synced = resume is not None and args.ref_sync_every > 0  # the checkpoint's reference, mixed toward the policy
    ref_policy = None if lora else shard(load_model(
        AutoModelForCausalLM, str(resume / "reference") if synced else args.model_name_or_path,
        "--resume-from" if synced else "--model-name-or-path", args, device, trainable=False), args)
    reward_model = reward_tokenizer = None
    if args.reward_model_path:
        reward_model = shard(load_scalar_model(args.reward_model_path, "--reward-model-path", args, device,
                                               trainable=False), args)
        reward_tokenizer = load_reward_tokenizer(args.reward_model_path)
    same_vocab = reward_tokenizer is not None and reward_tokenizer.get_vocab() == tokenizer.get_vocab()
    models = Models(tokenizer, policy, ref_policy, reward_model, reward_tokenizer, None, None, stop_ids, device,
                    torch.bfloat16 if args.dtype == "bfloat16" else None, lora, same_vocab)
    if args.critic_init == "reward" and not models.same_vocab:
        raise ConfigError("--critic-init reward: the reward model's tokenizer differs from the policy's, so the critic "
                          "cannot read the policy's tokens; use --critic-init policy")
    if args.shared_critic:
        models.value_head = load_value_head(policy.config.get_text_config().hidden_size, device, resume)
    else:
        models.critic = shard(load_critic(args, device, resume), args)
    return models


def load_critic(args: Args, device: torch.device, resume: Optional[Path]) -> nn.Module:
    """A separate critic: the policy with a fresh scalar head, or the reward model, or the checkpoint's critic."""
    initial = args.reward_model_path if args.critic_init == "reward" else args.model_name_or_path
    from_checkpoint = resume is not None and args.lora_r == 0
    path = str(resume / "critic") if from_checkpoint else initial
    # A fresh head starts the same on every rank: all ranks are seeded alike until the models are built.
    critic = load_scalar_model(path, "--resume-from" if from_checkpoint else "--critic-init", args, device,
                               trainable=True, fresh_head=not from_checkpoint and args.critic_init == "policy")
    if args.lora_r:  # its own adapters, and its score head trained in full
        critic = add_lora(critic, args, resume / "critic" if resume else None, task_type="SEQ_CLS")
    return critic


def load_value_head(hidden_size: int, device: torch.device, resume: Optional[Path]) -> nn.Linear:
    """--shared-critic's value head on the policy's last hidden state: zero at the start, or the checkpoint's."""
    value_head = nn.Linear(hidden_size, 1).to(device)
    nn.init.zeros_(value_head.weight)
    nn.init.zeros_(value_head.bias)
    if resume:
        try:
            value_head.load_state_dict(torch.load(resume / "value_head.pt", map_location=device))
        except Exception as e:
            raise ConfigError(f"--resume-from {resume}: value_head.pt cannot be loaded ({type(e).__name__})") from None
    return value_head


def check_model_path(path: str, flag: str) -> None:
    """A path that looks local must exist; anything else is treated as a Hub name."""
    looks_local = path.startswith((".", "/", "~")) or path.count("/") > 1
    if looks_local and not os.path.isdir(os.path.expanduser(path)):
        raise ConfigError(f"{flag} {path}: no such directory")


def from_pretrained(cls, path: str, flag: str, **kwargs):
    try:
        return cls.from_pretrained(path, **kwargs)
    except Exception as e:  # missing or damaged files, a directory without a usable tokenizer or config, ...
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"{flag} {path}: cannot load ({type(e).__name__}: {first_line})") from None


def disable_dropout(model: nn.Module) -> None:
    """RL needs pi_old and pi_theta evaluated identically: zero every dropout, in modules and in the config. The update
    runs in train mode, and attention layers (Llama, Qwen, Mistral, ...) keep config.attention_dropout in a plain float
    attribute that they apply in train mode, so those floats are zeroed too."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
                setattr(module, key, 0.0)
    for key, value in vars(model.config).items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(model.config, key, 0.0)


def load_tokenizer(args: Args):
    tokenizer = from_pretrained(AutoTokenizer, args.model_name_or_path, "--model-name-or-path")
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"--model-name-or-path {args.model_name_or_path}: tokenizer has no eos_token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # safe: masks come from the first EOS, never from pad ids
    tokenizer.padding_side = "left"
    if args.chat_template and not tokenizer.chat_template:
        raise ConfigError(f"--chat-template: the tokenizer of {args.model_name_or_path} has no chat template")
    return tokenizer


def load_reward_tokenizer(path: str):
    tokenizer = from_pretrained(AutoTokenizer, path, "--reward-model-path")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def end_of_turn_token_id(tokenizer) -> Optional[int]:
    """The special token that closes an assistant turn in the chat template (<|im_end|> in ChatML), read from a
    rendered conversation: the first special token after the assistant's reply. A base model's EOS is often another
    token (<|endoftext|> for Qwen2.5 base), and a response that ran past the end of its turn would be trained on what
    follows."""
    reply = "Hello there."
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": reply}], tokenize=False)
        after = text[text.rfind(reply) + len(reply) :] if reply in text else ""
        after_ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    except Exception:  # a template that insists on other roles, or a vocabulary that cannot encode what follows
        return None
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return next((i for i in after_ids if i in special), None)


def eos_token_ids(tokenizer, model, chat_template: bool) -> list[int]:
    """The ids that end a response: EOS from the tokenizer and the model's generation config (chat models often stop
    on several), and with --chat-template the token that closes the assistant's turn."""
    ids = {tokenizer.eos_token_id}
    configured = model.generation_config.eos_token_id
    ids.update(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    end_of_turn = end_of_turn_token_id(tokenizer) if chat_template else None
    if end_of_turn is not None:
        ids.add(end_of_turn)
    return sorted(ids)


def load_model(cls, path: str, flag: str, args: Args, device: torch.device, trainable: bool, dtype=torch.float32,
               fresh_head: bool = False, **kwargs):
    """Weights in float32 unless told otherwise: forward passes compute in --dtype under autocast (Models.autocast),
    so trained weights can absorb updates far below bfloat16's resolution, and the frozen reference, stored like the
    policy, computes exactly as the policy did before training (KL = 0 at the start). Weights missing from the
    checkpoint would start random (a causal LM given as a reward model): an error, unless fresh_head allows a new
    value head (a critic made from the policy)."""
    model, info = from_pretrained(cls, path, flag, dtype=dtype, output_loading_info=True, **kwargs)
    missing = sorted(key for key in info["missing_keys"] if not (fresh_head and key.startswith("score.")))
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ConfigError(f"{flag} {path}: the checkpoint has no weights for {shown}, which would start random "
                          f"(is it a {cls.__name__.removeprefix('AutoModelFor')} model?)")
    disable_dropout(model)
    model.to(device).eval()
    if trainable and args.gradient_checkpointing:
        model.activation_checkpointing_enable()  # active only in train mode, i.e. in the update, not in generate
    model.requires_grad_(trainable)
    return model


def load_scalar_model(path: str, flag: str, args: Args, device: torch.device, trainable: bool,
                      fresh_head: bool = False):
    """Backbone + scalar head (AutoModelForSequenceClassification, one label): the reward model (frozen, stored in
    --dtype) and the critic (float32 weights, like the policy)."""
    dtype = torch.float32 if trainable else getattr(torch, args.dtype)
    model = load_model(AutoModelForSequenceClassification, path, flag, args, device, trainable, dtype, fresh_head,
                       num_labels=1)
    if not isinstance(getattr(model, "score", None), nn.Linear):
        raise ConfigError(f"{flag} {path}: {type(model).__name__} has no linear `score` head")
    return model


def add_lora(model: nn.Module, args: Args, saved_adapters: Optional[Path], task_type: str = "CAUSAL_LM") -> nn.Module:
    """The model with trainable low-rank adapters on its linear layers (peft), its own weights frozen except a critic's
    score head (task_type SEQ_CLS trains it in full); a resumed run takes the checkpoint's adapters.
    model.disable_adapter() gives back the untouched model: the policy's is the reference."""
    import peft  # optional: check_args made sure it exists

    targets = args.lora_target_modules or ["all-linear"]
    if model.config.get_text_config().tie_word_embeddings and any("lm_head" in t or "embed" in t for t in targets):
        raise ConfigError(f"--lora-target-modules {' '.join(targets)}: the output head shares its weights with the "
                          "embeddings in this model, so merging an adapter on one would change the other")
    names = [name for name, _ in model.named_modules()]  # peft matches a name to a module's name or its suffix
    unmatched = [t for t in targets if t != "all-linear" and not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:  # peft itself complains only when no name matches at all
        raise ConfigError(f"--lora-target-modules: {' '.join(unmatched)} matches no module of this model")
    with warnings.catch_warnings():  # peft 0.21 asks transformers 5 for is_gradient_checkpointing, since renamed
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        try:
            if saved_adapters is not None:
                model = peft.PeftModel.from_pretrained(model, saved_adapters, is_trainable=True)
            else:
                config = peft.LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                         target_modules="all-linear" if targets == ["all-linear"] else targets,
                                         task_type=task_type)
                model = peft.get_peft_model(model, config)
        except (ValueError, OSError) as e:  # no module of that name; no adapter files in the checkpoint
            flag = (f"--resume-from {saved_adapters.parent}" if saved_adapters
                    else f"--lora-target-modules {' '.join(targets)}")
            raise ConfigError(f"{flag}: peft cannot place the adapters ({type(e).__name__}: "
                              f"{str(e).splitlines()[0]})") from None
    if args.gradient_checkpointing:  # the frozen embeddings' output must carry a gradient into checkpointed layers
        model.enable_input_require_grads()
    return model


def make_optimizers(models: Models, args: Args) -> tuple[dict, dict]:
    """AdamW for the policy and for the critic (with LoRA, over the adapters), and their base learning rates: the
    flags', or by the policy's size (default_learning_rates), said on the console."""
    num_params = sum(p.numel() for p in models.policy.parameters())  # a sharded tensor counts whole
    by_size = dict(zip(("policy", "critic"), default_learning_rates(num_params)))
    rates = {"policy": args.learning_rate, "critic": args.critic_learning_rate}
    for name, flag in (("policy", "--learning-rate"), ("critic", "--critic-learning-rate")):
        if rates[name] is None:
            rates[name] = by_size[name]
            print(f"{name} learning rate {by_size[name]:g}, by the policy's size ({num_params / 1e6:.1f}M parameters); "
                  f"{flag} sets another" + ("; this is a full fine-tuning rate, LoRA usually wants about 10x"
                                            if args.lora_r else ""))
    trained = {"policy": [p for p in models.policy.parameters() if p.requires_grad],
               "critic": models.critic_parameters()}
    # fused: one kernel per step over all tensors, without a temporary per tensor
    optimizers = {name: torch.optim.AdamW(trained[name], lr=rates[name], eps=args.adam_eps,
                                          weight_decay=args.weight_decay, fused=True) for name in trained}
    return optimizers, rates


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Left padding: the first real token is position 0."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def scalar_forward(model, query_responses, attention_mask) -> torch.Tensor:
    """Per-position scalar from a sequence-classification model: head(backbone hidden states), shape (B, L)."""
    if hasattr(model, "get_base_model"):  # LoRA: the model under peft's wrapper, its adapters in place
        model = model.get_base_model()
    hidden = model.base_model(input_ids=query_responses, attention_mask=attention_mask,
                              position_ids=position_ids_from(attention_mask), use_cache=False).last_hidden_state
    return model.score(hidden).squeeze(-1).float()


# ---------------------------------------------------------------------------------------------------------------------
# Appendix D. Performance: each function computes what its docstring's plain form says, in less time or memory (the
# measurements: benchmarks/README.md). Part 1 reaches it through policy_forward, micro_batches and generate.


def micro_batches(num_rows: int, micro_batch_size: int) -> list[slice]:
    """The rows of each micro-batch, in turn: a forward pass runs micro_batch_size sequences at a time."""
    return [slice(start, start + micro_batch_size) for start in range(0, num_rows, micro_batch_size)]


def response_states(model, query_responses, attention_mask, context_length: int, hidden: bool = False):
    """(states, head, hidden_states): what the response tokens' log-probs come from. Where output_head finds a plain
    head, the final hidden states of the positions that predict the response tokens and that head, so that
    logprobs_and_entropy computes their logits a chunk at a time; else the model's logits at those positions alone
    (logits_to_keep: no prompt logits, no copy) and None. hidden_states: those hidden states, for a shared critic."""
    head = output_head(model)
    positions = torch.arange(context_length - 1, query_responses.shape[1] - 1, device=query_responses.device)
    out = model(input_ids=query_responses, attention_mask=attention_mask, use_cache=False,
                position_ids=position_ids_from(attention_mask), output_hidden_states=hidden or head is not None,
                logits_to_keep=positions[:0] if head is not None else positions)  # no logits when the head is ours
    states = out.hidden_states[-1][:, context_length - 1 : -1] if hidden or head is not None else None
    return (states if head is not None else out.logits), head, (states if hidden else None)


def output_head(model) -> Optional[nn.Module]:
    """The output head, when the logits are exactly head(final hidden state) and outnumber it. None, and the logits
    come from the model, for a vocabulary no larger than the hidden state (nothing to save), for models that cap or
    scale their logits (Gemma 2 and 3, Cohere, Granite, Falcon-H1) or whose head is not a plain Linear, and under
    torchrun (outside the forward pass the head's weight is a shard)."""
    config, head = model.config, model.get_output_embeddings()
    scaled = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")
    if world_size() > 1 or any(getattr(config, key, None) for key in scaled):
        return None
    return head if type(head) is nn.Linear and head.out_features > head.in_features else None  # no subclass's forward


def logprobs_and_entropy(states: torch.Tensor, head: Optional[nn.Module], tokens: torch.Tensor, temperature: float,
                         entropy: Optional[bool]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log pi(y_t) of the (B, T) tokens, and unless entropy is None H_t (with a gradient only if entropy is True), from
    response_states' states and head. Equals  logp = log_softmax(head(states) / T);  logp.gather(tokens),
    -(logp.exp() * logp).sum(-1)  without holding the logits."""
    x = states.reshape(-1, states.shape[-1])
    weight, bias = (head.weight, head.bias) if head is not None else (None, None)
    logprobs, h = ResponseLogprobs.apply(x, weight, bias, tokens.reshape(-1), temperature, entropy is not None,
                                         torch.is_grad_enabled())
    if entropy is None:
        return logprobs.view(tokens.shape), None
    return logprobs.view(tokens.shape), (h if entropy else h.detach()).view(tokens.shape)


def log_softmax_at(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature), in float32."""
    z = logits.float() / temperature if temperature != 1 else logits.float()
    return z.log_softmax(-1)  # one fused pass, where logsumexp and a subtraction take two


LOGITS_CHUNK_ELEMENTS = 2**25  # logits per chunk of ResponseLogprobs: float32 temporaries of 128 MB each
KEPT_LOGPROBS_ELEMENTS = 2**27  # up to 512 MB of a micro-batch's log-softmax kept for its backward pass


class ResponseLogprobs(torch.autograd.Function):
    """log pi(y_t) and H_t of softmax(z), z = head(x_t) / temperature in float32, LOGITS_CHUNK_ELEMENTS at a time.
    x is (N, hidden) final hidden states with the output head's weight (and bias), or (N, vocab) logits with weight
    None. The logits (N x vocab floats) never exist whole, nor their gradient: the backward pass recomputes each chunk
    from x (one more output-head matmul), unless the log-softmax of all N positions fits in KEPT_LOGPROBS_ELEMENTS and
    the forward pass kept it, with  d log pi(y) / dz = onehot(y) - p  and  d H / dz = -p * (log p + H)."""

    @staticmethod
    def forward(ctx, x, weight, bias, tokens, temperature: float, with_entropy: bool, for_backward: bool):
        vocab = len(weight) if weight is not None else x.shape[-1]
        per_chunk = max(1, LOGITS_CHUNK_ELEMENTS // vocab)
        keep = for_backward and weight is not None and len(x) * vocab <= KEPT_LOGPROBS_ELEMENTS
        ctx.kept = []  # each chunk's log-softmax, for the backward pass, when keep
        logprobs = torch.empty(len(x), dtype=torch.float32, device=x.device)
        entropy = torch.empty_like(logprobs) if with_entropy else logprobs.new_empty(0)
        ctx.compute_dtype = x.dtype
        for i in range(0, len(x), per_chunk):
            rows = slice(i, i + per_chunk)
            logits = x[rows] if weight is None else nn.functional.linear(x[rows], weight, bias)
            ctx.compute_dtype = logits.dtype  # autocast's, if on
            logp = log_softmax_at(logits, temperature)
            del logits  # each chunk's temporaries go before the next chunk's come
            logprobs[rows] = logp.gather(-1, tokens[rows].unsqueeze(-1)).squeeze(-1)
            if with_entropy:
                entropy[rows] = entropy_from_logprobs(logp)
            if keep:
                ctx.kept.append(logp)
            del logp
        ctx.save_for_backward(x, weight, bias, tokens, entropy)
        ctx.temperature, ctx.per_chunk = temperature, per_chunk
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        x, weight, bias, tokens, entropy = ctx.saved_tensors
        t = ctx.temperature
        w = weight.to(ctx.compute_dtype) if weight is not None else None  # the forward's matmul ran in this dtype
        needs_x, needs_w, needs_b = ctx.needs_input_grad[:3]  # with LoRA the head is frozen: no weight gradient
        grad_x = torch.empty_like(x) if needs_x else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if needs_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if needs_b else None
        for k, i in enumerate(range(0, len(x), ctx.per_chunk)):
            rows = slice(i, i + ctx.per_chunk)
            xs = x[rows].to(ctx.compute_dtype)
            if ctx.kept and ctx.kept[k] is not None:  # (a second backward pass, retain_graph's, recomputes)
                logp, ctx.kept[k] = ctx.kept[k], None  # the forward's; in place from here on, as is a recomputed one
            else:
                logits = xs if w is None else nn.functional.linear(xs, w, None if bias is None else bias.to(w.dtype))
                logp = log_softmax_at(logits, t)  # in place from here on: one chunk-sized tensor
                del logits
            g = (grad_logprobs[rows] / t).unsqueeze(-1) if grad_logprobs is not None else logp.new_zeros(len(logp), 1)
            if grad_entropy is None:
                dz = logp.exp_().mul_(-g)  # -p g
            else:  # -p (g + (log p + H) g_H)
                p = logp.exp()
                dz = logp.add_(entropy[rows].unsqueeze(-1)).mul_((grad_entropy[rows] / t).unsqueeze(-1))
                dz = dz.add_(g).mul_(p).neg_()
                del p
            dz = dz.scatter_add_(-1, tokens[rows].unsqueeze(-1), g).to(ctx.compute_dtype)  # + onehot(y) g
            if grad_x is not None:
                grad_x[rows] = dz if w is None else dz @ w
            if grad_w is not None and dz.dtype == grad_w.dtype:
                grad_w.addmm_(dz.T, xs)  # in place: no (vocab, hidden) temporary per chunk
            elif grad_w is not None:
                grad_w += (dz.T @ xs).float()  # autocast: the matmul in its dtype, the sum in float32
            if grad_b is not None:
                grad_b += dz.sum(0).float()
            del logp, dz
        return (grad_x, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None)


@torch.no_grad()
def sample(model, input_ids, attention_mask, max_new_tokens: int, eos_token_ids: list[int], greedy: bool,
           temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> torch.Tensor:
    """Autoregressive sampling, y_t ~ next_token_probs(logits_t) (or its argmax, greedy), with the KV cache: one
    forward pass over the left-padded prompts, then one token per row per step, until every row has sampled an EOS or
    max_new_tokens. Returns the (B, T) tokens; the caller masks what follows a row's first EOS. Our own loop rather
    than transformers' generate: the model's shipped generation config (repetition penalties, its own top-k) cannot
    make the sampler differ from the distribution trained on."""
    model.eval()
    eos = torch.tensor(eos_token_ids, device=input_ids.device)
    positions = position_ids_from(attention_mask)
    tokens = []
    ended = torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)
    with unsharded(model):  # under torchrun: each rank decodes its own rows, waiting for none
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                    logits_to_keep=1)
        for step in range(max_new_tokens):
            logits = out.logits[:, -1]
            token = logits.argmax(-1) if greedy else sample_from(next_token_probs(logits, temperature, top_p, top_k,
                                                                                  min_p))
            tokens.append(token)
            ended |= torch.isin(token, eos)
            if step == max_new_tokens - 1 or ended.all():  # one wait for the device per token: stop when all ended
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(token), 1)], 1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=token.unsqueeze(1), attention_mask=attention_mask, position_ids=positions,
                        cache=out.cache, use_cache=True)
    return torch.stack(tokens, 1)


def next_token_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, min_p: float = 0.0
                     ) -> torch.Tensor:
    """The sampling distribution, (B, vocab): softmax(logits / temperature) cut to the top_k most likely tokens, then to
    the nucleus (the most likely tokens until their probability reaches top_p), then to those at least min_p times as
    likely as the most likely, as transformers orders them. Cut tokens get probability 0 and the rest are not
    renormalised: sample_from draws in proportion."""
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the more likely tokens already reach top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    if min_p > 0:  # min-p (Nguyen et al. 2024, arXiv:2407.01082): relative to the most likely token that is left
        probs = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs


def sample_from(probs: torch.Tensor) -> torch.Tensor:
    """One token per row, in proportion to probs, as torch.multinomial(probs, 1) draws: the first whose cumulative
    probability exceeds u * total, u ~ U[0, 1) (a token of probability 0 has an empty interval). A cumulative sum and
    a binary search, where multinomial is slow at a real vocabulary on a CPU."""
    cdf = probs.cumsum(-1)
    u = torch.rand(len(probs), 1, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


# ---------------------------------------------------------------------------------------------------------------------
# Appendix E. Distributed: torchrun and FSDP2. In one process every function here is the identity or returns at once.
# Part 1 reaches it through all_sum, gather_cat, backward and clip_grad_norm; sample through unsharded.


def launched_ranks() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0")) if launched_ranks() > 1 else 0  # RANK: set by torchrun


def init_distributed() -> torch.device:
    """This rank's device. Under torchrun, first join the process group on its LOCAL_RANK GPU (NCCL, and gloo for a few
    counts kept on the CPU; gloo alone without GPUs); only rank 0 prints (the others' errors still reach stderr)."""
    cuda = torch.cuda.is_available()
    if launched_ranks() == 1:
        return torch.device("cuda" if cuda else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    if rank() != 0:
        sys.stdout = open(os.devnull, "w")
    return torch.device("cuda", local_rank) if cuda else torch.device("cpu")


def all_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over the ranks (a new tensor)."""
    if world_size() > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


def all_max(value: int) -> int:
    if world_size() > 1:
        box = torch.tensor(value)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        value = int(box)
    return value


def barrier() -> None:
    """Every rank waits here, e.g. until rank 0 has written a checkpoint: none may exit before it is in place."""
    if world_size() > 1:
        dist.barrier()


def all_gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    if world_size() == 1:
        return [obj]
    parts = [None] * world_size()
    dist.all_gather_object(parts, obj)
    return parts


def gather_cat(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x concatenated along dim 0, in rank order; sizes may differ."""
    return x if world_size() == 1 else torch.cat(all_gather_objects(x.detach().cpu())).to(x.device)


def on_rank_zero(fn, *fn_args):
    """fn on rank 0 only (the output directory's checks and lock); a ConfigError there stops every rank with its
    line."""
    result, error = None, None
    if rank() == 0:
        try:
            result = fn(*fn_args)
        except ConfigError as e:
            error = str(e)
    if world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise ConfigError(error)
    return result


def backward(loss: torch.Tensor) -> None:
    """loss.backward(). Under torchrun, scaled by the number of ranks: the loss is already divided by the whole batch's
    counts (all_sum), and FSDP averages the gradients over the ranks."""
    (loss * world_size()).backward()


def clip_grad_norm(parameters, max_norm: float, name: str) -> float:
    """clip_grad_norm_, returning the norm before clipping. A non-finite norm stops the run before the optimizer can
    spread it into the weights."""
    norm = nn.utils.clip_grad_norm_(parameters, max_norm)
    norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()  # a DTensor under FSDP
    if not math.isfinite(norm):
        raise NonFiniteLoss(f"{name} gradient norm {norm}")
    return norm


def shard(model: nn.Module, args: Args) -> nn.Module:
    """FSDP2 over the ranks: one fully_shard unit per decoder layer, then the root. With --fsdp the mesh is (1 replica,
    N shards): each rank stores 1/N of the weights, gradients and optimizer state; without it (N replicas, 1 shard):
    DDP's full copies with averaged gradients, through the same code. Weights are gathered in float32 and compute in
    --dtype under autocast, as in one process (bfloat16 gathers would round the norm weights)."""
    if world_size() == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    shape = (1, world_size()) if args.fsdp else (world_size(), 1)
    mesh = init_device_mesh(model.device.type, shape, mesh_dim_names=("replicate", "shard"))
    layer_classes = set(model._no_split_modules or [])  # transformers' name for the decoder layer class
    for layer in [m for m in model.modules() if type(m).__name__ in layer_classes]:
        fully_shard(layer, mesh=mesh)
    if hasattr(model, "score"):  # scalar_forward calls the backbone and the head one by one: each needs its own unit
        for part in (model.base_model, model.score):
            fully_shard(part, mesh=mesh, reshard_after_forward=True)
    # The root too is resharded after each forward: after one without backward (the sampler's log-probs) every
    # parameter is back to its shard, which is what model.parameters() then returns (to the optimizer, the norm clip).
    return fully_shard(model, mesh=mesh, reshard_after_forward=True)


@contextlib.contextmanager
def unsharded(model: nn.Module):
    """The full weights, gathered once for a whole sample() and kept until it ends, not once per decoded token: no
    collective runs in between, so that ranks decode different numbers of tokens independently."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()


def optimizer_state(model: nn.Module, optimizer) -> Optional[dict]:
    """An optimizer's state to save: in one process its state_dict(); under torchrun the whole of it, gathered to
    rank 0's CPU and keyed by parameter name."""
    if not optimizer.state:  # never stepped (the policy's during critic warmup): nothing to save
        return None
    if world_size() == 1 or not isinstance(model, FSDPModule):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: nn.Module, optimizer, saved: Optional[dict]) -> None:
    if saved is None:  # saved before its first step; loading an empty state would fake one (Adam's step count)
        return
    if world_size() == 1 or not isinstance(model, FSDPModule):
        optimizer.load_state_dict(saved)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=saved, options=StateDictOptions(full_state_dict=True))


def average_gradients(module: nn.Module) -> None:
    """The shared critic's value head is a plain module, replicated on every rank: average its gradients as FSDP
    averages the others'."""
    if world_size() > 1:
        for p in module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world_size()


def full_state_dict(model: nn.Module) -> Optional[dict]:
    """The whole model's weights on rank 0's CPU (empty on the other ranks; None in one process: save as is)."""
    if world_size() == 1:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ---------------------------------------------------------------------------------------------------------------------
# Appendix F. The run: start-up, the output directory and its lock, checkpoints and resume, interrupts, the exit.
# Part 1 reaches it through start_run, the Run it yields, and save_checkpoint.


class NonFiniteLoss(Exception):
    pass


@dataclass
class Run:
    """What one training run holds; its methods are what happens around the training loop's iterations."""
    args: Args  # the flags, with their derived values
    models: Models
    optimizers: dict
    learning_rates: dict  # each optimizer's base rate, before warmup and annealing
    reward: Reward
    prompts: Prompts
    state: dict  # what a checkpoint keeps besides weights and optimizers: iteration, beta, reward moments, evals
    log: MetricsLog
    doctor: Doctor
    stop: StopRequests
    output_dir: Path
    start_time: float
    first_iteration: int  # 0, or the iteration of the checkpoint resumed
    earlier: Optional[EarlierRun] = None  # --overwrite's earlier run, set aside until this one's first iteration

    def generator(self, step: int) -> torch.Generator:
        """The random stream of an iteration's minibatch order and PPO-ptx texts: seeded by the step, so that a resumed
        run draws what the uninterrupted one would (ranks differ in their texts; each shuffles its own part anyway)."""
        return torch.Generator().manual_seed((self.args.seed * 1_000_003 + step + 7_919 * rank()) % 2**64)

    def report(self, metrics: dict) -> None:
        """An iteration's console line, the doctor's warnings (counted into the metrics), its metrics.jsonl row, and
        every --sample-every iterations a few of its sampled completions. Row 0 is the eval before the first update."""
        samples = metrics.pop("samples", [])
        self.state["eval_after"] = metrics.get("eval/reward", self.state["eval_after"])
        if metrics["iteration"] == 0:
            self.state["eval_before"] = self.state["eval_after"]
            print(f"iter    0 | eval {metrics['eval/reward']:.3f} (before training)", flush=True)
        else:
            print_line(metrics)
        metrics.update(self.doctor.check(metrics))
        self.log.log(metrics)
        if metrics["iteration"] > 0 and self.earlier is not None:  # this run has its first row: the earlier one goes
            self.earlier.forget()
            self.earlier = None
        if self.args.sample_every > 0 and metrics["iteration"] % self.args.sample_every == 0:
            for prompt, completion, score in samples:
                print(f"    {prompt!r} -> {completion!r}  score {score:.3f}")

    def report_pretraining(self, step: int, metrics: dict) -> None:
        progress("")
        print(f"value pretraining {step + 1}/{self.args.value_pretrain_steps} | value loss "
              f"{metrics['losses/value_loss']:.4f} | ev {metrics['val/explained_variance']:.2f}")

    def stop_if_asked(self, saved: bool) -> None:
        """After SIGTERM or Ctrl-C (on any rank, all ranks together): checkpoint this iteration unless `saved`, and
        raise Interrupted with the command line that resumes."""
        signum = all_max(self.stop.signum or 0)
        if not signum:
            return
        if self.state["iteration"] == self.first_iteration:
            raise Interrupted(signum, "interrupted before the first update of this run; nothing new to save")
        if not saved:
            save_checkpoint(self)
        print(run_summary(self, stopped=True), flush=True)
        checkpoint = self.output_dir / f"checkpoint-{self.state['iteration']}"
        raise Interrupted(signum, f"interrupted at iteration {self.state['iteration']}; resume with --resume-from "
                                  f"{checkpoint}")

    def finish(self) -> dict:
        """The final policy, saved, and the run's last line. Returns the eval reward before and after training."""
        for optimizer in self.optimizers.values():  # their states (twice the weights trained) go before the save
            optimizer.state.clear()
        with saved_atomically(self.output_dir / "policy") as tmp:
            save_policy(self.models, tmp, final=True)
        barrier()
        print(run_summary(self, stopped=False), flush=True)
        return dict(eval_before=self.state["eval_before"], eval_after=self.state["eval_after"])


@contextlib.contextmanager
def start_run(args: Args):
    """The Run of these flags, set up (open_run); on the way out, however the run ends, the output directory's lock is
    released, the logs are closed, the signal handlers restored and the process group left."""
    device = init_distributed()
    try:
        with StopRequests() as stop, contextlib.ExitStack() as held:
            yield open_run(args, stop, held, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def open_run(args: Args, stop: StopRequests, held: contextlib.ExitStack, device: torch.device) -> Run:
    """Check the flags and read the prompts and the checkpoint before any model loads; lock --output-dir; load the
    models and optimizers (and the checkpoint's state); only then set an earlier run aside (--overwrite)."""
    check_args(args)
    args = derived_args(args)
    training_state = read_checkpoint(args) if args.resume_from else None
    files = read_prompt_files(args)
    reward = load_reward(args, [file for file in files[:2] if file])
    lock = on_rank_zero(lock_output_dir, args)  # rank 0 alone checks, locks and writes the output directory
    if lock is not None:
        held.enter_context(lock)
    found = on_rank_zero(find_earlier_run, args) or []
    resume = Path(args.resume_from) if args.resume_from else None
    torch.manual_seed(args.seed)
    models = load_models(args, device, resume)
    if world_size() > 1:  # every rank samples its own responses
        torch.manual_seed((args.seed + 1_000_003 * rank()) % 2**64)
    if models.lora:
        trained = sum(p.numel() for p in models.policy.parameters() if p.requires_grad)
        print(f"LoRA: the policy trains {trained:,} of its {sum(p.numel() for p in models.policy.parameters()):,} "
              "parameters; the reference is the policy with its adapters off")
    print(f"stop tokens: {' '.join(models.tokenizer.convert_ids_to_tokens(models.eos_token_ids))}")
    prompts = tokenize_files(files, models.tokenizer, args)
    optimizers, learning_rates = make_optimizers(models, args)
    state = dict(iteration=0, kl_coef=args.kl_coef, reward_mean=0.0, reward_var=1.0, reward_count=0, eval_before=None,
                 eval_after=None, ent_coef=args.ent_coef)
    if resume:
        state.update(load_training_state(training_state, models, optimizers))
        print(f"resumed from {resume} at iteration {state['iteration']}")
    earlier = on_rank_zero(EarlierRun, found, Path(args.output_dir)) if found else None
    if earlier is not None:
        held.callback(earlier.restore)
    log = MetricsLog(args, state["iteration"])
    held.callback(log.close)
    output_dir = Path(args.output_dir)
    print(f"output: {output_dir}/ gets metrics.jsonl (every iteration)"
          + (f", checkpoint-N (every {args.save_every} iterations)" if args.save_every else "")
          + ", policy/ (at the end)" + (", tb/ (TensorBoard)" if args.track else ""), flush=True)
    return Run(args, models, optimizers, learning_rates, reward, prompts, state, log, Doctor(args, log.rows), stop,
               output_dir, time.time(), state["iteration"], earlier)


def save_policy(models: Models, path: Path, final: bool = False) -> None:
    """The policy and tokenizer with save_pretrained (and the model's own generation config, which the sampler
    ignores). With LoRA a checkpoint holds the adapters alone, and the final policy is a plain model with the adapters
    merged in. Under torchrun every rank takes part in gathering the weights; rank 0 writes them."""
    state_dict = None if models.lora else full_state_dict(models.policy)
    if rank() != 0:
        return
    model = models.policy.merge_and_unload() if models.lora and final else models.policy  # the run ends: merge in place
    model.save_pretrained(path, state_dict=state_dict)
    models.tokenizer.save_pretrained(path)


def save_reference(models: Models, path: Path) -> None:
    """The reference with save_pretrained: with --ref-sync-every it has been mixed toward the policy, so that a resumed
    run cannot load it from --model-name-or-path. Every rank takes part in gathering the weights; rank 0 writes them."""
    state_dict = full_state_dict(models.ref_policy)
    if rank() == 0:
        models.ref_policy.save_pretrained(path, state_dict=state_dict)


def save_checkpoint(run: Run) -> None:
    """<output-dir>/checkpoint-N: the policy and critic with save_pretrained, the optimizers, the run's state and every
    rank's random state, saved atomically (saved_atomically). Every rank takes part (weights, optimizer states and
    random states are gathered); rank 0 writes, and keeps only the newest --save-total-limit checkpoints."""
    models, path = run.models, run.output_dir / f"checkpoint-{run.state['iteration']}"
    with saved_atomically(path) as tmp:
        save_policy(models, tmp / "policy")
        if run.args.ref_sync_every:  # mixed toward the policy: no longer --model-name-or-path's
            save_reference(models, tmp / "reference")
        critic_state = full_state_dict(models.critic) if models.critic is not None and not models.lora else None
        trained = dict(policy=models.policy, critic=models.critic if models.critic is not None else models.value_head)
        optimizer_states = {name: optimizer_state(trained[name], opt) for name, opt in run.optimizers.items()}
        rng = all_gather_objects(dict(torch=torch.get_rng_state(),
                                      cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None))
        if rank() == 0:
            if models.critic is not None:
                models.critic.save_pretrained(tmp / "critic", state_dict=critic_state)
            else:
                torch.save(models.value_head.state_dict(), tmp / "value_head.pt")
            torch.save(dict(run.state, script="ppo", args=asdict(run.args), world_size=world_size(), rng=rng,
                            optimizers=optimizer_states), tmp / "training_state.pt")
    if rank() == 0 and run.args.save_total_limit is not None:  # this one and the newest others (by N) up to the limit
        others = [p for p in checkpoints_in(path.parent) if p != path]
        for old in others[: len(others) - (run.args.save_total_limit - 1)]:
            shutil.rmtree(old)
    barrier()  # no rank goes on (or exits on a stop request) before the checkpoint is in place


@contextlib.contextmanager
def saved_atomically(path: Path):
    """Yields path.tmp to write into (rank 0 writes; every rank takes part), then puts it in path's place: a crash or a
    failed write (disk full, permission) never leaves a half-written path, and the previous one stays whole until the
    new one is. A failure removes the partial files and is one line."""
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    try:
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        yield tmp
        if rank() == 0:
            shutil.rmtree(old, ignore_errors=True)
            if path.exists():
                path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
    except Exception as e:  # OSError; torch.save and safetensors report a full disk as their own errors
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            if old.exists() and not path.exists():
                old.rename(path)
        message = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"cannot save {path} ({type(e).__name__}: {message}); the partial files are removed, and "
                          "what was there before is as it was") from None


def checkpoints_in(output_dir: Path) -> list[Path]:
    """The checkpoint-N directories in output_dir, oldest first."""
    found = [p for p in output_dir.glob("checkpoint-*") if p.is_dir() and p.name.removeprefix("checkpoint-").isdigit()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("checkpoint-")))


def read_checkpoint(args: Args) -> dict:
    """The training state of --resume-from, checked before any model loads: a complete checkpoint of this script,
    written with the same flags except RESUME_MAY_CHANGE, and not past --num-iterations."""
    path = Path(args.resume_from)
    try:
        found = (path / "training_state.pt").is_file()
    except OSError as e:  # a name too long, a directory we may not read
        raise ConfigError(f"--resume-from {path}: cannot read it ({e.strerror or e})") from None
    if not found:
        raise ConfigError(f"--resume-from {path}: not a checkpoint directory (no training_state.pt)")
    state = training_state_at(path)
    optimizers = state["optimizers"]
    if optimizers.keys() != {"policy", "critic"} or not all(map(is_optimizer_state, optimizers.values())):
        raise ConfigError(f"--resume-from {path}: training_state.pt's 'optimizers' are not the policy's and the "
                          "critic's")
    if state["world_size"] != launched_ranks():  # each rank continues its own sampler
        raise ConfigError(f"--resume-from {path}: written by {state['world_size']} rank(s), resumed with "
                          f"{launched_ranks()}; resume with torchrun --nproc_per_node {state['world_size']}")
    saved = {**asdict(Args()), **state["args"]}  # a flag newer than the checkpoint had its default then
    changed = [f"{as_flag(k)} {saved[k]} in the checkpoint, {v} now" for k, v in asdict(args).items()
               if k not in RESUME_MAY_CHANGE and saved[k] != v]
    if changed:
        raise ConfigError(f"--resume-from {path}: flags differ from the run that wrote it: {'; '.join(changed)}")
    needed = ["policy"] + (["value_head.pt"] if args.shared_critic else ["critic"])
    needed += ["reference"] if args.ref_sync_every and args.kl_coef > 0 else []
    missing = [name for name in needed if not (path / name).exists()]
    if missing:
        raise ConfigError(f"--resume-from {path}: incomplete checkpoint, no {' or '.join(missing)}")
    if args.num_iterations < state["iteration"]:
        raise ConfigError(f"--num-iterations {args.num_iterations} is below the checkpoint's iteration "
                          f"{state['iteration']}")
    return state


def is_optimizer_state(x) -> bool:
    return x is None or (type(x) is dict and {"state", "param_groups"} <= x.keys())


def training_state_at(path: Path) -> dict:
    """path/training_state.pt loaded as data: weights_only admits tensors, numbers, strings and plain containers, and
    refuses any object that unpickling would construct by running code. Then each key of TRAINING_STATE is checked for
    its type, and the random states for one per rank."""
    try:
        state = torch.load(path / "training_state.pt", map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise ConfigError(f"--resume-from {path}: training_state.pt is truncated or corrupt "
                              "(UnpicklingError)") from None
        raise ConfigError(f"--resume-from {path}: training_state.pt holds more than tensors, numbers, strings and "
                          "containers (written by an older version, or not by this script); refused, since loading "
                          "it could run code") from None
    except Exception as e:
        raise ConfigError(f"--resume-from {path}: training_state.pt is truncated or corrupt "
                          f"({type(e).__name__})") from None
    if type(state) is not dict:
        raise ConfigError(f"--resume-from {path}: training_state.pt is not a training state of ppo_llm.py or "
                          "grpo_llm.py")
    if state.get("script") in ("ppo", "grpo") and state["script"] != SCRIPT:
        raise ConfigError(f"--resume-from {path}: a checkpoint of {state['script']}_llm.py, not of {SCRIPT}_llm.py")
    for key, types in TRAINING_STATE.items():
        if key not in state or type(state[key]) not in types:
            found = f"a {type(state[key]).__name__}" if key in state else "missing"
            raise ConfigError(f"--resume-from {path}: training_state.pt's {key!r} is {found}, not "
                              + " or ".join(t.__name__ for t in types))
    if state["iteration"] < 0 or state["world_size"] < 1:
        raise ConfigError(f"--resume-from {path}: training_state.pt's iteration {state['iteration']} or world_size "
                          f"{state['world_size']} is out of range")
    if len(state["rng"]) != state["world_size"] or any(type(r) is not dict or type(r.get("torch")) is not torch.Tensor
                                                       for r in state["rng"]):
        raise ConfigError(f"--resume-from {path}: training_state.pt's 'rng' holds {len(state['rng'])} random states, "
                          f"not one per rank of its {state['world_size']}")
    return state


def load_training_state(training_state: dict, models: Models, optimizers: dict) -> dict:
    """The optimizers' states and this rank's random state, loaded; returns the run's state to continue from."""
    trained = dict(policy=models.policy, critic=models.critic if models.critic is not None else models.value_head)
    for name, optimizer in optimizers.items():
        load_optimizer_state(trained[name], optimizer, training_state["optimizers"][name])
    rng = training_state["rng"][rank()]  # each rank's own
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"])
    skipped = ("optimizers", "rng", "world_size", "args", "script")
    return {k: v for k, v in training_state.items() if k not in skipped}


# What training_state.pt holds: each key and the types its value may have, so that a checkpoint is data, never code.
SCRIPT = "ppo"
NUMBER, NoneType = (int, float), type(None)
TRAINING_STATE = dict(script=(str,), args=(dict,), iteration=(int,), world_size=(int,), rng=(list,), optimizers=(dict,),
                      eval_before=(*NUMBER, NoneType), eval_after=(*NUMBER, NoneType), kl_coef=NUMBER,
                      reward_mean=NUMBER, reward_var=NUMBER, reward_count=(int,))

OVERWRITTEN = ".overwritten"
EARLIER_RUN = ("metrics.jsonl", "policy", "checkpoint-*", "tb", "wandb")  # what --overwrite sets aside, then deletes


def lock_output_dir(args: Args):
    """Create --output-dir and hold an exclusive lock on it for the whole run, so that a second run into the same
    directory stops instead of interleaving its metrics and checkpoints with ours. Returns the open lock file."""
    output_dir = Path(args.output_dir)
    try:
        if output_dir.exists() and not output_dir.is_dir():
            raise ConfigError(f"--output-dir {output_dir}: exists and is not a directory")
        output_dir.mkdir(parents=True, exist_ok=True)
        lock = open(output_dir / ".lock", "a")
    except OSError as e:
        raise ConfigError(f"--output-dir {output_dir}: cannot write there ({e.strerror or e})") from None
    try:
        import fcntl  # POSIX only; elsewhere runs go unlocked
    except ImportError:
        return lock
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise ConfigError(f"--output-dir {output_dir}: another run is writing to it") from None
    return lock


def find_earlier_run(args: Args) -> list[Path]:
    """What an earlier run left in --output-dir. A fresh run needs --overwrite to replace it; a run resuming from one
    of its checkpoints continues it."""
    output_dir = Path(args.output_dir)
    if (output_dir / OVERWRITTEN).exists():
        raise ConfigError(f"--output-dir {output_dir} holds {OVERWRITTEN}, an earlier run that an --overwrite run set "
                          "aside and did not finish with; move it elsewhere or delete it")
    found = sorted(p for pattern in EARLIER_RUN for p in output_dir.glob(pattern))
    resume = Path(args.resume_from).resolve() if args.resume_from else None
    resuming_here = resume is not None and resume.parent == output_dir.resolve()
    touched = [p for p in found if resume is not None and (p.resolve() == resume or p.resolve() in resume.parents
                                                              or resume in p.resolve().parents)]
    if args.overwrite and touched:
        raise ConfigError(f"--overwrite would delete --resume-from {args.resume_from} (it lies in {touched[0]}); "
                          "drop one of them")
    if found and not resuming_here and not args.overwrite:
        names = ", ".join(p.name for p in found[:3]) + (", ..." if len(found) > 3 else "")
        raise ConfigError(f"--output-dir {output_dir} holds an earlier run ({names}); pass --overwrite to replace it, "
                          f"or --resume-from one of its checkpoints")
    return found if args.overwrite else []


class EarlierRun:
    """--overwrite's earlier run, moved into <output-dir>/.overwritten (renames: nothing is copied or deleted yet)
    until the new run has written its first iteration's metrics row; forget() deletes it then. If the new run fails
    or is stopped before that, restore() (on the way out) puts it back in place of what the new run wrote."""

    def __init__(self, found: list[Path], output_dir: Path):
        self.output_dir, self.aside = output_dir, output_dir / OVERWRITTEN
        self.aside.mkdir()
        moved = []
        try:
            for path in found:
                path.rename(self.aside / path.name)
                moved.append(path)
        except OSError as e:
            for path in moved:
                (self.aside / path.name).rename(path)
            self.aside.rmdir()
            raise ConfigError(f"--overwrite: cannot move the earlier run in {output_dir} aside "
                              f"({e.strerror or e}); it is left as it was") from None

    def forget(self) -> None:
        shutil.rmtree(self.aside, ignore_errors=True)
        if self.aside.exists():
            print(f"warning: could not delete all of {self.aside}, the earlier run that --overwrite set aside")
        self.aside = None

    def restore(self) -> None:
        if self.aside is None:
            return
        for path in sorted(p for pattern in EARLIER_RUN for p in self.output_dir.glob(pattern)):  # the new run's
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in self.aside.iterdir():
            path.rename(self.output_dir / path.name)
        self.aside.rmdir()
        print(f"the earlier run in {self.output_dir} is back in place (--overwrite)")


class Interrupted(Exception):
    """The run stopped on SIGTERM or Ctrl-C, after checkpointing the iterations it did; exit 128 + the signal's
    number."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class SecondCtrlC(KeyboardInterrupt):
    """A second Ctrl-C: stop at once."""


class StopRequests:
    """SIGTERM (what a cluster scheduler sends before preemption) or a first Ctrl-C asks the training loop to stop
    after the current iteration and checkpoint it; a second Ctrl-C stops at once."""

    def __init__(self):
        self.signum = None

    def __enter__(self):
        self.previous = {signum: signal.signal(signum, self.request) for signum in (signal.SIGINT, signal.SIGTERM)
                         if signal.getsignal(signum) is not signal.SIG_IGN}  # e.g. Ctrl-C in a job started with &
        return self

    def request(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise SecondCtrlC
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this iteration (Ctrl-C again to stop at once)",
              flush=True)

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def main() -> None:
    args = parse_args(sys.argv[1:])
    transformers.logging.set_verbosity_error()  # keep stdout to our own lines (load reports, progress bars)
    transformers.logging.disable_progress_bar()
    output_dir = Path(args.output_dir).absolute()  # before a reward function can change the working directory
    try:
        train(args)
    except ConfigError as e:
        exit_with(f"error: {e}", 1)
    except NonFiniteLoss as e:
        checkpoints = checkpoints_in(output_dir)
        last = f"the last checkpoint is {checkpoints[-1]}" if checkpoints else "no checkpoint was written"
        exit_with(f"error: non-finite loss ({e}); stopped without saving this iteration; {last}", 1)
    except Interrupted as e:
        exit_with(str(e), 128 + e.signum)
    except KeyboardInterrupt:
        exit_with("stopped at once by a second Ctrl-C; nothing saved since the last checkpoint", 128 + signal.SIGINT)
    except Exception as e:
        if launched_ranks() > 1 and peer_failed(e):  # another rank failed first: its line is the one to read
            exit_with(None, 1)
        print(f"error: {type(e).__name__} in {Path(__file__).name}, a bug of ours rather than bad input: please report "
              "it, with the command line and the traceback below, where you got this file", file=sys.stderr)
        raise


def exit_with(message: Optional[str], code: int) -> None:
    """Exit with one line on stderr (or none). Under torchrun each rank says it prefixed by its rank (an error may be
    one rank's alone: its reward function on its completions), and leaves at once: the interpreter's teardown could
    abort it in gloo's threads, and the ranks still waiting for it learn of its exit at their next collective."""
    progress("")
    if message is not None:
        print(message if launched_ranks() == 1 else f"[rank {rank()}] {message}", file=sys.stderr)
    if launched_ranks() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def peer_failed(e: Exception) -> bool:
    """Whether a collective failed because another rank left (gloo: the connection closed or reset by the peer)."""
    return isinstance(e, RuntimeError) and any(text in str(e) for text in ("closed by peer", "reset by peer",
                                                                          "Broken pipe", "Connection refused"))


# ---------------------------------------------------------------------------------------------------------------------
# Appendix G. Logging, progress and the doctor: phase timings, evaluation, metrics.jsonl, the console, the doctor.
# Part 1 reaches it through phase, evaluate, rollout_metrics, samples_to_show, Run.report and progress.


phase_times: dict[str, float] = {}  # seconds per phase of the current iteration, logged as time/<phase>


@contextlib.contextmanager
def phase(name: str):
    """Add the seconds spent inside to phase_times[name]; on a GPU after the work it queued has run, so that the time
    is this phase's and not the next one's (one wait per phase, none inside its loops)."""
    start = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    phase_times[name] = phase_times.get(name, 0.0) + time.perf_counter() - start


def rollout_metrics(batch: dict, kl_coef: float) -> dict:
    """The batch's statistics, over every rank's responses: scores, KL (objective/kl: the mean over responses of
    sum_t KL_t), rewards, lengths, values and returns."""
    mask = batch["response_mask"]
    whole = {key: gather_cat(value.float()) for key, value in dict(
        raw_scores=batch["raw_scores"], kl=batch["kl"].sum(1), rlhf_reward=batch["rewards"].sum(1),
        scores=batch["scores"], lengths=mask.sum(1), has_eos=batch["has_eos"], values=batch["values"][mask],
        returns=batch["returns"][mask]).items()}
    return {
        "objective/scores": whole["raw_scores"].mean().item(),
        "objective/kl": whole["kl"].mean().item(),
        "objective/non_score_reward": (whole["rlhf_reward"] - whole["scores"]).mean().item(),
        "objective/rlhf_reward": whole["rlhf_reward"].mean().item(),
        "objective/kl_coef": kl_coef,
        "rollout/response_length": whole["lengths"].mean().item(),
        "rollout/eos_rate": whole["has_eos"].mean().item(),
        "val/values_mean": whole["values"].mean().item(),
        "val/returns_mean": whole["returns"].mean().item(),
        "val/explained_variance": explained_variance(whole["values"], whole["returns"],
                                                     torch.ones_like(whole["values"])),
        "perf/generated_tokens_per_sec": whole["lengths"].sum().item() / max(phase_times["rollout"], 1e-9),
    }


def samples_to_show(models: Models, batch: dict, scores: torch.Tensor) -> list[tuple]:
    """(prompt, completion, score) of the batch's first three responses."""
    completions = models.tokenizer.batch_decode(batch["responses"][:3], skip_special_tokens=True)
    return [(row["prompt"], c, s) for row, c, s in zip(batch["rows"][:3], completions, scores[:3].tolist())]


@torch.no_grad()
def evaluate(run: Run) -> dict:
    """Greedy decoding of the eval prompts; eval/reward is the mean raw score (accuracy for exact_match). Under
    torchrun each rank decodes its 1/N of the prompts, the last ones repeated to an equal share (the sharded reward
    model's forward passes need every rank) and left out of the means."""
    start, args, models, prompts = time.time(), run.args, run.models, run.prompts
    share = math.ceil(len(prompts.eval_rows) / world_size())
    mine = list(range(rank() * share, min((rank() + 1) * share, len(prompts.eval_rows))))
    padded = mine + [mine[-1] if mine else 0] * (share - len(mine))
    scores, lengths, eos = [], [], []
    for first in range(0, share, args.batch_size):
        progress(f"evaluating: prompts {first + 1}-{min(first + args.batch_size, share)} of {share}")
        inds = padded[first : first + args.batch_size]
        with models.autocast():
            batch = generate(models, [prompts.eval_ids[i] for i in inds], args, greedy=True)
            scores.append(score_responses(models, run.reward, batch, [prompts.eval_rows[i] for i in inds], args))
        lengths.append(batch["response_mask"].sum(1).float())
        eos.append(batch["has_eos"].float())
    progress("")
    metrics = {key: gather_cat(torch.cat(values)[: len(mine)]).mean().item()
               for key, values in (("eval/reward", scores), ("eval/response_length", lengths), ("eval/eos_rate", eos))}
    return dict(metrics, **{"time/eval": time.time() - start})


class MetricsLog:
    """One JSON object per iteration in <output-dir>/metrics.jsonl; TensorBoard and W&B with --track."""

    def __init__(self, args: Args, start_iteration: int):
        self.enabled = rank() == 0  # rank 0 alone writes
        self.rows = []  # the rows kept from before a resume, for the doctor
        self.writer = self.wandb = None
        if not self.enabled:
            return
        self.path = Path(args.output_dir) / "metrics.jsonl"
        # A fresh run starts a new file; a resumed one keeps the rows up to its checkpoint and drops those after it.
        kept = []
        if start_iteration > 0 and self.path.exists():
            for line_number, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash mid-write
                    print(f"warning: {self.path}, line {line_number} is not valid JSON (cut by a crash?); dropped")
                    continue
                if type(row) is not dict or type(row.get("iteration")) is not int:  # not what a crash leaves
                    raise ConfigError(f"{self.path}, line {line_number} is not a metrics row ({line[:40]}): fix or "
                                      "remove the line, then resume again")
                if row["iteration"] <= start_iteration:
                    kept.append(line)
                    self.rows.append(row)
        self.path.write_text("".join(line + "\n" for line in kept))
        if args.track:
            from torch.utils.tensorboard import SummaryWriter  # optional packages: check_args made sure they exist

            self.writer = SummaryWriter(str(Path(args.output_dir) / "tb"))
            if args.wandb_project:
                import wandb

                self.wandb = wandb.init(project=args.wandb_project, config=asdict(args), dir=args.output_dir)

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        for key, value in metrics.items():
            if self.writer is not None and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, metrics["iteration"])
        if self.wandb is not None:
            self.wandb.log(metrics, step=metrics["iteration"])

    def close(self) -> None:
        """TensorBoard's events reach the file through a thread of its own, which the interpreter's exit would kill."""
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


LEGEND = """columns: score  mean score of the sampled responses         kl    KL to the reference, summed per response
         ent    policy entropy per token                    clip  fraction of tokens clipped
         ev     the critic's explained variance (1 = perfect, 0 = no better than the mean return)
         len    response length in tokens                   s     seconds per iteration
         eval   greedy reward on the eval prompts
lines starting with "doctor" name an instability signal and the knob to turn; --doctor off hides them"""


def progress(text: str) -> None:
    """Say which phase runs now, on one line that the next one overwrites; only on a terminal (a log stays clean)."""
    if sys.stdout.isatty():
        print(f"\r\033[K{text}", end="" if text else "\r", flush=True)


def print_line(m: dict) -> None:
    progress("")
    text = (f"iter {m['iteration']:>4} | score {m['objective/scores']:.3f} | kl {m['objective/kl']:.3f} "
            f"| ent {m['policy/entropy']:.3f} | clip {m['policy/clipfrac']:.3f} "
            f"| ev {m['val/explained_variance']:.2f} | len {m['rollout/response_length']:.1f} "
            f"| {m['time/iteration']:.1f}s")
    if "eval/reward" in m:
        text += f" | eval {m['eval/reward']:.3f}"
    print(text, flush=True)


def run_summary(run: Run, stopped: bool) -> str:
    """The last line of a run: how far it got, the eval before and after, and where everything is."""
    state, output_dir = run.state, run.output_dir
    text = f"{'stopped' if stopped else 'done'}: iteration {state['iteration']} in {time.time() - run.start_time:.0f}s"
    if state["eval_before"] is not None:
        text += f"; eval/reward {state['eval_before']:.3f} -> {state['eval_after']:.3f}"
    checkpoints = checkpoints_in(output_dir)
    text += f"; metrics in {output_dir / 'metrics.jsonl'}"
    text += f"; last checkpoint {checkpoints[-1]}" if checkpoints else "; no checkpoint"
    return text + ("" if stopped else f"; final policy in {output_dir / 'policy'}")


# The training doctor reads the metrics of the run so far for the usual signs of unstable RLHF training. Each signal
# tests the median of the last DOCTOR_WINDOW iterations, so that one noisy batch does not trigger it, and names the
# knobs to turn, the KL coefficient first, then the clip range, then the learning rate.
DOCTOR_WINDOW = 5  # iterations each signal's median covers
DOCTOR_REPEAT = 10  # iterations before the same warning is printed again
KL_PER_TOKEN_MAX = 0.3  # KL(pi || pi_ref) per token above which the policy has drifted far from the reference
CLIPFRAC_MAX = 0.2  # more than 20% of tokens clipped: the steps are too large for the clip range
ENTROPY_MIN = 0.01  # entropy near 0 (nats per token): the policy has collapsed onto a few answers
GRAD_NORM_MAX = 5.0  # gradient norm before clipping
LENGTH_COLLAPSE_MAX = 1.5  # responses of about one token: the policy stops at once
LENGTH_PINNED_FRACTION = 0.95  # responses of about --max-new-tokens: the policy no longer stops
EOS_RATE_DROP = 0.2  # the fraction of responses ending in EOS fell this much below the run's first iterations
EVAL_DROP = 0.05  # eval/reward this far below its best while the training reward rose: reward hacking
VALUE_LOSS_GROWTH = 2.0  # value loss rising for a whole window, to this many times its lowest
# The critic predicts the returns worse than their mean does. Below 0 by a margin: a critic with nothing left to
# predict hovers at 0, its window medians a little either side.
EXPLAINED_VARIANCE_MIN = -0.1
EARLY_STOP_MOST = 0.5  # --target-kl stopped the epochs on more than this fraction of iterations


def window_medians(history: list[dict], metric: Callable[[dict], Optional[float]]) -> list[float]:
    """The median of every DOCTOR_WINDOW consecutive values of metric(row), oldest first; rows where it is None are
    skipped (an eval-only row has no training reward)."""
    values = [value for value in map(metric, history) if value is not None]
    return [statistics.median(values[i - DOCTOR_WINDOW : i]) for i in range(DOCTOR_WINDOW, len(values) + 1)]


def logged(name: str) -> Callable[[dict], Optional[float]]:
    return lambda row: row.get(name)


def per_token_kl(row: dict) -> Optional[float]:
    """Mean KL per response token: the mean per-response KL sum over the mean length (their ratio is sum KL / sum T)."""
    return row["objective/kl"] / max(row["rollout/response_length"], 1) if "objective/kl" in row else None


def doctor_findings(history: list[dict], args: Args) -> dict[str, str]:
    """{signal: one line naming the metric, its value, the threshold and the knobs to turn} for every signal that the
    metrics of the run so far (the rows of metrics.jsonl, oldest first) show now. Critic-warmup iterations, whose
    policy is frozen, are left out."""
    history = [row for row in history if not row.get("train/policy_frozen")]
    beta = ("raise --kl-coef (beta)" + (" or use --kl-schedule adaptive" if args.kl_schedule == "fixed" else "")
            if args.kl_coef > 0 else "add a KL penalty (--kl-coef 0.05; this run has none)")
    return {**policy_findings(history, args, beta), **critic_findings(history, args),
            **response_findings(history, args, beta)}


def policy_findings(history: list[dict], args: Args, beta: str) -> dict[str, str]:
    """The policy's signals: KL to the reference, reward collapse, clipping, entropy, gradient norms, early stops."""
    found, window = {}, f"median of {DOCTOR_WINDOW} iterations"
    kl, reward, clipfrac, entropy = (window_medians(history, metric) for metric in (
        per_token_kl, logged("objective/scores"), logged("policy/clipfrac"), logged("policy/entropy")))
    if kl and kl[-1] > KL_PER_TOKEN_MAX:
        found["kl_high"] = (f"KL to the reference {kl[-1]:.3f} per token > {KL_PER_TOKEN_MAX} ({window}): {beta}, then "
                            "lower --clip-eps, then --learning-rate")
    if reward and reward[-1] <= 0 < max(reward):
        found["reward_collapse"] = (f"training score fell to {reward[-1]:.3f} <= 0 from {max(reward):.3f} ({window}): "
                                    f"resume from an earlier checkpoint (--resume-from), check the reward, then {beta} "
                                    "or lower --learning-rate")
    if clipfrac and clipfrac[-1] > CLIPFRAC_MAX:
        found["clipfrac_high"] = (f"clip fraction {clipfrac[-1]:.3f} > {CLIPFRAC_MAX} ({window}): raise --clip-eps, "
                                  "then lower --learning-rate or --num-epochs")
    if entropy and entropy[-1] < ENTROPY_MIN:
        found["entropy_collapse"] = (f"policy entropy {entropy[-1]:.4f} < {ENTROPY_MIN} nats per token ({window}): "
                                     "raise --ent-coef or --temperature, or --clip-eps-high 0.28 (DAPO)")
    for model, knob in (("policy", "--learning-rate"), ("critic", "--critic-learning-rate")):
        grad_norm = window_medians(history, logged(f"grad/{model}_norm"))
        if grad_norm and grad_norm[-1] > GRAD_NORM_MAX:
            found["grad_norm_high" if model == "policy" else "critic_grad_norm_high"] = (
                f"{model} gradient norm {grad_norm[-1]:.2f} > {GRAD_NORM_MAX} before clipping ({window}): lower "
                f"{knob}; --max-grad-norm {args.max_grad_norm} clips each step")
    early_stops = [row["policy/early_stopped"] for row in history if "policy/early_stopped" in row][-DOCTOR_WINDOW:]
    if len(early_stops) == DOCTOR_WINDOW and sum(early_stops) / DOCTOR_WINDOW > EARLY_STOP_MOST:
        found["early_stopping"] = (f"--target-kl {args.target_kl} stopped the epochs on {sum(early_stops):.0f} of the "
                                   f"last {DOCTOR_WINDOW} iterations, more than {EARLY_STOP_MOST:.0%}: lower "
                                   "--learning-rate or --num-epochs, or raise --target-kl")
    return found


def critic_findings(history: list[dict], args: Args) -> dict[str, str]:
    """The critic's signals: a growing value loss, a negative explained variance."""
    found, window = {}, f"median of {DOCTOR_WINDOW} iterations"
    value_loss = window_medians(history, logged("losses/value_loss"))
    explained_variance = window_medians(history, logged("val/explained_variance"))
    rising = len(value_loss) > DOCTOR_WINDOW and all(
        earlier < later for earlier, later in zip(value_loss[-DOCTOR_WINDOW - 1 :], value_loss[-DOCTOR_WINDOW:]))
    if rising and value_loss[-1] > VALUE_LOSS_GROWTH * min(value_loss):
        found["value_loss_growing"] = (f"value loss {value_loss[-1]:.4f} has risen for {DOCTOR_WINDOW} iterations, to "
                                       f"more than {VALUE_LOSS_GROWTH:g}x its lowest {min(value_loss):.4f} ({window}): "
                                       "warm up the critic (--critic-warmup-iterations, --value-pretrain-steps), raise "
                                       "--vf-coef, or lower --critic-learning-rate")
    if explained_variance and explained_variance[-1] < EXPLAINED_VARIANCE_MIN:
        found["explained_variance_negative"] = (
            f"critic explained variance {explained_variance[-1]:.2f} < {EXPLAINED_VARIANCE_MIN} ({window}): its "
            "values are worse than the mean return; --critic-warmup-iterations, --value-pretrain-steps, "
            "--critic-learning-rate")
    return found


def response_findings(history: list[dict], args: Args, beta: str) -> dict[str, str]:
    """The responses' signals: lengths collapsing or pinned at the limit, fewer EOS, eval falling while reward rises."""
    found, window = {}, f"median of {DOCTOR_WINDOW} iterations"
    length, eos, reward = (window_medians(history, logged(name)) for name in (
        "rollout/response_length", "rollout/eos_rate", "objective/scores"))
    truncation_knobs = ("--missing-eos-penalty 1.0, or raise --max-new-tokens" if args.missing_eos_penalty == 0
                        else "raise --missing-eos-penalty or --max-new-tokens")
    if length and length[-1] <= LENGTH_COLLAPSE_MAX < length[0]:
        found["length_collapse"] = (f"response length {length[-1]:.2f} tokens <= {LENGTH_COLLAPSE_MAX} ({window}): the "
                                    "policy stops at once; check that the reward does not pay for empty answers, then "
                                    f"{beta}")
    if length and length[-1] >= LENGTH_PINNED_FRACTION * args.max_new_tokens:
        found["length_pinned"] = (f"response length {length[-1]:.1f} >= {LENGTH_PINNED_FRACTION} x --max-new-tokens "
                                  f"{args.max_new_tokens} ({window}): responses run to the limit; {truncation_knobs}")
    if eos and eos[-1] < eos[0] - EOS_RATE_DROP:
        found["eos_rate_falling"] = (f"EOS rate {eos[-1]:.2f} < {eos[0]:.2f} at the start - {EOS_RATE_DROP} "
                                     f"({window}): fewer responses stop; {truncation_knobs}")
    evals = [(i, row["eval/reward"]) for i, row in enumerate(history) if "eval/reward" in row]
    if evals and reward:
        best_at, best_eval = max(evals, key=lambda e: e[1])
        # the training reward when the eval was best; the first window's if that came before it (the eval before)
        reward_then = window_medians(history[: best_at + 1], logged("objective/scores")) or reward[:1]
        if evals[-1][1] < best_eval - EVAL_DROP and reward[-1] > reward_then[-1]:
            found["reward_hacking"] = (f"eval/reward {evals[-1][1]:.3f} < its best {best_eval:.3f} - {EVAL_DROP} while "
                                       f"the training score rose ({reward_then[-1]:.3f} -> {reward[-1]:.3f}): the "
                                       f"policy may exploit the reward; check it on samples, then {beta}")
    return found


class Doctor:
    """Prints each signal doctor_findings reports, at most once per DOCTOR_REPEAT iterations, and counts them into the
    metrics as doctor/<signal>."""

    def __init__(self, args: Args, history: list[dict]):
        self.args, self.history, self.last_warned, self.counts = args, list(history), {}, {}
        for row in history:  # a resumed run goes on counting, and repeating, where the checkpointed one was
            for key, count in row.items():
                if key.startswith("doctor/"):
                    signal_name = key.removeprefix("doctor/")
                    self.last_warned[signal_name], self.counts[signal_name] = row["iteration"], count

    def check(self, metrics: dict) -> dict:
        self.history.append(metrics)
        if self.args.doctor == "off":
            return {}
        iteration, counted = metrics["iteration"], {}
        for signal_name, message in doctor_findings(self.history, self.args).items():
            if iteration - self.last_warned.get(signal_name, -DOCTOR_REPEAT) >= DOCTOR_REPEAT:
                self.last_warned[signal_name] = iteration
                self.counts[signal_name] = counted[f"doctor/{signal_name}"] = self.counts.get(signal_name, 0) + 1
                print(f"doctor [{signal_name}] {message}", flush=True)
        return counted


if __name__ == "__main__":
    main()
    if launched_ranks() > 1:  # a finished rank skips the interpreter's teardown, where gloo's threads could abort it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
