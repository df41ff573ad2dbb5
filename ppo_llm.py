"""PPO for language models in one file: a policy, a frozen reference, a reward (model or function) and a critic.

One iteration (run_iteration), in the order Part 1 reads:
  1. rollout: sample a response to each prompt, mask what follows its first EOS, score it, and compute on the sampled
     tokens log pi_old, log pi_ref and the critic's values V(s_t);
  2. rewards: r_t = -beta * KL_t on every response token, plus the score on its last token;
  3. advantages: GAE over those rewards and values, whitened over the batch;
  4. update: --num-epochs passes over the batch, each in --num-minibatches optimizer steps on the clipped policy loss
     + c1 * the clipped value loss - c2 * the entropy, gradients accumulated over micro-batches.
The first --critic-warmup-iterations train the critic alone. Part 1 is that default path, read as if there were one
process and a plain log-softmax; each alternative (Part 2: the variants, where the default formulas' tables are too)
enters it at a line or a condition that names it, and each piece of machinery (Part 3, appendices A-G) is one call
whose name says what it returns.

With no flags it trains the tiny addition model in demo/ (beside this file), on CUDA if there is one, else the CPU.
On a real model:
    python ppo_llm.py --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct --prompts-path data.jsonl \
        --reward-fn last_number --chat-template --dtype bfloat16 --learning-rate 1e-6
Papers: PPO (Schulman et al. 2017, arXiv:1707.06347); GAE (Schulman et al. 2015, arXiv:1506.02438); KL-shaped rewards
and the adaptive KL controller (Ziegler et al. 2019, arXiv:1909.08593); InstructGPT and PPO-ptx (Ouyang et al. 2022,
arXiv:2203.02155); "The 37 implementation details of PPO" (Huang et al. 2022, ICLR blog track); the variants' papers
are named where Part 2 defines them.
"""

from __future__ import annotations

import ast
import contextlib
import csv
import importlib.util
import inspect
import json
import math
import operator
import os
import pickle
import pkgutil
import re
import runpy
import shutil
import signal
import statistics
import sys
import threading
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
import torch.distributed.checkpoint.state_dict as dcp_state
import torch.utils.checkpoint
import transformers
import tyro
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

DEMO = Path(__file__).resolve().parent / "demo"


# ---------------------------------------------------------------------------------------------------------------------
# Part 1: the algorithm
# ---------------------------------------------------------------------------------------------------------------------
# The knobs of the default path, one dataclass per group of --help; each line's comment is its help. Args (appendix A)
# joins them with the variants' knobs (Part 2) and the run's (appendix A), flat: the code reads args.kl_coef.


@dataclass
class RewardsAndAdvantages:
    """the per-token reward (Ziegler et al. 2019) and GAE (Schulman et al. 2015)"""

    kl_coef: float = 0.05  # beta in r_t = -beta * KL_t; 0.01-0.2
    gamma: float = 1.0  # discount; 1.0 for LLMs (a late token is worth as much as an early one)
    gae_lambda: float = 0.95  # GAE lambda: 0 = one-step TD error, 1 = Monte Carlo R - V(s_t); 0.9-0.95


@dataclass
class Losses:
    """the clipped policy loss, the clipped value loss and the entropy bonus (Schulman et al. 2017)"""

    clip_eps: float = 0.2  # PPO clip epsilon; 0.1-0.3, 0.2 is standard
    value_clip_eps: Optional[float] = 0.2  # value clipping around the rollout values (pessimistic max); None = off
    vf_coef: float = 0.5  # c1, the value loss's weight; a lone critic's Adam undoes it, but for --max-grad-norm
    ent_coef: float = 0.0  # c2, entropy bonus; 0 for LLMs, 0.01 in classic RL


@dataclass
class Optimisation:
    """iterations, batch sizes, the optimizers and the critic's warmup"""

    num_iterations: int = 40  # rollout -> update cycles
    num_prompts: int = 64  # prompts per iteration (batch = num_prompts * num_generations responses)
    num_epochs: int = 4  # K: passes over each batch; 1-4 for LLMs
    num_minibatches: int = 2  # optimizer steps per epoch; the batch is reshuffled every epoch
    micro_batch_size: int = 32  # sequences per forward pass but sampling's; gradients accumulate over a minibatch
    learning_rate: Optional[float] = None  # policy AdamW rate; None = by the policy's size (3e-4 for the demo)
    critic_learning_rate: Optional[float] = None  # critic AdamW rate; None = by the policy's size
    adam_eps: float = 1e-5  # AdamW epsilon (1e-5 is one of the 37 details)
    weight_decay: float = 0.0  # AdamW weight decay
    lr_warmup_iterations: int = 0  # linear warmup of each rate over its first iterations of training
    anneal_lr: bool = True  # linearly anneal the learning rates toward 0 (0 after the last iteration)
    max_grad_norm: float = 1.0  # global gradient-norm clip, separately for policy and critic
    critic_warmup_iterations: int = 0  # the first iterations train only the critic; the policy's schedule waits


@dataclass
class Generation:
    """how responses are sampled"""

    num_generations: int = 1  # responses sampled per prompt
    max_new_tokens: int = 16  # longest response in tokens; longer ones are cut (the demo's answers need 5)
    temperature: float = 1.0  # sampling temperature; log-probs use logits / temperature, as the sampler does
    top_p: float = 1.0  # nucleus sampling; 1.0 = off (log-probs ignore top-p/top-k/min-p, as most RLHF code)
    top_k: int = 0  # top-k sampling; 0 = off
    min_p: float = 0.0  # min-p sampling: drop tokens below min_p times the most likely one; 0 = off


# ---------------------------------------------------------------------------------------------------------------------
# The formulas: one pure function each, tensors in and tensors out. A tensor over response tokens is (B, T) and
# travels with its response_mask (1 up to and including the first EOS; with tools, on the model's own tokens alone);
# every mean over tokens is a masked mean.


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum(x * m) / sum(m), over all tokens (dim=None) or along dim."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the unmasked tokens of the whole batch (all_sum: every rank's part); masked ones are 0."""
    m = mask.to(x.dtype)
    count, total = all_sum(torch.stack([m.sum(), (x * m).sum()]))
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


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """KL_t, a per-token estimate of KL(pi_theta || pi_ref) on tokens pi_theta sampled: k1 = log pi_theta(y_t) -
    log pi_ref(y_t) by default, or another of KL_ESTIMATORS (Part 2)."""
    return pick(KL_ESTIMATORS, estimator, "KL estimator")(ref_logprobs - logprobs)


def kl_shaped_rewards(scores: torch.Tensor, kl: torch.Tensor, kl_coef: float,
                      response_mask: torch.Tensor) -> torch.Tensor:
    """r_t = -beta * KL_t on every response token, plus the score on the last one (Ziegler et al. 2019): the reward
    model judges the whole response, so its verdict lands where the response ends."""
    rewards = -kl_coef * kl * response_mask
    last = (response_mask * torch.arange(1, response_mask.shape[1] + 1, device=kl.device)).argmax(1)  # last real one
    rewards[torch.arange(len(scores)), last] += scores
    return rewards


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float,
                lam) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2015):  A_t = delta_t + gamma*lambda*A_{t+1},  delta_t = r_t + gamma*V(s_{t+1}) - V(s_t),
    with V = 0 after the last real token; lam is a float or a per-sequence (B,) tensor. Returns (advantages,
    returns = A + V), zero on masked tokens. With gamma = lambda = 1, A_t = R - V(s_t): the return minus the value.
    The recursion runs over the unmasked tokens alone: s_{t+1} is the next one, across a span of tool output."""
    mask = response_mask.to(values.dtype)
    rewards, values = rewards * mask, values * mask
    lam = torch.as_tensor(lam, dtype=values.dtype, device=values.device).expand(values.shape[0])
    advantages = torch.zeros_like(values)
    running, next_value = torch.zeros_like(values[:, 0]), torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        real = mask[:, t].bool()  # a masked token leaves A and the next value as they were
        running = torch.where(real, delta + gamma * lam * running, running)
        next_value = torch.where(real, values[:, t], next_value)
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def clipped_surrogate_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                           clip_eps: float, clip_eps_high: Optional[float] = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's per-token loss  max(-A*w, -A*clip(w, 1-eps, 1+eps_high)),  w = pi_theta / pi_old,  eps_high = eps unless
    Clip-Higher (Part 2) sets it. Returns (loss, ratio w, clipped: the tokens whose gradient the clip removed)."""
    ratio = torch.exp(logprobs - old_logprobs)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    return torch.maximum(unclipped, clipped_loss), ratio, clipped_loss > unclipped


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


def aggregate_loss(loss: torch.Tensor, response_mask: torch.Tensor, mode: str, num_tokens, num_seqs) -> torch.Tensor:
    """A per-token loss to a scalar: token-mean = the sum over the minibatch's tokens / num_tokens by default, or
    another of LOSS_AGGREGATIONS (Part 2). num_tokens and num_seqs count the whole minibatch, so that the
    micro-batches' terms add up to the minibatch's loss and gradient accumulation is exact."""
    return pick(LOSS_AGGREGATIONS, mode, "loss aggregation")(loss, response_mask.to(loss.dtype), num_tokens, num_seqs)


# ---------------------------------------------------------------------------------------------------------------------
# The rollout: 1. sample, 2. mask after EOS, 3. score, 4. the forward passes of pi_old, pi_ref and the critic


class PolicyOutput(NamedTuple):
    logprobs: torch.Tensor  # (B, T) log pi(y_t) of each response token, at the sampling temperature
    entropy: Optional[torch.Tensor]  # (B, T) entropy H_t of softmax(z / T) (before top-k/p, min-p), if asked for
    hidden: Optional[torch.Tensor]  # (B, T, d) the final hidden states that predict the y_t, for a shared critic


def policy_forward(model, batch: dict, rows, temperature: float, entropy: Optional[bool] = None,
                   hidden: bool = False) -> PolicyOutput:
    """A causal LM's forward pass over the rows' prompts and responses:
        log pi(y_t) = log_softmax(z_{t-1} / T)[y_t],   H_t = -sum_a pi(a) log pi(a),   z = model(prompt + response)
    where z_{t-1} are the logits at the position before response token y_t: the numbers of that plain form, without
    holding the (B, T, vocab) logits (appendix D). entropy: None = not computed, False = no gradient, True = with it."""
    states, head, hidden_states = response_states(model, batch["query_responses"][rows], batch["attention_mask"][rows],
                                                  batch["context_length"], hidden)
    return PolicyOutput(*logprobs_and_entropy(states, head, batch["responses"][rows], temperature, entropy),
                        hidden_states)


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
    """Left-padded prompts, each followed by a sampled (or greedy) response; what follows a response's first EOS is
    masked out and set to pad. With --max-tool-calls, a response of several turns and tool calls instead."""
    if args.max_tool_calls:
        return generate_with_tools(models, prompt_ids, args, greedy)
    input_ids, prompt_mask = left_pad(models.tokenizer, prompt_ids, models.device)
    responses = sample(models.policy, input_ids, prompt_mask, args.max_new_tokens, models.eos_token_ids, greedy,
                       args.temperature, args.top_p, args.top_k, args.min_p)
    response_mask, has_eos = response_mask_from_eos(responses, models.eos_token_ids)
    responses = responses.masked_fill(~response_mask, models.tokenizer.pad_token_id)
    return dict(query_responses=torch.cat([input_ids, responses], 1),
                attention_mask=torch.cat([prompt_mask, response_mask.long()], 1), context_length=input_ids.shape[1],
                responses=responses, response_mask=response_mask, has_eos=has_eos)


@torch.no_grad()
def generate_with_tools(models: Models, prompt_ids: list[list[int]], args: Args, greedy: bool) -> dict:
    """The multi-turn rollout of --max-tool-calls: generate a turn -> find its tool calls -> run them -> append their
    results (and the next turn's header) -> generate the next turn, until a turn ends without a call or calls once
    the --max-tool-calls are spent (calls past them within a turn get an error, counted as failed calls), or the
    response, tool output included, reaches --max-new-tokens (then no EOS: truncated). Each turn samples up to the
    largest budget left in the batch, each row cut to its own. Token ids are only appended, never decoded and
    re-tokenized. Tool output is context, not actions: tool_mask marks it, and response_mask leaves it out."""
    n, budget, eos = len(prompt_ids), args.max_new_tokens, models.eos_token_ids
    responses, from_tool = [[] for _ in range(n)], [[] for _ in range(n)]
    calls, failures, has_eos, active = [0] * n, [0] * n, [False] * n, list(range(n))
    with unsharded(models.policy):  # one gathering of the weights for every turn (each rank takes its own turns)
        while active:
            input_ids, mask = left_pad(models.tokenizer, [prompt_ids[i] + responses[i] for i in active], models.device)
            turns = sample(models.policy, input_ids, mask, budget - min(len(responses[i]) for i in active), eos,
                           greedy, args.temperature, args.top_p, args.top_k, args.min_p)
            kept, _ = response_mask_from_eos(turns, eos)
            going_on = []
            for i, turn, keep in zip(active, turns.tolist(), kept.tolist()):
                turn = [token for token, k in zip(turn, keep) if k][: budget - len(responses[i])]
                responses[i] += turn
                from_tool[i] += [False] * len(turn)
                has_eos[i] = turn[-1] in eos
                found = models.tools.calls_in(models.tokenizer.decode(turn), models.tokenizer) if has_eos[i] else []
                if not found or calls[i] >= args.max_tool_calls or len(responses[i]) >= budget:
                    continue  # the response ends here
                results = [models.tools.run(call) if calls[i] + k < args.max_tool_calls else
                           ToolResult(f"error: past --max-tool-calls {args.max_tool_calls}", True)
                           for k, call in enumerate(found)]
                output = tool_message_ids(models.tokenizer, results, args, turn[-1])[: budget - len(responses[i])]
                responses[i] += output
                from_tool[i] += [True] * len(output)
                has_eos[i] = False  # until a later turn ends with EOS
                calls[i] += len(results)
                failures[i] += sum(result.failed for result in results)
                if len(responses[i]) < budget:
                    going_on.append(i)
            active = going_on
    width, device = max(map(len, responses)), models.device
    input_ids, prompt_mask = left_pad(models.tokenizer, prompt_ids, device)
    pad = models.tokenizer.pad_token_id
    tool_mask = torch.tensor([t + [False] * (width - len(t)) for t in from_tool], device=device)
    attended = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in responses], device=device)
    responses = torch.tensor([r + [pad] * (width - len(r)) for r in responses], device=device)
    return dict(query_responses=torch.cat([input_ids, responses], 1), context_length=input_ids.shape[1],
                attention_mask=torch.cat([prompt_mask, attended.long()], 1), responses=responses,
                response_mask=attended & ~tool_mask, tool_mask=tool_mask, has_eos=torch.tensor(has_eos, device=device),
                tool_calls=torch.tensor(calls, device=device), tool_failures=torch.tensor(failures, device=device))


@torch.no_grad()
def forward_rollout(models: Models, batch: dict, args: Args) -> dict:
    """log pi_old, log pi_ref and V(s_t) on the sampled tokens, micro-batch by micro-batch, one model after the other
    (a shared critic's values come from the policy's pass)."""
    out = {"logprobs": [], "ref_logprobs": [], "values": []}
    with phase("old_logprobs"):
        for rows in micro_batches(len(batch["responses"]), args.micro_batch_size):
            policy = policy_forward(models.policy, batch, rows, args.temperature, hidden=args.shared_critic)
            out["logprobs"].append(policy.logprobs)
            if args.shared_critic:
                out["values"].append(critic_values(models, batch, rows, policy.hidden))
    with phase("reference"), models.reference() as ref_policy:
        for rows in micro_batches(len(batch["responses"]), args.micro_batch_size):
            out["ref_logprobs"].append(policy_forward(ref_policy, batch, rows, args.temperature).logprobs)
    if not args.shared_critic:
        with phase("values"):
            out["values"] = [critic_values(models, batch, rows)
                             for rows in micro_batches(len(batch["responses"]), args.micro_batch_size)]
    return {key: torch.cat(parts) for key, parts in out.items()}


def critic_values(models: Models, batch: dict, rows, policy_hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
    """V(s_t) for each response token t of the rows, s_t being the prompt and the response before token t: the
    critic's scalar head at the position before t (or, --shared-critic, its value head on the policy's hidden state)."""
    if models.value_head is not None:
        return models.value_head(policy_hidden.to(models.value_head.weight.dtype)).squeeze(-1).float()
    c = batch["context_length"]
    return scalar_forward(models.critic, batch["query_responses"][rows], batch["attention_mask"][rows])[:, c - 1 : -1]


# ---------------------------------------------------------------------------------------------------------------------
# Rewards and advantages


def shape_rewards(batch: dict, args: Args, kl_coef: float, state: dict) -> None:
    """The per-token rewards  r_t = -beta * KL_t,  plus the score on the last token."""
    batch["scores"] = shaped_scores(batch["raw_scores"], batch["has_eos"], args, state)  # Part 2; the raw ones here
    batch["kl"] = kl_penalty(batch["logprobs"], batch["ref_logprobs"], args.kl_estimator) * batch["response_mask"]
    batch["rewards"] = kl_shaped_rewards(batch["scores"], batch["kl"], kl_coef, batch["response_mask"])


def compute_advantages(batch: dict, args: Args) -> None:
    """GAE advantages for the policy and returns A + V for the critic, then the advantages whitened over the batch."""
    mask = batch["response_mask"]
    policy_lambda, critic_lambda = gae_lambdas(mask, args)  # --gae-lambda, and None; Part 2 decouples them
    advantages, returns = compute_gae(batch["rewards"], batch["values"], mask, args.gamma, policy_lambda)
    if critic_lambda is not None:
        _, returns = compute_gae(batch["rewards"], batch["values"], mask, args.gamma, critic_lambda)
    if args.advantage_whitening == "batch":  # or per minibatch (minibatch_step), or not at all
        advantages = masked_whiten(advantages, mask)
    batch["advantages"], batch["returns"] = advantages, returns


# ---------------------------------------------------------------------------------------------------------------------
# The update: K epochs x minibatches (one optimizer step each) x micro-batches (gradients accumulated)


def ppo_update(models: Models, optimizers: dict, batch: dict, args: Args, train_policy: bool,
               generator: torch.Generator, ptx: dict) -> dict:
    """K epochs over the batch, reshuffled each epoch into minibatches; returns the mean of the minibatches'
    statistics. With --target-kl (Part 2) the policy stops at the first minibatch that strayed too far from pi_old,
    and the critic trains on."""
    models.train()
    history, stopped_in = {}, None  # the epoch in which --target-kl stopped the policy
    for epoch in range(args.num_epochs):
        if epoch > 0 and args.recompute_advantages:  # Part 2: values from the critic as it is now
            batch["values"] = recompute_values(models, batch, args)
            compute_advantages(batch, args)
        batch_size = len(batch["responses"])  # this rank's part of the batch
        permutation = torch.randperm(batch_size, generator=generator).to(batch["responses"].device)
        for start in range(0, batch_size, args.minibatch_size):
            progress(f"updating: epoch {epoch + 1}/{args.num_epochs}, minibatch {start // args.minibatch_size + 1}/"
                     f"{math.ceil(batch_size / args.minibatch_size)}")
            stats = minibatch_step(models, optimizers, batch, permutation[start : start + args.minibatch_size], args,
                                   train_policy and stopped_in is None, ptx)
            if stats.pop("early_stop") and stopped_in is None:
                stopped_in = epoch
            for key, value in stats.items():
                history.setdefault(key, []).append(value)
    models.eval()
    summary = {key: sum(v) / len(v) for key, v in history.items()}
    summary["policy/early_stopped"] = float(stopped_in is not None)
    summary["policy/epochs_completed"] = float(args.num_epochs if stopped_in is None else stopped_in)
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
    return {**stats, **optimizer_step(models, optimizers, args, train_policy, stats["policy/approx_kl"])}


def micro_batch_backward(models: Models, batch: dict, inds: torch.Tensor, advantages: torch.Tensor, num_tokens,
                         num_seqs, args: Args, train_policy: bool, ptx: dict) -> dict:
    """Forward one micro-batch, and backward its part of the minibatch loss
        L = L_clip - c2 * H + c1 * L_V    (with the policy frozen: c1 * L_V alone).
    Returns its parts of the minibatch's statistics: losses, and token statistics over the minibatch's tokens."""
    mask, old_logprobs = batch["response_mask"][inds], batch["logprobs"][inds]
    with models.autocast():
        with torch.set_grad_enabled(train_policy or args.shared_critic):  # a shared critic backpropagates into it
            policy = policy_forward(models.policy, batch, inds, args.temperature, hidden=args.shared_critic,
                                    entropy=train_policy and args.ent_coef != 0)  # with a gradient if trained on
        values = critic_values(models, batch, inds, policy.hidden)
        ptx_lm_loss = ptx_loss(models, ptx, len(inds)) * len(inds) / num_seqs if ptx and train_policy else None
    pg_tokens, ratio, clipped = clipped_surrogate_loss(policy.logprobs, old_logprobs, advantages, args.clip_eps,
                                                       args.clip_eps_high)
    if args.dual_clip is not None:  # Part 2
        pg_tokens, clipped = dual_clip(pg_tokens, clipped, advantages, args.dual_clip)
    vf_tokens, vf_clipped = clipped_value_loss(values, batch["values"][inds], batch["returns"][inds],
                                               args.value_clip_eps)
    pg_loss, entropy_bonus, vf_loss = (aggregate_loss(x, mask, args.loss_aggregation, num_tokens, num_seqs)
                                       for x in (pg_tokens, policy.entropy, vf_tokens))
    loss = args.vf_coef * vf_loss
    if train_policy:
        loss = loss + pg_loss - args.ent_coef * entropy_bonus
    if ptx_lm_loss is not None:  # Part 2: PPO-ptx
        loss = loss + args.ptx_coef * ptx_lm_loss
    backward(loss)
    # approx KL(pi_old || pi_theta): k3 with the roles swapped, since the tokens were sampled by pi_old
    approx_kl = kl_penalty(old_logprobs, policy.logprobs.detach(), "k3")
    stats = {"losses/policy_loss": pg_loss.detach(), "losses/value_loss": vf_loss.detach()}
    if ptx_lm_loss is not None:
        stats["losses/ptx_loss"] = ptx_lm_loss.detach()
    for key, x in (("policy/approx_kl", approx_kl), ("policy/clipfrac", clipped), ("policy/ratio", ratio.detach()),
                   ("policy/entropy", policy.entropy.detach()), ("val/clipfrac", vf_clipped)):
        stats[key] = (x * mask).sum() / num_tokens
    return stats


def optimizer_step(models: Models, optimizers: dict, args: Args, train_policy: bool, minibatch_kl: float) -> dict:
    """Clip each network's gradient norm and step. The policy skips a minibatch that strayed past --target-kl (the
    check comes before the step, as in Spinning Up), and says so; the critic steps on it."""
    stats = {}
    early_stop = train_policy and args.target_kl is not None and minibatch_kl > args.target_kl
    if train_policy and not early_stop:
        stats["grad/policy_norm"] = clip_grad_norm(models.policy.parameters(), args.max_grad_norm, "policy")
        optimizers["policy"].step()
    if args.shared_critic:
        average_gradients(models.value_head)  # under torchrun: a plain module, whose gradients FSDP does not see
    stats["grad/critic_norm"] = clip_grad_norm(models.critic_parameters(), args.max_grad_norm, "critic")
    optimizers["critic"].step()
    for optimizer in optimizers.values():
        optimizer.zero_grad(set_to_none=True)
    models.policy.zero_grad(set_to_none=True)  # a frozen policy still gets a shared critic's gradient
    return {**stats, "early_stop": early_stop}


# ---------------------------------------------------------------------------------------------------------------------
# The training loop


def run_iteration(run: Run, train_policy: bool, step: int) -> dict:
    """One iteration on the prompts of `step` in the data order: rollout -> rewards -> advantages -> update. Returns
    its metrics."""
    models, state = run.models, run.state
    args = replace(run.args, ent_coef=state["ent_coef"])  # the coefficient in use: --entropy-target moves it
    phase_times.clear()
    with phase("iteration"):
        with phase("rollout"):
            rows, prompt_ids = prompts_of_step(run.prompts, step, args)  # this rank's share of them
            batch = rollout(models, run.reward, rows, prompt_ids, args)
        shape_rewards(batch, args, state["kl_coef"], state)
        compute_advantages(batch, args)
        metrics = rollout_metrics(batch, state["kl_coef"])
        generator = run.generator(step)  # the minibatches' order (and PPO-ptx's texts)
        ptx = dict(ids=run.prompts.ptx_ids, generator=generator) if args.ptx_coef > 0 else {}
        with phase("update"):
            metrics.update(ppo_update(models, run.optimizers, batch, args, train_policy, generator, ptx))
    metrics.update({f"time/{name}": seconds for name, seconds in phase_times.items()})
    metrics["train/ent_coef"] = args.ent_coef
    metrics["samples"] = samples_to_show(models, batch, batch["raw_scores"])
    return metrics


def train(args: Args) -> dict:
    """The run: --num-iterations iterations, each followed by its eval (every --eval-every), its console line and
    metrics row, the doctor's warnings and its checkpoint (every --save-every). Returns the eval reward before and
    after training."""
    with start_run(args) as run:  # appendix F: checks, data, models, optimizers, or a checkpoint's; Ctrl-C is caught
        args, state = run.args, run.state
        pretrain_values(run)  # Part 2: VC-PPO's value pretraining, with --value-pretrain-steps
        if state["iteration"] == 0 and args.eval_every > 0:
            run.report(dict(iteration=0, **evaluate(run)))  # row 0: the eval before the first update
        print(LEGEND, flush=True)  # what the columns of each iteration's line mean
        while state["iteration"] < args.num_iterations:
            iteration = state["iteration"]
            train_policy = iteration >= args.critic_warmup_iterations  # critic warmup: the policy is frozen
            set_learning_rates(run, iteration)
            metrics = run_iteration(run, train_policy, step=args.value_pretrain_steps + iteration)
            metrics.update({"iteration": iteration + 1, "episodes": (iteration + 1) * args.batch_size,
                            "lr": run.optimizers["policy"].param_groups[0]["lr"],
                            "train/policy_frozen": float(not train_policy)})
            state["iteration"] = iteration + 1
            state["kl_coef"] = pick(KL_SCHEDULES, args.kl_schedule, "KL schedule")(args, state, metrics["objective/kl"])
            after_update(run, metrics)  # Part 2: adaptive entropy control and the reference's soft update, if asked
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


def set_learning_rates(run: Run, iteration: int) -> None:
    """Each optimizer's rate for this iteration: its base rate, warmed up linearly over its first
    --lr-warmup-iterations of training and annealed linearly to 0 after the last (--anneal-lr). The policy's schedule
    starts after the critic warmup, when the policy starts training."""
    args = run.args
    for name, optimizer in run.optimizers.items():
        start = args.critic_warmup_iterations if name == "policy" else 0
        lr = learning_rate_at(max(iteration - start, 0), max(args.num_iterations - start, 1), run.learning_rates[name],
                              args.lr_warmup_iterations, args.anneal_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr


def learning_rate_at(iteration: int, num_iterations: int, base_lr: float, warmup: int, anneal: bool) -> float:
    """The base rate times a linear warmup over the first `warmup` iterations and, with anneal, times a linear decay
    from 1 at the first iteration to 0 after the last."""
    lr = base_lr * min(1.0, (iteration + 1) / warmup) if warmup > 0 else base_lr
    return lr * (1.0 - iteration / num_iterations) if anneal else lr


# ---------------------------------------------------------------------------------------------------------------------
# Part 2: the variants
# ---------------------------------------------------------------------------------------------------------------------
# Every alternative to a formula of Part 1, each with its knobs (a group of --help), its paper, and one pure function
# or table entry. Part 1 names each where it plugs in; with its knobs at their defaults each one is the identity.


def pick(table: dict, name: str, what: str) -> Callable:
    """table[name], the function a knob names; an unknown name is an error, never a fall-through to a default."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}: expected one of {', '.join(table)}")
    return table[name]


@dataclass
class KLVariants:
    """the KL estimator, and beta's schedule (Ziegler et al. 2019)"""

    kl_estimator: Literal["k1", "k2", "k3"] = "k1"  # k1 = log(p/q), k2 = (log(p/q))^2 / 2, k3 = q/p - 1 - log(q/p)
    kl_schedule: Literal["fixed", "linear", "adaptive"] = "fixed"  # fixed; linear to --kl-coef-final; or adaptive
    kl_coef_final: float = 0.1  # beta at the last iteration with --kl-schedule linear
    kl_target: float = 0.1  # the per-response KL that --kl-schedule adaptive steers towards
    kl_horizon: int = 10000  # adaptive horizon in responses: larger = slower beta changes (Ziegler et al.: 10000)


# Per-token estimates of KL(pi_theta || pi_ref) from tokens y sampled by pi_theta, as functions of
# log r = log pi_ref(y) - log pi_theta(y) (Schulman 2020, "Approximating KL divergence"): k1 is unbiased but negative
# on some tokens, k2 biased with low variance, k3 unbiased and never negative. In a reward, whose policy gradient
# treats it as a constant, only k1 gives the KL's own gradient; k2 and k3 estimate its value.
KL_ESTIMATORS = {
    "k1": lambda log_r: -log_r,
    "k2": lambda log_r: 0.5 * log_r**2,
    "k3": lambda log_r: torch.expm1(log_r) - log_r,
}


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


@dataclass
class ScoreShaping:
    """the score before it enters the reward: a penalty for a missing EOS, running whitening, clipping"""

    missing_eos_penalty: float = 0.0  # subtracted from the score of a response that ends without EOS (e.g. 1.0)
    whiten_rewards: bool = False  # normalise scores with a running mean/std over all iterations so far
    reward_clip: Optional[float] = None  # clip scores to [-c, c] after whitening; None = off (e.g. 5)


def shaped_scores(raw_scores: torch.Tensor, has_eos: torch.Tensor, args: Args, state: dict) -> torch.Tensor:
    """The score that enters the reward: the raw one, minus --missing-eos-penalty without EOS, then (--whiten-rewards)
    whitened with the running moments of every batch so far (kept in state, and so in checkpoints), then clipped to
    [-c, c] (--reward-clip)."""
    scores = raw_scores - args.missing_eos_penalty * (~has_eos).float()
    if args.whiten_rewards:
        state["reward_mean"], state["reward_var"], state["reward_count"] = update_running_moments(
            state["reward_mean"], state["reward_var"], state["reward_count"], gather_cat(scores))  # the whole batch
        scores = (scores - state["reward_mean"]) / math.sqrt(state["reward_var"] + 1e-8)
    if args.reward_clip is not None:
        scores = scores.clamp(-args.reward_clip, args.reward_clip)
    return scores


def update_running_moments(mean: float, var: float, count: int, batch: torch.Tensor) -> tuple[float, float, int]:
    """Merge a batch into a running mean and variance (Chan et al. 1979's parallel algorithm)."""
    batch = batch.double()
    n, batch_mean, batch_var = batch.numel(), batch.mean().item(), batch.var(unbiased=False).item()
    total = count + n
    delta = batch_mean - mean
    new_mean = mean + delta * n / total
    new_var = (var * count + batch_var * n + delta**2 * count * n / total) / total
    return new_mean, new_var, total


@dataclass
class AdvantageVariants:
    """the critic's own GAE lambda (VC-PPO), a length-adaptive one (VAPO), recomputed advantages, where to whiten"""

    critic_gae_lambda: Optional[float] = None  # lambda of the critic's returns; None = --gae-lambda (VC-PPO: 1.0)
    length_adaptive_alpha: Optional[float] = None  # VAPO: lambda = 1 - 1/(alpha * length); None = off (VAPO: 0.05)
    recompute_advantages: bool = False  # each epoch, values and advantages again from the updated critic
    advantage_whitening: Literal["batch", "minibatch", "none"] = "batch"  # mean 0, std 1 over the batch, or ...


def gae_lambdas(response_mask: torch.Tensor, args: Args):
    """(the policy's lambda, the critic's, or None where the critic's returns are the policy's GAE's). VC-PPO (Yuan et
    al. 2025, arXiv:2503.01491) decouples them: the critic learns from lambda = 1 returns, unbiased, while the policy's
    advantages keep a lower-variance lambda < 1. VAPO (Yue et al. 2025, arXiv:2504.05118) gives each response the
    lambda of its length (length_adaptive_lambda)."""
    critic_lambda = args.gae_lambda if args.critic_gae_lambda is None else args.critic_gae_lambda
    if args.length_adaptive_alpha is not None:
        return length_adaptive_lambda(response_mask.sum(1), args.length_adaptive_alpha), critic_lambda
    return args.gae_lambda, None if critic_lambda == args.gae_lambda else critic_lambda


def length_adaptive_lambda(response_lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO (Yue et al. 2025): lambda = 1 - 1 / (alpha * l) per sequence, so that longer responses look further ahead
    (floored at 0)."""
    return (1.0 - 1.0 / (alpha * response_lengths.float().clamp(min=1))).clamp(min=0.0)


@torch.no_grad()
def recompute_values(models: Models, batch: dict, args: Args) -> torch.Tensor:
    """V(s_t) under the critic as it is now, for --recompute-advantages: each epoch after the first recomputes the
    advantages and returns from them, and value clipping then centres on them."""
    values = []
    with models.autocast():
        for rows in micro_batches(len(batch["responses"]), args.micro_batch_size):
            hidden = policy_forward(models.policy, batch, rows, args.temperature, hidden=True).hidden \
                if args.shared_critic else None
            values.append(critic_values(models, batch, rows, hidden))
    return torch.cat(values)


@dataclass
class LossVariants:
    """Clip-Higher, Dual-Clip, the loss aggregation and the target-KL early stop"""

    clip_eps_high: Optional[float] = None  # upper clip epsilon (DAPO's Clip-Higher, e.g. 0.28); None = --clip-eps
    dual_clip: Optional[float] = None  # Dual-Clip c (about 3): for A < 0 the loss is at most -c*A; None = off
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"  # over tokens, or per sequence first
    target_kl: Optional[float] = None  # the policy stops updating once a minibatch's approx KL exceeds it; None = off


def dual_clip(loss: torch.Tensor, clipped: torch.Tensor, advantages: torch.Tensor, c: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-Clip (Ye et al. 2020, arXiv:1912.09729): for A < 0 the clipped loss is capped at -c*A, so that a token
    whose ratio has run far past 1 + eps (c > 1 + eps_high) cannot push with an unbounded weight. Returns (loss,
    clipped), the capped tokens counted as clipped. Clip-Higher (DAPO, Yu et al. 2025, arXiv:2503.14476) is
    clipped_surrogate_loss's eps_high."""
    cap = -c * advantages
    dual = (advantages < 0) & (loss > cap)
    return torch.where(dual, cap, loss), clipped | dual


# A per-token loss l (B, T) and its mask m (float) to a scalar, num_tokens and num_seqs being the whole minibatch's.
LOSS_AGGREGATIONS = {
    "token-mean": lambda l, m, num_tokens, num_seqs: (l * m).sum() / num_tokens,
    "seq-mean-token-mean": lambda l, m, num_tokens, num_seqs: ((l * m).sum(1) / m.sum(1).clamp(min=1)).sum() / num_seqs,
}


@dataclass
class CriticVariants:
    """the critic's initialisation, a value head on the policy instead, and value pretraining (VC-PPO)"""

    critic_init: Literal["policy", "reward"] = "policy"  # the policy with a fresh value head, or the reward model
    shared_critic: bool = False  # a value head on the policy's backbone, trained with --vf-coef in the policy's loss
    value_pretrain_steps: int = 0  # VC-PPO: before RL, this many rollouts train the critic on Monte Carlo returns


def pretrain_values(run: Run) -> None:
    """VC-PPO's value pretraining (Yuan et al. 2025): before the first update, --value-pretrain-steps rollouts (the
    first steps of the data order) train the critic alone on Monte Carlo returns (lambda = 1), so that GAE starts
    from values that mean something rather than from a fresh head."""
    if run.state["iteration"] > 0:
        return
    monte_carlo = replace(run, args=replace(run.args, critic_gae_lambda=1.0))
    for step in range(run.args.value_pretrain_steps):
        run.stop_if_asked(saved=False)
        metrics = run_iteration(monte_carlo, train_policy=False, step=step)
        progress("")
        print(f"value pretraining {step + 1}/{run.args.value_pretrain_steps} | value loss "
              f"{metrics['losses/value_loss']:.4f} | ev {metrics['val/explained_variance']:.2f}")
    run.stop_if_asked(saved=True)


@dataclass
class PretrainingMix:
    """PPO-ptx: a language-modelling loss on pretraining text mixed into the policy's (Ouyang et al. 2022)"""

    ptx_coef: float = 0.0  # the weight of the pretraining LM loss in the policy loss (InstructGPT); 0 = off
    ptx_path: Optional[str] = None  # a plain-text file, one document per line


def ptx_loss(models: Models, ptx: dict, count: int) -> torch.Tensor:
    """PPO-ptx (Ouyang et al. 2022): the policy's mean next-token cross-entropy  -mean_t log pi(x_t | x_<t)  on
    `count` random pretraining texts, through the rollout's log-probs (never the whole logits at once)."""
    picked = torch.randint(len(ptx["ids"]), (count,), generator=ptx["generator"]).tolist()
    input_ids, attention_mask = left_pad(models.tokenizer, [ptx["ids"][i] for i in picked], models.device)
    texts = dict(query_responses=input_ids, attention_mask=attention_mask, context_length=1,
                 responses=input_ids[:, 1:])  # each position predicts the next token
    logprobs = policy_forward(models.policy, texts, slice(None), temperature=1.0).logprobs
    return -masked_mean(logprobs, attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool())  # a pad precedes none


@dataclass
class ReferenceAndEntropy:
    """a reference that follows the policy (TR-DPO) and an entropy coefficient that follows a target (Skywork-OR1)"""

    ref_sync_every: int = 0  # TR-DPO: every this many iterations pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref
    ref_sync_alpha: float = 0.6  # with --ref-sync-every: alpha, the policy's share of the mix (1 = copy the policy)
    entropy_target: Optional[float] = None  # the entropy coefficient rises by --ent-coef-delta while below this
    ent_coef_delta: float = 0.005  # with --entropy-target: the coefficient's step per iteration
    ent_coef_min: float = 0.0  # with --entropy-target: the coefficient's lower bound
    ent_coef_max: float = 1.0  # with --entropy-target: the coefficient's upper bound


def after_update(run: Run, metrics: dict) -> None:
    """What follows each update when asked: the entropy coefficient's step toward --entropy-target, and every
    --ref-sync-every iterations the reference's step toward the policy. Both are in the checkpoints."""
    args, state = run.args, run.state
    if args.entropy_target is not None:
        state["ent_coef"] = entropy_coefficient(state["ent_coef"], metrics["policy/entropy"], args.entropy_target,
                                                args.ent_coef_delta, args.ent_coef_min, args.ent_coef_max)
    if args.ref_sync_every and state["iteration"] % args.ref_sync_every == 0:
        sync_reference(run.models.ref_policy, run.models.policy, args.ref_sync_alpha)


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


# ---------------------------------------------------------------------------------------------------------------------
# Part 3: the machinery
# ---------------------------------------------------------------------------------------------------------------------
# Appendix A. Arguments: the run's knobs, Args, --help's groups, every knob's range, the checks, the derived values.
# Part 1 reaches it through Args and start_run (appendix F), which checks the flags before anything loads.


@dataclass
class PolicyAndReward:
    """the policy (also the frozen reference), the reward, and LoRA"""

    model_name_or_path: str = str(DEMO / "model")  # the policy and reference: a local directory or a Hub name
    reward_model_path: Optional[str] = None  # a sequence classifier with one label, read at the last real token
    reward_fn: Optional[str] = None  # else exact_match (default), last_number, module:function or file.py:function
    lora_r: int = 0  # LoRA rank: policy and critic train adapters (peft), the reference is without them; 0 = off
    lora_alpha: float = 16.0  # LoRA scale: the adapters add alpha/r * B A to each target weight
    lora_dropout: float = 0.0  # dropout on the adapters' input in the update; 0 keeps its log-probs the sampler's
    lora_target_modules: Optional[list[str]] = None  # e.g. q_proj v_proj; None = every linear layer but the heads


@dataclass
class Data:
    """prompts to train and evaluate on"""

    prompts_path: str = str(DEMO / "train.jsonl")  # .jsonl; or, through datasets, .json, .parquet, .csv or a dataset
    eval_prompts_path: str = str(DEMO / "eval.jsonl")  # prompts greedy-decoded for eval/reward, in the same forms
    prompt_field: str = "prompt"  # the rows' prompt field (gsm8k: question); the others reach the reward function
    answer_field: str = "answer"  # the field exact_match and last_number compare with, given to them as 'answer'
    dataset_split: str = "train"  # split of a Hugging Face dataset named by --prompts-path
    eval_dataset_split: str = "test"  # split of a Hugging Face dataset named by --eval-prompts-path
    dataset_config: Optional[str] = None  # configuration of a Hugging Face dataset (gsm8k: main); None = its default
    chat_template: bool = False  # wrap each prompt as a user turn with the tokenizer's chat template
    max_prompt_length: int = 256  # longer prompts lose their first tokens (a warning counts them)


@dataclass
class Tools:
    """tools the policy may call between its turns: the multi-turn rollout (appendix B)"""

    tools: tuple[str, ...] = ()  # calculator (built in), module:function or file.py:function
    max_tool_calls: int = 0  # tool calls per response, each result appended before the model goes on; 0 = one turn
    max_tool_output_tokens: int = 128  # each tool's output is cut to this many tokens
    tool_timeout: float = 10.0  # seconds a tool may run; past them its call fails, and the model is told


@dataclass
class Experiment:
    """where the run writes, how often it evaluates and saves, what it reports"""

    output_dir: str = "runs/ppo"  # metrics.jsonl, checkpoints and the final policy; an earlier run needs --overwrite
    overwrite: bool = False  # delete an earlier run in --output-dir, once the flags are checked and the models load
    seed: int = 1  # random seed; the same seed gives the same metrics on CPU
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype (autocast); the trained weights stay float32
    gradient_checkpointing: bool = False  # trade compute for memory in the policy and critic forward passes
    fsdp: bool = False  # under torchrun: shard weights, gradients and optimizer states with FSDP2 (else replicate)
    track: bool = False  # also write TensorBoard logs to <output-dir>/tb (needs the tensorboard package)
    wandb_project: Optional[str] = None  # with --track, also log to this Weights & Biases project (needs wandb)
    eval_every: int = 5  # greedy-decode the eval prompts every this many iterations and before the first; 0 = never
    sample_every: int = 10  # print a few sampled completions every this many iterations; 0 = never
    save_every: int = 20  # write <output-dir>/checkpoint-N every this many iterations; 0 = none unless interrupted
    save_total_limit: Optional[int] = None  # keep only the newest this many checkpoints; None = keep all
    resume_from: Optional[str] = None  # a checkpoint-N to go on from; training flags must match (iterations may grow)
    doctor: Literal["warn", "off"] = "warn"  # watch the metrics for instability, and name the knob to turn


# --help shows one group per section, in this order
SECTIONS = dict(rewards_and_advantages=RewardsAndAdvantages, losses=Losses, optimisation=Optimisation,
                generation=Generation, kl_variants=KLVariants, score_shaping=ScoreShaping,
                advantage_variants=AdvantageVariants, loss_variants=LossVariants, critic_variants=CriticVariants,
                pretraining_mix=PretrainingMix, reference_and_entropy=ReferenceAndEntropy,
                policy_and_reward=PolicyAndReward, data=Data, tools=Tools, experiment=Experiment)


@dataclass
class Args(Experiment, Tools, Data, PolicyAndReward, ReferenceAndEntropy, PretrainingMix, CriticVariants, LossVariants,
           AdvantageVariants, ScoreShaping, KLVariants, Generation, Optimisation, Losses, RewardsAndAdvantages):
    """Every knob, flat. The last two are not flags: derived_args computes them from the flags."""

    batch_size: tyro.conf.Suppress[int] = 0  # responses per iteration: num_prompts * num_generations
    minibatch_size: tyro.conf.Suppress[int] = 0  # responses per optimizer step on each rank


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
    "lora_dropout": "[0, 1)", "max_tool_calls": "[0, inf)", "max_tool_output_tokens": "(0, inf)",
    "tool_timeout": "(0, inf)",
}

# A flag set to anything but its default while this condition is false would do nothing: an error, not a silent no-op
# (for the flags listed here).
ONLY_WITH = [
    ("wandb_project", "does nothing without --track", lambda a: a.track),
    ("ptx_path", "does nothing without --ptx-coef > 0", lambda a: a.ptx_coef > 0),
    ("reward_fn", "does nothing with --reward-model-path, which gives the reward",
     lambda a: a.reward_model_path is None),
    ("kl_coef_final", "does nothing without --kl-schedule linear", lambda a: a.kl_schedule == "linear"),
    *((name, "does nothing without --kl-schedule adaptive", lambda a: a.kl_schedule == "adaptive")
      for name in ("kl_target", "kl_horizon")),
    *((name, "does nothing without --entropy-target", lambda a: a.entropy_target is not None)
      for name in ("ent_coef_delta", "ent_coef_min", "ent_coef_max")),
    ("ref_sync_every", "does nothing with --kl-coef 0 (the reference only enters through the KL)",
     lambda a: a.kl_coef > 0),
    ("ref_sync_alpha", "does nothing without --ref-sync-every", lambda a: a.ref_sync_every > 0),
    ("save_total_limit", "does nothing with --save-every 0", lambda a: a.save_every > 0),
    ("dataset_split", "does nothing unless --prompts-path names a Hugging Face dataset",
     lambda a: is_dataset_name(a.prompts_path)),
    ("eval_dataset_split", "does nothing unless --eval-prompts-path names a Hugging Face dataset",
     lambda a: is_dataset_name(a.eval_prompts_path)),
    ("dataset_config", "does nothing unless --prompts-path or --eval-prompts-path names a Hugging Face dataset",
     lambda a: is_dataset_name(a.prompts_path) or is_dataset_name(a.eval_prompts_path)),
    ("fsdp", "does nothing in one process (launch with torchrun --nproc_per_node N)", lambda a: launched_ranks() > 1),
    *((name, "does nothing with --lora-r 0", lambda a: a.lora_r > 0)
      for name in ("lora_alpha", "lora_dropout", "lora_target_modules")),
    *((name, "does nothing with --max-tool-calls 0", lambda a: a.max_tool_calls > 0)
      for name in ("tools", "max_tool_output_tokens", "tool_timeout")),
]

# What --resume-from accepts differently from the run that wrote the checkpoint: the memory and speed knobs, which give
# the same gradients up to rounding (but for PPO-ptx's texts, drawn per micro-batch), the output and logging knobs, and
# --num-iterations, whose growth stretches the annealed learning rates and the linear beta schedule.
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
    ranks = launched_ranks()  # each rank samples and trains on its 1/N of the batch
    exact_div(args.num_prompts, ranks, f"--num-prompts (the whole batch's prompts) must split over the {ranks} "
              "torchrun ranks")
    minibatch = exact_div(args.num_prompts * args.num_generations // ranks, args.num_minibatches, "--num-prompts x "
                          f"--num-generations (the batch{' of each rank' if ranks > 1 else ''}) must split into "
                          "--num-minibatches")
    exact_div(minibatch, min(args.micro_batch_size, minibatch), "the minibatch (batch / --num-minibatches) must split "
              "into --micro-batch-size")
    check_combinations(args)
    for option, wanted, package in (("--track", args.track, "tensorboard"), ("--lora-r", args.lora_r, "peft"),
                                    ("--wandb-project", args.wandb_project, "wandb")):
        if wanted and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{option} needs the {package} package: pip install {package}")
    for path, flag in ((args.model_name_or_path, "--model-name-or-path"),
                       (args.reward_model_path, "--reward-model-path")):
        looks_local = path and (path.startswith((".", "/", "~")) or path.count("/") > 1)  # else a Hub name
        if looks_local and not os.path.isdir(os.path.expanduser(path)):
            raise ConfigError(f"{flag} {path}: no such directory")


def check_combinations(args: Args) -> None:
    """The flags that cannot work together."""
    high = args.clip_eps if args.clip_eps_high is None else args.clip_eps_high
    if args.dual_clip is not None and args.dual_clip <= 1 + high:
        raise ConfigError(f"--dual-clip {args.dual_clip} must exceed 1 + the upper clip epsilon ({1 + high:g}): a "
                          "lower cap would act inside the clip range")
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
    if args.max_tool_calls and not args.tools:
        raise ConfigError("--max-tool-calls needs --tools: name the tools the policy may call (calculator is built in)")
    if args.lora_r and launched_ranks() > 1:  # FSDP2's units would have to be placed around peft's
        raise ConfigError("--lora-r under torchrun is not supported yet: train LoRA adapters in one process")
    if args.ref_sync_every and args.lora_r:
        raise ConfigError("--ref-sync-every with --lora-r: the reference is the policy with its adapters off, which "
                          "cannot be mixed toward the policy apart from it")
    if args.entropy_target is not None and not args.ent_coef_min <= args.ent_coef <= args.ent_coef_max:
        raise ConfigError(f"--ent-coef {args.ent_coef} must lie in [--ent-coef-min {args.ent_coef_min}, "
                          f"--ent-coef-max {args.ent_coef_max}]: it is where adaptive entropy control starts")
    if not args.prompt_field or not args.answer_field or args.prompt_field == args.answer_field:
        raise ConfigError(f"--prompt-field {args.prompt_field!r} and --answer-field {args.answer_field!r} must be two "
                          "different, non-empty field names")


def derived_args(args: Args) -> Args:
    """The flags with the values derived from them: batch and minibatch sizes, the micro-batch capped at the
    minibatch, exact_match as the reward when neither a reward model nor a function is named, and the output and
    resume paths made absolute (a reward function may change the working directory)."""
    batch_size = args.num_prompts * args.num_generations
    minibatch_size = batch_size // launched_ranks() // args.num_minibatches
    reward_fn = "exact_match" if args.reward_fn is None and not args.reward_model_path else args.reward_fn
    return replace(args, batch_size=batch_size, minibatch_size=minibatch_size, reward_fn=reward_fn,
                   micro_batch_size=min(args.micro_batch_size, minibatch_size),
                   output_dir=os.path.abspath(args.output_dir),
                   resume_from=args.resume_from and os.path.abspath(args.resume_from))


def default_learning_rates(num_params: int) -> tuple[float, float]:
    """(policy, critic) learning rates when the flags give none, by the policy's parameter count: RL steps are about
    ten times smaller than fine-tuning's, which shrink as models grow; the critic, its head new, learns faster."""
    for limit, rates in ((10e6, (3e-4, 1e-3)), (300e6, (1e-5, 1e-4)), (3e9, (3e-6, 1e-5))):
        if num_params < limit:
            return rates
    return 1e-6, 5e-6


# ---------------------------------------------------------------------------------------------------------------------
# Appendix B. Data, rewards and tools: prompt files and datasets, tokenization, the reward functions, the reward model,
# the tools. Part 1 reaches it through prompts_of_step, left_pad, score_responses, the Toolbox in models.tools (its
# calls_in and run), ToolResult and tool_message_ids.


class PromptFile(NamedTuple):
    """The rows of a prompts file, and their line (or row) numbers, for errors that name them."""
    flag: str
    path: str
    rows: list[dict]
    line_numbers: list[int]
    unit: str = "line"

    def where(self, i: int) -> str:
        return f"{self.flag} {self.path}, {self.unit} {self.line_numbers[i]}"


DATASET_FILES = {".parquet": "parquet", ".csv": "csv", ".json": "json"}  # read by the datasets package


def is_dataset_name(path: str) -> bool:
    """A Hugging Face dataset (a directory laid out like one, or a Hub name: 'gsm8k', 'openai/gsm8k') rather than a
    file; what looks like a file path (a suffix such as .jsonl, or a path of several parts) is read as a file."""
    if os.path.exists(path):
        return os.path.isdir(path)
    return not (Path(path).suffix[1:].isalpha() or path.startswith((".", "/", "~")) or path.count("/") > 1)


def read_lines(path: str, flag: str) -> list[tuple[int, str]]:
    """(line number, text) of every non-blank line of a UTF-8 file (a leading byte-order mark is fine)."""
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: file not found")
    lines = []
    for number, raw in enumerate(Path(path).read_bytes().removeprefix(b"\xef\xbb\xbf").split(b"\n"), 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{flag} {path}, line {number}: not UTF-8 text (byte {e.start + 1} is "
                              f"{raw[e.start]:#04x})") from None
        if text.strip():
            lines.append((number, text.rstrip("\r")))
    return lines


def read_rows(path: str, flag: str, split: str, config: Optional[str]) -> PromptFile:
    """The rows of a JSONL file, line by line, or of what datasets.load_dataset reads: a .json, .parquet or .csv file
    (a CSV's cells kept as their text: "2" must not become 2.0 because another row's cell is empty), a dataset
    directory or a Hub name."""
    suffix = Path(path).suffix.lower()
    if suffix not in DATASET_FILES and not is_dataset_name(path):  # JSONL, whatever the file is called
        rows, numbers = [], []
        for number, line in read_lines(path, flag):
            try:
                rows.append(json.loads(line))
            except (ValueError, RecursionError) as e:  # malformed, an integer of >4300 digits, nested too deep
                reason = getattr(e, "msg", None) or f"{type(e).__name__}: {str(e).split(';')[0]}"
                raise ConfigError(f"{flag} {path}, line {number}: not valid JSON ({reason})") from None
            numbers.append(number)
        return PromptFile(flag, path, rows, numbers)
    if suffix in DATASET_FILES and not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: file not found")
    try:
        import datasets  # optional: only these inputs need it
    except ImportError:
        raise ConfigError(f"{flag} {path}: reading it needs the datasets package: pip install datasets") from None
    datasets.disable_progress_bars()  # stderr keeps to our one error line: no bars, retries, schema or card messages
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    huggingface_hub.utils.logging.set_verbosity_error()
    try:
        if suffix == ".csv":
            with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:  # -sig: Excel's CSV UTF-8
                text = datasets.Features({column: datasets.Value("string") for column in next(csv.reader(f), [])})
            rows = datasets.load_dataset("csv", data_files=path, split="train", features=text, keep_default_na=False,
                                         encoding="utf-8-sig")
        elif suffix in DATASET_FILES:
            rows = datasets.load_dataset(DATASET_FILES[suffix], data_files=path, split="train")
        else:
            rows = datasets.load_dataset(path, config, split=split)
    except Exception as e:  # offline, no such dataset, config or split, a malformed file (which the cause names)
        reasons = [f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
                   for error in (e, e.__cause__) if error is not None]
        raise ConfigError(f"{flag} {path}: cannot be read as a dataset ({'; '.join(reasons)})") from None
    return PromptFile(flag, path, list(rows), list(range(1, len(rows) + 1)), unit="row")


def load_prompts(path: str, flag: str, prompt_field: str = "prompt", answer_field: str = "answer",
                 split: str = "train", config: Optional[str] = None) -> PromptFile:
    """Prompt rows (read_rows), their --prompt-field and --answer-field renamed 'prompt' and 'answer', each row
    checked to hold a string prompt and no field named like a reward function's argument."""
    prompts = read_rows(path, flag, split, config)
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
        if not row["prompt"].strip():
            raise ConfigError(f"{prompts.where(i)}: the prompt is empty or only whitespace")
        clash = next((key for key in ("prompts", "completions") if key in row), None)
        if clash:
            raise ConfigError(f"{prompts.where(i)}: field {clash!r} collides with the reward function's argument of "
                              "that name; rename it")
    if not prompts.rows:
        raise ConfigError(f"{flag} {path}: {'file' if prompts.unit == 'line' else 'dataset'} has no rows")
    return prompts


def read_prompt_files(args: Args) -> list[Optional[PromptFile]]:
    """[the training prompts, the eval prompts (None with --eval-every 0), PPO-ptx's texts (None without it)]."""
    fields_ = (args.prompt_field, args.answer_field)
    train = load_prompts(args.prompts_path, "--prompts-path", *fields_, args.dataset_split, args.dataset_config)
    held_out = load_prompts(args.eval_prompts_path, "--eval-prompts-path", *fields_, args.eval_dataset_split,
                            args.dataset_config) if args.eval_every > 0 else None
    lines = read_lines(args.ptx_path, "--ptx-path") if args.ptx_coef > 0 else None
    if lines == []:
        raise ConfigError(f"--ptx-path {args.ptx_path}: file has no text")
    ptx = PromptFile("--ptx-path", args.ptx_path, [{"prompt": text} for _, text in lines],
                     [n for n, _ in lines]) if lines else None
    return [train, held_out, ptx]


class Prompts(NamedTuple):
    """Every prompt of the run as token ids beside its row (the fields the reward reads), and PPO-ptx's texts."""
    rows: list[dict]
    ids: list[list[int]]
    eval_rows: list[dict]
    eval_ids: list[list[int]]
    ptx_ids: list[list[int]]


def tokenize_files(files: list[Optional[PromptFile]], tokenizer, args: Args, tools: Optional[list[dict]] = None
                   ) -> Prompts:
    train, held_out, ptx = files
    # A pretraining text is cut to the longest sequence the rollout makes, and ends with EOS.
    ptx_ids = [ids[: args.max_prompt_length + args.max_new_tokens - 1] + [tokenizer.eos_token_id]
               for ids in encode(tokenizer, [row["prompt"] for row in ptx.rows], ptx, True)] if ptx else []
    return Prompts(train.rows, tokenize_prompts(tokenizer, train, args, tools), held_out.rows if held_out else [],
                   tokenize_prompts(tokenizer, held_out, args, tools) if held_out else [], ptx_ids)


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


def format_prompt(tokenizer, prompt: str, chat_template: bool, tools: Optional[list[dict]] = None) -> str:
    """The prompt as a user turn of the chat template, with the tools' schemas where there are tools (listed in a
    system turn where the template does not render them), or as it is."""
    if not chat_template:
        return prompt
    user, render = [{"role": "user", "content": prompt}], tokenizer.apply_chat_template
    text = render(user, tools=tools, tokenize=False, add_generation_prompt=True)
    if tools and text == render(user, tokenize=False, add_generation_prompt=True):
        listed = "\n".join(json.dumps(schema) for schema in tools)
        system = (f"You may call these tools:\n{listed}\nCall one with <tool_call>{{\"name\": the tool's name, "
                  "\"arguments\": {...}}</tool_call>; its result comes back in <tool_response></tool_response>.")
        text = render([{"role": "system", "content": system}] + user, tokenize=False, add_generation_prompt=True)
    return text


def encode(tokenizer, texts: list[str], source: PromptFile, add_special_tokens: bool) -> list[list[int]]:
    """Token ids of each text, a few hundred texts a call. A text the tokenizer cannot encode, or that encodes to
    nothing, is an error naming its file and line (and the first character that cannot be encoded on its own)."""
    def fails(text: str) -> bool:
        try:
            tokenizer(text, add_special_tokens=False)
        except Exception:
            return True
        return False

    encoded = []
    try:
        for start in range(0, len(texts), 256):
            progress(f"tokenizing {source.flag}: {start:,} of {len(texts):,} texts" if len(texts) > 256 else "")
            encoded += tokenizer(texts[start : start + 256], add_special_tokens=add_special_tokens)["input_ids"]
        progress("")
    except Exception as e:
        bad = next((i for i, text in enumerate(texts) if fails(text)), None)
        if bad is None:
            raise ConfigError(f"{source.flag} {source.path}: the tokenizer failed ({type(e).__name__}: {e})") from None
        char = next((c for c in dict.fromkeys(texts[bad]) if fails(c)), None)
        what = f"the character {char!r} (U+{ord(char):04X})" if char else "this text"
        raise ConfigError(f"{source.where(bad)}: the tokenizer cannot encode {what}") from None
    empty = next((i for i, ids in enumerate(encoded) if not ids), None)
    if empty is not None:
        raise ConfigError(f"{source.where(empty)}: the text is empty after tokenization")
    return encoded


def tokenize_prompts(tokenizer, prompts: PromptFile, args: Args, tools: Optional[list[dict]] = None
                     ) -> list[list[int]]:
    """Token ids of every prompt, truncated from the left to --max-prompt-length (the end of a prompt matters most)."""
    try:
        texts = [format_prompt(tokenizer, row["prompt"], args.chat_template, tools) for row in prompts.rows]
    except Exception as e:  # a template's own raise_exception, or a template that is not valid Jinja
        raise ConfigError(f"--chat-template: the chat template of {args.model_name_or_path} fails to render "
                          f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None
    encoded = encode(tokenizer, texts, prompts, add_special_tokens=not args.chat_template)
    truncated = sum(len(ids) > args.max_prompt_length for ids in encoded)
    if truncated:
        print(f"warning: {truncated} of {len(encoded)} prompts in {prompts.flag} are longer than --max-prompt-length="
              f"{args.max_prompt_length} tokens and were truncated from the left")
    return [ids[-args.max_prompt_length :] for ids in encoded]


def check_prompt_lengths(prompts: Prompts, policy, args: Args) -> None:
    """Every prompt token an id of the policy's vocabulary, and the longest prompt and response inside its context."""
    every, vocab = prompts.ids + prompts.eval_ids, policy.get_input_embeddings().num_embeddings
    largest, longest = max(map(max, every)), max(map(len, every))
    if largest >= vocab:
        raise ConfigError(f"--model-name-or-path {args.model_name_or_path}: its tokenizer gives the id {largest}, "
                          f"past the model's {vocab}-token vocabulary")
    context = getattr(policy.config.get_text_config(), "max_position_embeddings", None) or float("inf")
    if longest + args.max_new_tokens > context:
        raise ConfigError(f"the longest prompt ({longest} tokens) plus --max-new-tokens "
                          f"{args.max_new_tokens} is past the model's max_position_embeddings {context}; lower "
                          "--max-prompt-length or --max-new-tokens")


def left_pad(tokenizer, sequences: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of the sequences, padded on the left to the longest, by the tokenizer."""
    padded = tokenizer.pad({"input_ids": sequences}, padding_side="left", return_tensors="pt")
    return padded["input_ids"].to(device), padded["attention_mask"].to(device)


@torch.no_grad()
def score_responses(models: Models, reward: Reward, batch: dict, rows: list[dict], args: Args) -> torch.Tensor:
    """Raw scores: the reward model's if there is one, else the reward function's on the prompt and completion text."""
    completions = models.tokenizer.batch_decode(batch["responses"], skip_special_tokens=True)
    progress(f"scoring {len(completions)} responses")  # a reward function or a reward model may take its time
    if models.reward_model is not None:
        return reward_model_scores(models, batch, rows, completions, args)
    if "tool_mask" in batch:  # with tools, a reward function is also told each response's calls and failures
        rows = [dict(row, tool_calls=c, tool_failures=f) for row, c, f in zip(rows, batch["tool_calls"].tolist(),
                                                                                 batch["tool_failures"].tolist())]
        if reward.fn in BUILTIN_REWARD_FNS.values():  # which judge the answer: the text after the last tool output
            completions = last_turns(models.tokenizer, batch)
    return call_reward_fn(reward.fn, reward.name, [row["prompt"] for row in rows], completions, rows).to(models.device)


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match_reward(prompts: list[str], completions: list[str], answer: list, **_) -> list[float]:
    """1.0 if the completion, stripped, equals the row's answer, else 0.0. Numbers compare as numbers: "982", 982 and
    982.0 (as parquet or CSV may hold the answer) are equal, and "982.5" and 982 are not."""
    def equal(completion: str, expected) -> bool:
        c, a = completion.strip(), str(expected).strip()
        return float(c) == float(a) if _NUMBER.fullmatch(c) and _NUMBER.fullmatch(a) else c == a

    return [float(equal(c, a)) for c, a in zip(completions, answer)]


def last_number_reward(prompts: list[str], completions: list[str], answer: list, **_) -> list[float]:
    """1.0 if the last number in the completion equals the last number in the row's answer (math-style)."""
    def last_number(text) -> Optional[float]:
        found = _NUMBER.findall(str(text).replace(",", ""))
        return float(found[-1]) if found else None

    pairs = [(last_number(c), last_number(a)) for c, a in zip(completions, answer)]
    return [float(p is not None and a is not None and abs(p - a) < 1e-6) for p, a in pairs]


BUILTIN_REWARD_FNS = {"exact_match": exact_match_reward, "last_number": last_number_reward}


def answer_of_kind(answer) -> bool:
    """What a built-in reward compares with: a text or a finite number (a list, a mapping or NaN never matches)."""
    return isinstance(answer, (str, int)) or isinstance(answer, float) and math.isfinite(answer)


class Reward(NamedTuple):
    fn: Optional[Callable]  # None: the reward model gives the reward
    name: str


def load_reward(args: Args, prompt_files: list[PromptFile]) -> Reward:
    """--reward-fn, imported, after checking that a built-in one finds its answer in every row."""
    if args.reward_model_path:
        return Reward(None, args.reward_model_path)
    for prompts in prompt_files if args.reward_fn in BUILTIN_REWARD_FNS else []:
        missing = next((i for i, row in enumerate(prompts.rows) if not answer_of_kind(row.get("answer"))), None)
        if missing is not None:
            raise ConfigError(f"{prompts.where(missing)}: --reward-fn {args.reward_fn} needs the field "
                              f"{args.answer_field!r} (--answer-field) in every row, a text or a number (found "
                              f"{prompts.rows[missing].get('answer')!r})")
    return Reward(load_function(args.reward_fn), args.reward_fn)


def load_function(spec: str, flag: str = "--reward-fn", builtins: Optional[dict] = None) -> Callable:
    """A built-in name, 'package.module:function' (pkgutil.resolve_name) or 'path/to/file.py:function' (runpy)."""
    builtins = BUILTIN_REWARD_FNS if builtins is None else builtins
    if spec in builtins:
        return builtins[spec]
    module, _, function = spec.rpartition(":")
    if not module or not function:
        raise ConfigError(f"{flag} {spec!r}: expected one of {sorted(builtins)}, module:function or file.py:function")
    try:
        fn = runpy.run_path(module)[function] if module.endswith(".py") else pkgutil.resolve_name(spec)
    except BaseException as e:  # sys.exit() or KeyboardInterrupt at import time too; KeyError: no such function
        raise ConfigError(f"{flag} {spec!r} cannot be imported: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"{flag} {spec!r} is not callable")
    return fn


def call_reward_fn(fn: Callable, name: str, prompts: list[str], completions: list[str], rows: list[dict]
                   ) -> torch.Tensor:
    """fn(prompts, completions, **row_fields), checked to be one finite float32 number per completion."""
    what, keys = f"reward function {name!r}", dict.fromkeys(key for row in rows for key in row if key != "prompt")
    launch = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE")}  # how torchrun launched this run
    try:  # its own copies: a function that edits its lists in place changes nothing the next one sees
        returned = fn(list(prompts), list(completions), **{key: [row.get(key) for row in rows] for key in keys})
        returned = returned.tolist() if hasattr(returned, "tolist") else returned  # a tensor or array
        # a dict would be read as its keys, a set in no particular order; a generator runs here
        scores = list(returned) if isinstance(returned, Iterable) and not isinstance(
            returned, (str, bytes, dict, set)) else None
    except KeyboardInterrupt:
        if stop_requests.signum is not None:  # the user's second Ctrl-C, not the function's
            raise
        raise ConfigError(f"{what} raised KeyboardInterrupt") from None
    except BaseException as e:  # sys.exit() in a reward function ends no run silently
        raise ConfigError(f"{what} raised {type(e).__name__}: {e}") from None
    if changed := [key for key, value in launch.items() if os.environ.get(key) != value]:
        raise ConfigError(f"{what} changed {' and '.join(changed)} in os.environ: torchrun sets them for the run")
    if scores is None:
        shown = repr(returned) if len(repr(returned)) <= 40 else type(returned).__name__
        raise ConfigError(f"{what} returned {shown}, expected a list of {len(completions)} numbers")
    if len(scores) != len(completions):
        raise ConfigError(f"{what} returned {len(scores)} values for {len(completions)} completions")
    text = next((s for s in scores if isinstance(s, (str, bytes))), None)
    if text is not None:  # float("1.5") would succeed: a score must be a number, not text that looks like one
        raise ConfigError(f"{what} returned a non-number: {text!r} is text")
    try:
        scores = [float(s) for s in scores]
    except OverflowError:
        raise ConfigError(f"{what} returned an integer too large for float32") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{what} returned a non-number: {e}") from None
    bad = next((i for i, s in enumerate(scores) if not abs(s) <= torch.finfo(torch.float32).max), None)
    if bad is not None:
        raise ConfigError(f"{what} returned " + (f"{scores[bad]:g} at index {bad}, too large for float32"
                          if math.isfinite(scores[bad]) else f"a non-finite value ({scores[bad]}) at index {bad}"))
    return torch.tensor(scores, dtype=torch.float32)


def reward_model_texts(models: Models, rows: list[dict], completions: list[str], has_eos: torch.Tensor, args: Args
                       ) -> tuple[list[str], bool]:
    """Prompt + response as text in the reward model's own format, and whether that format already holds the special
    tokens: its chat template when the run uses one (a response cut off before EOS leaves the assistant turn open),
    else plain concatenation ending with its EOS token when the response ended with EOS."""
    tokenizer, ended = models.reward_tokenizer, has_eos.tolist()
    if args.chat_template and tokenizer.chat_template:
        return [tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]},
                                               {"role": "assistant", "content": c}],
                                              tokenize=False, continue_final_message=not e)
                for row, c, e in zip(rows, completions, ended)], True
    eos = tokenizer.eos_token or ""
    return [format_prompt(models.tokenizer, row["prompt"], args.chat_template) + c + (eos if e else "")
            for row, c, e in zip(rows, completions, ended)], False


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


# Tools: the built-in calculator, --tools and their JSON schemas, the prompt that lists them, a turn's tool calls
# parsed and run (a timeout each), and the tool message that carries their results back.


class ToolResult(NamedTuple):
    text: str  # what goes back to the model: the tool's output, or "error: ..." saying what went wrong
    failed: bool


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: the expression, for example 374*58 or (2+3)**2
    """
    return str(arithmetic(ast.parse(expression.strip(), mode="eval").body))


ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
              ast.UAdd: operator.pos}


def arithmetic(node: ast.AST):
    """The value of an expression's syntax tree, walked node by node (model text is never run with eval): numbers and
    the operators of ARITHMETIC alone. Every value, and a power before it is computed, stays within 10**300, so that
    no operation on model text can take long."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and type(node.op) in ARITHMETIC:
        value = ARITHMETIC[type(node.op)](arithmetic(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
        left, right = arithmetic(node.left), arithmetic(node.right)
        if isinstance(node.op, ast.Pow) and abs(left) > 1 and not abs(right) * math.log10(abs(left)) <= 300:
            raise ValueError(f"{ast.unparse(node)} is past 10**300")
        value = ARITHMETIC[type(node.op)](left, right)
    else:
        raise ValueError(f"{ast.unparse(node)!r} is not arithmetic: numbers and + - * / // % ** only")
    if isinstance(value, complex) or not abs(value) <= 10**300:  # a fractional power of a negative number, inf
        raise ValueError(f"{ast.unparse(node)} is past 10**300 or not a real number")
    return value


class Toolbox:
    """The functions of --tools by name, and their JSON schemas as transformers' get_json_schema makes them from each
    function's type hints and docstring (what apply_chat_template(tools=...) renders)."""

    def __init__(self, specs: tuple[str, ...], timeout: float):
        self.functions, self.schemas, self.timeout = {}, [], timeout
        for spec in specs:
            fn = load_function(spec, "--tools", {"calculator": calculator})
            try:
                self.schemas.append(transformers.utils.get_json_schema(fn))
            except Exception as e:  # no type hints, or a docstring without an Args section for every argument
                raise ConfigError(f"--tools {spec}: no JSON schema from its signature and docstring ({e})") from None
            self.functions[self.schemas[-1]["function"]["name"]] = fn

    def calls_in(self, text: str, tokenizer) -> list:
        """The tool calls in one turn's text, each what the model wrote ({"name": ..., "arguments": {...}} if well
        formed) or a failed ToolResult saying why it cannot be parsed: by the tokenizer's own response parser where
        it has one (its response_template, read by transformers' parse_response), else in the Hermes format,
        <tool_call>{"name": ..., "arguments": {...}}</tool_call>."""
        if getattr(tokenizer, "response_template", None):
            try:
                message = tokenizer.parse_response(text, prefix="", tools=self.schemas)
                return [call.get("function", call) for call in message.get("tool_calls") or []]
            except Exception as e:
                return [ToolResult(f"error: the tool call cannot be parsed ({type(e).__name__}: {e})", True)]
        calls = []
        for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
            try:
                calls.append(json.loads(body))
            except (ValueError, RecursionError) as e:  # what json.loads raises on any text, deep nesting included
                calls.append(ToolResult(f"error: the tool call is not valid JSON ({e})", True))
        unclosed = "<tool_call>" in text.rsplit("</tool_call>", 1)[-1]
        return calls + [ToolResult("error: the tool call has no </tool_call>", True)] * unclosed

    def run(self, call) -> ToolResult:
        """One call's result. Whatever goes wrong (a malformed call, an unknown tool, wrong arguments, a tool that
        raises or runs past --tool-timeout) is the model's mistake, not the run's: it goes back as an error."""
        if isinstance(call, ToolResult):  # it could not be parsed
            return call
        name, arguments = (call.get("name"), call.get("arguments", {})) if isinstance(call, dict) else (None, None)
        with contextlib.suppress(ValueError, RecursionError):  # the arguments as a JSON string, as in OpenAI's format
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return ToolResult('error: a tool call is {"name": a tool\'s name, "arguments": {...}}', True)
        if name not in self.functions:
            return ToolResult(f"error: there is no tool {name!r}; the tools are {', '.join(self.functions)}", True)
        try:
            inspect.signature(self.functions[name]).bind(**arguments)
        except TypeError as e:
            return ToolResult(f"error: {name}: {e}", True)
        outcome = []

        def attempt() -> None:
            try:
                outcome.append(ToolResult(str(self.functions[name](**arguments)), False))
            except BaseException as e:  # sys.exit() in a tool ends no run
                outcome.append(ToolResult(f"error: {name} raised {type(e).__name__}: {e}", True))
        thread = threading.Thread(target=attempt, daemon=True)
        thread.start()
        thread.join(self.timeout)  # a tool still running past it is left behind (a daemon thread ends with the run)
        return outcome[0] if outcome else ToolResult(f"error: {name} ran past --tool-timeout {self.timeout:g}s", True)

    def check_template(self, tokenizer, args: Args, end_of_turn_id: int) -> None:
        """That the chat template renders two tool messages after an assistant turn, each result in it."""
        try:
            if tokenizer.decode(tool_message_ids(tokenizer, [ToolResult("4217", False)] * 2, args, end_of_turn_id)
                                ).count("4217") != 2:
                raise ValueError("it leaves tool messages out")
        except Exception as e:
            raise ConfigError(f"--tools: the chat template of {args.model_name_or_path} cannot render a tool message "
                              f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None


def tool_message_ids(tokenizer, results: list[ToolResult], args: Args, end_of_turn_id: int) -> list[int]:
    """The token ids that carry a turn's results back, each without the tokenizer's special tokens and cut to
    --max-tool-output-tokens: as the chat template renders tool messages after an assistant turn (what it writes
    after the turn's end-of-turn token, if the turn ended on that one; the tool messages; the next assistant header),
    or without --chat-template as <tool_response>...</tool_response> each."""
    cut, specials = [], [special for special in tokenizer.all_special_tokens if special]
    for result in results:
        text = result.text
        while any(special in text for special in specials):  # a tool that writes <|im_end|> ends no turn
            for special in specials:
                text = text.replace(special, "")
        cut.append(tokenizer.decode(tokens_of(tokenizer, text)[: args.max_tool_output_tokens]))
    if not args.chat_template:
        return tokenizer("".join(f"<tool_response>{text}</tool_response>" for text in cut),
                         add_special_tokens=False)["input_ids"]
    turn = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
    before = tokenizer.apply_chat_template(turn, tokenize=False)
    after = tokenizer.apply_chat_template(turn + [{"role": "tool", "content": text} for text in cut], tokenize=False,
                                          add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("a tool message changes how the earlier turns render")
    end, written = before[before.rindex("!") + 1 :], tokenizer.decode([end_of_turn_id])
    rest = end[len(written) :] if end.startswith(written) else ""  # e.g. the "\n" after <|im_end|>
    return tokenizer(rest + after[len(before) :], add_special_tokens=False)["input_ids"]


def tokens_of(tokenizer, text: str) -> list[int]:
    try:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    except Exception:  # a vocabulary without this text's characters (and no unknown token): the output is dropped
        return []


def last_turns(tokenizer, batch: dict) -> list[str]:
    """Each response's text after its last tool output: the model's final answer."""
    starts = (batch["tool_mask"] * torch.arange(1, batch["tool_mask"].shape[1] + 1, device=batch["responses"].device)
              ).amax(1).tolist()
    return tokenizer.batch_decode([r[start:] for r, start in zip(batch["responses"], starts)], skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------------------------------
# Appendix C. Models and LoRA: the tokenizer, the policy, the reference, the reward model and the critic, loaded and
# held in Models, and the optimizers. Part 1 reaches it through Models (reference, autocast, train, eval,
# critic_parameters) and scalar_forward.


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
    tools: Optional[Toolbox] = None  # what the policy may call with --max-tool-calls (appendix B)

    def critic_parameters(self) -> list[nn.Parameter]:
        critic = self.value_head if self.value_head is not None else self.critic
        return [p for p in critic.parameters() if p.requires_grad]  # with LoRA, the adapters and the score head

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
        return torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None)

    def train(self, mode: bool = True) -> None:
        """Train mode for the update: dropout stays off (but --lora-dropout), gradient checkpointing turns on."""
        for model in (self.policy, self.critic):
            if model is not None:
                model.train(mode)

    def eval(self) -> None:
        self.train(False)


def load_models(args: Args, device: torch.device, resume: Optional[Path]) -> Models:
    """The models of the run, from --model-name-or-path and --reward-model-path, or from the checkpoint resumed (which
    holds the whole policy and critic, or with LoRA only their adapters). Under torchrun every rank loads the full
    weights, then keeps its shard (or, without --fsdp, its replica)."""
    tokenizer = load_tokenizer(args.model_name_or_path, "--model-name-or-path", args.chat_template)
    lora = args.lora_r > 0
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
        reward_tokenizer = load_tokenizer(args.reward_model_path, "--reward-model-path")
    same_vocab = reward_tokenizer is not None and reward_tokenizer.get_vocab() == tokenizer.get_vocab()
    if args.critic_init == "reward" and not same_vocab:
        raise ConfigError("--critic-init reward: the reward model's tokenizer differs from the policy's, so the critic "
                          "cannot read the policy's tokens; use --critic-init policy")
    critic = value_head = None
    if args.shared_critic:  # zero at the start, or the checkpoint's
        value_head = nn.Linear(policy.config.get_text_config().hidden_size, 1).to(device)
        nn.init.zeros_(value_head.weight)
        nn.init.zeros_(value_head.bias)
        if resume:
            value_head.load_state_dict(load_file(resume / "value_head.pt", "--resume-from", device))
    else:
        critic = shard(load_critic(args, device, resume), args)
    return Models(tokenizer, policy, ref_policy, reward_model, reward_tokenizer, critic, value_head, stop_ids, device,
                  torch.bfloat16 if args.dtype == "bfloat16" else None, lora, same_vocab)


def load_critic(args: Args, device: torch.device, resume: Optional[Path]) -> nn.Module:
    """A separate critic: the policy with a fresh scalar head, or the reward model, or the checkpoint's critic."""
    initial = args.reward_model_path if args.critic_init == "reward" else args.model_name_or_path
    from_checkpoint = resume is not None and args.lora_r == 0
    # A fresh head starts the same on every rank: all ranks are seeded alike until the models are built.
    critic = load_scalar_model(str(resume / "critic") if from_checkpoint else initial,
                               "--resume-from" if from_checkpoint else "--critic-init", args, device, trainable=True,
                               fresh_head=not from_checkpoint and args.critic_init == "policy")
    if args.lora_r:  # its own adapters, and its score head trained in full
        critic = add_lora(critic, args, resume / "critic" if resume else None, task_type="SEQ_CLS")
    return critic


def load_file(path: Path, flag: str, device) -> dict:
    """A tensor file written by torch.save, loaded as data (weights_only)."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise ConfigError(f"{flag} {path.parent}: {path.name} cannot be loaded ({type(e).__name__})") from None


def from_pretrained(cls, path: str, flag: str, **kwargs):
    try:
        return cls.from_pretrained(path, **kwargs)
    except Exception as e:  # missing or damaged files, a directory without a usable tokenizer or config, ...
        raise ConfigError(f"{flag} {path}: cannot load ({type(e).__name__}: "
                          f"{(str(e).strip().splitlines() or [''])[0]})") from None


def load_tokenizer(path: str, flag: str, chat_template: bool = False):
    """The tokenizer, padding on the left; without a pad token it pads with EOS (safe: the masks come from the first
    EOS, never from pad ids)."""
    tokenizer = from_pretrained(AutoTokenizer, path, flag)
    if flag == "--model-name-or-path" and tokenizer.eos_token_id is None:
        raise ConfigError(f"{flag} {path}: tokenizer has no eos_token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    tokenizer.padding_side = "left"
    if chat_template and not tokenizer.chat_template:
        raise ConfigError(f"--chat-template: the tokenizer of {path} has no chat template")
    return tokenizer


def eos_token_ids(tokenizer, model, chat_template: bool) -> list[int]:
    """The ids that end a response: EOS from the tokenizer and the model's generation config (chat models often stop
    on several), and with --chat-template the token that closes the assistant's turn (end_of_turn_token_id)."""
    ids = {tokenizer.eos_token_id}
    configured = model.generation_config.eos_token_id
    ids.update(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    end_of_turn = end_of_turn_token_id(tokenizer) if chat_template else None
    return sorted(ids | ({end_of_turn} if end_of_turn is not None else set()))


def end_of_turn_token_id(tokenizer) -> Optional[int]:
    """The special token that closes an assistant turn in the chat template (<|im_end|> in ChatML): the first special
    token after the assistant's reply in a rendered conversation. A base model's EOS is often another token
    (<|endoftext|> for Qwen2.5 base), and a response that ran past the end of its turn would be trained on what
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
    unused = sorted(key for key in info["unexpected_keys"] if not key.startswith(("lm_head.", "score.")))
    if unused:  # a config.json with fewer layers than the weights would train and save a truncated model
        raise ConfigError(f"{flag} {path}: the model of its config.json uses no weights for {', '.join(unused[:3])}"
                          + (f" and {len(unused) - 3} more" if len(unused) > 3 else "") + "; does it match them?")
    disable_dropout(model)
    model.to(device).eval()
    if trainable and args.gradient_checkpointing:
        model.activation_checkpointing_enable()  # active only in train mode, i.e. in the update, not in generate
    return model.requires_grad_(trainable)


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


def disable_dropout(model: nn.Module) -> None:
    """RL needs pi_old and pi_theta evaluated identically: zero every dropout, in modules and in the config. The update
    runs in train mode, and attention layers (Llama, Qwen, Mistral, ...) keep config.attention_dropout in a plain float
    attribute that they apply in train mode, so those floats are zeroed too."""
    for holder in [*model.modules(), model.config]:
        if isinstance(holder, nn.Dropout):
            holder.p = 0.0
        for key, value in list(vars(holder).items()):
            if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
                setattr(holder, key, 0.0)


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
                model = peft.get_peft_model(model, peft.LoraConfig(
                    r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, task_type=task_type,
                    target_modules="all-linear" if targets == ["all-linear"] else targets))
        except (ValueError, OSError) as e:  # no adapter files in the checkpoint, ...
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
    rates = dict(policy=args.learning_rate, critic=args.critic_learning_rate)
    for (name, rate), by_size, flag in zip(list(rates.items()), default_learning_rates(num_params),
                                           ("--learning-rate", "--critic-learning-rate")):
        if rate is None:
            rates[name] = by_size
            print(f"{name} learning rate {by_size:g}, by the policy's size ({num_params / 1e6:.1f}M parameters); "
                  f"{flag} sets another" + ("; this is a full fine-tuning rate, LoRA usually wants about 10x"
                                            if args.lora_r else ""))
    trained = dict(policy=[p for p in models.policy.parameters() if p.requires_grad], critic=models.critic_parameters())
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
# measurements: benchmarks/README.md). Part 1 reaches it through response_states and logprobs_and_entropy (in
# policy_forward), micro_batches and sample (in generate).


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



def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """H = -sum_a p_a * log p_a from log p = log_softmax(z), per position, without a gradient (the in-place product
    saves a vocabulary-sized temporary; appendix D's backward pass gives H's gradient). The equal form
    logsumexp(z) - sum p*z subtracts two large numbers and loses float32 precision on peaked distributions."""
    return -logp.exp().mul_(logp).sum(-1)


@torch.no_grad()
def sample(model, input_ids, attention_mask, max_new_tokens: int, eos_token_ids: list[int], greedy: bool,
           temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> torch.Tensor:
    """Autoregressive sampling, y_t ~ next_token_probs(logits_t) (or its argmax, greedy), with the KV cache: one
    forward pass over the left-padded prompts, then one token per row per step, until every row has sampled an EOS or
    max_new_tokens. Returns the (B, T) tokens; the caller masks what follows a row's first EOS. Our own loop rather
    than transformers' generate, which fills what is left unset from the model's shipped generation config
    (repetition penalties, its own top-k): the sampler must draw from the distribution trained on."""
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
# Appendix E. Distributed: torchrun and FSDP2. In one process each collective here is the identity or returns at once.
# Part 1 reaches it through all_sum (and masked_whiten), backward, clip_grad_norm and average_gradients; Part 2
# through gather_cat; sample through unsharded.


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
    """x summed over the ranks (in one process, x itself)."""
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


def average_gradients(module: nn.Module) -> None:
    """The shared critic's value head is a plain module, replicated on every rank: average its gradients as FSDP
    averages the others'."""
    if world_size() > 1:
        for p in module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world_size()


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


UNSHARDED = set()  # the FSDP units an unsharded() holds gathered


@contextlib.contextmanager
def unsharded(model: nn.Module):
    """The full weights, gathered once for a whole sample() and kept until it ends, not once per decoded token: no
    collective runs in between, so that ranks decode different numbers of tokens independently."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m not in UNSHARDED]  # once when nested
    UNSHARDED.update(units)
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()
        UNSHARDED.difference_update(units)


def full_state_dict(model: nn.Module) -> Optional[dict]:
    """The whole model's weights on rank 0's CPU (empty on the other ranks; None in one process: it saves itself)."""
    if world_size() == 1:
        return None
    return dcp_state.get_model_state_dict(model, options=dcp_state.StateDictOptions(full_state_dict=True,
                                                                                     cpu_offload=True))


def optimizer_state(model: nn.Module, optimizer) -> Optional[dict]:
    """The optimizer's whole state on rank 0's CPU, keyed by parameter name (torch.distributed.checkpoint: the same
    in one process and under FSDP2); None before its first step, where torch would fake one (Adam's step count)."""
    if not optimizer.state:
        return None
    return dcp_state.get_optimizer_state_dict(model, optimizer, options=dcp_state.StateDictOptions(
        full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: nn.Module, optimizer, saved: Optional[dict], where: str) -> None:
    shapes = {name: p.shape for name, p in model.named_parameters()}  # a model put in the checkpoint's place
    if wrong := next((k for k, v in (saved or {}).get("state", {}).items() if shapes.get(k) != v["exp_avg"].shape),
                     None):
        raise ConfigError(f"{where} does not fit the optimizer state that training_state.pt holds for it ({wrong})")
    if saved is not None:  # saved before its first step: nothing to load
        dcp_state.set_optimizer_state_dict(model, optimizer, optim_state_dict=saved,
                                           options=dcp_state.StateDictOptions(full_state_dict=True))


# ---------------------------------------------------------------------------------------------------------------------
# Appendix F. The run: start-up, the output directory and its lock, checkpoints and resume, interrupts, the exit.
# Part 1 reaches it through start_run, the Run it yields, save_checkpoint and NonFiniteLoss.


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
    output_dir: Path
    start_time: float
    first_iteration: int  # 0, or the iteration of the checkpoint resumed

    def generator(self, step: int) -> torch.Generator:
        """The random stream of an iteration's minibatch order and PPO-ptx texts, seeded by the step, so that a resumed
        run draws what the uninterrupted one would."""
        return torch.Generator().manual_seed((self.args.seed * 1_000_003 + step + 7_919 * rank()) % 2**64)

    def report(self, metrics: dict) -> None:
        """The console line, the doctor's warnings (counted into the metrics), the metrics.jsonl row, and every
        --sample-every iterations a few sampled completions. Row 0 is the eval before the first update."""
        samples = metrics.pop("samples", [])
        self.state["eval_after"] = metrics.get("eval/reward", self.state["eval_after"])
        if metrics["iteration"] == 0:
            self.state["eval_before"] = self.state["eval_after"]
            print(f"iter    0 | eval {metrics['eval/reward']:.3f} (before training)", flush=True)
        else:
            print_line(metrics)
        metrics.update(self.doctor.check(metrics))
        self.log.log(metrics)
        if self.args.sample_every > 0 and metrics["iteration"] % self.args.sample_every == 0:
            for prompt, completion, score in samples:
                print(f"    {prompt!r} -> {completion!r}  score {score:.3f}")

    def stop_if_asked(self, saved: bool) -> None:
        """After SIGTERM or Ctrl-C on any rank: checkpoint this iteration unless `saved`, and raise Interrupted with
        the --resume-from that continues it (with the same flags)."""
        signum = all_max(stop_requests.signum or 0)
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
        """The final policy saved, and the run's last line; returns the eval reward before and after training."""
        for optimizer in self.optimizers.values():  # their states (twice the weights trained) go before the save
            optimizer.state.clear()
        with saved_atomically(self.output_dir / "policy") as tmp:
            save_policy(self.models, tmp, final=True)
        print(run_summary(self, stopped=False), flush=True)
        return dict(eval_before=self.state["eval_before"], eval_after=self.state["eval_after"])


class Interrupted(Exception):
    """The run stopped on SIGTERM or Ctrl-C, with a checkpoint of its last iteration if it trained one since it
    started; exit 128 + the signal's number."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class StopRequests:
    """SIGTERM (a scheduler's notice before preemption) or a first Ctrl-C: stop after this iteration and checkpoint it.
    The first restores the previous handlers, so that a second Ctrl-C is Python's KeyboardInterrupt: stop at once."""
    signum = None

    def __enter__(self):
        self.signum = None
        self.previous = {signum: signal.signal(signum, self.request) for signum in (signal.SIGINT, signal.SIGTERM)
                         if signal.getsignal(signum) is not signal.SIG_IGN}  # e.g. Ctrl-C in a job started with &
        return self

    def request(self, signum, frame):
        self.signum = signum
        self.__exit__()
        print(f"\n{signal.Signals(signum).name}: stopping after this iteration (Ctrl-C again to stop at once)",
              flush=True)

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


stop_requests = StopRequests()


@contextlib.contextmanager
def start_run(args: Args):
    """The Run of these flags (open_run), SIGTERM and Ctrl-C caught; on the way out, however the run ends, the lock is
    released, the logs closed, the signal handlers restored and the process group left."""
    device = init_distributed()
    try:
        with stop_requests, contextlib.ExitStack() as held:
            yield open_run(args, held, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def open_run(args: Args, held: contextlib.ExitStack, device: torch.device) -> Run:
    """Check the flags and read the prompts and the checkpoint before any model loads; lock --output-dir; load the
    models and optimizers (and the checkpoint's state); only then delete what --overwrite replaces."""
    check_args(args)
    args = derived_args(args)
    training_state = read_checkpoint(args) if args.resume_from else None
    files = read_prompt_files(args)
    reward = load_reward(args, [file for file in files[:2] if file])
    tools = Toolbox(args.tools, args.tool_timeout) if args.max_tool_calls else None
    if rank() == 0:  # rank 0 alone locks and writes the output directory
        held.enter_context(lock_output_dir(Path(args.output_dir)))
    earlier = earlier_run(args)
    resume = Path(args.resume_from) if args.resume_from else None
    torch.manual_seed(args.seed)
    models = load_models(args, device, resume)
    models.tools = tools
    if world_size() > 1:  # every rank samples its own responses
        torch.manual_seed((args.seed + 1_000_003 * rank()) % 2**64)
    if models.lora:
        trained = sum(p.numel() for p in models.policy.parameters() if p.requires_grad)
        print(f"LoRA: the policy trains {trained:,} of its {sum(p.numel() for p in models.policy.parameters()):,} "
              "parameters; the reference is the policy with its adapters off")
    print(f"stop tokens: {' '.join(models.tokenizer.convert_ids_to_tokens(models.eos_token_ids))}")
    if tools:
        tools.check_template(models.tokenizer, args, models.eos_token_ids[0])
    prompts = tokenize_files(files, models.tokenizer, args, tools and tools.schemas)
    check_prompt_lengths(prompts, models.policy, args)
    optimizers, learning_rates = make_optimizers(models, args)
    state = dict(iteration=0, kl_coef=args.kl_coef, reward_mean=0.0, reward_var=1.0, reward_count=0, eval_before=None,
                 eval_after=None, ent_coef=args.ent_coef)
    if resume:
        state.update(load_training_state(training_state, models, optimizers, resume))
        print(f"resumed from {resume} at iteration {state['iteration']}")
    if signum := all_max(stop_requests.signum or 0):  # a signal while the models loaded: nothing deleted or written
        raise Interrupted(signum, "interrupted before the first update of this run; nothing new to save")
    if rank() == 0:
        delete_earlier_run(args, earlier, state["iteration"])
    log = MetricsLog(args, state["iteration"])
    held.callback(log.close)
    print(f"output: {args.output_dir}/ gets metrics.jsonl (every iteration)"
          + (f", checkpoint-N (every {args.save_every} iterations)" if args.save_every else "")
          + ", policy/ (at the end)" + (", tb/ (TensorBoard)" if args.track else ""), flush=True)
    return Run(args, models, optimizers, learning_rates, reward, prompts, state, log, Doctor(args, log.rows),
               Path(args.output_dir), time.time(), state["iteration"])


def lock_output_dir(output_dir: Path):
    """Create --output-dir and hold an exclusive lock (flock) on it for the whole run, so that a second run into it
    stops instead of interleaving its files with ours. Returns the open lock file."""
    try:
        if output_dir.exists() and not output_dir.is_dir():
            raise ConfigError(f"--output-dir {output_dir}: exists and is not a directory")
        output_dir.mkdir(parents=True, exist_ok=True)
        lock = open(output_dir / ".lock", "a")
    except OSError as e:
        raise ConfigError(f"--output-dir {output_dir}: cannot write there ({e.strerror or e})") from None
    try:
        import fcntl  # POSIX only; elsewhere runs go unlocked
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:
        pass
    except OSError:
        raise ConfigError(f"--output-dir {output_dir}: another run is writing to it") from None
    return lock


EARLIER_RUN = ("metrics.jsonl", "policy", "checkpoint-*", "tb", "wandb")  # what --overwrite deletes


def earlier_run(args: Args) -> list[Path]:
    """What an earlier run left in --output-dir, for --overwrite to delete once the models have loaded (the Hugging
    Face Trainer's overwrite_output_dir); without it an error, unless this run resumes from one of its checkpoints."""
    output_dir = Path(args.output_dir)
    found = sorted(p for pattern in EARLIER_RUN for p in output_dir.glob(pattern))
    resume = Path(args.resume_from).resolve() if args.resume_from else None
    touched = [p for p in found if resume is not None and (p.resolve() == resume or p.resolve() in resume.parents
                                                              or resume in p.resolve().parents)]
    if args.overwrite and touched:
        raise ConfigError(f"--overwrite would delete --resume-from {args.resume_from} (it lies in {touched[0]}); "
                          "drop one of them")
    if found and not args.overwrite and not (resume is not None and resume.parent == output_dir.resolve()):
        raise ConfigError(f"--output-dir {output_dir} holds an earlier run ({names_of(found)}); pass --overwrite to "
                          "replace it, or --resume-from one of its checkpoints")
    return found if args.overwrite else []


def delete_earlier_run(args: Args, earlier: list[Path], iteration: int) -> None:
    """Delete what --overwrite replaces; or, resuming in the run's own directory, the checkpoints written after the one
    resumed (MetricsLog drops their rows), so that --save-total-limit and the last line count this run's."""
    output_dir = Path(args.output_dir)
    if args.resume_from and Path(args.resume_from).resolve().parent == output_dir.resolve():
        earlier = [p for p in checkpoints_in(output_dir) if int(p.name.removeprefix("checkpoint-")) > iteration]
    for path in earlier:
        try:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        except OSError as e:
            raise ConfigError(f"cannot delete {path} of the earlier run ({e.strerror or e})") from None
    if earlier:
        print(f"deleted {names_of(earlier)}, " + ("the earlier run (--overwrite)" if args.overwrite else
                                                  "written after the checkpoint resumed"))


def names_of(paths: list[Path]) -> str:
    return ", ".join(p.name for p in paths[:3]) + (", ..." if len(paths) > 3 else "")


def save_policy(models: Models, path: Path, final: bool = False) -> None:
    """The policy and tokenizer with save_pretrained (and the model's own generation config, which the sampler
    ignores). With LoRA a checkpoint holds the adapters alone, and the final policy is the model with the adapters
    merged in. Every rank takes part in gathering the weights; rank 0 writes them."""
    state_dict = None if models.lora else full_state_dict(models.policy)
    if rank() == 0:
        model = models.policy.merge_and_unload() if models.lora and final else models.policy  # merged in place
        model.save_pretrained(path, state_dict=state_dict)
        models.tokenizer.save_pretrained(path)


def save_checkpoint(run: Run) -> None:
    """<output-dir>/checkpoint-N, atomically: the policy and critic (and with --ref-sync-every the reference, no longer
    the initial one) with save_pretrained (a shared critic's value head with torch.save), the optimizers, the run's
    state and every rank's random state. Every rank takes part; rank 0 writes, and keeps only the newest
    --save-total-limit checkpoints."""
    models, path = run.models, run.output_dir / f"checkpoint-{run.state['iteration']}"
    with saved_atomically(path) as tmp:
        save_policy(models, tmp / "policy")
        reference = full_state_dict(models.ref_policy) if run.args.ref_sync_every else None
        critic = full_state_dict(models.critic) if models.critic is not None and not models.lora else None
        trained = dict(policy=models.policy, critic=models.critic if models.critic is not None else models.value_head)
        optimizers = {name: optimizer_state(trained[name], opt) for name, opt in run.optimizers.items()}
        rng = all_gather_objects(dict(torch=torch.get_rng_state(),
                                      cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None))
        if rank() == 0:
            if run.args.ref_sync_every:
                models.ref_policy.save_pretrained(tmp / "reference", state_dict=reference)
            if models.critic is not None:
                models.critic.save_pretrained(tmp / "critic", state_dict=critic)
            else:
                torch.save(models.value_head.state_dict(), tmp / "value_head.pt")
            torch.save(dict(run.state, script="ppo", args=asdict(run.args), world_size=world_size(), rng=rng,
                            optimizers=optimizers), tmp / "training_state.pt")
    if rank() == 0 and run.args.save_total_limit is not None:  # this one and the newest others (by N) up to the limit
        others = [p for p in checkpoints_in(path.parent) if p != path]
        for old in others[: len(others) - (run.args.save_total_limit - 1)]:
            shutil.rmtree(old)


@contextlib.contextmanager
def saved_atomically(path: Path):
    """Yields path.tmp to write into, then puts it in path's place: a crash or a failed write (a full disk) never
    leaves a half-written path, and the previous one stays whole until the new one is. A failure removes the partial
    files and is one line. No rank goes on before the path is in place."""
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
        raise ConfigError(f"cannot save {path} ({type(e).__name__}: {(str(e).splitlines() or [''])[0]}); the partial "
                          "files are removed, and what was there before is as it was") from None
    barrier()


def checkpoints_in(output_dir: Path) -> list[Path]:
    """The checkpoint-N directories in output_dir, oldest first."""
    found = [p for p in output_dir.glob("checkpoint-*") if p.is_dir() and p.name.removeprefix("checkpoint-").isdigit()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("checkpoint-")))


# What training_state.pt holds: each key and the types its value may have, so that a checkpoint is data, never code.
NUMBER, NoneType = (int, float), type(None)
TRAINING_STATE = dict(script=(str,), args=(dict,), iteration=(int,), world_size=(int,), rng=(list,), optimizers=(dict,),
                      eval_before=(*NUMBER, NoneType), eval_after=(*NUMBER, NoneType), kl_coef=NUMBER,
                      reward_mean=NUMBER, reward_var=NUMBER, reward_count=(int,), ent_coef=NUMBER)


def read_checkpoint(args: Args) -> dict:
    """The training state of --resume-from, checked before any model loads: loaded as data (weights_only refuses any
    object whose unpickling would run code), each key of TRAINING_STATE of its type, then check_checkpoint."""
    path = Path(args.resume_from)
    where = f"--resume-from {path}: training_state.pt"
    try:
        state = torch.load(path / "training_state.pt", map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise ConfigError(f"--resume-from {path}: not a checkpoint directory (no training_state.pt)") from None
    except OSError as e:  # a name too long, a directory we may not read
        raise ConfigError(f"--resume-from {path}: cannot read it ({e.strerror or e})") from None
    except Exception as e:
        refused = isinstance(e, pickle.UnpicklingError) and "weights only" in str(e).lower()
        raise ConfigError(f"{where} holds more than tensors, numbers, strings and containers (written by an older "
                          "version, or not by this script); refused, since loading it could run code" if refused else
                          f"{where} is truncated or corrupt ({type(e).__name__})") from None
    if type(state) is not dict:
        raise ConfigError(f"{where} is not a training state of ppo_llm.py or grpo_llm.py")
    if state.get("script") in ("ppo", "grpo") and state["script"] != "ppo":
        raise ConfigError(f"--resume-from {path}: a checkpoint of {state['script']}_llm.py, not of ppo_llm.py")
    for key, types in TRAINING_STATE.items():
        if key not in state or type(state[key]) not in types:
            found = f"a {type(state[key]).__name__}" if key in state else "missing"
            raise ConfigError(f"{where}'s {key!r} is {found}, not " + " or ".join(t.__name__ for t in types))
    check_checkpoint(state, path, args)
    return state


def check_checkpoint(state: dict, path: Path, args: Args) -> None:
    """A complete checkpoint of this script, written by as many ranks, with the same flags but RESUME_MAY_CHANGE, and
    not past --num-iterations."""
    where = f"--resume-from {path}"
    if state["iteration"] < 0 or state["world_size"] < 1:
        raise ConfigError(f"{where}: training_state.pt's iteration {state['iteration']} or world_size "
                          f"{state['world_size']} is out of range")
    if len(state["rng"]) != state["world_size"] or any(type(r) is not dict or type(r.get("torch")) is not torch.Tensor
                                                       for r in state["rng"]):
        raise ConfigError(f"{where}: training_state.pt's 'rng' holds {len(state['rng'])} random states, not one per "
                          f"rank of its {state['world_size']}")
    optimizers = state["optimizers"]
    if optimizers.keys() != {"policy", "critic"} or not all(
            x is None or (type(x) is dict and {"state", "param_groups"} <= x.keys()) for x in optimizers.values()):
        raise ConfigError(f"{where}: training_state.pt's 'optimizers' are not the policy's and the critic's")
    if state["world_size"] != launched_ranks():  # each rank continues its own sampler
        raise ConfigError(f"{where}: written by {state['world_size']} rank(s), resumed with {launched_ranks()}; resume "
                          f"with torchrun --nproc_per_node {state['world_size']}")
    saved = {**asdict(Args()), **state["args"]}  # a flag newer than the checkpoint had its default then
    changed = [f"{as_flag(k)} {saved[k]} in the checkpoint, {v} now" for k, v in asdict(args).items()
               if k not in RESUME_MAY_CHANGE and saved[k] != v]
    if changed:
        raise ConfigError(f"{where}: flags differ from the run that wrote it: {'; '.join(changed)}")
    needed = ["policy", "value_head.pt" if args.shared_critic else "critic"] + ["reference"] * bool(args.ref_sync_every)
    missing = [name for name in needed if not (path / name).exists()]
    if missing:
        raise ConfigError(f"{where}: incomplete checkpoint, no {' or '.join(missing)}")
    if args.num_iterations < state["iteration"]:
        raise ConfigError(f"--num-iterations {args.num_iterations} is below the checkpoint's iteration "
                          f"{state['iteration']}")


def load_training_state(training_state: dict, models: Models, optimizers: dict, resume: Path) -> dict:
    """The optimizers' states and this rank's random state, loaded; returns the run's state to continue from."""
    trained = dict(policy=models.policy, critic=models.critic if models.critic is not None else models.value_head)
    for name, optimizer in optimizers.items():
        load_optimizer_state(trained[name], optimizer, training_state["optimizers"][name], f"the {name} of {resume}")
    rng = training_state["rng"][rank()]  # each rank's own
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"])
    return {k: v for k, v in training_state.items() if k not in ("optimizers", "rng", "world_size", "args", "script")}


def main() -> None:
    for stream in (sys.stdout, sys.stderr):  # a console that cannot encode a path prints it escaped
        getattr(stream, "reconfigure", lambda **_: None)(errors="backslashreplace")
    args = parse_args(sys.argv[1:])
    output_dir = Path(args.output_dir).absolute()  # before a reward function can change the working directory
    transformers.logging.set_verbosity_error()  # keep stdout to our own lines (load reports, progress bars)
    transformers.logging.disable_progress_bar()
    try:
        with contextlib.redirect_stdout(Console(sys.stdout)):
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
# Part 1 reaches it through phase, phase_times, evaluate, rollout_metrics, samples_to_show, LEGEND, progress and
# Run.report (appendix F).


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


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R): near 1 the critic is useful, near 0 or below it is noise."""
    var_returns, var_errors = returns.double().var(unbiased=False), (returns - values).double().var(unbiased=False)
    return float("nan") if var_returns == 0 else float(1 - var_errors / var_returns)


def rollout_metrics(batch: dict, kl_coef: float) -> dict:
    """The batch's statistics, over every rank's responses: scores, KL (objective/kl: the mean over responses of
    sum_t KL_t), rewards, lengths, values and returns."""
    mask = batch["response_mask"]
    whole = {key: gather_cat(value.double()) for key, value in dict(
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
        "val/explained_variance": explained_variance(whole["values"], whole["returns"]),
        "perf/generated_tokens_per_sec": whole["lengths"].sum().item() / max(phase_times["generate"], 1e-9),
        **(tool_metrics(batch) if "tool_mask" in batch else {}),
    }


def tool_metrics(batch: dict) -> dict:
    """With tools: calls per response, the share of calls that failed, the share of response tokens from tools."""
    calls, failed, tool, model = (gather_cat(x.double()) for x in (
        batch["tool_calls"], batch["tool_failures"], batch["tool_mask"].sum(1), batch["response_mask"].sum(1)))
    return {"tools/calls_per_response": calls.mean().item(),
            "tools/failure_rate": failed.sum().item() / max(calls.sum().item(), 1),
            "tools/token_fraction": tool.sum().item() / max((tool + model).sum().item(), 1)}


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
    scores, lengths, eos, calls = [], [], [], []
    for first in range(0, share, args.batch_size):
        progress(f"evaluating: prompts {first + 1}-{min(first + args.batch_size, share)} of {share}")
        inds = padded[first : first + args.batch_size]
        with models.autocast():
            batch = generate(models, [prompts.eval_ids[i] for i in inds], args, greedy=True)
            scores.append(score_responses(models, run.reward, batch, [prompts.eval_rows[i] for i in inds], args))
        lengths.append(batch["response_mask"].sum(1).float())
        eos.append(batch["has_eos"].float())
        calls += [batch["tool_calls"].float()] if args.max_tool_calls else []
    progress("")
    metrics = {key: gather_cat(torch.cat(values)[: len(mine)]).mean().item() for key, values in (
        ("eval/reward", scores), ("eval/response_length", lengths), ("eval/eos_rate", eos),
        *[("eval/tool_calls_per_response", calls)] * bool(calls))}
    return dict(metrics, **{"time/eval": time.time() - start})


class MetricsLog:
    """<output-dir>/metrics.jsonl, one JSON row per iteration (rank 0 writes), and TensorBoard and W&B with --track. A
    resumed run keeps the rows up to its checkpoint (`rows`, for the doctor), dropping the ones after it."""

    def __init__(self, args: Args, start_iteration: int):
        self.path, self.rows, self.writer, self.wandb = Path(args.output_dir) / "metrics.jsonl", [], None, None
        if rank() != 0:
            return
        lines = self.path.read_text(errors="replace").splitlines() if start_iteration and self.path.exists() else []
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash mid-write
                print(f"warning: {self.path}, line {number} is not valid JSON (cut by a crash?); dropped")
                continue
            if type(row) is not dict or type(row.get("iteration")) is not int:  # not what a crash leaves
                raise ConfigError(f"{self.path}, line {number} is not a metrics row ({line[:40]}): fix or remove the "
                                  "line, then resume again")
            self.rows += [row] if row["iteration"] <= start_iteration else []
        self.path.write_text("".join(json.dumps(row) + "\n" for row in self.rows))
        if args.track:  # optional packages: check_args made sure they exist
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(args.output_dir) / "tb"))
            if args.wandb_project:
                import wandb

                self.wandb = wandb.init(project=args.wandb_project, config=asdict(args), dir=args.output_dir)

    def log(self, metrics: dict) -> None:
        if rank() != 0:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
        except OSError as e:  # a full disk
            raise ConfigError(f"cannot write {self.path} ({e.strerror or e})") from None
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


# The console line of each iteration: (column, metric, format), and the legend that explains the columns.
COLUMNS = [("score", "objective/scores", ".3f"), ("kl", "objective/kl", ".3f"), ("ent", "policy/entropy", ".3f"),
           ("clip", "policy/clipfrac", ".3f"), ("ev", "val/explained_variance", ".2f"),
           ("len", "rollout/response_length", ".1f"), ("calls", "tools/calls_per_response", ".2f")]
LEGEND = """columns: score  mean score of the sampled responses         kl    KL to the reference, summed per response
         ent    policy entropy per token                    clip  fraction of tokens clipped
         ev     the critic's explained variance (1 = perfect, 0 = no better than the mean return)
         len    response length in tokens                   s     seconds per iteration
         eval   greedy reward on the eval prompts           calls tool calls per response (with --tools)
lines starting with "doctor" name an instability signal and the knob to turn; --doctor off hides them"""


class Console:
    """sys.stdout for the run: when the console fails (a closed pipe, `| head -1`; a full device) or a reward function
    closes it, one line on stderr says so, the rest goes to os.devnull, and training and its files go on."""

    def __init__(self, stream):
        self.stream = stream

    def __getattr__(self, name: str):
        return getattr(self.stream, name)

    def write(self, text: str) -> int:
        return self.attempt(self.stream.write, text) or len(text)

    def flush(self) -> None:
        self.attempt(self.stream.flush)

    def close(self) -> None:  # the run's console, not a reward function's to close
        pass

    def attempt(self, method, *args):
        try:
            return method(*args)
        except (OSError, ValueError) as e:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())  # what it still buffers goes there too
            print(f"warning: the console failed ({e}); its lines are dropped and training goes on", file=sys.stderr)


def progress(text: str) -> None:
    """Say which phase runs now, on one line that the next one overwrites; only on a terminal (a log stays clean)."""
    if sys.stdout.isatty():
        print(f"\r\033[K{text}", end="" if text else "\r", flush=True)


def print_line(m: dict) -> None:
    progress("")
    columns = [f"{name} {m[key]:{spec}}" for name, key, spec in COLUMNS if key in m]
    evals = [f"eval {m['eval/reward']:.3f}"] if "eval/reward" in m else []
    print(" | ".join([f"iter {m['iteration']:>4}", *columns, f"{m['time/iteration']:.1f}s", *evals]), flush=True)


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


def beta_knob(a: Args) -> str:
    if a.kl_coef == 0:
        return "add a KL penalty (--kl-coef 0.05)"
    return "raise --kl-coef" + (" or use --kl-schedule adaptive" if a.kl_schedule == "fixed" else "")


def per_token_kl(row: dict) -> Optional[float]:
    """Mean KL per response token: the mean per-response KL sum over the mean length (their ratio is sum KL / sum T)."""
    return row["objective/kl"] / max(row["rollout/response_length"], 1) if "objective/kl" in row else None


NO_EOS = "--missing-eos-penalty 1.0, or raise --max-new-tokens"
# (signal, the metric of each row, the test of its window medians m (oldest first), the warning): each warning names
# the value, the threshold and the knobs to turn. A critic with nothing left to predict hovers at explained variance
# 0, its medians a little either side: hence -0.1.
DOCTOR_SIGNALS = [
    ("kl_high", per_token_kl, lambda m, a: m[-1] > 0.3,
     lambda m, a: f"KL to the reference {m[-1]:.3f} per token > 0.3: {beta_knob(a)}, then lower --clip-eps"),
    ("reward_collapse", "objective/scores", lambda m, a: m[-1] <= 0 < max(m),
     lambda m, a: f"training score fell to {m[-1]:.3f} <= 0 from {max(m):.3f}: --resume-from an earlier checkpoint, "
                  f"check the reward, then {beta_knob(a)}"),
    ("clipfrac_high", "policy/clipfrac", lambda m, a: m[-1] > 0.2,
     lambda m, a: f"clip fraction {m[-1]:.3f} > 0.2: raise --clip-eps, or lower --learning-rate or --num-epochs"),
    ("entropy_collapse", "policy/entropy", lambda m, a: m[-1] < 0.01,
     lambda m, a: f"entropy {m[-1]:.4f} < 0.01 per token: raise --ent-coef or --temperature, or --clip-eps-high"),
    ("grad_norm_high", "grad/policy_norm", lambda m, a: m[-1] > 5.0,
     lambda m, a: f"policy gradient norm {m[-1]:.2f} > 5.0 before clipping: lower --learning-rate"),
    ("critic_grad_norm_high", "grad/critic_norm", lambda m, a: m[-1] > 5.0,
     lambda m, a: f"critic gradient norm {m[-1]:.2f} > 5.0 before clipping: lower --critic-learning-rate"),
    ("value_loss_growing", "losses/value_loss", lambda m, a: len(m) > DOCTOR_WINDOW and m[-1] > 2 * min(m) and all(
        x < y for x, y in zip(m[-DOCTOR_WINDOW - 1 :], m[-DOCTOR_WINDOW:])),
     lambda m, a: f"value loss {m[-1]:.4f} has risen for {DOCTOR_WINDOW} iterations, to over twice its lowest: "
                  "--critic-warmup-iterations, --value-pretrain-steps, --vf-coef, or a lower --critic-learning-rate"),
    ("explained_variance_negative", "val/explained_variance", lambda m, a: m[-1] < -0.1,
     lambda m, a: f"critic explained variance {m[-1]:.2f} < -0.1, worse than the mean return: "
                  "--critic-warmup-iterations, --value-pretrain-steps, --critic-learning-rate"),
    ("length_collapse", "rollout/response_length", lambda m, a: m[-1] <= 1.5 < m[0],
     lambda m, a: f"response length {m[-1]:.2f} tokens <= 1.5: does the reward pay for empty answers? {beta_knob(a)}"),
    ("length_pinned", "rollout/response_length", lambda m, a: m[-1] >= 0.95 * a.max_new_tokens,
     lambda m, a: f"response length {m[-1]:.1f} >= 0.95 x --max-new-tokens {a.max_new_tokens}: {NO_EOS}"),
    ("eos_rate_falling", "rollout/eos_rate", lambda m, a: m[-1] < m[0] - 0.2,
     lambda m, a: f"EOS rate {m[-1]:.2f} < {m[0]:.2f} at the start - 0.2: {NO_EOS}"),
]


def window_medians(history: list[dict], metric) -> list[float]:
    """The median of every DOCTOR_WINDOW consecutive values of the metric (a row's key, or a function of the row),
    oldest first; rows without it are skipped (an eval-only row has no training reward)."""
    values = [v for v in (metric(row) if callable(metric) else row.get(metric) for row in history) if v is not None]
    return [statistics.median(values[i - DOCTOR_WINDOW : i]) for i in range(DOCTOR_WINDOW, len(values) + 1)]


def doctor_findings(history: list[dict], args: Args) -> dict[str, str]:
    """{signal: its warning} for every signal the metrics of the run so far (oldest first) show now: DOCTOR_SIGNALS,
    then two that compare iterations: --target-kl's early stops, and an eval reward that falls while the training
    reward rises. Critic-warmup iterations, whose policy is frozen, are left out."""
    history = [row for row in history if not row.get("train/policy_frozen")]
    found = {}
    for signal_name, metric, shows, message in DOCTOR_SIGNALS:
        medians = window_medians(history, metric)
        if medians and shows(medians, args):
            found[signal_name] = message(medians, args) + f" (median of {DOCTOR_WINDOW} iterations)"
    stops = [row["policy/early_stopped"] for row in history if "policy/early_stopped" in row][-DOCTOR_WINDOW:]
    if len(stops) == DOCTOR_WINDOW and sum(stops) > DOCTOR_WINDOW / 2:
        found["early_stopping"] = (f"--target-kl stopped the policy's epochs on {sum(stops):.0f} of the last "
                                   f"{DOCTOR_WINDOW} iterations, more than 50%: lower --learning-rate or --num-epochs")
    evals = [(i, row["eval/reward"]) for i, row in enumerate(history) if "eval/reward" in row]
    reward = window_medians(history, "objective/scores")
    if evals and reward:
        best_at, best = max(evals, key=lambda e: e[1])
        # the training reward when the eval was best; the first window's if that came before it (the eval before)
        then = (window_medians(history[: best_at + 1], "objective/scores") or reward[:1])[-1]
        if evals[-1][1] < best - 0.05 and reward[-1] > then:
            found["reward_hacking"] = (f"eval/reward {evals[-1][1]:.3f} < its best {best:.3f} - 0.05 while the "
                                       f"training score rose ({then:.3f} -> {reward[-1]:.3f}): check samples, then "
                                       f"{beta_knob(args)}")
    return found


class Doctor:
    """Prints each signal doctor_findings reports, at most once per DOCTOR_REPEAT iterations, and counts them into the
    metrics as doctor/<signal>."""

    def __init__(self, args: Args, history: list[dict]):
        self.args, self.history, self.last_warned, self.counts = args, list(history), {}, {}
        for row in history:  # a resumed run goes on counting, and repeating, where the checkpointed one was
            for key, count in row.items():
                if key.startswith("doctor/"):
                    self.last_warned[key[7:]], self.counts[key[7:]] = row["iteration"], count

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
