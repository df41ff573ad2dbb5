"""PPO for language models in one file: a policy, a frozen reference, a reward (model or function) and a critic.

One iteration (run_iteration): 1. rollout: sample a response to each prompt in turns, with tool output between
(attended, never trained on), score it, compute log pi_old, log pi_ref, V(s_t); 2. rewards: r_t = -beta * KL_t on every
token of response_mask, plus the score on the last; 3. advantages: GAE, whitened over the batch; 4. update:
--num-epochs passes over the batch, each in --num-minibatches optimizer steps on the clipped policy loss + c1 * the
clipped value loss - c2 * the entropy. Part 1 is that default path; each variant (Part 2) enters it where a comment
names it (but those that pick a model or a file), and each piece of machinery (Part 3) is one call whose name says
what it returns. Needs numpy, torch, tyro, transformers >= 5.

With no flags it trains the tiny addition model in demo/ (beside this file), on CUDA if there is one; a real model:
    python ppo_llm_tools.py --tools calculator --max-tool-calls 2 --model-name-or-path Qwen/Qwen2.5-0.5B-Instruct \
        --prompts-path math.jsonl --eval-prompts-path math_eval.jsonl --reward-fn last_number --chat-template \
        --max-new-tokens 512 --max-prompt-length 1024 --dtype bfloat16
PPO (Schulman et al. 2017, arXiv:1707.06347); GAE (Schulman et al. 2015, arXiv:1506.02438); KL-shaped rewards and the
adaptive KL controller (Ziegler et al. 2019, arXiv:1909.08593); InstructGPT, PPO-ptx (Ouyang et al. 2022, arXiv:
2203.02155); "The 37 implementation details of PPO" (Huang et al. 2022, ICLR blog track); variants' papers in Part 2.

This file is ppo_llm.py plus multi-turn tool calling (--tools, --max-tool-calls; docs/tools.md). Changed from
ppo_llm.py: Generation, Batch, generate, compute_gae, Data, RANGES, ONLY_WITH, Prompts, load_prompts, tokenize_prompts,
score_responses, Models, unsharded, start_run, rollout_metrics, evaluate; added: generate_with_tools, ToolResult,
calculator, ARITHMETIC, arithmetic, Toolbox, tool_message_ids, tokens_of, last_turns, UNSHARDED, tool_metrics.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import math
import operator
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
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field, fields, make_dataclass, replace
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
# The default path's knobs, a dataclass per --help group, each comment its help; Args (Part 3) joins all, flat.


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
    value_clip_eps: Optional[float] = 0.2  # clip V around the rollout's values (pessimistic max); None = off
    vf_coef: float = 0.5  # c1, the value loss's weight; with a separate critic, Adam undoes it (but clipping, eps)
    ent_coef: float = 0.0  # c2, entropy bonus; 0 for LLMs, 0.01 in classic RL


@dataclass
class Optimisation:
    """iterations, batch sizes, the optimizers and the critic's warmup"""

    num_iterations: int = 40  # rollout -> update cycles
    num_prompts: int = 64  # prompts per iteration (batch = num_prompts * num_generations responses)
    num_epochs: int = 4  # K: passes over each batch; 1-4 for LLMs
    num_minibatches: int = 2  # optimizer steps per epoch; the batch is reshuffled every epoch
    micro_batch_size: int = 32  # sequences per forward pass (not sampling's); gradients accumulate over a minibatch
    learning_rate: Optional[float] = None  # policy AdamW rate; None = by the policy's size (3e-4 for the demo)
    critic_learning_rate: Optional[float] = None  # critic AdamW rate; None = by the policy's size
    adam_eps: float = 1e-5  # AdamW epsilon (1e-5 is one of the 37 details)
    weight_decay: float = 0.0  # AdamW weight decay
    lr_warmup_iterations: int = 0  # linear warmup of each rate over its first iterations of training
    anneal_lr: bool = True  # linearly anneal the learning rates toward 0 (0 after the last iteration)
    max_grad_norm: float = 1.0  # global gradient-norm clip, separately for policy and critic
    critic_warmup_iterations: int = 0  # the first iterations train the critic alone (shared: its head); policy waits


@dataclass
class Generation:
    """how responses are sampled"""

    num_generations: int = 1  # responses sampled per prompt
    max_new_tokens: int = 16  # the most tokens after the prompt; longer responses are cut (the demo's need 5)
    temperature: float = 1.0  # sampling temperature; every log-prob (pi_old, pi_ref, pi_theta) uses logits / it
    top_p: float = 1.0  # nucleus sampling; 1.0 = off (log-probs ignore top-p/top-k/min-p, as most RLHF code)
    top_k: int = 0  # top-k sampling; 0 = off
    min_p: float = 0.0  # min-p sampling: drop tokens below min_p times the most likely one; 0 = off
    tools: tuple[str, ...] = ()  # calculator, module:function, file.py:function; schemas in prompts: --chat-template
    max_tool_calls: int = 0  # tool calls per response, each result appended before the model goes on; 0 = one turn
    max_tool_output_tokens: int = 128  # each tool's output is cut to this many of its tokens, then rendered
    tool_timeout: float = 10.0
    """seconds a tool may run, then its call fails (the model is told). Calls run one at a time, each in a thread that
    is never stopped: past its timeout it runs on, and one that holds the interpreter lock blocks the wait too"""


# ---------------------------------------------------------------------------------------------------------------------
# The formulas: one function each, tensors in and tensors out. A tensor over response tokens is (B, T) and
# travels with its response_mask (1 on the model's own tokens; 0 on tool output and after the response); every mean
# over tokens is a masked mean.


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the unmasked tokens of the whole batch, masked ones 0. all_sum adds every rank's part under
    torchrun; in one process it is the identity."""
    m = mask.to(x.dtype)
    count, total = all_sum(torch.stack([m.sum(), (x * m).sum()]))
    mean = total / count.clamp(min=1)
    var = all_sum(((x - mean) ** 2 * m).sum()) / count.clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * m


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


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """KL_t, a per-token estimate of KL(pi_theta || pi_ref) on tokens pi_theta sampled: k1 = log pi_theta(y_t) -
    log pi_ref(y_t), or another estimator of KL_ESTIMATORS (Part 2)."""
    log_ratio = logprobs - ref_logprobs
    return log_ratio if estimator == "k1" else KL_ESTIMATORS[estimator](log_ratio)


def kl_shaped_rewards(scores: torch.Tensor, kl: torch.Tensor, kl_coef: float, response_mask) -> torch.Tensor:
    """r_t = -beta * KL_t on every token of response_mask, plus the score on its last one (Ziegler et al. 2019): the
    reward model judges the whole response, so its verdict lands on the last token the policy chose."""
    rewards = -kl_coef * kl * response_mask
    last = (response_mask * torch.arange(1, response_mask.shape[1] + 1, device=kl.device)).argmax(1)  # last real one
    rewards[torch.arange(len(scores)), last] += scores
    return rewards


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float,
                lam) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2015):  A_t = delta_t + gamma*lambda*A_{t+1},  delta_t = r_t + gamma*V(s_{t+1}) - V(s_t),
    t+1 the next token of response_mask, V = 0 after its last; lam a float or (B,). (A, returns A + V), 0 if masked."""
    mask = response_mask.to(values.dtype)
    rewards, values = rewards * mask, values * mask
    lam = torch.as_tensor(lam, dtype=values.dtype, device=values.device).expand(values.shape[0])
    advantages = torch.zeros_like(values)
    next_advantage, next_value = torch.zeros_like(values[:, 0]), torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        real = mask[:, t].bool()  # a masked token (tool output) leaves A and the next value as they were
        next_advantage = torch.where(real, delta + gamma * lam * next_advantage, next_advantage)
        next_value = torch.where(real, values[:, t], next_value)
        advantages[:, t] = next_advantage * mask[:, t]
    return advantages, (advantages + values) * mask


def clipped_surrogate_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                           clip_eps: float, clip_eps_high: Optional[float] = None) -> tuple[torch.Tensor, ...]:
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
    clipped_sq = (old_values + torch.clamp(values - old_values, -clip_eps, clip_eps) - returns) ** 2
    # Clipped: the bound's loss won. Inside the range V_old + (V - V_old) can differ from V by rounding: not counted.
    clipped = (clipped_sq > unclipped) & ((values - old_values).abs() > clip_eps)
    return 0.5 * torch.maximum(unclipped, clipped_sq), clipped


def aggregate_loss(loss: torch.Tensor, response_mask: torch.Tensor, mode: str, num_tokens, num_seqs) -> torch.Tensor:
    """A per-token loss to a scalar: token-mean = sum / num_tokens, or another of LOSS_AGGREGATIONS (Part 2). The counts
    are the whole minibatch's, so that the micro-batches' terms add up to its loss: gradient accumulation is exact."""
    mask = response_mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * mask).sum() / num_tokens
    return LOSS_AGGREGATIONS[mode](loss, mask, num_tokens, num_seqs)


# ---------------------------------------------------------------------------------------------------------------------
# The rollout: 1. sample, 2. mask (response_mask), 3. score, 4. the forward passes of pi_old, pi_ref and the critic


@dataclass
class Batch:
    """One iteration's responses: each (B, T) tensor is over the response tokens; batch[rows] slices every tensor."""
    query_responses: torch.Tensor  # (B, P + T) left-padded prompt, then response
    attention_mask: torch.Tensor  # (B, P + T) 0 on padding, and after a response's end; 1 on tool output
    context_length: int  # P: the response starts at this position
    responses: torch.Tensor  # (B, T) the sampled tokens y_t and the tools' output, pad after the response
    response_mask: torch.Tensor  # (B, T) bool: the model's own tokens; tool output is tool_mask's
    has_eos: Optional[torch.Tensor] = None  # (B,) whether the response ended with EOS (else it was cut)
    tool_mask: Optional[torch.Tensor] = None  # (B, T) bool, tool output: attended to, never trained on; None: no tools
    tool_calls: Optional[torch.Tensor] = None  # (B,) the calls run or refused (not a last turn's past the limit)
    tool_failures: Optional[torch.Tensor] = None  # (B,) how many of them failed
    raw_scores: Optional[torch.Tensor] = None  # (B,) the reward model's or function's score
    logprobs: Optional[torch.Tensor] = None  # (B, T) log pi_old(y_t)
    ref_logprobs: Optional[torch.Tensor] = None  # (B, T) log pi_ref(y_t)
    values: Optional[torch.Tensor] = None  # (B, T) V(s_t), s_t = the prompt and the response before y_t
    scores: Optional[torch.Tensor] = None  # (B,) the score that enters the reward (shaped_scores, Part 2)
    kl: Optional[torch.Tensor] = None  # (B, T) KL_t
    rewards: Optional[torch.Tensor] = None  # (B, T) r_t
    advantages: Optional[torch.Tensor] = None  # (B, T) A_t
    returns: Optional[torch.Tensor] = None  # (B, T) A_t + V(s_t), the critic's targets

    def __getitem__(self, rows) -> Batch:
        return replace(self, **{f.name: getattr(self, f.name)[rows] for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


def rollout(models: Models, reward_fn: Optional[Callable], rows: list[dict], prompt_ids: list[list[int]],
            args: Args) -> Batch:
    """--num-generations responses to each prompt, their masks and scores, and log pi_old, log pi_ref and V(s_t)."""
    rows = [row for row in rows for _ in range(args.num_generations)]
    prompt_ids = [ids for ids in prompt_ids for _ in range(args.num_generations)]
    with models.autocast():  # every forward pass computes in --dtype
        batch = generate(models, prompt_ids, args, greedy=False)  # 1 and 2
        batch = replace(batch, raw_scores=score_responses(models, reward_fn, batch, rows, args))  # 3
        logprobs, ref_logprobs, values = forward_rollout(models, batch, args)  # 4
    return replace(batch, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values)


@torch.no_grad()
def generate(models: Models, prompt_ids: list[list[int]], args: Args, greedy: bool) -> Batch:
    """Left-padded prompts, each followed by a sampled (or greedy) response, or with tools generate_with_tools'."""
    if args.max_tool_calls:  # a response of several turns and tool calls instead
        return generate_with_tools(models, prompt_ids, args, greedy)
    input_ids, prompt_mask = left_pad(models.tokenizer, prompt_ids, models.device)
    responses = sample(models.policy, input_ids, prompt_mask, args.max_new_tokens, models.eos_token_ids, greedy,
                       args.temperature, args.top_p, args.top_k, args.min_p)
    response_mask, has_eos = response_mask_from_eos(responses, models.eos_token_ids)
    responses = responses.masked_fill(~response_mask, models.tokenizer.pad_token_id)
    return Batch(torch.cat([input_ids, responses], 1), torch.cat([prompt_mask, response_mask.long()], 1),
                 input_ids.shape[1], responses, response_mask, has_eos)


@torch.no_grad()
def generate_with_tools(models: Models, prompt_ids: list[list[int]], args: Args, greedy: bool) -> Batch:
    """The multi-turn rollout: generate a turn -> run its tool calls -> append their results -> generate the next turn,
    until a turn ends without calls (or without EOS), or calls once --max-tool-calls are made (not run), or the
    response, tool output included, reaches --max-new-tokens. A turn's calls past the limit get an error each. Token
    ids are only appended, never decoded and tokenized again."""
    n, budget, eos, tokenizer = len(prompt_ids), args.max_new_tokens, models.eos_token_ids, models.tokenizer
    responses, from_tool, calls, failures = [[] for _ in range(n)], [[] for _ in range(n)], [0] * n, [0] * n
    active, device = list(range(n)), models.device
    with unsharded(models.policy):  # under torchrun: the weights gathered once for all turns (each rank takes its own)
        while active:
            input_ids, mask = left_pad(tokenizer, [prompt_ids[i] + responses[i] for i in active], device)
            turns = sample(models.policy, input_ids, mask, budget - min(len(responses[i]) for i in active), eos,
                           greedy, args.temperature, args.top_p, args.top_k, args.min_p)
            kept, _ = response_mask_from_eos(turns, eos)
            for i, turn, keep in zip(active, turns.tolist(), kept.tolist()):
                turn = [token for token, k in zip(turn, keep) if k][: budget - len(responses[i])]  # its own budget
                responses[i] += turn
                from_tool[i] += [False] * len(turn)
                found = models.tools.calls_in(tokenizer.decode(turn), tokenizer) if turn[-1] in eos else []
                if not found or calls[i] >= args.max_tool_calls or len(responses[i]) >= budget:
                    continue  # the response ends here
                results = [models.tools.run(call, tokenizer) for call in found[: args.max_tool_calls - calls[i]]]
                results += [ToolResult("error: no more tool calls allowed", True)] * (len(found) - len(results))
                output = tool_message_ids(tokenizer, results, args, turn[-1])[: budget - len(responses[i])]
                responses[i] += output
                from_tool[i] += [True] * len(output)  # context, not actions: tool_mask, out of response_mask
                calls[i] += len(results)
                failures[i] += sum(result.failed for result in results)
            active = [i for i in active if from_tool[i][-1] and len(responses[i]) < budget]  # ended on tool output
    input_ids, prompt_mask = left_pad(tokenizer, prompt_ids, device)
    padded = tokenizer.pad({"input_ids": responses}, padding_side="right", return_tensors="pt").to(device)
    tool_mask = nn.utils.rnn.pad_sequence([torch.tensor(t) for t in from_tool], batch_first=True).to(device)
    has_eos = [r[-1] in eos and not t[-1] for r, t in zip(responses, from_tool)]
    return Batch(torch.cat([input_ids, padded["input_ids"]], 1), torch.cat([prompt_mask, padded["attention_mask"]], 1),
                 input_ids.shape[1], padded["input_ids"], padded["attention_mask"].bool() & ~tool_mask,
                 torch.tensor(has_eos, device=device), tool_mask=tool_mask,
                 tool_calls=torch.tensor(calls, device=device), tool_failures=torch.tensor(failures, device=device))


def policy_forward(model, batch: Batch, temperature: float, chunked: bool = False, entropy: bool = False,
                   hidden: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(log pi(y_t), H_t if entropy, the final hidden states if hidden) over the response tokens, from the model's
    logits z_t at the position before each y_t (logits_to_keep: none for the prompt's other positions)."""
    if chunked:  # Part 3: --chunked-logprobs, off by default: the same numbers up to rounding, a chunk at a time
        return chunked_policy_forward(model, batch, temperature, entropy, hidden)
    c = batch.context_length
    positions = torch.arange(c - 1, batch.query_responses.shape[1] - 1, device=batch.responses.device)
    out = model(input_ids=batch.query_responses, attention_mask=batch.attention_mask, use_cache=False,
                position_ids=position_ids_from(batch.attention_mask), logits_to_keep=positions,
                output_hidden_states=hidden)
    logprobs, h = logprobs_and_entropy(out.logits, batch.responses, temperature, entropy)
    return logprobs, h, out.hidden_states[-1][:, c - 1 : -1] if hidden else None


@torch.no_grad()
def forward_rollout(models: Models, batch: Batch, args: Args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log pi_old, log pi_ref, V(s_t)) on the response tokens, a micro-batch at a time."""
    logprobs, ref_logprobs, values = [], [], []
    for rows in micro_batches(len(batch.responses), args.micro_batch_size):
        mb = batch[rows]
        mb_logprobs, _, hidden = policy_forward(models.policy, mb, args.temperature, args.chunked_logprobs,
                                                hidden=args.shared_critic)  # Part 2: --shared-critic, off by default
        logprobs.append(mb_logprobs)
        with models.reference() as ref_policy:
            ref_logprobs.append(policy_forward(ref_policy, mb, args.temperature, args.chunked_logprobs)[0])
        values.append(critic_values(models, mb, hidden))
    return torch.cat(logprobs), torch.cat(ref_logprobs), torch.cat(values)


# ---------------------------------------------------------------------------------------------------------------------
# Rewards and advantages


def shape_rewards(batch: Batch, args: Args, kl_coef: float, state: dict) -> Batch:
    """The per-token rewards  r_t = -beta * KL_t,  plus the score on the last token of response_mask."""
    scores = batch.raw_scores
    if args.missing_eos_penalty or args.whiten_rewards or args.reward_clip is not None:  # Part 2: all off by default
        scores = shaped_scores(scores, batch.has_eos, args, state)
    kl = kl_penalty(batch.logprobs, batch.ref_logprobs, args.kl_estimator)  # Part 2: --kl-estimator, k1 by default
    kl = kl * batch.response_mask
    return replace(batch, scores=scores, kl=kl, rewards=kl_shaped_rewards(scores, kl, kl_coef, batch.response_mask))


def compute_advantages(batch: Batch, args: Args) -> Batch:
    """GAE advantages for the policy and returns A + V for the critic, the advantages whitened (over the batch)."""
    rewards, values, mask = batch.rewards, batch.values, batch.response_mask
    advantages, returns = compute_gae(rewards, values, mask, args.gamma, args.gae_lambda)
    if args.length_adaptive_alpha is not None:  # Part 2: --length-adaptive-alpha (VAPO), None by default
        policy_lambda = length_adaptive_lambda(mask.sum(1), args.length_adaptive_alpha)
        advantages = compute_gae(rewards, values, mask, args.gamma, policy_lambda)[0]
    if args.critic_gae_lambda is not None:  # Part 2: --critic-gae-lambda (VC-PPO), None (= --gae-lambda) by default
        returns = compute_gae(rewards, values, mask, args.gamma, args.critic_gae_lambda)[1]
    if args.advantage_whitening == "batch":  # Part 2: --advantage-whitening, batch by default (or minibatch, none)
        advantages = masked_whiten(advantages, mask)
    return replace(batch, advantages=advantages, returns=returns)


# ---------------------------------------------------------------------------------------------------------------------
# The update: K epochs x minibatches (one optimizer step each) x micro-batches (gradients accumulated)


def ppo_update(models: Models, optimizers: dict, batch: Batch, args: Args, train_policy: bool,
               generator: torch.Generator, ptx: Optional[dict]) -> dict:
    """K epochs over the batch, reshuffled each epoch into --num-minibatches minibatches of one optimizer step each;
    returns each statistic's mean over the minibatches that logged it, and whether --target-kl stopped the policy."""
    models.train()  # dropout stays off (but --lora-dropout); train mode turns gradient checkpointing on
    minibatch_size = len(batch.responses) // args.num_minibatches  # this rank's share; check_args made sure it divides
    history, stopped_in = {}, None  # stopped_in: the epoch in which --target-kl stopped the policy
    for epoch in range(args.num_epochs):
        if epoch > 0 and args.recompute_advantages:  # Part 2: --recompute-advantages, off by default
            batch = compute_advantages(replace(batch, values=recompute_values(models, batch, args)), args)
        order = torch.randperm(len(batch.responses), generator=generator).to(batch.responses.device)
        for start in range(0, len(order), minibatch_size):
            progress(f"updating: epoch {epoch + 1}/{args.num_epochs}, minibatch {start // minibatch_size + 1}")
            stats = minibatch_step(models, optimizers, batch[order[start : start + minibatch_size]], args,
                                   train_policy and stopped_in is None, ptx)
            if stats.pop("early_stop") and stopped_in is None:
                stopped_in = epoch
            for key, value in stats.items():
                history.setdefault(key, []).append(value)
    models.train(False)
    summary = {key: sum(v) / len(v) for key, v in history.items()}
    return dict(summary, **{"policy/early_stopped": float(stopped_in is not None),
                            "policy/epochs_completed": float(args.num_epochs if stopped_in is None else stopped_in)})


def minibatch_step(models: Models, optimizers: dict, mb: Batch, args: Args, train_policy: bool,
                   ptx: Optional[dict]) -> dict:
    """One optimizer step on one minibatch, its statistics returned. Each micro-batch's loss is divided by the whole
    minibatch's token and sequence counts: the micro-batches' gradients add up to the minibatch loss's."""
    if args.advantage_whitening == "minibatch":  # Part 2: --advantage-whitening, batch by default
        mb = replace(mb, advantages=masked_whiten(mb.advantages, mb.response_mask))
    mask = mb.response_mask
    # all_sum: the counts and sums over every rank's part of the minibatch under torchrun; in one process, x itself
    num_tokens, num_seqs = all_sum(torch.stack([mask.sum(), torch.tensor(len(mask), device=mask.device)])).clamp(min=1)
    totals = {}  # tensors, summed on the device and read once per minibatch
    for rows in micro_batches(len(mask), args.micro_batch_size):
        for key, value in micro_batch_backward(models, mb[rows], num_tokens, num_seqs, args, train_policy,
                                               ptx).items():
            totals[key] = totals.get(key, 0.0) + value
    stats = dict(zip(totals, all_sum(torch.stack(list(totals.values()))).tolist()))
    if not (math.isfinite(stats["losses/policy_loss"]) and math.isfinite(stats["losses/value_loss"])):
        raise NonFiniteLoss(f"policy loss {stats['losses/policy_loss']}, value loss {stats['losses/value_loss']}")
    # Part 2: --target-kl, None by default: the policy skips the minibatch that strays past it, and stops there
    stats["early_stop"] = train_policy and args.target_kl is not None and stats["policy/approx_kl"] > args.target_kl
    step_policy = train_policy and not stats["early_stop"]
    if args.shared_critic:  # Part 2: --shared-critic, off by default; its value head is a plain module under torchrun
        average_gradients(models.value_head)
    # Each network's gradient norm (logged before clipping) is clipped; a non-finite one stops the run before a step.
    if step_policy:
        stats["grad/policy_norm"] = clip_grad_norm(models.policy.parameters(), args.max_grad_norm, "policy")
    stats["grad/critic_norm"] = clip_grad_norm(models.critic_parameters(), args.max_grad_norm, "critic")
    if step_policy:
        optimizers["policy"].step()
    optimizers["critic"].step()
    for optimizer in optimizers.values():
        optimizer.zero_grad(set_to_none=True)
    models.policy.zero_grad(set_to_none=True)  # a frozen policy still gets a shared critic's gradient
    return stats


def micro_batch_backward(models: Models, mb: Batch, num_tokens, num_seqs, args: Args, train_policy: bool,
                         ptx: Optional[dict]) -> dict:
    """Forward one micro-batch and backward its part of the minibatch loss  L = L_clip - c2 * H + c1 * L_V  (+ PPO-ptx;
    policy frozen: c1 * L_V). Returns its parts of the minibatch's statistics: its sums over the minibatch's counts."""
    with models.autocast():
        with torch.set_grad_enabled(train_policy or args.shared_critic):  # a shared critic (off by default) too
            logprobs, entropy, hidden = policy_forward(models.policy, mb, args.temperature, args.chunked_logprobs,
                                                       entropy=True, hidden=args.shared_critic)
        values = critic_values(models, mb, hidden)
        ptx_lm_loss = ptx_loss(models, ptx, len(mb.responses), args.chunked_logprobs) * len(mb.responses) / num_seqs \
            if ptx and train_policy else None  # Part 2: PPO-ptx, --ptx-coef 0 by default
    if not (train_policy and args.ent_coef != 0):
        entropy = entropy.detach()  # reported, not trained on
    pg_tokens, ratio, clipped = clipped_surrogate_loss(logprobs, mb.logprobs, mb.advantages, args.clip_eps,
                                                       args.clip_eps_high)  # Part 2: --clip-eps-high, None by default
    if args.dual_clip is not None:  # Part 2: --dual-clip, None by default
        pg_tokens, clipped = dual_clip(pg_tokens, clipped, mb.advantages, args.dual_clip)
    vf_tokens, vf_clipped = clipped_value_loss(values, mb.values, mb.returns, args.value_clip_eps)
    pg_loss, entropy_bonus, vf_loss = (aggregate_loss(x, mb.response_mask, args.loss_aggregation, num_tokens, num_seqs)
                                       for x in (pg_tokens, entropy, vf_tokens))  # Part 2: token-mean by default
    loss = args.vf_coef * vf_loss
    if train_policy:
        loss = loss + pg_loss - args.ent_coef * entropy_bonus
    if ptx_lm_loss is not None:
        loss = loss + args.ptx_coef * ptx_lm_loss
    # Under torchrun the counts above are every rank's and FSDP averages the gradients over the N ranks: hence x N.
    (loss * world_size()).backward()
    # approx KL(pi_old || pi_theta) per token, k3 = w - 1 - log w with w = pi_theta / pi_old, since pi_old sampled the
    # tokens; log w bounded to [-20, 20], so that exp cannot overflow float32
    log_w = (logprobs.detach() - mb.logprobs).clamp(-20, 20)
    approx_kl = torch.expm1(log_w) - log_w
    stats = {"losses/policy_loss": pg_loss.detach(), "losses/value_loss": vf_loss.detach()}
    if ptx_lm_loss is not None:
        stats["losses/ptx_loss"] = ptx_lm_loss.detach()
    for key, x in (("policy/approx_kl", approx_kl), ("policy/clipfrac", clipped), ("policy/ratio", ratio.detach()),
                   ("policy/entropy", entropy.detach()), ("val/clipfrac", vf_clipped)):
        stats[key] = (x * mb.response_mask).sum() / num_tokens
    return stats


# ---------------------------------------------------------------------------------------------------------------------
# The training loop


def run_iteration(run: Run, train_policy: bool, step: int) -> dict:
    """One iteration on the prompts of `step` in the data order: rollout, rewards, advantages, update; its metrics."""
    models, state = run.models, run.state
    args = replace(run.args, ent_coef=state["ent_coef"])  # the coefficient in use: --entropy-target (Part 2) moves it
    with phase("rollout"):
        rows, prompt_ids = prompts_of_step(run.prompts, step, args)  # this rank's share of them
        batch = rollout(models, run.reward_fn, rows, prompt_ids, args)
    batch = compute_advantages(shape_rewards(batch, args, state["kl_coef"], state), args)
    metrics = rollout_metrics(batch, state["kl_coef"])
    generator = run.generator(step)  # the minibatches' order, and PPO-ptx's texts
    ptx = dict(ids=run.prompts.ptx_ids, generator=generator) if args.ptx_coef > 0 else None  # Part 2: PPO-ptx, 0
    with phase("update"):
        metrics.update(ppo_update(models, run.optimizers, batch, args, train_policy, generator, ptx))
    metrics["samples"] = samples_to_show(models, batch, rows, args.num_generations)  # three, for metrics.jsonl
    return {**metrics, **{f"time/{name}": seconds for name, seconds in PHASES.items()}, "train/ent_coef": args.ent_coef}


def train(args: Args) -> dict:
    """The run: --num-iterations iterations, each followed by its eval (every --eval-every), its console line and
    metrics row, and its checkpoint (every --save-every). Returns the eval reward before and after training."""
    with start_run(args) as run:  # Part 3: the checks, data, models and optimizers (or a checkpoint's)
        args, state = run.args, run.state
        if args.value_pretrain_steps and state["iteration"] == 0:  # Part 2: VC-PPO's value pretraining, 0 by default
            pretrain_values(run)
        while state["iteration"] < args.num_iterations:
            if stop := stop_signal():  # a signal since the last update: checkpoint (none before the first row), exit
                run.save_and_exit(stop)
            if state["iteration"] == 0 and args.eval_every > 0 and state["eval_before"] is None:  # not on a resume
                run.report(dict(iteration=0, **evaluate(run)))  # row 0: the eval before the first update
            iteration = state["iteration"]
            train_policy = iteration >= args.critic_warmup_iterations  # critic warmup: the policy is frozen
            for name, optimizer in run.optimizers.items():  # the policy's schedule starts after the critic warmup
                start = args.critic_warmup_iterations if name == "policy" else 0
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate_at(iteration - start, args.num_iterations - start,
                                                   run.learning_rates[name], args.lr_warmup_iterations, args.anneal_lr)
            metrics = run_iteration(run, train_policy, step=args.value_pretrain_steps + iteration)
            state["iteration"] = done = iteration + 1
            metrics.update({"iteration": done, "episodes": done * args.num_prompts * args.num_generations,
                            "train/policy_frozen": float(not train_policy), "lr/policy": run.optimizers["policy"].
                            param_groups[0]["lr"], "lr/critic": run.optimizers["critic"].param_groups[0]["lr"]})
            if args.kl_schedule != "fixed" and train_policy:  # Part 2: beta's schedule, fixed by default
                state["kl_coef"] = next_kl_coef(args, state, metrics["objective/kl"])
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
    """The rate at the schedule's `iteration`: the base rate, warmed up linearly over `warmup` iterations and (anneal)
    decayed linearly to 0 after the last; 0 before the schedule starts (a policy frozen by the critic warmup)."""
    if iteration < 0:
        return 0.0
    lr = base_lr * min(1.0, (iteration + 1) / warmup) if warmup > 0 else base_lr
    return lr * (1.0 - iteration / num_iterations) if anneal else lr


# ---------------------------------------------------------------------------------------------------------------------
# Part 2: the variants
# ---------------------------------------------------------------------------------------------------------------------
# Every alternative to a formula of Part 1, each with its knobs (a group of --help), its paper where it has one, and a
# function or table entry. Part 1 names each where it plugs in (--critic-init and --ptx-path act where the models and
# data load, in Part 3); with its knobs at their defaults each does nothing.


@dataclass
class KLVariants:
    """the KL estimator, and beta's schedule (Ziegler et al. 2019)"""

    kl_estimator: Literal["k1", "k2", "k3"] = "k1"  # k1 = log(p/q), k2 = (log(p/q))^2 / 2, k3 = q/p - 1 - log(q/p)
    kl_schedule: Literal["fixed", "linear", "adaptive"] = "fixed"  # or linear, or adaptive; held while policy is frozen
    kl_coef_final: float = 0.1  # beta at the last iteration with --kl-schedule linear
    kl_target: float = 0.1  # adaptive's target: the mean per-response sum_t KL_t (--kl-estimator's), objective/kl
    kl_horizon: int = 10000  # adaptive horizon in responses: larger = slower beta changes (Ziegler et al.: 10000)


# Per-token estimates of KL(pi_theta || pi_ref) on tokens y sampled by pi_theta, of x = log pi_theta(y) - log pi_ref(y)
# (Schulman 2020, "Approximating KL divergence"): k1 unbiased but negative on some tokens, k2 biased with low variance,
# k3 unbiased and never negative. In a reward only k1 gives the KL's own gradient; k2 and k3 estimate its value. k3's x
# is bounded to [-20, 20], as in verl (which also caps k3 at 10), so exp(-x) cannot overflow float32 (past x = -88).
KL_ESTIMATORS = {
    "k1": lambda x: x,
    "k2": lambda x: 0.5 * x**2,
    "k3": lambda x: torch.expm1(-x.clamp(-20, 20)) + x.clamp(-20, 20),
}


def next_kl_coef(args: Args, state: dict, kl: float) -> float:
    """beta for the next iteration from this one's mean KL per response (the linear schedule from the critic warmup)."""
    if args.kl_schedule == "linear":
        warmup = args.critic_warmup_iterations
        return linear_kl_coef(state["iteration"] - warmup, args.num_iterations - warmup, args.kl_coef,
                              args.kl_coef_final)
    return adaptive_kl_coef(state["kl_coef"], kl, args.kl_target, args.num_prompts * args.num_generations,
                            args.kl_horizon)


def adaptive_kl_coef(kl_coef: float, kl: float, kl_target: float, num_seqs: int, horizon: int) -> float:
    """Ziegler et al. 2019's proportional controller: e = clip(KL / target - 1, -0.2, 0.2),
    beta <- beta * (1 + e * n / horizon), KL being the mean per-response sum. KL above target raises beta."""
    error = min(max(kl / kl_target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * num_seqs / horizon)


def linear_kl_coef(iteration: int, num_iterations: int, kl_coef: float, kl_coef_final: float) -> float:
    """beta's linear schedule: from --kl-coef to --kl-coef-final, linearly over the iterations of the schedule."""
    return kl_coef + (kl_coef_final - kl_coef) * min(iteration / max(num_iterations - 1, 1), 1.0)


@dataclass
class ScoreShaping:
    """the score before it enters the reward: a penalty for a missing EOS, running whitening, clipping"""

    missing_eos_penalty: float = 0.0  # subtracted from the score of a response that ends without EOS (e.g. 1.0)
    whiten_rewards: bool = False  # normalise scores with a running mean/std over all iterations so far
    reward_clip: Optional[float] = None  # clip scores to [-c, c] after whitening; None = off (e.g. 5)


def shaped_scores(raw_scores: torch.Tensor, has_eos: torch.Tensor, args: Args, state: dict) -> torch.Tensor:
    """The score that enters the reward: the raw one, minus --missing-eos-penalty without EOS, whitened with the running
    moments of every batch so far (--whiten-rewards; kept in state), clipped to [-c, c] (--reward-clip)."""
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
    new_var = (var * count + batch_var * n + delta**2 * count * n / total) / total
    return mean + delta * n / total, new_var, total


# VC-PPO (Yuan et al. 2025, arXiv:2503.01491) decouples GAE's lambdas: the critic learns from lambda = 1 returns,
# unbiased, while the policy's advantages keep a lower-variance lambda < 1.
@dataclass
class AdvantageVariants:
    """the critic's own GAE lambda (VC-PPO), a length-adaptive one (VAPO), recomputed advantages, where to whiten"""

    critic_gae_lambda: Optional[float] = None  # lambda of the critic's returns; None = --gae-lambda (VC-PPO: 1.0)
    length_adaptive_alpha: Optional[float] = None  # the policy's lambda = max(0, 1 - 1/(alpha * length)); VAPO: 0.05
    recompute_advantages: bool = False  # each epoch after the first: values, returns, advantages from the new critic
    advantage_whitening: Literal["batch", "minibatch", "none"] = "batch"  # mean 0, std 1 over the batch or minibatch


def length_adaptive_lambda(response_lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO (Yue et al. 2025, arXiv:2504.05118): lambda = max(0, 1 - 1 / (alpha * l)) per response of l tokens."""
    return (1.0 - 1.0 / (alpha * response_lengths.float().clamp(min=1))).clamp(min=0.0)


@torch.no_grad()
def recompute_values(models: Models, batch: Batch, args: Args) -> torch.Tensor:
    """V(s_t) under the critic as it is now, for --recompute-advantages (value clipping then centres on them)."""
    values = []
    with models.autocast():
        for rows in micro_batches(len(batch.responses), args.micro_batch_size):
            hidden = policy_forward(models.policy, batch[rows], args.temperature, args.chunked_logprobs,
                                    hidden=True)[2] if args.shared_critic else None
            values.append(critic_values(models, batch[rows], hidden))
    return torch.cat(values)


@dataclass
class LossVariants:
    """Clip-Higher, Dual-Clip, the loss aggregation and the target-KL early stop"""

    clip_eps_high: Optional[float] = None  # upper clip epsilon (DAPO's Clip-Higher, e.g. 0.28); None = --clip-eps
    dual_clip: Optional[float] = None  # Dual-Clip c (about 3): for A < 0 the loss is at most -c*A; None = off
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"  # L_clip, L_V, H: over tokens or rows
    target_kl: Optional[float] = None  # the policy stops at a minibatch whose per-token k3 KL(pi_old || pi) exceeds it


def dual_clip(loss: torch.Tensor, clipped: torch.Tensor, advantages: torch.Tensor, c: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-Clip (Ye et al. 2020, arXiv:1912.09729): for A < 0 the clipped loss is capped at -c*A, so that a ratio far
    past 1 + eps cannot push with an unbounded weight; (loss, clipped), the capped tokens counted as clipped.
    Clip-Higher (DAPO, Yu et al. 2025, arXiv:2503.14476) is clipped_surrogate_loss's eps_high."""
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
    shared_critic: bool = False  # value head on the policy's backbone; only the head learns while the policy is frozen
    value_pretrain_steps: int = 0  # VC-PPO: rollouts before RL train the critic alone (shared: its head) at base rate


def pretrain_values(run: Run) -> None:
    """VC-PPO's value pretraining (Yuan et al. 2025): --value-pretrain-steps rollouts train the critic alone on Monte
    Carlo returns (lambda = 1) at its base rate, so that GAE starts from values that mean something. Each step's row is
    iteration 0 of metrics.jsonl with its value_pretrain_step; SIGTERM or Ctrl-C checkpoints after the step."""
    monte_carlo = replace(run, args=replace(run.args, critic_gae_lambda=1.0))
    for group in run.optimizers["critic"].param_groups:
        group["lr"] = run.learning_rates["critic"]
    while (step := run.state["value_pretrain_steps_done"]) < run.args.value_pretrain_steps:
        if stop := stop_signal():  # a signal since the last step: checkpoint (none before the first row), exit
            run.save_and_exit(stop)
        metrics = run_iteration(monte_carlo, train_policy=False, step=step)
        run.state["value_pretrain_steps_done"] = step + 1
        run.log.log(dict(metrics, iteration=0, value_pretrain_step=step + 1, **{
            "train/policy_frozen": 1.0, "lr/critic": run.learning_rates["critic"]}))
        ev = metrics["val/explained_variance"]  # None where Var(R) = 0
        print(f"value pretraining {step + 1}/{run.args.value_pretrain_steps} | value loss "
              f"{metrics['losses/value_loss']:.4f} | ev {math.nan if ev is None else ev:.2f}")


@dataclass
class PretrainingMix:
    """PPO-ptx: a language-modelling loss on pretraining text mixed into the policy's (Ouyang et al. 2022)"""

    ptx_coef: float = 0.0  # the weight of the pretraining LM loss in the policy loss (InstructGPT); 0 = off
    ptx_path: Optional[str] = None  # a plain-text file, one document per line


def ptx_loss(models: Models, ptx: dict, count: int, chunked: bool) -> torch.Tensor:
    """PPO-ptx (Ouyang et al. 2022): the policy's mean next-token cross-entropy  -mean_t log pi(x_t | x_<t)  on
    `count` random pretraining texts, through policy_forward's log-probs."""
    picked = torch.randint(len(ptx["ids"]), (count,), generator=ptx["generator"]).tolist()
    input_ids, attention_mask = left_pad(models.tokenizer, [ptx["ids"][i] for i in picked], models.device)
    mask = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()  # each position predicts the next token
    texts = Batch(input_ids, attention_mask, 1, input_ids[:, 1:], mask)
    return -(policy_forward(models.policy, texts, 1.0, chunked)[0] * mask).sum() / mask.sum()


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
    if args.entropy_target is not None and not metrics["train/policy_frozen"]:  # not on a frozen policy's entropy
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


# ---------------------------------------------------------------------------------------------------------------------
# Part 3: the machinery
# ---------------------------------------------------------------------------------------------------------------------
# Arguments: the run's knobs, Args, --help's groups, every knob's range, the checks.


@dataclass
class PolicyAndReward:
    """the policy (also the frozen reference), the reward, and LoRA"""

    model_name_or_path: str = str(DEMO / "model")  # the policy and reference: a local directory or a Hub name
    reward_model_path: Optional[str] = None  # a sequence classifier (a .score head), one label, the policy's tokenizer
    reward_fn: str = "exact_match"  # or last_number, module:function, file.py:function; unused with a reward model
    lora_r: int = 0  # LoRA rank: policy and critic train adapters (peft), the reference is without them; 0 = off
    lora_alpha: float = 16.0  # LoRA scale: the adapters add alpha/r * B A to each target weight
    lora_dropout: float = 0.0  # dropout on the adapters' input in the update; 0 keeps its log-probs the sampler's
    lora_target_modules: Optional[list[str]] = None  # e.g. q_proj v_proj; None = every linear layer but the heads


@dataclass
class Data:
    """prompts to train and evaluate on"""

    prompts_path: str = str(DEMO / "train.jsonl")  # a .jsonl file, or a dataset directory (datasets.load_dataset)
    eval_prompts_path: str = str(DEMO / "eval.jsonl")  # prompts greedy-decoded for eval/reward, in the same forms
    prompt_field: str = "prompt"  # the rows' prompt field (gsm8k: question); the others reach the reward function
    answer_field: str = "answer"  # the field exact_match and last_number compare with, given to them as 'answer'
    dataset_split: str = "train"  # split of a dataset directory named by --prompts-path
    eval_dataset_split: str = "test"  # split of a dataset directory named by --eval-prompts-path
    chat_template: bool = False  # wrap each prompt as a user turn with the tokenizer's chat template
    max_prompt_length: int = 256  # longer prompts lose their first tokens, or with tools' schemas are an error


@dataclass
class Experiment:
    """where the run writes, how often it evaluates and saves, what it reports"""

    output_dir: Optional[str] = None  # metrics.jsonl, checkpoints, final policy: runs/ppo, or --resume-from's run
    overwrite: bool = False  # delete an earlier run in --output-dir at the first row, once every check has passed
    seed: int = 1  # seeds torch, random and NumPy: on CPU the same metrics (but time/) with a deterministic reward
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype (autocast); the trained weights stay float32
    gradient_checkpointing: bool = False  # trade compute for memory in the policy and critic forward passes
    chunked_logprobs: bool = False  # log-probs a chunk at a time (equal up to rounding): pays at vocabulary x length
    fsdp: bool = False  # under torchrun: shard weights, gradients and optimizer states with FSDP2 (else replicate)
    track: bool = False  # also write TensorBoard logs to <output-dir>/tb (needs the tensorboard package)
    wandb_project: Optional[str] = None  # with --track, also log to this Weights & Biases project (needs wandb)
    eval_every: int = 5  # greedy eval before iteration 1, every this many and after the last; none after a signal
    save_every: int = 20  # write <output-dir>/checkpoint-N every this many iterations and the last; 0 = if interrupted
    resume_from: Optional[str] = None  # a checkpoint-N to go on from; the flags must match (RESUME_MAY_CHANGE aside)
    doctor: Literal["warn", "off"] = "warn"  # watch the metrics for instability, and name the knob to turn


# --help shows one group per section, in this order
SECTIONS = dict(rewards_and_advantages=RewardsAndAdvantages, losses=Losses, optimisation=Optimisation,
                generation=Generation, kl_variants=KLVariants, score_shaping=ScoreShaping,
                advantage_variants=AdvantageVariants, loss_variants=LossVariants, critic_variants=CriticVariants,
                pretraining_mix=PretrainingMix, reference_and_entropy=ReferenceAndEntropy,
                policy_and_reward=PolicyAndReward, data=Data, experiment=Experiment)


@dataclass
class Args(Experiment, Data, PolicyAndReward, ReferenceAndEntropy, PretrainingMix, CriticVariants, LossVariants,
           AdvantageVariants, ScoreShaping, KLVariants, Generation, Optimisation, Losses, RewardsAndAdvantages):
    """Every knob, flat."""


def parse_args(argv: list[str]) -> Args:
    """The flags, parsed as one group per section (--help's groups) without a prefix, then made flat."""
    Flags = make_dataclass("Flags", [(name, group, field(default_factory=group)) for name, group in SECTIONS.items()])
    flags = tyro.cli(Flags, args=argv, config=(tyro.conf.OmitArgPrefixes,))
    return Args(**{key: value for name in SECTIONS for key, value in vars(getattr(flags, name)).items()})


# The valid range of every numeric knob. None (off) is always valid for an Optional knob; NaN never is.
RANGES = {
    "(0, inf)": "num_iterations num_prompts num_epochs num_minibatches micro_batch_size num_generations max_new_tokens "
                "max_prompt_length adam_eps target_kl kl_target kl_horizon reward_clip value_clip_eps "
                "clip_eps_high length_adaptive_alpha ent_coef_delta lora_alpha max_tool_output_tokens",
    "[0, inf)": "kl_coef kl_coef_final vf_coef ent_coef learning_rate critic_learning_rate weight_decay top_k "
                "lr_warmup_iterations critic_warmup_iterations value_pretrain_steps missing_eos_penalty ptx_coef "
                "entropy_target ent_coef_min ent_coef_max ref_sync_every lora_r eval_every save_every max_tool_calls",
    "[0, 1]": "gamma gae_lambda critic_gae_lambda", "(0, 1]": "top_p ref_sync_alpha", "(0, 1)": "clip_eps",
    "[0, 1)": "min_p lora_dropout", "(1, inf)": "dual_clip", "[0.001, inf)": "temperature", "[0, 2**64)": "seed",
    "(0, inf]": "max_grad_norm", "(0, 1e9]": "tool_timeout",  # a thread waits at most threading.TIMEOUT_MAX
}

# A flag set to anything but its default while this condition is false would do nothing: an error, not a no-op.
ONLY_WITH = [
    ("wandb_project", "does nothing without --track", lambda a: a.track),
    ("dataset_split", "does nothing with a .jsonl --prompts-path", lambda a: not a.prompts_path.endswith(".jsonl")),
    ("eval_prompts_path", "does nothing with --eval-every 0", lambda a: a.eval_every > 0),
    ("eval_dataset_split", "does nothing with --eval-every 0 or a .jsonl --eval-prompts-path",
     lambda a: a.eval_every > 0 and not a.eval_prompts_path.endswith(".jsonl")),
    ("ptx_path", "does nothing without --ptx-coef > 0", lambda a: a.ptx_coef > 0),
    ("reward_fn", "does nothing with --reward-model-path, which gives the reward", lambda a: not a.reward_model_path),
    ("kl_coef_final", "does nothing without --kl-schedule linear", lambda a: a.kl_schedule == "linear"),
    ("recompute_advantages", "does nothing with --num-epochs 1", lambda a: a.num_epochs > 1),
    ("advantage_whitening", "minibatch is batch with --num-minibatches 1",
     lambda a: a.advantage_whitening != "minibatch" or a.num_minibatches > 1),
    *((name, "does nothing without --kl-schedule adaptive", lambda a: a.kl_schedule == "adaptive")
      for name in ("kl_target", "kl_horizon")),
    *((name, "does nothing without --entropy-target", lambda a: a.entropy_target is not None)
      for name in ("ent_coef_delta", "ent_coef_min", "ent_coef_max")),
    *((name, "does nothing while beta is 0 (the reference only enters through the KL)",
       lambda a: a.kl_coef > 0 or (a.kl_schedule == "linear" and a.kl_coef_final > 0)) for name in ("ref_sync_every",
                                                                                                 "kl_estimator")),
    ("answer_field", "does nothing with --reward-model-path", lambda a: not a.reward_model_path),
    ("ref_sync_alpha", "does nothing without --ref-sync-every", lambda a: a.ref_sync_every > 0),
    ("fsdp", "does nothing in one process (launch with torchrun --nproc_per_node N)", lambda a: launched_ranks() > 1),
    *((name, "does nothing with --lora-r 0", lambda a: a.lora_r > 0)
      for name in ("lora_alpha", "lora_dropout", "lora_target_modules")),
    ("max_tool_calls", "does nothing without --tools (calculator is built in)", lambda a: bool(a.tools)),
    *((name, "does nothing without --max-tool-calls", lambda a: a.max_tool_calls > 0)
      for name in ("tools", "max_tool_output_tokens", "tool_timeout")),
]

# What --resume-from accepts changed: the output and logging knobs, the memory and speed knobs (the same gradients up to
# rounding, but PPO-ptx's texts and token mean per micro-batch), --num-iterations (stretching annealing, linear beta).
RESUME_MAY_CHANGE = {"num_iterations", "output_dir", "overwrite", "resume_from", "eval_every", "eval_prompts_path",
                     "eval_dataset_split", "save_every", "track", "wandb_project", "doctor", "gradient_checkpointing",
                     "chunked_logprobs", "micro_batch_size", "fsdp"}


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
    for name, why, needed in ONLY_WITH:
        if getattr(args, name) != getattr(Args, name) and not needed(args):
            raise ConfigError(f"{as_flag(name)} {why}")
    per_rank = exact_div(args.num_prompts, launched_ranks(), "--num-prompts must split over the torchrun ranks")
    exact_div(per_rank * args.num_generations, args.num_minibatches, "--num-prompts x --num-generations (per rank) "
              "must split into --num-minibatches")  # micro-batches need not: the loss's counts are the minibatch's
    high = args.clip_eps if args.clip_eps_high is None else args.clip_eps_high
    for conflict, message in (
            (args.dual_clip is not None and args.dual_clip <= 1 + high, f"--dual-clip {args.dual_clip} must exceed 1 "
             f"+ the upper clip epsilon ({1 + high:g})"),
            (args.kl_schedule == "adaptive" and args.kl_coef == 0, "--kl-schedule adaptive needs --kl-coef > 0"),
            (args.kl_schedule == "adaptive" and args.kl_horizon <= 0.2 * args.num_prompts * args.num_generations,
             f"--kl-horizon must exceed 0.2 x the batch ({args.num_prompts * args.num_generations} responses)"),
            (args.critic_init == "reward" and (not args.reward_model_path or args.shared_critic),
             "--critic-init reward needs --reward-model-path and a separate critic (no --shared-critic)"),
            (args.ptx_coef > 0 and not (args.ptx_path and os.path.isfile(args.ptx_path)),
             f"--ptx-coef needs --ptx-path, a text file ({args.ptx_path} is none)"),
            (args.lora_r > 0 and (launched_ranks() > 1 or args.ref_sync_every > 0), "--lora-r trains in one process, "
             "without --ref-sync-every (its reference is the policy with the adapters off)"),
            (args.entropy_target is not None and not args.ent_coef_min <= args.ent_coef <= args.ent_coef_max,
             "--ent-coef must lie in [--ent-coef-min, --ent-coef-max]: adaptive entropy control starts there"),
            (not args.prompt_field or not args.answer_field or args.prompt_field == args.answer_field,
             "--prompt-field and --answer-field must be two different, non-empty field names"),
            (args.output_dir == "" or args.resume_from == "", "--output-dir and --resume-from must name a directory"),
            (args.prompts_path != Data.prompts_path and args.eval_prompts_path == Data.eval_prompts_path and
             args.eval_every > 0, "--prompts-path needs --eval-prompts-path (else the demo's eval) or --eval-every 0"),
            (int(transformers.__version__.split(".")[0]) < 5, f"transformers {transformers.__version__}: this script "
             "needs transformers 5 or later (pip install -U transformers)")):
        if conflict:
            raise ConfigError(message)
    for flag, wanted, package in (("--track", args.track, "tensorboard"), ("--lora-r", args.lora_r, "peft"),
                                  ("--wandb-project", args.wandb_project, "wandb")):
        if wanted and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{flag} needs the {package} package: pip install {package}")
    for flag, p in (("--model-name-or-path", args.model_name_or_path), ("--reward-model-path", args.reward_model_path)):
        if p and (p[:1] in "/~" or p.count("/") > 1 or os.path.isdir(p.split("/")[0])) and not os.path.isdir(p):
            raise ConfigError(f"{flag} {p}: no such directory")  # demo/x is a path (demo/ exists), Qwen/x a Hub id


def exact_div(a: int, b: int, what: str) -> int:
    if a % b != 0:
        raise ConfigError(f"{what}: {a} is not divisible by {b}")
    return a // b


def default_learning_rates(num_params: int) -> tuple[float, float]:
    """(policy, critic) learning rates by the policy's parameter count: about a tenth of fine-tuning's."""
    for limit, rates in ((10e6, (3e-4, 1e-3)), (300e6, (1e-5, 1e-4)), (3e9, (3e-6, 1e-5))):
        if num_params < limit:
            return rates
    return 1e-6, 5e-6


# ---------------------------------------------------------------------------------------------------------------------
# Data and rewards: prompt files, tokenization, the reward functions and the reward model.


class Prompts:
    """Every prompt of the run as token ids beside its row (the fields the reward reads), and PPO-ptx's texts."""

    def __init__(self, rows: list[dict], eval_rows: list[dict], tokenizer, args: Args, tools: Optional[list] = None):
        self.rows, self.eval_rows = rows, eval_rows
        self.ids = tokenize_prompts(tokenizer, rows, args, f"--prompts-path {args.prompts_path}", tools)
        self.eval_ids = tokenize_prompts(tokenizer, eval_rows, args, f"--eval-prompts-path {args.eval_prompts_path}",
                                         tools)
        texts = [text for text in read_text(args.ptx_path, "--ptx-path").splitlines() if text.strip()] \
            if args.ptx_coef else []
        if args.ptx_coef and not texts:
            raise ConfigError(f"--ptx-path {args.ptx_path}: no text")
        ids = tokenize_prompts(tokenizer, [{"prompt": text} for text in texts], replace(
            args, chat_template=False, max_prompt_length=2**62), f"--ptx-path {args.ptx_path}")  # whole, plain text
        self.ptx_ids = [i[: args.max_prompt_length + args.max_new_tokens - 1] + [tokenizer.eos_token_id] for i in ids]


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
            if clash := {"prompts", "completions", "tool_calls", "tool_failures"} & row.keys():
                raise ConfigError(f"{place}: a field named {min(clash)} is a reward function's argument")
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ConfigError(f"{place}: no prompt: each row needs a non-empty text in the field {args.prompt_field!r}")
        answer, builtin = row.get("answer"), args.reward_fn in BUILTIN_REWARD_FNS and not args.reward_model_path
        if builtin and not (isinstance(answer, (str, int)) or isinstance(answer, float) and math.isfinite(answer)):
            raise ConfigError(f"{place}: --reward-fn {args.reward_fn} needs a text or a number in the field "
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


def tokenize_prompts(tokenizer, rows: list[dict], args: Args, where: str, tools=None) -> list[list[int]]:
    """Token ids of every prompt (with --chat-template, a user turn after the tools' schemas), cut from the left to
    --max-prompt-length (with tools and --chat-template an error: the start holds the schemas)."""
    encoded = []
    for n, row in enumerate(rows, 1):
        try:  # a template that fails to render, a character the tokenizer cannot encode (a lone surrogate)
            text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tools=tools,
                                                 tokenize=False, add_generation_prompt=True) \
                if args.chat_template else row["prompt"]
            encoded.append(tokenizer(text, add_special_tokens=not args.chat_template)["input_ids"])
        except Exception as e:
            raise ConfigError(f"{where}, row {n}: the tokenizer cannot encode its prompt ({why(e)})") from None
    if (truncated := sum(len(ids) > args.max_prompt_length for ids in encoded)) and tools and args.chat_template:
        raise ConfigError(f"{where}: {truncated} prompts with the tools' schemas are longer than --max-prompt-length "
                          f"{args.max_prompt_length} tokens, and cut from the left they would lose the schemas")
    if truncated:
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
def score_responses(models: Models, reward_fn: Optional[Callable], batch: Batch, rows: list[dict],
                    args: Args) -> torch.Tensor:
    """Raw scores: the reward model's, else the reward function's on the whole text, tool output included (built-ins
    on the last turn), also given each response's tool_calls and tool_failures."""
    if models.reward_model is not None:
        return reward_model_scores(models.reward_model, batch, args.micro_batch_size)
    completions = models.tokenizer.batch_decode(batch.responses, skip_special_tokens=True)
    if batch.tool_mask is not None:
        rows = [dict(row, tool_calls=c, tool_failures=f) for row, c, f in zip(rows, batch.tool_calls.tolist(),
                                                                                 batch.tool_failures.tolist())]
        if reward_fn in BUILTIN_REWARD_FNS.values():  # they judge the final answer: the text after the last tool output
            completions = last_turns(models.tokenizer, batch)
    return call_reward_fn(reward_fn, args.reward_fn, [r["prompt"] for r in rows], completions, rows).to(models.device)


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


# ---------------------------------------------------------------------------------------------------------------------
# Tools: the built-in calculator, --tools, a turn's calls parsed and run, the tool message that carries results back.


@dataclass
class ToolResult:
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
    ARITHMETIC's operators alone, every value (and a power, x**y, before it is computed) within 10**300 in size, so
    never slow; a tiny power (2**-1000) is computed."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and type(node.op) in ARITHMETIC:
        value = ARITHMETIC[type(node.op)](arithmetic(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
        left, right = arithmetic(node.left), arithmetic(node.right)
        if isinstance(node.op, ast.Pow) and left != 0 and not right * math.log10(abs(left)) <= 300:
            raise ValueError(f"{ast.unparse(node)} is past 10**300")
        value = ARITHMETIC[type(node.op)](left, right)
    else:
        raise ValueError(f"{ast.unparse(node)!r} is not arithmetic: numbers and + - * / // % ** only")
    if isinstance(value, complex) or not abs(value) <= 10**300:  # a fractional power of a negative number, inf
        raise ValueError(f"{ast.unparse(node)} is past 10**300 or not a real number")
    return value


class Toolbox:
    """The functions of --tools by name, and their JSON schemas from their type hints and docstrings."""

    def __init__(self, args: Args, tokenizer):
        self.functions, self.schemas, self.timeout = {}, [], args.tool_timeout
        for spec in args.tools:
            fn = load_function(spec, "--tools", {"calculator": calculator})
            try:  # what apply_chat_template(tools=...) renders
                self.schemas.append(transformers.utils.get_json_schema(fn))
            except Exception as e:  # no type hints, or an argument that the docstring's Args section leaves out
                raise ConfigError(f"--tools {spec}: no JSON schema from its signature and docstring ({e})") from None
            if (name := self.schemas[-1]["function"]["name"]) in self.functions:
                raise ConfigError(f"--tools {spec}: a second tool named {name}; the model calls a tool by its name")
            self.functions[name] = fn
        try:  # a chat template that cannot render a tool message after a turn: an error now, not mid-run
            ids = tool_message_ids(tokenizer, [ToolResult("4217", False)], replace(args, max_tool_output_tokens=9),
                                   tokenizer.eos_token_id)
            shown = tokenizer.decode(ids)
        except Exception as e:  # jinja2's, for a template that refuses the tool role
            shown = f"{type(e).__name__}: {e}"
        if "4217" not in shown:
            raise ConfigError(f"--tools: {args.model_name_or_path}'s tokenizer cannot write a tool message ({shown})")

    def calls_in(self, text: str, tokenizer) -> list:
        """The tool calls in a turn's text (dicts, or a ToolResult for one that cannot be parsed): by the tokenizer's
        response parser where it has one (transformers' parse_response), else as Hermes <tool_call>{...}</tool_call>."""
        if getattr(tokenizer, "response_template", None):
            try:
                message = tokenizer.parse_response(text, prefix="", tools=self.schemas)
            except Exception as e:
                return [ToolResult(f"error: the tool call cannot be parsed ({type(e).__name__}: {e})", True)]
            return [call.get("function", call) for call in message.get("tool_calls") or []]
        calls = []
        for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
            try:
                calls.append(json.loads(body))
            except (ValueError, RecursionError) as e:  # malformed, or nested past the recursion limit
                calls.append(ToolResult(f"error: the tool call is not valid JSON ({e})", True))
        return calls

    def run(self, call, tokenizer) -> ToolResult:
        """One call's result: the tool's output, or an error that goes back to the model: its call cannot be parsed or
        names no tool, or the tool raised, returned what the tokenizer cannot encode or ran past --tool-timeout."""
        if isinstance(call, ToolResult):  # it could not be parsed
            return call
        name = call.get("name") if isinstance(call, dict) else None
        if not isinstance(name, str) or name not in self.functions:
            return ToolResult(f"error: there is no tool {name!r}; the tools are {', '.join(self.functions)}", True)
        outcome = []

        def attempt() -> None:
            try:
                text = str(self.functions[name](**call.get("arguments", {})))
                tokenizer(text)  # an output it cannot encode (a lone surrogate) would vanish from the tool message
                outcome.append(ToolResult(text, False))
            except BaseException as e:  # SystemExit too: the tool's failure, not the run's
                outcome.append(ToolResult(f"error: {name} failed: {type(e).__name__}: {e}", True))
        thread = threading.Thread(target=attempt, daemon=True)  # one past its timeout is left running
        thread.start()
        thread.join(self.timeout)
        return outcome[0] if outcome else ToolResult(f"error: {name} ran past --tool-timeout {self.timeout:g}s", True)


def tool_message_ids(tokenizer, results: list[ToolResult], args: Args, end_of_turn_id: int) -> list[int]:
    """The ids that carry a turn's results back, each cut to --max-tool-output-tokens: what the chat template writes
    after the model's end-of-turn token (tool messages, the next header), or <tool_response>...</tool_response>."""
    cut = [tokenizer.decode(tokens_of(tokenizer, result.text)[: args.max_tool_output_tokens], skip_special_tokens=True)
           for result in results]  # without special tokens: a tool that writes <|im_end|> ends no turn
    if not args.chat_template:
        return tokens_of(tokenizer, "".join(f"<tool_response>{text}</tool_response>" for text in cut))
    turn = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
    before = tokenizer.apply_chat_template(turn, tokenize=False)
    after = tokenizer.apply_chat_template(turn + [{"role": "tool", "content": text} for text in cut], tokenize=False,
                                          add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("a tool message changes how the earlier turns render")
    end, written = before[before.rindex("!") + 1 :], tokenizer.decode([end_of_turn_id])
    rest = end[len(written) :] if end.startswith(written) else ""  # e.g. the newline after <|im_end|>
    return tokens_of(tokenizer, rest + after[len(before) :])


def tokens_of(tokenizer, text: str) -> list[int]:
    """The text's token ids; none where the vocabulary cannot spell it (the demo's, an error message)."""
    try:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    except Exception:  # the tokenizers library's own error type
        return []


def last_turns(tokenizer, batch: Batch) -> list[str]:
    """Each response's text after its last tool output: what the built-in rewards judge."""
    starts = (batch.tool_mask * torch.arange(1, batch.tool_mask.shape[1] + 1, device=batch.tool_mask.device)).amax(1)
    return tokenizer.batch_decode([r[s:] for r, s in zip(batch.responses, starts.tolist())], skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------------------------------
# Models and LoRA: the tokenizer, the policy, the reference, the reward model and the critic, and the optimizers.


@dataclass
class Models:
    """The four models of RLHF PPO, the tokenizer and tools; with LoRA the reference is the policy, adapters off."""
    tokenizer: transformers.PreTrainedTokenizerBase
    policy: nn.Module
    ref_policy: Optional[nn.Module]  # None with LoRA
    reward_model: Optional[nn.Module]  # None with a reward function
    critic: Optional[nn.Module]  # None with --shared-critic
    value_head: Optional[nn.Linear]  # only with --shared-critic
    eos_token_ids: list[int]
    device: torch.device
    dtype: torch.dtype  # what forward passes compute in: --dtype
    tools: Optional[Toolbox] = None  # what the policy may call, with --max-tool-calls

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
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def train(self, mode: bool = True) -> None:
        """Train mode for the update: dropout stays off (but --lora-dropout); --gradient-checkpointing acts."""
        for model in [model for model in (self.policy, self.critic) if model is not None]:
            model.train(mode)


def load_models(args: Args, tokenizer, device: torch.device, resume: Optional[Path]) -> Models:
    """The models of the run, from the flags' paths or the checkpoint resumed (with LoRA: its adapters). Under
    torchrun every rank loads the full weights, then keeps its shard (or, without --fsdp, its replica)."""
    saved = resume if resume is not None and not args.lora_r else None  # whole models in the checkpoint
    policy = load_model(AutoModelForCausalLM, saved / "policy" if saved else args.model_name_or_path, args, device)
    stop_ids = eos_token_ids(tokenizer, policy, args.chat_template)
    if args.lora_r:
        policy = add_lora(policy, args, resume / "policy" if resume else None)
    policy = shard(policy, args)  # each model sharded as soon as it is loaded: one model's full weights at a time
    synced = resume is not None and args.ref_sync_every > 0  # the checkpoint's reference, mixed toward the policy
    ref_policy = None if args.lora_r else shard(load_model(
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
    critic = value_head = None
    if args.shared_critic:  # zero at the start, or the checkpoint's
        value_head = nn.Linear(policy.config.get_text_config().hidden_size, 1).to(device)
        nn.init.zeros_(value_head.weight)
        nn.init.zeros_(value_head.bias)
        if resume:
            value_head.load_state_dict(torch.load(resume / "value_head.pt", map_location=device, weights_only=True))
    else:  # the policy with a fresh scalar head (the same on every rank: all are seeded alike), or the reward model
        initial = args.reward_model_path if args.critic_init == "reward" else args.model_name_or_path
        critic = load_model(AutoModelForSequenceClassification, saved / "critic" if saved else initial, args, device,
                            fresh_head=not saved and args.critic_init == "policy", num_labels=1)
        critic = shard(add_lora(critic, args, resume / "critic" if resume else None, "SEQ_CLS") if args.lora_r
                       else critic, args)  # with LoRA its own adapters, and its score head trained in full
    return Models(tokenizer, policy, ref_policy, reward_model, critic, value_head, stop_ids, device,
                  getattr(torch, args.dtype))


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


def load_model(cls, path, args: Args, device: torch.device, trainable: bool = True, fresh_head: bool = False,
               dtype: torch.dtype = torch.float32, **kwargs):
    """The model in float32 unless told otherwise (forward passes compute in --dtype). Weights missing (they would start
    random) or unused (fewer layers in the config) are an error, but a fresh_head (a critic made from the policy)."""
    try:
        model, info = cls.from_pretrained(path, dtype=dtype, output_loading_info=True, trust_remote_code=False,
                                          **kwargs)
    except (OSError, ValueError) as e:  # no such directory or Hub name, no config or weights there
        raise ConfigError(f"{path}: cannot load ({why(e)})") from None
    missing = [key for key in info["missing_keys"] if not (fresh_head and key.startswith("score."))]
    if missing:
        raise ConfigError(f"{path}: the checkpoint has no weights for {', '.join(missing[:3])}, which would start "
                          f"random (is it a {cls.__name__.removeprefix('AutoModelFor')} model?)")
    unused = [key for key in info["unexpected_keys"] if not (fresh_head and key.startswith("lm_head."))]
    if unused:  # a config.json with fewer layers than the weights would train, and save, a truncated model
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


def add_lora(model: nn.Module, args: Args, saved_adapters: Optional[Path], task_type: str = "CAUSAL_LM") -> nn.Module:
    """The model with trainable low-rank adapters (peft; the checkpoint's on resume), its own weights frozen but a
    critic's score head (SEQ_CLS); model.disable_adapter() gives back the untouched model."""
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
            peft.get_peft_model(model, peft.LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, task_type=task_type,
                                                       lora_dropout=args.lora_dropout,
                                                       target_modules=targets or "all-linear"))
    except ValueError as e:  # a module peft cannot wrap (a norm layer)
        raise ConfigError(f"--lora-target-modules {' '.join(targets)}: peft cannot place adapters there ({why(e)})"
                          ) from None
    if args.gradient_checkpointing:  # the frozen embeddings' output must carry a gradient into checkpointed layers
        model.enable_input_require_grads()
    return model


def make_optimizers(models: Models, args: Args) -> tuple[dict, dict]:
    """AdamW for the policy and the critic, and their base learning rates (the flags', or by the policy's size)."""
    num_params = sum(p.numel() for p in models.policy.parameters())  # a sharded tensor counts whole
    rates = dict(zip(("policy", "critic"), default_learning_rates(num_params)))
    for name, given in (("policy", args.learning_rate), ("critic", args.critic_learning_rate)):
        if given is not None:
            rates[name] = given
        else:
            print(f"{name} learning rate {rates[name]:g}, by the policy's size ({num_params / 1e6:.1f}M parameters)"
                  + ("; LoRA usually wants about 10x" if args.lora_r else ""))
    trained = dict(policy=[p for p in models.policy.parameters() if p.requires_grad], critic=models.critic_parameters())
    # fused: one kernel per step over all tensors, without a temporary per tensor
    optimizers = {name: torch.optim.AdamW(trained[name], lr=rates[name], eps=args.adam_eps,
                                          weight_decay=args.weight_decay, fused=True) for name in trained}
    return optimizers, rates


def critic_values(models: Models, batch: Batch, policy_hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
    """V(s_t) for each response token t: the critic's head at the position before t (or the shared value head's)."""
    if models.value_head is not None:
        return models.value_head(policy_hidden.to(models.value_head.weight.dtype)).squeeze(-1).float()
    c = batch.context_length
    return scalar_forward(models.critic, batch.query_responses, batch.attention_mask)[:, c - 1 : -1]


def scalar_forward(model, query_responses, attention_mask) -> torch.Tensor:
    """Per-position scalar from a sequence-classification model: head(backbone hidden states), shape (B, L)."""
    if hasattr(model, "get_base_model"):  # LoRA: the model under peft's wrapper, its adapters in place
        model = model.get_base_model()
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


def chunked_policy_forward(model, batch: Batch, temperature: float, entropy: bool, hidden: bool):
    """policy_forward's numbers through ResponseLogprobs: from the final hidden states and output_head's head (the
    (B, T, vocab) logits never held whole) where there is one, else from the model's logits, log-softmaxed in chunks."""
    head, c = output_head(model), batch.context_length
    positions = torch.arange(c - 1, batch.query_responses.shape[1] - 1, device=batch.responses.device)
    out = model(input_ids=batch.query_responses, attention_mask=batch.attention_mask, use_cache=False,
                position_ids=position_ids_from(batch.attention_mask), output_hidden_states=hidden or head is not None,
                logits_to_keep=positions[:0] if head is not None else positions)  # no logits when the head is ours
    states = out.hidden_states[-1][:, c - 1 : -1] if hidden or head is not None else None
    x = states if head is not None else out.logits
    weight, bias = (head.weight, head.bias) if head is not None else (None, None)
    logprobs, h = ResponseLogprobs.apply(x.reshape(-1, x.shape[-1]), weight, bias, batch.responses.reshape(-1),
                                         temperature, entropy, torch.is_grad_enabled())
    shape = batch.responses.shape
    return logprobs.view(shape), h.view(shape) if entropy else None, states if hidden else None


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
           temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> torch.Tensor:
    """The (B, T) tokens y_t ~ next_token_probs(logits_t) (or its argmax, greedy) until each has EOS or max_new_tokens:
    not transformers' generate, which takes unset knobs from the model's generation config (a repetition penalty)."""
    model.eval()
    eos = torch.tensor(eos_token_ids, device=input_ids.device)
    positions = position_ids_from(attention_mask)
    tokens, ended = [], torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)
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
                        cache=out.cache, use_cache=True)  # transformers 5's name (before: past_key_values)
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


def average_gradients(module: nn.Module) -> None:
    """A plain module's gradients averaged over the ranks, as FSDP averages the others' (the shared value head)."""
    for p in module.parameters() if world_size() > 1 else []:
        dist.all_reduce(p.grad)
        p.grad /= world_size()


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


UNSHARDED = set()  # the FSDP units that an enclosing unsharded() holds gathered: nested, it gathers nothing


@contextlib.contextmanager
def unsharded(model: nn.Module):
    """The full weights, gathered once for a whole sample() (or rollout: nested, it gathers nothing), so that ranks
    may decode different numbers of tokens."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m not in UNSHARDED]
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
    optimizers: dict
    learning_rates: dict  # each optimizer's base rate, before warmup and annealing
    reward_fn: Optional[Callable]  # None: the reward model scores
    prompts: Prompts
    state: dict  # what a checkpoint keeps besides weights, optimizers and rows: iteration, beta, ent_coef, evals, ...
    log: MetricsLog
    start_time: float

    def generator(self, step: int) -> torch.Generator:
        """The random stream of a step's minibatch order and PPO-ptx texts, seeded by the step (for resume)."""
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
        if self.state["saved_at"] != [self.state["iteration"], self.state["value_pretrain_steps_done"]]:
            save_checkpoint(self)  # else that checkpoint was just written, or is the one resumed from
        print(run_summary(self, stopped=True), flush=True)
        print(f"interrupted at iteration {self.state['iteration']}; resume with --resume-from "
              f"{Path(self.args.output_dir) / ('checkpoint-' + str(self.state['iteration']))}", file=sys.stderr)
        raise SystemExit(128 + signum)

    def finish(self) -> dict:
        """The final policy saved, and the run's last line; returns the eval reward before and after training."""
        for optimizer in self.optimizers.values():  # their states (twice the weights trained) go before the save
            optimizer.state.clear()
        save_policy(self.models, Path(self.args.output_dir) / "policy")
        print(run_summary(self, stopped=False), flush=True)
        return dict(eval_before=self.state["eval_before"], eval_after=self.state["eval_after"])

    def __exit__(self, kind, error, traceback) -> None:
        """However the run ends: the logs closed, the process group left; a non-finite loss one line naming it."""
        self.log.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        if isinstance(error, NonFiniteLoss):
            last = checkpoints_in(Path(self.args.output_dir))
            step = self.state["value_pretrain_steps_done"]
            where = f"value pretraining step {step + 1}" if step < self.args.value_pretrain_steps else \
                f"iteration {self.state['iteration'] + 1}"
            raise ConfigError(f"non-finite loss in {where} ({error}); stopped without saving it; "
                              f"{f'the last checkpoint is {last[-1]}' if last else 'no checkpoint'}")


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
    signum = torch.tensor(STOP[-1] if STOP else 0)
    if world_size() > 1:
        dist.all_reduce(signum, op=dist.ReduceOp.MAX)
    return int(signum)


def start_run(args: Args) -> Run:
    """Check the flags, the checkpoint, the output directory and the prompts before any model loads; load the models
    and optimizers (and the checkpoint's state). What --overwrite or a resume replaces goes at the first row."""
    device = init_distributed()
    check_args(args)  # then local paths made absolute: a reward function may change the working directory, or resume
    local = {name: os.path.abspath(path) for name in ("model_name_or_path", "reward_model_path", "prompts_path",
             "eval_prompts_path", "ptx_path", "resume_from") if (path := getattr(args, name)) and os.path.exists(path)}
    output_dir = args.output_dir or (Path(args.resume_from).parent if args.resume_from else "runs/ppo")
    args = replace(args, output_dir=os.path.abspath(output_dir), **local)  # a Hub name stays as it is
    training_state = read_checkpoint(args) if args.resume_from else None
    earlier = earlier_run(args, training_state["iteration"] if training_state else 0)
    rows = load_prompts(args.prompts_path, "--prompts-path", args.dataset_split, args)
    eval_rows = load_prompts(args.eval_prompts_path, "--eval-prompts-path", args.eval_dataset_split,
                             args) if args.eval_every > 0 else []
    reward_fn = None if args.reward_model_path else load_function(args.reward_fn, "--reward-fn", BUILTIN_REWARD_FNS)
    tokenizer = load_tokenizer(args.model_name_or_path, args.chat_template)
    tools = Toolbox(args, tokenizer) if args.max_tool_calls else None
    prompts = Prompts(rows, eval_rows, tokenizer, args, tools and tools.schemas)
    seed_everything(args.seed)
    models = load_models(args, tokenizer, device, Path(args.resume_from) if args.resume_from else None)
    models.tools = tools
    context = getattr(models.policy.config.get_text_config(), "max_position_embeddings", None) or math.inf
    if max(map(len, prompts.ids + prompts.eval_ids)) + args.max_new_tokens > context or max(
            map(len, prompts.ptx_ids), default=0) > context:  # a PPO-ptx text: --max-prompt-length + --max-new-tokens
        raise ConfigError(f"the longest prompt (or PPO-ptx text) plus --max-new-tokens {args.max_new_tokens} is past "
                          f"max_position_embeddings {context}; lower --max-prompt-length or --max-new-tokens")
    if world_size() > 1:  # every rank samples its own responses
        seed_everything(args.seed + 1_000_003 * rank())
    print(f"stop tokens: {' '.join(tokenizer.convert_ids_to_tokens(models.eos_token_ids))}")
    optimizers, learning_rates = make_optimizers(models, args)
    state = dict(iteration=0, kl_coef=args.kl_coef, reward_mean=0.0, reward_var=1.0, reward_count=0, eval_before=None,
                 eval_after=None, ent_coef=args.ent_coef, value_pretrain_steps_done=0, saved_at=None)
    if training_state is not None:
        load_training_state(training_state, models, optimizers)
        state.update({key: training_state.get(key, value) for key, value in state.items()})  # a new key: its start
        print(f"resumed from {args.resume_from} at iteration {state['iteration']}")
    log = MetricsLog(args, training_state["rows"] if training_state else None, earlier)
    print(f"output: {args.output_dir}/ gets metrics.jsonl (every iteration)"
          + (f", checkpoint-N (every {args.save_every} iterations)" if args.save_every else "")
          + ", policy/ (at the end)" + (", tb/ (TensorBoard)" if args.track else ""), flush=True)
    return Run(args, models, optimizers, learning_rates, reward_fn, prompts, state, log, time.time())


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


def save_policy(models: Models, path: Path) -> None:
    """The final policy (with LoRA, merged) and tokenizer, written whole; every rank gathers, rank 0 writes."""
    state_dict = None if models.ref_policy is None else full_state_dict(models.policy)
    if rank() == 0:
        with written_whole(path) as tmp:
            policy = models.policy.merge_and_unload() if models.ref_policy is None else models.policy
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
    """<output-dir>/checkpoint-N, written whole: the trained models (LoRA's adapters), a synced reference, the
    optimizers, the state and metrics rows, every rank's torch, CUDA, Python and NumPy random states; rank 0 writes."""
    models, args, path = run.models, run.args, Path(run.args.output_dir) / f"checkpoint-{run.state['iteration']}"
    run.state["saved_at"] = [run.state["iteration"], run.state["value_pretrain_steps_done"]]  # kept in the checkpoint
    lora = models.ref_policy is None
    saved = dict(policy=models.policy, critic=models.critic,
                 reference=models.ref_policy if args.ref_sync_every else None)
    weights = {name: None if lora else full_state_dict(model) for name, model in saved.items() if model is not None}
    trained = dict(policy=models.policy, critic=models.critic if models.critic is not None else models.value_head)
    optimizers = {name: optimizer_state(trained[name], optimizer) for name, optimizer in run.optimizers.items()}
    numpy_state = numpy.random.get_state()  # ("MT19937", keys, position, has_gauss, gauss): keys as a list
    rng = all_gather_objects(dict(torch=torch.get_rng_state(), python=random.getstate(),
                                  numpy=(numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]),
                                  cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []))
    if rank() == 0:
        with written_whole(path) as tmp:
            for name, state_dict in weights.items():
                saved[name].save_pretrained(tmp / name, state_dict=state_dict)
            models.tokenizer.save_pretrained(tmp / "policy")
            if models.value_head is not None:
                torch.save(models.value_head.state_dict(), tmp / "value_head.pt")
            torch.save(dict(run.state, script="ppo", args=asdict(args), world_size=world_size(), rng=rng,
                            optimizers=optimizers, rows=run.log.rows), tmp / "training_state.pt")
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
    if not isinstance(state, dict) or state.get("script") != "ppo":
        raise ConfigError(f"{where}: not a checkpoint of ppo_llm.py or its variants")
    if state["world_size"] != launched_ranks():  # each rank continues its own sampler
        raise ConfigError(f"{where}: written by {state['world_size']} rank(s), resumed with {launched_ranks()}; resume "
                          f"with torchrun --nproc_per_node {state['world_size']}")
    if unknown := sorted(set(state["args"]) - set(asdict(args))):  # written by a variant with more flags
        raise ConfigError(f"{where}: written with flags this script lacks ({', '.join(map(as_flag, unknown))})")
    saved = {**asdict(Args()), **state["args"]}  # a flag newer than the checkpoint had its default then
    changed = [f"{as_flag(k)} {saved[k]} in the checkpoint, {v} now" for k, v in asdict(args).items()
               if k not in RESUME_MAY_CHANGE and saved[k] != v]
    if changed:
        raise ConfigError(f"{where}: flags differ from the run that wrote it: {'; '.join(changed)}")
    if args.num_iterations < state["iteration"]:
        raise ConfigError(f"--num-iterations {args.num_iterations} is below the checkpoint's {state['iteration']}")
    return state


def load_training_state(training_state: dict, models: Models, optimizers: dict) -> None:
    """The optimizers' states and this rank's random states, loaded."""
    trained = dict(policy=models.policy, critic=models.critic if models.critic is not None else models.value_head)
    for name, optimizer in optimizers.items():
        if training_state["optimizers"][name] is not None:  # saved before its first step: nothing to load
            dcp.set_optimizer_state_dict(trained[name], optimizer, training_state["optimizers"][name],
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


def rollout_metrics(batch: Batch, kl_coef: float) -> dict:
    """objective/ (scores, kl: the mean of sum_t KL_t, rewards, kl_coef), rollout/ (response_mask's length, EOS rate),
    val/ (means, explained variance 1 - Var(R - V) / Var(R), None where Var(R) = 0) over every rank's responses."""
    mask = batch.response_mask
    whole = {key: gather_cat(value.double()) for key, value in dict(
        raw_scores=batch.raw_scores, kl=batch.kl.sum(1), rlhf_reward=batch.rewards.sum(1), scores=batch.scores,
        lengths=mask.sum(1), has_eos=batch.has_eos, values=batch.values[mask], returns=batch.returns[mask]).items()}
    var_returns = whole["returns"].var(unbiased=False).item()
    errors = (whole["returns"] - whole["values"]).var(unbiased=False).item()
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
        "val/explained_variance": 1 - errors / var_returns if var_returns > 0 else None,
        **(tool_metrics(batch) if batch.tool_mask is not None else {}),
    }


def tool_metrics(batch: Batch) -> dict:
    """Calls per response, the share of calls that failed, the share of response tokens that are tool output."""
    calls, failed, tool, model = (gather_cat(x.double()) for x in (
        batch.tool_calls, batch.tool_failures, batch.tool_mask.sum(1), batch.response_mask.sum(1)))
    return {"tools/calls_per_response": calls.mean().item(),
            "tools/failure_rate": failed.sum().item() / max(calls.sum().item(), 1),
            "tools/token_fraction": tool.sum().item() / max((tool + model).sum().item(), 1)}


def samples_to_show(models: Models, batch: Batch, rows: list[dict], num_generations: int) -> list[tuple]:
    """[prompt, completion, score] of the batch's first three responses (num_generations of each row's prompt)."""
    completions = models.tokenizer.batch_decode(batch.responses[:3], skip_special_tokens=True)
    return [(rows[i // num_generations]["prompt"], c, s) for i, (c, s) in enumerate(zip(completions,
                                                                                       batch.raw_scores.tolist()))]


@torch.no_grad()
def evaluate(run: Run) -> dict:
    """Greedy decoding of the eval prompts: eval/reward is the mean raw score. Under torchrun each rank decodes 1/N,
    the last prompts repeated to an equal share (the sharded models need every rank) and left out of the means."""
    args, models, prompts = run.args, run.models, run.prompts
    share = math.ceil(len(prompts.eval_rows) / world_size())
    mine = list(range(rank() * share, min((rank() + 1) * share, len(prompts.eval_rows))))
    padded = mine + [mine[-1] if mine else 0] * (share - len(mine))
    scores, lengths, eos = [], [], []
    calls = []  # with tools, each response's tool calls
    step = args.num_prompts * args.num_generations // world_size()  # what a rollout samples on each rank
    for first in range(0, share, step):
        progress(f"evaluating: prompts {first + 1}-{min(first + step, share)} of {share}")
        inds = padded[first : first + step]
        with models.autocast():
            batch = generate(models, [prompts.eval_ids[i] for i in inds], args, greedy=True)
            scores.append(score_responses(models, run.reward_fn, batch, [prompts.eval_rows[i] for i in inds], args))
        lengths.append(batch.response_mask.sum(1).float())
        eos.append(batch.has_eos.float())
        calls += [batch.tool_calls.float()] if batch.tool_calls is not None else []
    progress("")
    return {key: gather_cat(torch.cat(values)[: len(mine)]).mean().item() for key, values in (
        ("eval/reward", scores), ("eval/response_length", lengths), ("eval/eos_rate", eos),
        *([("eval/tool_calls_per_response", calls)] if calls else []))}


class MetricsLog:
    """<output-dir>/metrics.jsonl (rank 0 writes) and TensorBoard and W&B with --track; rows: every row so far, from the
    checkpoint's on. No file is deleted or written before the first row, every check passed (the reward's too)."""

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
        if "value_pretrain_step" in metrics:  # TensorBoard and W&B plot one row per iteration
            return
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
COLUMNS = [("score", "objective/scores", ".3f"), ("kl", "objective/kl", ".3f"), ("ent", "policy/entropy", ".3f"),
           ("clip", "policy/clipfrac", ".3f"), ("ev", "val/explained_variance", ".2f"),
           ("len", "rollout/response_length", ".1f")]


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
    return "add a KL penalty (--kl-coef 0.05)" if a.kl_coef == 0 else "raise --kl-coef" + (
        " or use --kl-schedule adaptive" if a.kl_schedule == "fixed" else "")


NO_EOS = "--missing-eos-penalty 1.0, or raise --max-new-tokens"
# (signal, the metric of each row, the test of its window medians m (oldest first), the warning with value, threshold
# and knobs). A critic with nothing left to predict hovers about explained variance 0: hence -0.1.
DOCTOR_SIGNALS = [
    ("kl_high", lambda row: row["objective/kl"] / max(row["rollout/response_length"], 1), lambda m, a: m[-1] > 0.3,
     lambda m, a: f"KL to the reference {m[-1]:.3f} per token > 0.3: {beta_knob(a)}, then lower --clip-eps"),
    ("reward_collapse", "objective/scores", lambda m, a: m[-1] <= 0 < max(m),
     lambda m, a: f"training score fell to {m[-1]:.3f} <= 0 from {max(m):.3f}: check the reward, then {beta_knob(a)} "
                  "in a new run (a resume keeps the flags)"),
    ("clipfrac_high", "policy/clipfrac", lambda m, a: m[-1] > 0.2,
     lambda m, a: f"clip fraction {m[-1]:.3f} > 0.2: raise --clip-eps, or lower --learning-rate or --num-epochs"),
    ("entropy_collapse", "policy/entropy", lambda m, a: m[-1] < 0.01,
     lambda m, a: f"entropy {m[-1]:.4f} < 0.01 per token: raise --ent-coef or --temperature, or --clip-eps-high"),
    ("grad_norm_high", "grad/policy_norm", lambda m, a: m[-1] > 5.0,
     lambda m, a: f"policy gradient norm {m[-1]:.2f} > 5.0 before clipping: lower --learning-rate"),
    ("critic_grad_norm_high", "grad/critic_norm", lambda m, a: m[-1] > 5.0,
     lambda m, a: f"critic gradient norm {m[-1]:.2f} > 5.0 before clipping: lower --critic-learning-rate"),
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


def doctor_findings(history: list[dict], args: Args) -> dict[str, str]:
    """{signal: its warning} for each signal of DOCTOR_SIGNALS that the medians of every DOCTOR_WINDOW consecutive
    rows so far show now; rows of a frozen policy and row 0 (the eval before training) left out."""
    rows = [row for row in history if not row.get("train/policy_frozen") and "objective/kl" in row]
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
