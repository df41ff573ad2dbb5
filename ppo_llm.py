"""PPO for language models in one file: policy, frozen reference, reward (model or function) and critic.

Read it top to bottom: Args -> one pure function per formula -> data and rewards -> models -> rollout ->
advantages -> update -> checkpoints and logging -> the training loop. With no flags it trains the tiny
addition model shipped in demo/ on CPU and prints eval accuracy before and after. On a real model:
    python ppo_llm.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --prompts-path data.jsonl \
        --reward-fn last_number --chat-template --dtype bfloat16 --learning-rate 1e-6
Sources: PPO (Schulman et al. 2017), GAE (Schulman et al. 2016), InstructGPT (Ouyang et al. 2022),
"The 37 implementation details of PPO" (Huang et al.), VC-PPO / VAPO (Yuan et al. 2025), and the design
documents in shared/seeds (referred to as "seed 000" and "seed 001 §N").
"""

import contextlib
import ctypes
import csv
import gc
import importlib
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import statistics
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, make_dataclass
from pathlib import Path
from typing import Callable, Literal, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
import huggingface_hub
import transformers
import tyro
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

HERE = Path(__file__).resolve().parent
DEMO = HERE / "demo"


# The knobs, one dataclass per section of `--help`. Args inherits them all, so the code reads args.kl_coef and the
# flags stay flat (--kl-coef); parse_args shows each section as its own group.
@dataclass
class Experiment:
    """where the run writes, how often it evaluates and saves, what it reports"""

    output_dir: str = "runs/ppo"
    """where metrics.jsonl, checkpoints and the final policy go; an earlier run there needs --overwrite"""
    overwrite: bool = False
    """delete the earlier run in --output-dir (metrics, checkpoints, policy) before starting a fresh one"""
    seed: int = 1
    """random seed; the same seed gives the same metrics on CPU"""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """compute dtype of the forward passes (autocast; bfloat16 on GPUs); trained weights stay float32"""
    # Float32 weights: an update of lr*1e-3 is below bfloat16's resolution. The reward model alone is stored in --dtype.
    gradient_checkpointing: bool = False
    """trade compute for memory in the policy and critic forward passes"""
    fsdp: bool = False
    """under torchrun: shard weights, gradients and optimizer states over the ranks with FSDP2"""
    # Without --fsdp each rank holds full copies of every model and only gradients are averaged.
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
    # RESUME_MAY_CHANGE lists the flags that may differ
    doctor: Literal["warn", "off"] = "warn"
    """watch the metrics for seed 001 §9.3's instability signals and print the knob to turn; off = silent"""


@dataclass
class Models:
    """the policy (also the frozen reference) and the reward"""

    model_name_or_path: str = str(DEMO / "model")
    """policy and reference: a local directory or a Hub name of an AutoModelForCausalLM"""
    reward_model_path: Optional[str] = None
    """an AutoModelForSequenceClassification with one label, scored on prompt+response at the last real token"""
    reward_fn: Optional[str] = None
    """reward without a reward model: exact_match (default), last_number, module:function or file.py:function"""
    lora_r: int = 0
    """LoRA rank: policy and critic train low-rank adapters (peft), the reference is the policy with them off; 0 = off"""
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
class Generation:
    """how responses are sampled"""

    max_new_tokens: int = 16
    """longest response in tokens; responses without EOS by then are truncated (the demo's answers need 5)"""
    # 16 fits a short chat answer such as "46 + 92 = 138" and its end-of-turn token
    temperature: float = 1.0
    """sampling temperature; log-probs are computed from logits / temperature so they match the sampler"""
    top_p: float = 1.0
    """nucleus sampling; 1.0 = off (log-probs ignore top-p/top-k truncation, as in most RLHF code)"""
    top_k: int = 0
    """top-k sampling; 0 = off"""
    num_generations: int = 1
    """responses sampled per prompt"""
    missing_eos_penalty: float = 0.0
    """subtracted from the score of a response that ends without EOS (e.g. 1.0)"""


@dataclass
class RewardsAndKL:
    """the per-token reward: the score minus beta times the KL to the reference (seed 000 part 5, seed 001 §6.4, §7)"""

    kl_coef: float = 0.05
    """beta in r_t = -beta * KL_t; 0.01-0.2"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """per-token KL estimator: k1 = log(p/q), k2 = (log(p/q))^2 / 2, k3 = q/p - 1 - log(q/p)"""
    kl_schedule: Literal["fixed", "linear", "adaptive"] = "fixed"
    """fixed beta; linear anneal to --kl-coef-final; adaptive controller towards --kl-target (PPO-penalty)"""
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


@dataclass
class Advantages:
    """GAE (seed 000 part 2)"""

    gamma: float = 1.0
    """discount; 1.0 for LLMs (a late token is worth as much as an early one)"""
    gae_lambda: float = 0.95
    """policy GAE lambda: 0 = one-step TD error, 1 = Monte Carlo R - V(s_t); 0.9-0.95"""
    critic_gae_lambda: Optional[float] = None
    """lambda for the critic's returns; None = same as --gae-lambda (VC-PPO decouples: 1.0)"""
    length_adaptive_alpha: Optional[float] = None
    """VAPO: policy lambda = 1 - 1/(alpha * response length); None = off (VAPO uses 0.05)"""
    recompute_advantages: bool = False
    """recompute values and advantages with the updated critic at the start of every epoch"""
    # value clipping then centres on the recomputed values
    advantage_whitening: Literal["batch", "minibatch", "none"] = "batch"
    """normalise advantages to mean 0, std 1 over the batch, each minibatch, or not at all"""


@dataclass
class Losses:
    """the clipped policy loss, the value loss and the entropy bonus (seed 000 parts 1, 3, 4)"""

    clip_eps: float = 0.2
    """PPO clip epsilon; 0.1-0.3, 0.2 is standard"""
    clip_eps_high: Optional[float] = None
    """upper clip epsilon (DAPO Clip-Higher, e.g. 0.28); None = --clip-eps"""
    dual_clip: Optional[float] = None
    """Dual-Clip c (about 3): for A < 0 the loss is capped at -c*A; above 1 + the upper clip epsilon; None = off"""
    # the same bound as INTELLECT-2's two-sided clipping delta
    value_clip_eps: Optional[float] = 0.2
    """value clipping around the rollout values (pessimistic max); None = off"""
    vf_coef: float = 0.5
    """c1, weight of the value loss; 0.5-1.0"""
    ent_coef: float = 0.0
    """c2, entropy bonus; 0 for LLMs, 0.01 in classic RL"""
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
    """first iterations train only the critic (policy frozen) on fresh rollouts"""
    value_pretrain_steps: int = 0
    """VC-PPO: before RL, this many rollouts regress the critic on Monte Carlo returns (lambda = 1)"""


@dataclass
class Optimisation:
    """iterations, batch sizes and the optimizer (seed 000 part 6, seed 001 §9)"""

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


# --help shows one group per section, in this order
SECTIONS = dict(experiment=Experiment, models=Models, data=Data, generation=Generation, rewards_and_kl=RewardsAndKL,
                advantages=Advantages, losses=Losses, critic=Critic, optimisation=Optimisation)


@dataclass
class Args(Optimisation, Critic, Losses, Advantages, RewardsAndKL, Generation, Data, Models, Experiment):
    """Every knob, flat: a dataclass's fields run from its last base to its first, so Experiment's come first."""

    # Filled in at runtime (not flags)
    batch_size: tyro.conf.Suppress[int] = 0
    """num_prompts * num_generations"""
    minibatch_size: tyro.conf.Suppress[int] = 0
    """batch_size / num_minibatches, on each rank: batch_size / ranks / num_minibatches"""


def parse_args(argv: list[str]) -> Args:
    """The flags, parsed as one group per section (so --help groups them) without a prefix, then made flat."""
    Flags = make_dataclass("Flags", list(SECTIONS.items()))
    defaults = Args()
    default = Flags(**{name: section(**{f.name: getattr(defaults, f.name) for f in fields(section)})
                       for name, section in SECTIONS.items()})
    flags = tyro.cli(Flags, default=default, args=argv, config=(tyro.conf.OmitArgPrefixes,))
    return Args(**{key: value for name in SECTIONS for key, value in vars(getattr(flags, name)).items()})


# The valid range of every numeric knob, as an interval, checked first in check_args. None (off) is always valid for
# an Optional knob; NaN is never valid.
RANGES = {
    "seed": "[0, 2**64)", "eval_every": "[0, inf)", "sample_every": "[0, inf)", "save_every": "[0, inf)",
    "save_total_limit": "(0, inf)", "max_prompt_length": "(0, inf)", "ptx_coef": "[0, inf)",
    "max_new_tokens": "(0, inf)", "temperature": "[0.001, inf)", "top_p": "(0, 1]", "top_k": "[0, inf)",
    "num_generations": "(0, inf)", "missing_eos_penalty": "[0, inf)",
    "kl_coef": "[0, inf)", "kl_coef_final": "[0, inf)", "kl_target": "(0, inf)", "kl_horizon": "(0, inf)",
    "reward_clip": "(0, inf)", "gamma": "[0, 1]", "gae_lambda": "[0, 1]", "critic_gae_lambda": "[0, 1]",
    "length_adaptive_alpha": "(0, inf)", "clip_eps": "(0, 1)", "clip_eps_high": "(0, inf)", "dual_clip": "(1, inf)",
    "value_clip_eps": "(0, inf)", "vf_coef": "[0, inf)", "ent_coef": "[0, inf)",
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
    ("reward_fn", "does nothing with --reward-model-path, which gives the reward", lambda a: a.reward_model_path is None),
    ("kl_coef_final", "does nothing without --kl-schedule linear", lambda a: a.kl_schedule == "linear"),
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
                     "gradient_checkpointing", "micro_batch_size", "fsdp"}  # memory knobs: the same gradients


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


# ---------------------------------------------------------------------------------------------------------
# Pure functions, one per formula. Tensors over response tokens are (B, T) and travel with response_mask.
# ---------------------------------------------------------------------------------------------------------


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum(x * m) / sum(m), over all tokens (dim=None) or along dim."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the unmasked tokens; masked entries become 0. [dist] The mean and std are over every
    rank's tokens: each rank holds a part of the batch (or minibatch)."""
    m = mask.to(x.dtype)
    count, total = all_sum(torch.stack([m.sum(), (x * m).sum()]))
    count = count.clamp(min=1)
    mean = total / count
    var = all_sum(((x - mean) ** 2 * m).sum()) / count
    return (x - mean) * torch.rsqrt(var + eps) * mask


def response_mask_from_eos(responses: torch.Tensor, eos_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """1 up to and including the first EOS, 0 after it; a response without EOS is all ones.
    Returns (response_mask, has_eos). Works when pad == EOS: only the first EOS counts."""
    is_eos = torch.isin(responses, torch.tensor(eos_token_ids, device=responses.device))
    after_first_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0
    return ~after_first_eos, is_eos.any(1)


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """H = -sum_a p_a * log p_a from log p = log_softmax(z), per position. The equal form logsumexp(z) - sum p*z
    subtracts two large numbers and loses float32 precision on peaked distributions."""
    return -logp.exp().mul_(logp).sum(-1)  # in place: one vocabulary-sized temporary, not two


def log_softmax_at(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(z), z = logits / temperature, in float32."""
    z = logits.float() / temperature if temperature != 1 else logits.float()  # a pass saved at T = 1
    return z.log_softmax(-1)  # one fused pass; torch.logsumexp alone took 1.5-2x as long on our CPU


LOGITS_CHUNK_ELEMENTS = 2**25  # logits per chunk of ResponseLogprobs: float32 temporaries of 128 MB each
KEPT_LOGPROBS_ELEMENTS = 2**27  # up to 512 MB of a micro-batch's log-softmax kept for its backward pass, not recomputed


class ResponseLogprobs(torch.autograd.Function):
    """log pi(y_t) and H_t of softmax(z), z = head(x_t) / temperature in float32, LOGITS_CHUNK_ELEMENTS at a time.
    x is (N, hidden) final hidden states with the output head's weight (and bias), or (N, vocab) logits with weight
    None. At a real vocabulary the logits (N x 151,936 floats) then never exist whole, nor their gradient: the backward
    pass recomputes each chunk from x (one more output-head matmul) unless the log-softmax of all N positions fits in
    KEPT_LOGPROBS_ELEMENTS (from logits, recomputing is a log-softmax and keeping would copy them), with  d log pi(y) / dz = onehot(y) - p  and  d H / dz = -p * (log p + H)."""

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
        needs_x, needs_w, needs_b = ctx.needs_input_grad[:3]  # [lora] the head is frozen: no weight gradient
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
            else:
                p = logp.exp()
                dz = logp.add_(entropy[rows].unsqueeze(-1)).mul_((grad_entropy[rows] / t).unsqueeze(-1)).add_(g).mul_(p).neg_()
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
        return (grad_x, None if grad_w is None else grad_w.to(weight.dtype), None if grad_b is None else grad_b.to(bias.dtype),
                None, None, None, None)


def logprobs_and_entropy(states: torch.Tensor, head: Optional[nn.Module], tokens: torch.Tensor, temperature: float,
                         entropy: Optional[bool]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log pi(y_t) of the (B, T) tokens and, unless entropy is None, H_t (with a gradient only if entropy is True), from
    policy_forward's states and head. The entropy of an update that does not train on it is computed without gradient."""
    x = states.reshape(-1, states.shape[-1])
    weight, bias = (head.weight, head.bias) if head is not None else (None, None)
    logprobs, h = ResponseLogprobs.apply(x, weight, bias, tokens.reshape(-1), temperature, entropy is not None,
                                         torch.is_grad_enabled())
    if entropy is None:
        return logprobs.view(tokens.shape), None
    return logprobs.view(tokens.shape), (h if entropy else h.detach()).view(tokens.shape)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled by pi_theta (Schulman, "Approximating
    KL divergence"). With log r = ref_logprobs - logprobs:  k1 = -log r,  k2 = (log r)^2 / 2,  k3 = r - 1 - log r."""
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}")


def kl_shaped_rewards(scores: torch.Tensor, kl: torch.Tensor, kl_coef: float, response_mask: torch.Tensor) -> torch.Tensor:
    """r_t = -beta * KL_t for every response token, plus the score on the last real token (seed 001 §6.4):
    the reward model judges the whole response, so its verdict lands where the response ends."""
    rewards = -kl_coef * kl * response_mask
    last = response_mask.long().sum(1).clamp(min=1) - 1
    rewards[torch.arange(len(scores)), last] += scores
    return rewards


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016):  A_t = delta_t + gamma*lambda*A_{t+1},  delta_t = r_t + gamma*V(s_{t+1}) - V(s_t),
    with V = 0 after the last real token. lam is a float or a per-sequence (B,) tensor. Returns (advantages,
    returns = A + V), zero on masked tokens. gamma = lambda = 1 gives A_t = R - V(s_t) (seed 000 part 2)."""
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
    """VAPO: lambda = 1 - 1 / (alpha * l) per sequence, so longer responses look further ahead (floored at 0)."""
    return (1.0 - 1.0 / (alpha * response_lengths.float().clamp(min=1))).clamp(min=0.0)


def clipped_surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
    clip_eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO loss  max(-A*w, -A*clip(w, 1-eps_low, 1+eps_high)),  w = pi_theta / pi_old  (seed 000 part 1).
    Dual-Clip: for A < 0 the loss is further capped at -c*A. Returns (loss, ratio, clipped), where clipped
    marks tokens whose gradient the clip removed."""
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


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_eps: Optional[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2), the pessimistic max (seed 000 part 3).
    Returns (loss, clipped)."""
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    clipped_sq = (clipped_values - returns) ** 2
    # Clipped: the clamp bound and its loss won. Inside the range V_old + (V - V_old) can differ from V by rounding,
    # which must not count.
    clipped = (clipped_sq > unclipped) & ((values - old_values).abs() > clip_eps)
    return 0.5 * torch.maximum(unclipped, clipped_sq), clipped


def aggregate_loss(
    loss: torch.Tensor, response_mask: torch.Tensor, mode: str, num_tokens: float, num_seqs: float
) -> torch.Tensor:
    """Reduce a per-token loss. token-mean: sum over all tokens / num_tokens. seq-mean-token-mean: each sequence's
    token mean, summed / num_seqs. Passing the whole minibatch's num_tokens/num_seqs while summing over a micro-batch
    makes gradient accumulation exact: the micro-batch losses add up to the minibatch loss."""
    mask = response_mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * mask).sum() / num_tokens
    if mode == "seq-mean-token-mean":
        return ((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / num_seqs
    raise ValueError(f"unknown loss aggregation {mode!r}")


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over response tokens: near 1 the critic is useful, near 0 or below it is noise."""
    var_returns = masked_mean((returns - masked_mean(returns, response_mask)) ** 2, response_mask)
    residual = returns - values
    var_residual = masked_mean((residual - masked_mean(residual, response_mask)) ** 2, response_mask)
    return float("nan") if var_returns == 0 else float(1 - var_residual / var_returns)


def adaptive_kl_coef(kl_coef: float, kl: float, kl_target: float, num_seqs: int, horizon: int) -> float:
    """PPO-penalty controller (Ziegler et al. 2019): e = clip(KL / target - 1, -0.2, 0.2),
    beta <- beta * (1 + e * n / horizon). KL above target raises beta, below lowers it."""
    error = min(max(kl / kl_target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * num_seqs / horizon)


def linear_kl_coef(iteration: int, num_iterations: int, kl_coef: float, kl_coef_final: float) -> float:
    """KL annealing (seed 001 §7.3): beta goes linearly from --kl-coef to --kl-coef-final over the run."""
    progress = iteration / max(num_iterations - 1, 1)
    return kl_coef + (kl_coef_final - kl_coef) * progress


def default_learning_rates(num_params: int) -> tuple[float, float]:
    """(policy, critic) learning rates when the flags are not given, by the policy's parameter count. RL fine-tuning
    steps are about ten times smaller than SFT's (seed 001 section 9.1: 1e-6 to 5e-6 for 0.5B-7B models), and SFT's
    shrink as models grow; the critic, whose head starts from scratch, learns 3 to 10 times faster. The tiny demo
    model needs (3e-4, 1e-3) to learn in a minute; SmolLM2-135M learns at (1e-5, 1e-4) (README)."""
    for limit, rates in ((10e6, (3e-4, 1e-3)), (300e6, (1e-5, 1e-4)), (3e9, (3e-6, 1e-5))):
        if num_params < limit:
            return rates
    return 1e-6, 5e-6


def learning_rate_at(iteration: int, num_iterations: int, base_lr: float, warmup: int, anneal: bool) -> float:
    """Linear warmup over `warmup` iterations, then (optionally) linear anneal to 0 at the end of the run."""
    lr = base_lr * min(1.0, (iteration + 1) / warmup) if warmup > 0 else base_lr
    return lr * (1.0 - iteration / num_iterations) if anneal else lr


def update_running_moments(
    mean: float, var: float, count: int, batch: torch.Tensor
) -> tuple[float, float, int]:
    """Merge a batch into a running mean/variance (Chan et al. parallel algorithm)."""
    batch = batch.double()
    n, batch_mean, batch_var = batch.numel(), batch.mean().item(), batch.var(unbiased=False).item()
    total = count + n
    delta = batch_mean - mean
    new_mean = mean + delta * n / total
    new_var = (var * count + batch_var * n + delta**2 * count * n / total) / total
    return new_mean, new_var, total


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


# ---------------------------------------------------------------------------------------------------------
# Data and reward functions
# ---------------------------------------------------------------------------------------------------------


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
    """The rows of a prompts file, with where each came from, so that every later error can name its file and line
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
    # stderr keeps to our one error line: no progress bars, retry, schema or dataset-card messages
    datasets.disable_progress_bars()
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
    except Exception as e:  # offline, no such dataset, config or split, a malformed file
        reasons = [f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
                   for error in (e, e.__cause__) if error is not None]  # the cause says what was wrong in the file
        raise ConfigError(f"{flag} {path}: cannot be read as a dataset ({'; '.join(reasons)})") from None
    return list(dataset)


def load_prompts(path: str, flag: str, prompt_field: str = "prompt", answer_field: str = "answer",
                 split: str = "train", config: Optional[str] = None) -> PromptFile:
    """Read prompt rows from a JSONL file or, through the datasets package, a .parquet, .csv or .json file or a
    Hugging Face dataset; --prompt-field and --answer-field name the fields read as 'prompt' and 'answer'. Errors
    name the file and line (the row, for what datasets read)."""
    if Path(path).suffix.lower() in DATASET_FILES or is_dataset_name(path):
        rows = read_dataset_rows(path, flag, split, config)
        prompts = PromptFile(flag, path, rows, list(range(1, len(rows) + 1)), unit="row")
    else:  # JSONL, whatever the file is called
        rows, line_numbers = read_jsonl_rows(path, flag)
        prompts = PromptFile(flag, path, rows, line_numbers)
    for i, row in enumerate(rows):
        for field, name in ((prompt_field, "prompt"), (answer_field, "answer")):
            if field != name and isinstance(row, dict) and name in row:  # which of the two is meant?
                raise ConfigError(f"{prompts.where(i)}: row has a field {name!r} besides {as_flag(name + '_field')} "
                                  f"{field!r}; rename one")
            if field != name and isinstance(row, dict) and field in row:
                row[name] = row.pop(field)
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            named = "" if prompt_field == "prompt" else " (--prompt-field)"
            fields_there = f" (its fields: {', '.join(map(str, row))})" if isinstance(row, dict) and row else ""
            raise ConfigError(f"{prompts.where(i)}: row has no string field {prompt_field!r}{named}{fields_there}")
        clash = next((key for key in REWARD_FN_ARGUMENTS if key in row), None)
        if clash:
            raise ConfigError(f"{prompts.where(i)}: field {clash!r} collides with the reward function's argument of "
                              "that name; rename it")
    if not rows:
        raise ConfigError(f"{flag} {path}: {'file' if prompts.unit == 'line' else 'dataset'} has no rows")
    return prompts


def load_ptx_texts(path: str) -> PromptFile:
    """The PPO-ptx corpus: one document per non-blank line, kept as a PromptFile of {"prompt": text} rows."""
    lines = read_lines(path, "--ptx-path")
    if not lines:
        raise ConfigError(f"--ptx-path {path}: file has no text")
    return PromptFile("--ptx-path", path, [{"prompt": text} for _, text in lines], [n for n, _ in lines])


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match_reward(prompts: list[str], completions: list[str], answer: list, **_) -> list[float]:
    """1.0 if the completion, stripped, equals the row's answer, else 0.0."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


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


def load_reward_fn(spec: str) -> Callable:
    """A built-in name, 'package.module:function' or 'path/to/file.py:function'."""
    if spec in BUILTIN_REWARD_FNS:
        return BUILTIN_REWARD_FNS[spec]
    module_name, _, function_name = spec.rpartition(":")
    if not module_name or not function_name:
        raise ConfigError(
            f"--reward-fn {spec!r}: expected one of {sorted(BUILTIN_REWARD_FNS)}, module:function or file.py:function"
        )
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


def call_reward_fn(fn: Callable, name: str, prompts: list[str], completions: list[str], rows: list[dict]) -> torch.Tensor:
    """Call fn(prompts, completions, **row_fields) and check it returned one finite float32 number per completion."""
    keys = dict.fromkeys(key for row in rows for key in row if key != "prompt")
    fields = {key: [row.get(key) for row in rows] for key in keys}
    try:
        returned = fn(prompts, completions, **fields)
        returned = returned.tolist() if hasattr(returned, "tolist") else returned  # a tensor or array
        # a dict would be read as its keys, a set in no particular order
        in_order = isinstance(returned, Iterable) and not isinstance(returned, (str, bytes, dict, set))
        scores = list(returned) if in_order else None  # a generator runs here
    except Exception as e:
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


# ---------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------


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
    token (<|endoftext|> for Qwen2.5 base), and a response that runs past the end of its turn is trained on what follows."""
    reply = "Hello there."
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}],
                                             tokenize=False)
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
    value head."""
    model, info = from_pretrained(cls, path, flag, dtype=dtype, output_loading_info=True, **kwargs)
    # a critic made from the policy: its random head is the one place a head missing from a checkpoint is expected
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


def add_lora(model: nn.Module, args: Args, saved_adapters: Optional[Path], task_type: str = "CAUSAL_LM") -> nn.Module:
    """[lora] The model with trainable low-rank adapters on its linear layers (peft), its own weights frozen except a
    critic's score head (task_type SEQ_CLS trains it in full); a resumed run takes the checkpoint's adapters.
    model.disable_adapter() gives back the untouched model: the policy's is the reference."""
    import peft  # optional: check_args made sure it exists

    targets = args.lora_target_modules or ["all-linear"]
    if model.config.get_text_config().tie_word_embeddings and any("lm_head" in t or "embed" in t for t in targets):
        raise ConfigError(f"--lora-target-modules {' '.join(targets)}: the output head shares its weights with the "
                          "embeddings in this model, so merging an adapter on one would change the other")
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
            flag = f"--resume-from {saved_adapters.parent}" if saved_adapters else f"--lora-target-modules {' '.join(targets)}"
            raise ConfigError(f"{flag}: peft cannot place the adapters ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if args.gradient_checkpointing:  # the frozen embeddings' output must carry a gradient into checkpointed layers
        model.enable_input_require_grads()
    return model


def load_scalar_model(path: str, flag: str, args: Args, device: torch.device, trainable: bool, fresh_head: bool = False):
    """Backbone + scalar head (AutoModelForSequenceClassification, one label): the reward model (frozen, stored in
    --dtype) and the critic (float32 weights, like the policy)."""
    dtype = torch.float32 if trainable else getattr(torch, args.dtype)
    model = load_model(AutoModelForSequenceClassification, path, flag, args, device, trainable, dtype, fresh_head, num_labels=1)
    if not isinstance(getattr(model, "score", None), nn.Linear):
        raise ConfigError(f"{flag} {path}: {type(model).__name__} has no linear `score` head")
    return model


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Left padding: the first real token is position 0."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def output_head(model) -> Optional[nn.Module]:
    """The output head, when the logits are exactly head(final hidden state) and outnumber it: then ResponseLogprobs
    computes them a chunk at a time. None, and the logits come from the model, for a vocabulary no larger than the
    hidden state (the demo's 15 tokens: nothing to save), for models that cap or scale their logits (Gemma 2 and 3,
    Cohere, Granite, Falcon-H1) or whose head is not a plain Linear, and [dist] under torchrun (outside the forward the
    head's weight is a shard)."""
    config, head = model.config, model.get_output_embeddings()
    scaled = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")
    if world_size() > 1 or any(getattr(config, key, None) for key in scaled):
        return None
    return head if type(head) is nn.Linear and head.out_features > head.in_features else None  # not a subclass's forward


def policy_forward(model, query_responses, attention_mask, context_length: int, hidden=False):
    """What the response tokens' log-probs come from, (states, head): the final hidden states of the positions before
    them (the logit at position t predicts response token t) and the output head; or, where output_head is None, those
    positions' logits and None (logits_to_keep names exactly them: no prompt logits, no slice copy). Also, when hidden,
    those hidden states for a shared critic. Run under the same autocast as generation; logprobs_and_entropy divides
    by the sampling temperature, so the log-probs are the sampler's."""
    head = output_head(model)
    positions = torch.arange(context_length - 1, query_responses.shape[1] - 1, device=query_responses.device)
    out = model(
        input_ids=query_responses,
        attention_mask=attention_mask,
        position_ids=position_ids_from(attention_mask),
        output_hidden_states=hidden or head is not None,
        use_cache=False,
        logits_to_keep=positions[:0] if head is not None else positions,  # no logits at all when the head is ours
    )
    states = out.hidden_states[-1][:, context_length - 1 : -1] if hidden or head is not None else None
    return (states, head) if head is not None else (out.logits, None), (states if hidden else None)


def scalar_forward(model, query_responses, attention_mask) -> torch.Tensor:
    """Per-position scalar from a sequence-classification model: head(backbone hidden states), shape (B, L)."""
    if hasattr(model, "get_base_model"):  # [lora] the model under peft's wrapper, its adapters in place
        model = model.get_base_model()
    hidden = model.base_model(
        input_ids=query_responses, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask), use_cache=False
    ).last_hidden_state
    return model.score(hidden).squeeze(-1).float()


# ---------------------------------------------------------------------------------------------------------
# Distributed (torchrun), the few additions. In a plain `python ppo_llm.py` there is one rank and each function
# below returns at once; the single-process code is the one to read. Callers mark their uses with "# [dist]".
# ---------------------------------------------------------------------------------------------------------


def launched_ranks() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0")) if launched_ranks() > 1 else 0  # RANK: set by torchrun


def init_distributed() -> torch.device:
    """Under torchrun: join the process group on this rank's LOCAL_RANK GPU (NCCL, plus gloo for a few small counts
    kept on the CPU; gloo alone without GPUs). Only rank 0 prints; the others' stdout goes nowhere (errors still reach
    stderr)."""
    cuda = torch.cuda.is_available()
    if launched_ranks() == 1:
        return torch.device("cuda" if cuda else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")  # gloo too: a few small counts live on the CPU
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


def all_min(value: int) -> int:
    return -all_max(-value)


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
    """fn on rank 0 only (the output directory's checks and lock); a ConfigError there stops every rank with its line."""
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


def shard(model: nn.Module, args: Args) -> nn.Module:
    """FSDP2 over the ranks: one fully_shard unit per decoder layer, then the root. One code path for both modes: with
    --fsdp the mesh is (1 replica, N shards), so each rank stores 1/N of the weights, gradients and optimizer state;
    without it (N replicas, 1 shard), which is data parallelism (DDP's semantics: full copies, gradients averaged).
    Weights are gathered in float32 and computed in --dtype under autocast, exactly as in one process (FSDP's
    MixedPrecisionPolicy(param_dtype=bfloat16) would halve the gathers but round norm weights to bfloat16)."""
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
    """Gather the full weights once for a whole sample() (one all-gather per layer) and keep them until it ends, not
    once per decoded token: in between no collective runs, so ranks decode different numbers of tokens independently."""
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
    if not optimizer.state:  # never stepped (ppo_llm.py's policy during critic warmup): nothing to save
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


class Models:
    """The four models of RLHF PPO (seed 001 §6.1) and the tokenizer; [lora] three: the reference is the policy with its
    adapters off."""

    def __init__(self, args: Args, device: torch.device, resume: Optional[Path]):
        self.tokenizer = load_tokenizer(args)
        self.lora = args.lora_r > 0
        # A checkpoint holds the whole policy, or with LoRA only its adapters over --model-name-or-path's weights
        policy_path = str(resume / "policy") if resume and not self.lora else args.model_name_or_path
        policy_flag = "--resume-from" if resume and not self.lora else "--model-name-or-path"
        # [dist] every rank loads the full weights, then keeps its shard (or, without --fsdp, its replica)
        self.policy = load_model(AutoModelForCausalLM, policy_path, policy_flag, args, device, trainable=True)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.policy, args.chat_template)
        if self.lora:  # [lora]
            self.policy = add_lora(self.policy, args, resume / "policy" if resume else None)
        self.policy = shard(self.policy, args)
        self.ref_policy = None  # with LoRA the reference is the policy with its adapters off: no second model
        if not self.lora:
            self.ref_policy = shard(load_model(AutoModelForCausalLM, args.model_name_or_path, "--model-name-or-path", args,
                                               device, False), args)
        self.reward_model = self.reward_tokenizer = None
        if args.reward_model_path:
            self.reward_model = shard(load_scalar_model(args.reward_model_path, "--reward-model-path", args, device, False), args)
            self.reward_tokenizer = load_reward_tokenizer(args.reward_model_path)
        self.same_vocab = self.reward_tokenizer is not None and self.reward_tokenizer.get_vocab() == self.tokenizer.get_vocab()
        if args.critic_init == "reward" and not self.same_vocab:
            raise ConfigError("--critic-init reward: the reward model's tokenizer differs from the policy's, so the critic "
                              "cannot read the policy's tokens; use --critic-init policy")
        self.critic = self.value_head = None
        if args.shared_critic:
            self.value_head = nn.Linear(self.policy.config.get_text_config().hidden_size, 1).to(device)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
            if resume:
                try:
                    self.value_head.load_state_dict(torch.load(resume / "value_head.pt", map_location=device))
                except Exception as e:
                    raise ConfigError(f"--resume-from {resume}: value_head.pt cannot be loaded ({type(e).__name__})") from None
        else:
            initial = args.reward_model_path if args.critic_init == "reward" else args.model_name_or_path
            critic_path = str(resume / "critic") if resume and not self.lora else initial
            from_policy = critic_path == initial and args.critic_init == "policy"
            critic_flag = "--resume-from" if resume and not self.lora else "--critic-init"
            # a fresh score head starts the same on every rank: all ranks are seeded alike until the models are built
            self.critic = load_scalar_model(critic_path, critic_flag, args, device, trainable=True, fresh_head=from_policy)
            if self.lora:  # [lora] its own adapters, and its score head trained in full
                self.critic = add_lora(self.critic, args, resume / "critic" if resume else None, task_type="SEQ_CLS")
            self.critic = shard(self.critic, args)

        self.autocast_dtype = torch.bfloat16 if args.dtype == "bfloat16" else None

    def critic_parameters(self) -> list[nn.Parameter]:
        critic = self.value_head if self.value_head is not None else self.critic
        return [p for p in critic.parameters() if p.requires_grad]  # [lora] the adapters and the score head

    @contextlib.contextmanager
    def reference(self):
        """pi_ref: the frozen copy of the initial policy, or [lora] the policy with its adapters off."""
        if self.ref_policy is not None:
            yield self.ref_policy
        else:
            with self.policy.disable_adapter():
                yield self.policy

    def autocast(self):
        """Forward passes compute in --dtype; trained weights stay float32 (see load_model)."""
        device_type = self.policy.device.type
        return torch.autocast(device_type, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None)


# ---------------------------------------------------------------------------------------------------------
# Rollout: generate, mask after EOS, score, log-probs of policy and reference, values
# ---------------------------------------------------------------------------------------------------------


PHASE_SECONDS: dict[str, float] = {}  # seconds per phase of the current iteration; run_iteration logs them as time/<phase>


@contextlib.contextmanager
def phase(name: str):
    """Add the seconds spent inside to PHASE_SECONDS[name]; on a GPU after the work it queued has run, so that the
    time is this phase's and not the next one's (one synchronisation per phase, none inside its loops)."""
    start = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    PHASE_SECONDS[name] = PHASE_SECONDS.get(name, 0.0) + time.perf_counter() - start


try:
    LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not Linux with glibc
    LIBC = None


def release_freed_memory(models: Models, rows: int) -> None:
    """Give the OS back the pages glibc's allocator keeps after a phase's many frees (the sampler's per-token logits,
    the update's per-chunk ones: 1 GB at a 151,936-token vocabulary), so the next phase's do not come on top of them.
    On a CPU only, and where one token's logits for the rows sampled together pass 1 MB: a trim takes 10-30 ms, more
    than the demo's whole sampler frees."""
    if LIBC is not None and models.policy.device.type == "cpu" and rows * len(models.tokenizer) * 4 > 2**20:
        LIBC.malloc_trim(0)


def format_prompt(tokenizer, prompt: str, chat_template: bool) -> str:
    if chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
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

    # 256 texts a call: one call would hold every text's encoding (ids, offsets, masks) at once, 9 MB for the demo's 4,000
    encoded = []
    try:
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
    width = max(len(s) for s in sequences)
    input_ids = torch.tensor([[pad_id] * (width - len(s)) + s for s in sequences], device=device)
    attention_mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], device=device)
    return input_ids, attention_mask


def next_token_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """The sampling distribution, (B, vocab): softmax(logits / temperature) cut to the top_k most likely tokens, then to
    the nucleus (the most likely tokens until their probability reaches top_p), as transformers orders them. Cut tokens
    get probability 0 and the rest are not renormalised: sample_from draws in proportion."""
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the more likely tokens already reach top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    return probs


def sample_from(probs: torch.Tensor) -> torch.Tensor:
    """One token per row, in proportion to probs: the first whose cumulative probability exceeds u * total, u ~ U[0, 1)
    (a token of probability 0 has an empty interval). torch.multinomial draws the same way but took 22x longer on our
    CPU at a 151,936-token vocabulary (6.5 s against 0.3 s for 64 draws of 32 rows); the CPU's cumsum accumulates in
    float64."""
    cdf = probs.cumsum(-1)
    u = torch.rand(len(probs), 1, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


@torch.no_grad()
def sample(model, input_ids, attention_mask, max_new_tokens: int, eos_token_ids: list[int], greedy: bool,
           temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, with_logprobs: bool = False
           ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Autoregressive sampling with the KV cache: one forward over the left-padded prompts, then one token per row per
    step, until every row has sampled an EOS or max_new_tokens. Returns the (B, T) tokens (the caller masks whatever
    follows a row's first EOS) and, with_logprobs, each token's log-probability under the sampling distribution (the
    rollout's log pi_old where sampler_logprobs_are_pi_old; the tests compare them with the update's).
    Our own loop rather than transformers' generate: it does only this, and the model's shipped generation config
    (repetition penalties, its own top-k) cannot make the sampler differ from the log-probs we train on."""
    eos = torch.tensor(eos_token_ids, device=input_ids.device)
    positions = position_ids_from(attention_mask)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    tokens, logprobs = [], []
    ended = torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)
    for step in range(max_new_tokens):
        if greedy:
            token = out.logits[:, -1].argmax(-1)
        else:
            probs = next_token_probs(out.logits[:, -1], temperature, top_p, top_k)
            token = sample_from(probs)
            if with_logprobs:
                logprobs.append((probs.gather(1, token.unsqueeze(1)).squeeze(1) / probs.sum(-1)).log())
        tokens.append(token)
        ended |= torch.isin(token, eos)
        if step == max_new_tokens - 1 or ended.all():  # one host sync per token, to stop as soon as every row has ended
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(token), 1)], 1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=token.unsqueeze(1), attention_mask=attention_mask, position_ids=positions, cache=out.cache,
                    use_cache=True)
    return torch.stack(tokens, 1), torch.stack(logprobs, 1) if logprobs else None


def sampler_logprobs_are_pi_old(models: Models, args: Args) -> bool:
    """Whether the sampler's log-probs can stand for log pi_old, which saves the policy a pass over the rollout. In
    float32 over the full softmax they are the training forward's up to float rounding (the tests ask 1e-5). Not under
    bfloat16, where the KV-cached decode rounds differently from a full forward (the ratio would start away from 1);
    not with top-k or top-p, which sample from a truncated distribution, not the one trained on; and not with a
    shared critic, whose values come from the policy's pass."""
    return models.autocast_dtype is None and args.top_k == 0 and args.top_p == 1.0 and not args.shared_critic


def generate(models: Models, prompt_ids: list[list[int]], args: Args, greedy: bool, device) -> dict:
    """Batched, left-padded sampling (or greedy decoding). Everything after the first EOS is masked out. A sampled
    rollout carries its log pi_old as "logprobs" where sampler_logprobs_are_pi_old."""
    input_ids, prompt_mask = left_pad(prompt_ids, models.tokenizer.pad_token_id, device)
    models.policy.eval()
    with_logprobs = not greedy and sampler_logprobs_are_pi_old(models, args)
    with unsharded(models.policy):  # [dist] each rank samples on its own: none waits for another's longer responses
        responses, logprobs = sample(models.policy, input_ids, prompt_mask, args.max_new_tokens, models.eos_token_ids,
                                     greedy, args.temperature, args.top_p, args.top_k, with_logprobs)
    response_mask, has_eos = response_mask_from_eos(responses, models.eos_token_ids)
    responses = responses.masked_fill(~response_mask, models.tokenizer.pad_token_id)
    rollout = dict(
        query_responses=torch.cat([input_ids, responses], 1),
        attention_mask=torch.cat([prompt_mask, response_mask.long()], 1),
        context_length=input_ids.shape[1],
        responses=responses,
        response_mask=response_mask,
        has_eos=has_eos,
    )
    if with_logprobs:
        rollout["logprobs"] = logprobs.masked_fill(~response_mask, 0.0)  # what follows an EOS was sampled, then masked
    return rollout


def last_attended_scores(per_position: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Value of a (B, L) per-position tensor at the last position whose attention mask is 1."""
    last = attention_mask.shape[1] - 1 - attention_mask.flip(1).long().argmax(1)
    return per_position[torch.arange(len(per_position)), last]


def reward_model_texts(models: Models, rows: list[dict], completions: list[str], has_eos: torch.Tensor, args: Args
                       ) -> tuple[list[str], bool]:
    """Prompt + response as text in the reward model's own format, and whether that format already holds the special
    tokens: its chat template when the run uses one (a response cut off before EOS leaves the assistant turn open),
    else plain concatenation ending with its EOS token when the response ended with EOS."""
    tokenizer = models.reward_tokenizer
    if args.chat_template and tokenizer.chat_template:
        return [tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": c}],
                                              tokenize=False, continue_final_message=not ended)
                for row, c, ended in zip(rows, completions, has_eos.tolist())], True
    eos = tokenizer.eos_token or ""
    return [format_prompt(models.tokenizer, row["prompt"], args.chat_template) + c + (eos if ended else "")
            for row, c, ended in zip(rows, completions, has_eos.tolist())], False


@torch.no_grad()
def reward_model_scores(models: Models, rollout: dict, rows: list[dict], completions: list[str], args: Args) -> torch.Tensor:
    """The reward model's scalar at the last real token of prompt+response (the EOS when there is one). With the
    policy's vocabulary it scores the sampled ids; otherwise the text, re-tokenized for the reward model."""
    device = rollout["responses"].device
    if models.same_vocab:
        sequences, mask = rollout["query_responses"], rollout["attention_mask"]
    else:
        texts, templated = reward_model_texts(models, rows, completions, rollout["has_eos"], args)
        encoded = models.reward_tokenizer(texts, padding=True, return_tensors="pt", padding_side="left",
                                          add_special_tokens=not templated)  # a template already holds BOS
        sequences, mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
    scores = []
    for start in range(0, len(sequences), args.micro_batch_size):
        chunk = slice(start, start + args.micro_batch_size)
        scores.append(last_attended_scores(scalar_forward(models.reward_model, sequences[chunk], mask[chunk]), mask[chunk]))
    return torch.cat(scores)


@torch.no_grad()
def score_responses(models: Models, reward_fn, reward_fn_name, rollout: dict, rows: list[dict], args: Args) -> torch.Tensor:
    """Raw scores: the reward model if given, else the reward function on the raw prompt and the decoded completion."""
    completions = models.tokenizer.batch_decode(rollout["responses"], skip_special_tokens=True)
    if models.reward_model is not None:
        return reward_model_scores(models, rollout, rows, completions, args)
    prompts = [row["prompt"] for row in rows]
    return call_reward_fn(reward_fn, reward_fn_name, prompts, completions, rows).to(rollout["responses"].device)


def micro_batches(response_attention: torch.Tensor, micro_batch_size: int) -> list[tuple[slice, int]]:
    """(rows, width) of each micro-batch: its slice of the rows and its longest response (at least 1 token), from the
    responses' part of the attention mask. Generation pads every response to the batch's longest; a micro-batch is
    cut to its own longest, since the columns after it are padding in each of its rows, masked out of attention and
    loss (the same numbers up to float rounding, and less work where lengths vary). One host read for all
    micro-batches, none inside their loop."""
    lengths = response_attention.sum(1).tolist()
    return [(slice(start, start + micro_batch_size), max(1, *lengths[start : start + micro_batch_size]))
            for start in range(0, len(lengths), micro_batch_size)]


def pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """x (B, w) padded on the right with zeros to (B, width): a trimmed micro-batch's per-token values, back to the batch's width."""
    return nn.functional.pad(x, (0, width - x.shape[1]))


@torch.no_grad()
def forward_rollout(models: Models, rollout: dict, args: Args) -> dict:
    """log pi_old (unless the sampler gave it), log pi_ref and V_old on the sampled tokens, micro-batch by micro-batch
    (each cut to its longest response, then padded back), one model after the other (each its own phase; a shared
    critic's values come with the policy's pass)."""
    context_length = rollout["context_length"]
    width = rollout["responses"].shape[1]
    chunks = [(rollout["query_responses"][rows, : context_length + chunk_width],
               rollout["attention_mask"][rows, : context_length + chunk_width], rollout["responses"][rows, :chunk_width])
              for rows, chunk_width in micro_batches(rollout["attention_mask"][:, context_length:], args.micro_batch_size)]
    logprobs, ref_logprobs, values = [], [], []
    if "logprobs" in rollout:  # the sampler's (sampler_logprobs_are_pi_old): no pass of pi_old
        logprobs.append(rollout["logprobs"])
    else:
        with phase("old_logprobs"):
            for sequences, mask, responses in chunks:
                (states, head), hidden = policy_forward(models.policy, sequences, mask, context_length, args.shared_critic)
                logprobs.append(pad_columns(logprobs_and_entropy(states, head, responses, args.temperature, None)[0], width))
                if models.value_head is not None:
                    values.append(pad_columns(critic_values(models, sequences, mask, context_length, hidden), width))
    with phase("reference"), models.reference() as ref_policy:
        for sequences, mask, responses in chunks:
            (states, head), _ = policy_forward(ref_policy, sequences, mask, context_length)
            ref_logprobs.append(pad_columns(logprobs_and_entropy(states, head, responses, args.temperature, None)[0], width))
    if models.value_head is None:
        with phase("values"):
            values = [pad_columns(critic_values(models, sequences, mask, context_length), width) for sequences, mask, _ in chunks]
    return dict(logprobs=torch.cat(logprobs), ref_logprobs=torch.cat(ref_logprobs), values=torch.cat(values))


@torch.no_grad()
def recompute_values(models: Models, batch: dict, args: Args) -> torch.Tensor:
    """V(s_t) under the current critic, for --recompute-advantages."""
    values, context_length = [], batch["context_length"]
    for rows, width in micro_batches(batch["attention_mask"][:, context_length:], args.micro_batch_size):
        sequences = batch["query_responses"][rows, : context_length + width]
        mask = batch["attention_mask"][rows, : context_length + width]
        with models.autocast():
            hidden = None
            if args.shared_critic:
                _, hidden = policy_forward(models.policy, sequences, mask, context_length, True)
            values.append(pad_columns(critic_values(models, sequences, mask, context_length, hidden),
                                      batch["responses"].shape[1]))
    return torch.cat(values)


def critic_values(models: Models, sequences, mask, context_length: int, policy_hidden=None) -> torch.Tensor:
    """V(s_t) for each response token t, where s_t is the prompt plus the response before token t."""
    if models.value_head is not None:
        return models.value_head(policy_hidden.to(models.value_head.weight.dtype)).squeeze(-1).float()
    return scalar_forward(models.critic, sequences, mask)[:, context_length - 1 : -1]


# ---------------------------------------------------------------------------------------------------------
# Rewards and advantages for one batch (seed 001 §6.4, §7.1-7.2; seed 000 parts 2 and 5)
# ---------------------------------------------------------------------------------------------------------


def shape_rewards(batch: dict, args: Args, kl_coef: float, state: dict) -> None:
    """Scores -> (missing-EOS penalty, running whitening, clipping) -> per-token r_t = -beta*KL_t + score at the end."""
    scores = batch["raw_scores"] - args.missing_eos_penalty * (~batch["has_eos"]).float()
    if args.whiten_rewards:
        state["reward_mean"], state["reward_var"], state["reward_count"] = update_running_moments(
            state["reward_mean"], state["reward_var"], state["reward_count"], gather_cat(scores)  # [dist] the whole batch
        )
        scores = (scores - state["reward_mean"]) / math.sqrt(state["reward_var"] + 1e-8)
    if args.reward_clip is not None:
        scores = scores.clamp(-args.reward_clip, args.reward_clip)
    batch["scores"] = scores
    batch["kl"] = kl_penalty(batch["logprobs"], batch["ref_logprobs"], args.kl_estimator) * batch["response_mask"]
    batch["rewards"] = kl_shaped_rewards(scores, batch["kl"], kl_coef, batch["response_mask"])


def compute_advantages(batch: dict, args: Args, critic_lambda: float) -> None:
    """Policy advantages with --gae-lambda (or VAPO's length-adaptive lambda); critic targets with critic_lambda
    (VC-PPO's decoupled GAE: the critic trains on lambda = 1 returns, the policy on lower-variance lambda < 1)."""
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


# ---------------------------------------------------------------------------------------------------------
# Update: K epochs x minibatches x micro-batches (seed 000 part 6)
# ---------------------------------------------------------------------------------------------------------


class NonFiniteLoss(Exception):
    pass


def ptx_loss(models: Models, ptx_ids: list[list[int]], generator: torch.Generator, count: int, device) -> torch.Tensor:
    """PPO-ptx: next-token cross-entropy of the policy on `count` random pretraining texts (InstructGPT)."""
    picked = torch.randint(len(ptx_ids), (count,), generator=generator).tolist()
    input_ids, attention_mask = left_pad([ptx_ids[i] for i in picked], models.tokenizer.pad_token_id, device)
    # A token is a target only when the token before it is real: with left padding the first one is predicted from a pad.
    is_target = attention_mask.bool()
    is_target[:, 1:] &= attention_mask[:, :-1].bool()
    labels = input_ids.masked_fill(~is_target, -100)
    return models.policy(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask), labels=labels
    ).loss


def minibatch_step(models: Models, optimizers: dict, batch: dict, mb_inds: torch.Tensor, args: Args,
                   train_policy: bool, ptx: dict) -> dict:
    """One optimizer step on one minibatch, accumulating gradients over micro-batches. Returns its statistics."""
    mb_mask = batch["response_mask"][mb_inds]
    mb_advantages = batch["advantages"][mb_inds]
    if args.advantage_whitening == "minibatch":
        mb_advantages = masked_whiten(mb_advantages, mb_mask)
    # [dist] the whole minibatch's counts, every rank's part: N ranks compute the gradient of one process on it
    num_tokens, num_seqs = all_sum(torch.stack([mb_mask.sum(), torch.tensor(len(mb_inds), device=mb_mask.device)]))
    num_tokens = num_tokens.clamp(min=1)
    context_length = batch["context_length"]
    totals = {}  # tensors, read once per minibatch: no device sync inside the micro-batch loop
    for part, width in micro_batches(batch["attention_mask"][mb_inds, context_length:], args.micro_batch_size):
        inds = mb_inds[part]
        mask, advantages = mb_mask[part, :width], mb_advantages[part, :width]
        sequences = batch["query_responses"][inds, : context_length + width]
        attention = batch["attention_mask"][inds, : context_length + width]
        with models.autocast():
            with torch.set_grad_enabled(train_policy or args.shared_critic):
                (states, head), hidden = policy_forward(models.policy, sequences, attention, context_length, args.shared_critic)
                logprobs, entropy = logprobs_and_entropy(states, head, batch["responses"][inds, :width], args.temperature,
                                                         train_policy and args.ent_coef != 0)
            ptx_lm_loss = ptx_loss(models, ptx["ids"], ptx["generator"], len(inds), sequences.device) if ptx and train_policy else 0.0
        old_logprobs = batch["logprobs"][inds, :width]
        pg_tokens, ratio, clipped = clipped_surrogate_loss(
            logprobs, old_logprobs, advantages, args.clip_eps, args.clip_eps_high, args.dual_clip
        )

        def aggregate(x):
            return aggregate_loss(x, mask, args.loss_aggregation, num_tokens, num_seqs)

        pg_loss, entropy_bonus = aggregate(pg_tokens), aggregate(entropy)
        ptx_lm_loss = ptx_lm_loss * len(inds) / num_seqs  # a mean per micro-batch: weight it by its share of sequences
        loss = 0.0
        if train_policy:
            loss = pg_loss - args.ent_coef * entropy_bonus + args.ptx_coef * ptx_lm_loss
            if ptx:
                totals["losses/ptx_loss"] = totals.get("losses/ptx_loss", 0.0) + ptx_lm_loss.detach()
            if models.value_head is None:  # a separate critic: free the policy's activations before it makes its own
                (loss * world_size()).backward()  # [dist] FSDP averages gradients over ranks; the normalisers are already global
                loss = 0.0
        with models.autocast():
            values = critic_values(models, sequences, attention, context_length, hidden)
        vf_tokens, vf_clipped = clipped_value_loss(values, batch["values"][inds, :width], batch["returns"][inds, :width],
                                                   args.value_clip_eps)
        vf_loss = aggregate(vf_tokens)
        ((loss + args.vf_coef * vf_loss) * world_size()).backward()  # [dist] as above
        # Losses carry the minibatch normalisers, so their micro-batch parts add up; token statistics are averaged.
        # approx KL(pi_old || pi_theta) is k3 with the roles swapped: the tokens were sampled by pi_old.
        approx_kl = kl_penalty(old_logprobs, logprobs.detach(), "k3")
        for key, value in (
            ("losses/policy_loss", pg_loss.detach()),
            ("losses/value_loss", vf_loss.detach()),
            ("policy/approx_kl", (approx_kl * mask).sum() / num_tokens),
            ("policy/clipfrac", (clipped & mask).sum() / num_tokens),
            ("policy/ratio", (ratio.detach() * mask).sum() / num_tokens),
            ("policy/entropy", (entropy.detach() * mask).sum() / num_tokens),
            ("val/clipfrac", (vf_clipped & mask).sum() / num_tokens),
        ):
            totals[key] = totals.get(key, 0.0) + value
    stats = dict(zip(totals, all_sum(torch.stack(list(totals.values()))).tolist()))  # [dist] each rank's part of the sums
    if not (math.isfinite(stats["losses/policy_loss"]) and math.isfinite(stats["losses/value_loss"])):
        raise NonFiniteLoss(f"policy loss {stats['losses/policy_loss']:.4g}, value loss {stats['losses/value_loss']:.4g}")
    stats.update(optimizer_step(models, optimizers, args, train_policy, stats["policy/approx_kl"]))
    return stats


def clip_grad_norm(parameters, max_norm: float, name: str) -> float:
    """Global gradient-norm clip; a non-finite norm stops the run before the optimizer can spread it into the weights."""
    norm = nn.utils.clip_grad_norm_(parameters, max_norm)
    norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()  # [dist] a DTensor under FSDP
    if not math.isfinite(norm):
        raise NonFiniteLoss(f"{name} gradient norm {norm}")
    return norm


def optimizer_step(models: Models, optimizers: dict, args: Args, train_policy: bool, minibatch_kl: float) -> dict:
    """Clip each network's gradient norm and step; with --target-kl, a minibatch that already strayed too far from
    pi_old is not applied and the update stops (the check happens before the step, as in Spinning Up)."""
    stats = {}
    early_stop = args.target_kl is not None and train_policy and minibatch_kl > args.target_kl
    if train_policy and not early_stop:
        stats["grad/policy_norm"] = clip_grad_norm(models.policy.parameters(), args.max_grad_norm, "policy")
        optimizers["policy"].step()
    if not early_stop:
        if models.value_head is not None:
            average_gradients(models.value_head)  # [dist]
        stats["grad/critic_norm"] = clip_grad_norm(models.critic_parameters(), args.max_grad_norm, "critic")
        optimizers["critic"].step()
    for optimizer in optimizers.values():
        optimizer.zero_grad(set_to_none=True)
    models.policy.zero_grad(set_to_none=True)  # frozen-policy phases still backprop a shared critic's loss into it
    stats["early_stop"] = float(early_stop)
    return stats


def ppo_update(models: Models, optimizers: dict, batch: dict, args: Args, train_policy: bool, critic_lambda: float,
               generator: torch.Generator, ptx: dict) -> dict:
    """K epochs over the batch, reshuffled each epoch into minibatches; returns the mean of minibatch statistics."""
    models.policy.train()  # dropout is off (but a nonzero --lora-dropout); train mode enables gradient checkpointing
    if models.critic is not None:
        models.critic.train()
    history = {}
    for epoch in range(args.num_epochs):
        if epoch > 0 and args.recompute_advantages:
            batch["values"] = recompute_values(models, batch, args)
            compute_advantages(batch, args, critic_lambda)
        batch_size = len(batch["responses"])  # [dist] this rank's part of the batch
        permutation = torch.randperm(batch_size, generator=generator, device="cpu").to(batch["responses"].device)
        for start in range(0, batch_size, args.minibatch_size):
            progress(f"updating: epoch {epoch + 1}/{args.num_epochs}, minibatch {start // args.minibatch_size + 1}/"
                     f"{math.ceil(batch_size / args.minibatch_size)}")
            stats = minibatch_step(models, optimizers, batch, permutation[start : start + args.minibatch_size], args, train_policy, ptx)
            for key, value in stats.items():
                history.setdefault(key, []).append(value)
            if stats["early_stop"]:
                break
        if stats["early_stop"]:
            break
    models.policy.eval()
    if models.critic is not None:
        models.critic.eval()
    summary = {key: sum(v) / len(v) for key, v in history.items() if key != "early_stop"}
    summary["policy/early_stopped"] = float(bool(history["early_stop"][-1]))
    summary["policy/epochs_completed"] = epoch + (0.0 if stats["early_stop"] else 1.0)
    return summary


# ---------------------------------------------------------------------------------------------------------
# Evaluation, logging, checkpoints
# ---------------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(models: Models, reward, eval_ids: list[list[int]], eval_rows: list[dict], args: Args, device) -> dict:
    """Greedy decoding on the eval prompts; eval/reward is the mean raw score (accuracy for exact match).
    [dist] Each rank decodes its 1/N of the prompts, the last ones repeated to an equal share (the sharded reward
    model's forward passes need every rank) and left out of the means."""
    share = math.ceil(len(eval_rows) / world_size())
    mine = list(range(rank() * share, min((rank() + 1) * share, len(eval_rows))))
    padded = mine + [mine[-1] if mine else 0] * (share - len(mine))
    scores, lengths, eos = [], [], []
    for start in range(0, share, args.batch_size):
        progress(f"evaluating: prompts {start + 1}-{min(start + args.batch_size, share)} of {share}")
        inds = padded[start : start + args.batch_size]
        with models.autocast():
            rollout = generate(models, [eval_ids[i] for i in inds], args, greedy=True, device=device)
            scores.append(score_responses(models, *reward, rollout, [eval_rows[i] for i in inds], args))
        lengths.append(rollout["response_mask"].sum(1).float())
        eos.append(rollout["has_eos"].float())
    progress("")
    return {
        key: gather_cat(torch.cat(values)[: len(mine)]).mean().item()  # [dist]
        for key, values in (("eval/reward", scores), ("eval/response_length", lengths), ("eval/eos_rate", eos))
    }


class MetricsLog:
    """One JSON object per iteration in <output-dir>/metrics.jsonl; TensorBoard and W&B with --track."""

    def __init__(self, args: Args, start_iteration: int):
        self.enabled = rank() == 0  # [dist] rank 0 alone writes
        self.rows = []  # the rows kept from before a resume, for the doctor
        self.writer = self.wandb = None
        if not self.enabled:
            return
        self.path = Path(args.output_dir) / "metrics.jsonl"
        # A fresh run starts a new file; a resumed one keeps the rows up to its checkpoint and drops any logged after it.
        kept = []
        if start_iteration > 0 and self.path.exists():
            for line_number, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash mid-write
                    print(f"warning: {self.path}, line {line_number} is not valid JSON (cut by a crash?); dropped")
                    continue
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


LEGEND = """columns: score  mean score of the sampled responses         kl    KL to the reference, summed over a response
         ent    policy entropy per token                    clip  fraction of tokens clipped
         ev     the critic's explained variance (1 = perfect, 0 = no better than the mean return)
         len    response length in tokens                   s     seconds per iteration
         eval   greedy reward on the eval prompts
lines starting with "doctor" name an instability signal (seed 001 §9.3) and the knob to turn; --doctor off hides them"""


def progress(text: str) -> None:
    """Say which phase runs now, on one line that the next one overwrites; only on a terminal (a log file stays clean)."""
    if sys.stdout.isatty():
        print(f"\r\033[K{text}", end="" if text else "\r", flush=True)


def print_line(m: dict) -> None:
    progress("")
    text = (f"iter {m['iteration']:>4} | score {m['objective/scores']:.3f} | kl {m['objective/kl']:.3f} "
            f"| ent {m['policy/entropy']:.3f} | clip {m['policy/clipfrac']:.3f} | ev {m['val/explained_variance']:.2f} "
            f"| len {m['rollout/response_length']:.1f} | {m['time/iteration']:.1f}s")
    if "eval/reward" in m:
        text += f" | eval {m['eval/reward']:.3f}"
    print(text, flush=True)


def save_policy(models: Models, path: Path, final: bool = False) -> None:
    """The policy and tokenizer with save_pretrained (and the model's own generation config, which the sampler ignores).
    [lora] A checkpoint holds the adapters alone; the final policy is a plain model, the adapters merged into it.
    [dist] Every rank takes part in gathering the weights; rank 0 writes them."""
    state_dict = None if models.lora else full_state_dict(models.policy)  # [lora] each rank holds a whole replica
    if rank() != 0:
        return
    model = models.policy.merge_and_unload() if models.lora and final else models.policy  # the run ends: merge in place
    model.save_pretrained(path, state_dict=state_dict)
    models.tokenizer.save_pretrained(path)


def save_checkpoint(path: Path, models: Models, optimizers: dict, state: dict, args: Args) -> None:
    """Policy (and critic) with save_pretrained, plus optimisers, counters and RNG state. Written to a temporary
    directory first and renamed, so a crash mid-save never destroys the previous checkpoint. [dist] Every rank takes
    part (the weights, the optimizer states and each rank's RNG state are gathered); rank 0 writes."""
    tmp = path.with_name(path.name + ".tmp")
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    save_policy(models, tmp / "policy")
    critic_state = full_state_dict(models.critic) if models.critic is not None and not models.lora else None
    trained = dict(policy=models.policy, critic=models.critic if models.critic is not None else models.value_head)
    optimizer_states = {name: optimizer_state(trained[name], opt) for name, opt in optimizers.items()}
    rng = all_gather_objects(dict(torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None))
    if rank() == 0:
        if models.critic is not None:
            models.critic.save_pretrained(tmp / "critic", state_dict=critic_state)
        else:
            torch.save(models.value_head.state_dict(), tmp / "value_head.pt")
        training_state = dict(state, script="ppo", args=asdict(args), world_size=world_size(), rng=rng,
                              optimizers=optimizer_states)
        torch.save(training_state, tmp / "training_state.pt")
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        if args.save_total_limit is not None:  # keep this one and the newest others (by N) up to the limit
            others = [p for p in checkpoints_in(path.parent) if p != path]
            for old in others[: len(others) - (args.save_total_limit - 1)]:
                shutil.rmtree(old)
    barrier()  # [dist] no rank goes on (or exits on a stop request) before the checkpoint is in place


def checkpoints_in(output_dir: Path) -> list[Path]:
    """The checkpoint-N directories in output_dir, oldest first."""
    found = [p for p in output_dir.glob("checkpoint-*") if p.is_dir() and p.name.removeprefix("checkpoint-").isdigit()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("checkpoint-")))


def read_checkpoint(args: Args) -> dict:
    """The training state of --resume-from, checked before any model loads: a complete checkpoint of this script,
    written with the same flags except RESUME_MAY_CHANGE, and not past --num-iterations."""
    path = Path(args.resume_from)
    if not (path / "training_state.pt").is_file():
        raise ConfigError(f"--resume-from {path}: not a checkpoint directory (no training_state.pt)")
    try:
        state = torch.load(path / "training_state.pt", map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:
        raise ConfigError(f"--resume-from {path}: training_state.pt is truncated or corrupt ({type(e).__name__})") from None
    if not isinstance(state, dict) or not {"args", "iteration"} <= state.keys():
        raise ConfigError(f"--resume-from {path}: training_state.pt is not a training state of ppo_llm.py or grpo_llm.py")
    script = state.get("script", "ppo" if "optimizers" in state else "grpo")
    if script != "ppo":
        raise ConfigError(f"--resume-from {path}: a checkpoint of {script}_llm.py, not of ppo_llm.py")
    saved = {**asdict(Args()), **state["args"]}  # a flag newer than the checkpoint had its default then
    changed = [f"{as_flag(k)} {saved[k]} in the checkpoint, {v} now" for k, v in asdict(args).items()
               if k not in RESUME_MAY_CHANGE and saved[k] != v]
    if changed:
        raise ConfigError(f"--resume-from {path}: flags differ from the run that wrote it: {'; '.join(changed)}")
    needed = ["policy"] + (["value_head.pt"] if args.shared_critic else ["critic"])
    missing = [name for name in needed if not (path / name).exists()]
    if missing:
        raise ConfigError(f"--resume-from {path}: incomplete checkpoint, no {' or '.join(missing)}")
    if state.get("world_size", 1) != launched_ranks():  # [dist] each rank continues its own sampler
        raise ConfigError(f"--resume-from {path}: written by {state.get('world_size', 1)} rank(s), resumed with "
                          f"{launched_ranks()}; resume with torchrun --nproc_per_node {state.get('world_size', 1)}")
    if args.num_iterations < state["iteration"]:
        raise ConfigError(f"--num-iterations {args.num_iterations} is below the checkpoint's iteration {state['iteration']}")
    return state


def load_training_state(training_state: dict, models: Models, optimizers: dict) -> dict:
    trained = dict(policy=models.policy, critic=models.critic if models.critic is not None else models.value_head)
    for name, optimizer in optimizers.items():
        load_optimizer_state(trained[name], optimizer, training_state["optimizers"][name])
    if "rng" in training_state:  # one RNG state per rank
        rng = training_state["rng"][rank()]
        torch.set_rng_state(rng["torch"])
        if torch.cuda.is_available() and rng["cuda"] is not None:
            torch.cuda.set_rng_state(rng["cuda"])
    else:  # a checkpoint of one process, written before the per-rank states
        torch.set_rng_state(training_state["torch_rng"])
        if torch.cuda.is_available() and "cuda_rng" in training_state:
            torch.cuda.set_rng_state_all(training_state["cuda_rng"])
    skipped = ("optimizers", "torch_rng", "cuda_rng", "rng", "world_size", "args", "script")
    return {k: v for k, v in training_state.items() if k not in skipped}


EARLIER_RUN = ("metrics.jsonl", "policy", "checkpoint-*", "tb", "wandb")  # what --overwrite removes


def lock_output_dir(args: Args):
    """Create --output-dir and hold an exclusive lock on it for the whole run, so that a second run into the same
    directory stops instead of interleaving its metrics and checkpoints with ours. Returns the open lock file."""
    output_dir = Path(args.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output-dir {output_dir}: exists and is not a directory")
    try:
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


def earlier_run(args: Args) -> list[Path]:
    """What an earlier run left in --output-dir. A fresh run needs --overwrite to replace it; a run resuming from one
    of its checkpoints continues it."""
    output_dir = Path(args.output_dir)
    found = sorted(p for pattern in EARLIER_RUN for p in output_dir.glob(pattern))
    resuming_here = args.resume_from and Path(args.resume_from).resolve().parent == output_dir.resolve()
    if found and resuming_here and args.overwrite:
        raise ConfigError(f"--overwrite would delete --resume-from {args.resume_from}; drop one of them")
    if found and not resuming_here and not args.overwrite:
        names = ", ".join(p.name for p in found[:3]) + (", ..." if len(found) > 3 else "")
        raise ConfigError(f"--output-dir {output_dir} holds an earlier run ({names}); pass --overwrite to replace it, "
                          f"or --resume-from one of its checkpoints")
    return found if args.overwrite else []


# ---------------------------------------------------------------------------------------------------------
# The training doctor: seed 001 §9.3's instability signals, and what the seeds' knobs imply, read off the metrics
# of the run so far. Each signal tests the median of the last DOCTOR_WINDOW iterations, so that one noisy batch does
# not trigger it, and names the knobs to turn in §9.2's priority order: beta, then clip epsilon, then learning rate.
# ---------------------------------------------------------------------------------------------------------

DOCTOR_WINDOW = 5  # iterations each signal's median covers
DOCTOR_REPEAT = 10  # iterations before the same warning is printed again
KL_PER_TOKEN_MAX = 0.3  # §9.3: KL(pi || pi_ref) above 0.3 per token
CLIPFRAC_MAX = 0.2  # §9.3: more than 20% of tokens clipped
ENTROPY_MIN = 0.01  # §9.3: entropy falling to 0 (nats per token)
GRAD_NORM_MAX = 5.0  # §9.3: gradient norm above 5 (before clipping)
LENGTH_COLLAPSE_MAX = 1.5  # responses of about one token: the policy stops at once
LENGTH_PINNED_FRACTION = 0.95  # responses of about --max-new-tokens: the policy no longer stops
EOS_RATE_DROP = 0.2  # the fraction of responses ending in EOS fell this much below the run's first iterations
EVAL_DROP = 0.05  # eval/reward this far below its best while the training reward rose: reward hacking
VALUE_LOSS_GROWTH = 2.0  # §9.3: value loss growing: rising for a whole window, to this many times its lowest
# The critic predicts the returns worse than their mean does. Below 0 by a margin: a critic with nothing left to
# predict (the demo's, once the policy carries) hovers at 0, its window medians down to -0.03.
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
    found = {}
    beta = ("raise --kl-coef (beta)" + (" or use --kl-schedule adaptive" if args.kl_schedule == "fixed" else "")
            if args.kl_coef > 0 else "add a KL penalty (--kl-coef 0.05; this run has none)")
    window = f"median of {DOCTOR_WINDOW} iterations"
    kl, reward, clipfrac, entropy, length, eos, value_loss, explained_variance = (
        window_medians(history, metric) for metric in (
            per_token_kl, logged("objective/scores"), logged("policy/clipfrac"), logged("policy/entropy"),
            logged("rollout/response_length"), logged("rollout/eos_rate"), logged("losses/value_loss"),
            logged("val/explained_variance")))
    if kl and kl[-1] > KL_PER_TOKEN_MAX:
        found["kl_high"] = (f"KL to the reference {kl[-1]:.3f} per token > {KL_PER_TOKEN_MAX} ({window}): {beta}, then "
                            "lower --clip-eps, then --learning-rate")
    if reward and reward[-1] <= 0 < max(reward):
        found["reward_collapse"] = (f"training score fell to {reward[-1]:.3f} <= 0 from {max(reward):.3f} ({window}): "
                                    f"resume from an earlier checkpoint (--resume-from), check the reward, then {beta} "
                                    "or lower --learning-rate")
    rising = len(value_loss) > DOCTOR_WINDOW and all(
        earlier < later for earlier, later in zip(value_loss[-DOCTOR_WINDOW - 1 :], value_loss[-DOCTOR_WINDOW:]))
    if rising and value_loss[-1] > VALUE_LOSS_GROWTH * min(value_loss):
        found["value_loss_growing"] = (f"value loss {value_loss[-1]:.4f} has risen for {DOCTOR_WINDOW} iterations, to more "
                                       f"than {VALUE_LOSS_GROWTH:g}x its lowest {min(value_loss):.4f} ({window}): warm up "
                                       "the critic (--critic-warmup-iterations, --value-pretrain-steps), raise --vf-coef "
                                       "(seed 001 §9.3), or lower --critic-learning-rate")
    if clipfrac and clipfrac[-1] > CLIPFRAC_MAX:
        found["clipfrac_high"] = (f"clip fraction {clipfrac[-1]:.3f} > {CLIPFRAC_MAX} ({window}): raise --clip-eps "
                                  "(seed 001 §9.3), then lower --learning-rate or --num-epochs")
    if entropy and entropy[-1] < ENTROPY_MIN:
        found["entropy_collapse"] = (f"policy entropy {entropy[-1]:.4f} < {ENTROPY_MIN} nats per token ({window}): "
                                     "raise --ent-coef (seed 001 §9.3) or --temperature, or --clip-eps-high 0.28 (DAPO)")
    for model, knob in (("policy", "--learning-rate"), ("critic", "--critic-learning-rate")):
        grad_norm = window_medians(history, logged(f"grad/{model}_norm"))
        if grad_norm and grad_norm[-1] > GRAD_NORM_MAX:
            found["grad_norm_high" if model == "policy" else "critic_grad_norm_high"] = (
                f"{model} gradient norm {grad_norm[-1]:.2f} > {GRAD_NORM_MAX} before clipping ({window}): lower {knob}; "
                f"--max-grad-norm {args.max_grad_norm} clips each step")
    if explained_variance and explained_variance[-1] < EXPLAINED_VARIANCE_MIN:
        found["explained_variance_negative"] = (
            f"critic explained variance {explained_variance[-1]:.2f} < {EXPLAINED_VARIANCE_MIN} ({window}): its values "
            "are worse than the mean return; --critic-warmup-iterations, --value-pretrain-steps, --critic-learning-rate")
    truncation_knobs = ("--missing-eos-penalty 1.0, or raise --max-new-tokens" if args.missing_eos_penalty == 0
                        else "raise --missing-eos-penalty or --max-new-tokens")
    if length and length[-1] <= LENGTH_COLLAPSE_MAX < length[0]:
        found["length_collapse"] = (f"response length {length[-1]:.2f} tokens <= {LENGTH_COLLAPSE_MAX} ({window}): the "
                                    f"policy stops at once; check that the reward does not pay for empty answers, then {beta}")
    if length and length[-1] >= LENGTH_PINNED_FRACTION * args.max_new_tokens:
        found["length_pinned"] = (f"response length {length[-1]:.1f} >= {LENGTH_PINNED_FRACTION} x --max-new-tokens "
                                  f"{args.max_new_tokens} ({window}): responses run to the limit; {truncation_knobs}")
    if eos and eos[-1] < eos[0] - EOS_RATE_DROP:
        found["eos_rate_falling"] = (f"EOS rate {eos[-1]:.2f} < {eos[0]:.2f} at the start - {EOS_RATE_DROP} ({window}): "
                                     f"fewer responses stop; {truncation_knobs}")
    evals = [(i, row["eval/reward"]) for i, row in enumerate(history) if "eval/reward" in row]
    if evals and reward:
        best_at, best_eval = max(evals, key=lambda e: e[1])
        # the training reward when the eval was best; the first window's if that came before it (the eval before training)
        reward_then = window_medians(history[: best_at + 1], logged("objective/scores")) or reward[:1]
        if evals[-1][1] < best_eval - EVAL_DROP and reward[-1] > reward_then[-1]:
            found["reward_hacking"] = (f"eval/reward {evals[-1][1]:.3f} < its best {best_eval:.3f} - {EVAL_DROP} while the "
                                       f"training score rose ({reward_then[-1]:.3f} -> {reward[-1]:.3f}): the policy may "
                                       f"exploit the reward; check it on samples, then {beta}")
    early_stops = [row["policy/early_stopped"] for row in history if "policy/early_stopped" in row][-DOCTOR_WINDOW:]
    if len(early_stops) == DOCTOR_WINDOW and sum(early_stops) / DOCTOR_WINDOW > EARLY_STOP_MOST:
        found["early_stopping"] = (f"--target-kl {args.target_kl} stopped the epochs on {sum(early_stops):.0f} of the last "
                                   f"{DOCTOR_WINDOW} iterations, more than {EARLY_STOP_MOST:.0%}: lower --learning-rate "
                                   "or --num-epochs, or raise --target-kl")
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


# ---------------------------------------------------------------------------------------------------------
# Checks before anything loads, and the training loop
# ---------------------------------------------------------------------------------------------------------


def check_args(args: Args) -> None:
    """Fail fast, with one line naming the flag, before any model is loaded: ranges, then combinations."""
    for name, interval in RANGES.items():
        if getattr(args, name) is not None:
            check_range(name, getattr(args, name), interval)
    defaults = Args()
    for name, why, needed in ONLY_WITH:
        if getattr(args, name) != getattr(defaults, name) and not needed(args):
            raise ConfigError(f"{as_flag(name)} {why}")
    high = args.clip_eps if args.clip_eps_high is None else args.clip_eps_high
    if args.dual_clip is not None and args.dual_clip <= 1 + high:
        raise ConfigError(f"--dual-clip {args.dual_clip} must exceed 1 + the upper clip epsilon ({1 + high:g}): a lower "
                          "cap would act inside the clip range")
    args.batch_size = args.num_prompts * args.num_generations
    ranks = launched_ranks()  # [dist] each rank samples and trains on its 1/N of the batch
    exact_div(args.num_prompts, ranks, f"--num-prompts (the whole batch's prompts) must split over the {ranks} torchrun ranks")
    args.minibatch_size = exact_div(args.batch_size // ranks, args.num_minibatches,
                                    f"--num-prompts x --num-generations (the batch{' of each rank' if ranks > 1 else ''}) "
                                    "must split into --num-minibatches")
    args.micro_batch_size = min(args.micro_batch_size, args.minibatch_size)
    exact_div(args.minibatch_size, args.micro_batch_size, "the minibatch (batch / --num-minibatches) must split into --micro-batch-size")
    if args.kl_schedule == "adaptive" and args.kl_coef == 0:
        raise ConfigError("--kl-schedule adaptive scales --kl-coef up and down, so it needs --kl-coef > 0")
    if args.kl_schedule == "adaptive" and args.kl_horizon <= 0.2 * args.batch_size:
        raise ConfigError(f"--kl-horizon {args.kl_horizon} must exceed 0.2 x the batch ({args.batch_size} responses), "
                          f"or one step of the adaptive controller can make beta negative")
    if args.reward_model_path is None and args.reward_fn is None:
        args.reward_fn = "exact_match"
    if args.critic_init == "reward" and not args.reward_model_path:
        raise ConfigError("--critic-init reward needs --reward-model-path")
    if args.critic_init == "reward" and args.shared_critic:
        raise ConfigError("--critic-init reward needs a separate critic; drop --shared-critic")
    if args.ptx_coef > 0 and not args.ptx_path:
        raise ConfigError("--ptx-coef > 0 needs --ptx-path")
    if args.lora_r and launched_ranks() > 1:  # [lora] [dist] FSDP2's units would have to be placed around peft's
        raise ConfigError("--lora-r under torchrun is not supported yet: train LoRA adapters in one process")
    for option, wanted, package in (("--track", args.track, "tensorboard"), ("--wandb-project", args.wandb_project, "wandb"),
                                    ("--lora-r", args.lora_r, "peft")):
        if wanted and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{option} needs the {package} package: pip install {package}")
    if not args.prompt_field or not args.answer_field or args.prompt_field == args.answer_field:
        raise ConfigError(f"--prompt-field {args.prompt_field!r} and --answer-field {args.answer_field!r} must be two "
                          "different, non-empty field names")
    check_model_path(args.model_name_or_path, "--model-name-or-path")
    if args.reward_model_path:
        check_model_path(args.reward_model_path, "--reward-model-path")


def load_reward(args: Args, prompt_files: list[PromptFile]) -> tuple[Optional[Callable], str]:
    if args.reward_model_path:
        return None, args.reward_model_path
    fn = load_reward_fn(args.reward_fn)
    if args.reward_fn in BUILTIN_REWARD_FNS:
        for prompts in prompt_files:
            missing = next((i for i, row in enumerate(prompts.rows) if row.get("answer") is None), None)
            if missing is not None:
                raise ConfigError(f"{prompts.where(missing)}: --reward-fn {args.reward_fn} needs the field {args.answer_field!r} "
                                  "(--answer-field) in every row")
    return fn, args.reward_fn


def rollout_phase(models: Models, reward, rows: list[dict], prompt_ids: list[list[int]], args: Args, device) -> dict:
    """1. generate num_generations responses per prompt, 2. mask after the first EOS, 3. score,
    4. log-probs of policy and reference and values of the critic on the sampled tokens."""
    rows = [row for row in rows for _ in range(args.num_generations)]
    prompt_ids = [ids for ids in prompt_ids for _ in range(args.num_generations)]
    with models.autocast():
        progress("sampling responses")
        with phase("generate"):
            batch = generate(models, prompt_ids, args, greedy=False, device=device)
        progress("scoring, reference and critic forward passes")
        with phase("score"):
            batch["raw_scores"] = score_responses(models, *reward, batch, rows, args)
        batch.update(forward_rollout(models, batch, args))
    batch["rows"] = rows
    return batch


def run_iteration(models, optimizers, reward, data, args, state, device, train_policy, critic_lambda, step) -> dict:
    """Rollout -> rewards -> advantages -> update on the prompts of `step` in the data order (value pretraining
    takes the first steps, then each iteration the next)."""
    rows, prompt_ids = data["rows"], data["prompt_ids"]
    PHASE_SECONDS.clear()
    release_freed_memory(models, args.batch_size // world_size())  # the last update's, before the sampler's
    start = time.time()
    share = args.num_prompts // world_size()  # [dist] this rank's prompts
    inds = batch_indices(step, args.num_prompts, len(rows), args.seed)[rank() * share : (rank() + 1) * share]
    batch = rollout_phase(models, reward, [rows[i] for i in inds], [prompt_ids[i] for i in inds], args, device)
    rollout_time = time.time() - start
    shape_rewards(batch, args, state["kl_coef"], state)
    compute_advantages(batch, args, critic_lambda)
    mask = batch["response_mask"]
    # [dist] one value per response, or per real token, of the whole batch: every rank's
    whole = {key: gather_cat(value.float()) for key, value in dict(
        raw_scores=batch["raw_scores"], kl=batch["kl"].sum(1), rlhf_reward=batch["rewards"].sum(1), scores=batch["scores"],
        lengths=mask.sum(1), has_eos=batch["has_eos"], values=batch["values"][mask], returns=batch["returns"][mask]).items()}
    metrics = {
        "objective/scores": whole["raw_scores"].mean().item(),
        "objective/kl": whole["kl"].mean().item(),
        "objective/non_score_reward": (whole["rlhf_reward"] - whole["scores"]).mean().item(),
        "objective/rlhf_reward": whole["rlhf_reward"].mean().item(),
        "objective/kl_coef": state["kl_coef"],
        "rollout/response_length": whole["lengths"].mean().item(),
        "rollout/eos_rate": whole["has_eos"].mean().item(),
        "val/values_mean": whole["values"].mean().item(),
        "val/returns_mean": whole["returns"].mean().item(),
        "val/explained_variance": explained_variance(whole["values"], whole["returns"], torch.ones_like(whole["values"])),
        "perf/generated_tokens_per_sec": whole["lengths"].sum().item() / max(rollout_time, 1e-9),
    }
    # [dist] ranks differ only in their pretraining texts (PPO-ptx); the minibatch order is each rank's own anyway
    generator = torch.Generator().manual_seed((args.seed * 1_000_003 + step + 7_919 * rank()) % 2**64)
    release_freed_memory(models, args.batch_size // world_size())  # the sampler's, before the update's
    update_start = time.time()
    ptx = dict(ids=data["ptx_ids"], generator=generator) if args.ptx_coef > 0 else {}
    metrics.update(ppo_update(models, optimizers, batch, args, train_policy, critic_lambda, generator, ptx))
    metrics.update({"time/rollout": rollout_time, "time/update": time.time() - update_start})
    metrics.update({f"time/{name}": seconds for name, seconds in PHASE_SECONDS.items()})
    metrics["samples"] = [(row["prompt"], c, s) for row, c, s in zip(
        batch["rows"][:3], models.tokenizer.batch_decode(batch["responses"][:3], skip_special_tokens=True), batch["raw_scores"][:3].tolist())]
    return metrics


def next_kl_coef(args: Args, state: dict, kl: float) -> float:
    if args.kl_schedule == "linear":
        return linear_kl_coef(state["iteration"] + 1, args.num_iterations, args.kl_coef, args.kl_coef_final)
    if args.kl_schedule == "adaptive":
        return adaptive_kl_coef(state["kl_coef"], kl, args.kl_target, args.batch_size, args.kl_horizon)
    return state["kl_coef"]


class Interrupted(Exception):
    """The run stopped on SIGTERM or Ctrl-C, after checkpointing the iterations it did; exit 128 + the signal's number."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


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
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this iteration (Ctrl-C again to stop at once)", flush=True)

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def train(args: Args) -> dict:
    """The run, with SIGTERM and Ctrl-C handled, and the output directory's lock released however it ends."""
    device = init_distributed()  # [dist]
    try:
        with StopRequests() as stop, contextlib.ExitStack() as held:
            return train_until_done_or_stopped(args, stop, held, device)
    finally:
        gc.unfreeze()  # a caller in the same process (the tests, a notebook) gets the frozen objects collected again
        if dist.is_initialized():
            dist.destroy_process_group()


def train_until_done_or_stopped(args: Args, stop: StopRequests, held: contextlib.ExitStack, device: torch.device) -> dict:
    check_args(args)
    training_state = read_checkpoint(args) if args.resume_from else None
    field_names = (args.prompt_field, args.answer_field)
    prompts = load_prompts(args.prompts_path, "--prompts-path", *field_names, args.dataset_split, args.dataset_config)
    eval_prompts = load_prompts(args.eval_prompts_path, "--eval-prompts-path", *field_names, args.eval_dataset_split,
                                args.dataset_config) if args.eval_every > 0 else None
    reward_fn, reward_name = load_reward(args, [prompts] + ([eval_prompts] if eval_prompts else []))
    ptx_texts = load_ptx_texts(args.ptx_path) if args.ptx_coef > 0 else None
    lock = on_rank_zero(lock_output_dir, args)  # [dist] rank 0 alone checks, locks and writes the output directory
    if lock is not None:
        held.enter_context(lock)
    earlier = on_rank_zero(earlier_run, args) or []
    resume = Path(args.resume_from) if args.resume_from else None
    torch.manual_seed(args.seed)

    models = Models(args, device, resume)
    if world_size() > 1:  # [dist] every rank samples its own responses
        torch.manual_seed(args.seed + 1_000_003 * rank())
    reward = (reward_fn, reward_name)
    tokenizer = models.tokenizer
    if models.lora:  # [lora]
        trained_count = sum(p.numel() for p in models.policy.parameters() if p.requires_grad)
        total = sum(p.numel() for p in models.policy.parameters())
        print(f"LoRA: the policy trains {trained_count:,} of its {total:,} parameters; the reference is the policy with its "
              "adapters off")
    print(f"stop tokens: {' '.join(tokenizer.convert_ids_to_tokens(models.eos_token_ids))}")
    data = dict(rows=prompts.rows, prompt_ids=tokenize_prompts(tokenizer, prompts, args),
                ptx_ids=[ids[: args.max_prompt_length + args.max_new_tokens - 1] + [tokenizer.eos_token_id]
                         for ids in encode(tokenizer, [row["prompt"] for row in ptx_texts.rows], ptx_texts, True)]
                if ptx_texts else [])
    eval_ids = tokenize_prompts(tokenizer, eval_prompts, args) if eval_prompts else []
    eval_rows = eval_prompts.rows if eval_prompts else []
    num_params = sum(p.numel() for p in models.policy.parameters())  # [dist] a sharded tensor counts whole
    by_size = dict(zip(("policy", "critic"), default_learning_rates(num_params)))
    learning_rates = {"policy": args.learning_rate, "critic": args.critic_learning_rate}
    for name, flag in (("policy", "--learning-rate"), ("critic", "--critic-learning-rate")):
        if learning_rates[name] is None:
            learning_rates[name] = by_size[name]
            print(f"{name} learning rate {by_size[name]:g}, by the policy's size ({num_params / 1e6:.1f}M parameters); "
                  f"{flag} sets another" + ("; this is a full fine-tuning rate, LoRA usually wants about 10x"
                                            if args.lora_r else ""))
    optimizers = {
        "policy": torch.optim.AdamW([p for p in models.policy.parameters() if p.requires_grad],  # [lora] the adapters
                                    lr=learning_rates["policy"], eps=args.adam_eps, weight_decay=args.weight_decay, fused=True),
        "critic": torch.optim.AdamW(models.critic_parameters(), lr=learning_rates["critic"], eps=args.adam_eps,
                                    weight_decay=args.weight_decay, fused=True),
    }  # fused: one pass per tensor, no temporaries (a 151,936 x 256 embedding's step took 0.2 s for-loop, 0.02 s fused)
    state = dict(iteration=0, kl_coef=args.kl_coef, reward_mean=0.0, reward_var=1.0, reward_count=0, eval_before=None, eval_after=None)
    if resume:
        state.update(load_training_state(training_state, models, optimizers))
        print(f"resumed from {resume} at iteration {state['iteration']}")
    for path in earlier:  # --overwrite: only now that everything has loaded
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    output_dir = Path(args.output_dir)
    log = MetricsLog(args, state["iteration"])
    held.callback(log.close)
    doctor = Doctor(args, log.rows)  # a resumed run's doctor sees the iterations before its checkpoint too
    print(f"output: {output_dir}/ gets metrics.jsonl (every iteration)"
          + (f", checkpoint-N (every {args.save_every} iterations)" if args.save_every else "")
          + ", policy/ (at the end)" + (", tb/ (TensorBoard)" if args.track else ""), flush=True)
    critic_lambda = args.gae_lambda if args.critic_gae_lambda is None else args.critic_gae_lambda
    run = dict(models=models, optimizers=optimizers, reward=reward, data=data, args=args, state=state, device=device)
    start_time, first_iteration = time.time(), state["iteration"]

    def stop_if_asked(saved: bool) -> None:
        signum = all_max(stop.signum or 0)  # [dist] all ranks stop together, at the same iteration
        if not signum:
            return
        if state["iteration"] == first_iteration:
            raise Interrupted(signum, "interrupted before the first update of this run; nothing new to save")
        checkpoint = output_dir / f"checkpoint-{state['iteration']}"
        if not saved:
            save_checkpoint(checkpoint, models, optimizers, state, args)
        print(run_summary(state, output_dir, time.time() - start_time, stopped=True), flush=True)
        raise Interrupted(signum, f"interrupted at iteration {state['iteration']}; resume with --resume-from {checkpoint}")

    if not resume and args.value_pretrain_steps > 0:  # VC-PPO: regress the critic on Monte Carlo returns first
        for step in range(args.value_pretrain_steps):
            stop_if_asked(saved=False)
            m = run_iteration(**run, train_policy=False, critic_lambda=1.0, step=step)
            progress("")
            print(f"value pretraining {step + 1}/{args.value_pretrain_steps} | value loss {m['losses/value_loss']:.4f} "
                  f"| ev {m['val/explained_variance']:.2f}")

    def should_eval(iteration: int) -> bool:  # every --eval-every updates, before the first and after the last
        return args.eval_every > 0 and (iteration % args.eval_every == 0 or iteration == args.num_iterations)

    # The start-up's objects (about 400,000: torch, transformers, the models) live as long as the run: frozen, Python's
    # full garbage collections, which otherwise scan them all (0.2 s each at the demo), leave them out.
    gc.freeze()
    stop_if_asked(saved=True)
    if should_eval(0) and state["iteration"] == 0:
        metrics = dict(iteration=0, **timed(evaluate, "time/eval", models, reward, eval_ids, eval_rows, args, device))
        state["eval_before"] = state["eval_after"] = metrics["eval/reward"]
        doctor.check(metrics)
        log.log(metrics)
        print(f"iter    0 | eval {state['eval_after']:.3f} (before training)", flush=True)
    print(LEGEND, flush=True)
    while state["iteration"] < args.num_iterations:
        iteration = state["iteration"]
        for name, base in learning_rates.items():
            for group in optimizers[name].param_groups:
                group["lr"] = learning_rate_at(iteration, args.num_iterations, base, args.lr_warmup_iterations, args.anneal_lr)
        train_policy = iteration >= args.critic_warmup_iterations
        iteration_start = time.time()
        metrics = run_iteration(**run, train_policy=train_policy, critic_lambda=critic_lambda,
                                step=args.value_pretrain_steps + iteration)
        metrics.update({"iteration": iteration + 1, "episodes": (iteration + 1) * args.batch_size,
                        "lr": optimizers["policy"].param_groups[0]["lr"], "time/iteration": time.time() - iteration_start,
                        "train/policy_frozen": float(not train_policy)})
        samples = metrics.pop("samples")
        state["kl_coef"] = next_kl_coef(args, state, metrics["objective/kl"])
        state["iteration"] = iteration + 1
        if should_eval(state["iteration"]):
            metrics.update(timed(evaluate, "time/eval", models, reward, eval_ids, eval_rows, args, device))
        state["eval_after"] = metrics.get("eval/reward", state["eval_after"])
        print_line(metrics)
        metrics.update(doctor.check(metrics))  # prints a line per warning, counts it in the metrics
        log.log(metrics)
        if args.sample_every > 0 and state["iteration"] % args.sample_every == 0:
            for prompt, completion, score in samples:
                print(f"    {prompt!r} -> {completion!r}  score {score:.3f}")
        saved = args.save_every > 0 and (state["iteration"] % args.save_every == 0 or state["iteration"] == args.num_iterations)
        if saved:
            save_checkpoint(output_dir / f"checkpoint-{state['iteration']}", models, optimizers, state, args)
        if state["iteration"] < args.num_iterations:  # after the last one the run ends anyway, with its final policy
            stop_if_asked(saved)

    # The run is over: the optimizer's states (twice the trainable weights) go before the save makes its serialized copy
    for optimizer in optimizers.values():
        optimizer.state.clear()
    save_policy(models, output_dir / "policy", final=True)
    barrier()  # [dist]
    print(run_summary(state, output_dir, time.time() - start_time, stopped=False), flush=True)
    return dict(eval_before=state["eval_before"], eval_after=state["eval_after"])


def run_summary(state: dict, output_dir: Path, seconds: float, stopped: bool) -> str:
    """The last line of a run: how far it got, the eval before and after, and where everything is."""
    text = f"{'stopped' if stopped else 'done'}: iteration {state['iteration']} in {seconds:.0f}s"
    if state["eval_before"] is not None:
        text += f"; eval/reward {state['eval_before']:.3f} -> {state['eval_after']:.3f}"
    checkpoints = checkpoints_in(output_dir)
    text += f"; metrics in {output_dir / 'metrics.jsonl'}"
    text += f"; last checkpoint {checkpoints[-1]}" if checkpoints else "; no checkpoint"
    return text + ("" if stopped else f"; final policy in {output_dir / 'policy'}")


def timed(fn, key: str, *fn_args) -> dict:
    start = time.time()
    result = fn(*fn_args)
    result[key] = time.time() - start
    return result


def main() -> None:
    args = parse_args(sys.argv[1:])
    transformers.logging.set_verbosity_error()  # keep stdout to our own lines (load reports, progress bars)
    transformers.logging.disable_progress_bar()
    try:
        train(args)
    except ConfigError as e:
        exit_with(f"error: {e}", 1)
    except NonFiniteLoss as e:
        checkpoints = checkpoints_in(Path(args.output_dir))
        last = f"the last checkpoint is {checkpoints[-1]}" if checkpoints else "no checkpoint was written"
        exit_with(f"error: non-finite loss ({e}); stopped without saving this iteration; {last}", 1)
    except Interrupted as e:
        exit_with(str(e), 128 + e.signum)
    except KeyboardInterrupt:
        exit_with("stopped at once by a second Ctrl-C; nothing saved since the last checkpoint", 128 + signal.SIGINT)


def exit_with(message: str, code: int) -> None:
    """Exit with one line on stderr. [dist] Every rank says it, the others prefixed by their rank: an error may be
    one rank's alone (its reward function on its completions)."""
    progress("")
    print(message if rank() == 0 else f"[rank {rank()}] {message}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    try:
        main()
    finally:
        gc.freeze()  # the interpreter's last collection at exit would walk every object of torch and transformers: 1.3 s
    if launched_ranks() > 1:  # [dist] a finished rank skips the interpreter's teardown, where gloo's threads could abort it
        sys.stdout.flush()  # (SIGABRT, "terminate called without an active exception") after its run had ended well
        sys.stderr.flush()
        os._exit(0)
