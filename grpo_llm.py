"""GRPO and its critic-free family in one file: GRPO, Dr. GRPO, DAPO, GSPO, CISPO, SAPO, VESPO, LUSPO, RLOO and ReMax.

No critic: each prompt gets G sampled responses, and the rewards of its group give each one's baseline. One iteration
(run_iteration): 1. rollout: sample G responses to each prompt, mask what follows each one's first EOS, score them, and
compute log pi_ref on their tokens; 2. advantages: each response's reward minus its group's mean, over the group's std;
3. update: --num-epochs passes over the batch, each in --num-minibatches optimizer steps on the clipped policy loss
- c * the entropy + beta * the KL to the reference (k3, in the loss), each response's token mean averaged over the
responses. Part 1 is that default path (GRPO's); each variant (Part 2) enters it where a comment names it (but those
that pick a model or a file), the other methods are presets of the variants' knobs (PRESETS, at the end of Part 2), and
each piece of machinery (Part 3) is a call whose name says what it returns. Needs numpy, torch, tyro, transformers >= 5.

With no flags it trains the tiny addition model in demo/ (beside this file), on CUDA if there is one; a real model:
    python grpo_llm.py --preset dapo --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --prompts-path math.jsonl \
        --eval-prompts-path math_eval.jsonl --reward-fn last_number --chat-template --dtype bfloat16 \
        --learning-rate 1e-6 --max-new-tokens 1024
GRPO (Shao et al. 2024, arXiv:2402.03300); PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347); the k3
KL estimator (Schulman 2020, "Approximating KL divergence"); the variants' papers in Part 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import pkgutil
import random
import re
import runpy
import shutil
import signal
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, fields, make_dataclass, replace
from pathlib import Path
from typing import Callable, Literal, Optional

import numpy
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dcp
import torch.nn as nn
import transformers
import tyro
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

DEMO = Path(__file__).resolve().parent / "demo"


# ---------------------------------------------------------------------------------------------------------------------
# Part 1: the algorithm
# ---------------------------------------------------------------------------------------------------------------------
# The default path's knobs, a dataclass per --help group, each comment its help; Args (Part 3) joins all, flat. A
# preset (Part 2) changes some of their defaults.


@dataclass
class Objective:
    """the clipped policy loss, the KL to the reference and the entropy bonus (Shao et al. 2024)"""

    clip_eps: float = 0.2  # the ratio is clipped to [1 - eps, 1 + eps]; 0.1-0.3 (cispo: 1 - eps bounds its weight)
    kl_coef: float = 0.04  # beta: k3 in the loss, whose gradient is KL(pi_ref || pi_theta)'s; 0 = no reference
    ent_coef: float = 0.0  # c, the entropy bonus; 0 for LLMs


@dataclass
class Optimisation:
    """iterations, batch sizes and the optimizer"""

    num_iterations: int = 40  # rollout -> update cycles
    num_prompts: int = 16  # prompts per iteration (batch = num_prompts * num_generations responses)
    num_epochs: int = 1  # mu: passes over each batch; one epoch of one minibatch is on-policy (the ratio is 1)
    num_minibatches: int = 1  # optimizer steps per epoch; the batch is reshuffled every epoch
    micro_batch_size: int = 64  # sequences per forward pass (not sampling's); gradients accumulate over a minibatch
    learning_rate: Optional[float] = None  # AdamW learning rate; None = by the policy's size (5e-4 for the demo)
    adam_eps: float = 1e-5  # AdamW epsilon
    weight_decay: float = 0.0  # AdamW weight decay
    lr_warmup_iterations: int = 0  # linear warmup of the rate over the first iterations
    anneal_lr: bool = True  # linearly anneal the learning rate toward 0 (0 after the last iteration)
    max_grad_norm: float = 1.0  # global gradient-norm clip


@dataclass
class Generation:
    """the group rollout: G responses to each prompt"""

    num_generations: int = 8  # G: responses sampled per prompt (the group); 4-16, larger = a steadier baseline
    max_new_tokens: int = 16  # L_max, the most tokens after the prompt; longer responses are cut (the demo's need 5)
    temperature: float = 1.0  # sampling temperature; every log-prob (pi_old, pi_ref, pi_theta) uses logits / it
    top_p: float = 1.0  # nucleus sampling; 1.0 = off (log-probs ignore top-p/top-k/min-p, as most RLHF code)
    top_k: int = 0  # top-k sampling; 0 = off
    min_p: float = 0.0  # min-p sampling: drop tokens below min_p times the most likely one; 0 = off


# ---------------------------------------------------------------------------------------------------------------------
# The formulas: one function each, tensors in and tensors out. A tensor over response tokens is (B, T) and
# travels with its mask (1 up to and including the first EOS); every mean over tokens is a masked mean.


def response_mask_from_eos(responses: torch.Tensor, eos_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(response_mask, has_eos): 1 up to and including the first EOS, 0 after it; a response without EOS is all ones.
    Right even when pad == EOS: only the first EOS counts."""
    is_eos = torch.isin(responses, torch.tensor(eos_token_ids, device=responses.device)).long()
    return (is_eos.cumsum(1) - is_eos) == 0, is_eos.any(1).bool()


def logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, entropy: bool = True
                         ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log pi(y_t) = log_softmax(z_t / T)[y_t]  and (if entropy, else None)  H_t = -sum_a pi(a) log pi(a),  from the
    (B, T, vocab) logits z_t that predict the (B, T) tokens y_t; the softmax in float32, whatever the logits' dtype."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    logprobs = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return logprobs, -(logp.exp() * logp).sum(-1) if entropy else None


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """KL_t, a per-token estimate of KL(pi_theta || pi_ref) on tokens pi_theta sampled: k3 = (r - 1) - log r with
    r = pi_ref(y_t) / pi_theta(y_t), never negative (log r bounded to [-20, 20], so that r stays finite in float32), or
    another of KL_ESTIMATORS (Part 2). In the loss, as GRPO puts it, k3's gradient is KL(pi_ref || pi_theta)'s."""
    log_ratio = logprobs - ref_logprobs
    if estimator != "k3":
        return KL_ESTIMATORS[estimator](log_ratio)
    log_r = -log_ratio.clamp(-20, 20)
    return torch.expm1(log_r) - log_r


def combine_rewards(scores: torch.Tensor, weights: Optional[list[float]]) -> torch.Tensor:
    """r_i = sum_k w_k * r_ik over the (B, K) scores of the K rewards (each --reward-fn in order, then the reward
    model); every weight 1 unless --reward-weights."""
    return scores.sum(1) if weights is None else scores @ torch.tensor(weights, device=scores.device)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's  A_i = (r_i - mean(r)) / (std(r) + eps)  over each group of G consecutive responses (the unbiased std, as
    TRL's GRPOTrainer): one advantage per response, shared by all of its tokens."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).flatten()


def is_on_policy(args: Args) -> bool:
    """One epoch of one minibatch: pi_old is pi_theta before its one step, the ratio 1 (the clip does nothing)."""
    return args.num_epochs == 1 and args.num_minibatches == 1


def clipped_surrogate_loss(ratio: torch.Tensor, advantages: torch.Tensor, clip_eps: float,
                           clip_eps_high: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's per-token loss  max(-A * w, -A * clip(w, 1 - eps, 1 + eps_high)),  w = pi_theta / pi_old, eps_high = eps
    unless Clip-Higher sets it. Returns (loss, clipped_low, clipped_high): tokens whose gradient each bound removed."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    clipped = clipped_loss > unclipped
    return torch.maximum(unclipped, clipped_loss), clipped & (advantages < 0), clipped & (advantages > 0)


def loss_counts(mask: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_tokens, num_seqs) of a minibatch's (B, T) loss mask over every rank's part of it (all_sum; in one process
    the identity): its tokens, and its rows with a loss token (a row without one has no token mean), or all B rows
    for Dr. GRPO's constant; at least 1 each, so that no loss token makes a loss of 0, not 0/0."""
    rows = (mask.sum(1) > 0).sum() if mode != "seq-mean-token-sum-norm" else torch.tensor(len(mask), device=mask.device)
    num_tokens, num_seqs = all_sum(torch.stack([mask.sum(), rows]))
    return num_tokens.clamp(min=1), num_seqs.clamp(min=1)


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, counts: tuple, max_new_tokens: int
                   ) -> torch.Tensor:
    """A per-token loss to the minibatch's scalar: GRPO's seq-mean-token-mean, sum_i (sum_t l_it / |y_i|) / num_seqs,
    or another of LOSS_AGGREGATIONS (Part 2). counts = (num_tokens, num_seqs) are the whole minibatch's (loss_counts),
    so that the micro-batches' terms add up to the minibatch's loss and gradient accumulation is exact."""
    m, (num_tokens, num_seqs) = mask.to(loss.dtype), counts
    if mode == "seq-mean-token-mean":
        return ((loss * m).sum(1) / m.sum(1).clamp(min=1)).sum() / num_seqs
    return LOSS_AGGREGATIONS[mode](loss, m, num_tokens, num_seqs, max_new_tokens)


# ---------------------------------------------------------------------------------------------------------------------
# The rollout: 1. sample G responses per prompt, 2. mask (response_mask), 3. score, 4. the forward passes of pi_ref
# (and of pi_old where the update needs them)


@dataclass
class Batch:
    """One iteration's responses, G to a prompt in turn; batch[rows] slices every tensor by response."""
    query_responses: torch.Tensor  # (B, P + T) left-padded prompt, then response
    attention_mask: torch.Tensor  # (B, P + T) 0 on padding, and after a response's first EOS
    context_length: int  # P: the response starts at this position
    responses: torch.Tensor  # (B, T) the sampled tokens y_t, pad after the first EOS
    response_mask: torch.Tensor  # (B, T) bool
    has_eos: Optional[torch.Tensor] = None  # (B,) whether the response ended with EOS (else it was cut)
    scores: Optional[torch.Tensor] = None  # (B, K) each reward's raw score: the reward functions', the reward model's
    greedy_rewards: Optional[torch.Tensor] = None  # (B,) ReMax: the reward of a greedy response to the same prompt
    logprobs: Optional[torch.Tensor] = None  # (B, T) log pi_old(y_t), where the update needs it (forward_rollout)
    entropy: Optional[torch.Tensor] = None  # (B, T) pi_old's H_t of softmax(z / T), for --top-entropy-quantile
    ref_logprobs: Optional[torch.Tensor] = None  # (B, T) log pi_ref(y_t); None when beta = 0
    rewards: Optional[torch.Tensor] = None  # (B,) r_i: the weighted rewards, plus Part 2's shaping
    advantages: Optional[torch.Tensor] = None  # (B,) A_i
    loss_mask: Optional[torch.Tensor] = None  # (B, T) the tokens that carry the loss: response_mask by default
    pg_mask: Optional[torch.Tensor] = None  # (B, T) those that carry the policy loss: loss_mask by default

    def __getitem__(self, rows) -> Batch:
        return replace(self, **{f.name: getattr(self, f.name)[rows] for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


def rollout(models: Models, reward_fns: list, rows: list[dict], prompt_ids: list[list[int]], args: Args) -> Batch:
    """G responses per prompt, masked, and their (B, K) scores: each --reward-fn's (default exact_match), the RM's."""
    G, group_rows = args.num_generations, [row for row in rows for _ in range(args.num_generations)]
    with models.autocast():  # every forward pass computes in --dtype
        batch = generate(models, [ids for ids in prompt_ids for _ in range(G)], args, greedy=False)
        batch = replace(batch, scores=score_responses(models, reward_fns, batch, group_rows, args))
        if args.baseline == "greedy":  # Part 2: --baseline greedy (ReMax), group-mean by default
            batch = replace(batch, greedy_rewards=greedy_rewards(models, reward_fns, rows, prompt_ids, args))
    return batch


@torch.no_grad()
def generate(models: Models, prompt_ids: list[list[int]], args: Args, greedy: bool) -> Batch:
    """Left-padded prompts, each followed by a sampled (or greedy) response, masked and set to pad after its EOS; sample
    draws each token from softmax(z / T) (cut by top-p, top-k, min-p), the prompts' KV cache reused."""
    input_ids, prompt_mask = left_pad(models.tokenizer, prompt_ids, models.device)
    responses = sample(models.policy, input_ids, prompt_mask, args.max_new_tokens, models.eos_token_ids, greedy,
                       args.temperature, args.top_p, args.top_k, args.min_p, args.share_prompts)
    response_mask, has_eos = response_mask_from_eos(responses, models.eos_token_ids)
    responses = responses.masked_fill(~response_mask, models.tokenizer.pad_token_id)
    return Batch(torch.cat([input_ids, responses], 1), torch.cat([prompt_mask, response_mask.long()], 1),
                 input_ids.shape[1], responses, response_mask, has_eos)


def policy_forward(model, batch: Batch, temperature: float, entropy: bool = False, chunked: bool = False,
                   share_prompts: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log pi(y_t), H_t if entropy) over the response tokens, from the model's logits z_t at the position before each
    y_t (logits_to_keep: none for the prompt's other positions)."""
    if chunked or share_prompts:  # Part 3: --chunked-logprobs, --share-prompts, both off by default: the same numbers
        return fast_policy_forward(model, batch, temperature, entropy, chunked, share_prompts)  # up to rounding
    c = batch.context_length
    positions = torch.arange(c - 1, batch.query_responses.shape[1] - 1, device=batch.responses.device)
    out = model(input_ids=batch.query_responses, attention_mask=batch.attention_mask, use_cache=False,
                position_ids=position_ids_from(batch.attention_mask), logits_to_keep=positions)
    return logprobs_and_entropy(out.logits, batch.responses, temperature, entropy)


@torch.no_grad()
def forward_rollout(models: Models, batch: Batch, args: Args) -> Batch:
    """Step 4, a micro-batch at a time: log pi_ref (beta > 0: the frozen initial policy; LoRA's, adapters off), and log
    pi_old where the update is off-policy, the KL is in the reward or the high-entropy tokens are chosen (with the
    sampler's entropy); on-policy the update's own forward pass gives pi_old."""
    old = not is_on_policy(args) or (args.kl_coef > 0 and args.kl_in == "reward") or args.top_entropy_quantile < 1
    logprobs, entropy, ref_logprobs, with_entropy = [], [], [], args.top_entropy_quantile < 1
    with models.autocast():
        for rows in micro_batches(len(batch.responses), args.micro_batch_size):
            mb = batch[rows]
            if old:
                mb_logprobs, mb_entropy = policy_forward(models.policy, mb, args.temperature, with_entropy,
                                                         args.chunked_logprobs, args.share_prompts)
                logprobs.append(mb_logprobs)
                entropy += [mb_entropy] if with_entropy else []
            if args.kl_coef > 0:  # beta = 0: no reference
                with models.reference() as ref_policy:
                    ref_logprobs.append(policy_forward(ref_policy, mb, args.temperature, False, args.chunked_logprobs,
                                                       args.share_prompts)[0])
    return replace(batch, logprobs=torch.cat(logprobs) if old else None, entropy=torch.cat(entropy) if with_entropy
                   else None, ref_logprobs=torch.cat(ref_logprobs) if args.kl_coef > 0 else None)


# ---------------------------------------------------------------------------------------------------------------------
# Rewards and advantages


def compute_advantages(batch: Batch, args: Args) -> Batch:
    """Each response's reward r_i (weighted, plus Part 2's shaping), its advantage A_i (group_advantages by default)
    and the tokens that carry the loss (response_mask's by default)."""
    rewards = combine_rewards(batch.scores, args.reward_weights)  # Part 3: --reward-weights, None (all 1) by default
    shaping = torch.zeros_like(rewards)
    if args.overlong_buffer_length != 0 or args.kl_in == "reward":  # Part 2: 0 and loss by default
        shaping = reward_shaping(batch, args)  # DAPO's overlong penalty, -beta * sum_t KL_t (RLOO, ReMax)
    defaults = args.baseline == "group-mean" and args.scale_rewards == "group"  # Part 2: both by default, and
    if defaults and args.reward_aggregation == "sum-then-normalize":  # --reward-aggregation sum-then-normalize
        advantages = group_advantages(rewards + shaping, args.num_generations)
    else:  # Part 2: RLOO's, ReMax's and Dr. GRPO's baselines and scales, GDPO's normalisation
        advantages = variant_advantages(batch, shaping, args)
    loss_mask = batch.response_mask
    if args.mask_truncated:  # Part 2: DAPO's overlong filtering, off by default
        loss_mask = loss_mask & batch.has_eos.unsqueeze(1)
    pg_mask = loss_mask
    if args.top_entropy_quantile < 1:  # Part 2: only the high-entropy tokens carry the policy loss, 1 (all) by default
        pg_mask = high_entropy_tokens(batch.entropy, loss_mask, args.top_entropy_quantile)
    return replace(batch, rewards=rewards + shaping, advantages=advantages, loss_mask=loss_mask, pg_mask=pg_mask)


# ---------------------------------------------------------------------------------------------------------------------
# The update: mu epochs x minibatches (one optimizer step each) x micro-batches (gradients accumulated)


def grpo_update(models: Models, optimizer, batch: Batch, args: Args, generator: torch.Generator) -> dict:
    """mu epochs over the batch, reshuffled each epoch into --num-minibatches minibatches of one optimizer step each;
    returns each statistic's mean over the minibatches that logged it (one without loss tokens logs no token mean)."""
    models.policy.train()  # dropout stays off (but --lora-dropout); train mode turns gradient checkpointing on
    num_minibatches = min(args.num_minibatches, len(batch.responses))  # dynamic sampling may leave a smaller batch
    history = {}
    for _ in range(args.num_epochs):
        order = torch.randperm(len(batch.responses), generator=generator).to(batch.responses.device)
        for step, mb_rows in enumerate(torch.tensor_split(order, num_minibatches)):  # sizes differ by at most 1
            progress(f"updating: minibatch {step + 1}/{num_minibatches}")
            # In batch order within the minibatch: the responses to one prompt sit together (for --share-prompts).
            stats = minibatch_step(models, optimizer, batch[mb_rows.sort().values], args)
            for key, value in stats.items():
                history.setdefault(key, []).append(value)
    models.policy.eval()
    return {key: sum(v) / len(v) for key, v in history.items()}


def minibatch_step(models: Models, optimizer, mb: Batch, args: Args) -> dict:
    """One optimizer step on one minibatch, its statistics returned. Each micro-batch's loss is divided by the whole
    minibatch's counts (loss_counts): the micro-batches' gradients add up to the minibatch loss's."""
    counts = loss_counts(mb.loss_mask, args.loss_aggregation), loss_counts(mb.pg_mask, args.loss_aggregation)
    num_rows = all_sum(torch.tensor(len(mb.responses), device=mb.responses.device))  # every rank's rows
    totals = {}  # tensors, summed on the device and read once per minibatch
    for rows in micro_batches(len(mb.responses), args.micro_batch_size):
        for key, value in micro_batch_backward(models, mb[rows], counts, num_rows, args).items():
            totals[key] = totals.get(key, 0.0) + value
    stats = dict(zip(totals, all_sum(torch.stack(list(totals.values()))).tolist()))  # every rank's part of the sums
    if not (math.isfinite(stats["losses/policy_loss"]) and math.isfinite(stats["losses/kl"])):
        raise NonFiniteLoss(f"policy loss {stats['losses/policy_loss']}, KL loss {stats['losses/kl']}")
    if not stats.pop("loss_tokens"):  # every response masked out (--mask-truncated): no token to average, no step
        optimizer.zero_grad(set_to_none=True)
        return {key: value for key, value in stats.items() if not key.startswith("policy/")}
    if "policy/clip_ratio_low" in stats:
        stats["policy/clipfrac"] = stats["policy/clip_ratio_low"] + stats["policy/clip_ratio_high"]
    stats["grad/policy_norm"] = clip_grad_norm(models.policy.parameters(), args.max_grad_norm, "policy")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stats


def micro_batch_backward(models: Models, mb: Batch, counts: tuple, num_rows, args: Args) -> dict:
    """Forward one micro-batch and backward its part of the minibatch loss  L = L_clip - c * H + beta * KL. Returns its
    parts of the minibatch's statistics: its sums over the minibatch's counts (the policy loss's own, counts[1])."""
    with models.autocast():
        logprobs, entropy = policy_forward(models.policy, mb, args.temperature, True, args.chunked_logprobs,
                                           args.share_prompts and not args.gradient_checkpointing)
    if args.ent_coef == 0:
        entropy = entropy.detach()  # reported, not trained on
    old_logprobs = mb.logprobs if mb.logprobs is not None else logprobs.detach()  # on-policy: pi_theta before the step
    ratio = torch.exp(logprobs - old_logprobs)  # w_t = pi_theta(y_t) / pi_old(y_t); 1 on-policy, with its gradient
    if args.importance_level == "sequence":  # Part 2: GSPO's sequence ratio, token by default
        ratio = sequence_ratio(logprobs - old_logprobs, mb.response_mask)
    advantages = mb.advantages.unsqueeze(1).expand_as(logprobs)
    if args.policy_loss == "clip":  # Part 2: --policy-loss cispo, sapo or vespo, clip by default
        pg_tokens, clipped_low, clipped_high = clipped_surrogate_loss(ratio, advantages, args.clip_eps,
                                                                      args.clip_eps_high)  # Part 2: --clip-eps-high
        if args.dual_clip is not None:  # Part 2: --dual-clip, None by default
            pg_tokens, clipped_high = dual_clip(pg_tokens, clipped_high, advantages, args.dual_clip)
    else:
        pg_tokens, clipped_low, clipped_high = POLICY_LOSSES[args.policy_loss](ratio, logprobs, advantages, mb, args)
    stats = {}
    if args.off_policy_mask_threshold is not None:  # Part 2: DeepSeek-V3.2's off-policy sequence mask, None
        kept = off_policy_sequence_mask(logprobs, old_logprobs, mb.advantages, mb.response_mask,
                                        args.off_policy_mask_threshold)
        pg_tokens = torch.where(kept.unsqueeze(1), pg_tokens, 0.0)  # not pg_tokens * kept: 0 * inf would be NaN
        stats["policy/off_policy_masked_fraction"] = (~kept).sum() / num_rows
    pg_loss = aggregate_loss(pg_tokens, mb.pg_mask, args.loss_aggregation, counts[1], args.max_new_tokens)
    entropy_bonus = aggregate_loss(entropy, mb.loss_mask, args.loss_aggregation, counts[0], args.max_new_tokens)
    loss, kl_loss = pg_loss - args.ent_coef * entropy_bonus, torch.zeros((), device=logprobs.device)
    if args.kl_coef > 0 and args.kl_in == "loss":  # Part 2: --kl-in reward (RLOO, ReMax), loss by default
        kl_tokens = kl_penalty(logprobs, mb.ref_logprobs, args.kl_estimator)  # Part 2: --kl-estimator, k3 by default
        if args.kl_importance_correction:  # Part 2: DeepSeek-V3.2's importance-weighted KL, off by default
            kl_tokens = importance_weighted_kl(kl_tokens, logprobs, old_logprobs)
        kl_loss = aggregate_loss(kl_tokens, mb.loss_mask, args.loss_aggregation, counts[0], args.max_new_tokens)
        loss = loss + args.kl_coef * kl_loss
        if mb.logprobs is None:  # on-policy, pi_theta is the sampler: sum_t KL_t of its responses, for objective/kl
            stats["objective/kl"] = (kl_tokens.detach() * mb.response_mask).sum() / num_rows
    # Under torchrun the counts above are every rank's and FSDP averages the gradients over the N ranks: hence x N.
    (loss * world_size()).backward()
    # approx KL(pi_old || pi_theta) per token: k3 = w - 1 - log w, w = pi_theta / pi_old (pi_old sampled the tokens)
    log_w = (logprobs.detach() - old_logprobs).clamp(-20, 20)
    stats.update({"losses/policy_loss": pg_loss.detach(), "losses/kl": kl_loss.detach(),
                  "loss_tokens": mb.loss_mask.sum().float()})  # summed over the ranks, then taken out
    for key, x in (("policy/approx_kl", torch.expm1(log_w) - log_w), ("policy/ratio", ratio.detach()),
                   ("policy/entropy", entropy.detach())):
        stats[key] = (x * mb.loss_mask).sum() / counts[0][0]
    if clipped_low is not None:  # over the policy loss's tokens; SAPO's gate and VESPO's weight have no bounds
        stats["policy/clip_ratio_low"] = (clipped_low & mb.pg_mask).sum() / counts[1][0]
        stats["policy/clip_ratio_high"] = (clipped_high & mb.pg_mask).sum() / counts[1][0]
    return stats


# ---------------------------------------------------------------------------------------------------------------------
# The training loop


def run_iteration(run: Run) -> dict:
    """One iteration on the next prompts in the data order: rollout, advantages, update; its metrics."""
    models, state = run.models, run.state
    args = replace(run.args, ent_coef=state["ent_coef"])  # the coefficient in use: --entropy-target (Part 2) moves it
    with phase("rollout"):
        if args.dynamic_sampling:  # Part 2: DAPO's dynamic sampling, off by default
            batch, rows, sampling = dynamic_sampling_rollout(run, args)
        else:
            rows, prompt_ids = prompts_of_step(run.prompts, state["prompts_seen"] // args.num_prompts, args)
            state["prompts_seen"] += args.num_prompts  # every rank's: the data order, a seeded shuffle per pass
            batch, sampling = rollout(models, run.reward_fns, rows, prompt_ids, args), {}
        batch = forward_rollout(models, batch, args)  # 4
    batch = compute_advantages(batch, args)
    metrics = {**rollout_metrics(batch, [name for name, _ in run.reward_fns], args), **sampling}
    with phase("update"):
        metrics.update(grpo_update(models, run.optimizer, batch, args, run.generator(state["iteration"])))
    metrics["samples"] = samples_to_show(models, batch, rows, args)  # three, for metrics.jsonl
    return {**metrics, **{f"time/{name}": seconds for name, seconds in PHASES.items()}, "train/ent_coef": args.ent_coef}


def train(args: Args) -> dict:
    """The run: --num-iterations iterations, each followed by its eval (every --eval-every), its console line and
    metrics row, and its checkpoint (every --save-every). Returns the eval reward before and after training."""
    with start_run(args) as run:  # Part 3: the checks, data, models and optimizer (or a checkpoint's)
        args, state = run.args, run.state
        while state["iteration"] < args.num_iterations:
            if stop := stop_signal():  # a signal since the last update: checkpoint (none before the first row), exit
                run.save_and_exit(stop)
            if state["iteration"] == 0 and args.eval_every > 0 and state["eval_before"] is None:  # not on a resume
                run.report(dict(iteration=0, **evaluate(run)))  # row 0: the eval before the first update
            iteration = state["iteration"]
            for group in run.optimizer.param_groups:
                group["lr"] = learning_rate_at(iteration, args.num_iterations, run.learning_rate,
                                               args.lr_warmup_iterations, args.anneal_lr)
            metrics = run_iteration(run)
            state["iteration"] = done = iteration + 1
            metrics.update({"iteration": done, "episodes": state["prompts_seen"] * args.num_generations,
                            "lr": run.optimizer.param_groups[0]["lr"]})
            if args.entropy_target is not None or args.ref_sync_every:  # Part 2: both off by default
                after_update(run, metrics)  # adaptive entropy control, the reference's soft update
            stop = stop_signal() if done < args.num_iterations else 0  # a signal: save now, skip the eval (not last)
            if not stop and args.eval_every > 0 and (done % args.eval_every == 0 or done == args.num_iterations):
                metrics.update(evaluate(run))
            run.report(metrics)  # the console line, the doctor's warnings, metrics.jsonl
            if stop:
                run.save_and_exit(stop)  # checkpoint, say where, and exit with 128 + the signal's number
            if args.save_every > 0 and (done % args.save_every == 0 or done == args.num_iterations):
                save_checkpoint(run)
        return run.finish()  # saves the final policy, prints the run's last line


def learning_rate_at(iteration: int, num_iterations: int, base_lr: float, warmup: int, anneal: bool) -> float:
    """The rate at `iteration`: the base rate, warmed up linearly over `warmup` iterations, (anneal) decayed to 0."""
    lr = base_lr * min(1.0, (iteration + 1) / warmup) if warmup > 0 else base_lr
    return lr * (1.0 - iteration / num_iterations) if anneal else lr


# ---------------------------------------------------------------------------------------------------------------------
# Part 2: the variants
# ---------------------------------------------------------------------------------------------------------------------
# Every alternative to a formula of Part 1, each with its knobs (a group of --help), its paper, and a function or table
# entry. Part 1 names each where it plugs in; at its defaults each does nothing. The presets at the end pick some.


@dataclass
class AdvantageVariants:
    """the group baseline and scale (RLOO, ReMax, Dr. GRPO), and several rewards normalised one by one (GDPO)"""

    baseline: Literal["group-mean", "leave-one-out", "greedy"] = "group-mean"  # GRPO, RLOO, or ReMax's greedy reward
    scale_rewards: Literal["group", "batch", "none"] = "group"  # divide by the group's std, the batch's, or not at all
    reward_aggregation: Literal["sum-then-normalize", "normalize-then-sum"] = "sum-then-normalize"  # several rewards


# The baseline b_i each reward of a group is compared with, from the (P, G) rewards r of P groups of G and, for ReMax,
# the (P, G) rewards of a greedy response to each group's prompt.
BASELINES = {
    "group-mean": lambda r, greedy: r.mean(1, keepdim=True),  # GRPO
    "leave-one-out": lambda r, greedy: (r.sum(1, keepdim=True) - r) / (r.shape[1] - 1),  # RLOO: the other G - 1
    "greedy": lambda r, greedy: greedy,  # ReMax
}
# What r_i - b_i is divided by: the group's std (GRPO), the batch's or none (Dr. GRPO); eps keeps an equal group at 0.
REWARD_SCALES = {
    "group": lambda r, batch_rewards, eps: r.std(1, keepdim=True) + eps,
    "batch": lambda r, batch_rewards, eps: batch_rewards.std() + eps,
    "none": lambda r, batch_rewards, eps: 1.0,
}


def variant_advantages(batch: Batch, shaping: torch.Tensor, args: Args) -> torch.Tensor:
    """A_i = (r_i - b_i) / s_i, --baseline's b and --scale-rewards' s; with normalize-then-sum (GDPO, arXiv:2601.05242)
    the weighted sum of each reward's own advantage plus the shaping's: a wide reward cannot drown the others."""
    greedy = batch.greedy_rewards

    def advantages(rewards: torch.Tensor) -> torch.Tensor:
        r = rewards.view(-1, args.num_generations)
        batch_rewards = gather_cat(rewards) if args.scale_rewards == "batch" else None  # every rank's
        centred = r - BASELINES[args.baseline](r, None if greedy is None else greedy.view_as(r))
        return (centred / REWARD_SCALES[args.scale_rewards](r, batch_rewards, 1e-4)).flatten()

    if args.reward_aggregation == "sum-then-normalize":
        return advantages(combine_rewards(batch.scores, args.reward_weights) + shaping)
    each = torch.stack([advantages(score) for score in batch.scores.T], 1)
    return combine_rewards(each, args.reward_weights) + advantages(shaping)


@torch.no_grad()
def greedy_rewards(models: Models, reward_fns: list, rows: list[dict], prompt_ids: list[list[int]], args: Args
                   ) -> torch.Tensor:
    """ReMax's baseline (Li et al. 2023, arXiv:2310.10505): the reward of one greedy response to each prompt, with its
    overlong penalty but no KL term, given to each of the prompt's G responses."""
    greedy = generate(models, prompt_ids, args, greedy=True)
    reward = combine_rewards(score_responses(models, reward_fns, greedy, rows, args), args.reward_weights)
    if args.overlong_buffer_length != 0:
        reward = reward + overlong_penalty(greedy.attention_mask[:, greedy.context_length :].sum(1), args)
    return reward.repeat_interleave(args.num_generations)


@dataclass
class RewardShaping:
    """the KL in the reward instead of the loss (RLOO, ReMax), and DAPO's shaping of over-long responses"""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # k1 = log(p/q), k2 = (log(p/q))^2 / 2, k3 = q/p - 1 - log(q/p)
    kl_in: Literal["loss", "reward"] = "loss"  # beta * KL_t in the loss, or beta * sum_t KL_t off each reward
    kl_importance_correction: bool = False  # DeepSeek-V3.2: weight the KL term by pi_theta / pi_old (unbiased)
    overlong_buffer_length: Optional[int] = 0  # DAPO: a penalty over the last this many tokens; None = a fifth
    overlong_penalty: float = 1.0  # the largest overlong penalty, reached at --max-new-tokens
    mask_truncated: bool = False  # responses that end without EOS carry no loss (DAPO's overlong filtering)


# Per-token estimates of KL(pi_theta || pi_ref) on tokens y sampled by pi_theta, of x = log pi_theta(y) - log pi_ref(y)
# (Schulman 2020, "Approximating KL divergence"): k1 unbiased but negative on some tokens, k2 biased with low variance,
# k3 unbiased and never negative. In a reward only k1 gives the KL's gradient; in the loss k1's is 0 on-policy.
KL_ESTIMATORS = {
    "k1": lambda x: x,
    "k2": lambda x: 0.5 * x**2,
    "k3": lambda x: torch.expm1(-x.clamp(-20, 20)) + x.clamp(-20, 20),
}


def importance_weighted_kl(kl: torch.Tensor, logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3.2 (arXiv:2512.02556), eq. 7: (pi_theta(y_t) / pi_old(y_t)) * KL_t, the ratio not detached: on tokens
    pi_old sampled, k3's (and k1's) value and gradient unbiased for KL(pi_theta || pi_ref); on-policy w = 1 in value."""
    return torch.exp(logprobs - old_logprobs) * kl


def overlong_penalty(lengths: torch.Tensor, args: Args) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476):  min(0, (L_max - L_cache - L) / L_cache) *
    penalty,  down to -penalty at L_max; L_cache = --overlong-buffer-length (None: a fifth of L_max, DAPO's ratio)."""
    buffer = max(1, args.max_new_tokens // 5) if args.overlong_buffer_length is None else args.overlong_buffer_length
    start = args.max_new_tokens - buffer
    return ((start - lengths.float()) / buffer * args.overlong_penalty).clamp(min=-args.overlong_penalty, max=0.0)


def reward_shaping(batch: Batch, args: Args) -> torch.Tensor:
    """What compute_advantages adds to each response's reward: DAPO's overlong penalty, and with --kl-in reward
    -beta * sum_t KL_t of the sampler from the reference (RLOO, ReMax)."""
    mask = batch.response_mask
    shaping = torch.zeros(len(mask), device=mask.device)
    if args.overlong_buffer_length != 0:  # the length: every token after the prompt
        shaping = overlong_penalty(batch.attention_mask[:, batch.context_length :].sum(1), args)
    if args.kl_in == "reward" and batch.ref_logprobs is not None:
        shaping = shaping - args.kl_coef * (kl_penalty(batch.logprobs, batch.ref_logprobs, args.kl_estimator) *
                                            mask).sum(1)
    return shaping


@dataclass
class LossVariants:
    """the policy loss (CISPO, SAPO, VESPO), its ratio (GSPO), its clip (Clip-Higher, Dual-Clip), its aggregation"""

    policy_loss: Literal["clip", "cispo", "sapo", "vespo"] = "clip"  # PPO's clip; MiniMax-M1's; a soft gate; a weight
    clip_eps_high: Optional[float] = None  # upper clip epsilon (DAPO's Clip-Higher: 0.28); None = --clip-eps
    dual_clip: Optional[float] = None  # Dual-Clip c (about 3): for A < 0 the loss is at most -c*A; None = off
    importance_level: Literal["token", "sequence"] = "token"  # per-token ratios, or GSPO's sequence ratio
    sapo_temperature_pos: float = 1.0  # SAPO's gate temperature for A > 0: larger = the gradient fades faster
    sapo_temperature_neg: float = 1.05  # SAPO's gate temperature for A < 0 (above tau_pos)
    vespo_k_pos: float = 2.0  # VESPO's k for A >= 0: phi(w) = e^lambda * w^k * e^(-lambda * w) peaks at w = k/lambda
    vespo_lambda_pos: float = 3.0  # VESPO's lambda for A >= 0: larger = the weight falls faster off its peak
    vespo_k_neg: float = 3.0  # VESPO's k for A < 0
    vespo_lambda_neg: float = 2.0  # VESPO's lambda for A < 0
    loss_aggregation: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum"] = \
        "seq-mean-token-mean"  # GRPO; DAPO; Dr. GRPO; LUSPO (LOSS_AGGREGATIONS)


def sequence_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's (Zheng et al. 2025, arXiv:2507.18071) length-normalised ratio of the whole response,
    exp(mean_t log(pi_theta(y_t) / pi_old(y_t))) over its masked tokens, given to each of its tokens."""
    m = mask.to(log_ratio.dtype)
    mean = (log_ratio * m).sum(1) / m.sum(1).clamp(min=1)
    return torch.exp(mean)[:, None].expand_as(log_ratio)


def dual_clip(loss: torch.Tensor, clipped_high: torch.Tensor, advantages: torch.Tensor, c: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-Clip (Ye et al. 2020, arXiv:1912.09729): for A < 0 the clipped loss is capped at -c*A (c > 1 + eps_high):
    INTELLECT-2's two-sided clipping (arXiv:2505.07291) with delta = c. Returns (loss, clipped_high), the capped too."""
    cap = -c * advantages
    dual = (advantages < 0) & (loss > cap)
    return torch.where(dual, cap, loss), clipped_high | dual


def cispo_loss(ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, clip_eps: float,
               clip_eps_high: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax 2025, arXiv:2506.13585): per-token  -sg(clip(w, 1 - eps_low, 1 + eps_high)) * A * log pi(y_t):
    the weight scales a token's gradient, never removes it (PPO's clip does). eps_low >= 1: no lower bound (the
    paper's). Returns (loss, clipped_low, clipped_high): the tokens whose weight a bound changed."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    w = ratio.detach()  # sg(): the weight carries no gradient of its own
    loss = -torch.clamp(w, 1.0 - clip_eps, 1.0 + high) * advantages * logprobs
    return loss, w < 1.0 - clip_eps, w > 1.0 + high


def sapo_loss(ratio: torch.Tensor, advantages: torch.Tensor, temperature_pos: float,
              temperature_neg: float) -> torch.Tensor:
    """SAPO (Gao et al. 2025, arXiv:2511.20347): per-token  -f(w) * A,  f(w) = sigmoid(tau (w - 1)) * 4 / tau,  tau =
    tau_pos for A > 0, else tau_neg: its gradient -4 s (1 - s) w A grad log pi is the policy gradient at w = 1 and fades
    smoothly as w leaves 1, where a clip cuts."""
    tau = torch.where(advantages > 0, temperature_pos, temperature_neg).to(ratio.dtype)
    return -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * advantages


def vespo_loss(ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float) -> torch.Tensor:
    """VESPO (arXiv:2602.10693): per-token  -sg(phi(w)) * A * log pi(y_t),  w = exp(sum_t log(pi_theta / pi_old)) the
    response's ratio and  phi(w) = e^lambda w^k e^(-lambda w)  with A's sign's (k, lambda): 1 at w = 1, peaking at k /
    lambda, 0 for stale responses. In log space, the per-token log ratio in [-20, 20] and log w in [log 1e-8, 20]."""
    log_w = (torch.log(ratio.detach()).clamp(-20.0, 20.0) * mask).sum(1, keepdim=True).clamp(math.log(1e-8), 20.0)
    k = torch.where(advantages >= 0, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(advantages >= 0, lambda_pos, lambda_neg).to(log_w.dtype)
    return -torch.exp(lam + k * log_w - lam * log_w.exp()) * advantages * logprobs


# --policy-loss but clip: (ratio w, log pi, advantages, micro-batch, args) -> (per-token loss, tokens its lower / upper
# bound acted on, or None). A new loss: a function, an entry here, a --policy-loss choice, its ONLY_WITH rows.
POLICY_LOSSES = {
    "cispo": lambda w, logprobs, a, mb, args: cispo_loss(w, logprobs, a, args.clip_eps, args.clip_eps_high),
    "sapo": lambda w, logprobs, a, mb, args: (
        sapo_loss(w, a, args.sapo_temperature_pos, args.sapo_temperature_neg), None, None),
    "vespo": lambda w, logprobs, a, mb, args: (
        vespo_loss(w, logprobs, a, mb.response_mask, args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg,
                   args.vespo_lambda_neg), None, None),
}

# A per-token loss l (B, T) and its mask m (float) to a scalar, num_tokens and num_seqs being the whole minibatch's.
LOSS_AGGREGATIONS = {
    "token-mean": lambda l, m, num_tokens, num_seqs, max_new_tokens:  # DAPO: every token weighs the same
        (l * m).sum() / num_tokens,
    "seq-mean-token-sum-norm": lambda l, m, num_tokens, num_seqs, max_new_tokens:  # Dr. GRPO: a constant, no bias
        (l * m).sum() / (num_seqs * max_new_tokens),
    "seq-mean-token-sum": lambda l, m, num_tokens, num_seqs, max_new_tokens:  # LUSPO: a response weighs its length
        (l * m).sum() / num_seqs,
}


@dataclass
class TokenSelection:
    """which tokens carry the loss: the high-entropy ones (Wang et al. 2025), not the stale negatives (DeepSeek-V3.2)"""

    top_entropy_quantile: float = 1.0  # only this top fraction of loss tokens by entropy carry the policy loss; 1 = all
    off_policy_mask_threshold: Optional[float] = None  # drop an A < 0 response whose mean log(pi_old/pi) is above


def high_entropy_tokens(entropy: torch.Tensor, loss_mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """'Beyond the 80/20 rule' (Wang et al. 2025, arXiv:2506.01939): of the batch's N loss tokens (every rank's), those
    of sampler entropy at least the ceil(q * N)-th highest (ties kept): the 'forking' tokens, once per rollout."""
    entropies = gather_cat(entropy[loss_mask])
    if entropies.numel() == 0:
        return loss_mask
    k = max(1, math.ceil(quantile * entropies.numel() - 1e-9))  # the guard: 0.1 * 30 is 3.0000000000000004 in floats
    return loss_mask & (entropy >= torch.topk(entropies, k).values[-1])


def off_policy_sequence_mask(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                             mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2, eq. 9: (B,) False for a response with A_i < 0 and (1/|y_i|) sum_t log(pi_old(y_t) / pi_theta(y_t))
    > threshold, else True: a negative sample the policy has already moved far from is mostly noise."""
    m = mask.to(logprobs.dtype)
    sampler_kl = ((old_logprobs - logprobs.detach()) * m).sum(1) / m.sum(1).clamp(min=1)
    return ~((advantages < 0) & (sampler_kl > threshold))


@dataclass
class DynamicSampling:
    """DAPO's dynamic sampling: drop the groups whose rewards are all equal and sample more"""

    dynamic_sampling: bool = False  # drop groups whose task rewards are all equal, and sample more prompts instead
    max_resample_rounds: int = 4  # with --dynamic-sampling, extra sampling rounds per iteration before training


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(P,) bool: the groups whose G rewards are all equal (their reward's group-relative advantage is 0)."""
    r = rewards.view(-1, group_size)
    return (r == r[:, :1]).all(1)


def dynamic_sampling_rollout(run: Run, args: Args) -> tuple[Batch, list[dict], dict]:
    """DAPO's dynamic sampling (Yu et al. 2025): groups of equal task rewards dropped, the next prompts sampled until
    --num-prompts groups are kept or --max-resample-rounds spent; the kept batch (kept_groups), its rows, statistics."""
    share = args.num_prompts // world_size()  # the groups each rank keeps at most
    kept, num_kept, sampled, flat_count, G = [], 0, 0, 0, args.num_generations
    for round_index in range(1 + args.max_resample_rounds):
        rows, prompt_ids = prompts_of_step(run.prompts, run.state["prompts_seen"] // args.num_prompts, args)
        run.state["prompts_seen"] += args.num_prompts
        batch = rollout(run.models, run.reward_fns, rows, prompt_ids, args)
        flat = zero_std_groups(combine_rewards(batch.scores, args.reward_weights), G)
        sampled, flat_count = sampled + len(flat), flat_count + int(flat.sum())
        keep = ~flat & ((~flat).cumsum(0) <= share - num_kept)  # stop exactly at a full batch
        if keep.any():
            kept.append((batch[keep.repeat_interleave(G)], [row for row, k in zip(rows, keep.tolist()) if k]))
            num_kept += int(keep.sum())
        if all_max(share - num_kept) == 0:  # every rank is full
            break
    sampled, flat_count = (int(n) for n in all_sum(torch.tensor([sampled, flat_count])))
    stats = {"rollout/groups_sampled": sampled, "rollout/zero_std_fraction": flat_count / sampled,
             "rollout/resample_rounds": round_index}
    return (*kept_groups(kept, (batch, rows), run.models, args, round_index + 1), stats)


@dataclass
class ReferenceAndEntropy:
    """a reference that follows the policy (TR-DPO) and an entropy coefficient that follows a target (Skywork-OR1)"""

    ref_sync_every: int = 0  # TR-DPO: every this many iterations pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref
    ref_sync_alpha: float = 0.6  # with --ref-sync-every: alpha, the policy's share of the mix (1 = copy the policy)
    entropy_target: Optional[float] = None  # the entropy coefficient steps up by --ent-coef-delta below it, down above
    ent_coef_delta: float = 0.005  # with --entropy-target: the coefficient's step per iteration
    ent_coef_min: float = 0.0  # with --entropy-target: the coefficient's lower bound
    ent_coef_max: float = 1.0  # with --entropy-target: the coefficient's upper bound


def after_update(run: Run, metrics: dict) -> None:
    """After an update: the entropy coefficient's step toward --entropy-target, the reference's toward the policy."""
    args, state = run.args, run.state
    if args.entropy_target is not None and "policy/entropy" in metrics:  # none without loss tokens
        state["ent_coef"] = entropy_coefficient(state["ent_coef"], metrics["policy/entropy"], args.entropy_target,
                                                args.ent_coef_delta, args.ent_coef_min, args.ent_coef_max)
    if args.ref_sync_every and state["iteration"] % args.ref_sync_every == 0:
        sync_reference(run.models.ref_policy, run.models.policy, args.ref_sync_alpha)


def entropy_coefficient(coef: float, entropy: float, target: float, delta: float, low: float, high: float) -> float:
    """Adaptive entropy control (He et al. 2025, Skywork-OR1, arXiv:2505.22312): the next coefficient of the entropy
    bonus, c + delta while the entropy is below the target and c - delta otherwise, within [low, high]."""
    return min(high, max(low, coef + (delta if entropy < target else -delta)))


@torch.no_grad()
def sync_reference(reference: nn.Module, policy: nn.Module, alpha: float) -> None:
    """TR-DPO's soft update of the reference (Gorbatovski et al. 2024, arXiv:2404.09656), parameter by parameter:
    pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref (under FSDP2 each rank mixes its own shards)."""
    for ref, own in zip(reference.parameters(), policy.parameters(), strict=True):
        ref.lerp_(own.detach(), alpha)


# Each method as the knobs it sets apart from the defaults, which are GRPO's (Shao et al. 2024): --preset X fills them,
# a flag given on the command line wins, and --help lists them. A new method: one entry.
PRESETS = {
    "grpo": {},  # group mean and std, per-response token mean, clip 0.2, k3 KL in the loss, on-policy
    "dr-grpo": dict(  # Liu et al. 2025, arXiv:2503.20783: no std division, a constant length normaliser, no KL
        scale_rewards="none", loss_aggregation="seq-mean-token-sum-norm", kl_coef=0.0),
    "dapo": dict(  # Yu et al. 2025: Clip-Higher, token mean, dynamic sampling, overlong shaping, no KL; 16 steps
        clip_eps_high=0.28, loss_aggregation="token-mean", dynamic_sampling=True, overlong_buffer_length=None,
        kl_coef=0.0, num_minibatches=16),  # the paper's count (512 prompts in minibatches of 32): the clip acts
    "gspo": dict(  # Zheng et al. 2025: the sequence ratio in a tiny clip range, no KL; 4 minibatches per rollout
        importance_level="sequence", clip_eps=3e-4, clip_eps_high=4e-4, kl_coef=0.0, num_minibatches=4),
    "cispo": dict(  # MiniMax-M1 2025: the clipped weight, token mean, no KL, no lower bound; the upper 5 is ScaleRL's
        policy_loss="cispo", loss_aggregation="token-mean", clip_eps=1.0, clip_eps_high=4.0, kl_coef=0.0,
        num_minibatches=4),  # (Khatri et al. 2025, arXiv:2510.13786); 4 minibatches, ours as gspo's
    "sapo": dict(  # SAPO 2025: the soft gate, tau_pos 1.0 and tau_neg 1.05, no KL; 4 minibatches (its off-policy runs)
        policy_loss="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, kl_coef=0.0, num_minibatches=4),
    "vespo": dict(  # VESPO 2026: the gamma weight of the sequence ratio, (k, lambda) (2, 3) for A >= 0, (3, 2) else
        policy_loss="vespo", vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
        loss_aggregation="token-mean", kl_coef=0.0, num_minibatches=4),  # token mean, no KL; 4 minibatches as gspo's
    "luspo": dict(  # LUSPO 2026 (arXiv:2602.05261): GSPO's ratio and clip, each response's token sum over responses
        importance_level="sequence", clip_eps=3e-4, clip_eps_high=4e-4, loss_aggregation="seq-mean-token-sum",
        kl_coef=0.0, num_minibatches=4),  # a long response weighs its length; 4 minibatches as gspo's
    "rloo": dict(  # Ahmadian et al. 2024, arXiv:2402.14740: leave-one-out baseline, k1 KL in the reward, a response's
        baseline="leave-one-out", scale_rewards="none", kl_coef=0.05, kl_estimator="k1", kl_in="reward"),  # token mean
    "remax": dict(  # Li et al. 2023: the greedy response's reward is the baseline, k1 KL in the reward (G = 8, not 1)
        baseline="greedy", scale_rewards="none", kl_coef=0.05, kl_estimator="k1", kl_in="reward"),
}


# ---------------------------------------------------------------------------------------------------------------------
# Part 3: the machinery
# ---------------------------------------------------------------------------------------------------------------------
# Arguments: the run's knobs, Args, --preset and --help's groups, every knob's range, the checks.


@dataclass
class PolicyAndReward:
    """the policy (also the frozen reference), the rewards, and LoRA"""

    model_name_or_path: str = str(DEMO / "model")  # the policy and reference: a local directory or a Hub name
    reward_model_path: Optional[str] = None  # a sequence classifier (a .score head), one label, the policy's tokenizer
    reward_fn: tuple[str, ...] = ()  # exact_match, last_number, module:fn or file.py:fn; () = exact_match, or the RM
    reward_weights: Optional[tuple[float, ...]] = None  # one per reward (each --reward-fn, then the reward model); 1s
    lora_r: int = 0  # LoRA rank: the policy trains adapters (peft), the reference is without them; 0 = off
    lora_alpha: float = 16.0  # LoRA scale: the adapters add alpha/r * B A to each target weight
    lora_dropout: float = 0.0  # dropout on the adapters' input in the update; 0 keeps its log-probs the sampler's
    lora_target_modules: Optional[list[str]] = None  # e.g. q_proj v_proj; None = every linear layer but the head


@dataclass
class Data:
    """prompts to train and evaluate on"""

    prompts_path: str = str(DEMO / "train.jsonl")  # a .jsonl file, or a dataset directory (datasets.load_dataset)
    eval_prompts_path: str = str(DEMO / "eval.jsonl")  # prompts greedy-decoded for eval/reward, in the same forms
    prompt_field: str = "prompt"  # the rows' prompt field (gsm8k: question); the others reach the reward functions
    answer_field: str = "answer"  # the field exact_match and last_number compare with, given to them as 'answer'
    dataset_split: str = "train"  # split of a dataset directory named by --prompts-path
    eval_dataset_split: str = "test"  # split of a dataset directory named by --eval-prompts-path
    chat_template: bool = False  # wrap each prompt as a user turn with the tokenizer's chat template
    max_prompt_length: int = 256  # longer prompts lose their first tokens (a warning counts them)


@dataclass
class Experiment:
    """the method, where the run writes, how often it evaluates and saves, what it reports"""

    preset: Literal[tuple(PRESETS)] = "grpo"  # the method whose knobs fill the defaults (PRESETS); flags override them
    output_dir: Optional[str] = None  # metrics.jsonl, checkpoints, final policy: runs/grpo, or --resume-from's run
    overwrite: bool = False  # delete an earlier run in --output-dir at the first row, once every check has passed
    seed: int = 1  # seeds torch, random and NumPy: on CPU the same metrics (but time/) with a deterministic reward
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype (autocast); the trained weights stay float32
    gradient_checkpointing: bool = False  # trade compute for memory in the policy's forward passes
    chunked_logprobs: bool = False  # log-probs a chunk at a time (equal up to rounding): pays at vocabulary x length
    share_prompts: bool = False
    """a micro-batch runs each prompt once (equal up to rounding); one process only.
    Not in an update under --gradient-checkpointing, nor in a model with recurrent layers (no KV cache to share)"""
    fsdp: bool = False  # under torchrun: shard weights, gradients and optimizer states with FSDP2 (else replicate)
    track: bool = False  # also write TensorBoard logs to <output-dir>/tb (needs the tensorboard package)
    wandb_project: Optional[str] = None  # with --track, also log to this Weights & Biases project (needs wandb)
    eval_every: int = 5  # greedy eval before iteration 1, every this many and after the last; none after a signal
    save_every: int = 20  # write <output-dir>/checkpoint-N every this many iterations and the last; 0 = if interrupted
    resume_from: Optional[str] = None  # a checkpoint-N to go on from; the flags must match (RESUME_MAY_CHANGE aside)
    doctor: Literal["warn", "off"] = "warn"  # watch the metrics for instability, and name the knob to turn


# --help shows one group per section, in this order
SECTIONS = dict(objective=Objective, optimisation=Optimisation, generation=Generation,
                advantage_variants=AdvantageVariants, reward_shaping=RewardShaping, loss_variants=LossVariants,
                token_selection=TokenSelection, dynamic_sampling=DynamicSampling,
                reference_and_entropy=ReferenceAndEntropy, policy_and_reward=PolicyAndReward, data=Data,
                experiment=Experiment)


@dataclass
class Args(Experiment, Data, PolicyAndReward, ReferenceAndEntropy, DynamicSampling, TokenSelection, LossVariants,
           RewardShaping, AdvantageVariants, Generation, Optimisation, Objective):
    """Every knob, flat."""


def parse_args(argv: list[str]) -> Args:
    """--preset first, then the flags against its defaults (--help shows them, and every preset's knobs), as one group
    per section without a prefix, then flat."""
    reader = argparse.ArgumentParser(add_help=False)
    reader.add_argument("--preset", default="grpo")
    defaults = replace(Args(), **PRESETS.get(reader.parse_known_args(argv)[0].preset, {}))  # tyro refuses the unknown
    Flags = make_dataclass("Flags", list(SECTIONS.items()))
    default = Flags(**{name: group(**{f.name: getattr(defaults, f.name) for f in fields(group)})
                       for name, group in SECTIONS.items()})
    description = "presets (--preset X sets these; a flag given wins):\n" + "\n".join(f"  {name}: " + " ".join(
        as_flag(k) if v is True else f"{as_flag(k)} {v}" for k, v in knobs.items()) for name, knobs in PRESETS.items())
    flags = tyro.cli(Flags, default=default, args=argv, description=description, config=(tyro.conf.OmitArgPrefixes,))
    return Args(**{key: value for name in SECTIONS for key, value in vars(getattr(flags, name)).items()})


# The valid range of every numeric knob. None (off; --overlong-buffer-length: a fifth) is always valid; NaN never is.
RANGES = {
    "(0, inf)": "num_iterations num_prompts num_epochs num_minibatches micro_batch_size num_generations max_new_tokens "
                "max_prompt_length adam_eps clip_eps clip_eps_high sapo_temperature_pos sapo_temperature_neg "
                "vespo_lambda_pos vespo_lambda_neg ent_coef_delta lora_alpha",
    "[0, inf)": "kl_coef ent_coef learning_rate weight_decay top_k lr_warmup_iterations vespo_k_pos vespo_k_neg "
                "off_policy_mask_threshold max_resample_rounds overlong_buffer_length overlong_penalty "
                "entropy_target ent_coef_min ent_coef_max ref_sync_every lora_r eval_every save_every",
    "(0, 1]": "top_p ref_sync_alpha top_entropy_quantile", "[0, 1)": "min_p lora_dropout", "(1, inf)": "dual_clip",
    "[0.001, inf)": "temperature", "[0, 2**64)": "seed", "(0, inf]": "max_grad_norm",
}

# A flag away from its default (Args'; a value --preset sets counts as set) while this condition is false would do
# nothing: an error. On-policy (one epoch of one minibatch) the ratio is 1, and every policy loss gives the gradient.
ONLY_WITH = [
    ("wandb_project", "does nothing without --track", lambda a: a.track),
    ("dataset_split", "does nothing with a .jsonl --prompts-path", lambda a: not a.prompts_path.endswith(".jsonl")),
    ("eval_prompts_path", "does nothing with --eval-every 0", lambda a: a.eval_every > 0),
    ("eval_dataset_split", "does nothing with --eval-every 0 or a .jsonl --eval-prompts-path",
     lambda a: a.eval_every > 0 and not a.eval_prompts_path.endswith(".jsonl")),
    *((name, "does nothing on-policy (--num-epochs 1, --num-minibatches 1: the ratio is 1)",
       lambda a: not is_on_policy(a)) for name in ("clip_eps", "clip_eps_high", "dual_clip", "policy_loss",
                                                    "off_policy_mask_threshold")),
    ("importance_level", "does nothing on-policy (--num-epochs 1, --num-minibatches 1) with every token's loss",
     lambda a: not is_on_policy(a) or a.top_entropy_quantile < 1),
    ("max_resample_rounds", "does nothing without --dynamic-sampling", lambda a: a.dynamic_sampling),
    ("overlong_penalty", "does nothing with --overlong-buffer-length 0", lambda a: a.overlong_buffer_length != 0),
    *((name, "does nothing with --kl-coef 0", lambda a: a.kl_coef > 0) for name in ("kl_estimator", "kl_in",
                                                                                    "ref_sync_every")),
    ("kl_importance_correction", "does nothing without the KL in the loss (--kl-coef > 0, --kl-in loss)",
     lambda a: a.kl_coef > 0 and a.kl_in == "loss"),
    ("dual_clip", "does nothing without --policy-loss clip", lambda a: a.policy_loss == "clip"),
    *((name, "does nothing with --policy-loss sapo or vespo (no clip range)",
       lambda a: a.policy_loss not in ("sapo", "vespo")) for name in ("clip_eps", "clip_eps_high")),
    *((name, "does nothing without --policy-loss sapo", lambda a: a.policy_loss == "sapo")
      for name in ("sapo_temperature_pos", "sapo_temperature_neg")),
    *((name, "does nothing without --policy-loss vespo", lambda a: a.policy_loss == "vespo")
      for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")),
    ("reward_aggregation", "does nothing with one reward of weight 1 and no shaping (overlong penalty, --kl-in reward)",
     lambda a: len(reward_specs(a)) + bool(a.reward_model_path) > 1 or a.reward_weights not in (None, (1.0,))
     or a.overlong_buffer_length != 0 or a.kl_in == "reward"),
    *((name, "does nothing without --entropy-target", lambda a: a.entropy_target is not None)
      for name in ("ent_coef_delta", "ent_coef_min", "ent_coef_max")),
    ("answer_field", "does nothing with --reward-model-path alone", lambda a: reward_specs(a)),
    ("ref_sync_alpha", "does nothing without --ref-sync-every", lambda a: a.ref_sync_every > 0),
    ("fsdp", "does nothing in one process (launch with torchrun --nproc_per_node N)", lambda a: launched_ranks() > 1),
    *((name, "does nothing with --lora-r 0", lambda a: a.lora_r > 0)
      for name in ("lora_alpha", "lora_dropout", "lora_target_modules")),
]

# What --resume-from accepts changed: output, logging, memory and speed knobs (equal up to rounding), --num-iterations.
RESUME_MAY_CHANGE = {"num_iterations", "output_dir", "overwrite", "resume_from", "eval_every", "eval_prompts_path",
                     "eval_dataset_split", "save_every", "track", "wandb_project", "doctor", "gradient_checkpointing",
                     "chunked_logprobs", "share_prompts", "micro_batch_size", "fsdp"}


class ConfigError(Exception):
    """Bad input from the user, or a run that cannot go on: one line starting with "error:", exit code 1."""


class NonFiniteLoss(Exception):
    """A loss or gradient norm that is NaN or infinite: the run stops before the optimizer spreads it."""


def as_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_args(args: Args) -> None:
    """One line naming the flag, before any model loads: ranges, do-nothing flags, sizes, conflicts, packages, paths."""
    for interval, names in RANGES.items():
        low, high = (float(b) if b != "2**64" else 2**64 for b in interval[1:-1].split(", "))
        for name, value in ((name, getattr(args, name)) for name in names.split()):
            if value is not None and not ((low < value if interval[0] == "(" else low <= value) and
                                          (value < high if interval[-1] == ")" else value <= high)):
                raise ConfigError(f"{as_flag(name)} must be in {interval}, got {value}")
    defaults = replace(Args(), **PRESETS[args.preset])
    for name, why_not, needed in ONLY_WITH:  # a knob --preset set counts as set
        if getattr(args, name) != getattr(Args, name) and not needed(args):
            raise ConfigError(f"{as_flag(name)} {why_not}" + f" (--preset {args.preset} sets it)" * (
                getattr(args, name) == getattr(defaults, name)))
    per_rank = exact_div(args.num_prompts, launched_ranks(), "--num-prompts must split over the torchrun ranks")
    if not args.dynamic_sampling:  # dynamic sampling may keep fewer: its minibatches are split as they come
        exact_div(per_rank * args.num_generations, args.num_minibatches, "--num-prompts x --num-generations (per "
                  f"rank) must split into --num-minibatches (--preset {args.preset}: {defaults.num_minibatches})")
    check_combinations(args)
    for flag, wanted, package in (("--track", args.track, "tensorboard"), ("--lora-r", args.lora_r, "peft"),
                                  ("--wandb-project", args.wandb_project, "wandb")):
        if wanted and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{flag} needs the {package} package: pip install {package}")
    for flag, p in (("--model-name-or-path", args.model_name_or_path), ("--reward-model-path", args.reward_model_path)):
        if p and (p[:1] in "/~" or p.count("/") > 1 or os.path.isdir(p.split("/")[0])) and not os.path.isdir(p):
            raise ConfigError(f"{flag} {p}: no such directory")  # demo/x is a path (demo/ exists), Qwen/x a Hub id


def check_combinations(args: Args) -> None:
    """The flags that cannot work together: the clip, the rewards and their baseline, the KL, LoRA, entropy control."""
    high = args.clip_eps if args.clip_eps_high is None else args.clip_eps_high
    num_rewards = len(reward_specs(args)) + bool(args.reward_model_path)
    for conflict, message in (
            (args.policy_loss == "clip" and args.clip_eps >= 1, f"--clip-eps {args.clip_eps} must be below 1 with "
             "--policy-loss clip: 1 - clip_eps bounds the ratio from below"),
            (args.dual_clip is not None and args.dual_clip <= 1 + high, f"--dual-clip {args.dual_clip} must exceed 1 "
             f"+ the upper clip epsilon ({1 + high:g})"),
            (args.kl_coef > 0 and args.kl_in == "loss" and args.kl_estimator == "k1" and not
             args.kl_importance_correction, "--kl-estimator k1 in the loss has an expected gradient of 0 on-policy "
             "(E[grad log pi] = 0): use k3, --kl-in reward or --kl-importance-correction"),
            (args.kl_importance_correction and args.kl_estimator == "k2", "--kl-importance-correction with "
             "--kl-estimator k2: the weighted k2 term's gradient is not the KL's; use k3 (DeepSeek-V3.2) or k1"),
            (args.baseline == "greedy" and (args.scale_rewards != "none" or args.dynamic_sampling or
                                            args.reward_aggregation != "sum-then-normalize"),
             "--baseline greedy needs --scale-rewards none, sum-then-normalize and no --dynamic-sampling"),
            (args.num_generations < 2 and (args.baseline != "greedy" or args.scale_rewards == "group"),
             f"--num-generations {args.num_generations}: the {args.baseline} baseline and group scaling need G >= 2"),
            (args.overlong_buffer_length is not None and args.overlong_buffer_length >= args.max_new_tokens,
             f"--overlong-buffer-length {args.overlong_buffer_length} must be below --max-new-tokens"),
            (args.reward_weights is not None and len(args.reward_weights) != num_rewards, f"--reward-weights has "
             f"{len(args.reward_weights or ())} values for {num_rewards} rewards (each --reward-fn, the reward model)"),
            (args.reward_weights is not None and not (all(map(math.isfinite, args.reward_weights)) and any(
                args.reward_weights)), f"--reward-weights must be finite and not all 0, got {args.reward_weights}"),
            (args.share_prompts and launched_ranks() > 1, "--share-prompts runs in one process only"),
            (args.lora_r > 0 and (launched_ranks() > 1 or args.ref_sync_every > 0), "--lora-r trains in one process, "
             "without --ref-sync-every (its reference is the policy with the adapters off)"),
            (args.entropy_target is not None and not args.ent_coef_min <= args.ent_coef <= args.ent_coef_max,
             "--ent-coef must lie in [--ent-coef-min, --ent-coef-max]: adaptive entropy control starts there"),
            (not args.prompt_field or not args.answer_field or args.prompt_field == args.answer_field,
             "--prompt-field and --answer-field must be two different, non-empty field names"),
            (args.output_dir == "" or args.resume_from == "" or "" in args.reward_fn,
             "--output-dir, --resume-from and --reward-fn must not be empty"),
            (args.prompts_path != Data.prompts_path and args.eval_prompts_path == Data.eval_prompts_path and
             args.eval_every > 0, "--prompts-path needs --eval-prompts-path (else the demo's eval) or --eval-every 0"),
            (int(transformers.__version__.split(".")[0]) < 5, f"transformers {transformers.__version__}: this script "
             "needs transformers 5 or later (pip install -U transformers)")):
        if conflict:
            raise ConfigError(message)


def exact_div(a: int, b: int, what: str) -> int:
    if a % b != 0:
        raise ConfigError(f"{what}: {a} is not divisible by {b}")
    return a // b


def default_learning_rate(num_params: int) -> float:
    """The policy's learning rate by its parameter count: about a tenth of fine-tuning's (5e-4 for the demo)."""
    for limit, rate in ((10e6, 5e-4), (300e6, 3e-5), (3e9, 3e-6)):
        if num_params < limit:
            return rate
    return 1e-6



# ---------------------------------------------------------------------------------------------------------------------
# Data and rewards: prompt files, tokenization, the reward functions and the reward model.


class Prompts:
    """Every prompt of the run as token ids beside its row (the fields the reward functions read)."""

    def __init__(self, rows: list[dict], eval_rows: list[dict], tokenizer, args: Args):
        self.rows, self.eval_rows = rows, eval_rows
        self.ids = tokenize_prompts(tokenizer, rows, args, f"--prompts-path {args.prompts_path}")
        self.eval_ids = tokenize_prompts(tokenizer, eval_rows, args, f"--eval-prompts-path {args.eval_prompts_path}")


def load_prompts(path: str, flag: str, split: str, args: Args) -> list[dict]:
    """The rows of a JSONL file or a dataset directory's split, their fields renamed 'prompt' and 'answer', checked."""
    if path.endswith(".jsonl"):
        if not os.path.isfile(path):
            raise ConfigError(f"{flag} {path}: file not found")
        lines = [(n, line) for n, line in enumerate(read_text(path, flag).splitlines(), 1) if line.strip()]
        rows, where = [], [f"{flag} {path}, line {n}" for n, _ in lines]
        for place, (_, line) in zip(where, lines):
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise ConfigError(f"{place}: not valid JSON ({e})") from None
    else:
        if importlib.util.find_spec("datasets") is None or not os.path.isdir(path):
            raise ConfigError(f"{flag} {path}: neither a .jsonl file nor a dataset directory that the datasets "
                              "package (pip install datasets) reads")
        import datasets
        datasets.disable_progress_bars()
        try:  # an empty directory, a missing split, a save_to_disk directory, columns of two types, a script ...
            rows = list(datasets.load_dataset(path, split=split))
        except Exception as e:
            raise ConfigError(f"{flag} {path}: the datasets package cannot read it ({why(e)})") from None
        where = [f"{flag} {path}, row {n}" for n in range(1, len(rows) + 1)]
    for row, place in zip(rows, where):
        if isinstance(row, dict):  # both renamed at once: --prompt-field answer --answer-field prompt swaps them
            fields_ = ((args.prompt_field, "prompt"), (args.answer_field, "answer"))
            row.update({name: row.pop(given, None) for given, name in fields_ if given != name})
            if clash := {"prompts", "completions"} & row.keys():
                raise ConfigError(f"{place}: a field named {min(clash)} is a reward function's argument")
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ConfigError(f"{place}: no prompt: each row needs a non-empty text in the field {args.prompt_field!r}")
        answer, builtin = row.get("answer"), [spec for spec in reward_specs(args) if spec in BUILTIN_REWARD_FNS]
        if builtin and not (isinstance(answer, (str, int)) or isinstance(answer, float) and math.isfinite(answer)):
            raise ConfigError(f"{place}: --reward-fn {builtin[0]} needs a text or a number in the field "
                              f"{args.answer_field!r} (--answer-field), found {answer!r}")
    if not rows:
        raise ConfigError(f"{flag} {path}: no rows")
    return rows


def read_text(path: str, flag: str) -> str:
    """The UTF-8 text of a file, or one line naming the first byte that is not UTF-8 (a gzip or Latin-1 file)."""
    try:
        return Path(path).read_bytes().decode("utf-8-sig")  # a byte-order mark, as some editors write, dropped
    except UnicodeDecodeError as e:
        raise ConfigError(f"{flag} {path}: not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x})") from None


def why(e: Exception) -> str:
    """An exception as one line: its type and the first line of its message."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def tokenize_prompts(tokenizer, rows: list[dict], args: Args, where: str) -> list[list[int]]:
    """Token ids of every prompt (with --chat-template, a user turn), cut from the left to --max-prompt-length."""
    encoded = []
    for n, row in enumerate(rows, 1):
        try:  # a template that fails to render, a character the tokenizer cannot encode (a lone surrogate)
            text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                                 add_generation_prompt=True) if args.chat_template else row["prompt"]
            encoded.append(tokenizer(text, add_special_tokens=not args.chat_template)["input_ids"])
        except Exception as e:
            raise ConfigError(f"{where}, row {n}: the tokenizer cannot encode its prompt ({why(e)})") from None
    if truncated := sum(len(ids) > args.max_prompt_length for ids in encoded):
        print(f"warning: {truncated} of {len(encoded)} prompts are longer than --max-prompt-length "
              f"{args.max_prompt_length} tokens and were truncated from the left")
    return [ids[-args.max_prompt_length :] for ids in encoded]


def prompts_of_step(prompts: Prompts, step: int, args: Args) -> tuple[list[dict], list[list[int]]]:
    """The rows and token ids of the prompts of `step` in the data order, this rank's share of them."""
    share = args.num_prompts // world_size()
    inds = batch_indices(step, args.num_prompts, len(prompts.rows), args.seed)[rank() * share : (rank() + 1) * share]
    return [prompts.rows[i] for i in inds], [prompts.ids[i] for i in inds]


def batch_indices(iteration: int, num_prompts: int, dataset_size: int, seed: int) -> list[int]:
    """An iteration's prompts: a fresh seeded permutation per pass over the data, stateless for resume."""
    positions = range(iteration * num_prompts, (iteration + 1) * num_prompts)
    permutations = {epoch: torch.randperm(dataset_size, generator=torch.Generator().manual_seed(
        (seed * 100_003 + epoch) % 2**64)) for epoch in {p // dataset_size for p in positions}}
    return [int(permutations[p // dataset_size][p % dataset_size]) for p in positions]


def left_pad(tokenizer, sequences: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of the sequences, padded on the left to the longest, by the tokenizer."""
    padded = tokenizer.pad({"input_ids": sequences}, padding_side="left", return_tensors="pt")
    return padded["input_ids"].to(device), padded["attention_mask"].to(device)


@torch.no_grad()
def score_responses(models: Models, reward_fns: list, batch: Batch, rows: list[dict], args: Args) -> torch.Tensor:
    """The (B, K) raw scores: each reward function's on the prompt and completion text, then the reward model's."""
    completions = models.tokenizer.batch_decode(batch.responses, skip_special_tokens=True)
    scores = [call_reward_fn(fn, name, [row["prompt"] for row in rows], completions, rows).to(models.device)
              for name, fn in reward_fns]
    if models.reward_model is not None:
        scores.append(reward_model_scores(models.reward_model, batch, args.micro_batch_size))
    return torch.stack(scores, 1)


@torch.no_grad()
def reward_model_scores(reward_model: nn.Module, batch: Batch, micro_batch_size: int) -> torch.Tensor:
    """The reward model's scalar at the last attended token of prompt + response."""
    scores = []
    for rows in micro_batches(len(batch.responses), micro_batch_size):
        mask = batch.attention_mask[rows]
        per_position = scalar_forward(reward_model, batch.query_responses[rows], mask)
        last = mask.shape[1] - 1 - mask.flip(1).long().argmax(1)  # the last position attended
        scores.append(per_position[torch.arange(len(per_position)), last])
    if not (scores := torch.cat(scores)).isfinite().all():  # a broken model, as a reward function's NaN is refused
        raise ConfigError(f"the reward model gave a non-finite score ({scores[~scores.isfinite()][0].item()})")
    return scores


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match_reward(prompts: list[str], completions: list[str], answer: list, **_) -> list[float]:
    """1.0 if the completion, stripped, equals the row's answer, else 0.0; numbers as numbers ("982" = 982.0)."""
    def equal(completion: str, expected) -> bool:
        c, a = completion.strip(), str(expected).strip()
        return float(c) == float(a) if NUMBER.fullmatch(c) and NUMBER.fullmatch(a) else c == a

    return [float(equal(c, a)) for c, a in zip(completions, answer)]


def last_number_reward(prompts: list[str], completions: list[str], answer: list, **_) -> list[float]:
    """1.0 if the last number in the completion equals the last number in the row's answer (math-style)."""
    def last_number(text) -> Optional[float]:
        found = NUMBER.findall(str(text).replace(",", ""))
        return float(found[-1]) if found else None

    pairs = [(last_number(c), last_number(a)) for c, a in zip(completions, answer)]
    return [float(p is not None and a is not None and abs(p - a) < 1e-6) for p, a in pairs]


BUILTIN_REWARD_FNS = {"exact_match": exact_match_reward, "last_number": last_number_reward}


def reward_specs(args: Args) -> tuple[str, ...]:
    """The --reward-fn given, else exact_match when there is no reward model."""
    return args.reward_fn or (() if args.reward_model_path else ("exact_match",))


def load_rewards(args: Args) -> list[tuple[str, Callable]]:
    """(name, function) of each reward: a built-in's name or 'fn' of 'module:fn', 'file.py:fn' (repeated: fn_2, ...)."""
    named, taken = [], {"reward_model"}  # the reward model's scores' name
    for spec in reward_specs(args):
        base = spec.rpartition(":")[2]
        name = next(n for n in (base, *(f"{base}_{k}" for k in range(2, len(taken) + 2))) if n not in taken)
        named.append((name, load_function(spec, "--reward-fn", BUILTIN_REWARD_FNS)))
        taken.add(name)
    return named


def load_function(spec: str, flag: str, builtins: dict) -> Callable:
    """A built-in name, 'package.module:function' (pkgutil.resolve_name) or 'path/to/file.py:function' (runpy)."""
    if spec in builtins:
        return builtins[spec]
    module, _, function = spec.rpartition(":")
    if not module or not function:
        raise ConfigError(f"{flag} {spec!r}: expected one of {sorted(builtins)}, module:function or file.py:function")
    try:
        fn = runpy.run_path(module)[function] if module.endswith(".py") else pkgutil.resolve_name(spec)
    except Exception as e:  # no such file, module or function, or the module fails as it is imported
        raise ConfigError(f"{flag} {spec!r} cannot be imported: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"{flag} {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def call_reward_fn(fn: Callable, name: str, prompts: list[str], completions: list[str], rows: list[dict]
                   ) -> torch.Tensor:
    """fn(prompts, completions, **row_fields), checked to be one finite number per completion."""
    keys = dict.fromkeys(key for row in rows for key in row if key != "prompt")
    scores = fn(list(prompts), list(completions), **{key: [row.get(key) for row in rows] for key in keys})
    what = f"reward function {name!r} returned"
    try:  # a list, a tuple, a tensor or an array of real numbers (an iterator could be endless)
        if not isinstance(scores, (list, tuple, torch.Tensor, numpy.ndarray)):
            raise TypeError(f"a {type(scores).__name__}, not a list, tuple, tensor or array")
        if any(isinstance(s, (str, bytes)) for s in scores):
            raise TypeError("text where a number belongs")
        scores = torch.as_tensor(scores)
        if scores.is_complex():
            raise TypeError("complex numbers")
        scores = scores.to(torch.float32)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise ConfigError(f"{what} {str(scores)[:40]}, not {len(completions)} numbers ({e})") from None
    if scores.shape != (len(completions),):
        raise ConfigError(f"{what} shape {tuple(scores.shape)}, not one number for each of {len(completions)}")
    if not scores.isfinite().all():
        raise ConfigError(f"{what} a non-finite value ({scores[~scores.isfinite()][0].item()}), or past float32")
    return scores


def kept_groups(kept: list[tuple[Batch, list[dict]]], last_round: tuple[Batch, list[dict]], models: Models, args: Args,
                rounds: int) -> tuple[Batch, list[dict]]:
    """The groups dynamic sampling kept (re-padded) and their rows: every rank's, each rank taking an equal share (in
    one process: all; those past a multiple of the ranks left out), or, fewer groups than ranks, its last round."""
    moved = lambda b, device: replace(b, **{f.name: getattr(b, f.name).to(device) for f in fields(b)
                                            if isinstance(getattr(b, f.name), torch.Tensor)})
    parts = kept if world_size() == 1 else [(moved(b, models.device), rows) for part in all_gather_objects(
        [(moved(b, "cpu"), rows) for b, rows in kept]) for b, rows in part]  # every rank's, gathered on the CPU
    total, share = sum(len(rows) for _, rows in parts), args.num_prompts // world_size()
    per_rank = min(total // world_size(), share)
    if per_rank < share:
        progress("")
        print(f"warning: dynamic sampling kept {total} of {args.num_prompts} groups after {rounds} rounds; training "
              + (f"on {per_rank * world_size()}" if per_rank else "on the last round as sampled"))
    if not per_rank:
        return last_round
    context, width = max(b.context_length for b, _ in parts), max(b.responses.shape[1] for b, _ in parts)
    pad, pad_id, padded = nn.functional.pad, models.tokenizer.pad_token_id, []
    for b, _ in parts:
        left, right = context - b.context_length, width - b.responses.shape[1]
        padded.append(replace(b, context_length=context, responses=pad(b.responses, (0, right), value=pad_id),
                              response_mask=pad(b.response_mask, (0, right)),
                              query_responses=pad(b.query_responses, (left, right), value=pad_id),
                              attention_mask=pad(b.attention_mask, (left, right))))
    batch = Batch(**{f.name: torch.cat([getattr(b, f.name) for b in padded]) if isinstance(
        getattr(padded[0], f.name), torch.Tensor) else getattr(padded[0], f.name) for f in fields(Batch)})
    mine = (torch.arange(total) // per_rank == rank()).tolist()
    mine_rows = torch.tensor(mine, device=batch.responses.device).repeat_interleave(args.num_generations)
    return batch[mine_rows], [row for row, m in zip([r for _, rows in parts for r in rows], mine) if m]


# ---------------------------------------------------------------------------------------------------------------------
# Models and LoRA: the tokenizer, the policy, the reference, the reward model, and the optimizer.


@dataclass
class Models:
    """The policy, the frozen reference (with LoRA the policy, adapters off), the reward model and the tokenizer."""
    tokenizer: transformers.PreTrainedTokenizerBase
    policy: nn.Module
    ref_policy: Optional[nn.Module]  # None with LoRA, or with beta = 0
    reward_model: Optional[nn.Module]  # None without --reward-model-path
    eos_token_ids: list[int]
    device: torch.device
    dtype: torch.dtype  # what forward passes compute in: --dtype

    @contextlib.contextmanager
    def reference(self):
        """pi_ref: the initial policy (frozen but for --ref-sync-every), or with LoRA the policy, adapters off."""
        if self.ref_policy is not None:
            yield self.ref_policy
        else:
            with self.policy.disable_adapter():
                yield self.policy

    def autocast(self):
        """Forward passes compute in --dtype; trained weights stay float32 (see load_model)."""
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)


def load_models(args: Args, tokenizer, device: torch.device, resume: Optional[Path]) -> Models:
    """The models of the run, from the flags' paths or the checkpoint resumed (LoRA: its adapters); under torchrun
    every rank loads the full weights, then keeps its shard (or, without --fsdp, its replica)."""
    saved = resume if resume is not None and not args.lora_r else None  # whole models in the checkpoint
    policy = load_model(AutoModelForCausalLM, saved / "policy" if saved else args.model_name_or_path, args, device)
    stop_ids = eos_token_ids(tokenizer, policy, args.chat_template)
    if args.lora_r:
        policy = add_lora(policy, args, resume / "policy" if resume else None)
    policy = shard(policy, args)  # each model sharded as soon as it is loaded: one model's full weights at a time
    synced = resume is not None and args.ref_sync_every > 0  # the checkpoint's reference, mixed toward the policy
    ref_policy = None if args.lora_r or args.kl_coef == 0 else shard(load_model(
        AutoModelForCausalLM, resume / "reference" if synced else args.model_name_or_path, args, device,
        trainable=False), args)
    reward_model = shard(load_model(AutoModelForSequenceClassification, args.reward_model_path, args, device,
                                    trainable=False, dtype=getattr(torch, args.dtype)),
                         args) if args.reward_model_path else None
    if reward_model is not None and reward_model.config.num_labels != 1:
        raise ConfigError(f"--reward-model-path {args.reward_model_path}: a reward model has one output, this one "
                          f"{reward_model.config.num_labels} (num_labels in its config.json)")
    if reward_model is not None and load_tokenizer(args.reward_model_path).get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"--reward-model-path {args.reward_model_path}: its tokenizer is not the policy's; score "
                          "with a reward model of the policy's vocabulary, or write a --reward-fn that calls yours")
    return Models(tokenizer, policy, ref_policy, reward_model, stop_ids, device, getattr(torch, args.dtype))


def load_tokenizer(path: str, chat_template: bool = False):
    """The tokenizer; without a pad token it pads with EOS (safe: the masks never come from pad ids)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)  # no code from a model's directory
    except (OSError, ValueError) as e:  # no tokenizer files there
        raise ConfigError(f"{path}: cannot load a tokenizer ({why(e)})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template and not tokenizer.chat_template:
        raise ConfigError(f"--chat-template: the tokenizer of {path} has no chat template")
    return tokenizer


def eos_token_ids(tokenizer, model, chat_template: bool) -> list[int]:
    """The ids that end the model's turn: the tokenizer's and generation config's EOS, and with --chat-template the
    first special token after an assistant's reply in the template (which closes a turn: <|im_end|> in ChatML)."""
    configured = model.generation_config.eos_token_id
    ids = {tokenizer.eos_token_id, *(configured if isinstance(configured, list) else [configured])} - {None}
    if chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "Hello there."}], tokenize=False)
        after = tokenizer(text[text.rfind("Hello there.") + 12 :], add_special_tokens=False)["input_ids"]
        ids |= set([i for i in after if i in tokenizer.all_special_ids][:1])
    return sorted(ids)


def load_model(cls, path, args: Args, device: torch.device, trainable: bool = True,
               dtype: torch.dtype = torch.float32):
    """The model in float32 unless told otherwise (forward passes compute in --dtype). Weights missing (they would start
    random) or unused (fewer layers in the config) are an error."""
    try:
        model, info = cls.from_pretrained(path, dtype=dtype, output_loading_info=True, trust_remote_code=False)
    except (OSError, ValueError) as e:  # no such directory or Hub name, no config or weights there
        raise ConfigError(f"{path}: cannot load ({why(e)})") from None
    if missing := sorted(info["missing_keys"]):
        raise ConfigError(f"{path}: the checkpoint has no weights for {', '.join(missing[:3])}, which would start "
                          f"random (is it a {cls.__name__.removeprefix('AutoModelFor')} model?)")
    if unused := sorted(info["unexpected_keys"]):  # fewer layers in config.json than in the weights: a truncated model
        raise ConfigError(f"{path}: the model of its config.json uses no weights for {', '.join(unused[:3])}; does "
                          "it match them?")
    disable_dropout(model)
    model.to(device).eval()
    if trainable and args.gradient_checkpointing:
        model.gradient_checkpointing_enable()  # active only in train mode, i.e. in the update, not in generate
    return model.requires_grad_(trainable)


def disable_dropout(model: nn.Module) -> None:
    """Every dropout zeroed (pi_old and pi_theta must be one network), config floats like attention_dropout too."""
    for holder in [*model.modules(), model.config]:
        for key, value in list(vars(holder).items()):
            if isinstance(value, float) and (key == "p" and isinstance(holder, nn.Dropout) or "dropout" in key
                                             or "pdrop" in key):
                setattr(holder, key, 0.0)


def add_lora(model: nn.Module, args: Args, saved_adapters: Optional[Path]) -> nn.Module:
    """The model with trainable low-rank adapters (peft; the checkpoint's on resume), its own weights frozen;
    model.disable_adapter() gives back the untouched model: the reference."""
    import peft  # optional: check_args made sure it exists
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)  # peft 0.21's call
    targets = args.lora_target_modules or []
    if model.config.get_text_config().tie_word_embeddings and any("lm_head" in t or "embed" in t for t in targets):
        raise ConfigError(f"--lora-target-modules {' '.join(targets)}: the output head shares its weights with the "
                          "embeddings in this model, so merging an adapter on one would change the other")
    names = [name for name, _ in model.named_modules()]  # peft matches a module's name or its suffix
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:  # peft itself complains only when no name matches at all
        raise ConfigError(f"--lora-target-modules: {' '.join(unmatched)} matches no module of this model")
    try:
        model = peft.PeftModel.from_pretrained(model, saved_adapters, is_trainable=True) if saved_adapters else \
            peft.get_peft_model(model, peft.LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, task_type="CAUSAL_LM",
                                                       lora_dropout=args.lora_dropout,
                                                       target_modules=targets or "all-linear"))
    except ValueError as e:  # a module peft cannot wrap (a norm layer)
        raise ConfigError(f"--lora-target-modules {' '.join(targets)}: peft cannot place adapters there ({why(e)})"
                          ) from None
    if args.gradient_checkpointing:  # the frozen embeddings' output must carry a gradient into checkpointed layers
        model.enable_input_require_grads()
    return model


def make_optimizer(models: Models, args: Args) -> tuple[torch.optim.Optimizer, float]:
    """AdamW over the policy's trained weights (LoRA's adapters), and its base rate: the flag's, or by its size."""
    rate = args.learning_rate
    if rate is None:
        num_params = sum(p.numel() for p in models.policy.parameters())  # a sharded tensor counts whole
        rate = default_learning_rate(num_params)
        print(f"learning rate {rate:g}, by the policy's size ({num_params / 1e6:.1f}M parameters)"
              + ("; LoRA usually wants about 10x" if args.lora_r else ""))
    # fused: one kernel per step over all tensors, without a temporary per tensor
    return torch.optim.AdamW([p for p in models.policy.parameters() if p.requires_grad], lr=rate, eps=args.adam_eps,
                             weight_decay=args.weight_decay, fused=True), rate


def scalar_forward(model, query_responses, attention_mask) -> torch.Tensor:
    """Per-position scalar from a sequence-classification model: head(backbone hidden states), shape (B, L)."""
    hidden = model.base_model(input_ids=query_responses, attention_mask=attention_mask,
                              position_ids=position_ids_from(attention_mask), use_cache=False).last_hidden_state
    return model.score(hidden).squeeze(-1).float()


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Left padding: the first real token is position 0."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


# ---------------------------------------------------------------------------------------------------------------------
# Performance: each function computes what its docstring's plain form says, in less time or memory.


def micro_batches(num_rows: int, micro_batch_size: int) -> list[slice]:
    """The rows of each micro-batch, in turn: a forward pass runs micro_batch_size sequences at a time."""
    return [slice(start, start + micro_batch_size) for start in range(0, num_rows, micro_batch_size)]


def fast_policy_forward(model, batch: Batch, temperature: float, entropy: bool, chunked: bool, share_prompts: bool):
    """policy_forward's numbers up to rounding: share_prompts, each prompt's pass once (prompt_cache); chunked, through
    ResponseLogprobs from the hidden states and output_head's head (no whole (B, T, vocab) logits), else the logits."""
    head = output_head(model) if chunked else None
    hidden, c, mask = head is not None, batch.context_length, batch.attention_mask
    positions, keep = position_ids_from(mask), torch.arange(c - 1, mask.shape[1] - 1, device=mask.device)
    query_responses = batch.query_responses
    shared = prompt_cache(model, query_responses[:, :c], mask[:, :c], hidden) if share_prompts else None
    if shared is None:  # no logits at all where the head is ours
        out = model(input_ids=query_responses, attention_mask=mask, position_ids=positions, use_cache=False,
                    output_hidden_states=hidden, logits_to_keep=keep[:0] if hidden else keep)
        x = out.hidden_states[-1][:, c - 1 : -1] if hidden else out.logits
    else:  # the prompt's last position predicts the first response token; the responses but their last, the rest
        x, cache = shared
        if query_responses.shape[1] - c > 1:
            out = model(input_ids=query_responses[:, c:-1], attention_mask=mask[:, :-1], cache=cache, use_cache=True,
                        position_ids=positions[:, c:-1], output_hidden_states=hidden,
                        logits_to_keep=keep[:0] if hidden else 0)
            x = torch.cat([x, out.hidden_states[-1] if hidden else out.logits], 1)
    if not chunked:
        return logprobs_and_entropy(x, batch.responses, temperature, entropy)
    weight, bias = (head.weight, head.bias) if head is not None else (None, None)
    logprobs, h = ResponseLogprobs.apply(x.reshape(-1, x.shape[-1]), weight, bias, batch.responses.reshape(-1),
                                         temperature, entropy, torch.is_grad_enabled())
    shape = batch.responses.shape
    return logprobs.view(shape), h.view(shape) if entropy else None


def prompt_cache(model, prompt_ids, prompt_mask, hidden: bool) -> Optional[tuple[torch.Tensor, transformers.Cache]]:
    """One pass over each distinct left-padded prompt, its KV cache (keys and values) indexed out to every row: a
    response's own pass attends to it as to its own prompt, the same log-probs up to rounding, gradients flowing back
    through the indexing. Per row, the prompt's last position (final hidden state, or logits) and the cache; None
    where no prompt repeats, or for a cache of more than attention keys and values (recurrent layers)."""
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
    distinct, rows = torch.unique(torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], 1), dim=0,
                                  return_inverse=True)
    if len(distinct) == len(prompt_ids) or any(kind not in ("full_attention", "sliding_attention")
                                               for kind in layer_types):
        return None
    ids, mask = distinct.split(prompt_ids.shape[1], 1)
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from(mask), use_cache=True,
                output_hidden_states=hidden, logits_to_keep=1)
    cache, dynamic = out.cache, transformers.cache_utils.DynamicLayer
    if not isinstance(cache, transformers.DynamicCache) or not all(  # keys and values only: no layer selects more
            isinstance(layer, dynamic) and type(layer).batch_select_indices is dynamic.batch_select_indices
            for layer in cache.layers):
        return None
    for layer in cache.layers:  # index_select rather than x[rows]: a faster gather, and backward (index_add_)
        if layer.get_seq_length() > 0:  # a layer that reads another's keys and values (KV sharing) holds none
            layer.keys, layer.values = (x.index_select(0, rows) for x in (layer.keys, layer.values))
    return (out.hidden_states[-1][:, -1:] if hidden else out.logits).index_select(0, rows), cache


def output_head(model) -> Optional[nn.Module]:
    """The output head, a plain Linear outnumbering the hidden state, where no (text) config key caps or scales the
    logits (Gemma 2 and 3, Cohere, Granite, Falcon-H1); None otherwise, and under torchrun (it is a shard)."""
    config, head = model.config.get_text_config(), model.get_output_embeddings()
    scaled = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")
    if world_size() > 1 or any(getattr(config, key, None) for key in scaled):
        return None
    return head if type(head) is nn.Linear and head.out_features > head.in_features else None  # no subclass's forward


def log_softmax_at(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature), in float32."""
    z = logits.float() / temperature if temperature != 1 else logits.float()
    return z.log_softmax(-1)


LOGITS_CHUNK_ELEMENTS = 2**25  # logits per chunk of ResponseLogprobs: float32 temporaries of 128 MB each
KEPT_LOGPROBS_ELEMENTS = 2**27  # up to 512 MB of a micro-batch's log-softmax kept for its backward pass


class ResponseLogprobs(torch.autograd.Function):
    """logprobs_and_entropy's log pi(y_t) and H_t of softmax(z), z = head(x_t) / temperature in float32,
    LOGITS_CHUNK_ELEMENTS at a time, with its own backward pass (--chunked-logprobs). x: (N, hidden) final hidden
    states with the head's weight (and bias), or (N, vocab) logits with weight None. With a head the logits never
    exist whole, nor their gradient: backward recomputes each chunk from x, unless the forward pass kept the log-softmax
    (at most KEPT_LOGPROBS_ELEMENTS). d log pi(y)/dz = onehot(y) - p, dH/dz = -p (log p + H)."""

    @staticmethod
    def forward(ctx, x, weight, bias, tokens, temperature: float, with_entropy: bool, for_backward: bool):
        vocab = len(weight) if weight is not None else x.shape[-1]
        per_chunk = max(1, LOGITS_CHUNK_ELEMENTS // vocab)
        keep = for_backward and weight is not None and len(x) * vocab <= KEPT_LOGPROBS_ELEMENTS
        ctx.kept, ctx.compute_dtype = [], x.dtype  # each chunk's log-softmax, for the backward pass, when keep
        logprobs = torch.empty(len(x), dtype=torch.float32, device=x.device)
        entropy = torch.empty_like(logprobs) if with_entropy else logprobs.new_empty(0)
        for i in range(0, len(x), per_chunk):
            rows = slice(i, i + per_chunk)
            logits = x[rows] if weight is None else nn.functional.linear(x[rows], weight, bias)
            ctx.compute_dtype = logits.dtype  # autocast's, if on
            logp = log_softmax_at(logits, temperature)
            del logits  # each chunk's temporaries go before the next chunk's come
            logprobs[rows] = logp.gather(-1, tokens[rows].unsqueeze(-1)).squeeze(-1)
            if with_entropy:  # -sum p log p; in place, without another vocabulary-sized temporary
                entropy[rows] = -logp.exp().mul_(logp).sum(-1)
            ctx.kept += [logp] if keep else []
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
                logp = log_softmax_at(xs if w is None else nn.functional.linear(xs, w, None if bias is None else
                                                                                 bias.to(w.dtype)), t)
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
           temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
           share_prompts: bool = False) -> torch.Tensor:
    """The (B, T) tokens y_t ~ next_token_probs(logits_t) (or its argmax, greedy) until each has EOS or max_new_tokens
    (share_prompts: prompt_cache): not transformers' generate, whose unset knobs are the generation config's."""
    model.eval()
    eos = torch.tensor(eos_token_ids, device=input_ids.device)
    positions = position_ids_from(attention_mask)
    tokens, ended = [], torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)
    with unsharded(model):  # under torchrun: each rank decodes its own rows, waiting for none
        prefill = prompt_cache(model, input_ids, attention_mask, hidden=False) if share_prompts else None
        if prefill is None:
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                        logits_to_keep=1)
            prefill = out.logits, out.cache
        logits, cache = prefill
        for step in range(max_new_tokens):
            token = logits[:, -1].argmax(-1) if greedy else sample_from(next_token_probs(
                logits[:, -1], temperature, top_p, top_k, min_p))
            tokens.append(token)
            ended |= torch.isin(token, eos)
            if step == max_new_tokens - 1 or ended.all():  # one wait for the device per token: stop when all ended
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(token), 1)], 1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=token.unsqueeze(1), attention_mask=attention_mask, position_ids=positions,
                        cache=cache, use_cache=True)  # transformers 5's name (before: past_key_values)
            logits, cache = out.logits, out.cache
    return torch.stack(tokens, 1)


def next_token_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, min_p: float = 0.0
                     ) -> torch.Tensor:
    """The (B, vocab) sampling distribution: softmax(logits / T) cut to the top_k, then to the nucleus (most likely
    first, until top_p), then to min_p times the most likely, as transformers does; not renormalised."""
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
    """One token per row in proportion to probs, as torch.multinomial(probs, 1) draws, but fast at a real vocabulary
    on a CPU: the first whose cumulative probability exceeds u, u ~ U[0, total) from torch's global generator."""
    cdf = probs.cumsum(-1)
    u = torch.minimum(torch.rand_like(cdf[:, -1:]) * cdf[:, -1:], cdf[:, -1:].nextafter(cdf[:, -1:] * 0))
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


# ---------------------------------------------------------------------------------------------------------------------
# Distributed: torchrun and FSDP2. In one process each collective here is the identity or returns at once.


def launched_ranks() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def init_distributed() -> torch.device:
    """This rank's device; under torchrun, in the process group (NCCL and gloo, or gloo), stdout rank 0's alone."""
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
    """x summed over the ranks (in one process, x itself)."""
    if world_size() > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


def gather_cat(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x concatenated along dim 0, in rank order; sizes may differ."""
    return x if world_size() == 1 else torch.cat(all_gather_objects(x.detach().cpu())).to(x.device)


def clip_grad_norm(parameters, max_norm: float, name: str) -> float:
    """clip_grad_norm_, returning the norm before clipping; a non-finite norm stops the run (NonFiniteLoss)."""
    norm = nn.utils.clip_grad_norm_(parameters, max_norm)
    norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()  # a DTensor under FSDP
    if not math.isfinite(norm):
        raise NonFiniteLoss(f"{name} gradient norm {norm}")
    return norm


def all_max(value: int) -> int:
    """The largest of every rank's value (in one process, the value)."""
    x = torch.tensor(value)
    if world_size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return int(x)


def shard(model: nn.Module, args: Args) -> nn.Module:
    """FSDP2 over the ranks, a unit per decoder layer (and a scalar model's backbone and head) and the root: with --fsdp
    each rank stores 1/N of the weights, gradients and optimizer state; without it, full copies, as DDP keeps."""
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
    """The full weights, gathered once for a whole sample(), so that ranks may decode different numbers of tokens."""
    from torch.distributed.fsdp import FSDPModule
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


def full_state_dict(model: nn.Module) -> Optional[dict]:
    """The whole model's weights on rank 0's CPU (empty on the other ranks; None in one process: it saves itself)."""
    if world_size() == 1:
        return None
    return dcp.get_model_state_dict(model, options=dcp.StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state(model: nn.Module, optimizer) -> Optional[dict]:
    """The optimizer's whole state on rank 0's CPU; None before its first step (loading would fake a counted one)."""
    if not optimizer.state:
        return None
    return dcp.get_optimizer_state_dict(model, optimizer, options=dcp.StateDictOptions(full_state_dict=True,
                                                                                       cpu_offload=True))


# ---------------------------------------------------------------------------------------------------------------------
# The run: start-up, the output directory, checkpoints and resume, interrupts, the exit.


@dataclass
class Run(contextlib.AbstractContextManager):
    """What one training run holds; its methods are what happens around the training loop's iterations."""
    args: Args  # the flags, the output and resume paths made absolute
    models: Models
    optimizer: torch.optim.Optimizer
    learning_rate: float  # the base rate, before warmup and annealing
    reward_fns: list  # (name, function) of each reward function (load_rewards); the reward model is in models
    prompts: Prompts
    state: dict  # what a checkpoint keeps besides weights, optimizer and rows: iteration, prompts drawn, evals, ...
    log: MetricsLog
    start_time: float

    def generator(self, step: int) -> torch.Generator:
        """The random stream of an iteration's minibatch order, seeded by the iteration (for resume)."""
        return torch.Generator().manual_seed((self.args.seed * 1_000_003 + step + 7_919 * rank()) % 2**64)

    def report(self, metrics: dict) -> None:
        """The console line (COLUMNS), the doctor's warnings (counted as doctor/<signal>) and the metrics.jsonl row."""
        self.state["eval_after"] = metrics.get("eval/reward", self.state["eval_after"])
        if metrics["iteration"] == 0:
            self.state["eval_before"] = self.state["eval_after"]
            print(f"iter    0 | eval {metrics['eval/reward']:.3f} (before training)", flush=True)
        else:
            print_line(metrics)
        metrics.update(doctor_check(self.log.rows, metrics, self.args))
        self.log.log(metrics)

    def save_and_exit(self, signum: int) -> None:
        """After SIGTERM or Ctrl-C: checkpoint the run as it is, say where, and exit with 128 + the signal's number."""
        if self.log.replaced is not None:  # no row yet: nothing to save, and the earlier run left whole
            print(f"{signal.Signals(signum).name}: stopped before training; nothing deleted or saved", file=sys.stderr)
            raise SystemExit(128 + signum)
        if self.state["saved_at"] != self.state["iteration"]:
            save_checkpoint(self)  # else that checkpoint was just written, or is the one resumed from
        print(run_summary(self, stopped=True), flush=True)
        print(f"interrupted at iteration {self.state['iteration']}; resume with --resume-from "
              f"{Path(self.args.output_dir) / ('checkpoint-' + str(self.state['iteration']))}", file=sys.stderr)
        raise SystemExit(128 + signum)

    def finish(self) -> dict:
        """The final policy saved, and the run's last line; returns the eval reward before and after training."""
        self.optimizer.state.clear()  # its state (twice the weights trained) goes before the save
        save_policy(self.models, Path(self.args.output_dir) / "policy", self.args.lora_r > 0)
        print(run_summary(self, stopped=False), flush=True)
        return dict(eval_before=self.state["eval_before"], eval_after=self.state["eval_after"])

    def __exit__(self, kind, error, traceback) -> None:
        """However the run ends: the logs closed, the process group left; a non-finite loss one line naming it."""
        self.log.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        if isinstance(error, NonFiniteLoss):
            last = checkpoints_in(Path(self.args.output_dir))
            raise ConfigError(f"non-finite loss in iteration {self.state['iteration'] + 1} ({error}); stopped without "
                              f"saving it; {f'the last checkpoint is {last[-1]}' if last else 'no checkpoint'}")


STOP = []  # the signals that asked the run to stop


def request_stop(signum, frame) -> None:
    """SIGTERM (a scheduler's notice before preemption) or a first Ctrl-C: checkpoint after this iteration's update (or
    before the next one's rollout) and exit; in the last iteration the run ends as usual. A second one stops at once."""
    STOP.append(signum)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(OSError):  # straight to stderr's file: print could be mid-write on the same stream
        os.write(2, f"\n{signal.Signals(signum).name}: stopping at the next safe point (again: now)\n".encode())


def stop_signal() -> int:
    """The signal that asked any rank to stop (SIGTERM or Ctrl-C), or 0."""
    return all_max(STOP[-1] if STOP else 0)


def start_run(args: Args) -> Run:
    """Check the flags, the checkpoint, the output directory and the prompts before any model loads; load the models
    and optimizer (and the checkpoint's state). What --overwrite or a resume replaces goes at the first row."""
    device = init_distributed()
    check_args(args)  # then local paths made absolute: a reward function may change the working directory, or resume
    local = {name: os.path.abspath(path) for name in ("model_name_or_path", "reward_model_path", "prompts_path",
             "eval_prompts_path", "resume_from") if (path := getattr(args, name)) and os.path.exists(path)}
    output_dir = args.output_dir or (Path(args.resume_from).parent if args.resume_from else "runs/grpo")
    args = replace(args, output_dir=os.path.abspath(output_dir), **local)  # a Hub name stays as it is
    training_state = read_checkpoint(args) if args.resume_from else None
    earlier = earlier_run(args, training_state["iteration"] if training_state else 0)
    rows = load_prompts(args.prompts_path, "--prompts-path", args.dataset_split, args)
    eval_rows = load_prompts(args.eval_prompts_path, "--eval-prompts-path", args.eval_dataset_split,
                             args) if args.eval_every > 0 else []
    reward_fns = load_rewards(args)
    tokenizer = load_tokenizer(args.model_name_or_path, args.chat_template)
    prompts = Prompts(rows, eval_rows, tokenizer, args)
    seed_everything(args.seed)
    models = load_models(args, tokenizer, device, Path(args.resume_from) if args.resume_from else None)
    context = getattr(models.policy.config.get_text_config(), "max_position_embeddings", None) or math.inf
    if max(map(len, prompts.ids + prompts.eval_ids)) + args.max_new_tokens > context:
        raise ConfigError(f"the longest prompt plus --max-new-tokens {args.max_new_tokens} is past "
                          f"max_position_embeddings {context}; lower --max-prompt-length or --max-new-tokens")
    if world_size() > 1:  # every rank samples its own responses
        seed_everything(args.seed + 1_000_003 * rank())
    print(f"stop tokens: {' '.join(tokenizer.convert_ids_to_tokens(models.eos_token_ids))}")
    optimizer, learning_rate = make_optimizer(models, args)
    state = dict(iteration=0, prompts_seen=0, eval_before=None, eval_after=None, ent_coef=args.ent_coef, saved_at=None)
    if training_state is not None:
        load_training_state(training_state, models, optimizer)
        state.update({key: training_state.get(key, value) for key, value in state.items()})  # a new key: its start
        print(f"resumed from {args.resume_from} at iteration {state['iteration']}")
    log = MetricsLog(args, training_state["rows"] if training_state else None, earlier)
    print(f"output: {args.output_dir}/ gets metrics.jsonl (every iteration)"
          + (f", checkpoint-N (every {args.save_every} iterations)" if args.save_every else "")
          + ", policy/ (at the end)" + (", tb/ (TensorBoard)" if args.track else ""), flush=True)
    return Run(args, models, optimizer, learning_rate, reward_fns, prompts, state, log, time.time())


def seed_everything(seed: int) -> None:
    """torch's, Python's and NumPy's random streams (a reward function may draw from any), from one seed."""
    torch.manual_seed(seed % 2**64)
    random.seed(seed)
    numpy.random.seed(seed % 2**32)


def earlier_run(args: Args, iteration: int) -> list[Path]:
    """What an earlier run left in --output-dir for --overwrite to delete (else an error), or when resuming in place the
    checkpoints after the one resumed; none may be or hold a model or checkpoint this run loads (resolved paths)."""
    output_dir = Path(args.output_dir).resolve()
    try:  # a file, read-only, a name too long: said now, not after the first iteration
        output_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=output_dir).close()
    except OSError as e:
        raise ConfigError(f"--output-dir {args.output_dir}: cannot be written ({why(e)})") from None
    found = sorted(p for name in ("metrics.jsonl", "policy", "tb") if (p := output_dir / name).exists()) + \
        checkpoints_in(output_dir)
    if args.resume_from and Path(args.resume_from).resolve().parent == output_dir:  # going on in place
        if args.overwrite:
            raise ConfigError("--overwrite does nothing when --resume-from is a checkpoint of --output-dir: "
                              "resuming in place replaces the checkpoints after it, keeping the rest; drop --overwrite")
        found = [p for p in checkpoints_in(output_dir) if int(p.name.removeprefix("checkpoint-")) > iteration]
    elif found and not args.overwrite:
        raise ConfigError(f"--output-dir {args.output_dir} holds an earlier run; pass --overwrite to replace it, or "
                          "--resume-from one of its checkpoints")
    for flag, path in (("--model-name-or-path", args.model_name_or_path),
                       ("--reward-model-path", args.reward_model_path), ("--resume-from", args.resume_from)):
        read = Path(path).resolve() if path and os.path.exists(path) else None
        if read and any(p.resolve() == read or p.resolve() in read.parents or read in p.resolve().parents
                        for p in found):
            raise ConfigError(f"{flag} {path} is in what this run would delete from --output-dir "
                              f"{args.output_dir} ({', '.join(p.name for p in found)}); write to another --output-dir")
    return found


def save_policy(models: Models, path: Path, lora: bool) -> None:
    """The final policy (with LoRA, merged) and tokenizer, written whole; every rank gathers, rank 0 writes."""
    state_dict = None if lora else full_state_dict(models.policy)
    if rank() == 0:
        with written_whole(path) as tmp:
            policy = models.policy.merge_and_unload() if lora else models.policy
            policy.save_pretrained(tmp, state_dict=state_dict)
            models.tokenizer.save_pretrained(tmp)


@contextlib.contextmanager
def written_whole(path: Path):
    """Yields path.tmp to write into, then puts it in path's place: a crash mid-save leaves no half-written path."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def save_checkpoint(run: Run) -> None:
    """<output-dir>/checkpoint-N, written whole: the policy (LoRA's adapters), a synced reference, the optimizer, the
    state and metrics rows, every rank's torch, CUDA, Python and NumPy random states; rank 0 writes."""
    models, args, path = run.models, run.args, Path(run.args.output_dir) / f"checkpoint-{run.state['iteration']}"
    run.state["saved_at"] = run.state["iteration"]  # kept in the checkpoint
    saved = dict(policy=models.policy, reference=models.ref_policy if args.ref_sync_every else None)
    weights = {name: None if args.lora_r else full_state_dict(model) for name, model in saved.items()
               if model is not None}
    optimizer = optimizer_state(models.policy, run.optimizer)
    numpy_state = numpy.random.get_state()  # ("MT19937", keys, position, has_gauss, gauss): keys as a list
    rng = all_gather_objects(dict(torch=torch.get_rng_state(), python=random.getstate(),
                                  numpy=(numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]),
                                  cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []))
    if rank() == 0:
        with written_whole(path) as tmp:
            for name, state_dict in weights.items():
                saved[name].save_pretrained(tmp / name, state_dict=state_dict)
            models.tokenizer.save_pretrained(tmp / "policy")
            torch.save(dict(run.state, script="grpo", args=asdict(args), world_size=world_size(), rng=rng,
                            optimizer=optimizer, rows=run.log.rows), tmp / "training_state.pt")
    if world_size() > 1:
        dist.barrier()  # no rank goes on (or exits) before the checkpoint is in place


def all_gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    parts = [obj] * world_size()
    if world_size() > 1:
        dist.all_gather_object(parts, obj)
    return parts


def checkpoints_in(output_dir: Path) -> list[Path]:
    """The checkpoint-N directories in output_dir, oldest first."""
    found = [p for p in output_dir.glob("checkpoint-*") if p.name.removeprefix("checkpoint-").isdigit()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("checkpoint-")))


def read_checkpoint(args: Args) -> dict:
    """The training state of --resume-from, checked before any model loads: data alone (weights_only), of this
    script, written by as many ranks, with the same flags but RESUME_MAY_CHANGE, and not past --num-iterations."""
    where = f"--resume-from {args.resume_from}"
    try:
        state = torch.load(Path(args.resume_from) / "training_state.pt", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"{where}: not a checkpoint directory (no training_state.pt)") from None
    except Exception as e:  # truncated, or more than data (unpickling it could run code)
        raise ConfigError(f"{where}: training_state.pt cannot be loaded as data ({type(e).__name__})") from None
    if not isinstance(state, dict) or state.get("script") != "grpo":
        raise ConfigError(f"{where}: not a checkpoint of grpo_llm.py or its variants")
    if state["world_size"] != launched_ranks():  # each rank continues its own sampler
        raise ConfigError(f"{where}: written by {state['world_size']} rank(s), resumed with {launched_ranks()}; resume "
                          f"with torchrun --nproc_per_node {state['world_size']}")
    if unknown := sorted(set(state["args"]) - set(asdict(args))):  # written by a variant with more flags
        raise ConfigError(f"{where}: written with flags this script lacks ({', '.join(map(as_flag, unknown))})")
    saved = {**asdict(replace(Args(), **PRESETS[args.preset])), **state["args"]}  # a newer flag: its default then
    changed = [f"{as_flag(k)} {saved[k]} in the checkpoint, {v} now" for k, v in asdict(args).items()
               if k not in RESUME_MAY_CHANGE and saved[k] != v]
    if changed:
        raise ConfigError(f"{where}: flags differ from the run that wrote it: {'; '.join(changed)}")
    if args.num_iterations < state["iteration"]:
        raise ConfigError(f"--num-iterations {args.num_iterations} is below the checkpoint's {state['iteration']}")
    return state


def load_training_state(training_state: dict, models: Models, optimizer) -> None:
    """The optimizer's state and this rank's random states, loaded."""
    if training_state["optimizer"] is not None:  # saved before its first step: nothing to load
        dcp.set_optimizer_state_dict(models.policy, optimizer, training_state["optimizer"],
                                     options=dcp.StateDictOptions(full_state_dict=True))
    rng = training_state["rng"][rank()]  # each rank's own
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    numpy.random.set_state((rng["numpy"][0], numpy.array(rng["numpy"][1], dtype=numpy.uint32), *rng["numpy"][2:]))
    if rng["cuda"]:
        torch.cuda.set_rng_state_all(rng["cuda"])


def main() -> None:
    transformers.logging.set_verbosity_error()  # keep stdout to our own lines (load reports, progress bars)
    transformers.logging.disable_progress_bar()
    STOP.clear()
    handlers = {signum: signal.signal(signum, request_stop) for signum in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(signum) is not signal.SIG_IGN}  # not ignored, as in a job started with &
    code = 0
    try:
        train(parse_args(sys.argv[1:]))
    except ConfigError as e:
        progress("")
        print(f"error: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("stopped by Ctrl-C after a first signal: nothing saved since the last checkpoint", file=sys.stderr)
        code = 128 + signal.SIGINT
    except SystemExit as e:  # --help, or 128 + the number of the signal that stopped the run
        code = e.code
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if launched_ranks() > 1:  # gloo's threads can abort a rank in the interpreter's teardown: leave at once
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


# ---------------------------------------------------------------------------------------------------------------------
# Logging and the doctor: evaluation, metrics.jsonl, the console, the doctor.


def rollout_metrics(batch: Batch, reward_names: list[str], args: Args) -> dict:
    """Every rank's responses' rewards (each, the weighted sum, with shaping), KL (sum_t KL_t of pi_old; on-policy the
    update gives it), advantages' std, lengths after the prompt, truncation, groups of equal rewards, tokens chosen."""
    mask, names = batch.response_mask, reward_names + ["reward_model"] * (batch.scores.shape[1] - len(reward_names))
    std = lambda x: x.std().item() if x.numel() > 1 else 0.0  # one value's sample std: 0, not NaN
    kl = torch.zeros(len(mask), device=mask.device)  # beta = 0: no reference
    if batch.ref_logprobs is not None and batch.logprobs is not None:
        kl = (kl_penalty(batch.logprobs, batch.ref_logprobs, args.kl_estimator) * mask).sum(1)
    whole = {key: gather_cat(value.double()) for key, value in dict(
        scores=batch.scores, task=combine_rewards(batch.scores, args.reward_weights), rewards=batch.rewards,
        advantages=batch.advantages, kl=kl, lengths=batch.attention_mask[:, batch.context_length :].sum(1),
        truncated=~batch.has_eos).items()}
    lengths, flat = whole["lengths"], zero_std_groups(whole["task"], args.num_generations)
    metrics = {f"rewards/{name}/{stat}": value for k, name in enumerate(names) for stat, value in (
        ("mean", whole["scores"][:, k].mean().item()), ("std", std(whole["scores"][:, k])))}
    if args.top_entropy_quantile < 1:
        chosen, total = all_sum(torch.stack([batch.pg_mask.sum(), batch.loss_mask.sum()]))
        metrics["rollout/top_entropy_fraction"] = (chosen / total.clamp(min=1)).item()
        chosen_entropy = gather_cat(batch.entropy[batch.pg_mask])  # the threshold: the least of those chosen
        metrics["rollout/top_entropy_threshold"] = chosen_entropy.min().item() if len(chosen_entropy) else 0.0
    return dict(metrics, **{
        "objective/reward": whole["task"].mean().item(),
        "objective/total_reward": whole["rewards"].mean().item(),
        "objective/kl": whole["kl"].mean().item(),
        "objective/advantage_std": std(whole["advantages"]),
        "rollout/response_length": lengths.mean().item(),
        "rollout/response_length_min": lengths.min().item(),
        "rollout/response_length_max": lengths.max().item(),
        "rollout/truncated_fraction": whole["truncated"].mean().item(),
        "rollout/batch_size": len(lengths),
        "rollout/groups_sampled": len(flat),
        "rollout/zero_std_fraction": flat.float().mean().item(),
        "rollout/resample_rounds": 0,
    })


def samples_to_show(models: Models, batch: Batch, rows: list[dict], args: Args) -> list[tuple]:
    """[prompt, completion, reward] of the batch's first three responses (G to each row's prompt)."""
    completions = models.tokenizer.batch_decode(batch.responses[:3], skip_special_tokens=True)
    rewards = combine_rewards(batch.scores[:3], args.reward_weights).tolist()
    return [(rows[i // args.num_generations]["prompt"], c, r) for i, (c, r) in enumerate(zip(completions, rewards))]


@torch.no_grad()
def evaluate(run: Run) -> dict:
    """Greedy decoding of the eval prompts: eval/reward is the mean weighted reward. Under torchrun each rank decodes
    1/N, the last prompts repeated to an equal share (the sharded models need every rank) and left out of the means."""
    args, models, prompts = run.args, run.models, run.prompts
    share = math.ceil(len(prompts.eval_rows) / world_size())
    mine = list(range(rank() * share, min((rank() + 1) * share, len(prompts.eval_rows))))
    padded = mine + [mine[-1] if mine else 0] * (share - len(mine))
    scores, lengths, eos = [], [], []
    step = args.num_prompts * args.num_generations // world_size()  # what a rollout samples on each rank
    for first in range(0, share, step):
        progress(f"evaluating: prompts {first + 1}-{min(first + step, share)} of {share}")
        inds = padded[first : first + step]
        with models.autocast():
            batch = generate(models, [prompts.eval_ids[i] for i in inds], args, greedy=True)
            scores.append(combine_rewards(score_responses(models, run.reward_fns, batch, [
                prompts.eval_rows[i] for i in inds], args), args.reward_weights))
        lengths.append(batch.attention_mask[:, batch.context_length :].sum(1).float())
        eos.append(batch.has_eos.float())
    progress("")
    return {key: gather_cat(torch.cat(values)[: len(mine)]).mean().item() for key, values in (
        ("eval/reward", scores), ("eval/response_length", lengths), ("eval/eos_rate", eos))}


class MetricsLog:
    """<output-dir>/metrics.jsonl (rank 0 writes), TensorBoard and W&B with --track; rows: every row so far (a resumed
    run's from the checkpoint's). No file is deleted or written before the first row, every check passed."""

    def __init__(self, args: Args, resumed_rows: Optional[list[dict]], replaced: list[Path]):
        self.args, self.path, self.writer, self.wandb = args, Path(args.output_dir) / "metrics.jsonl", None, None
        self.rows, self.resumed, self.replaced = list(resumed_rows or []), resumed_rows is not None, replaced

    def start(self) -> None:
        """At the first row: delete what this run replaces, write a resumed run's rows whole, open TensorBoard, W&B."""
        args, replaced, self.replaced = self.args, self.replaced, None
        if replaced and rank() == 0:
            print(f"deleting {', '.join(p.name for p in replaced)} in {args.output_dir}, "
                  + (f"which follow {Path(args.resume_from).name}" if args.resume_from else "replaced by --overwrite"))
            for path in replaced:
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        if self.resumed and rank() == 0:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(row) + "\n" for row in self.rows))
            tmp.replace(self.path)
        if args.track and rank() == 0:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(Path(args.output_dir) / "tb"))
            if args.wandb_project:
                import wandb
                self.wandb = wandb.init(project=args.wandb_project, config=asdict(args), dir=args.output_dir)

    def log(self, metrics: dict) -> None:
        if self.replaced is not None:
            self.start()
        self.rows.append(metrics)
        if rank() == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
        for key, value in metrics.items() if self.writer is not None else []:
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, metrics["iteration"])
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if k != "samples"}, step=metrics["iteration"])

    def close(self) -> None:
        """TensorBoard's events reach the file through a thread of its own, which the interpreter's exit would kill."""
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


# The console line of each iteration: (column, metric, format)
COLUMNS = [("reward", "objective/reward", ".3f"), ("kl", "objective/kl", ".3f"), ("ent", "policy/entropy", ".3f"),
           ("clip", "policy/clipfrac", ".3f"), ("len", "rollout/response_length", ".1f")]


PHASES: dict[str, float] = {}  # the seconds of each phase of the current iteration, logged as time/<phase>


@contextlib.contextmanager
def phase(name: str):
    """Times what runs inside as PHASES[name]; on a GPU once the work it queued has run, so that it is this phase's."""
    start = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    PHASES[name] = time.perf_counter() - start


def progress(text: str) -> None:
    """Say which phase runs now, on one line that the next one overwrites; only on a terminal (a log stays clean)."""
    if sys.stdout.isatty():
        print(f"\r\033[K{text}", end="" if text else "\r", flush=True)


def print_line(m: dict) -> None:
    progress("")
    columns = [f"{name} {m[key]:{spec}}" for name, key, spec in COLUMNS if m.get(key) is not None]
    evals = [f"eval {m['eval/reward']:.3f}"] if "eval/reward" in m else []
    seconds = m["time/rollout"] + m["time/update"]
    print(" | ".join([f"iter {m['iteration']:>4}", *columns, f"{seconds:.1f}s", *evals]), flush=True)


def run_summary(run: Run, stopped: bool) -> str:
    """The last line of a run: how far it got, the eval before and after, and where everything is."""
    state, output_dir, checkpoints = run.state, Path(run.args.output_dir), checkpoints_in(Path(run.args.output_dir))
    text = f"{'stopped' if stopped else 'done'}: iteration {state['iteration']} in {time.time() - run.start_time:.0f}s"
    if state["eval_before"] is not None:
        text += f"; eval/reward {state['eval_before']:.3f} -> {state['eval_after']:.3f}" + " (the last eval)" * stopped
    text += f"; metrics in {output_dir / 'metrics.jsonl'}; " + (f"last checkpoint {checkpoints[-1]}" if checkpoints
                                                                  else "no checkpoint")
    return text + ("" if stopped else f"; final policy in {output_dir / 'policy'}")


# The training doctor reads the metrics of the run so far for the usual signs of unstable RLHF training, on medians
# of DOCTOR_WINDOW iterations (one noisy batch triggers nothing), and names the knobs to turn.
DOCTOR_WINDOW = 5  # iterations each signal's median covers
DOCTOR_REPEAT = 10  # iterations before the same warning is printed again


def beta_knob(a: Args) -> str:
    return "raise --kl-coef" if a.kl_coef > 0 else "add a KL penalty (--kl-coef 0.04)"


NO_EOS = "--overlong-buffer-length (with --overlong-penalty: DAPO), --mask-truncated, or more --max-new-tokens"
# (signal, the metric of each row, the test of its window medians m (oldest first), the warning with value, threshold
# and knobs). GSPO's sequence ratio in its tiny clip range clips whole responses by design, CISPO clips weights, SAPO
# and VESPO nothing: the clip fraction is read for the token-level clip alone.
DOCTOR_SIGNALS = [
    ("kl_high", lambda row: row["objective/kl"] / max(row["rollout/response_length"], 1), lambda m, a: m[-1] > 0.3,
     lambda m, a: f"KL to the reference {m[-1]:.3f} per token > 0.3: {beta_knob(a)}"
                  + ("" if is_on_policy(a) else ", then lower --clip-eps")),
    ("reward_collapse", "objective/reward", lambda m, a: m[-1] <= 0 < max(m),
     lambda m, a: f"training reward fell to {m[-1]:.3f} <= 0 from {max(m):.3f}: check the reward, then "
                  f"{beta_knob(a)} in a new run (a resume keeps the flags)"),
    ("clipfrac_high", "policy/clipfrac",
     lambda m, a: m[-1] > 0.2 and a.policy_loss == "clip" and a.importance_level == "token",
     lambda m, a: f"clip fraction {m[-1]:.3f} > 0.2: raise --clip-eps, or lower --learning-rate or --num-minibatches"),
    ("entropy_collapse", "policy/entropy", lambda m, a: m[-1] < 0.01,
     lambda m, a: f"entropy {m[-1]:.4f} < 0.01 per token: raise --ent-coef or --temperature"
                  + ("" if is_on_policy(a) else ", or --clip-eps-high")),
    ("grad_norm_high", "grad/policy_norm", lambda m, a: m[-1] > 5.0,
     lambda m, a: f"policy gradient norm {m[-1]:.2f} > 5.0 before clipping: lower --learning-rate"),
    ("zero_std_groups", "rollout/zero_std_fraction", lambda m, a: m[-1] > 0.95 and a.baseline != "greedy",
     lambda m, a: f"{m[-1]:.2f} of groups have equal rewards (no reward advantage) > 0.95: prompts too easy or hard; "
                  + ("" if a.dynamic_sampling else "--dynamic-sampling, ") + "raise --num-generations"),
    ("length_collapse", "rollout/response_length", lambda m, a: m[-1] <= 1.5 < m[0],
     lambda m, a: f"response length {m[-1]:.2f} tokens <= 1.5: does the reward pay for empty answers? {beta_knob(a)}"),
    ("length_pinned", "rollout/response_length", lambda m, a: m[-1] >= 0.95 * a.max_new_tokens,
     lambda m, a: f"response length {m[-1]:.1f} >= 0.95 x --max-new-tokens {a.max_new_tokens}: {NO_EOS}"),
    ("eos_rate_falling", lambda row: 1 - row["rollout/truncated_fraction"], lambda m, a: m[-1] < m[0] - 0.2,
     lambda m, a: f"EOS rate {m[-1]:.2f} < {m[0]:.2f} at the start - 0.2: {NO_EOS}"),
]


def doctor_findings(history: list[dict], args: Args) -> dict[str, str]:
    """{signal: its warning} for each signal of DOCTOR_SIGNALS that the medians of every DOCTOR_WINDOW consecutive
    rows so far show now; row 0 (the eval before training) left out."""
    rows = [row for row in history if "objective/kl" in row]
    found = {}
    for signal_name, metric, shows, message in DOCTOR_SIGNALS:
        values = [v for v in (metric(row) if callable(metric) else row.get(metric) for row in rows) if v is not None]
        medians = [statistics.median(values[i - DOCTOR_WINDOW : i]) for i in range(DOCTOR_WINDOW, len(values) + 1)]
        if medians and shows(medians, args):
            found[signal_name] = message(medians, args) + f" (median of {DOCTOR_WINDOW} iterations)"
    return found


def doctor_check(rows: list[dict], metrics: dict, args: Args) -> dict:
    """Prints each warning doctor_findings gives for the rows so far and this one, at most once per DOCTOR_REPEAT
    iterations, and returns their counts as doctor/<signal>, read from the rows (a resumed run goes on counting)."""
    counted = {}
    for name, message in doctor_findings(rows + [metrics], args).items() if args.doctor == "warn" else []:
        warned = [row for row in rows if f"doctor/{name}" in row]
        if not warned or metrics["iteration"] - warned[-1]["iteration"] >= DOCTOR_REPEAT:
            counted[f"doctor/{name}"] = warned[-1][f"doctor/{name}"] + 1 if warned else 1
            print(f"doctor [{name}] {message}", flush=True)
    return counted


if __name__ == "__main__":
    main()
