"""Tests for ppo_llm.py: one behaviour per test, expected values derived independently (a plain loop, a
hand-computed case, or an identity from the design documents). End-to-end runs use the script as a subprocess
on tiny models built here from a config, so nothing is ever downloaded.

Run: python -m pytest -q test_ppo_llm.py
"""

import ast
import dataclasses
import contextlib
import inspect
import io
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import string
import subprocess
import re
import sys
import textwrap
import threading
import typing
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import tyro
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

import ppo_llm
from conftest import CHARS, EOS, PAD, REAL_MODEL_ENV, SUBPROCESS_ENV, VOCAB, char_tokenizer, greedy_last_numbers, llama_config, non_timing, read_metrics, succeeded, write_jsonl
from ppo_llm import (
    Args,
    ConfigError,
    adaptive_kl_coef,
    aggregate_loss,
    batch_indices,
    call_reward_fn,
    clipped_surrogate_loss,
    clipped_value_loss,
    compute_advantages,
    compute_gae,
    default_learning_rates,
    entropy_from_logprobs,
    exact_match_reward,
    kl_penalty,
    kl_shaped_rewards,
    last_number_reward,
    learning_rate_at,
    length_adaptive_lambda,
    linear_kl_coef,
    PromptFile,
    disable_dropout,
    eos_token_ids,
    load_function,
    masked_whiten,
    response_mask_from_eos,
    tokenize_prompts,
    update_running_moments,
)

REPO = Path(__file__).resolve().parent
SCRIPT = REPO / "ppo_llm.py"
DEMO_MODEL = REPO / "demo" / "model"  # its tokenizer knows digits, '+', '=' and nothing else (no <unk>)
# ---------------------------------------------------------------------------------------------------------
# Tiny models and data, built once per module from a config (the same from_pretrained path as a real model)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    policy = LlamaForCausalLM(llama_config(PAD))
    paths = {}
    # Same weights, three tokenizers: a distinct pad, no pad at all, and pad == EOS.
    for name, pad_token, pad_id in (("policy", "<pad>", PAD), ("nopad", None, None), ("padeos", "<eos>", EOS)):
        paths[name] = root / name
        policy.config.pad_token_id = pad_id
        policy.save_pretrained(paths[name])
        char_tokenizer(pad_token).save_pretrained(paths[name])
    paths["rm"] = root / "rm"
    LlamaForSequenceClassification(llama_config(PAD, num_labels=1)).save_pretrained(paths["rm"])
    char_tokenizer("<pad>").save_pretrained(paths["rm"])

    def additions(pairs):
        return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]

    # Training prompts of different lengths, so batches are left-padded.
    paths["train"] = write_jsonl(root / "train.jsonl", additions([(37, 48), (3, 4), (15, 43), (8, 61), (5, 7)]))
    # Eval prompts share one length, so greedy decoding needs no padding and can be checked prompt by prompt.
    paths["eval"] = write_jsonl(root / "eval.jsonl", additions([(12, 34), (56, 17), (40, 40), (99, 11)]))
    paths["empty_dir"] = root / "empty_dir"
    paths["empty_dir"].mkdir()
    paths["empty_prompts"] = write_jsonl(root / "empty.jsonl", [])
    paths["malformed_prompts"] = root / "malformed.jsonl"
    paths["malformed_prompts"].write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", \n')
    paths["promptless_rows"] = write_jsonl(root / "promptless.jsonl", [{"question": "1+1=", "answer": "2"}])
    paths["solutions"] = write_jsonl(root / "solutions.jsonl", [{"question": "1+1=", "solution": "2"}])
    (root / "bad_rewards.py").write_text(
        "def raises(prompts, completions, **kw):\n"
        "    raise ValueError('boom')\n"
        "def wrong_length(prompts, completions, **kw):\n"
        "    return [0.0]\n"
        "def nan(prompts, completions, **kw):\n"
        "    return [float('nan')] * len(completions)\n"
        "calls = 0\n"
        "def blows_up_on_second_call(prompts, completions, **kw):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    return [0.0 if calls == 1 else 3e38] * len(completions)\n"
    )
    paths["bad_rewards"] = root / "bad_rewards.py"
    paths["latin1_prompts"] = root / "latin1.jsonl"
    paths["latin1_prompts"].write_bytes('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\u00e9", "answer": "2"}\n'.encode("latin-1"))
    paths["answerless_eval"] = write_jsonl(root / "answerless_eval.jsonl", additions([(1, 2), (3, 4)]) + [{"prompt": "5+6="}])
    paths["completions_field"] = write_jsonl(root / "completions_field.jsonl", [{"prompt": "1+1=", "answer": "2", "completions": 1}])
    paths["letter_prompts"] = write_jsonl(root / "letters.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1+x=", "answer": "2"}])
    paths["empty_prompt"] = write_jsonl(root / "empty_prompt.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "", "answer": "0"}])
    paths["huge_int_prompts"] = root / "huge_int.jsonl"
    paths["huge_int_prompts"].write_text('{"prompt": "1+1=", "answer": ' + "9" * 5000 + "}\n")  # past json's 4300 digits
    paths["no_tokenizer"] = root / "no_tokenizer"
    policy.save_pretrained(paths["no_tokenizer"])  # weights and config, but no tokenizer files
    paths["root"] = root
    return SimpleNamespace(**paths)


def script_flags(tiny, output_dir, *flags, model=None):
    """The command line of a run with tiny budgets; flags given later override the ones here."""
    return [
        "--model-name-or-path", str(model or tiny.policy),
        "--prompts-path", str(tiny.train),
        "--eval-prompts-path", str(tiny.eval),
        "--output-dir", str(output_dir),
        "--num-iterations", "2", "--num-prompts", "4", "--micro-batch-size", "2", "--max-new-tokens", "4",
        "--eval-every", "1", "--sample-every", "0", "--save-every", "0",
        *map(str, flags),
    ]


def run_script(tiny, output_dir, *flags, model=None):
    """The script as a user runs it, with tiny budgets; returns the CompletedProcess."""
    command = [sys.executable, str(SCRIPT), *script_flags(tiny, output_dir, *flags, model=model)]
    return subprocess.run(command, cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300)


def run_main(tiny, output_dir, *flags, model=None):
    """ppo_llm.main() in this process on run_script's command line: the same code path, without the seconds of
    starting Python and importing torch for every run. Returns what the subprocess would: the exit code, stdout, and
    stderr with sys.exit's message on it, as the interpreter prints it."""
    argv = [str(SCRIPT), *script_flags(tiny, output_dir, *flags, model=model)]
    stdout, stderr = io.StringIO(), io.StringIO()
    with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            ppo_llm.main()
            code = 0
        except SystemExit as e:
            code = e.code
    if code is not None and not isinstance(code, int):
        print(code, file=stderr)
        code = 1
    return subprocess.CompletedProcess(argv, code or 0, stdout.getvalue(), stderr.getvalue())


def weights_differing(before, after, prefix=""):
    """Names of the tensors in `before` starting with `prefix` whose values differ from the same name in `after`."""
    return [name for name, tensor in before.items() if name.startswith(prefix) and not torch.equal(tensor, after[name])]


# ---------------------------------------------------------------------------------------------------------
# GAE (Schulman et al. 2015): a plain Python loop is the reference
# ---------------------------------------------------------------------------------------------------------


def gae_reference(rewards, values, lengths, gamma, lams):
    """A_t = delta_t + gamma*lambda*A_{t+1}, delta_t = r_t + gamma*V_{t+1} - V_t, V = 0 after the last real token;
    one Python loop per sequence, zeros after its length."""
    advantages, returns = [], []
    for r, v, n, lam in zip(rewards.tolist(), values.tolist(), lengths, lams):
        adv, running = [0.0] * len(r), 0.0
        for t in reversed(range(n)):
            next_value = v[t + 1] if t + 1 < n else 0.0
            running = r[t] + gamma * next_value - v[t] + gamma * lam * running
            adv[t] = running
        advantages.append(adv)
        returns.append([adv[t] + v[t] if t < n else 0.0 for t in range(len(r))])
    return torch.tensor(advantages, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)


def prefix_mask(lengths, width):
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]


def random_batch(lengths, width, seed=0):
    """Random rewards and values everywhere, masked positions included (they must be ignored)."""
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(len(lengths), width, generator=generator, dtype=torch.float64)
    values = torch.randn(len(lengths), width, generator=generator, dtype=torch.float64)
    return rewards, values, prefix_mask(lengths, width)


def test_compute_gae_matches_a_python_loop_on_ragged_sequences():
    lengths = [5, 2, 7, 1]
    rewards, values, mask = random_batch(lengths, 7)
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    expected_advantages, expected_returns = gae_reference(rewards, values, lengths, 0.9, [0.8] * 4)
    torch.testing.assert_close(advantages, expected_advantages)
    torch.testing.assert_close(returns, expected_returns)


def test_compute_gae_is_zero_on_masked_positions():
    lengths = [5, 2, 7, 1]
    rewards, values, mask = random_batch(lengths, 7)
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert advantages[~mask].abs().max() == 0
    assert returns[~mask].abs().max() == 0


def test_gae_with_gamma_and_lambda_one_is_return_minus_value():
    lengths = [4, 2, 6]
    rewards, values, mask = random_batch(lengths, 6, seed=1)
    advantages, _ = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    for b, n in enumerate(lengths):
        for t in range(n):
            reward_to_go = sum(rewards[b, k].item() for k in range(t, n))
            assert advantages[b, t].item() == pytest.approx(reward_to_go - values[b, t].item())


def test_gae_with_reward_only_on_last_token_gives_every_token_the_same_return():
    lengths = [4, 2, 6]
    _, values, mask = random_batch(lengths, 6, seed=2)
    scores = [0.7, -1.3, 2.0]
    rewards = torch.zeros(3, 6, dtype=torch.float64)
    for b, n in enumerate(lengths):
        rewards[b, n - 1] = scores[b]
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    for b, n in enumerate(lengths):
        assert returns[b, :n].tolist() == pytest.approx([scores[b]] * n)
        assert advantages[b, :n].tolist() == pytest.approx([scores[b] - v for v in values[b, :n].tolist()])


def test_gae_with_lambda_zero_is_the_one_step_td_error():
    lengths = [4, 2, 6]
    rewards, values, mask = random_batch(lengths, 6, seed=3)
    gamma = 0.9
    advantages, _ = compute_gae(rewards, values, mask, gamma=gamma, lam=0.0)
    for b, n in enumerate(lengths):
        for t in range(n):
            next_value = values[b, t + 1].item() if t + 1 < n else 0.0
            td_error = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            assert advantages[b, t].item() == pytest.approx(td_error)


def test_critic_returns_with_lambda_one_are_monte_carlo_returns_whatever_the_values():
    lengths = [4, 2, 6]
    rewards, values, mask = random_batch(lengths, 6, seed=4)
    gamma = 0.9
    _, returns = compute_gae(rewards, values, mask, gamma=gamma, lam=1.0)
    _, returns_other_values = compute_gae(rewards, 10 * values + 3, mask, gamma=gamma, lam=1.0)
    for b, n in enumerate(lengths):
        monte_carlo = [sum(gamma ** (k - t) * rewards[b, k].item() for k in range(t, n)) for t in range(n)]
        assert returns[b, :n].tolist() == pytest.approx(monte_carlo)
        assert returns_other_values[b, :n].tolist() == pytest.approx(monte_carlo)


def test_compute_advantages_decouples_policy_lambda_from_critic_lambda():
    lengths = [4, 2, 6]
    rewards, values, mask = random_batch(lengths, 6, seed=5)
    batch = dict(rewards=rewards, values=values, response_mask=mask)
    args = Args(gamma=0.9, gae_lambda=0.7, critic_gae_lambda=1.0, advantage_whitening="none")
    compute_advantages(batch, args)
    expected_advantages, _ = gae_reference(rewards, values, lengths, 0.9, [0.7] * 3)
    _, expected_returns = gae_reference(rewards, values, lengths, 0.9, [1.0] * 3)
    torch.testing.assert_close(batch["advantages"], expected_advantages)
    torch.testing.assert_close(batch["returns"], expected_returns)


def test_length_adaptive_lambda_is_one_minus_one_over_alpha_times_length():
    lengths = torch.tensor([40, 100, 400])
    assert length_adaptive_lambda(lengths, alpha=0.05).tolist() == pytest.approx(
        [1 - 1 / (0.05 * 40), 1 - 1 / (0.05 * 100), 1 - 1 / (0.05 * 400)]
    )


def test_length_adaptive_lambda_is_floored_at_zero_for_short_responses():
    assert length_adaptive_lambda(torch.tensor([10]), alpha=0.05).tolist() == [0.0]


def test_compute_gae_with_per_sequence_lambda_equals_row_by_row_scalar_lambda():
    lengths = [5, 2, 7]
    rewards, values, mask = random_batch(lengths, 7, seed=6)
    lams = [0.5, 0.9, 0.99]
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.95, lam=torch.tensor(lams))
    for b, lam in enumerate(lams):
        row_advantages, row_returns = compute_gae(rewards[b : b + 1], values[b : b + 1], mask[b : b + 1], 0.95, lam)
        torch.testing.assert_close(advantages[b : b + 1], row_advantages)
        torch.testing.assert_close(returns[b : b + 1], row_returns)


def test_compute_advantages_uses_length_adaptive_lambda_for_the_policy_and_critic_lambda_for_returns():
    lengths = [5, 2, 7]
    rewards, values, mask = random_batch(lengths, 7, seed=7)
    batch = dict(rewards=rewards, values=values, response_mask=mask)
    args = Args(gamma=1.0, gae_lambda=0.95, length_adaptive_alpha=0.5, advantage_whitening="none")
    compute_advantages(batch, args)
    policy_lams = [max(0.0, 1 - 1 / (0.5 * n)) for n in lengths]
    expected_advantages, _ = gae_reference(rewards, values, lengths, 1.0, policy_lams)
    _, expected_returns = gae_reference(rewards, values, lengths, 1.0, [0.95] * 3)
    torch.testing.assert_close(batch["advantages"], expected_advantages)
    torch.testing.assert_close(batch["returns"], expected_returns)


# ---------------------------------------------------------------------------------------------------------
# Clipped losses (PPO's policy and value losses), by hand with ratio = pi/pi_old and old log-probs 0
# ---------------------------------------------------------------------------------------------------------


def surrogate(advantage, ratio, dual_clip=None, **kwargs):
    """The per-token loss and clipped flag of one token; with dual_clip, Dual-Clip's cap applied (Part 2)."""
    advantages = torch.tensor([advantage], dtype=torch.float64)
    loss, _, clipped = clipped_surrogate_loss(
        torch.tensor([math.log(ratio)], dtype=torch.float64), torch.zeros(1, dtype=torch.float64), advantages, **kwargs,
    )
    if dual_clip is not None:
        loss, clipped = ppo_llm.dual_clip(loss, clipped, advantages, dual_clip)
    return loss.item(), clipped.item()


@pytest.mark.parametrize(
    "advantage, ratio, expected_loss, expected_clipped",
    [
        (2.0, 1.1, -2.0 * 1.1, False),  # A > 0, inside [0.8, 1.2]: plain -A*w
        (2.0, 1.5, -2.0 * 1.2, True),  # A > 0, above: capped at 1 + eps, no gradient
        (2.0, 0.5, -2.0 * 0.5, False),  # A > 0, below: pessimistic max keeps -A*w (gradient flows)
        (-2.0, 0.9, 2.0 * 0.9, False),  # A < 0, inside
        (-2.0, 0.5, 2.0 * 0.8, True),  # A < 0, below: floored at 1 - eps, no gradient
        (-2.0, 1.5, 2.0 * 1.5, False),  # A < 0, above: pessimistic max keeps -A*w
    ],
    ids=["pos-inside", "pos-above", "pos-below", "neg-inside", "neg-below", "neg-above"],
)
def test_clipped_surrogate_loss_by_hand(advantage, ratio, expected_loss, expected_clipped):
    loss, clipped = surrogate(advantage, ratio, clip_eps=0.2)
    assert loss == pytest.approx(expected_loss)
    assert clipped == expected_clipped


def test_clip_higher_moves_only_the_upper_bound():
    assert surrogate(1.0, 1.5, clip_eps=0.2, clip_eps_high=0.28) == (pytest.approx(-1.28), True)
    assert surrogate(1.0, 1.25, clip_eps=0.2, clip_eps_high=0.28) == (pytest.approx(-1.25), False)
    assert surrogate(-1.0, 0.5, clip_eps=0.2, clip_eps_high=0.28) == (pytest.approx(0.8), True)


def test_dual_clip_caps_the_loss_at_c_times_minus_advantage_for_negative_advantages():
    assert surrogate(-2.0, 10.0, clip_eps=0.2, dual_clip=3.0) == (pytest.approx(3.0 * 2.0), True)
    assert surrogate(-2.0, 2.0, clip_eps=0.2, dual_clip=3.0) == (pytest.approx(2.0 * 2.0), False)


@pytest.mark.parametrize("ratio", [10.0, 1.1, 0.5])
def test_dual_clip_changes_nothing_for_positive_advantages(ratio):
    assert surrogate(2.0, ratio, clip_eps=0.2, dual_clip=3.0) == surrogate(2.0, ratio, clip_eps=0.2)


def value_loss(value, old_value, ret, clip_eps):
    loss, clipped = clipped_value_loss(torch.tensor([value]), torch.tensor([old_value]), torch.tensor([ret]), clip_eps)
    return loss.item(), clipped.item()


def test_value_loss_takes_the_clipped_loss_when_it_is_larger():
    # V moved from 0 to 1 onto R = 1; clipped V = 0.2 is 0.8 away: 0.5 * 0.8^2.
    assert value_loss(1.0, 0.0, 1.0, 0.2) == (pytest.approx(0.5 * 0.8**2), True)


def test_value_loss_takes_the_unclipped_loss_when_it_is_larger():
    # V moved from 0 to 1, away from R = -1: unclipped 2^2 beats clipped 1.2^2.
    assert value_loss(1.0, 0.0, -1.0, 0.2) == (pytest.approx(0.5 * 2.0**2), False)


def test_value_loss_without_clipping_is_half_squared_error():
    assert value_loss(1.0, 0.0, 1.0, None) == (0.0, False)
    assert value_loss(1.0, 0.0, -1.0, None) == (pytest.approx(0.5 * 2.0**2), False)


# ---------------------------------------------------------------------------------------------------------
# KL estimators and KL-shaped rewards (Schulman 2020; Ziegler et al. 2019)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "estimator, expected",
    [("k1", math.log(2)), ("k2", 0.5 * math.log(2) ** 2), ("k3", 0.5 - 1 - math.log(0.5))],
)
def test_kl_estimators_by_hand_for_p_half_and_q_quarter(estimator, expected):
    # p = pi_theta(a) = 0.5, q = pi_ref(a) = 0.25: k1 = log(p/q), k2 = log(p/q)^2 / 2, k3 = q/p - 1 - log(q/p).
    kl = kl_penalty(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]), estimator)
    assert kl.item() == pytest.approx(expected)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_k2_and_k3_are_nonnegative_elementwise(estimator):
    generator = torch.Generator().manual_seed(0)
    logprobs = -3 * torch.rand(1000, generator=generator)
    ref_logprobs = -3 * torch.rand(1000, generator=generator)
    assert (kl_penalty(logprobs, ref_logprobs, estimator) >= 0).all()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_are_zero_when_policy_equals_reference(estimator):
    logprobs = -3 * torch.rand(100, generator=torch.Generator().manual_seed(0))
    assert kl_penalty(logprobs, logprobs.clone(), estimator).abs().max() == 0


def test_kl_shaped_rewards_put_the_score_on_the_last_real_token():
    lengths, width, kl_coef = [4, 2, 1], 5, 0.1
    mask = prefix_mask(lengths, width)
    kl = torch.rand(3, width, generator=torch.Generator().manual_seed(0))
    scores = torch.tensor([1.5, -2.0, 0.25])
    rewards = kl_shaped_rewards(scores, kl * mask, kl_coef, mask)
    for b, n in enumerate(lengths):
        expected = [-kl_coef * kl[b, t].item() if t < n else 0.0 for t in range(width)]
        expected[n - 1] += scores[b].item()
        assert rewards[b].tolist() == pytest.approx(expected)


def test_response_mask_ends_at_the_first_eos_of_ragged_responses():
    responses = torch.tensor([[5, EOS, PAD, PAD], [5, 6, 7, EOS], [EOS, PAD, PAD, PAD]])
    mask, has_eos = response_mask_from_eos(responses, [EOS])
    assert mask.tolist() == [[True, True, False, False], [True, True, True, True], [True, False, False, False]]
    assert has_eos.tolist() == [True, True, True]


def test_response_mask_counts_only_the_first_eos_when_pad_is_eos():
    responses = torch.tensor([[5, 6, EOS, EOS, EOS], [EOS, EOS, EOS, EOS, EOS]])
    mask, has_eos = response_mask_from_eos(responses, [EOS])
    assert mask.tolist() == [[True, True, True, False, False], [True, False, False, False, False]]
    assert has_eos.tolist() == [True, True]


def test_response_without_eos_is_all_ones_and_has_no_eos():
    mask, has_eos = response_mask_from_eos(torch.tensor([[5, 6, 7, 8]]), [EOS])
    assert mask.tolist() == [[True, True, True, True]]
    assert has_eos.tolist() == [False]


def test_response_mask_stops_at_whichever_eos_id_comes_first():
    responses = torch.tensor([[5, 13, 6, EOS], [5, EOS, 13, 6]])
    mask, _ = response_mask_from_eos(responses, [EOS, 13])
    assert mask.tolist() == [[True, True, False, False], [True, True, False, False]]


def test_score_lands_on_the_first_eos_or_on_the_last_token_without_eos():
    responses = torch.tensor([[5, EOS, EOS, EOS], [5, 6, 7, EOS], [5, 6, 7, 8]])
    mask, _ = response_mask_from_eos(responses, [EOS])
    rewards = kl_shaped_rewards(torch.tensor([10.0, 20.0, 30.0]), torch.zeros(3, 4), 0.1, mask)
    # By hand: first EOS at index 1 and 3; no EOS -> last index 3. Always mask.sum() - 1.
    assert rewards.nonzero().tolist() == [[0, 1], [1, 3], [2, 3]]
    assert [int(m.sum()) - 1 for m in mask] == [1, 3, 3]


def test_masked_whiten_gives_mean_zero_variance_one_over_real_tokens_and_zero_elsewhere():
    lengths = [5, 2, 7]
    x, _, mask = random_batch(lengths, 7, seed=8)
    whitened = masked_whiten(3 * x + 2, mask)
    real = [whitened[b, t].item() for b, n in enumerate(lengths) for t in range(n)]
    assert statistics.fmean(real) == pytest.approx(0.0, abs=1e-9)
    assert statistics.pvariance(real) == pytest.approx(1.0, rel=1e-6)
    assert whitened[~mask].abs().max() == 0


# ---------------------------------------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------------------------------------


def test_token_mean_is_sum_over_real_tokens_over_their_count():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    expected = (1 + 2 + 3 + 4) / 4
    assert aggregate_loss(loss, mask, "token-mean", num_tokens=4, num_seqs=2).item() == pytest.approx(expected)


def test_seq_mean_token_mean_averages_each_sequence_first():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate_loss(loss, mask, "seq-mean-token-mean", num_tokens=4, num_seqs=2).item() == pytest.approx(
        ((1 + 2 + 3) / 3 + 4 / 1) / 2
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_losses_with_minibatch_normalisers_add_up_to_the_minibatch_loss(mode):
    loss = torch.randn(6, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mask = prefix_mask([5, 1, 3, 2, 4, 5], 5)
    num_tokens, num_seqs = mask.sum().item(), 6
    whole = aggregate_loss(loss, mask, mode, num_tokens, num_seqs)
    parts = sum(aggregate_loss(loss[i : i + 2], mask[i : i + 2], mode, num_tokens, num_seqs) for i in range(0, 6, 2))
    assert parts.item() == pytest.approx(whole.item())


# ---------------------------------------------------------------------------------------------------------
# Dispatch tables: every choice of a knob has its entry, and an unknown name is an error
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("knob, table", [("kl_estimator", "KL_ESTIMATORS"), ("loss_aggregation", "LOSS_AGGREGATIONS"),
                                         ("kl_schedule", "KL_SCHEDULES")])
def test_every_choice_of_a_dispatched_knob_is_an_entry_of_its_table(knob, table):
    choices = typing.get_args(typing.get_type_hints(Args)[knob])
    assert set(choices) == set(getattr(ppo_llm, table))


def test_an_unknown_name_in_a_dispatch_table_is_an_error_not_a_default():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4': expected one of k1, k2, k3"):
        kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        aggregate_loss(x, x.bool(), "sum", 1, 1)


# ---------------------------------------------------------------------------------------------------------
# Log-probs and entropy
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_elements", [2**25, 3 * 14])  # one chunk; 3 positions per chunk
def test_log_probs_from_logits_equal_log_softmax_gathered_at_the_tokens_and_so_do_their_gradients(chunk_elements):
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2, 5, 14, generator=generator)
    tokens, weights = torch.randint(14, (2, 5), generator=generator), torch.randn(2, 5, generator=generator)
    leaf = logits.clone().requires_grad_()
    expected = torch.log_softmax(leaf / 0.9, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    (expected * weights).sum().backward()
    ours = logits.clone().requires_grad_()
    with mock.patch.object(ppo_llm, "LOGITS_CHUNK_ELEMENTS", chunk_elements):
        logprobs, _ = ppo_llm.logprobs_and_entropy(ours, None, tokens, 0.9, None)
    (logprobs * weights).sum().backward()
    torch.testing.assert_close(logprobs, expected)
    torch.testing.assert_close(ours.grad, leaf.grad)


@pytest.mark.parametrize("kept", [2**27, 0])  # the log-softmax kept for the backward pass, or recomputed there
@pytest.mark.parametrize("chunk_elements", [2**25, 3 * 14])  # one chunk; 3 positions per chunk
def test_log_probs_from_a_head_equal_log_softmax_of_its_logits_and_so_do_their_gradients(chunk_elements, kept):
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(2, 5, 6, generator=generator)
    tokens, weights = torch.randint(14, (2, 5), generator=generator), torch.randn(2, 5, generator=generator)
    head = torch.nn.Linear(6, 14)
    leaf = states.clone().requires_grad_()
    expected = torch.log_softmax(head(leaf) / 0.9, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    (expected * weights).sum().backward()
    expected_weight_grad, head.weight.grad, head.bias.grad = head.weight.grad.clone(), None, None
    ours = states.clone().requires_grad_()
    with (mock.patch.object(ppo_llm, "LOGITS_CHUNK_ELEMENTS", chunk_elements),
          mock.patch.object(ppo_llm, "KEPT_LOGPROBS_ELEMENTS", kept)):
        logprobs, _ = ppo_llm.logprobs_and_entropy(ours, head, tokens, 0.9, None)
    (logprobs * weights).sum().backward()
    torch.testing.assert_close(logprobs, expected)
    torch.testing.assert_close(ours.grad, leaf.grad)
    torch.testing.assert_close(head.weight.grad, expected_weight_grad)


def test_entropy_from_logprobs_equals_minus_sum_p_log_p():
    logits = 3 * torch.randn(2, 5, 14, generator=torch.Generator().manual_seed(0))
    p, log_p = torch.softmax(logits, -1), torch.log_softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logprobs(torch.log_softmax(logits, -1)), -(p * log_p).sum(-1))


@pytest.mark.parametrize("scale", [1, 10, 30])
def test_entropy_in_float32_stays_within_4e_6_of_float64_on_peaked_distributions(scale):
    # logsumexp(z) - sum p*z cancels two large numbers: its error reaches ~1e-5 at logit scale 10-30.
    logits = scale * torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    exact = -(torch.softmax(logits.double(), -1) * torch.log_softmax(logits.double(), -1)).sum(-1)
    assert (entropy_from_logprobs(torch.log_softmax(logits, -1)).double() - exact).abs().max().item() < 4e-6


# ---------------------------------------------------------------------------------------------------------
# Schedules, running moments, prompt order
# ---------------------------------------------------------------------------------------------------------


def test_adaptive_kl_coef_raises_beta_when_kl_is_above_target():
    # Ziegler et al.: e = clip(KL/target - 1, -0.2, 0.2) = clip(0.5) = 0.2; beta * (1 + e * n / horizon).
    expected = 0.1 * (1 + 0.2 * 64 / 10000)
    assert adaptive_kl_coef(0.1, kl=0.15, kl_target=0.1, num_seqs=64, horizon=10000) == pytest.approx(expected)


def test_adaptive_kl_coef_lowers_beta_when_kl_is_below_target():
    # e = clip(0.05/0.1 - 1 = -0.5) = -0.2.
    expected = 0.1 * (1 - 0.2 * 64 / 10000)
    assert adaptive_kl_coef(0.1, kl=0.05, kl_target=0.1, num_seqs=64, horizon=10000) == pytest.approx(expected)


def test_adaptive_kl_coef_is_proportional_inside_the_clip():
    # e = 0.11/0.1 - 1 = 0.1, not clipped.
    expected = 0.1 * (1 + 0.1 * 64 / 100)
    assert adaptive_kl_coef(0.1, kl=0.11, kl_target=0.1, num_seqs=64, horizon=100) == pytest.approx(expected)


def test_linear_kl_coef_goes_from_initial_to_final_beta():
    assert linear_kl_coef(0, 5, kl_coef=0.05, kl_coef_final=0.25) == pytest.approx(0.05)
    assert linear_kl_coef(2, 5, kl_coef=0.05, kl_coef_final=0.25) == pytest.approx(0.15)
    assert linear_kl_coef(4, 5, kl_coef=0.05, kl_coef_final=0.25) == pytest.approx(0.25)


def test_learning_rate_warms_up_linearly_then_anneals_to_zero():
    # Warmup 2 of 10 iterations: factor (i + 1) / 2 until 1; anneal factor 1 - i / 10.
    lrs = [learning_rate_at(i, 10, base_lr=1.0, warmup=2, anneal=True) for i in (0, 1, 5, 9)]
    assert lrs == pytest.approx([0.5 * 1.0, 1.0 * 0.9, 1.0 * 0.5, 1.0 * 0.1])


def test_learning_rates_by_size_keep_the_demo_rates_and_fall_into_the_seeds_range_for_real_models():
    """Without the flags the demo model keeps the rates its README figures were measured with; 0.5B-7B policies
    get the common 1e-6 to 5e-6; larger models never get larger rates; the critic never learns slower."""
    demo = AutoModelForCausalLM.from_pretrained(REPO / "demo" / "model")
    assert default_learning_rates(sum(p.numel() for p in demo.parameters())) == (3e-4, 1e-3)
    sizes = [2e5, 9e6, 135e6, 0.5e9, 1.5e9, 3e9, 7e9, 70e9]
    rates = [default_learning_rates(int(n)) for n in sizes]
    assert all(1e-6 <= policy <= 5e-6 for n, (policy, _) in zip(sizes, rates) if 0.5e9 <= n <= 7e9)
    assert all(a[0] >= b[0] and a[1] >= b[1] for a, b in zip(rates, rates[1:]))
    assert all(critic >= policy for policy, critic in rates)


def test_learning_rate_without_anneal_is_constant_after_warmup():
    lrs = [learning_rate_at(i, 10, base_lr=2.0, warmup=4, anneal=False) for i in (0, 3, 9)]
    assert lrs == pytest.approx([2.0 * 1 / 4, 2.0, 2.0])


def test_running_moments_equal_mean_and_variance_of_all_batches_so_far():
    generator = torch.Generator().manual_seed(0)
    batches = [3 + 2 * torch.randn(n, generator=generator) for n in (5, 1, 12, 7)]
    mean, var, count = 0.0, 1.0, 0  # the state train() starts from
    for batch in batches:
        mean, var, count = update_running_moments(mean, var, count, batch)
    everything = [x for batch in batches for x in batch.tolist()]
    assert count == len(everything)
    assert mean == pytest.approx(statistics.fmean(everything))
    assert var == pytest.approx(statistics.pvariance(everything))


def test_batch_indices_cover_every_prompt_once_per_pass():
    # 10 prompts, 4 per iteration: iterations 0-4 walk exactly two passes over the data.
    walked = [i for iteration in range(5) for i in batch_indices(iteration, 4, 10, seed=1)]
    assert sorted(walked[:10]) == list(range(10))
    assert sorted(walked[10:]) == list(range(10))


def test_batch_indices_are_deterministic_and_depend_on_the_seed():
    assert batch_indices(3, 4, 10, seed=1) == batch_indices(3, 4, 10, seed=1)
    assert [batch_indices(i, 2, 10, seed=1) for i in range(5)] != [batch_indices(i, 2, 10, seed=2) for i in range(5)]


# ---------------------------------------------------------------------------------------------------------
# Prompts and reward functions
# ---------------------------------------------------------------------------------------------------------


def test_long_prompts_are_truncated_from_the_left_with_a_counted_warning(tiny, capsys):
    tokenizer = AutoTokenizer.from_pretrained(tiny.policy)
    rows = [{"prompt": "37+48="}, {"prompt": "1+2="}, {"prompt": "123+456="}]
    ids = tokenize_prompts(tokenizer, PromptFile("--prompts-path", "p.jsonl", rows, [1, 2, 3]), Args(max_prompt_length=4))
    assert ids == [[VOCAB[c] for c in "+48="], [VOCAB[c] for c in "1+2="], [VOCAB[c] for c in "456="]]
    assert "warning: 2 of 3 prompts in --prompts-path" in capsys.readouterr().out


def test_prompts_are_tokenized_a_slice_at_a_time_in_order_and_a_bad_one_past_the_first_slice_is_named():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)  # no <unk>: a letter cannot be encoded
    texts = [f"{i}+{i % 7}=" for i in range(600)]  # 256 a call: three calls
    rows = [{"prompt": text} for text in texts]
    source = PromptFile("--prompts-path", "p.jsonl", rows, list(range(1, 601)))
    ids = tokenize_prompts(tokenizer, source, Args(max_prompt_length=64))
    assert ids == [[tokenizer.convert_tokens_to_ids(c) for c in text] for text in texts]
    rows[400] = {"prompt": "4x+1="}
    with pytest.raises(ConfigError, match=r"p.jsonl, line 401: the tokenizer cannot encode the character 'x'"):
        tokenize_prompts(tokenizer, source, Args(max_prompt_length=64))


def test_exact_match_compares_numbers_as_numbers_and_text_as_stripped_text():
    # parquet and CSV hand answers over as numbers: 982 and 982.0 must match "982", and 982.5 must not
    completions = [" 982 ", "982", "982.0", "982.5", "982", "0982", "abc", "abc", "-3"]
    answers = [982, 982.0, "982", 982, "982.5", 982, " abc ", "ab", -3.0]
    expected = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert exact_match_reward(["p"] * len(answers), completions, answer=answers) == expected


def test_each_reward_function_call_gets_its_own_copy_of_the_completions():
    def edits_in_place(prompts, completions, **fields):
        completions[0], prompts[0] = "edited", "edited"
        return [0.0] * len(completions)

    prompts, completions = ["a", "b"], ["1", "2"]
    call_reward_fn(edits_in_place, "edits_in_place", prompts, completions, [{"prompt": "a"}, {"prompt": "b"}])
    assert (prompts, completions) == (["a", "b"], ["1", "2"])


def test_last_number_compares_the_last_numbers_in_completion_and_answer():
    completions = ["so 1,234", "12 then 13", "13 then 12", "no number", "-5", "3.5"]
    answers = ["1234", "13", "13", "13", "x = -5.0", "3.50"]
    assert last_number_reward(["p"] * 6, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


REWARD_MODULE = "def length(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n"


def test_load_reward_fn_from_a_file_path(tmp_path):
    (tmp_path / "my_reward.py").write_text(REWARD_MODULE)
    fn = load_function(f"{tmp_path / 'my_reward.py'}:length")
    assert fn(["p", "p"], ["12", "12345"]) == [2.0, 5.0]


def test_load_reward_fn_from_an_importable_module(tmp_path, monkeypatch):
    (tmp_path / "ppo_test_reward_module.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_function("ppo_test_reward_module:length")
    assert fn(["p"], ["123"]) == [3.0]


def test_load_reward_fn_rejects_a_spec_that_is_neither_builtin_nor_module_function():
    with pytest.raises(ConfigError, match="--reward-fn 'exact'"):
        load_function("exact")


def test_call_reward_fn_passes_every_row_field_but_prompt_as_a_list():
    seen = {}

    def fn(prompts, completions, **fields):
        seen.update(fields)
        return [0.0] * len(completions)

    rows = [{"prompt": "a", "answer": "1", "id": 7}, {"prompt": "b", "answer": "2", "id": 8}]
    call_reward_fn(fn, "fn", ["a", "b"], ["1", "2"], rows)
    assert seen == {"answer": ["1", "2"], "id": [7, 8]}


@pytest.mark.parametrize(
    "returns, message",
    [
        (ValueError("boom"), "'my_fn' raised ValueError: boom"),
        ([1.0], "'my_fn' returned 1 values for 2 completions"),
        ([1.0, float("nan")], "'my_fn' returned a non-finite value (nan) at index 1"),
        ([1.0, "high"], "'my_fn' returned a non-number"),
        (1.0, "'my_fn' returned 1.0, expected a list of 2 numbers"),
        (None, "'my_fn' returned None, expected a list of 2 numbers"),
        ({"a": 1.0, "b": 0.0}, "returned {'a': 1.0, 'b': 0.0}, expected a list of 2 numbers"),
        (torch.tensor(1.0), "'my_fn' returned 1.0, expected a list of 2 numbers"),
        ([1.0, 1e39], "'my_fn' returned 1e+39 at index 1, too large for float32"),
        ([1, 10**400], "'my_fn' returned an integer too large for float32"),
        ((1.0 / x for x in [1.0, 0.0]), "'my_fn' raised ZeroDivisionError"),  # a generator fails while it is read
        ({1.0, 0.0}, "returned {0.0, 1.0}, expected a list of 2 numbers"),  # a set has no order
        (["1.5", "2"], "'my_fn' returned a non-number: '1.5' is text"),
        (SystemExit(0), "'my_fn' raised SystemExit: 0"),  # would end the run with exit 0, saying nothing
        (KeyboardInterrupt(), "'my_fn' raised KeyboardInterrupt"),  # not a Ctrl-C of the user's
        (GeneratorExit(), "'my_fn' raised GeneratorExit"),  # a BaseException like the two above
    ],
    ids=["raises", "wrong-length", "nan", "non-number", "scalar", "none", "dict", "0-d-tensor", "beyond-float32",
         "huge-int", "generator-raising", "set", "strings", "sys-exit", "keyboard-interrupt", "generator-exit"],
)
def test_call_reward_fn_errors_are_config_errors_naming_the_function(returns, message):
    def fn(prompts, completions, **fields):
        if isinstance(returns, BaseException):
            raise returns
        return returns

    with pytest.raises(ConfigError) as error:
        call_reward_fn(fn, "my_fn", ["a", "b"], ["1", "2"], [{"prompt": "a"}, {"prompt": "b"}])
    assert message in str(error.value)


# ---------------------------------------------------------------------------------------------------------
# The training doctor: its instability signals on synthetic metric histories
# ---------------------------------------------------------------------------------------------------------


def healthy_history(iterations=20):
    """Rows shaped like the demo's healthy run: rising score, KL 0.025 per token, entropy 0.1, few clipped tokens,
    gradient norms 1, a falling value loss, explained variance 0.3, 4-token responses that all end in EOS."""
    return [{"iteration": i + 1, "objective/scores": 0.4 + 0.02 * i, "objective/kl": 0.1, "rollout/response_length": 4.0,
             "policy/entropy": 0.1, "policy/clipfrac": 0.05, "grad/policy_norm": 1.0, "grad/critic_norm": 1.0,
             "rollout/eos_rate": 1.0, "losses/value_loss": 0.2 / (i + 1), "val/explained_variance": 0.3,
             "policy/early_stopped": 0.0, "train/policy_frozen": 0.0} for i in range(iterations)]


def with_last(rows, count, **values):
    """The history with the last `count` rows changed to show a signal (keys written with __ for /)."""
    for row in rows[-count:]:
        row.update({key.replace("__", "/"): value for key, value in values.items()})
    return rows


def with_eval(rows, evals):
    for iteration, value in evals.items():
        rows[iteration - 1]["eval/reward"] = value
    return rows


def growing_value_loss(rows, count=10):
    for k, row in enumerate(rows[-count:]):
        row["losses/value_loss"] = 0.01 * 1.3**k
    return rows


W = ppo_llm.DOCTOR_WINDOW
# signal: (history that shows it, words the warning must hold: the value, the threshold, the first knob)
DOCTOR_SIGNALS = {
    "kl_high": (lambda h: with_last(h, W, objective__kl=2.0), ["0.500 per token > 0.3", "--kl-coef"]),
    "reward_collapse": (lambda h: with_last(h, W, objective__scores=-0.1), ["fell to -0.100 <= 0", "--resume-from"]),
    "value_loss_growing": (growing_value_loss, ["has risen for 5 iterations", "--critic-warmup-iterations", "--vf-coef"]),
    "clipfrac_high": (lambda h: with_last(h, W, policy__clipfrac=0.3), ["clip fraction 0.300 > 0.2", "--clip-eps"]),
    "entropy_collapse": (lambda h: with_last(h, W, policy__entropy=0.001), ["0.0010 < 0.01", "--ent-coef"]),
    "grad_norm_high": (lambda h: with_last(h, W, grad__policy_norm=8.0), ["policy gradient norm 8.00 > 5.0", "--learning-rate"]),
    "critic_grad_norm_high": (lambda h: with_last(h, W, grad__critic_norm=8.0),
                              ["critic gradient norm 8.00 > 5.0", "--critic-learning-rate"]),
    "explained_variance_negative": (lambda h: with_last(h, W, val__explained_variance=-0.5),
                                    ["-0.50 < -0.1", "--critic-warmup-iterations", "--value-pretrain-steps"]),
    "length_collapse": (lambda h: with_last(h, W, rollout__response_length=1.0), ["1.00 tokens <= 1.5", "--kl-coef"]),
    "length_pinned": (lambda h: with_last(h, W, rollout__response_length=16.0),
                      ["16.0 >= 0.95 x --max-new-tokens 16", "--missing-eos-penalty"]),
    "eos_rate_falling": (lambda h: with_last(h, W, rollout__eos_rate=0.5), ["EOS rate 0.50 < 1.00", "--missing-eos-penalty"]),
    "early_stopping": (lambda h: with_last(h, W, policy__early_stopped=1.0),
                       ["stopped the policy's epochs on 5 of the last 5 iterations, more than 50%", "lower --learning-rate"]),
    "reward_hacking": (lambda h: with_eval(h, {5: 0.6, 10: 0.8, 20: 0.6}),
                       ["eval/reward 0.600 < its best 0.800", "training score rose", "--kl-coef"]),
}


def test_the_doctor_is_silent_on_a_healthy_history():
    assert ppo_llm.doctor_findings(healthy_history(), Args()) == {}


@pytest.mark.parametrize("signal", list(DOCTOR_SIGNALS))
def test_the_doctor_names_each_signal_its_value_threshold_and_knob(signal):
    shows, words = DOCTOR_SIGNALS[signal]
    found = ppo_llm.doctor_findings(shows(healthy_history()), Args())
    assert list(found) == [signal]
    assert [word for word in words if word not in found[signal]] == [], found[signal]


@pytest.mark.parametrize("signal", [s for s in DOCTOR_SIGNALS if s != "reward_hacking"])
def test_one_noisy_iteration_does_not_trigger_the_doctor(signal):
    shows, _ = DOCTOR_SIGNALS[signal]
    noisy = healthy_history()
    noisy[-1] = shows(healthy_history())[-1]  # only the newest row shows the signal
    assert ppo_llm.doctor_findings(noisy, Args()) == {}


def test_the_doctor_ignores_critic_warmup_iterations():
    # While the policy is frozen the critic starts from scratch: a poor explained variance then is expected
    history = with_last(healthy_history(), W, val__explained_variance=-3.0, train__policy_frozen=1.0)
    assert ppo_llm.doctor_findings(history, Args()) == {}


def test_the_doctor_sees_reward_hacking_when_the_best_eval_was_the_one_before_training():
    history = [{"iteration": 0, "eval/reward": 0.9}] + with_eval(healthy_history(), {10: 0.7, 20: 0.5})
    found = ppo_llm.doctor_findings(history, Args())
    assert list(found) == ["reward_hacking"] and "eval/reward 0.500 < its best 0.900" in found["reward_hacking"]


def test_a_resumed_runs_doctor_goes_on_counting_and_waiting_where_the_checkpointed_one_was(capsys):
    rows = with_last(healthy_history(25), 25, objective__kl=2.0)
    rows[W - 1]["doctor/kl_high"] = 1  # the run before the checkpoint warned at the first full window
    doctor = ppo_llm.Doctor(Args(), rows[:W])
    counts = {row["iteration"]: doctor.check(row) for row in rows[W:]}
    assert {i: c for i, c in counts.items() if c} == {W + ppo_llm.DOCTOR_REPEAT: {"doctor/kl_high": 2},
                                                     W + 2 * ppo_llm.DOCTOR_REPEAT: {"doctor/kl_high": 3}}


def test_the_doctor_warns_once_per_repeat_interval_and_counts_into_the_metrics(capsys):
    doctor = ppo_llm.Doctor(Args(), [])
    rows = with_last(healthy_history(25), 25, objective__kl=2.0)  # high from the first iteration on
    counts = {row["iteration"]: doctor.check(row) for row in rows}
    warned = {iteration: c for iteration, c in counts.items() if c}
    assert warned == {W: {"doctor/kl_high": 1}, W + ppo_llm.DOCTOR_REPEAT: {"doctor/kl_high": 2},
                      W + 2 * ppo_llm.DOCTOR_REPEAT: {"doctor/kl_high": 3}}
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line.startswith("doctor [kl_high] KL to the reference") for line in lines)


def test_doctor_off_prints_and_counts_nothing(capsys):
    doctor = ppo_llm.Doctor(Args(doctor="off"), [])
    assert [doctor.check(row) for row in with_last(healthy_history(), 20, objective__kl=2.0)] == [{}] * 20
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------------------------------------------------
# The update with learning rate 0: pi_theta == pi_old on the first minibatch
# ---------------------------------------------------------------------------------------------------------


def test_first_minibatch_with_learning_rate_zero_has_ratio_one_and_no_kl_or_clipping(tiny, tmp_path):
    args = Args(model_name_or_path=str(tiny.policy), prompts_path=str(tiny.train), output_dir=str(tmp_path),
                eval_every=0, sample_every=0, save_every=0, num_iterations=1, num_prompts=4, micro_batch_size=2,
                max_new_tokens=4, learning_rate=0.0, critic_learning_rate=0.0, num_minibatches=1, num_epochs=1)
    ppo_llm.train(args)
    metrics = read_metrics(tmp_path)[1]  # one epoch of one minibatch: the summary is that minibatch
    assert metrics["policy/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["policy/approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["policy/clipfrac"] == 0.0


# ---------------------------------------------------------------------------------------------------------
# End to end on the tiny models: `trained` runs the script as a subprocess, the others its main() in this process
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tiny):
    """Two iterations with a checkpoint after each."""
    output_dir = tiny.root / "run"
    succeeded(run_script(tiny, output_dir, "--save-every", 1))
    return output_dir


def test_training_changes_every_policy_tensor(tiny, trained):
    output_dir = trained
    initial = load_file(tiny.policy / "model.safetensors")
    final = load_file(output_dir / "policy" / "model.safetensors")
    assert weights_differing(initial, final) == list(initial)


def test_training_changes_every_critic_backbone_tensor(tiny, trained):
    output_dir = trained
    initial = load_file(tiny.policy / "model.safetensors")  # the critic starts from the policy's backbone
    critic = load_file(output_dir / "checkpoint-2" / "critic" / "model.safetensors")
    backbone = [name for name in initial if name.startswith("model.")]
    assert weights_differing(initial, critic, prefix="model.") == backbone


@pytest.fixture(scope="module")
def warmup_run(tiny):
    """Value pretraining, then two critic-warmup iterations (the whole run), two responses per prompt, linear KL."""
    output_dir = tiny.root / "warmup"
    result = succeeded(run_main(tiny, output_dir, "--value-pretrain-steps", 1, "--critic-warmup-iterations", 2,
                                "--num-generations", 2, "--kl-schedule", "linear", "--kl-coef", 0.1,
                                "--kl-coef-final", 0.3, "--reward-model-path", tiny.rm, "--save-every", 2))
    return output_dir, result.stdout


def test_critic_warmup_leaves_the_policy_untouched_and_trains_the_critic(tiny, warmup_run):
    output_dir, _ = warmup_run
    initial = load_file(tiny.policy / "model.safetensors")
    assert weights_differing(initial, load_file(output_dir / "policy" / "model.safetensors")) == []
    critic = load_file(output_dir / "checkpoint-2" / "critic" / "model.safetensors")
    assert weights_differing(initial, critic, prefix="model.") != []
    assert [read_metrics(output_dir)[i]["train/policy_frozen"] for i in (1, 2)] == [1.0, 1.0]


def test_value_pretraining_runs_its_steps_before_the_first_iteration(warmup_run):
    _, stdout = warmup_run
    lines = stdout.splitlines()
    pretraining = [i for i, line in enumerate(lines) if line.startswith("value pretraining 1/1")]
    first_iteration = next(i for i, line in enumerate(lines) if line.startswith("iter    1"))
    assert len(pretraining) == 1 and pretraining[0] < first_iteration


def test_linear_kl_schedule_goes_from_kl_coef_to_kl_coef_final(warmup_run):
    output_dir, _ = warmup_run
    metrics = read_metrics(output_dir)
    assert [metrics[1]["objective/kl_coef"], metrics[2]["objective/kl_coef"]] == pytest.approx([0.1, 0.3])


def test_num_generations_samples_that_many_responses_per_prompt(warmup_run):
    output_dir, _ = warmup_run
    assert read_metrics(output_dir)[1]["episodes"] == 4 * 2  # --num-prompts 4 x --num-generations 2


def test_target_kl_stops_the_update_at_the_first_minibatch_over_the_threshold(tiny, tmp_path):
    # The first minibatch has KL 0 and steps; the second has KL > 0 > 1e-12: not applied, and the update ends.
    succeeded(run_main(tiny, tmp_path, "--target-kl", 1e-12, "--num-epochs", 4, "--num-minibatches", 2,
                       "--num-iterations", 1, "--reward-model-path", tiny.rm))
    metrics = read_metrics(tmp_path)[1]
    assert (metrics["policy/early_stopped"], metrics["policy/epochs_completed"]) == (1.0, 0.0)


def test_the_policys_learning_rate_warms_up_from_the_first_iteration_it_trains_after_the_critic_warmup(tiny, tmp_path):
    succeeded(run_main(tiny, tmp_path, "--critic-warmup-iterations", 1, "--lr-warmup-iterations", 2, "--num-iterations",
                       3, "--learning-rate", 1e-3, "--no-anneal-lr", "--eval-every", 0))
    metrics = read_metrics(tmp_path)
    assert [metrics[i]["train/policy_frozen"] for i in (1, 2, 3)] == [1.0, 0.0, 0.0]
    assert [metrics[i]["lr"] for i in (2, 3)] == pytest.approx([1e-3 * 1 / 2, 1e-3 * 2 / 2])  # warmup steps 1 and 2


def test_target_kl_stops_the_policy_while_the_critic_trains_every_epoch_and_minibatch(tiny, tmp_path):
    # The critic's loss reads only the rollout's values and returns, so with and without --target-kl its weights after
    # the first iteration are the same (Spinning Up's PPO: early stopping is the policy's).
    flags = ["--num-epochs", 2, "--num-minibatches", 2, "--num-iterations", 1, "--save-every", 1, "--eval-every", 0,
             "--reward-model-path", tiny.rm]
    succeeded(run_main(tiny, tmp_path / "stopped", *flags, "--target-kl", 1e-12))
    succeeded(run_main(tiny, tmp_path / "full", *flags))
    assert read_metrics(tmp_path / "stopped")[1]["policy/early_stopped"] == 1.0
    stopped, full = (load_file(tmp_path / run / "checkpoint-1" / "critic" / "model.safetensors")
                     for run in ("stopped", "full"))
    assert weights_differing(load_file(tiny.policy / "model.safetensors"), full, prefix="model.") != []
    assert weights_differing(full, stopped) == []
    policies = [load_file(tmp_path / run / "policy" / "model.safetensors") for run in ("stopped", "full")]
    assert weights_differing(*policies) != []  # the control: the policy did stop early


def test_shape_rewards_applies_missing_eos_penalty_then_running_whitening_then_clipping():
    raw, has_eos = [1.0, 0.0, 2.0], [True, False, True]
    penalised = [r - (0.0 if ended else 0.5) for r, ended in zip(raw, has_eos)]
    mean, std = statistics.fmean(penalised), statistics.pstdev(penalised)
    expected = [max(-1.0, min(1.0, (x - mean) / std)) for x in penalised]
    mask = torch.ones(3, 2, dtype=torch.bool)
    batch = dict(raw_scores=torch.tensor(raw), has_eos=torch.tensor(has_eos), response_mask=mask,
                 logprobs=torch.zeros(3, 2), ref_logprobs=torch.zeros(3, 2))
    state = dict(reward_mean=0.0, reward_var=1.0, reward_count=0)
    args = Args(missing_eos_penalty=0.5, whiten_rewards=True, reward_clip=1.0)
    ppo_llm.shape_rewards(batch, args, kl_coef=0.1, state=state)
    torch.testing.assert_close(batch["scores"], torch.tensor(expected), atol=1e-5, rtol=0)
    assert state["reward_count"] == 3


def test_ptx_loss_is_the_mean_next_token_cross_entropy_of_the_sampled_texts(tiny):
    policy = AutoModelForCausalLM.from_pretrained(tiny.policy)
    texts = [[VOCAB[c] for c in "12+34=46"] + [EOS], [VOCAB[c] for c in "5+6=11"] + [EOS]]
    models = SimpleNamespace(policy=policy, tokenizer=char_tokenizer(), device=torch.device("cpu"))
    loss = ppo_llm.ptx_loss(models, dict(ids=texts, generator=torch.Generator().manual_seed(0)), 3)
    picked = torch.randint(len(texts), (3,), generator=torch.Generator().manual_seed(0)).tolist()
    # Reference: each text alone (no padding), cross-entropy of every next token, averaged over all of them.
    losses = []
    with torch.no_grad():
        for i in picked:
            ids = torch.tensor([texts[i]])
            logprobs = torch.log_softmax(policy(ids).logits[0, :-1], -1)
            losses += [-logprobs[t, ids[0, t + 1]].item() for t in range(ids.shape[1] - 1)]
    assert loss.item() == pytest.approx(statistics.fmean(losses), abs=1e-5)


def test_ptx_loss_takes_no_logits_from_the_model_when_the_vocabulary_outnumbers_the_hidden_state():
    # A vocabulary of 96 over a hidden state of 32: the log-probs come a chunk at a time from the final hidden states
    # (appendix D), so the model's own forward pass returns logits for no position at all.
    torch.manual_seed(0)
    policy = LlamaForCausalLM(llama_config(PAD, vocab_size=96))
    texts = [[VOCAB[c] for c in "12+34=46"] + [EOS], [VOCAB[c] for c in "5+6=11"] + [EOS]]
    models = SimpleNamespace(policy=policy, tokenizer=char_tokenizer(), device=torch.device("cpu"))
    widths = []
    policy.register_forward_hook(lambda module, inputs, out: widths.append(out.logits.shape[1]))
    loss = ppo_llm.ptx_loss(models, dict(ids=texts, generator=torch.Generator().manual_seed(0)), 2)
    assert widths == [0]
    picked = torch.randint(len(texts), (2,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = statistics.fmean(torch.nn.functional.cross_entropy(policy(torch.tensor([texts[i]])).logits[0, :-1],
                                                                      torch.tensor(texts[i][1:]), reduction="none")
                                    .tolist()[t] for i in picked for t in range(len(texts[i]) - 1))
    assert loss.item() == pytest.approx(expected, abs=1e-5)


METRIC_KEYS = [
    "objective/scores", "objective/kl", "policy/approx_kl", "policy/clipfrac", "val/clipfrac", "policy/entropy",
    "losses/policy_loss", "losses/value_loss", "val/explained_variance", "grad/policy_norm", "grad/critic_norm",
    "rollout/response_length", "rollout/eos_rate", "perf/generated_tokens_per_sec", "time/rollout", "time/update",
    "eval/reward",
]


def test_metrics_log_one_line_per_iteration_with_the_standard_diagnostics(trained):
    output_dir = trained
    metrics = read_metrics(output_dir)
    assert list(metrics) == [0, 1, 2]
    for iteration in (1, 2):
        assert [key for key in METRIC_KEYS if not isinstance(metrics[iteration].get(key), (int, float))] == []


def test_metrics_log_the_eval_before_the_first_update_as_iteration_zero(trained):
    output_dir = trained
    assert isinstance(read_metrics(output_dir)[0]["eval/reward"], float)


def test_resumed_run_continues_exactly_where_the_checkpoint_left_off(tiny, trained):
    output_dir = trained
    resumed_dir = tiny.root / "resumed"
    result = succeeded(run_main(tiny, resumed_dir, "--resume-from", output_dir / "checkpoint-1"))
    assert "resumed from" in result.stdout
    resumed = read_metrics(resumed_dir)
    assert list(resumed) == [2]
    assert non_timing(resumed[2]) == non_timing(read_metrics(output_dir)[2])


@pytest.fixture(scope="module")
def bf16_run(tiny):
    """One bfloat16 iteration at a real-model learning rate, with --save-every larger than the run."""
    output_dir = tiny.root / "bf16"
    succeeded(run_main(tiny, output_dir, "--dtype", "bfloat16", "--learning-rate", 1e-6, "--num-iterations", 1,
                       "--save-every", 5))
    return output_dir


def test_bfloat16_training_keeps_float32_weights_so_tiny_updates_are_not_rounded_away(tiny, bf16_run):
    # A 1e-6 step is far below bfloat16's resolution near typical weights: bfloat16 weights would barely move.
    before, after = load_file(tiny.policy / "model.safetensors"), load_file(bf16_run / "policy" / "model.safetensors")
    assert {tensor.dtype for tensor in after.values()} == {torch.float32}
    assert weights_differing(before, after) == list(before)


def test_bfloat16_reference_computes_like_the_policy_so_the_first_kl_is_zero(bf16_run):
    # Iteration 1 samples before any update: policy and reference are the same model and must agree exactly.
    assert read_metrics(bf16_run)[1]["objective/kl"] == 0.0


def test_the_last_iteration_is_checkpointed_even_when_save_every_does_not_divide_it(bf16_run):
    assert (bf16_run / "checkpoint-1" / "training_state.pt").is_file()


@pytest.mark.parametrize("flags, phases", [
    ([], {"generate", "score", "old_logprobs", "reference", "values"}),
    (["--shared-critic"], {"generate", "score", "old_logprobs", "reference"}),  # its values come with the policy's pass
])
def test_each_phase_is_timed(tiny, tmp_path, flags, phases):
    succeeded(run_main(tiny, tmp_path, "--eval-every", 0, *flags))
    for row in read_metrics(tmp_path).values():
        timed = {key.removeprefix("time/") for key in row if key.startswith("time/")} - {"rollout", "update", "iteration"}
        assert timed == phases
        assert sum(row[f"time/{name}"] for name in phases) + row["time/update"] <= row["time/iteration"]


def test_resuming_into_a_run_directory_drops_rows_logged_after_the_checkpoint(tiny, trained):
    # A run that died after checkpoint-1 but had logged iteration 2: resuming must not log iteration 2 twice.
    output_dir = tiny.root / "resumed_in_place"
    shutil.copytree(trained, output_dir)
    succeeded(run_main(tiny, output_dir, "--resume-from", output_dir / "checkpoint-1"))
    rows = [json.loads(line)["iteration"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == [0, 1, 2]


def test_resuming_from_the_final_checkpoint_has_nothing_left_to_do_and_says_so(tiny, trained):
    output_dir = tiny.root / "resumed_final"
    result = succeeded(run_main(tiny, output_dir, "--resume-from", trained / "checkpoint-2"))
    last_line = result.stdout.strip().splitlines()[-1]
    assert last_line.startswith("done: iteration 2 in") and "eval/reward" in last_line
    assert not (output_dir / "checkpoint-2").exists()


def test_a_fresh_run_into_an_earlier_runs_directory_is_refused_and_nothing_is_touched(tiny, trained):
    output_dir = tiny.root / "refused"
    shutil.copytree(trained, output_dir)
    before = {p.relative_to(output_dir): p.stat().st_mtime_ns for p in output_dir.rglob("*")}
    line = single_error_line(run_main(tiny, output_dir, "--num-iterations", 1))
    assert "--output-dir" in line and "--overwrite" in line
    after = {p.relative_to(output_dir): p.stat().st_mtime_ns for p in output_dir.rglob("*") if p.name != ".lock"}
    assert after == {k: v for k, v in before.items() if k.name != ".lock"}


def test_overwrite_removes_the_earlier_run_so_no_stale_checkpoint_is_left(tiny, trained):
    output_dir = tiny.root / "overwritten"
    shutil.copytree(trained, output_dir)
    succeeded(run_main(tiny, output_dir, "--num-iterations", 1, "--overwrite"))
    assert list(read_metrics(output_dir)) == [0, 1]
    assert sorted(p.name for p in output_dir.iterdir() if p.name != ".lock") == ["metrics.jsonl", "policy"]


CHDIR_REWARD = """
import os
def exact_match_after_a_chdir(prompts, completions, answer, **_):
    os.chdir(os.environ["ELSEWHERE"])
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
"""


def test_a_relative_output_dir_stays_put_when_a_reward_function_changes_directory(tiny, tmp_path, monkeypatch):
    (tmp_path / "chdir.py").write_text(CHDIR_REWARD)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("ELSEWHERE", str(elsewhere))
    monkeypatch.chdir(tmp_path)  # and back after the test
    succeeded(run_main(tiny, Path("out"), "--reward-fn", f"{tmp_path / 'chdir.py'}:exact_match_after_a_chdir",
                       "--save-every", 1))
    assert list(read_metrics(tmp_path / "out")) == [0, 1, 2] and (tmp_path / "out" / "checkpoint-2").is_dir()
    assert list(elsewhere.iterdir()) == []


def snapshot(directory):
    """Every file under directory but the locks, with its bytes."""
    return {p.relative_to(directory): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != ".lock"}


FAILING_REWARD = "def fails(prompts, completions, **kw):\n    raise ConnectionError('reward service down')\n"


@pytest.mark.parametrize("failure", ["a-model-that-does-not-load", "ctrl-c-during-model-load"])
def test_overwrite_keeps_the_earlier_run_whole_until_the_models_have_loaded(tiny, trained, tmp_path, failure):
    # The Hugging Face Trainer's overwrite_output_dir: every check runs and the models load before anything is deleted.
    output_dir = tmp_path / "earlier"
    shutil.copytree(trained, output_dir)
    before = snapshot(output_dir)
    if failure == "a-model-that-does-not-load":
        line = single_error_line(run_main(tiny, output_dir, "--overwrite", "--reward-model-path", tiny.policy))
        assert "--reward-model-path" in line and "score.weight" in line
    else:
        load = ppo_llm.load_models

        def load_after_a_ctrl_c(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)  # a first Ctrl-C: stop before the first update
            return load(*args, **kwargs)

        handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # not ignored, as under a background shell
        try:
            with mock.patch.object(ppo_llm, "load_models", load_after_a_ctrl_c):
                result = run_main(tiny, output_dir, "--overwrite")
        finally:
            signal.signal(signal.SIGINT, handler)
        assert result.returncode == 128 + signal.SIGINT and "before the first update" in result.stderr
    assert snapshot(output_dir) == before


def test_overwrite_deletes_the_earlier_run_once_the_models_have_loaded(tiny, trained, tmp_path):
    # A reward function that fails on its first call fails after the deletion: the earlier run is gone, as with the
    # Trainer, and the new run has left only its empty metrics file.
    output_dir = tmp_path / "earlier"
    shutil.copytree(trained, output_dir)
    (tmp_path / "failing.py").write_text(FAILING_REWARD)
    result = run_main(tiny, output_dir, "--overwrite", "--reward-fn", f"{tmp_path / 'failing.py'}:fails")
    assert "reward service down" in single_error_line(result)
    assert snapshot(output_dir) == {Path("metrics.jsonl"): b""}


def test_overwrite_never_touches_the_checkpoint_it_resumes_from(tiny, trained, tmp_path):
    output_dir = tmp_path / "nested"
    shutil.copytree(trained, output_dir)
    before = snapshot(output_dir)
    checkpoint = output_dir / "checkpoint-1"  # the output directory is the checkpoint itself
    line = single_error_line(run_main(tiny, checkpoint, "--resume-from", checkpoint, "--overwrite"))
    assert "--overwrite would delete --resume-from" in line and "checkpoint-1/policy" in line
    assert snapshot(output_dir) == before


def test_a_failed_save_leaves_the_previous_checkpoint_whole_and_no_partial_files(tiny, tmp_path):
    output_dir, save, calls = tmp_path / "disk_full", torch.save, []

    def disk_full_on_the_second_checkpoint(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 2:
            Path(f).write_bytes(b"partial")
            raise OSError(28, "No space left on device")
        return save(obj, f, *args, **kwargs)

    with mock.patch.object(ppo_llm.torch, "save", disk_full_on_the_second_checkpoint):
        line = single_error_line(run_main(tiny, output_dir, "--save-every", 1, "--eval-every", 0))
    assert "cannot save" in line and "checkpoint-2" in line and "No space left on device" in line
    assert sorted(p.name for p in output_dir.iterdir()) == [".lock", "checkpoint-1", "metrics.jsonl"]
    assert torch.load(output_dir / "checkpoint-1" / "training_state.pt", weights_only=True)["iteration"] == 1


def test_same_seed_gives_the_same_metrics(tiny, trained):
    output_dir = trained
    again_dir = tiny.root / "again"
    succeeded(run_main(tiny, again_dir, "--save-every", 1))
    again, first = read_metrics(again_dir), read_metrics(output_dir)
    assert list(again) == list(first)
    for iteration in first:
        assert non_timing(again[iteration]) == non_timing(first[iteration])


def test_final_policy_loads_with_from_pretrained(trained):
    output_dir = trained
    policy = AutoModelForCausalLM.from_pretrained(output_dir / "policy")
    tokenizer = AutoTokenizer.from_pretrained(output_dir / "policy")
    assert isinstance(policy, LlamaForCausalLM)
    assert tokenizer("37+48=")["input_ids"] == [VOCAB[c] for c in "37+48="]


def greedy_reward_model_score(policy, reward_model, prompt, max_new_tokens):
    """Plain greedy decoding up to and including EOS, then the reward model's score at the last token."""
    ids = [VOCAB[c] for c in prompt]
    for _ in range(max_new_tokens):
        next_id = int(policy(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(next_id)
        if next_id == EOS:
            break
    reward_model.config.pad_token_id = None  # score the last token, even if the policy sampled the <pad> symbol
    return reward_model(torch.tensor([ids])).logits[0, 0].item()


def test_reward_model_scores_responses_and_initialises_the_critic(tiny):
    # Before the first update, eval/reward is the reward model's mean score on the initial policy's greedy responses.
    # A critic learning rate of 0 freezes the critic: it must still be the reward model, score head included.
    output_dir = tiny.root / "rm_run"
    succeeded(run_main(tiny, output_dir, "--reward-model-path", tiny.rm, "--critic-init", "reward",
                       "--critic-learning-rate", 0, "--num-iterations", 1,
                       "--save-every", 1))
    policy = AutoModelForCausalLM.from_pretrained(tiny.policy)
    reward_model = LlamaForSequenceClassification.from_pretrained(tiny.rm)
    with torch.no_grad():
        expected = statistics.fmean(
            greedy_reward_model_score(policy, reward_model, json.loads(line)["prompt"], 4)
            for line in tiny.eval.read_text().splitlines()
        )
    assert read_metrics(output_dir)[0]["eval/reward"] == pytest.approx(expected, abs=1e-4)
    rm_weights = load_file(tiny.rm / "model.safetensors")
    critic = load_file(output_dir / "checkpoint-1" / "critic" / "model.safetensors")
    assert weights_differing(rm_weights, critic) == []


# A reward model with its own tokenizer: other ids for the same characters, and no pad token.
OTHER_VOCAB = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(reversed(CHARS))}}


@pytest.fixture(scope="module")
def other_rm(tiny):
    path = tiny.root / "rm_other_tokenizer"
    torch.manual_seed(1)
    LlamaForSequenceClassification(llama_config(None, vocab_size=len(OTHER_VOCAB), num_labels=1)).save_pretrained(path)
    char_tokenizer(None, vocab=OTHER_VOCAB).save_pretrained(path)
    return path


def test_a_reward_model_with_another_tokenizer_scores_the_text_ending_with_its_eos(tiny, other_rm):
    output_dir = tiny.root / "rm_other_run"
    succeeded(run_main(tiny, output_dir, "--reward-model-path", other_rm, "--num-iterations", 1))
    policy = AutoModelForCausalLM.from_pretrained(tiny.policy)
    reward_model = LlamaForSequenceClassification.from_pretrained(other_rm)
    id_to_char = {i: c for c, i in VOCAB.items()}
    expected = []
    with torch.no_grad():
        for line in tiny.eval.read_text().splitlines():
            prompt = json.loads(line)["prompt"]
            ids = [VOCAB[c] for c in prompt]
            for _ in range(4):
                ids.append(int(policy(torch.tensor([ids])).logits[0, -1].argmax()))
                if ids[-1] == EOS:
                    break
            # The text the reward model reads: prompt, completion (special symbols dropped), then its EOS if one was sampled.
            completion = "".join(id_to_char[i] for i in ids[len(prompt):] if i not in (PAD, EOS))
            other_ids = [OTHER_VOCAB[c] for c in prompt + completion] + ([OTHER_VOCAB["<eos>"]] if ids[-1] == EOS else [])
            expected.append(reward_model(torch.tensor([other_ids])).logits[0, 0].item())
    assert read_metrics(output_dir)[0]["eval/reward"] == pytest.approx(statistics.fmean(expected), abs=1e-4)


def test_reward_model_text_ends_with_its_eos_only_when_the_response_ended(other_rm):
    models = SimpleNamespace(tokenizer=char_tokenizer(), reward_tokenizer=ppo_llm.load_tokenizer(str(other_rm), "--reward-model-path"))
    rows = [{"prompt": "1+2="}, {"prompt": "3+4="}]
    texts, templated = ppo_llm.reward_model_texts(models, rows, ["3", "77"], torch.tensor([True, False]), Args())
    assert (texts, templated) == (["1+2=3<eos>", "3+4=77"], False)
    assert models.reward_tokenizer.pad_token == "<eos>"  # it had none: padding needs one


# A chat template in the characters the tiny vocabularies know: a user turn ends with "=", an assistant turn with <eos>.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'user' %}={% else %}<eos>{% endif %}"
                 "{% endfor %}")


def test_reward_model_chat_template_closes_only_the_turns_of_responses_that_ended(other_rm):
    reward_tokenizer = ppo_llm.load_tokenizer(str(other_rm), "--reward-model-path")
    reward_tokenizer.chat_template = CHAT_TEMPLATE
    models = SimpleNamespace(tokenizer=char_tokenizer(), reward_tokenizer=reward_tokenizer)
    rows = [{"prompt": "1+2"}, {"prompt": "3+4"}]
    texts, templated = ppo_llm.reward_model_texts(models, rows, ["3", "77"], torch.tensor([True, False]),
                                                  Args(chat_template=True))
    assert (texts, templated) == (["1+2=3<eos>", "3+4=77"], True)


def test_chat_template_wraps_each_prompt_before_generation(tiny, tmp_path):
    # The template turns "12+34" into "12+34=": greedy eval on bare prompts must match eval on the written-out ones.
    templated_model = tmp_path / "templated"
    shutil.copytree(tiny.policy, templated_model)
    tokenizer = AutoTokenizer.from_pretrained(templated_model)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(templated_model)
    bare_eval = write_jsonl(tmp_path / "bare.jsonl", [dict(row, prompt=row["prompt"].rstrip("=")) for row in
                                                        map(json.loads, tiny.eval.read_text().splitlines())])
    plain, templated = tmp_path / "plain", tmp_path / "templated_run"
    # Scored by a reward model: a real-valued score of the exact token sequences, so any difference would show.
    succeeded(run_main(tiny, plain, "--num-iterations", 1, "--reward-model-path", tiny.rm))
    succeeded(run_main(tiny, templated, "--num-iterations", 1, "--reward-model-path", tiny.rm, "--chat-template",
                       "--eval-prompts-path", bare_eval, model=templated_model))
    assert read_metrics(templated)[0]["eval/reward"] == pytest.approx(read_metrics(plain)[0]["eval/reward"], abs=1e-6)


def test_critic_init_from_a_reward_model_with_another_tokenizer_is_an_error(tiny, tmp_path, other_rm):
    line = single_error_line(run_main(tiny, tmp_path / "out", "--reward-model-path", other_rm, "--critic-init", "reward"))
    assert "--critic-init reward" in line and "tokenizer differs" in line


def test_shared_critic_trains_a_value_head_on_the_policy(tiny):
    output_dir = tiny.root / "shared"
    # Scored by the reward model, so returns are non-zero from the first iteration (exact match on an untrained
    # policy scores 0 and the KL to the reference starts at 0, which would leave nothing to learn).
    succeeded(run_main(tiny, output_dir, "--shared-critic", "--reward-model-path", tiny.rm, "--num-iterations", 1,
                       "--save-every", 1))
    value_head = torch.load(output_dir / "checkpoint-1" / "value_head.pt")
    # The head starts at zero; any update moves it.
    assert value_head["weight"].abs().sum() > 0
    assert list(read_metrics(output_dir)) == [0, 1]


@pytest.mark.parametrize("model", ["nopad", "padeos"], ids=["tokenizer-without-pad", "pad-equals-eos"])
def test_trains_end_to_end_when_the_tokenizer_has_no_distinct_pad(tiny, model):
    output_dir = tiny.root / f"run_{model}"
    succeeded(run_main(tiny, output_dir, "--num-iterations", 1, model=getattr(tiny, model)))
    metrics = read_metrics(output_dir)[1]
    assert 1 <= metrics["rollout/response_length"] <= 4
    assert (output_dir / "policy" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------------------
# --help, the console and other inputs
# ---------------------------------------------------------------------------------------------------------


def names_part_reaches(nodes):
    """The names that top-level code loads, less each function's own parameters and locals, and annotations."""
    found = set()

    def visit(node, local):
        if isinstance(node, (ast.FunctionDef, ast.Lambda)):
            local = local | {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)} | {
                n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for field, value in ast.iter_fields(node):
            if field not in ("annotation", "returns"):
                for child in value if isinstance(value, list) else [value]:
                    if isinstance(child, ast.AST):
                        visit(child, local)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
            found.add(node.id)

    for node in nodes:
        visit(node, frozenset())
    return found


def test_each_appendix_header_names_what_parts_1_and_2_reach_in_it():
    lines = SCRIPT.read_text().splitlines()
    part2, part3 = lines.index("# Part 2: the variants") + 1, lines.index("# Part 3: the machinery") + 1
    starts = [(number, line) for number, line in enumerate(lines, 1) if line.startswith("# Appendix ")]
    header = {number: " ".join(l for l in itertools.takewhile(lambda l: l.startswith("#"), lines[number - 1:]))
              for number, _ in starts}
    tree = ast.parse(SCRIPT.read_text())
    reached = {1: names_part_reaches([n for n in tree.body if n.lineno < part2]),
               2: names_part_reaches([n for n in tree.body if part2 < n.lineno < part3])}
    unnamed = []
    for node in tree.body:
        names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [
            t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        appendix = max((number for number, _ in starts if number <= node.lineno), default=None)
        for name in names if node.lineno > part3 else []:
            unnamed += [(part, name) for part in (1, 2) if name in reached[part]
                        and not re.search(rf"\b{name}\b", header[appendix])]
    assert unnamed == [] and len(starts) == 7



def help_text(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        ppo_llm.parse_args([*argv, "--help"])
    assert stopped.value.code == 0
    return capsys.readouterr().out


def docstrings(section):
    """{field: docstring} of a dataclass, read from its source: the string statement after each annotated field."""
    body = ast.parse(textwrap.dedent(inspect.getsource(section))).body[0].body
    return {statement.target.id: following.value.value for statement, following in zip(body, body[1:])
            if isinstance(statement, ast.AnnAssign) and isinstance(following, ast.Expr)}


def help_groups(text):
    """{group title: the flags at the start of its entries}, from tyro's boxes (or their plain-text form off a
    terminal): a flag's entry starts one column in, its wrapped description further in."""
    groups = {}
    for line in text.splitlines():
        title = re.match(r"^[╭─ ]*([a-z-]+ )?options\b", line)
        if title:
            flags = groups.setdefault((title.group(1) or "").strip(), [])
        elif re.match(r"^(│ |  )--[a-z]", line):
            flags.append(re.match(r"^(│ |  )(--[a-z0-9-]+)", line).group(2))
    return groups


def test_help_groups_the_flags_by_the_sources_sections_and_keeps_them_flat(capsys):
    groups = help_groups(help_text([], capsys))
    assert list(groups) == ["", *(name.replace("_", "-") for name in ppo_llm.SECTIONS)]
    for name, section in ppo_llm.SECTIONS.items():
        assert groups[name.replace("_", "-")] == ["--" + f.name.replace("_", "-") for f in dataclasses.fields(section)]


def test_every_flags_docstring_is_one_line_that_help_shows_whole(capsys):
    shown = " ".join(" ".join(line.strip("│ ").split()) for line in help_text([], capsys).splitlines())
    for section in ppo_llm.SECTIONS.values():
        for name, doc in docstrings(section).items():
            assert "\n" not in doc, name
            assert doc in shown, name


def test_a_run_says_where_its_output_goes_explains_its_columns_once_and_ends_with_a_summary(tiny, tmp_path):
    output_dir = tmp_path / "out"
    lines = succeeded(run_main(tiny, output_dir, "--save-every", "1")).stdout.splitlines()
    assert f"output: {output_dir}/ gets metrics.jsonl (every iteration), checkpoint-N (every 1 iterations), policy/ (at the end)" in lines
    legend = ppo_llm.LEGEND.splitlines()
    assert [i for i, line in enumerate(lines) if line == legend[0]] == [lines.index("iter    0 | eval 0.000 (before training)") + 1]
    for column in re.findall(r"\| (\w+) ", lines[-2]):  # every column of an iteration's line is explained
        assert re.search(rf"(columns:| ) {column} ", ppo_llm.LEGEND), column
    metrics = read_metrics(output_dir)
    assert lines[-1] == (f"done: iteration 2 in {lines[-1].split(' in ')[1].split('s;')[0]}s; eval/reward "
                         f"{metrics[0]['eval/reward']:.3f} -> {metrics[2]['eval/reward']:.3f}; metrics in "
                         f"{output_dir / 'metrics.jsonl'}; last checkpoint {output_dir / 'checkpoint-2'}; "
                         f"final policy in {output_dir / 'policy'}")


def test_track_leaves_every_iterations_metrics_in_tensorboard_and_no_writer_thread_running(tiny, tmp_path):
    # TensorBoard's writer hands events to a thread of its own: the run must close it, or the interpreter's exit kills
    # that thread with whatever it still holds.
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    threads = set(threading.enumerate())
    succeeded(run_main(tiny, tmp_path, "--track"))
    assert set(threading.enumerate()) - threads == set()  # no thread left behind (one that ended is no matter)
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    metrics = read_metrics(tmp_path)
    assert list(metrics) == [0, 1, 2] and len(metrics[2]) > 20
    for iteration, row in metrics.items():
        for key, value in row.items():
            written = {event.step: event.value for event in events.Scalars(key)}
            assert written[iteration] == pytest.approx(value, rel=1e-6, nan_ok=True), (iteration, key)


def test_the_progress_line_says_when_prompts_are_tokenized_and_responses_scored(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    texts = ["1+1="] * 600
    source = ppo_llm.PromptFile("--prompts-path", "p.jsonl", [{"prompt": t} for t in texts], list(range(1, 601)))
    assert len(ppo_llm.encode(char_tokenizer(), texts, source, False)) == 600
    shown = sys.stdout.getvalue()
    assert "tokenizing --prompts-path: 256 of 600 texts" in shown and "512 of 600" in shown
    assert shown.endswith("\r\033[K\r")  # cleared before the next line
    models = SimpleNamespace(tokenizer=char_tokenizer(), reward_model=None, device=torch.device("cpu"))
    batch = dict(responses=torch.tensor([[4, EOS], [4, EOS]]))
    rows = [{"prompt": "1+1=", "answer": "2"}] * 2
    ppo_llm.score_responses(models, ppo_llm.Reward(ppo_llm.exact_match_reward, "exact_match"), batch, rows, ppo_llm.Args())
    assert "\r\033[Kscoring 2 responses" in sys.stdout.getvalue()


def test_a_console_that_cannot_encode_a_path_prints_it_escaped_and_the_run_goes_on(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(SUBPROCESS_ENV, "PYTHONIOENCODING", "ascii")  # a console that cannot print "é"
    result = run_script(tiny, tmp_path / "caf\u00e9", "--num-iterations", 1, "--eval-every", 0)
    assert result.returncode == 0, result.stderr
    assert "caf\\xe9" in result.stdout and (tmp_path / "caf\u00e9" / "policy" / "config.json").is_file()


def test_progress_is_shown_on_a_terminal_and_nowhere_else(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, expected in ((Terminal(), "\r\033[Kupdating: minibatch 1/4"), (io.StringIO(), "")):
        monkeypatch.setattr(sys, "stdout", stream)
        ppo_llm.progress("updating: minibatch 1/4")
        assert stream.getvalue() == expected


@pytest.mark.parametrize("form", ["parquet", "csv"])
def test_a_parquet_or_csv_file_with_question_fields_trains_as_its_jsonl_does(tiny, tmp_path, form):
    datasets = pytest.importorskip("datasets")
    rows = [json.loads(line) for line in tiny.train.read_text().splitlines()]
    path = tmp_path / f"questions.{form}"
    table = datasets.Dataset.from_list([{"question": row["prompt"], "answer": row["answer"]} for row in rows])
    table.to_parquet(path) if form == "parquet" else table.to_csv(path, index=False)
    succeeded(run_main(tiny, tmp_path / "jsonl", "--eval-every", 0))
    succeeded(run_main(tiny, tmp_path / form, "--eval-every", 0, "--prompts-path", path, "--prompt-field", "question"))
    expected, metrics = read_metrics(tmp_path / "jsonl"), read_metrics(tmp_path / form)
    assert sorted(metrics) == [1, 2] and {i: non_timing(m) for i, m in metrics.items()} == \
        {i: non_timing(m) for i, m in expected.items()}


def test_without_the_datasets_package_a_csv_file_stops_with_one_line_saying_to_install_it(tiny, tmp_path):
    path = tmp_path / "questions.csv"
    path.write_text("question,answer\n1+1=,2\n")
    with mock.patch.dict(sys.modules, {"datasets": None}):  # what `import datasets` meets where it is not installed
        line = single_error_line(run_main(tiny, tmp_path / "out", "--prompts-path", path, "--prompt-field", "question"))
    assert line == f"error: --prompts-path {path}: reading it needs the datasets package: pip install datasets"


@pytest.fixture(scope="module")
def demo_run(demo_runs):
    return demo_runs("ppo")


def test_the_demo_learns_and_the_doctor_warns_at_most_of_the_critics_weak_values(demo_run):
    # The demo's reward is 0 or 1 at the last token, mostly sampling luck once the policy has learned to carry: its
    # critic's explained variance hovers around 0, and with most seeds the doctor says so (README, "The demo")
    assert demo_run.metrics[0]["eval/reward"] < 0.5 and demo_run.metrics[40]["eval/reward"] > 0.9
    warned = {line.split("]")[0] for line in demo_run.stdout.splitlines() if line.startswith("doctor")}
    assert warned <= {"doctor [explained_variance_negative"}
    assert {key for row in demo_run.metrics.values() for key in row if key.startswith("doctor/")} <= \
        {"doctor/explained_variance_negative"}


@pytest.mark.parametrize("doctor", ["warn", "off"])
def test_a_doctors_warning_reaches_the_console_and_the_metrics_unless_turned_off(tiny, tmp_path, doctor):
    # With one new token every response stops at the limit: the length_pinned signal, from the first full window on
    result = succeeded(run_main(tiny, tmp_path, "--max-new-tokens", 1, "--num-iterations", 6, "--doctor", doctor))
    lines = result.stdout.splitlines()
    logged = read_metrics(tmp_path)
    if doctor == "warn":  # other signals may show too in so odd a run; this one must
        pinned = [line for line in lines if line.startswith("doctor [length_pinned]")]
        assert len(pinned) == 1 and pinned[0].startswith("doctor [length_pinned] response length 1.0 >= 0.95 x")
        assert {i: row["doctor/length_pinned"] for i, row in logged.items() if "doctor/length_pinned" in row} == \
            {ppo_llm.DOCTOR_WINDOW: 1}
    else:
        assert [line for line in lines if line.startswith("doctor")] == []
        assert [key for row in logged.values() for key in row if key.startswith("doctor/")] == []



# ---------------------------------------------------------------------------------------------------------
# The sampler (our own loop with the KV cache; test_grpo_llm.py tests its distribution, its twin there)
# ---------------------------------------------------------------------------------------------------------


def test_the_rollouts_passes_in_micro_batches_give_one_whole_batch_passs_numbers(tiny):
    # Responses of 5, 2, 3 and 1 tokens, padded to 5, in micro-batches of 2: pi_old, pi_ref and V (also
    # --recompute-advantages' V) on the real tokens equal one pass over the whole batch.
    args = Args(model_name_or_path=str(tiny.policy), micro_batch_size=2)
    models = ppo_llm.load_models(args, torch.device("cpu"), resume=None)
    mask = torch.arange(5).unsqueeze(0) < torch.tensor([[5], [2], [3], [1]])
    responses = torch.randint(2, 12, (4, 5), generator=torch.Generator().manual_seed(3)).masked_fill(~mask, PAD)
    sequences = torch.cat([torch.tensor([[3, 12, 4, 13]]).repeat(4, 1), responses], 1)
    attention = torch.cat([torch.ones(4, 4, dtype=torch.long), mask.long()], 1)
    rollout = dict(query_responses=sequences, attention_mask=attention, responses=responses, response_mask=mask,
                   context_length=4)
    with torch.no_grad():
        passes = ppo_llm.forward_rollout(models, rollout, args)
        passes["recomputed_values"] = ppo_llm.recompute_values(models, rollout, args)
        logprobs = ppo_llm.policy_forward(models.policy, rollout, slice(None), args.temperature).logprobs
        with models.reference() as ref_policy:
            ref_logprobs = ppo_llm.policy_forward(ref_policy, rollout, slice(None), args.temperature).logprobs
        values = ppo_llm.critic_values(models, rollout, slice(None))
    for key, expected in (("logprobs", logprobs), ("ref_logprobs", ref_logprobs), ("values", values),
                          ("recomputed_values", values)):
        assert passes[key].shape == (4, 5), key
        torch.testing.assert_close(passes[key][mask], expected[mask], atol=1e-5, rtol=0, msg=key)


# ---------------------------------------------------------------------------------------------------------
# LoRA (--lora-r): adapters on the policy and the critic, the reference is the policy with its adapters off
# ---------------------------------------------------------------------------------------------------------


def test_with_lora_the_reference_is_the_base_model_and_the_adapters_change_the_policy(tiny):
    pytest.importorskip("peft")
    torch.manual_seed(0)
    args = Args(model_name_or_path=str(tiny.policy), lora_r=4, lora_alpha=8.0, max_new_tokens=4)
    models = ppo_llm.load_models(args, torch.device("cpu"), resume=None)
    assert models.ref_policy is None  # no second model in memory
    for name, weight in models.policy.named_parameters():
        if "lora_B" in name:  # B starts at 0 (the adapters add nothing yet): give them something to add
            weight.data.normal_(0, 0.5)
    rollout = ppo_llm.generate(models, [[3, 4, 12], [5, 13]], args, greedy=False)

    def logprobs(model):
        return ppo_llm.policy_forward(model, rollout, slice(None), args.temperature).logprobs[rollout["response_mask"]]

    with torch.no_grad(), models.reference() as ref_policy:
        reference = logprobs(ref_policy)
    with torch.no_grad():
        expected = logprobs(AutoModelForCausalLM.from_pretrained(tiny.policy, dtype=torch.float32).eval())
        adapted = logprobs(models.policy)
    assert torch.equal(reference, expected)
    assert not torch.allclose(adapted, expected, atol=1e-3)


def test_a_lora_checkpoint_holds_the_adapters_resumes_exactly_and_the_final_policy_is_a_plain_model(tiny, tmp_path):
    pytest.importorskip("peft")
    flags = ("--lora-r", 4, "--learning-rate", 2e-3, "--save-every", 1)
    succeeded(run_main(tiny, tmp_path / "run", *flags))
    checkpoint = tmp_path / "run" / "checkpoint-1"
    for part in ("policy", "critic"):  # the critic's adapters carry its score head, trained in full
        assert sorted(p.name for p in (checkpoint / part).glob("adapter_*")) == ["adapter_config.json", "adapter_model.safetensors"]
    critic_adapters = load_file(str(checkpoint / "critic" / "adapter_model.safetensors"))
    assert critic_adapters["base_model.model.score.weight"].shape[0] == 1  # the whole head, not an adapter on it
    assert not any("score" in key and "lora" in key for key in critic_adapters)
    succeeded(run_main(tiny, tmp_path / "resumed", *flags, "--resume-from", checkpoint))
    assert non_timing(read_metrics(tmp_path / "resumed")[2]) == non_timing(read_metrics(tmp_path / "run")[2])
    final = load_file(str(tmp_path / "run" / "policy" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "resumed" / "policy" / "model.safetensors"))
    base = load_file(str(tiny.policy / "model.safetensors"))
    assert final.keys() == base.keys()  # the adapters merged: the base model's own tensors, nothing else
    assert all(torch.equal(final[name], resumed[name]) for name in final)
    assert any(not torch.equal(final[name], base[name]) for name in final)
    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "policy")


def test_without_peft_lora_stops_with_one_line_saying_to_install_it(tiny, tmp_path):
    with mock.patch.dict(sys.modules, {"peft": None}):  # what the import system meets where peft is not installed
        line = single_error_line(run_main(tiny, tmp_path, "--lora-r", 8))
    assert line == "error: --lora-r needs the peft package: pip install peft"


def test_lora_learns_the_demo(demo_runs):
    run = demo_runs("ppo-lora")
    assert run.metrics[max(run.metrics)]["eval/reward"] >= run.metrics[0]["eval/reward"] + 0.25

# ---------------------------------------------------------------------------------------------------------
# Bad input: one line on stderr, "error: ...", non-zero exit
# ---------------------------------------------------------------------------------------------------------


def single_error_line(result):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# Checked before any model loads: (model path, flags) -> what the error line must name. Where the model path is
# an empty directory, which cannot be loaded, getting this error proves the check ran first.
PRELOAD_ERRORS = {
    "model-path-missing": (lambda t: (t.root / "no_such_model", []), ["--model-name-or-path", "no such directory"]),
    "prompts-missing": (
        lambda t: (t.empty_dir, ["--prompts-path", t.root / "missing.jsonl"]), ["--prompts-path", "not found"]
    ),
    "prompts-empty": (lambda t: (t.empty_dir, ["--prompts-path", t.empty_prompts]), ["--prompts-path", "no rows"]),
    "prompts-malformed": (
        lambda t: (t.empty_dir, ["--prompts-path", t.malformed_prompts]), ["--prompts-path", "line 2", "not valid JSON"]
    ),
    "row-without-prompt": (lambda t: (t.empty_dir, ["--prompts-path", t.promptless_rows]), ["line 1", "'prompt'"]),
    "fsdp-in-one-process": (lambda t: (t.empty_dir, ["--fsdp"]), ["--fsdp does nothing in one process", "torchrun"]),
    "tools-without-max-tool-calls": (lambda t: (t.empty_dir, ["--tools", "calculator"]),
                                     ["--tools does nothing with --max-tool-calls 0"]),
    "max-tool-calls-without-tools": (lambda t: (t.empty_dir, ["--max-tool-calls", 1]), ["--max-tool-calls needs --tools"]),
    "tool-that-cannot-be-imported": (lambda t: (t.empty_dir, ["--max-tool-calls", 1, "--tools", t.root / "no.py:f"]),
                                     ["--tools", "no.py:f' cannot be imported"]),
    "dual-clip-inside-the-clip-range": (
        lambda t: (t.empty_dir, ["--clip-eps-high", 0.28, "--dual-clip", 1.2]), ["--dual-clip 1.2 must exceed", "(1.28)"]
    ),
    "batch-not-divisible-by-minibatches": (
        lambda t: (t.empty_dir, ["--num-prompts", 4, "--num-minibatches", 3]),
        ["--num-prompts", "--num-minibatches", "4 is not divisible by 3"],
    ),
    "minibatch-not-divisible-by-micro-batch": (
        lambda t: (t.empty_dir, ["--num-prompts", 8, "--num-minibatches", 2, "--micro-batch-size", 3]),
        ["--micro-batch-size", "4 is not divisible by 3"],
    ),
    "reward-fn-not-importable": (
        lambda t: (t.empty_dir, ["--reward-fn", "no_such_reward_module:score"]),
        ["--reward-fn", "no_such_reward_module:score", "cannot be imported"],
    ),
    "track-without-tensorboard": (
        lambda t: (t.empty_dir, ["--track"]), ["--track", "needs the tensorboard package"]
    ),
    "resume-from-not-a-checkpoint": (
        lambda t: (t.empty_dir, ["--resume-from", t.empty_dir]), ["--resume-from", "not a checkpoint"]
    ),
    # An unset shell variable: '' would otherwise mean the current directory, or no resume at all.
    "output-dir-empty": (lambda t: (t.empty_dir, ["--output-dir", ""]), ["--output-dir is empty"]),
    "resume-from-empty": (lambda t: (t.empty_dir, ["--resume-from", ""]), ["--resume-from is empty"]),
    "output-dir-name-too-long": (lambda t: (t.empty_dir, ["--output-dir", t.root / ("x" * 300)]),
                                 ["--output-dir", "File name too long"]),
    "resume-from-name-too-long": (lambda t: (t.empty_dir, ["--resume-from", t.root / ("x" * 300)]),
                                  ["--resume-from", "File name too long"]),
    # Every knob's range (RANGES), checked first: sizes say "must be positive" before any divisibility message.
    **{f"range{flags[0]}={flags[1]}": (lambda t, flags=flags: (t.empty_dir, flags), [flags[0], expected])
       for flags, expected in [
           (["--max-grad-norm", -1], "must be positive"), (["--max-grad-norm", 0], "must be positive"),
           (["--reward-clip", 0], "must be positive"), (["--clip-eps-high", -0.1], "must be positive"),
           (["--value-clip-eps", 0], "must be positive"), (["--target-kl", 0], "must be positive"),
           (["--kl-coef", -0.1], "must be >= 0"), (["--length-adaptive-alpha", 0], "must be positive"),
           (["--top-p", 0], "must be in (0, 1]"), (["--top-p", 1.5], "must be in (0, 1]"), (["--top-k", -1], "must be >= 0"),
           (["--kl-horizon", 0, "--kl-schedule", "adaptive"], "must be positive"),
           (["--kl-horizon", 1, "--kl-schedule", "adaptive", "--num-prompts", 8], "must exceed 0.2 x the batch (8 responses)"),
           (["--kl-coef", 0, "--kl-schedule", "adaptive"], "needs --kl-coef > 0"),
           (["--learning-rate", -1e-4], "must be >= 0"), (["--critic-learning-rate", -1e-4], "must be >= 0"),
           (["--weight-decay", -0.1], "must be >= 0"), (["--seed", 2**64], "must be in [0, 2**64)"),
           (["--seed", -1], "must be in [0, 2**64)"), (["--save-every", -1], "must be >= 0"),
           (["--eval-every", -1], "must be >= 0"), (["--sample-every", -1], "must be >= 0"),
           (["--num-prompts", 0], "must be positive, got 0"), (["--num-minibatches", 0], "must be positive, got 0"),
           (["--micro-batch-size", 0], "must be positive, got 0"), (["--clip-eps", 1.5], "must be in (0, 1)"),
           (["--learning-rate", "nan"], "must be >= 0 and finite"), (["--temperature", "inf"], "must be in [0.001, inf) and finite"),
           (["--temperature", 1e-45], "must be in [0.001, inf)"),
           (["--gae-lambda", 1.1], "must be in [0, 1]"), (["--dual-clip", 1.0], "must be in (1, inf)"),
           (["--save-total-limit", 0], "must be positive"), (["--missing-eos-penalty", -1], "must be >= 0"),
           (["--min-p", 1], "must be in [0, 1)"), (["--entropy-target", -1], "must be >= 0"),
           (["--ent-coef-delta", 0], "must be positive"), (["--ent-coef-min", -1], "must be >= 0"),
           (["--ent-coef-max", -1], "must be >= 0"), (["--ref-sync-every", -1], "must be >= 0"),
           (["--ref-sync-alpha", 0], "must be in (0, 1]"), (["--ref-sync-alpha", 1.5], "must be in (0, 1]"),
       ]},
    # Adaptive entropy control and reference sync, where they do nothing or cannot work.
    "entropy-step-without-a-target": (lambda t: (t.empty_dir, ["--ent-coef-delta", 0.01]),
                                      ["--ent-coef-delta does nothing without --entropy-target"]),
    "entropy-coefficient-outside-its-bounds": (lambda t: (t.empty_dir, ["--entropy-target", 0.5, "--ent-coef", 2.0]),
                                               ["--ent-coef 2.0 must lie in"]),
    "reference-sync-alpha-without-sync": (lambda t: (t.empty_dir, ["--ref-sync-alpha", 0.5]),
                                          ["--ref-sync-alpha does nothing without --ref-sync-every"]),
    "reference-sync-with-kl-coef-0": (lambda t: (t.empty_dir, ["--kl-coef", 0, "--ref-sync-every", 2]),
                                      ["--ref-sync-every does nothing with --kl-coef 0"]),
    "reference-sync-with-lora": (lambda t: (t.empty_dir, ["--lora-r", 4, "--ref-sync-every", 2]),
                                 ["--ref-sync-every with --lora-r", "adapters off"]),
    # Flags that would do nothing without another.
    "wandb-project-without-track": (lambda t: (t.empty_dir, ["--wandb-project", "p"]), ["--wandb-project", "without --track"]),
    "ptx-path-without-ptx-coef": (lambda t: (t.empty_dir, ["--ptx-path", t.train]), ["--ptx-path", "without --ptx-coef"]),
    "reward-fn-with-reward-model": (
        lambda t: (t.empty_dir, ["--reward-fn", "last_number", "--reward-model-path", t.rm]), ["--reward-fn", "--reward-model-path"]
    ),
    "kl-coef-final-without-linear": (
        lambda t: (t.empty_dir, ["--kl-coef-final", 0.3]), ["--kl-coef-final", "without --kl-schedule linear"]
    ),
    "lora-targets-without-lora": (
        lambda t: (t.empty_dir, ["--lora-target-modules", "q_proj"]), ["--lora-target-modules does nothing with --lora-r 0"]),
    "lora-rank-negative": (lambda t: (t.empty_dir, ["--lora-r", -1]), ["--lora-r must be >= 0"]),
    "save-total-limit-without-saves": (
        lambda t: (t.empty_dir, ["--save-total-limit", 2]), ["--save-total-limit", "--save-every 0"]
    ),
    # Data files.
    "prompts-not-utf8": (lambda t: (t.empty_dir, ["--prompts-path", t.latin1_prompts]), ["--prompts-path", "line 2", "not UTF-8"]),
    "eval-row-without-answer": (
        lambda t: (t.empty_dir, ["--eval-prompts-path", t.answerless_eval]), ["--eval-prompts-path", "line 3", "'answer'"]
    ),
    "field-named-completions": (
        lambda t: (t.empty_dir, ["--prompts-path", t.completions_field]), ["--prompts-path", "line 1", "'completions'"]
    ),
    "ptx-not-utf8": (
        lambda t: (t.empty_dir, ["--ptx-coef", 0.1, "--ptx-path", t.latin1_prompts]), ["--ptx-path", "line 2", "not UTF-8"]
    ),
    # Prompts in other forms and fields.
    "dataset-split-with-a-prompts-file": (
        lambda t: (t.empty_dir, ["--dataset-split", "test"]),
        ["--dataset-split does nothing unless --prompts-path names a Hugging Face dataset"]),
    "dataset-config-with-prompts-files": (lambda t: (t.empty_dir, ["--dataset-config", "main"]), ["--dataset-config does nothing"]),
    "rows-without-the-prompt-field": (
        lambda t: (t.empty_dir, ["--prompts-path", t.promptless_rows, "--prompt-field", "text"]),
        ["line 1: row has no string field 'text' (--prompt-field) (its fields: question, answer)"]),
    "prompt-field-beside-a-prompt": (
        lambda t: (t.empty_dir, ["--prompt-field", "question"]), ["line 1: row has a field 'prompt' besides --prompt-field"]),
    "rows-without-the-answer-field": (
        lambda t: (t.empty_dir, ["--prompts-path", t.solutions, "--prompt-field", "question", "--answer-field", "result",
                                 "--eval-every", 0]),
        ["--prompts-path", "line 1", "--reward-fn exact_match needs the field 'result' (--answer-field)"]),
    "missing-csv-file": (lambda t: (t.empty_dir, ["--prompts-path", t.root / "no.csv"]), ["no.csv: file not found"]),
    "typo-in-a-relative-file-name": (lambda t: (t.empty_dir, ["--prompts-path", "data/train.jsnl"]), ["data/train.jsnl: file not found"]),
    "empty-prompt-field": (lambda t: (t.empty_dir, ["--prompt-field", ""]), ["must be two different, non-empty field names"]),
    # The output directory.
    "output-dir-is-a-file": (lambda t: (t.empty_dir, ["--output-dir", t.train]), ["--output-dir", "not a directory"]),
    "output-dir-below-a-file": (lambda t: (t.empty_dir, ["--output-dir", t.train / "out"]), ["--output-dir", "cannot write"]),
    "reward-fn-empty": (lambda t: (t.empty_dir, ["--reward-fn", ""]), ["--reward-fn '': expected one of"]),
    "reward-module-exits-on-import": (lambda t: (t.empty_dir, ["--reward-fn", f"{hostile(t, 'exits_on_import.py')}:score"]),
                                      ["exits_on_import.py:score' cannot be imported: SystemExit: 0"]),
    "reward-module-interrupts-on-import": (
        lambda t: (t.empty_dir, ["--reward-fn", f"{hostile(t, 'interrupts_on_import.py')}:score"]),
        ["interrupts_on_import.py:score' cannot be imported: KeyboardInterrupt"]),
    "prompt-of-only-whitespace": (lambda t: (t.empty_dir, ["--prompts-path", hostile(t, "whitespace_prompt.jsonl")]),
                                  ["--prompts-path", "line 2: the prompt is empty or only whitespace"]),
    "answer-nan": (lambda t: (t.empty_dir, ["--prompts-path", hostile(t, "nan_answer.jsonl"), "--eval-every", 0]),
                   ["line 1", "a text or a number (found nan)"]),
    "answer-a-list": (lambda t: (t.empty_dir, ["--prompts-path", hostile(t, "list_answer.jsonl"), "--eval-every", 0]),
                      ["line 1", "a text or a number (found ['2'])"]),
    "prompts-integer-too-long-for-json": (
        lambda t: (t.empty_dir, ["--prompts-path", t.huge_int_prompts]), ["--prompts-path", "line 1", "not valid JSON"]
    ),
}


@pytest.mark.parametrize("case", list(PRELOAD_ERRORS))
def test_bad_input_is_reported_before_any_model_loads(tiny, tmp_path, case):
    model_and_flags, expected = PRELOAD_ERRORS[case]
    model, flags = model_and_flags(tiny)
    hidden = {"tensorboard": None} if case == "track-without-tensorboard" else {}  # as where it is not installed
    with mock.patch.dict(sys.modules, hidden):
        line = single_error_line(run_main(tiny, tmp_path / "out", *flags, model=model))
    assert [part for part in expected if part not in line] == [], line


def test_a_bom_at_the_start_of_a_prompts_file_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": "4"}\n')
    prompts = ppo_llm.load_prompts(str(path), "--prompts-path")
    assert [row["prompt"] for row in prompts.rows] == ["1+1=", "2+2="] and prompts.where(1).endswith("line 3")


def hostile(t, name):
    """The third trust pass's files, made under the tiny fixture's root on first use."""
    path = t.root / name
    if path.exists():
        return path
    if name == "fewer_layers":  # the weights of 2 layers under a config.json of 1
        shutil.copytree(t.policy, path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=1)))
    elif name == "broken_template":  # a chat template whose own code raises
        shutil.copytree(t.policy, path)
        tokenizer = char_tokenizer("<pad>")
        tokenizer.chat_template = "{{ raise_exception('this template only renders system turns') }}"
        tokenizer.save_pretrained(path)
    elif name == "drops_tools_template":  # a chat template that leaves tool messages out without a word
        shutil.copytree(t.policy, path)
        tokenizer = char_tokenizer("<pad>")
        tokenizer.chat_template = "{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}{% endif %}{% endfor %}"
        tokenizer.save_pretrained(path)
    elif name == "no_tool_template":  # a chat template that renders every role but the tool's
        shutil.copytree(t.policy, path)
        tokenizer = char_tokenizer("<pad>")
        tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool turns "
                                   "here') }}{% endif %}{{ m.content }}{% endfor %}")
        tokenizer.save_pretrained(path)
    elif name == "small_vocab":  # a vocabulary one id short of the tokenizer's ('=' is the last)
        LlamaForCausalLM(llama_config(PAD, vocab_size=llama_config().vocab_size - 1)).save_pretrained(path)
        char_tokenizer("<pad>").save_pretrained(path)
    else:
        path.write_text({"whitespace_prompt.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"prompt": " \\t ", "answer": "0"}\n',
                         "nan_answer.jsonl": '{"prompt": "1+1=", "answer": NaN}\n',
                         "list_answer.jsonl": '{"prompt": "1+1=", "answer": ["2"]}\n',
                         "exits_on_import.py": "import sys\nsys.exit(0)\ndef score(prompts, completions, **kw):\n    pass\n",
                         "interrupts_on_import.py": "raise KeyboardInterrupt\n",
                         "sets_rank.py": "import os\ndef score(prompts, completions, **kw):\n    os.environ['RANK'] = '1'\n"
                                         "    return [0.0] * len(completions)\n",
                         "closes_stdout.py": "import sys\ndef score(prompts, completions, answer, **kw):\n"
                                             "    sys.stdout.close()\n    return [float(c == a) for c, a in zip(completions, answer)]\n",
                         }[name])
    return path


@pytest.mark.parametrize("console", ["closed-pipe", "full-device", "closed-by-the-reward-function"])
def test_a_console_that_fails_drops_its_lines_and_training_goes_on(tiny, tmp_path, console):
    flags = script_flags(tiny, tmp_path / "out", "--num-iterations", 3, "--eval-every", 0, "--save-every", 3)
    if console == "closed-by-the-reward-function":
        flags += ["--reward-fn", f"{hostile(tiny, 'closes_stdout.py')}:score"]
    with open("/dev/full", "w") if console == "full-device" else contextlib.nullcontext(subprocess.PIPE) as stdout:
        process = subprocess.Popen([sys.executable, str(SCRIPT), *flags], cwd=REPO, env=SUBPROCESS_ENV, text=True,
                                   stdout=stdout, stderr=subprocess.PIPE)
        if console == "closed-pipe":  # as `| head -1` does
            process.stdout.readline()
            process.stdout.close()
        shown, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    assert sorted(read_metrics(tmp_path / "out")) == [1, 2, 3] and (tmp_path / "out" / "checkpoint-3").is_dir()
    if console == "closed-by-the-reward-function":
        assert "iter    3" in shown and stderr == ""
    else:
        assert stderr.count("warning: the console failed") == 1 and "Traceback" not in stderr, stderr


def test_a_full_disk_while_writing_metrics_jsonl_is_one_line_naming_it(tiny, tmp_path):
    def full_metrics(path, mode="r", *rest, **kwargs):  # metrics.jsonl on a full device, the rest as it is
        return open("/dev/full" if str(path).endswith("metrics.jsonl") and mode == "a" else path, mode, *rest, **kwargs)

    with mock.patch.object(ppo_llm, "open", full_metrics, create=True):
        line = single_error_line(run_main(tiny, tmp_path / "out"))
    assert f"cannot write {tmp_path / 'out' / 'metrics.jsonl'} (No space left on device)" in line, line


def test_a_csv_file_with_a_byte_order_mark_reads_as_one_without(tmp_path):
    pytest.importorskip("datasets")
    plain, marked = tmp_path / "plain.csv", tmp_path / "marked.csv"  # Excel's "CSV UTF-8" starts with the mark
    plain.write_text("prompt,answer\n1+1=,2\n2+2=,4\n")
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    rows = [ppo_llm.load_prompts(str(path), "--prompts-path").rows for path in (plain, marked)]
    assert rows[0] == rows[1] == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


# Checked after the models load: (model path, flags) -> what the error line must name.
POSTLOAD_ERRORS = {
    "config-with-fewer-layers-than-its-weights": (
        lambda t: (hostile(t, "fewer_layers"), []), ["fewer_layers", "uses no weights for model.layers.1."]),
    "chat-template-that-fails-to-render": (
        lambda t: (hostile(t, "broken_template"), ["--chat-template"]),
        ["--chat-template: the chat template of", "fails to render", "only renders system turns"]),
    "token-ids-past-the-vocabulary": (lambda t: (hostile(t, "small_vocab"), []), ["gives the id 13", "13-token vocabulary"]),
    "prompt-and-response-past-the-context": (
        lambda t: (t.policy, ["--max-new-tokens", 60]), ["plus --max-new-tokens 60", "max_position_embeddings 64"]),
    "character-the-tokenizer-cannot-encode": (
        lambda t: (DEMO_MODEL, ["--prompts-path", t.letter_prompts]), ["--prompts-path", "line 2", "'x' (U+0078)"]
    ),
    "directory-without-a-tokenizer": (lambda t: (t.no_tokenizer, []), ["--model-name-or-path", "cannot load"]),
    "empty-prompt": (lambda t: (t.policy, ["--prompts-path", t.empty_prompt]), ["--prompts-path", "line 2", "empty"]),
    "chat-template-that-cannot-render-a-tool-message": (
        lambda t: (hostile(t, "no_tool_template"), ["--chat-template", "--tools", "calculator", "--max-tool-calls", 1]),
        ["--tools: the chat template of", "cannot render a tool message", "no tool turns here"]),
    "chat-template-that-leaves-tool-messages-out": (
        lambda t: (hostile(t, "drops_tools_template"), ["--chat-template", "--tools", "calculator", "--max-tool-calls", 1]),
        ["cannot render a tool message (ValueError: it leaves tool messages out)"]),
    "reward-function-that-sets-rank": (lambda t: (t.policy, ["--reward-fn", f"{hostile(t, 'sets_rank.py')}:score"]),
                                       ["sets_rank.py:score' changed RANK in os.environ"]),
    "reward-model-without-a-score-head": (
        lambda t: (t.policy, ["--reward-model-path", t.policy]), ["--reward-model-path", "score.weight"]
    ),
    "critic-init-from-a-reward-model-without-a-score-head": (
        lambda t: (t.policy, ["--reward-model-path", t.policy, "--critic-init", "reward"]), ["score.weight"]
    ),
    # peft itself refuses a list only when none of its names matches: a typo beside a real name would go unnoticed.
    "lora-target-that-matches-nothing-beside-one-that-does": (
        lambda t: (t.policy, ["--lora-r", 4, "--lora-target-modules", "q_proj", "qproj"]),
        ["--lora-target-modules: qproj matches no module"]
    ),
}


@pytest.mark.parametrize("case", list(POSTLOAD_ERRORS))
def test_bad_input_found_after_loading_is_one_error_line(tiny, tmp_path, case):
    model_and_flags, expected = POSTLOAD_ERRORS[case]
    model, flags = model_and_flags(tiny)
    with mock.patch.dict("os.environ"):  # a reward function's changes stay in this test
        line = single_error_line(run_main(tiny, tmp_path / "out", "--eval-every", 0, *flags, model=model))
    assert [part for part in expected if part not in line] == [], line


def test_bad_input_in_a_real_process_is_one_line_on_stderr_and_exit_code_1(tiny, tmp_path):
    # The tables run main() in this process; one row found after loading runs as a user would, so that nothing else
    # (a library's warning, a traceback) reaches stderr.
    result = run_script(tiny, tmp_path / "out", "--reward-model-path", tiny.policy)
    assert result.returncode == 1
    assert "--reward-model-path" in single_error_line(result) and "score.weight" in result.stderr


def test_the_output_directory_is_unlocked_when_a_run_fails(tiny, tmp_path):
    import fcntl

    # A response past the model's context is refused once the models have loaded, with the lock held.
    args = Args(model_name_or_path=str(tiny.policy), prompts_path=str(tiny.train), output_dir=str(tmp_path),
                eval_every=0, num_iterations=1, num_prompts=2, micro_batch_size=2, max_new_tokens=60)
    with pytest.raises(ConfigError) as failure:  # keeps the traceback, and its frames, alive, as a notebook does
        ppo_llm.train(args)
    assert "max_position_embeddings" in str(failure.value) and (tmp_path / ".lock").exists()
    with open(tmp_path / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the failed run still held it


def test_chat_template_without_one_in_the_tokenizer_is_an_error(tiny, tmp_path):
    line = single_error_line(run_main(tiny, tmp_path / "out", "--chat-template"))
    assert "--chat-template" in line and "no chat template" in line


@pytest.mark.parametrize(
    "function, message",
    [
        ("raises", "raised ValueError: boom"),
        ("wrong_length", "returned 1 values for 4 completions"),
        ("nan", "returned a non-finite value (nan)"),
    ],
)
def test_bad_reward_function_output_stops_the_run_with_its_name(tiny, tmp_path, function, message):
    spec = f"{tiny.bad_rewards}:{function}"
    result = run_main(tiny, tmp_path / "out", "--reward-fn", spec, "--num-iterations", 1, "--eval-every", 0)
    line = single_error_line(result)
    assert f"reward function {spec!r}" in line and message in line


def test_non_finite_loss_stops_the_run_and_keeps_the_last_checkpoint(tiny, tmp_path):
    # A finite reward of 3e38 passes the reward check, but its squared error in the value loss overflows float32.
    output_dir = tmp_path / "out"
    result = run_main(tiny, output_dir, "--reward-fn", f"{tiny.bad_rewards}:blows_up_on_second_call",
                      "--eval-every", 0, "--save-every", 1)
    line = single_error_line(result)
    assert "non-finite loss" in line and f"the last checkpoint is {output_dir / 'checkpoint-1'}" in line
    assert list(read_metrics(output_dir)) == [1]
    assert sorted(p.name for p in output_dir.iterdir()) == [".lock", "checkpoint-1", "metrics.jsonl"]
    training_state = torch.load(output_dir / "checkpoint-1" / "training_state.pt", weights_only=False)
    assert training_state["iteration"] == 1
    AutoModelForCausalLM.from_pretrained(output_dir / "checkpoint-1" / "policy")


# ---------------------------------------------------------------------------------------------------------
# Model configurations the demo does not use: attention dropout, shipped sampling settings, chat end-of-turn
# ---------------------------------------------------------------------------------------------------------


def test_disable_dropout_zeroes_the_float_dropout_attributes_of_attention_modules():
    model = LlamaForCausalLM(llama_config(attention_dropout=0.1))
    assert {m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")} == {0.1}
    disable_dropout(model)
    assert {m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")} == {0.0}


def test_learning_rate_zero_with_attention_dropout_in_the_config_gives_ratio_one_and_no_kl(tiny, tmp_path):
    # The update runs in train mode, where Llama attention applies config.attention_dropout unless it is zeroed.
    model_dir = tmp_path / "dropout_model"
    LlamaForCausalLM.from_pretrained(tiny.policy, attention_dropout=0.1).save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    args = Args(model_name_or_path=str(model_dir), prompts_path=str(tiny.train), output_dir=str(tmp_path / "out"),
                eval_every=0, sample_every=0, save_every=0, num_iterations=1, num_prompts=4, micro_batch_size=4,
                max_new_tokens=4, learning_rate=0.0, critic_learning_rate=0.0, num_minibatches=1, num_epochs=1)
    ppo_llm.train(args)
    metrics = read_metrics(tmp_path / "out")[1]
    # pi_old is the sampler's log-probs, the update's up to float rounding; with the dropout left on, approx KL is 1e-4
    assert metrics["policy/approx_kl"] < 1e-9 and abs(metrics["policy/ratio"] - 1.0) < 1e-6 and metrics["policy/clipfrac"] == 0.0


def test_the_saved_policy_keeps_the_models_own_generation_config_and_the_run_prints_its_stop_tokens(tiny, tmp_path):
    model_dir = tmp_path / "sampling_model"
    shutil.copytree(tiny.policy, model_dir)
    shipped = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.3, eos_token_id=EOS)
    shipped.save_pretrained(model_dir)
    output_dir = tmp_path / "out"
    result = succeeded(run_main(tiny, output_dir, "--num-iterations", 1, "--save-every", 1, model=model_dir))
    assert "stop tokens: <eos>\n" in result.stdout  # printed at start-up
    for saved in (output_dir / "policy", output_dir / "checkpoint-1" / "policy"):
        config = GenerationConfig.from_pretrained(saved)
        assert (config.temperature, config.top_p, config.top_k, config.repetition_penalty) == (0.7, 0.8, 20, 1.3)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_with_chat_template_the_token_that_closes_the_assistant_turn_also_stops_responses():
    # A base model whose EOS is <eos> but whose template ends turns with <|im_end|> (like Qwen2.5 base).
    tokenizer = char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = SimpleNamespace(generation_config=GenerationConfig(eos_token_id=EOS))
    assert eos_token_ids(tokenizer, model, chat_template=True) == sorted({EOS, im_end})
    assert eos_token_ids(tokenizer, model, chat_template=False) == [EOS]


def test_ptx_loss_is_logged_when_ptx_coef_is_positive(tiny, tmp_path):
    ptx = tmp_path / "ptx.txt"
    ptx.write_text("1+1=2\n12+30=42\n")
    output_dir = tmp_path / "out"
    succeeded(run_main(tiny, output_dir, "--num-iterations", 1, "--eval-every", 0, "--ptx-coef", 0.5, "--ptx-path", ptx))
    # A next-token cross-entropy of an untrained 14-token model: positive and near log(14).
    assert 0.5 * math.log(14) < read_metrics(output_dir)[1]["losses/ptx_loss"] < 2 * math.log(14)


# ---------------------------------------------------------------------------------------------------------
# The output directory, resume checks and interrupts
# ---------------------------------------------------------------------------------------------------------


def test_a_second_run_into_a_directory_another_run_holds_is_refused(tiny, tmp_path):
    import fcntl

    output_dir = tmp_path / "out"
    output_dir.mkdir()
    with open(output_dir / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a running run holds
        line = single_error_line(run_main(tiny, output_dir, "--num-iterations", 1))
    assert "--output-dir" in line and "another run is writing to it" in line
    assert sorted(p.name for p in output_dir.iterdir()) == [".lock"]


def test_save_total_limit_keeps_only_the_newest_checkpoints(tiny, tmp_path):
    output_dir = tmp_path / "out"
    succeeded(run_main(tiny, output_dir, "--num-iterations", 3, "--save-every", 1, "--save-total-limit", 2, "--eval-every", 0))
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]


def checkpoint_of_grpo(tiny, trained):
    path = tiny.root / "grpo_checkpoint"
    if not path.exists():
        shutil.copytree(trained / "checkpoint-1", path)
        state = torch.load(path / "training_state.pt", weights_only=False)
        state["script"] = "grpo"
        torch.save(state, path / "training_state.pt")
    return path


def changed_checkpoint(tiny, trained, name, change):
    """A copy of the trained run's checkpoint-1 under tiny.root/name, changed once by change(path)."""
    path = tiny.root / name
    if not path.exists():
        shutil.copytree(trained / "checkpoint-1", path)
        change(path)
    return path


def saved_tensor(path):
    torch.save(torch.zeros(3), path / "training_state.pt")


def cut_policy_weights(path):
    data = (path / "policy" / "model.safetensors").read_bytes()
    (path / "policy" / "model.safetensors").write_bytes(data[: len(data) // 2])


def smaller_policy(path):  # a model of one layer in the checkpoint's place, config and weights agreeing
    config = llama_config(PAD)
    config.num_hidden_layers = 1
    LlamaForCausalLM(config).save_pretrained(path / "policy")


def truncated_checkpoint(tiny, trained):
    path = tiny.root / "truncated_checkpoint"
    if not path.exists():
        shutil.copytree(trained / "checkpoint-1", path)
        data = (path / "training_state.pt").read_bytes()
        (path / "training_state.pt").write_bytes(data[: len(data) // 2])
    return path


REMOVED = object()


def changed_state(**changes):
    """A change(path) for changed_checkpoint: training_state.pt with these keys set, to value(state) where the value
    is callable, or removed where it is REMOVED."""
    def change(path):
        state = torch.load(path / "training_state.pt", weights_only=True)
        for key, value in changes.items():
            if value is REMOVED:
                del state[key]
            else:
                state[key] = value(state) if callable(value) else value
        torch.save(state, path / "training_state.pt")
    return change


class OpensAFile:
    """Unpickled, it calls open(path, "w"): what a doctored checkpoint's __reduce__ can do with any function."""
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


RESUME_ERRORS = {
    "changed-learning-rate": (lambda t, r: [r / "checkpoint-1", "--learning-rate", 1e-3],
                              ["--learning-rate None in the checkpoint, 0.001 now"]),
    "changed-two-flags": (lambda t, r: [r / "checkpoint-1", "--clip-eps", 0.1, "--kl-coef", 0.2],
                          ["--kl-coef 0.05 in the checkpoint, 0.2 now", "--clip-eps 0.2 in the checkpoint, 0.1 now"]),
    "shared-critic-not-in-the-checkpoint": (lambda t, r: [r / "checkpoint-1", "--shared-critic"],
                                            ["--shared-critic False in the checkpoint, True now"]),
    "num-iterations-below-the-checkpoint": (lambda t, r: [r / "checkpoint-2", "--num-iterations", 1],
                                            ["--num-iterations 1", "iteration 2"]),
    "checkpoint-of-grpo": (lambda t, r: [checkpoint_of_grpo(t, r)], ["--resume-from", "grpo_llm.py"]),
    "truncated-training-state": (lambda t, r: [truncated_checkpoint(t, r)], ["--resume-from", "truncated or corrupt"]),
    "training-state-of-something-else": (lambda t, r: [changed_checkpoint(t, r, "tensor_state", saved_tensor)],
                                         ["--resume-from", "not a training state"]),
    "damaged-policy-weights": (lambda t, r: [changed_checkpoint(t, r, "damaged_policy", cut_policy_weights)],
                               ["--resume-from", "damaged_policy/policy", "cannot load"]),
    "args-a-list": (lambda t, r: [changed_checkpoint(t, r, "args_list", changed_state(args=[]))],
                    ["--resume-from", "args_list", "'args' is a list, not dict"]),
    "iteration-a-string": (lambda t, r: [changed_checkpoint(t, r, "iteration_str", changed_state(iteration="1"))],
                           ["--resume-from", "iteration_str", "'iteration' is a str, not int"]),
    "no-optimizer-state": (lambda t, r: [changed_checkpoint(t, r, "no_optimizer", changed_state(optimizers=REMOVED))],
                           ["--resume-from", "no_optimizer", "'optimizers' is missing"]),
    "no-random-states": (lambda t, r: [changed_checkpoint(t, r, "no_rng", changed_state(rng=[]))],
                         ["--resume-from", "no_rng", "'rng' holds 0 random states, not one per rank of its 1"]),
    "written-by-two-ranks": (
        lambda t, r: [changed_checkpoint(t, r, "two_ranks", changed_state(world_size=2, rng=lambda s: s["rng"] * 2))],
        ["--resume-from", "two_ranks", "written by 2 rank(s), resumed with 1", "--nproc_per_node 2"]),
    "ent-coef-a-string": (lambda t, r: [changed_checkpoint(t, r, "ent_coef_str", changed_state(ent_coef="0.01"))],
                          ["--resume-from", "ent_coef_str", "'ent_coef' is a str, not int or float"]),
    "policy-replaced-by-a-smaller-model": (lambda t, r: [changed_checkpoint(t, r, "smaller_policy", smaller_policy)],
                                           ["the policy of", "smaller_policy", "does not fit the optimizer state",
                                            "model.layers.1."]),
}


@pytest.mark.parametrize("case", list(RESUME_ERRORS))
def test_resume_refuses_a_checkpoint_that_does_not_match_its_flags_or_script(tiny, trained, tmp_path, case):
    flags, expected = RESUME_ERRORS[case]
    resume_from, *rest = flags(tiny, trained)
    line = single_error_line(run_main(tiny, tmp_path / "out", "--resume-from", resume_from, *rest))
    assert [part for part in expected if part not in line] == [], line


def test_a_doctored_training_state_is_refused_and_runs_nothing(tiny, trained, tmp_path):
    marker = tiny.root / "created_by_the_checkpoint"
    path = changed_checkpoint(tiny, trained, "doctored", changed_state(args=OpensAFile(str(marker))))
    line = single_error_line(run_main(tiny, tmp_path / "out", "--resume-from", path))
    assert "doctored" in line and "could run code" in line, line
    assert not marker.exists()
    torch.load(path / "training_state.pt", weights_only=False)  # the control: unpickled in full, it runs open()
    assert marker.exists()
    marker.unlink()


def test_resume_drops_a_metrics_line_cut_by_a_crash_with_a_warning(tiny, trained):
    output_dir = tiny.root / "cut_line"
    shutil.copytree(trained, output_dir)
    with open(output_dir / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 3, "objective/sco')
    result = succeeded(run_main(tiny, output_dir, "--resume-from", output_dir / "checkpoint-1"))
    assert "line 4 is not valid JSON" in result.stdout
    assert list(read_metrics(output_dir)) == [0, 1, 2]


def test_resume_refuses_a_metrics_line_that_is_not_a_row_and_changes_nothing(tiny, trained, tmp_path):
    output_dir = tmp_path / "bad_rows"
    shutil.copytree(trained, output_dir)
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    (output_dir / "metrics.jsonl").write_text("\n".join([lines[0], "null", *lines[1:]]) + "\n")
    before = (output_dir / "metrics.jsonl").read_bytes()
    line = single_error_line(run_main(tiny, output_dir, "--resume-from", output_dir / "checkpoint-1"))
    assert "metrics.jsonl, line 2 is not a metrics row (null)" in line
    assert (output_dir / "metrics.jsonl").read_bytes() == before


def test_adaptive_entropy_control_steps_the_coefficient_toward_the_target_entropy_within_its_bounds():
    # Skywork-OR1: c_next = clip(c + delta if H < target else c - delta, [c_min, c_max]), a loop of it by hand
    entropies = [0.1, 0.2, 0.9, 0.3, 0.05, 0.05, 0.05, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6]
    coef, expected = 0.02, []
    for h in entropies:
        coef = coef + 0.01 if h < 0.5 else coef - 0.01
        coef = min(0.045, max(0.0, coef))
        expected.append(coef)
    coef, ours = 0.02, []
    for h in entropies:
        coef = ppo_llm.entropy_coefficient(coef, h, target=0.5, delta=0.01, low=0.0, high=0.045)
        ours.append(coef)
    assert ours == pytest.approx(expected, abs=1e-15)
    assert 0.045 in ours and 0.0 in ours  # both bounds reached


def test_reference_sync_mixes_every_parameter_as_tr_dpo_says():
    # pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref, per parameter; alpha = 1 copies the policy bit for bit
    torch.manual_seed(0)
    policy, reference = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    before = [p.detach().clone() for p in reference.parameters()]
    ppo_llm.sync_reference(reference, policy, 0.3)
    for mixed, old, own in zip(reference.parameters(), before, policy.parameters()):
        for j in range(mixed.numel()):
            assert mixed.flatten()[j].item() == pytest.approx(0.3 * own.flatten()[j].item() + 0.7 * old.flatten()[j].item(),
                                                              abs=1e-6)
    ppo_llm.sync_reference(reference, policy, 1.0)
    assert all(torch.equal(mixed, own) for mixed, own in zip(reference.parameters(), policy.parameters()))


def test_a_reference_synced_to_the_policy_has_no_kl_at_the_next_rollout(tiny, tmp_path):
    # --ref-sync-every 1 --ref-sync-alpha 1: after each update pi_ref = pi_theta (lerp's weight 1 returns the policy's
    # value), so iteration 2's KL, measured on its rollout before its first step, is 0; without the sync it is not.
    synced, plain = tmp_path / "synced", tmp_path / "plain"
    succeeded(run_main(tiny, synced, "--ref-sync-every", 1, "--ref-sync-alpha", 1, "--eval-every", 0))
    succeeded(run_main(tiny, plain, "--eval-every", 0))
    assert abs(read_metrics(synced)[2]["objective/kl"]) < 1e-6
    assert abs(read_metrics(plain)[2]["objective/kl"]) > 1e-4


def test_adaptive_entropy_and_reference_sync_resume_exactly(tiny, tmp_path):
    # The coefficient in use and the mixed reference are in the checkpoint: a resumed run goes on as the whole one.
    flags = ("--entropy-target", 5.0, "--ent-coef", 0.01, "--ent-coef-delta", 0.01, "--ref-sync-every", 1,
             "--ref-sync-alpha", 0.5, "--num-iterations", 3, "--save-every", 1, "--eval-every", 0)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    succeeded(run_main(tiny, full, *flags))
    succeeded(run_main(tiny, resumed, *flags, "--resume-from", full / "checkpoint-1"))
    metrics = read_metrics(full)
    assert [metrics[i]["train/ent_coef"] for i in (1, 2, 3)] == pytest.approx([0.01, 0.02, 0.03])  # H < 5: it rises
    assert (full / "checkpoint-1" / "reference" / "model.safetensors").is_file()
    assert [non_timing(read_metrics(resumed)[i]) for i in (2, 3)] == [non_timing(metrics[i]) for i in (2, 3)]
    expected, after = load_file(full / "policy" / "model.safetensors"), load_file(resumed / "policy" / "model.safetensors")
    assert all(torch.equal(after[name], expected[name]) for name in expected)

INTERRUPTING_REWARD = """
import os, signal
calls = 0
def exact_match_or_signal(prompts, completions, answer, **_):
    # Sends itself the signals in $SIGNALS (e.g. "TERM" or "INT INT") on the first call: inside iteration 1.
    global calls
    calls += 1
    if calls == 1:
        for name in os.environ.get("SIGNALS", "").split():
            os.kill(os.getpid(), getattr(signal, "SIG" + name))
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
"""


def interrupting_flags(tiny):
    (tiny.root / "interrupting.py").write_text(INTERRUPTING_REWARD)
    return ["--eval-every", 0, "--reward-fn", f"{tiny.root / 'interrupting.py'}:exact_match_or_signal"]


def run_with_signals(tiny, output_dir, signals):
    command = [sys.executable, str(SCRIPT), *script_flags(tiny, output_dir, *interrupting_flags(tiny))]
    env = dict(SUBPROCESS_ENV, SIGNALS=signals)
    # As from a terminal: a shell's background job (as CI may be) would otherwise pass SIGINT on as ignored.
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_sigterm_checkpoints_the_iteration_and_resuming_equals_the_uninterrupted_run(tiny, tmp_path):
    interrupted = run_with_signals(tiny, tmp_path / "interrupted", "TERM")
    checkpoint = tmp_path / "interrupted" / "checkpoint-1"
    assert interrupted.returncode == 128 + 15, interrupted.stderr
    assert interrupted.stderr.strip().splitlines()[-1] == f"interrupted at iteration 1; resume with --resume-from {checkpoint}"
    last_line = interrupted.stdout.strip().splitlines()[-1]
    assert last_line.startswith("stopped: iteration 1 in") and last_line.endswith(f"; last checkpoint {checkpoint}")
    assert "Traceback" not in interrupted.stderr
    # The rest in this process (same code path, faster): resume, and the same run without a signal.
    succeeded(run_main(tiny, tmp_path / "interrupted", *interrupting_flags(tiny), "--resume-from", checkpoint))
    succeeded(run_main(tiny, tmp_path / "uninterrupted", *interrupting_flags(tiny)))
    resumed, uninterrupted = read_metrics(tmp_path / "interrupted"), read_metrics(tmp_path / "uninterrupted")
    assert list(resumed) == list(uninterrupted) == [1, 2]
    assert [non_timing(resumed[i]) for i in (1, 2)] == [non_timing(uninterrupted[i]) for i in (1, 2)]


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(tiny, tmp_path):
    result = run_with_signals(tiny, tmp_path / "out", "INT INT")
    assert result.returncode == 128 + 2
    assert "Traceback" not in result.stderr and "second Ctrl-C" in result.stderr
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_a_run_without_eval_ends_by_saying_where_the_final_policy_is(tiny, tmp_path):
    result = succeeded(run_main(tiny, tmp_path / "out", "--num-iterations", 1, "--eval-every", 0))
    assert result.stdout.strip().splitlines()[-1].endswith(f"final policy in {tmp_path / 'out' / 'policy'}")


def test_every_numeric_knob_has_a_declared_range():
    def is_numeric(t):  # int, float, Optional[int], Optional[float]
        return t in (int, float) or (typing.get_origin(t) is typing.Union and set(typing.get_args(t)) - {type(None)} <= {int, float})

    types = typing.get_type_hints(Args, include_extras=True)  # the script's annotations are strings until resolved
    numeric = {f.name for f in dataclasses.fields(Args) if is_numeric(types[f.name])}  # derived sizes are Annotated
    assert numeric - set(ppo_llm.RANGES) == set()
    assert set(ppo_llm.RANGES) - numeric == set()


def test_save_total_limit_never_removes_the_checkpoint_just_written(tiny, trained):
    # Resuming in place from checkpoint-1 beside a checkpoint-3 left by an earlier continuation: the fresh checkpoint-2
    # is the one to keep, whatever the numbers of the others.
    output_dir = tiny.root / "limit_after_resume"
    shutil.copytree(trained, output_dir)
    shutil.copytree(output_dir / "checkpoint-2", output_dir / "checkpoint-3")
    succeeded(run_main(tiny, output_dir, "--resume-from", output_dir / "checkpoint-1", "--save-every", 1,
                       "--save-total-limit", 1))
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-2"]


def test_resuming_in_place_from_an_older_checkpoint_deletes_the_later_ones_of_the_run_it_replaces(tiny, trained):
    # checkpoint-3 and -4 belong to the continuation this resume abandons: kept, --save-total-limit 2 would keep them
    # over this run's checkpoint-1 and the last line would name checkpoint-4.
    output_dir = tiny.root / "resume_older"
    shutil.copytree(trained, output_dir)
    for n in (3, 4):
        shutil.copytree(output_dir / "checkpoint-2", output_dir / f"checkpoint-{n}")
    result = succeeded(run_main(tiny, output_dir, "--resume-from", output_dir / "checkpoint-1", "--save-every", 1,
                                "--save-total-limit", 2))
    assert "deleted checkpoint-2, checkpoint-3, checkpoint-4, written after the checkpoint resumed" in result.stdout
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert f"last checkpoint {output_dir / 'checkpoint-2'};" in result.stdout.splitlines()[-1]


def test_sigterm_in_the_last_iteration_lets_the_run_finish_with_its_final_policy(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SIGNALS", "TERM")  # sent to this process, where main() runs and handles it
    result = run_main(tiny, tmp_path / "out", *interrupting_flags(tiny), "--num-iterations", 1)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "policy" / "model.safetensors").is_file()


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_a_minibatch_step_gets_the_gradients_of_its_whole_loss_in_one_backward_pass(tiny, monkeypatch, aggregation):
    # minibatch_step runs one micro-batch of 2 rows at a time; the gradients must be those of the 4-row minibatch's
    # summed losses, written out here from the models' own outputs.
    args = tyro.cli(Args, args=["--micro-batch-size", "2", "--ent-coef", "0.05", "--vf-coef", "0.7", "--clip-eps", "0.2",
                                "--value-clip-eps", "0.2", "--temperature", "1.0", "--loss-aggregation", aggregation])
    torch.manual_seed(0)
    policy = LlamaForCausalLM.from_pretrained(tiny.policy)
    critic = LlamaForSequenceClassification.from_pretrained(tiny.policy, num_labels=1)
    models = SimpleNamespace(policy=policy, critic=critic, value_head=None, autocast=contextlib.nullcontext,
                             critic_parameters=lambda: list(critic.parameters()))
    g = torch.Generator().manual_seed(5)
    mask = torch.arange(5).unsqueeze(0) < torch.tensor([[5], [2], [3], [1]])
    responses = torch.randint(2, 12, (4, 5), generator=g).masked_fill(~mask, PAD)
    query_responses = torch.cat([torch.tensor([[3, 12, 4, 13]]).repeat(4, 1), responses], 1)
    attention_mask = torch.cat([torch.ones(4, 4, dtype=torch.long), mask.long()], 1)
    batch = dict(query_responses=query_responses, attention_mask=attention_mask, responses=responses,
                 response_mask=mask, context_length=4, advantages=torch.randn(4, 5, generator=g),
                 logprobs=-torch.rand(4, 5, generator=g) * 3, values=torch.randn(4, 5, generator=g),
                 returns=torch.randn(4, 5, generator=g))
    grads = {}

    def keep_gradients(models, optimizers, args, train_policy, minibatch_kl):
        for name, model in (("policy", policy), ("critic", critic)):
            grads[name] = [p.grad.clone() for p in model.parameters()]
        return {}

    monkeypatch.setattr(ppo_llm, "optimizer_step", keep_gradients)
    ppo_llm.minibatch_step(models, {}, batch, torch.arange(4), args, True, {})

    policy.zero_grad(set_to_none=True)
    critic.zero_grad(set_to_none=True)
    logp = torch.log_softmax(policy(query_responses, attention_mask=attention_mask).logits[:, 3:-1], -1)
    logprobs = logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    values = critic.score(critic.model(query_responses, attention_mask=attention_mask).last_hidden_state)[:, 3:-1, 0]
    ratio = (logprobs - batch["logprobs"]).exp()
    pg = torch.maximum(-batch["advantages"] * ratio, -batch["advantages"] * ratio.clamp(1 - 0.2, 1 + 0.2))
    clipped_values = batch["values"] + (values - batch["values"]).clamp(-0.2, 0.2)
    vf = 0.5 * torch.maximum((values - batch["returns"]) ** 2, (clipped_values - batch["returns"]) ** 2)
    if aggregation == "token-mean":
        mean = lambda x: x[mask].mean()
    else:
        mean = lambda x: torch.stack([row[row_mask].mean() for row, row_mask in zip(x, mask)]).mean()
    (mean(pg) - 0.05 * mean(entropy) + 0.7 * mean(vf)).backward()
    for name, model in (("policy", policy), ("critic", critic)):
        for (param_name, param), got in zip(model.named_parameters(), grads[name]):
            assert param.grad.abs().max() > 0, param_name
            torch.testing.assert_close(got, param.grad, rtol=1e-4, atol=1e-7, msg=f"{name} {param_name}")


# ---------------------------------------------------------------------------------------------------------
# torchrun: N ranks compute what one process computes on the same global batch, and no rank ever waits forever.
# Each launch starts 2 gloo ranks on this CPU; the worker is this file run as a script (the end of the file).
# ---------------------------------------------------------------------------------------------------------


def torchrun(*command, timeout=300):
    """`torchrun --nproc_per_node 2 ...`; a rank that blocks in a collective shows up as the timeout."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return subprocess.run([*launcher, *map(str, command)], cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True,
                          timeout=timeout)


UPDATE_FLAGS = ["--num-prompts", "2", "--num-generations", "4", "--max-new-tokens", "5", "--whiten-rewards",
                "--advantage-whitening", "batch", "--num-epochs", "2", "--micro-batch-size", "2", "--learning-rate", "1e-3",
                "--critic-learning-rate", "1e-3", "--kl-coef", "0.05"]


def update_on_this_rank(policy_dir, fsdp):
    """forward_rollout, shape_rewards, compute_advantages and ppo_update on a fixed global batch of 8 responses, of
    which this rank holds its part: running reward moments and advantage whitening over the whole batch, global loss
    normalisers and statistics, sharded policy, reference and critic forward passes, gradients reduced over ranks.
    Returns (full policy weights, full critic weights, update statistics, reward moments), weights on rank 0."""
    args = tyro.cli(Args, args=UPDATE_FLAGS + (["--fsdp"] if fsdp else []))
    world, rank = ppo_llm.world_size(), ppo_llm.rank()
    args.batch_size, args.minibatch_size = 8, 8 // world
    torch.manual_seed(0)  # the critic's fresh score head: the same on every rank and in one process
    policy, reference = (ppo_llm.shard(LlamaForCausalLM.from_pretrained(policy_dir), args) for _ in range(2))
    critic = ppo_llm.shard(LlamaForSequenceClassification.from_pretrained(policy_dir, num_labels=1), args)
    reference.requires_grad_(False)
    models = SimpleNamespace(policy=policy, ref_policy=reference, reference=lambda: contextlib.nullcontext(reference),
                             critic=critic, value_head=None, train=lambda: (policy.train(), critic.train()),
                             eval=lambda: (policy.eval(), critic.eval()),
                             autocast=contextlib.nullcontext, critic_parameters=lambda: list(critic.parameters()))
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)  # before any forward, as train() does
                  for name, model in (("policy", policy), ("critic", critic))}
    g = torch.Generator().manual_seed(3)
    mask = torch.arange(5).unsqueeze(0) < torch.randint(1, 6, (8, 1), generator=g)
    responses = torch.randint(2, 12, (8, 5), generator=g).masked_fill(~mask, PAD)
    batch = dict(query_responses=torch.cat([torch.tensor([[3, 12, 4, 13]]).repeat(8, 1), responses], 1),
                 attention_mask=torch.cat([torch.ones(8, 4, dtype=torch.long), mask.long()], 1), responses=responses,
                 response_mask=mask, has_eos=mask[:, -1].logical_not(), raw_scores=torch.rand(8, generator=g))
    part = slice(rank * 8 // world, (rank + 1) * 8 // world)
    batch = {key: value[part] for key, value in batch.items()}
    batch["context_length"] = 4
    state = dict(reward_mean=0.0, reward_var=1.0, reward_count=0)
    with torch.no_grad():
        batch.update(ppo_llm.forward_rollout(models, batch, args))
    ppo_llm.shape_rewards(batch, args, args.kl_coef, state)
    compute_advantages(batch, args)
    stats = ppo_llm.ppo_update(models, optimizers, batch, args, True, torch.Generator().manual_seed(0), {})
    full = [ppo_llm.full_state_dict(model) or model.state_dict() for model in (policy, critic)]
    return full[0], full[1], stats, (state["reward_mean"], state["reward_var"])


def distributed_worker(policy_dir, out_dir):
    ppo_llm.init_distributed()
    for fsdp in (False, True):
        policy, critic, stats, moments = update_on_this_rank(policy_dir, fsdp)
        if ppo_llm.rank() == 0:
            torch.save(dict(policy=policy, critic=critic, stats=stats, moments=moments), Path(out_dir) / f"fsdp={fsdp}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tiny):
    out = tiny.root / "two-ranks"
    out.mkdir()
    succeeded(torchrun(Path(__file__).resolve(), "update", tiny.policy, out))
    return out


@pytest.mark.parametrize("fsdp", [False, True])
def test_two_ranks_update_policy_and_critic_as_one_process_does_on_the_same_global_batch(tiny, two_ranks, fsdp):
    policy, critic, stats, moments = update_on_this_rank(tiny.policy, fsdp=False)  # this process: one rank
    result = torch.load(two_ranks / f"fsdp={fsdp}.pt", weights_only=False)
    before = load_file(tiny.policy / "model.safetensors")
    assert max((policy[k] - before[k]).abs().max().item() for k in before) > 1e-4  # the update moved the weights
    for name, expected in [*(("policy." + k, v) for k, v in policy.items()), *(("critic." + k, v) for k, v in critic.items())]:
        model, key = name.split(".", 1)
        torch.testing.assert_close(result[model][key], expected, atol=1e-6, rtol=0, msg=name)
    assert result["moments"] == pytest.approx(moments, rel=1e-9)
    assert result["stats"].keys() == stats.keys()
    for key, value in stats.items():
        assert result["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_two_ranks_that_stop_early_on_target_kl_train_checkpoint_and_resume_exactly(tiny, tmp_path):
    # A tiny --target-kl stops most updates after their first minibatch: both ranks must stop at the same one (the
    # KL is reduced over ranks before the decision), or one would wait forever in the next gradient reduction.
    # Iteration 1 warms the critic up, so checkpoint-1 holds a policy optimizer that never stepped: saving it must not
    # change the run (a run without checkpoints ends with the same weights).
    flags = ["--fsdp", "--num-generations", "2", "--num-minibatches", "2", "--num-epochs", "2", "--target-kl", "1e-5",
             "--critic-warmup-iterations", "1", "--num-iterations", "3", "--save-every", "1"]
    full, resumed, unsaved = tmp_path / "full", tmp_path / "resumed", tmp_path / "unsaved"
    succeeded(torchrun(SCRIPT, *script_flags(tiny, unsaved, *flags, "--save-every", "0")))
    result = succeeded(torchrun(SCRIPT, *script_flags(tiny, full, *flags)))
    assert result.stdout.count("iter    2 |") == 1  # rank 0 alone prints
    metrics = read_metrics(full)
    assert sorted(metrics) == [0, 1, 2, 3] and any(metrics[i]["policy/early_stopped"] == 1.0 for i in (2, 3))
    # the critic: a plain save_pretrained directory of the model's own class (not FSDP's wrapper class)
    critic = full / "checkpoint-2" / "critic"
    assert json.loads((critic / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    assert LlamaForSequenceClassification.from_pretrained(critic).score.weight.shape == (1, 32)
    succeeded(torchrun(SCRIPT, *script_flags(tiny, resumed, *flags, "--resume-from", full / "checkpoint-1")))
    assert [non_timing(read_metrics(resumed)[i]) for i in (2, 3)] == [non_timing(metrics[i]) for i in (2, 3)]
    expected = load_file(full / "policy" / "model.safetensors")
    for other in (resumed, unsaved):
        after = load_file(other / "policy" / "model.safetensors")
        assert all(torch.equal(after[name], expected[name]) for name in expected), other.name


def test_value_clipfrac_counts_only_values_the_clamp_moved_not_rounding_ties():
    # Inside the range V_old + (V - V_old) may differ from V in the last bit, which made the clipped loss "win" a tie.
    g = torch.Generator().manual_seed(0)
    old = torch.randn(20000, generator=g)
    # mostly inside +-0.2, a few outside; rounded from float64, so that old + (values - old) is not always values
    values = (old.double() + 0.1 * torch.randn(20000, generator=g, dtype=torch.float64)).float()
    returns = torch.randn(20000, generator=g)
    _, clipped = clipped_value_loss(values, old, returns, 0.2)
    outside = (values - old).abs() > 0.2
    rounding_ties = (old + (values - old) != values) & ~outside
    assert rounding_ties.any()  # the sample really holds such ties
    assert not clipped[~outside].any()
    expected = ((old + (values - old).clamp(-0.2, 0.2) - returns) ** 2 > (values - returns) ** 2) & outside
    assert torch.equal(clipped, expected)


RANK_ONE_FAILS = """
import os
def exact_match_but_not_on_rank_1(prompts, completions, answer, **_):
    if os.environ["RANK"] == "1":
        raise ValueError("the reward service is down for rank 1")
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
"""


def test_a_reward_function_failing_on_one_rank_ends_the_job_with_that_ranks_one_line(tiny, tmp_path):
    (tmp_path / "ranked.py").write_text(RANK_ONE_FAILS)
    spec = f"{tmp_path / 'ranked.py'}:exact_match_but_not_on_rank_1"
    result = torchrun(SCRIPT, *script_flags(tiny, tmp_path / "out", "--reward-fn", spec, "--eval-every", "0"))
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith(("[rank", "error:"))]
    assert ours == [f"[rank 1] error: reward function {spec!r} raised ValueError: the reward service is down for rank 1"]
    assert f'{SCRIPT.name}", line' not in result.stderr  # no traceback from the script on any rank


def test_num_prompts_must_split_over_the_torchrun_ranks():
    with mock.patch.dict("os.environ", {"WORLD_SIZE": "2"}):
        with pytest.raises(ConfigError, match="--num-prompts .* must split over the 2 torchrun ranks"):
            ppo_llm.check_args(tyro.cli(Args, args=["--num-prompts", "3", "--model-name-or-path", str(DEMO_MODEL)]))


def test_real_model_one_iteration_with_its_chat_template(real_model, tmp_path):
    """A real chat model with pad = EOS = <|im_end|> and a critic initialised from it: the script's greedy eval
    agrees with plain HF generation prompt by prompt; one PPO iteration trains both models at the learning rates
    chosen by size; the saved policy loads with the chat template."""
    rows = [json.loads(line) for line in (REPO / "demo/real/eval.jsonl").read_text().splitlines()[:6]]
    expected = greedy_last_numbers(real_model, [row["prompt"] for row in rows], 16)
    output_dir = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--model-name-or-path", str(real_model), "--chat-template",
               "--reward-fn", "last_number", "--prompts-path", str(REPO / "demo/real/train.jsonl"),
               "--eval-prompts-path", str(write_jsonl(tmp_path / "eval.jsonl", rows)), "--output-dir", str(output_dir),
               "--num-iterations", "1", "--num-prompts", "4", "--max-new-tokens", "16", "--num-epochs", "1",
               "--num-minibatches", "1", "--save-every", "0", "--eval-every", "1"]
    result = succeeded(subprocess.run(command, cwd=REPO, env=REAL_MODEL_ENV, capture_output=True, text=True, timeout=600))
    assert "stop tokens: <|im_end|>" in result.stdout
    assert "policy learning rate 1e-05, by the policy's size (134.5M parameters)" in result.stdout
    assert "critic learning rate 0.0001, by the policy's size (134.5M parameters)" in result.stdout
    metrics = read_metrics(output_dir)
    right = sum(number == float(row["answer"]) for (number, _), row in zip(expected, rows))
    assert metrics[0]["eval/reward"] == pytest.approx(right / len(rows), abs=1e-6)  # a float32 mean
    assert metrics[0]["eval/eos_rate"] == pytest.approx(sum(ended for _, ended in expected) / len(rows), abs=1e-6)
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    assert AutoTokenizer.from_pretrained(output_dir / "policy").chat_template == tokenizer.chat_template
    assert isinstance(AutoModelForCausalLM.from_pretrained(output_dir / "policy"), LlamaForCausalLM)


if __name__ == "__main__" and sys.argv[1] == "update":  # the worker of the torchrun tests: update POLICY_DIR OUT_DIR
    distributed_worker(*sys.argv[2:4])
    os._exit(0)  # as the scripts do under torchrun: the interpreter's teardown could abort the rank in gloo's threads


# ---------------------------------------------------------------------------------------------------------
# Tools: the multi-turn rollout, its masks, the calculator, parsing and running calls
# ---------------------------------------------------------------------------------------------------------
TOOLS_DEMO = REPO / "demo" / "tools"
PRINTABLE = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(string.printable)}}
TEST_TOOLS = '''
import time


def raises(x: int) -> int:
    """Fail on purpose.

    Args:
        x: any number
    """
    raise ValueError(f"no good: {x}")


def sleeps(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


def echo(text: str) -> str:
    """Repeat the text five times.

    Args:
        text: what to repeat
    """
    return text * 5


def undocumented(x):
    return x
'''


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@pytest.fixture(scope="module")
def toolbox(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(TEST_TOOLS)
    return ppo_llm.Toolbox(("calculator", *(f"{path}:{name}" for name in ("raises", "sleeps", "echo"))), 0.3)


def test_the_calculator_computes_arithmetic_by_walking_its_syntax_tree():
    for expression, expected in (("374*58", 374 * 58), ("(2+3)**2", 25), ("7/2", 3.5), ("-3+10//3", 0),
                                 (" 2**-2 ", 0.25), ("17 % 5", 2), ("1.5*4", 6.0)):
        assert ppo_llm.calculator(expression) == str(expected), expression


@pytest.mark.parametrize("expression", ["x+1", "(1).real", "abs(-1)", "__import__('os').system('touch pwned')",
                                        "'a'*3", "[1]*3", "1 if 1 else 2", "9**999", "(10**200)**2", "2**3**7",
                                        "10**300*10", "(9**100)**100 % 7", "1e308*10", "(-8)**0.5",
                                        pytest.param("9" * 5000, id="5000-digits")])
def test_the_calculator_refuses_names_attributes_calls_and_huge_powers(expression, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises((ValueError, SyntaxError)):  # Python refuses a literal past 4300 digits as it parses
        ppo_llm.calculator(expression)
    assert not (tmp_path / "pwned").exists()


# A turn's text -> (the results the model is given back, how many of them failed).
TOOL_CALLS = {
    "well-formed": (call("calculator", expression="21*4"), ["84"], 0),
    "several-in-one-turn": (call("calculator", expression="2+3") + " then " + call("echo", text="ab"),
                            ["5", "ababababab"], 0),
    "arguments-as-a-json-string": ('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"6*7\\"}"}'
                                   "</tool_call>", ["42"], 0),
    "malformed-json": ('<tool_call>{"name": calculator}</tool_call>',
                       ["error: the tool call is not valid JSON (Expecting value: line 1 column 10 (char 9))"], 1),
    "json-nested-past-the-recursion-limit": ("<tool_call>" + "[" * 100_000 + "</tool_call>",
                                             ["error: the tool call is not valid JSON (maximum recursion depth "
                                              "exceeded while decoding a JSON array from a unicode string)"], 1),
    "a-json-string": ('<tool_call>"calculator"</tool_call>',
                      ['error: a tool call is {"name": a tool\'s name, "arguments": {...}}'], 1),
    "not-closed": ('<tool_call>{"name": "calculator"', ["error: the tool call has no </tool_call>"], 1),
    "not-an-object": ("<tool_call>[1, 2]</tool_call>",
                      ['error: a tool call is {"name": a tool\'s name, "arguments": {...}}'], 1),
    "unknown-tool": (call("search", query="x"),
                     ["error: there is no tool 'search'; the tools are calculator, raises, sleeps, echo"], 1),
    "missing-argument": (call("calculator", expr="1+1"), ["error: calculator: missing a required argument: 'expression'"],
                         1),
    "extra-argument": (call("echo", text="a", times=2), ["error: echo: got an unexpected keyword argument 'times'"], 1),
    "tool-that-raises": (call("raises", x=3), ["error: raises raised ValueError: no good: 3"], 1),
    "tool-past-its-timeout": (call("sleeps", seconds=5), ["error: sleeps ran past --tool-timeout 0.3s"], 1),
    "calculator-refusing-a-name": (call("calculator", expression="x"),
                                   ["error: calculator raised ValueError: 'x' is not arithmetic: numbers and + - * / // "
                                    "% ** only"], 1),
    "no-call": ("just an answer: 42", [], 0),
}


@pytest.mark.parametrize("case", list(TOOL_CALLS))
def test_each_tool_call_gives_the_model_its_result_or_an_error_and_counts_the_failures(toolbox, case):
    text, expected, failures = TOOL_CALLS[case]
    results = [toolbox.run(c) for c in toolbox.calls_in(text, char_tokenizer(vocab=PRINTABLE))]
    assert [r.text for r in results] == expected and sum(r.failed for r in results) == failures


def test_a_tool_output_longer_than_its_cap_is_cut_to_max_tool_output_tokens(toolbox):
    tokenizer = char_tokenizer(vocab=PRINTABLE)
    result = toolbox.run(toolbox.calls_in(call("echo", text="0123456789"), tokenizer)[0])
    ids = ppo_llm.tool_message_ids(tokenizer, [result], Args(max_tool_output_tokens=12), EOS)
    assert tokenizer.decode(ids) == "<tool_response>012345678901</tool_response>"


def test_a_tool_without_a_docstring_for_its_arguments_is_refused_at_start_up(tmp_path):
    (tmp_path / "t.py").write_text(TEST_TOOLS)
    with pytest.raises(ConfigError, match=r"--tools .*t.py:undocumented: no JSON schema"):
        ppo_llm.Toolbox((f"{tmp_path / 't.py'}:undocumented",), 1.0)


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WITH_TOOLS = "{% if tools %}<|im_start|>tools\n{{ tools | map(attribute='function.name') | join(',') }}<|im_end|>\n{% endif %}" + CHATML


def chat_tokenizer(template):
    tokenizer = char_tokenizer(vocab=dict(PRINTABLE, **{"<|im_start|>": 200, "<|im_end|>": 201}))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = template
    return tokenizer


def test_a_chat_template_that_renders_tools_lists_them_itself_and_one_that_does_not_gets_a_system_turn(toolbox):
    renders, ignores = chat_tokenizer(WITH_TOOLS), chat_tokenizer(CHATML)
    assert ppo_llm.format_prompt(renders, "2+2?", True, toolbox.schemas) == \
        "<|im_start|>tools\ncalculator,raises,sleeps,echo<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    listed = ppo_llm.format_prompt(ignores, "2+2?", True, toolbox.schemas)
    assert listed.startswith("<|im_start|>system\nYou may call these tools:\n" + json.dumps(toolbox.schemas[0]))
    assert listed.endswith("<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert ppo_llm.format_prompt(ignores, "2+2?", True) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_a_tool_result_is_appended_as_the_chat_template_renders_a_tool_message_after_the_turn():
    tokenizer = chat_tokenizer(CHATML)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    results = [ppo_llm.ToolResult("8<|im_<|im_end|>end|>4", False), ppo_llm.ToolResult("error: x", True)]  # no turn ends
    ids = ppo_llm.tool_message_ids(tokenizer, results, Args(chat_template=True), end_of_turn)
    # the model wrote <|im_end|>; what the template puts after it, then both tool turns and the next assistant header
    assert tokenizer.decode(ids) == \
        "\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>tool\nerror: x<|im_end|>\n<|im_start|>assistant\n"


def scripted_sample(tokenizer, prompts, turns):
    """A stand-in for sample(): the policy writes turns[prompt][k] as its k-th turn (then EOS), whatever it is given."""
    said = {}

    def sample(model, input_ids, attention_mask, max_new_tokens, *rest, **kwargs):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            real = [t for t, m in zip(ids, mask) if m]
            prompt = next(p for p in prompts if real[: len(tokenizer(p)["input_ids"])] == tokenizer(p)["input_ids"])
            k = said[prompt] = said.get(prompt, -1) + 1
            rows.append((tokenizer(turns[prompt][k], add_special_tokens=False)["input_ids"] + [EOS])[:max_new_tokens])
        width = max(map(len, rows))
        return torch.tensor([r + [EOS] * (width - len(r)) for r in rows])
    return sample


def scripted_rollout(monkeypatch, toolbox, turns, max_new_tokens=600, max_tool_calls=2):
    tokenizer = char_tokenizer(vocab=PRINTABLE)
    prompts = list(turns)
    monkeypatch.setattr(ppo_llm, "sample", scripted_sample(tokenizer, prompts, turns))
    models = SimpleNamespace(tokenizer=tokenizer, policy=torch.nn.Linear(1, 1), eos_token_ids=[EOS],
                             device=torch.device("cpu"), tools=toolbox)
    args = Args(max_new_tokens=max_new_tokens, max_tool_calls=max_tool_calls, tools=("calculator",))
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    return ppo_llm.generate(models, prompt_ids, args, greedy=False), tokenizer


TURNS = {"2*3=": [call("calculator", expression="2*3"), "6"],
         "9-1=": ["8"],
         "5*5=": [call("calculator", expression="5*5"), call("nope"), "wrong, try " + call("calculator", expression="x")]}


def test_the_rollout_appends_each_tool_result_and_masks_it_out_of_the_trained_tokens(monkeypatch, toolbox):
    batch, tokenizer = scripted_rollout(monkeypatch, toolbox, TURNS)
    expected = {  # (the response, with the tool output in brackets), calls, failures
        0: ([call("calculator", expression="2*3"), "<eos>", "[<tool_response>6</tool_response>]", "6", "<eos>"], 1, 0),
        1: (["8", "<eos>"], 0, 0),
        2: ([call("calculator", expression="5*5"), "<eos>", "[<tool_response>25</tool_response>]", call("nope"),
             "<eos>", "[<tool_response>error: there is no tool 'nope'; the tools are calculator, raises, sleeps, echo"
             "</tool_response>]", "wrong, try " + call("calculator", expression="x"), "<eos>"], 2, 1)}
    for row, (parts, calls, failures) in expected.items():
        ids, tool, model = (batch[k][row].tolist() for k in ("responses", "tool_mask", "response_mask"))
        text = "".join(p.strip("[]") for p in parts)
        assert tokenizer.decode([i for i, t, m in zip(ids, tool, model) if t or m]) == text
        assert tokenizer.decode([i for i, t in zip(ids, tool) if t]) == "".join(p[1:-1] for p in parts if p[0] == "[")
        assert not any(t and m for t, m in zip(tool, model))
        assert (batch["tool_calls"][row].item(), batch["tool_failures"][row].item()) == (calls, failures)
    assert batch["has_eos"].tolist() == [True, True, True]
    attended = batch["attention_mask"][:, batch["context_length"]:].bool()
    assert torch.equal(attended, batch["tool_mask"] | batch["response_mask"])


def test_the_rollout_stops_at_max_new_tokens_counting_the_tool_output(monkeypatch, toolbox):
    turns = {"2*3=": [call("calculator", expression="2*3"), "6"]}
    width = len(call("calculator", expression="2*3")) + 1 + len("<tool_response>")  # the call, EOS, part of the output
    batch, tokenizer = scripted_rollout(monkeypatch, toolbox, turns, max_new_tokens=width)
    assert batch["responses"].shape[1] == width and batch["tool_mask"][0, -1] and not batch["has_eos"][0]


def test_with_no_call_the_rollout_is_the_single_turn_rollout_token_for_token(tiny):
    args = Args(max_new_tokens=6, tools=("calculator",), max_tool_calls=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny.policy)  # no '<': the tiny model can write no tool call
    models = SimpleNamespace(tokenizer=tokenizer, policy=LlamaForCausalLM.from_pretrained(tiny.policy),
                             eos_token_ids=[EOS], device=torch.device("cpu"), tools=ppo_llm.Toolbox(("calculator",), 1.0))
    prompt_ids = [tokenizer(p)["input_ids"] for p in ("37+48=", "3+4=", "15+43=")]
    torch.manual_seed(5)
    with_tools = ppo_llm.generate(models, prompt_ids, args, greedy=False)
    torch.manual_seed(5)
    single = ppo_llm.generate(models, prompt_ids, dataclasses.replace(args, max_tool_calls=0), greedy=False)
    assert with_tools["tool_mask"].sum() == 0 and with_tools["tool_calls"].sum() == 0
    for key, value in single.items():
        assert torch.equal(with_tools[key], value) if isinstance(value, torch.Tensor) else with_tools[key] == value, key


@pytest.fixture(scope="module")
def demo_rollout():
    """A sampled rollout of the tool demo's model, with calls in it."""
    tokenizer = AutoTokenizer.from_pretrained(TOOLS_DEMO / "model")
    policy = AutoModelForCausalLM.from_pretrained(TOOLS_DEMO / "model")
    models = SimpleNamespace(tokenizer=tokenizer, policy=policy, eos_token_ids=[tokenizer.eos_token_id],
                             device=torch.device("cpu"), tools=ppo_llm.Toolbox(("calculator",), 5.0))
    rows = [json.loads(line) for line in (TOOLS_DEMO / "eval.jsonl").read_text().splitlines()[:24]]
    torch.manual_seed(0)
    args = Args(tools=("calculator",), max_tool_calls=1)
    batch = ppo_llm.generate(models, [tokenizer(r["prompt"])["input_ids"] for r in rows], args, greedy=False)
    assert batch["tool_calls"].sum() >= 3 and (batch["tool_calls"] == 0).sum() >= 3  # both kinds of response
    return models, batch, args


def test_the_updates_logprobs_at_model_tokens_are_the_samplers_across_a_tool_call(demo_rollout):
    models, batch, args = demo_rollout
    rows = torch.arange(len(batch["responses"]))
    with torch.no_grad():
        update = ppo_llm.policy_forward(models.policy, batch, rows, args.temperature).logprobs
    c = batch["context_length"]
    for i in torch.nonzero(batch["tool_calls"]).flatten().tolist()[:4]:
        sequence = batch["query_responses"][i][batch["attention_mask"][i].bool()]  # no padding: as the sampler saw it
        prompt_length = int(batch["attention_mask"][i, :c].sum())
        with torch.no_grad():
            logp = models.policy(sequence[None]).logits[0].log_softmax(-1)
        for t in torch.nonzero(batch["response_mask"][i]).flatten().tolist():
            sampler = logp[prompt_length + t - 1, sequence[prompt_length + t]]
            torch.testing.assert_close(update[i, t], sampler, atol=1e-5, rtol=0)


def masked_micro_batch(monkeypatch, batch, entropy_at_tools):
    """micro_batch_backward on a rollout's masks, with the policy's log-probs, entropies and the critic's values as
    leaves (entropy_at_tools where tools wrote); returns (leaves, statistics)."""
    tool = batch["tool_mask"]
    g = torch.Generator().manual_seed(0)
    leaves = dict(logprobs=-torch.rand(tool.shape, generator=g), values=torch.zeros(tool.shape),
                  entropy=torch.rand(tool.shape, generator=g).masked_fill(tool, entropy_at_tools))
    leaves = {k: v.requires_grad_() for k, v in leaves.items()}
    monkeypatch.setattr(ppo_llm, "policy_forward", lambda *a, **k: ppo_llm.PolicyOutput(leaves["logprobs"],
                                                                                      leaves["entropy"], None))
    monkeypatch.setattr(ppo_llm, "critic_values", lambda *a, **k: leaves["values"])
    old = (leaves["logprobs"].detach() - 0.1 * torch.rand(tool.shape, generator=g)).masked_fill(tool, -50.0)
    batch = dict(batch, logprobs=old, values=torch.zeros(tool.shape), returns=torch.randn(tool.shape, generator=g))
    rows, mask = torch.arange(len(old)), batch["response_mask"]
    stats = ppo_llm.micro_batch_backward(SimpleNamespace(autocast=contextlib.nullcontext, policy=None), batch, rows,
                                        torch.randn(tool.shape, generator=g), mask.sum(), len(old),
                                        Args(ent_coef=0.01), True, {})
    return leaves, stats


def test_tool_output_gets_no_gradient_and_stays_out_of_the_kl_and_entropy(monkeypatch, toolbox):
    batch, _ = scripted_rollout(monkeypatch, toolbox, TURNS)
    tool, model = batch["tool_mask"], batch["response_mask"]
    leaves, stats = masked_micro_batch(monkeypatch, batch, 1e3)  # a huge entropy where the tools wrote
    for name in ("logprobs", "entropy", "values"):  # the policy loss, the entropy bonus and the value loss
        grad = leaves[name].grad
        assert (grad[tool] == 0).all() and (grad[model] != 0).all(), name
    expected = leaves["entropy"].detach()[model].sum().item() / model.sum().item()  # over the model's tokens alone
    assert stats["policy/entropy"].item() == pytest.approx(expected, rel=1e-6)
    g = torch.Generator().manual_seed(1)
    logprobs = -torch.rand(tool.shape, generator=g)
    ref = (logprobs - 0.3 * torch.rand(tool.shape, generator=g)).masked_fill(tool, 40.0)  # far away at tool tokens
    shaped = dict(batch, logprobs=logprobs, ref_logprobs=ref, raw_scores=torch.tensor([1.0, 0.0, 0.5]))
    ppo_llm.shape_rewards(shaped, Args(), 0.1, dict(reward_mean=0.0, reward_var=1.0, reward_count=0))
    by_hand = [sum(lp - r for lp, r, m in zip(logprobs[i].tolist(), ref[i].tolist(), model[i].tolist()) if m)
               for i in range(len(ref))]  # k1, the default estimator, over the model's tokens
    assert shaped["kl"].sum(1).tolist() == pytest.approx(by_hand, rel=1e-5)
    last = [max(t for t in range(tool.shape[1]) if model[i, t]) for i in range(len(ref))]  # the last model token
    scored = shaped["rewards"] + 0.1 * shaped["kl"]
    assert [scored[i, t].item() for i, t in enumerate(last)] == pytest.approx([1.0, 0.0, 0.5])


def test_gae_runs_over_the_models_tokens_alone_across_a_tool_span():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 0, 1, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    rewards, values = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    advantages, returns = compute_gae(rewards, values, mask, 0.9, 0.8)
    for i in range(3):  # a plain loop over the model's tokens alone, tool spans cut out
        kept = [t for t in range(7) if mask[i, t]]
        r, v = rewards[i, kept].tolist(), values[i, kept].tolist()
        a, expected = 0.0, [0.0] * len(kept)
        for k in reversed(range(len(kept))):
            delta = r[k] + 0.9 * (v[k + 1] if k + 1 < len(kept) else 0.0) - v[k]
            a = expected[k] = delta + 0.9 * 0.8 * a
        assert advantages[i, kept].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert (advantages[i, ~mask[i]] == 0).all() and (returns[i, ~mask[i]] == 0).all()
        assert returns[i, kept].tolist() == pytest.approx([x + y for x, y in zip(expected, v)], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("script", ["default", "failing-tool", "slow-tool"])
def test_the_tool_demo_trains_and_reports_its_tool_metrics_and_a_failing_tool_ends_no_run(tiny, tmp_path, script):
    tools = {"default": ["calculator"], "failing-tool": [f"{tmp_path / 'bad.py'}:calculator"],
             "slow-tool": [f"{tmp_path / 'bad.py'}:calculator", "--tool-timeout", "0.01"]}[script]
    (tmp_path / "bad.py").write_text(  # a calculator that fails every call, or answers too late
        "import time\ndef calculator(expression: str) -> str:\n    '''Broken.\n\n    Args:\n        expression: any\n"
        "    '''\n" + ("    time.sleep(1)\n    return '0'\n" if script == "slow-tool" else "    raise RuntimeError('down')\n"))
    result = succeeded(run_main(tiny, tmp_path / "out", "--model-name-or-path", TOOLS_DEMO / "model", "--prompts-path",
                                TOOLS_DEMO / "train.jsonl", "--eval-prompts-path", TOOLS_DEMO / "eval.jsonl",
                                "--max-tool-calls", 1, "--num-prompts", 16, "--max-new-tokens", 16, "--sample-every", 1,
                                "--tools", *tools))
    metrics = read_metrics(tmp_path / "out")
    for row in (metrics[1], metrics[2]):
        assert 0 < row["tools/calls_per_response"] <= 1 and 0 < row["tools/token_fraction"] < 1
        assert row["tools/failure_rate"] == (0.0 if script == "default" else 1.0)
    assert "eval/tool_calls_per_response" in metrics[0] and "| calls " in result.stdout
    # a sample with its call and result (an error message, which the demo's vocabulary cannot spell, is left out)
    shown = "</tool_call><tool_response>" + ("" if script == "default" else "</tool_response>")
    assert shown in result.stdout and '"expression": "' in result.stdout


def test_a_resumed_tool_using_run_continues_exactly_where_the_checkpoint_left_off(tiny, tmp_path):
    flags = ["--model-name-or-path", TOOLS_DEMO / "model", "--prompts-path", TOOLS_DEMO / "train.jsonl",
             "--eval-prompts-path", TOOLS_DEMO / "eval.jsonl", "--tools", "calculator", "--max-tool-calls", 1,
             "--num-prompts", 16, "--max-new-tokens", 16, "--num-iterations", 3, "--save-every", 1]
    succeeded(run_main(tiny, tmp_path / "whole", *flags))
    succeeded(run_main(tiny, tmp_path / "resumed", *flags, "--resume-from", tmp_path / "whole" / "checkpoint-1"))
    whole, resumed = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "resumed")
    assert resumed[2]["tools/calls_per_response"] > 0
    assert {i: non_timing(resumed[i]) for i in (2, 3)} == {i: non_timing(whole[i]) for i in (2, 3)}
    before, after = (load_file(d / "policy" / "model.safetensors") for d in (tmp_path / "whole", tmp_path / "resumed"))
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_two_ranks_with_tools_take_their_own_numbers_of_turns_under_fsdp(tiny, tmp_path):
    # On rank 1 every tool answer fills what is left of --max-new-tokens, so its responses end after one turn, while
    # rank 0 samples a second turn after each call: under FSDP2 no collective may run between the turns.
    (tmp_path / "ranked.py").write_text(
        "import os\ndef calculator(expression: str) -> str:\n    '''Long answers on rank 1.\n\n    Args:\n"
        "        expression: any\n    '''\n    return '1' * 50 if os.environ['RANK'] == '1' else '42'\n")
    flags = ["--model-name-or-path", TOOLS_DEMO / "model", "--prompts-path", TOOLS_DEMO / "train.jsonl",
             "--eval-prompts-path", TOOLS_DEMO / "eval.jsonl", "--tools", f"{tmp_path / 'ranked.py'}:calculator",
             "--max-tool-calls", 1, "--num-prompts", 8, "--max-new-tokens", 16, "--fsdp", "--eval-every", "0"]
    succeeded(torchrun(SCRIPT, *script_flags(tiny, tmp_path / "out", *flags)))
    metrics = read_metrics(tmp_path / "out")
    assert sorted(metrics) == [1, 2] and all(m["tools/calls_per_response"] > 0 for m in metrics.values())

def test_a_built_in_reward_judges_the_text_after_the_last_tool_output(monkeypatch, toolbox):
    batch, tokenizer = scripted_rollout(monkeypatch, toolbox, TURNS)
    assert ppo_llm.last_turns(tokenizer, batch) == ["6", "8", "wrong, try " + call("calculator", expression="x")]
