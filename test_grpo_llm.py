"""Tests for grpo_llm.py: one behaviour per test, expected values derived independently (a plain Python loop, a
hand-computed case, or an identity from the papers). End-to-end runs use the script as a subprocess on tiny models
built here from a config, so nothing is ever downloaded.

Run: python -m pytest -q test_grpo_llm.py
"""

import ast
import contextlib
import dataclasses
import inspect
import io
import itertools
import json
import math
import os
import re
import shutil
import signal
import statistics
import string
import subprocess
import sys
import textwrap
import threading
import typing
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch import nn
from safetensors.torch import load_file
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM, LlamaForSequenceClassification

import grpo_llm
import plot_metrics

from conftest import EOS, PAD, REAL_MODEL_ENV, SUBPROCESS_ENV, char_tokenizer, greedy_last_numbers, llama_config, non_timing, read_metrics, succeeded, write_jsonl
from grpo_llm import (
    PRESETS,
    ConfigError,
    aggregate_loss,
    call_reward_fn,
    check_args,
    cispo_loss,
    clipped_surrogate_loss,
    combine_rewards,
    default_learning_rate,
    disable_dropout,
    entropy_from_logprobs,
    eos_token_ids,
    exact_match_reward,
    group_advantages,
    grpo_update,
    importance_ratio,
    importance_weighted_kl,
    kl_penalty,
    load_prompts,
    loss_normalisers,
    masked_mean,
    merge_rounds,
    off_policy_sequence_mask,
    overlong_penalty,
    Args,
    parse_args,
    response_states,
    print_line,
    response_mask_from_eos,
    reward_names,
    sapo_loss,
    select_groups,
    vespo_loss,
    top_entropy_threshold,
    zero_std_groups,
)

REPO = Path(__file__).resolve().parent
SCRIPT = REPO / "grpo_llm.py"
DEMO_MODEL = REPO / "demo" / "model"  # its tokenizer knows digits, '+', '=' and nothing else (no <unk>)
# ---------------------------------------------------------------------------------------------------------
# Tiny models, data and reward functions, built once per module (the same from_pretrained path as a real model)
# ---------------------------------------------------------------------------------------------------------


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
    paths = SimpleNamespace(root=root, policy=root / "policy", rm=root / "rm", no_tokenizer=root / "no_tokenizer")
    policy = LlamaForCausalLM(llama_config())
    policy.save_pretrained(paths.policy)
    char_tokenizer().save_pretrained(paths.policy)
    policy.save_pretrained(paths.no_tokenizer)  # weights and config, but no tokenizer files
    LlamaForSequenceClassification(llama_config(num_labels=1)).save_pretrained(paths.rm)
    char_tokenizer().save_pretrained(paths.rm)
    problems = [(37, 48), (3, 4), (15, 43), (8, 61), (75, 72), (9, 9)]  # prompts of different lengths
    paths.train = write_jsonl(root / "train.jsonl", [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in problems])
    paths.eval = write_jsonl(root / "eval.jsonl", [{"prompt": "12+34=", "answer": "46"}, {"prompt": "5+6=", "answer": "11"}])
    paths.malformed = root / "malformed.jsonl"
    paths.malformed.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", \n')
    (root / "rewards.py").write_text(REWARD_FNS)
    paths.digit_sum = f"{root / 'rewards.py'}:digit_sum"
    paths.has_one = f"{root / 'rewards.py'}:has_one"
    paths.wrong_length = f"{root / 'rewards.py'}:wrong_length"
    paths.missing_fn = f"{root / 'rewards.py'}:no_such_function"
    paths.blows_up = f"{root / 'rewards.py'}:blows_up_on_second_call"
    paths.empty_dir = root / "empty_dir"
    paths.empty_dir.mkdir()
    paths.latin1_prompts = root / "latin1.jsonl"
    paths.latin1_prompts.write_bytes('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\u00e9", "answer": "2"}\n'.encode("latin-1"))
    paths.answerless_eval = write_jsonl(root / "answerless_eval.jsonl", [{"prompt": "1+2=", "answer": "3"},
                                                                         {"prompt": "3+4=", "answer": "7"}, {"prompt": "5+6="}])
    paths.completions_field = write_jsonl(root / "completions_field.jsonl", [{"prompt": "1+1=", "answer": "2", "completions": 1}])
    paths.letter_prompts = write_jsonl(root / "letters.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1+x=", "answer": "2"}])
    paths.null_answer = write_jsonl(root / "null_answer.jsonl", [{"prompt": "1+1=", "answer": None}])
    paths.questions = write_jsonl(root / "questions.jsonl", [{"question": "1+1=", "answer": "2"}])
    paths.solutions = write_jsonl(root / "solutions.jsonl", [{"question": "1+1=", "solution": "2"}])
    paths.empty_prompt = write_jsonl(root / "empty_prompt.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "", "answer": "0"}])
    return paths


def script_flags(tiny, output_dir, *flags, model=None):
    """The command line of a run with tiny budgets; flags given later override the ones here."""
    return [
        "--model-name-or-path", str(model or tiny.policy),
        "--prompts-path", str(tiny.train),
        "--eval-prompts-path", str(tiny.eval),
        "--output-dir", str(output_dir),
        "--num-iterations", "2", "--num-prompts", "2", "--num-generations", "4", "--max-new-tokens", "4",
        "--micro-batch-size", "4", "--eval-every", "1", "--sample-every", "0", "--save-every", "0",
        *map(str, flags),
    ]


def run_script(tiny, output_dir, *flags, model=None):
    """The script as a user runs it, with tiny budgets; returns the CompletedProcess."""
    command = [sys.executable, str(SCRIPT), *script_flags(tiny, output_dir, *flags, model=model)]
    return subprocess.run(command, cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300)


def run_main(tiny, output_dir, *flags, model=None):
    """grpo_llm.main() in this process on run_script's command line: the same code path, without the seconds of
    starting Python and importing torch for every run. Returns what the subprocess would: the exit code, stdout, and
    stderr with sys.exit's message on it, as the interpreter prints it."""
    argv = [str(SCRIPT), *script_flags(tiny, output_dir, *flags, model=model)]
    stdout, stderr = io.StringIO(), io.StringIO()
    with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            grpo_llm.main()
            code = 0
        except SystemExit as e:
            code = e.code
    if code is not None and not isinstance(code, int):
        print(code, file=stderr)
        code = 1
    return subprocess.CompletedProcess(argv, code or 0, stdout.getvalue(), stderr.getvalue())


def single_error_line(result):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def weights(model_dir):
    return load_file(str(Path(model_dir) / "model.safetensors"))


# ---------------------------------------------------------------------------------------------------------
# Advantages: GRPO group mean/std, RLOO leave-one-out, Dr. GRPO no scaling, ReMax greedy baseline
# ---------------------------------------------------------------------------------------------------------


def test_group_advantages_are_rewards_centred_and_divided_by_the_unbiased_group_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    # Group 1: mean 1/2, squared deviations 4 x 1/4 = 1, unbiased variance 1/3.
    # Group 2: mean 3/4, squared deviations 3 x 1/16 + 9/16 = 3/4, unbiased variance 1/4, std 1/2.
    s1, s2, eps = 1 / math.sqrt(3), 0.5, 1e-4
    expected = [0.5 / (s1 + eps), -0.5 / (s1 + eps), -0.5 / (s1 + eps), 0.5 / (s1 + eps),
                0.25 / (s2 + eps), 0.25 / (s2 + eps), 0.25 / (s2 + eps), -0.75 / (s2 + eps)]
    advantages = group_advantages(rewards, 4, "group-mean", "group")
    torch.testing.assert_close(advantages, torch.tensor(expected))


def test_leave_one_out_baseline_is_the_mean_of_the_other_rewards_of_the_group():
    G = 5
    rewards = torch.rand(3 * G, generator=torch.Generator().manual_seed(0))
    r = rewards.tolist()
    expected = []
    for i in range(len(r)):
        group = range(i // G * G, i // G * G + G)
        others = [r[j] for j in group if j != i]
        expected.append(r[i] - sum(others) / len(others))
    advantages = group_advantages(rewards, G, "leave-one-out", "none")
    torch.testing.assert_close(advantages, torch.tensor(expected))


def test_scale_none_leaves_rewards_minus_their_group_mean():
    G = 4
    rewards = torch.rand(3 * G, generator=torch.Generator().manual_seed(1))
    r = rewards.tolist()
    expected = [r[i] - statistics.fmean(r[i // G * G : i // G * G + G]) for i in range(len(r))]
    torch.testing.assert_close(group_advantages(rewards, G, "group-mean", "none"), torch.tensor(expected))


def test_batch_scaling_divides_centred_rewards_by_the_std_of_the_whole_batch():
    G = 4
    rewards = torch.rand(3 * G, generator=torch.Generator().manual_seed(2))
    r = rewards.tolist()
    batch_std = statistics.stdev(r)  # unbiased, over all P*G rewards
    expected = [(r[i] - statistics.fmean(r[i // G * G : i // G * G + G])) / (batch_std + 1e-4) for i in range(len(r))]
    torch.testing.assert_close(group_advantages(rewards, G, "group-mean", "batch"), torch.tensor(expected))


def test_greedy_baseline_subtracts_the_greedy_reward_of_the_same_prompt():
    G = 3
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 3.0, 4.0])
    greedy_rewards = torch.tensor([0.5, 3.5])
    expected = [1.0 - 0.5, 0.0 - 0.5, 0.5 - 0.5, 2.0 - 3.5, 3.0 - 3.5, 4.0 - 3.5]
    torch.testing.assert_close(group_advantages(rewards, G, "greedy", "none", greedy_rewards), torch.tensor(expected))


def test_combine_rewards_is_the_weighted_sum_in_order():
    scores = {"exact_match": torch.tensor([1.0, 0.0]), "reward_model": torch.tensor([0.25, -2.0])}
    torch.testing.assert_close(combine_rewards(scores, [1.0, 0.5]), torch.tensor([1.0 + 0.125, 0.0 - 1.0]))


# ---------------------------------------------------------------------------------------------------------
# Loss aggregation (GRPO, DAPO, Dr. GRPO) on a ragged mask
# ---------------------------------------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
RAGGED = torch.tensor([[True, True, True, False], [True, False, False, False]])


def aggregate_ragged(mode):
    """LOSS over RAGGED: 4 real tokens in 2 sequences, L_max = 5 (wider than the rows)."""
    return aggregate_loss(LOSS, RAGGED, mode, num_tokens=4, num_seqs=2, max_new_tokens=5).item()


def test_seq_mean_token_mean_averages_each_sequence_then_the_sequences():
    # (1+2+3)/3 = 2 and 5/1 = 5, then (2+5)/2
    assert aggregate_ragged("seq-mean-token-mean") == pytest.approx(3.5)


def test_token_mean_weighs_every_real_token_the_same():
    # (1+2+3+5)/4
    assert aggregate_ragged("token-mean") == pytest.approx(2.75)


def test_seq_mean_token_sum_norm_divides_the_token_sum_by_sequences_times_max_new_tokens():
    # (1+2+3+5)/(2*5): the constant L_max, not the row width 4 nor the real lengths
    assert aggregate_ragged("seq-mean-token-sum-norm") == pytest.approx(1.1)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_losses_with_minibatch_normalisers_add_up_to_the_minibatch_loss(mode):
    generator = torch.Generator().manual_seed(3)
    loss = torch.randn(6, 5, generator=generator)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 1, 3, 2, 4, 5])[:, None]
    num_tokens, num_seqs = mask.sum().item(), 6
    whole = aggregate_loss(loss, mask, mode, num_tokens, num_seqs, max_new_tokens=7)
    parts = sum(aggregate_loss(loss[s : s + 2], mask[s : s + 2], mode, num_tokens, num_seqs, max_new_tokens=7)
                for s in (0, 2, 4))
    torch.testing.assert_close(parts, whole)


def test_masked_mean_ignores_masked_values():
    x = torch.tensor([[1.0, 2.0, 100.0], [4.0, -50.0, -50.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(x, mask).item() == pytest.approx((1 + 2 + 4) / 3)
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 4.0]))


# ---------------------------------------------------------------------------------------------------------
# Dispatch tables: every choice of a knob has its entry, and an unknown name is an error
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("knob, table", [
    ("kl_estimator", "KL_ESTIMATORS"), ("loss_aggregation", "LOSS_AGGREGATIONS"), ("baseline", "BASELINES"),
    ("scale_rewards", "REWARD_SCALES"), ("importance_level", "IMPORTANCE_RATIOS"), ("policy_loss", "POLICY_LOSSES"),
    ("reward_aggregation", "REWARD_AGGREGATIONS"),
])
def test_every_choice_of_a_dispatched_knob_is_an_entry_of_its_table(knob, table):
    choices = typing.get_args(typing.get_type_hints(Args)[knob])
    assert set(choices) == set(getattr(grpo_llm, table))


def test_an_unknown_name_in_a_dispatch_table_is_an_error_not_a_default():
    # Before the tables, a --policy-loss without its own branch ran SAPO.
    x, r = torch.zeros(2, 3), torch.tensor([1.0, 0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="unknown KL estimator 'k4': expected one of k1, k2, k3"):
        kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match="unknown baseline 'median'"):
        group_advantages(r, 2, "median", "none")
    with pytest.raises(ValueError, match="unknown reward scaling 'rank'"):
        group_advantages(r, 2, "group-mean", "rank")
    with pytest.raises(ValueError, match="unknown importance level 'group'"):
        importance_ratio(x, x, x.bool(), "group")
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        aggregate_loss(x, x.bool(), "sum", 1, 1, 3)
    with pytest.raises(ValueError, match="unknown policy loss 'reinforce'"):
        grpo_llm.pick(grpo_llm.POLICY_LOSSES, "reinforce", "policy loss")
    with pytest.raises(ValueError, match="unknown reward aggregation 'max'"):
        grpo_llm.compute_advantages(dict(scores={"a": r}, response_mask=torch.ones(4, 1, dtype=torch.bool)),
                                    dataclasses.replace(Args(), num_generations=2, reward_weights=[1.0],
                                                        reward_aggregation="max"))


# ---------------------------------------------------------------------------------------------------------
# Importance ratios: per token, and GSPO's length-normalised sequence ratio
# ---------------------------------------------------------------------------------------------------------


def test_gspo_sequence_ratio_is_exp_of_the_mean_token_log_ratio_shared_by_all_tokens():
    generator = torch.Generator().manual_seed(4)
    logprobs, old_logprobs = -torch.rand(2, 4, generator=generator), -torch.rand(2, 4, generator=generator)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    ratio = importance_ratio(logprobs, old_logprobs, mask, "sequence")
    for i in range(2):
        real = [t for t in range(4) if mask[i, t]]
        expected = math.exp(sum(logprobs[i, t].item() - old_logprobs[i, t].item() for t in real) / len(real))
        for t in range(4):  # every position of the row, padding included, carries the sequence's ratio
            assert ratio[i, t].item() == pytest.approx(expected, rel=1e-6)


def test_gspo_sequence_ratio_ignores_masked_tokens():
    generator = torch.Generator().manual_seed(5)
    logprobs, old_logprobs = -torch.rand(2, 4, generator=generator), -torch.rand(2, 4, generator=generator)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    changed = logprobs.clone()
    changed[~mask] = 30.0
    torch.testing.assert_close(importance_ratio(changed, old_logprobs, mask, "sequence"),
                               importance_ratio(logprobs, old_logprobs, mask, "sequence"))


def test_token_ratio_is_exp_of_each_token_log_ratio():
    logprobs, old_logprobs = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    ratio = importance_ratio(logprobs, old_logprobs, torch.ones(1, 2, dtype=torch.bool), "token")
    torch.testing.assert_close(ratio, torch.tensor([[math.exp(0.5), math.exp(-1.0)]]))


# ---------------------------------------------------------------------------------------------------------
# KL estimators (Schulman, "Approximating KL divergence"); log r = ref - policy log-prob of the sampled token
# ---------------------------------------------------------------------------------------------------------


def test_k3_is_nonnegative_elementwise():
    generator = torch.Generator().manual_seed(6)
    logprobs, ref_logprobs = 3 * torch.randn(1000, generator=generator), 3 * torch.randn(1000, generator=generator)
    assert (kl_penalty(logprobs, ref_logprobs, "k3") >= 0).all()


@pytest.mark.parametrize(
    "estimator, p, q, expected",
    [
        # log r = q - p.  k1 = -log r,  k2 = (log r)^2 / 2,  k3 = exp(log r) - log r - 1
        ("k1", -1.0, -2.0, 1.0),
        ("k2", -1.0, -2.0, 0.5),
        ("k3", -1.0, -2.0, math.exp(-1.0) + 1.0 - 1.0),
        ("k1", -2.0, -1.0, -1.0),
        ("k2", -2.0, -1.0, 0.5),
        ("k3", -2.0, -1.0, math.exp(1.0) - 1.0 - 1.0),
    ],
)
def test_kl_estimators_by_hand(estimator, p, q, expected):
    assert kl_penalty(torch.tensor([p]), torch.tensor([q]), estimator).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("scale", [1, 10, 30])
def test_entropy_in_float32_stays_within_4e_6_of_float64_on_peaked_distributions(scale):
    # logsumexp(z) - sum p*z cancels two large numbers: its error reaches ~1e-5 at logit scale 10-30.
    logits = scale * torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    exact = -(torch.softmax(logits.double(), -1) * torch.log_softmax(logits.double(), -1)).sum(-1)
    assert (entropy_from_logprobs(torch.log_softmax(logits, -1)).double() - exact).abs().max().item() < 4e-6


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("head", ["none", "linear", "linear with bias", "frozen linear"])
def test_log_probs_and_entropy_by_chunks_are_the_plain_formulas_values_and_gradients(head, entropy_grad):
    # From hidden states and an output head (the logits computed a chunk at a time, never whole), or from logits;
    # a frozen head (LoRA's) gets no gradient
    g = torch.Generator().manual_seed(2)
    tokens, weights = torch.randint(0, 40, (7, 5), generator=g), torch.randn(7, 5, generator=g)
    linear = nn.Linear(16, 40, bias=head == "linear with bias").requires_grad_(head != "frozen linear")
    parameters = [] if head in ("none", "frozen linear") else list(linear.parameters())
    states = torch.randn(7, 5, 40 if head == "none" else 16, generator=g)

    def loss(logprobs, entropy):
        return ((logprobs + entropy) * weights if entropy_grad else logprobs * weights).sum()

    leaf = states.clone().requires_grad_()  # the plain formulas, through autograd
    log_softmax = torch.log_softmax((leaf if head == "none" else linear(leaf)) / 0.7, -1)
    expected = (log_softmax.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(log_softmax.exp() * log_softmax).sum(-1))
    loss(*expected).backward()
    expected_grads = [leaf.grad] + [p.grad.clone() for p in parameters]
    # one chunk; 2 positions per chunk (the last holds 1); 1 per chunk; each with the log-softmax kept for the backward
    # pass or recomputed there
    for chunk_elements, kept in itertools.product((2**24, 2 * 40, 1), (2**27, 0)):
        linear.zero_grad()
        leaf = states.clone().requires_grad_()
        with (mock.patch.object(grpo_llm, "LOGITS_CHUNK_ELEMENTS", chunk_elements),
              mock.patch.object(grpo_llm, "KEPT_LOGPROBS_ELEMENTS", kept)):
            logprobs, entropy = grpo_llm.logprobs_and_entropy(leaf, None if head == "none" else linear, tokens, 0.7,
                                                              entropy_grad)
        assert entropy.requires_grad == entropy_grad
        loss(logprobs, entropy).backward()
        torch.testing.assert_close(logprobs, expected[0].detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy.detach(), expected[1].detach(), atol=1e-5, rtol=0)
        for got, want in zip([leaf.grad] + [p.grad for p in parameters], expected_grads, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert linear.weight.grad is None or head != "frozen linear"


def test_without_the_models_logits_the_log_probs_are_those_of_its_logits(tiny_policy):
    # Where the vocabulary outnumbers the hidden state, policy_forward hands ResponseLogprobs the final hidden states
    # and the head instead of the model's own logits
    config = llama_config()
    config.hidden_size, config.intermediate_size, config.head_dim = 8, 16, 2  # 4 heads of 2: 8 < the vocabulary's 15
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    seq = torch.randint(2, 14, (3, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(seq)
    mask[0, :2] = 0
    with torch.no_grad():
        states, head = response_states(model, seq, mask, 4)
        logprobs, _ = grpo_llm.logprobs_and_entropy(states, head, seq[:, 4:], 0.8, None)
        logits = model(input_ids=seq, attention_mask=mask, position_ids=grpo_llm.position_ids_from(mask)).logits
        assert response_states(tiny_policy, seq, mask, 4)[1] is None  # hidden 32 > 15 tokens: the model's logits
    assert head is model.lm_head and states.shape == (3, 5, 8)
    expected = torch.log_softmax(logits[:, 3:-1] / 0.8, -1).gather(-1, seq[:, 4:].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# Clipped surrogate: loss = max(-A*w, -A*clip(w, 1-eps_low, 1+eps_high)), DAPO Clip-Higher, Dual-Clip
# ---------------------------------------------------------------------------------------------------------


def surrogate(ratio, advantage, clip_eps_high=None, dual_clip=None):
    ratio, advantage = torch.tensor([ratio]), torch.tensor([advantage])
    loss, low, high = clipped_surrogate_loss(ratio, advantage, 0.2, clip_eps_high)
    if dual_clip is not None:
        loss, high = grpo_llm.dual_clip(loss, high, advantage, dual_clip)
    return loss.item(), bool(low), bool(high)


def test_clip_higher_caps_a_positive_advantage_at_one_plus_eps_high():
    # max(-2*1.5, -2*1.28) = -2.56: the upper bound 1.28 removes the gradient
    loss, low, high = surrogate(1.5, 2.0, clip_eps_high=0.28)
    assert loss == pytest.approx(-1.28 * 2.0) and high and not low


def test_clip_higher_keeps_the_lower_bound_at_one_minus_eps_low():
    # max(2*0.5, 2*0.8) = 1.6 = -0.8*A: the lower bound 0.8 removes the gradient
    loss, low, high = surrogate(0.5, -2.0, clip_eps_high=0.28)
    assert loss == pytest.approx(-0.8 * -2.0) and low and not high


@pytest.mark.parametrize("ratio, advantage", [(1.25, 1.0), (0.85, -1.0), (1.0, 3.0), (1.5, -1.0), (0.5, 1.0)])
def test_ratio_inside_the_bounds_or_on_the_pessimistic_side_is_not_clipped(ratio, advantage):
    # 1.25 < 1.28 is inside Clip-Higher's range (a symmetric 0.2 would clip it); for A < 0 a ratio above the range,
    # and for A > 0 one below it, already give the larger (pessimistic) loss -A*w, so PPO keeps their gradient.
    loss, low, high = surrogate(ratio, advantage, clip_eps_high=0.28)
    assert loss == pytest.approx(-advantage * ratio) and not low and not high


def test_dual_clip_caps_the_loss_of_a_negative_advantage_at_minus_c_times_a():
    # without it: max(1*10, 1*1.28) = 10; with c = 3 the loss is capped at -3*A = 3
    loss, low, high = surrogate(10.0, -1.0, clip_eps_high=0.28, dual_clip=3.0)
    assert loss == pytest.approx(3.0) and high and not low


def test_dual_clip_leaves_positive_advantages_alone():
    assert surrogate(10.0, 1.0, clip_eps_high=0.28, dual_clip=3.0) == surrogate(10.0, 1.0, clip_eps_high=0.28)


# ---------------------------------------------------------------------------------------------------------
# The newer critic-free losses (CISPO, SAPO, INTELLECT-2's two-sided clip) and token or sequence masks (high-entropy
# tokens, DeepSeek-V3.2's off-policy masking and importance-corrected KL), each against a per-token loop of its paper's
# formula on random ragged float64 batches: the loss value and its gradient with respect to log pi_theta.
# ---------------------------------------------------------------------------------------------------------


def ragged_batch(seed, B=6, T=7, spread=0.5):
    """float64 log-probs (a leaf with gradient), the sampler's and the reference's, one advantage per row (some 0),
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
    return SimpleNamespace(logprobs=logprobs.requires_grad_(), old=old, ref=ref, advantages=advantages, mask=mask, B=B, T=T)


def real_tokens(b):
    return [(i, t) for i in range(b.B) for t in range(b.T) if b.mask[i, t]]


def loss_and_gradient(b, per_token, mode):
    """Aggregate a (B, T) per-token loss over b.mask, and its gradient with respect to b.logprobs."""
    n_tokens, n_seqs = loss_normalisers(b.mask, mode)
    loss = aggregate_loss(per_token, b.mask, mode, n_tokens, n_seqs, b.T)
    (gradient,) = torch.autograd.grad(loss, b.logprobs)
    return loss.item(), gradient


@pytest.mark.parametrize("eps_low, eps_high, spread", [(0.2, 0.28, 0.5), (1.0, 4.0, 1.5)])
def test_cispo_loss_and_gradient_equal_a_per_token_loop_of_minimax_m1s_formula(eps_low, eps_high, spread):
    # J = 1/N sum_it sg(clip(w_it, 1-eps_low, 1+eps_high)) * A_i * log pi(y_it): the weight is a constant for the
    # gradient, so d(-J)/d log pi(y_it) = -w_hat_it * A_i / N, with no term from w's own dependence on log pi.
    b = ragged_batch(0, spread=spread)
    ratio = importance_ratio(b.logprobs, b.old, b.mask, "token")
    tokens, low, high = cispo_loss(ratio, b.logprobs, b.advantages.unsqueeze(1).expand(b.B, b.T), eps_low, eps_high)
    loss, gradient = loss_and_gradient(b, tokens, "token-mean")
    n = len(real_tokens(b))
    expected_loss, expected_gradient = 0.0, torch.zeros(b.B, b.T, dtype=torch.float64)
    for i, t in real_tokens(b):
        w = math.exp(b.logprobs[i, t].item() - b.old[i, t].item())
        w_hat = min(max(w, 1 - eps_low), 1 + eps_high)
        expected_loss += -w_hat * b.advantages[i].item() * b.logprobs[i, t].item() / n
        expected_gradient[i, t] = -w_hat * b.advantages[i].item() / n
        assert (bool(low[i, t]), bool(high[i, t])) == (w < 1 - eps_low, w > 1 + eps_high)
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    torch.testing.assert_close(gradient, expected_gradient, atol=1e-6, rtol=0)
    assert high[b.mask].any() and (eps_low >= 1 or low[b.mask].any())  # the batch really exercises the bounds


def test_sapo_loss_and_gradient_equal_a_per_token_loop_of_the_soft_gate():
    # J = sum_i 1/|y_i| sum_t f(w_it) A_i / num_seqs with f(w) = sigmoid(tau (w - 1)) * 4 / tau, tau by the sign of A;
    # d(-f(w) A)/d log pi = -4 s (1 - s) * w * A with s = sigmoid(tau (w - 1)), because dw/d log pi = w.
    b = ragged_batch(1)
    tau_pos, tau_neg = 1.0, 1.05
    ratio = importance_ratio(b.logprobs, b.old, b.mask, "token")
    tokens = sapo_loss(ratio, b.advantages.unsqueeze(1).expand(b.B, b.T), tau_pos, tau_neg)
    loss, gradient = loss_and_gradient(b, tokens, "seq-mean-token-mean")
    rows = [i for i in range(b.B) if b.mask[i].any()]
    expected_loss, expected_gradient = 0.0, torch.zeros(b.B, b.T, dtype=torch.float64)
    for i, t in real_tokens(b):
        a, n_i = b.advantages[i].item(), int(b.mask[i].sum())
        tau = tau_pos if a > 0 else tau_neg
        w = math.exp(b.logprobs[i, t].item() - b.old[i, t].item())
        s = 1 / (1 + math.exp(-tau * (w - 1)))
        expected_loss += -s * 4 / tau * a / n_i / len(rows)
        expected_gradient[i, t] = -4 * s * (1 - s) * w * a / n_i / len(rows)
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    torch.testing.assert_close(gradient, expected_gradient, atol=1e-6, rtol=0)


def test_sapo_gate_has_the_policy_gradient_at_ratio_one():
    # f'(1) = 4 * sigmoid(0) * (1 - sigmoid(0)) = 1 whatever tau: on-policy SAPO is the plain policy gradient -A.
    ratio = torch.ones(3, dtype=torch.float64, requires_grad=True)
    sapo_loss(ratio, torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64), 1.0, 3.0).sum().backward()
    torch.testing.assert_close(ratio.grad, torch.tensor([-2.0, 1.0, -0.5], dtype=torch.float64))


@pytest.mark.parametrize("seed, spread", [(5, 0.1), (6, 0.6)])
def test_vespo_loss_and_gradient_equal_a_per_token_loop_of_the_papers_gamma_weight(seed, spread):
    # VESPO: l_it = -sg(phi(w_i)) * A_i * log pi(y_it), w_i = exp(sum_t log(pi/pi_old)), phi(w) = e^lam w^k e^(-lam w),
    # (k, lam) = (2, 3) for A >= 0 and (3, 2) otherwise; phi is a constant for the gradient: dl/d log pi = -phi * A.
    b = ragged_batch(seed, spread=spread)
    ratio = importance_ratio(b.logprobs, b.old, b.mask, "token")
    tokens = vespo_loss(ratio, b.logprobs, b.advantages.unsqueeze(1).expand(b.B, b.T), b.mask, 2.0, 3.0, 3.0, 2.0)
    loss, gradient = loss_and_gradient(b, tokens, "token-mean")
    n = len(real_tokens(b))
    expected_loss, expected_gradient, weights = 0.0, torch.zeros(b.B, b.T, dtype=torch.float64), []
    for i in range(b.B):
        a = b.advantages[i].item()
        k, lam = (2.0, 3.0) if a >= 0 else (3.0, 2.0)
        w = math.exp(sum(b.logprobs[i, t].item() - b.old[i, t].item() for t in range(b.T) if b.mask[i, t]))
        phi = math.exp(lam) * w**k * math.exp(-lam * w)
        weights.append(phi)
        for t in range(b.T):
            if b.mask[i, t]:
                expected_loss += -phi * a * b.logprobs[i, t].item() / n
                expected_gradient[i, t] = -phi * a / n
    assert loss == pytest.approx(expected_loss, abs=1e-9)
    torch.testing.assert_close(gradient, expected_gradient, atol=1e-9, rtol=0)
    assert max(weights) > 1.05 and min(weights) < 0.95  # responses on both sides of w = 1


def test_vespo_weight_is_one_on_policy_and_peaks_at_k_over_lambda():
    # phi(1) = e^lam e^-lam = 1 whatever k and lam; d log phi / dw = k / w - lam = 0 at w = k / lam.
    log_w = torch.linspace(-1.5, 1.5, 301, dtype=torch.float64)
    logprobs = torch.zeros(301, 1, dtype=torch.float64, requires_grad=True)
    a = torch.ones(301, 1, dtype=torch.float64)
    (gradient,) = torch.autograd.grad(vespo_loss(log_w.exp().unsqueeze(1), logprobs, a, torch.ones(301, 1), 2.0, 3.0,
                                                 3.0, 2.0).sum(), logprobs)
    phi = -gradient.squeeze(1)
    assert phi[150].item() == pytest.approx(1.0, abs=1e-12)  # log w = 0
    assert log_w[phi.argmax()].exp().item() == pytest.approx(2.0 / 3.0, abs=0.01)


def test_normalize_then_sum_adds_each_rewards_own_group_advantage():
    # GDPO: A_i = sum_k w_k (r_ki - mean_group(r_k)) / (std_group(r_k) + 1e-4), the unbiased std, group by group; a
    # reward 100 times as wide as the other no longer drowns it. With one reward of weight 1 both orders agree.
    g = torch.Generator().manual_seed(8)
    scores = {"a": torch.randint(0, 2, (12,), generator=g).float(), "b": 100 * torch.rand(12, generator=g)}
    batch = dict(scores=scores, response_mask=torch.ones(12, 3, dtype=torch.bool))
    args = dataclasses.replace(Args(), num_generations=4, reward_weights=[1.0, 0.5],
                               reward_aggregation="normalize-then-sum")
    grpo_llm.compute_advantages(batch, args)
    expected = []
    for i in range(12):
        total = 0.0
        for weight, r in zip([1.0, 0.5], scores.values()):
            group = r[i // 4 * 4 : i // 4 * 4 + 4].tolist()
            total += weight * (r[i].item() - statistics.mean(group)) / (statistics.stdev(group) + 1e-4)
        expected.append(total)
    assert batch["advantages"].tolist() == pytest.approx(expected, abs=1e-4)
    summed = dict(batch, scores=dict(scores))
    grpo_llm.compute_advantages(summed, dataclasses.replace(args, reward_aggregation="sum-then-normalize"))
    assert not torch.allclose(summed["advantages"], batch["advantages"], atol=1e-2)
    one = dict(scores={"a": scores["a"]}, response_mask=batch["response_mask"])
    two = dict(one)
    grpo_llm.compute_advantages(one, dataclasses.replace(args, reward_weights=[1.0]))
    grpo_llm.compute_advantages(two, dataclasses.replace(args, reward_weights=[1.0], reward_aggregation="sum-then-normalize"))
    torch.testing.assert_close(one["advantages"], two["advantages"])


def test_seq_mean_token_sum_averages_each_responses_token_sum_over_the_responses():
    # LUSPO: L = (1 / #responses with loss tokens) * sum_i sum_t l_it
    b = ragged_batch(7)
    tokens = b.logprobs * b.advantages.unsqueeze(1)
    loss, gradient = loss_and_gradient(b, tokens, "seq-mean-token-sum")
    rows = [i for i in range(b.B) if b.mask[i].any()]
    expected = sum(b.logprobs[i, t].item() * b.advantages[i].item() for i, t in real_tokens(b)) / len(rows)
    assert loss == pytest.approx(expected, abs=1e-12)
    expected_gradient = torch.zeros(b.B, b.T, dtype=torch.float64)
    for i, t in real_tokens(b):
        expected_gradient[i, t] = b.advantages[i].item() / len(rows)
    torch.testing.assert_close(gradient, expected_gradient, atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed, eps_high, delta", [(2, 0.2, 3.0), (3, 0.28, 1.5), (4, 0.2, 1.21)])
def test_dual_clip_equals_intellect_2s_two_sided_clipping_on_random_batches(seed, eps_high, delta):
    # INTELLECT-2: loss_t = -min(min(w, delta) * A, clip(w, 1-eps, 1+eps_high) * A), per token; its gradient with
    # respect to log pi is -A*w when the chosen branch still depends on w, else 0.
    g = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(400, generator=g, dtype=torch.float64)  # ratios from 0.05 to 20
    advantages = torch.randn(400, generator=g, dtype=torch.float64)
    log_ratio.requires_grad_()
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


@pytest.mark.parametrize("quantile", [0.2, 0.1, 1 / 3, 0.5, 1.0])
def test_top_entropy_threshold_keeps_the_top_quantile_of_real_tokens_by_entropy(quantile):
    b = ragged_batch(5, B=8, T=9)
    entropy = torch.rand(b.B, b.T, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    entropy[~b.mask] = 100.0  # padding: the caller passes real tokens only
    threshold = top_entropy_threshold(entropy[b.mask], quantile)
    selected = b.mask & (entropy >= threshold)  # as compute_advantages selects
    values = sorted((entropy[i, t].item() for i, t in real_tokens(b)), reverse=True)
    k = math.ceil(Fraction(quantile).limit_denominator(1000) * len(values))
    assert threshold == values[k - 1]
    expected = [[bool(b.mask[i, t]) and entropy[i, t].item() >= values[k - 1] for t in range(b.T)] for i in range(b.B)]
    assert selected.tolist() == expected
    assert int(selected.sum()) == k  # continuous entropies: no ties at the threshold


def test_top_entropy_selection_keeps_every_token_tied_with_the_last_selected_one():
    entropy = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.5])
    assert (entropy >= top_entropy_threshold(entropy, 0.4)).tolist() == [True, True, True, True, False]


def test_off_policy_mask_drops_exactly_the_negative_sequences_the_policy_moved_far_from():
    # DeepSeek-V3.2 eq. 9: M_i = 0 iff A_i < 0 and (1/|y_i|) sum_t log(pi_old / pi_theta) > delta.
    b = ragged_batch(7, B=12)
    b.advantages[3] = -0.5  # a negative row whose KL is measured over its real tokens only
    kls = [sum(b.old[i, t].item() - b.logprobs[i, t].item() for t in range(b.T) if b.mask[i, t]) / max(1, int(b.mask[i].sum()))
           for i in range(b.B)]
    delta = statistics.median(kls)
    kept = off_policy_sequence_mask(b.logprobs, b.old, b.advantages, b.mask, delta)
    expected = [not (b.advantages[i].item() < 0 and kls[i] > delta) for i in range(b.B)]
    assert kept.tolist() == expected
    assert False in expected and any(expected[i] and b.advantages[i] < 0 for i in range(b.B))  # both cases occur


def test_importance_weighted_kl_and_its_gradient_equal_a_per_token_loop():
    # D_t = w_t * k3_t with w_t = exp(lp - old) not detached and k3 = exp(ref - lp) - (ref - lp) - 1:
    # dD/dlp = w*k3 + w*(1 - exp(ref - lp)).
    b = ragged_batch(8)
    tokens = importance_weighted_kl(kl_penalty(b.logprobs, b.ref, "k3"), b.logprobs, b.old)
    loss, gradient = loss_and_gradient(b, tokens, "token-mean")
    n = len(real_tokens(b))
    expected_loss, expected_gradient = 0.0, torch.zeros(b.B, b.T, dtype=torch.float64)
    for i, t in real_tokens(b):
        lp, old, ref = b.logprobs[i, t].item(), b.old[i, t].item(), b.ref[i, t].item()
        w, k3 = math.exp(lp - old), math.exp(ref - lp) - (ref - lp) - 1
        expected_loss += w * k3 / n
        expected_gradient[i, t] = (w * k3 + w * (1 - math.exp(ref - lp))) / n
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    torch.testing.assert_close(gradient, expected_gradient, atol=1e-6, rtol=0)


def test_importance_weighted_k3_has_the_exact_reverse_kl_gradient_in_expectation_and_plain_k3_has_not():
    # On one categorical distribution, the expected gradient over tokens sampled on-policy is exact: sum_a pi(a) * grad
    # of the per-token term. DeepSeek-V3.2's weighted k3 gives grad KL(pi || ref); plain k3 gives grad KL(ref || pi).
    g = torch.Generator().manual_seed(9)
    theta = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), 0)

    def expected_gradient(weighted):
        logprobs = torch.log_softmax(theta, 0)
        per_token = kl_penalty(logprobs, ref, "k3")
        if weighted:
            per_token = importance_weighted_kl(per_token, logprobs, logprobs.detach())
        (gradient,) = torch.autograd.grad((logprobs.exp().detach() * per_token).sum(), theta)
        return gradient

    def exact(kl):
        (gradient,) = torch.autograd.grad(kl(torch.log_softmax(theta, 0)), theta)
        return gradient

    reverse = exact(lambda lp: (lp.exp() * (lp - ref)).sum())  # KL(pi_theta || pi_ref)
    forward = exact(lambda lp: (ref.exp() * (ref - lp)).sum())  # KL(pi_ref || pi_theta)
    torch.testing.assert_close(expected_gradient(weighted=True), reverse, atol=1e-12, rtol=0)
    torch.testing.assert_close(expected_gradient(weighted=False), forward, atol=1e-12, rtol=0)
    assert (reverse - forward).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------------------
# DAPO's data side: dynamic sampling and the soft overlong penalty
# ---------------------------------------------------------------------------------------------------------


def test_zero_std_groups_are_exactly_the_groups_with_all_rewards_equal():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 0.0, 0.0, 1e-3])
    assert zero_std_groups(rewards, 3).tolist() == [True, False, True, False]


ONE_HUGE_PER_GROUP = """
def one_huge_per_group(prompts, completions, **_):
    return [3e38 if i % 4 == 0 else 0.0 for i in range(len(completions))]
"""


def test_scores_near_float32s_largest_give_finite_statistics(tiny, tmp_path):
    # Two scores of 3e38 sum past float32's largest (3.4e38): the batch's statistics are taken in float64.
    (tmp_path / "huge.py").write_text(ONE_HUGE_PER_GROUP)
    succeeded(run_main(tiny, tmp_path / "out", "--reward-fn", f"{tmp_path / 'huge.py'}:one_huge_per_group",
                       "--num-iterations", 1, "--eval-every", 0))
    metrics = read_metrics(tmp_path / "out")[1]
    assert metrics["rewards/one_huge_per_group/mean"] == pytest.approx(3e38 / 4, rel=1e-6)
    assert "Infinity" not in (tmp_path / "out" / "metrics.jsonl").read_text()


def test_a_batch_of_one_response_logs_a_std_of_0_and_no_nan(tiny, tmp_path):
    # ReMax takes one response per prompt: with one prompt the batch holds one reward, whose sample std is undefined.
    succeeded(run_main(tiny, tmp_path, "--preset", "remax", "--num-prompts", 1, "--num-generations", 1,
                       "--num-iterations", 1, "--eval-every", 0))
    metrics = read_metrics(tmp_path)[1]
    assert (metrics["rewards/exact_match/std"], metrics["objective/advantage_std"]) == (0.0, 0.0)
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()


def test_select_groups_keeps_the_rows_of_the_kept_groups_in_order():
    P, G, T = 4, 3, 2
    keep = torch.tensor([False, True, False, True])
    kept_rows = [3, 4, 5, 9, 10, 11]  # groups 1 and 3 of 3 rows each
    batch = dict(
        query_responses=torch.arange(P * G)[:, None].repeat(1, 5),
        attention_mask=torch.ones(P * G, 5, dtype=torch.long),
        responses=torch.arange(P * G)[:, None].repeat(1, T) + 100,
        response_mask=(torch.arange(P * G) % 2 == 0)[:, None].repeat(1, T),
        has_eos=torch.arange(P * G) % 3 == 0,
        scores={"a": torch.arange(P * G).float(), "b": -torch.arange(P * G).float()},
        rows=[{"prompt": f"p{i // G}", "i": i} for i in range(P * G)],
        greedy_rewards=torch.tensor([10.0, 11.0, 12.0, 13.0]),
        context_length=3,
    )
    out = select_groups(batch, keep, G)
    assert out["query_responses"][:, 0].tolist() == kept_rows
    assert out["responses"][:, 0].tolist() == [100 + i for i in kept_rows]
    assert out["response_mask"][:, 0].tolist() == [i % 2 == 0 for i in kept_rows]
    assert out["has_eos"].tolist() == [i % 3 == 0 for i in kept_rows]
    assert out["scores"]["a"].tolist() == [float(i) for i in kept_rows]
    assert out["scores"]["b"].tolist() == [-float(i) for i in kept_rows]
    assert [row["i"] for row in out["rows"]] == kept_rows
    assert out["greedy_rewards"].tolist() == [11.0, 13.0]  # one per kept group
    assert out["context_length"] == 3


def test_overlong_penalty_is_zero_until_the_buffer_then_falls_linearly_to_minus_penalty():
    # L_max = 10, L_cache = 4: 0 for L <= 6, then (6 - L) / 4 * penalty
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10])
    expected = [0.0, 0.0, 0.0, -0.5, -1.0, -1.5, -2.0]
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, 2.0), torch.tensor(expected))


def test_overlong_buffer_zero_means_no_penalty():
    assert overlong_penalty(torch.tensor([0, 5, 10]), 10, 0, 1.0).tolist() == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------------------
# Rollout bookkeeping: masks after EOS, merging sampling rounds of different widths
# ---------------------------------------------------------------------------------------------------------


def test_response_mask_covers_tokens_up_to_and_including_the_first_eos():
    responses = torch.tensor([[5, EOS, 6, EOS], [5, 6, 7, 8], [EOS, EOS, EOS, EOS]])
    mask, has_eos = response_mask_from_eos(responses, [EOS])
    assert mask.tolist() == [[True, True, False, False], [True, True, True, True], [True, False, False, False]]
    assert has_eos.tolist() == [True, False, True]


def rollout(prompts, responses, response_masks, has_eos, scores):
    """A rollout shaped like generate()'s: prompts left-padded to their widest, responses right-padded."""
    context = max(len(p) for p in prompts)
    query_responses = [[PAD] * (context - len(p)) + p + r for p, r in zip(prompts, responses)]
    attention_mask = [[0] * (context - len(p)) + [1] * len(p) + m for p, m in zip(prompts, response_masks)]
    return dict(
        query_responses=torch.tensor(query_responses),
        attention_mask=torch.tensor(attention_mask),
        context_length=context,
        responses=torch.tensor(responses),
        response_mask=torch.tensor(response_masks, dtype=torch.bool),
        has_eos=torch.tensor(has_eos),
        scores={"r": torch.tensor(scores)},
        rows=[{"prompt": str(p)} for p in prompts],
    )


def test_merge_rounds_repads_prompts_on_the_left_and_responses_on_the_right():
    first = rollout(prompts=[[7, 8], [9, 10, 11]], responses=[[3, EOS], [4, 5]], response_masks=[[1, 1], [1, 1]],
                    has_eos=[True, False], scores=[0.5, 1.5])
    second = rollout(prompts=[[2, 3, 4, 5, 6]], responses=[[7, EOS, PAD, PAD]], response_masks=[[1, 1, 0, 0]],
                     has_eos=[True], scores=[2.5])
    merged = merge_rounds([first, second], PAD)
    assert merged["context_length"] == 5
    assert merged["query_responses"].tolist() == [
        [PAD, PAD, PAD, 7, 8, 3, EOS, PAD, PAD],
        [PAD, PAD, 9, 10, 11, 4, 5, PAD, PAD],
        [2, 3, 4, 5, 6, 7, EOS, PAD, PAD],
    ]
    assert merged["attention_mask"].tolist() == [
        [0, 0, 0, 1, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 0, 0],
    ]
    assert merged["responses"].tolist() == [[3, EOS, PAD, PAD], [4, 5, PAD, PAD], [7, EOS, PAD, PAD]]
    assert merged["response_mask"].tolist() == [[True, True, False, False], [True, True, False, False],
                                                [True, True, False, False]]
    assert merged["has_eos"].tolist() == [True, False, True]
    assert merged["scores"]["r"].tolist() == [0.5, 1.5, 2.5]
    assert [row["prompt"] for row in merged["rows"]] == ["[7, 8]", "[9, 10, 11]", "[2, 3, 4, 5, 6]"]


# ---------------------------------------------------------------------------------------------------------
# The training doctor: its instability signals on synthetic metric histories
# ---------------------------------------------------------------------------------------------------------


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


def with_eval(rows, evals):
    for iteration, value in evals.items():
        rows[iteration - 1]["eval/reward"] = value
    return rows


W = grpo_llm.DOCTOR_WINDOW
# signal: (history that shows it, words the warning must hold: the value, the threshold, the first knob)
DOCTOR_SIGNALS = {
    "kl_high": (lambda h: with_last(h, W, objective__kl=2.0), ["0.500 per token > 0.3", "--kl-coef"]),
    "reward_collapse": (lambda h: with_last(h, W, objective__reward=-0.1), ["fell to -0.100 <= 0", "--resume-from"]),
    "clipfrac_high": (lambda h: with_last(h, W, policy__clipfrac=0.3), ["clip fraction 0.300 > 0.2", "--clip-eps"]),
    "entropy_collapse": (lambda h: with_last(h, W, policy__entropy=0.001), ["0.0010 < 0.01", "--ent-coef"]),
    "grad_norm_high": (lambda h: with_last(h, W, grad__policy_norm=8.0), ["8.00 > 5.0", "--learning-rate"]),
    "length_collapse": (lambda h: with_last(h, W, rollout__response_length=1.0), ["1.00 tokens <= 1.5", "--kl-coef"]),
    "length_pinned": (lambda h: with_last(h, W, rollout__response_length=16.0),
                      ["16.0 >= 0.95 x --max-new-tokens 16", "--overlong-buffer-length"]),
    "eos_rate_falling": (lambda h: with_last(h, W, rollout__truncated_fraction=0.5),
                         ["EOS rate 0.50 < 1.00", "--mask-truncated"]),
    "zero_std_groups": (lambda h: with_last(h, W, rollout__zero_std_fraction=0.98), ["0.98 of groups", "--dynamic-sampling"]),
    "reward_hacking": (lambda h: with_eval(h, {5: 0.6, 10: 0.8, 20: 0.6}),
                       ["eval/reward 0.600 < its best 0.800", "training reward rose", "--kl-coef"]),
}


def test_the_doctor_is_silent_on_a_healthy_history():
    assert grpo_llm.doctor_findings(healthy_history(), Args()) == {}


@pytest.mark.parametrize("signal", list(DOCTOR_SIGNALS))
def test_the_doctor_names_each_signal_its_value_threshold_and_knob(signal):
    shows, words = DOCTOR_SIGNALS[signal]
    found = grpo_llm.doctor_findings(shows(healthy_history()), Args())
    assert list(found) == [signal]
    assert [word for word in words if word not in found[signal]] == [], found[signal]


@pytest.mark.parametrize("signal", [s for s in DOCTOR_SIGNALS if s != "reward_hacking"])
def test_one_noisy_iteration_does_not_trigger_the_doctor(signal):
    shows, _ = DOCTOR_SIGNALS[signal]
    noisy = healthy_history()
    noisy[-1] = shows(healthy_history())[-1]  # only the newest row shows the signal
    assert grpo_llm.doctor_findings(noisy, Args()) == {}


def test_the_doctor_leaves_gspos_designed_clipping_alone():
    # GSPO clips whole responses in a tiny range by design; the clip-fraction signal is for token-level clipping
    history = with_last(healthy_history(), W, policy__clipfrac=0.3)
    assert grpo_llm.doctor_findings(history, grpo_llm.preset_defaults("gspo")) == {}


def test_the_doctor_sees_reward_hacking_when_the_best_eval_was_the_one_before_training():
    history = [{"iteration": 0, "eval/reward": 0.9}] + with_eval(healthy_history(), {10: 0.7, 20: 0.5})
    found = grpo_llm.doctor_findings(history, Args())
    assert list(found) == ["reward_hacking"] and "eval/reward 0.500 < its best 0.900" in found["reward_hacking"]


def test_the_doctor_leaves_remaxs_equal_groups_alone():
    # ReMax's baseline is the greedy response's reward: a group of equal sampled rewards still has advantages
    history = with_last(healthy_history(), W, rollout__zero_std_fraction=1.0)
    assert grpo_llm.doctor_findings(history, grpo_llm.preset_defaults("remax")) == {}


def test_a_resumed_runs_doctor_goes_on_counting_and_waiting_where_the_checkpointed_one_was(capsys):
    rows = with_last(healthy_history(25), 25, objective__kl=2.0)
    rows[W - 1]["doctor/kl_high"] = 1  # the run before the checkpoint warned at the first full window
    doctor = grpo_llm.Doctor(Args(), rows[:W])
    counts = {row["iteration"]: doctor.check(row) for row in rows[W:]}
    assert {i: c for i, c in counts.items() if c} == {W + grpo_llm.DOCTOR_REPEAT: {"doctor/kl_high": 2},
                                                     W + 2 * grpo_llm.DOCTOR_REPEAT: {"doctor/kl_high": 3}}


def test_the_doctor_warns_once_per_repeat_interval_and_counts_into_the_metrics(capsys):
    doctor = grpo_llm.Doctor(Args(), [])
    rows = with_last(healthy_history(25), 25, objective__kl=2.0)  # high from the first iteration on
    counts = {row["iteration"]: doctor.check(row) for row in rows}
    warned = {iteration: c for iteration, c in counts.items() if c}
    first = W  # the first full window
    assert warned == {first: {"doctor/kl_high": 1}, first + grpo_llm.DOCTOR_REPEAT: {"doctor/kl_high": 2},
                      first + 2 * grpo_llm.DOCTOR_REPEAT: {"doctor/kl_high": 3}}
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line.startswith("doctor [kl_high] KL to the reference") for line in lines)


def test_doctor_off_prints_and_counts_nothing(capsys):
    doctor = grpo_llm.Doctor(Args(doctor="off"), [])
    assert [doctor.check(row) for row in with_last(healthy_history(), 20, objective__kl=2.0)] == [{}] * 20
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------------------------------------------------
# Presets and the command line
# ---------------------------------------------------------------------------------------------------------


def test_dapo_preset_gives_dapos_published_knobs():
    args = parse_args(["--preset", "dapo", "--max-new-tokens", "20"])
    assert (args.clip_eps, args.clip_eps_high) == (0.2, 0.28)
    assert args.dynamic_sampling is True
    assert args.loss_aggregation == "token-mean"
    assert args.kl_coef == 0.0
    assert args.overlong_buffer_length is None  # a fifth of --max-new-tokens, once check_args has found that valid
    check_args(args)
    assert grpo_llm.derived_args(args).overlong_buffer_length == 20 // 5


def test_an_explicit_flag_overrides_its_preset_and_leaves_the_other_knobs():
    args = parse_args(["--preset", "dapo", "--clip-eps-high", "0.3"])
    assert args.clip_eps_high == 0.3
    assert (args.dynamic_sampling, args.loss_aggregation, args.kl_coef) == (True, "token-mean", 0.0)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_sets_its_knobs(preset):
    args = parse_args(["--preset", preset])
    assert {knob: getattr(args, knob) for knob in PRESETS[preset]} == PRESETS[preset]


def help_block(text, flag):
    """The help entry of one flag, joined into one line (tyro wraps and boxes it)."""
    lines = [line.strip("│ ") for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith(flag + " "))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("--"))
    return " ".join(lines[start:end])


@pytest.mark.parametrize("preset, flag, shown", [
    ("dapo", "--clip-eps-high", "(default: 0.28)"), ("grpo", "--clip-eps-high", "(default: None)"),
    ("cispo", "--clip-eps-high", "(default: 4.0)"), ("cispo", "--policy-loss", "(default: cispo)"),
    ("sapo", "--policy-loss", "(default: sapo)"), ("sapo", "--sapo-temperature-neg", "(default: 1.05)"),
])
def test_help_shows_the_presets_resolved_defaults(preset, flag, shown, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--preset", preset, "--help"])
    assert shown in help_block(capsys.readouterr().out, flag)


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
        parse_args([*argv, "--help"])
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
    assert list(groups) == ["", *(name.replace("_", "-") for name in grpo_llm.SECTIONS)]
    for name, section in grpo_llm.SECTIONS.items():
        assert groups[name.replace("_", "-")] == ["--" + f.name.replace("_", "-") for f in dataclasses.fields(section)]


def test_every_flags_docstring_is_one_line_that_help_shows_whole(capsys):
    shown = " ".join(" ".join(line.strip("│ ").split()) for line in help_text([], capsys).splitlines())
    for section in grpo_llm.SECTIONS.values():
        for name, doc in docstrings(section).items():
            assert "\n" not in doc, name
            assert doc in shown, name


def test_help_names_no_model_this_script_does_not_have(capsys):
    assert "critic" not in help_text([], capsys).lower()


@pytest.mark.parametrize("preset", ["grpo", "dapo"])
def test_help_ends_with_every_presets_knobs_in_aligned_columns(preset, capsys):
    table = help_text(["--preset", preset], capsys).split("a flag given on the command line overrides")[1]
    shown = {}
    for block in table.strip().split("\n\n"):
        header, *rows = block.splitlines()
        starts = [m.start() for m in re.finditer(r"\S+", header)]  # a cell starts where its column's name does
        names = header.split()[1:]
        for row in rows:
            cells = [row[a:b].strip() for a, b in zip(starts, [*starts[1:], None])]
            for name, cell in zip(names, cells[1:]):
                shown.setdefault(name, {})[cells[0]] = cell
    knobs = dict.fromkeys(knob for values in PRESETS.values() for knob in values)
    flag = lambda knob: "--" + knob.replace("_", "-")  # noqa: E731
    assert shown == {name: {flag(knob): str(PRESETS[name].get(knob, "-")) for knob in knobs} for name in PRESETS}


# ---------------------------------------------------------------------------------------------------------
# End to end on the tiny models: `trained` runs the script as a subprocess, the others its main() in this process
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tiny):
    """Two GRPO iterations with exact match plus a reward that varies within groups, a checkpoint each iteration."""
    output_dir = tiny.root / "trained"
    flags = ("--reward-fn", "exact_match", tiny.digit_sum, "--save-every", "1")
    succeeded(run_script(tiny, output_dir, *flags))
    return SimpleNamespace(dir=output_dir, metrics=read_metrics(output_dir), flags=flags)


def test_training_changes_every_policy_tensor(tiny, trained):
    before, after = weights(tiny.policy), weights(trained.dir / "policy")
    assert before.keys() == after.keys()
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert unchanged == []


def test_metrics_log_one_row_per_iteration_with_the_standard_diagnostics(trained):
    assert sorted(trained.metrics) == [0, 1, 2]
    expected = {
        "rewards/exact_match/mean", "rewards/exact_match/std", "rollout/zero_std_fraction", "policy/clip_ratio_low",
        "policy/clip_ratio_high", "policy/clipfrac", "policy/ratio", "objective/kl", "losses/kl", "policy/entropy",
        "rollout/response_length", "rollout/truncated_fraction", "rollout/groups_sampled", "eval/reward",
    }
    for iteration in (1, 2):
        assert expected <= trained.metrics[iteration].keys(), expected - trained.metrics[iteration].keys()


@pytest.mark.parametrize("flags, phases", [
    ([], {"generate", "score", "reference"}),  # on-policy: the update's forward gives pi_old's KL to the reference
    (["--kl-coef", 0], {"generate", "score"}),
    (["--kl-in", "reward"], {"generate", "score", "old_logprobs", "reference"}),  # the reward needs pi_old's KL first
    (["--kl-coef", 0, "--num-minibatches", 2], {"generate", "score", "old_logprobs"}),  # off-policy: ratios need pi_old
    (["--kl-coef", 0, "--top-entropy-quantile", 0.5], {"generate", "score", "old_logprobs"}),  # entropies need the pass
])
def test_each_phase_is_timed_and_a_pass_the_update_does_not_need_is_skipped(tiny, tmp_path, flags, phases):
    succeeded(run_main(tiny, tmp_path, "--eval-every", 0, *flags))
    for row in read_metrics(tmp_path).values():
        timed = {key.removeprefix("time/") for key in row if key.startswith("time/")} - {"rollout", "update", "iteration"}
        assert timed == phases
        assert sum(row[f"time/{name}"] for name in phases) + row["time/update"] <= row["time/iteration"]


def test_metrics_log_the_eval_before_the_first_update_as_iteration_zero(trained):
    assert "eval/reward" in trained.metrics[0] and "policy/ratio" not in trained.metrics[0]


def test_rollout_kl_is_zero_before_the_first_update_and_positive_after_it(trained):
    # Iteration 1 samples from the initial policy, which is the reference; iteration 2 from the updated policy.
    assert trained.metrics[1]["objective/kl"] == 0.0
    assert trained.metrics[2]["objective/kl"] > 0.0


def test_resumed_run_continues_exactly_where_the_checkpoint_left_off(tiny, trained):
    output_dir = tiny.root / "resumed"
    succeeded(run_main(tiny, output_dir, *trained.flags, "--resume-from", trained.dir / "checkpoint-1"))
    resumed = read_metrics(output_dir)
    assert sorted(resumed) == [2]
    assert non_timing(resumed[2]) == non_timing(trained.metrics[2])
    after, expected = weights(output_dir / "policy"), weights(trained.dir / "policy")
    assert all(torch.equal(after[name], expected[name]) for name in expected)


def test_learning_rate_by_size_keeps_the_demo_rate_and_falls_into_the_seeds_range_for_real_models():
    """Without --learning-rate the demo model keeps the rate its README figures were measured with; 0.5B-7B policies
    get the common 1e-6 to 5e-6; larger models never get a larger rate."""
    demo = LlamaForCausalLM.from_pretrained(REPO / "demo" / "model")
    assert default_learning_rate(sum(p.numel() for p in demo.parameters())) == 5e-4
    sizes = [2e5, 9e6, 135e6, 0.5e9, 1.5e9, 3e9, 7e9, 70e9]
    rates = [default_learning_rate(int(n)) for n in sizes]
    assert all(1e-6 <= rate <= 5e-6 for n, rate in zip(sizes, rates) if 0.5e9 <= n <= 7e9)
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def test_with_learning_rate_zero_the_recomputed_ratio_is_one_and_nothing_is_clipped(tiny):
    # Two epochs, so pi_old is really recomputed in a separate forward pass before the update.
    output_dir = tiny.root / "lr0"
    succeeded(run_main(tiny, output_dir, "--reward-fn", tiny.digit_sum, "--learning-rate", "0", "--num-epochs", "2"))
    metrics = read_metrics(output_dir)
    for iteration in (1, 2):
        assert metrics[iteration]["policy/ratio"] == pytest.approx(1.0, abs=1e-5)
        assert metrics[iteration]["policy/approx_kl"] < 1e-8  # a mean ratio of 1 could hide ratios on both sides of 1
        assert metrics[iteration]["policy/clipfrac"] == 0.0


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_trains_end_to_end(tiny, preset):
    # has_one leaves about a third of the groups flat, so DAPO's dynamic sampling really resamples and merges rounds.
    output_dir = tiny.root / f"preset-{preset}"
    result = succeeded(run_main(tiny, output_dir, "--preset", preset, "--reward-fn", tiny.has_one))
    assert result.stdout.startswith(f"preset {preset}:")
    metrics = read_metrics(output_dir)
    assert sorted(metrics) == [0, 1, 2]
    assert all(math.isfinite(metrics[i]["losses/policy_loss"]) for i in (1, 2))
    assert ("policy/clipfrac" in metrics[2]) == (preset not in ("sapo", "vespo"))  # their weights clip nothing


def test_the_new_token_and_sequence_knobs_train_together_end_to_end(tiny):
    # CISPO with the high-entropy tokens, off-policy masking and the importance-corrected KL at once; 2 minibatches.
    output_dir = tiny.root / "every-new-knob"
    succeeded(run_main(tiny, output_dir, "--preset", "cispo", "--num-minibatches", "2", "--reward-fn", tiny.digit_sum,
                       "--top-entropy-quantile", "0.3", "--off-policy-mask-threshold", "0.01", "--kl-coef", "0.05",
                       "--kl-importance-correction"))
    metrics = read_metrics(output_dir)
    for iteration in (1, 2):
        m = metrics[iteration]
        assert all(math.isfinite(m[key]) for key in ("losses/policy_loss", "losses/kl"))
        assert m["rollout/top_entropy_fraction"] < 0.6  # ceil(0.3 N) tokens, plus any tied with the last one
        assert "policy/off_policy_masked_fraction" in m and m["rollout/top_entropy_threshold"] > 0


def test_reward_model_alone_is_the_reward(tiny):
    output_dir = tiny.root / "rm-alone"
    succeeded(run_main(tiny, output_dir, "--reward-model-path", tiny.rm))
    metrics = read_metrics(output_dir)
    for iteration in (1, 2):
        m = metrics[iteration]
        assert "rewards/exact_match/mean" not in m and m["rewards/reward_model/mean"] != 0.0
        assert m["objective/reward"] == pytest.approx(m["rewards/reward_model/mean"], abs=1e-6)


def test_reward_weights_apply_to_the_reward_functions_then_the_reward_model(tiny):
    output_dir = tiny.root / "rm-combined"
    succeeded(run_main(tiny, output_dir, "--reward-fn", "exact_match", "--reward-model-path", tiny.rm,
                       "--reward-weights", "1", "0.5"))
    metrics = read_metrics(output_dir)
    for iteration in (1, 2):
        m = metrics[iteration]
        assert m["rewards/reward_model/mean"] != 0.0
        expected = 1.0 * m["rewards/exact_match/mean"] + 0.5 * m["rewards/reward_model/mean"]
        assert m["objective/reward"] == pytest.approx(expected, abs=1e-6)


def test_a_run_says_where_its_output_goes_explains_its_columns_once_and_ends_with_a_summary(tiny, tmp_path):
    output_dir = tmp_path / "out"
    lines = succeeded(run_main(tiny, output_dir, "--save-every", "1")).stdout.splitlines()
    assert f"output: {output_dir}/ gets metrics.jsonl (every iteration), checkpoint-N (every 1 iterations), policy/ (at the end)" in lines
    legend = grpo_llm.LEGEND.splitlines()
    before = next(i for i, line in enumerate(lines) if re.fullmatch(r"iter    0 \| eval \d\.\d{3} \(before training\)", line))
    assert [i for i, line in enumerate(lines) if line == legend[0]] == [before + 1]
    for column in re.findall(r"\| (\w+) ", lines[-2]):  # every column of an iteration's line is explained
        assert re.search(rf"(columns:| ) {column} ", grpo_llm.LEGEND), column
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
    source = grpo_llm.PromptFile("--prompts-path", "p.jsonl", [{"prompt": t} for t in texts], list(range(1, 601)))
    assert len(grpo_llm.encode(char_tokenizer(), texts, source, False)) == 600
    shown = sys.stdout.getvalue()
    assert "tokenizing --prompts-path: 256 of 600 texts" in shown and "512 of 600" in shown
    assert shown.endswith("\r\033[K\r")  # cleared before the next line
    models = SimpleNamespace(tokenizer=char_tokenizer(), reward_model=None, device=torch.device("cpu"))
    batch = dict(responses=torch.tensor([[4, EOS], [4, EOS]]))
    rows = [{"prompt": "1+1=", "answer": "2"}] * 2
    grpo_llm.score_responses(models, [("exact_match", grpo_llm.exact_match_reward)], batch, rows, grpo_llm.Args())
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
        grpo_llm.progress("updating: minibatch 1/4")
        assert stream.getvalue() == expected


# ---------------------------------------------------------------------------------------------------------
# Prompts beyond JSONL: parquet, CSV, JSON files and Hugging Face datasets (through the datasets package)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def question_files(tiny):
    """tiny's training prompts with the prompt under 'question' (as in gsm8k), as parquet, CSV and a dataset directory
    whose 'test' split holds the eval prompts."""
    datasets = pytest.importorskip("datasets")
    as_questions = lambda path: datasets.Dataset.from_list(  # noqa: E731
        [{"question": row["prompt"], "answer": row["answer"], "source": path.stem} for row in map(json.loads, path.read_text().splitlines())])
    files = SimpleNamespace(parquet=tiny.root / "questions.parquet", csv=tiny.root / "questions.csv",
                            eval_csv=tiny.root / "eval_questions.csv", dataset=tiny.root / "question_dataset")
    as_questions(tiny.train).to_parquet(files.parquet)
    as_questions(tiny.train).to_csv(files.csv, index=False)
    as_questions(tiny.eval).to_csv(files.eval_csv, index=False)
    (files.dataset / "data").mkdir(parents=True)
    as_questions(tiny.train).to_parquet(files.dataset / "data" / "train-00000-of-00001.parquet")
    as_questions(tiny.eval).to_parquet(files.dataset / "data" / "test-00000-of-00001.parquet")
    return files


@pytest.mark.parametrize("form", ["parquet", "csv"])
def test_parquet_and_csv_rows_read_as_the_jsonl_rows_they_were_written_from(tiny, question_files, form):
    path = getattr(question_files, form)
    prompts = load_prompts(str(path), "--prompts-path", prompt_field="question")
    expected = [json.loads(line) for line in tiny.train.read_text().splitlines()]
    assert [(row["prompt"], row["answer"], row["source"]) for row in prompts.rows] == \
        [(row["prompt"], row["answer"], "train") for row in expected]
    assert prompts.where(1) == f"--prompts-path {path}, row 2"


def test_csv_cells_are_read_as_the_text_they_hold(tmp_path):
    pytest.importorskip("datasets")
    path = tmp_path / "answers.csv"
    path.write_text("question,answer\n1+1=,2\n2+2=,\n3+4=,007\n")  # an empty cell would make a number column float
    assert [row["answer"] for row in load_prompts(str(path), "--prompts-path", prompt_field="question").rows] == ["2", "", "007"]


def test_a_json_file_holding_an_array_of_rows_is_read(tmp_path):
    pytest.importorskip("datasets")
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]))
    assert load_prompts(str(path), "--prompts-path").rows == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


def test_a_dataset_directory_gives_the_split_asked_for(tiny, question_files):
    prompts = load_prompts(str(question_files.dataset), "--eval-prompts-path", prompt_field="question", split="test")
    assert [row["prompt"] for row in prompts.rows] == [json.loads(line)["prompt"] for line in tiny.eval.read_text().splitlines()]


def test_a_parquet_file_and_a_csv_file_with_question_fields_train_as_their_jsonl_does(tiny, tmp_path, question_files):
    from_jsonl = succeeded(run_main(tiny, tmp_path / "jsonl", "--reward-fn", tiny.digit_sum))
    from_files = succeeded(run_main(tiny, tmp_path / "files", "--reward-fn", tiny.digit_sum, "--prompt-field", "question",
                                    "--prompts-path", question_files.parquet, "--eval-prompts-path", question_files.eval_csv))
    assert from_jsonl.returncode == from_files.returncode == 0
    expected, metrics = read_metrics(tmp_path / "jsonl"), read_metrics(tmp_path / "files")
    assert sorted(metrics) == [0, 1, 2] and {i: non_timing(m) for i, m in metrics.items()} == \
        {i: non_timing(m) for i, m in expected.items()}


def test_without_the_datasets_package_a_csv_file_stops_with_one_line_saying_to_install_it(tiny, tmp_path):
    path = tmp_path / "questions.csv"
    path.write_text("question,answer\n1+1=,2\n")
    with mock.patch.dict(sys.modules, {"datasets": None}):  # what `import datasets` meets where it is not installed
        line = single_error_line(run_main(tiny, tmp_path / "out", "--prompts-path", path, "--prompt-field", "question"))
    assert line == f"error: --prompts-path {path}: reading it needs the datasets package: pip install datasets"


def test_a_hub_dataset_that_cannot_be_reached_offline_is_one_error_line(tiny, tmp_path):
    pytest.importorskip("datasets")
    result = run_script(tiny, tmp_path / "out", "--prompts-path", "no-such-org/no-such-dataset", "--dataset-config", "main")
    line = single_error_line(result)
    assert line.startswith("error: --prompts-path no-such-org/no-such-dataset: cannot be read as a dataset (")


# ---------------------------------------------------------------------------------------------------------
# plot_metrics.py: the dashboard of one or several runs
# ---------------------------------------------------------------------------------------------------------


def write_metrics(path: Path, rows: list[dict], tail: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + tail)
    return path


GRPO_ROWS = [
    {"iteration": 0, "eval/reward": 0.4, "time/eval": 0.3},
    {"iteration": 1, "objective/reward": 0.5, "objective/kl": 0.0, "rollout/truncated_fraction": 0.25,
     "rollout/response_length": 4.0, "time/rollout": 0.2, "time/update": 0.6, "time/iteration": 0.8},
    {"iteration": 2, "objective/reward": 0.6, "objective/kl": 0.1, "doctor/kl_high": 1, "time/generate": 0.1},
    {"iteration": 3, "objective/reward": 0.2, "doctor/kl_high": 2, "doctor/reward_collapse": 1},
]


def test_doctor_marks_are_the_warnings_written_into_the_file(tmp_path):
    rows = plot_metrics.read(write_metrics(tmp_path / "grpo" / "metrics.jsonl", GRPO_ROWS))
    assert plot_metrics.doctor_marks(rows) == [(2, "kl_high"), (3, "kl_high"), (3, "reward_collapse")]
    assert plot_metrics.doctor_summary(rows) == "kl_high @ 2, 3  ·  reward_collapse @ 3"
    assert plot_metrics.doctor_marks(rows[:2]) == [] and plot_metrics.doctor_summary(rows[:2]) == ""


def test_truncated_last_line_is_skipped(tmp_path):
    path = write_metrics(tmp_path / "metrics.jsonl", GRPO_ROWS, tail='{"iteration": 4, "objective/rew')
    assert [row["iteration"] for row in plot_metrics.read(path)] == [0, 1, 2, 3]


def test_grpo_eos_rate_is_one_minus_truncated_fraction(tmp_path):
    rows = plot_metrics.read(write_metrics(tmp_path / "metrics.jsonl", GRPO_ROWS))
    assert rows[1]["rollout/eos_rate"] == 0.75


def test_panels_no_run_logged_are_skipped():
    panels = dict(plot_metrics.pick_panels([GRPO_ROWS]))
    assert "critic" not in panels and "policy entropy" not in panels  # GRPO has no value loss; these rows no entropy
    assert [label for label, *_ in panels["reward"]] == ["train", "eval (greedy)"]
    assert [label for label, *_ in panels["KL to reference (per sequence)"]] == ["KL"]  # no β logged
    assert [label for label, *_ in panels["response length / EOS rate"]] == ["length"]  # EOS rate is derived by read()


def test_every_time_key_is_a_phase_and_iteration_comes_last():
    phases = dict(plot_metrics.pick_panels([GRPO_ROWS]))["seconds per phase"]
    assert [label for label, *_ in phases] == ["eval", "generate", "rollout", "update", "iteration"]


def test_runs_with_the_same_folder_name_are_told_apart():
    paths = [Path("a/ppo/metrics.jsonl"), Path("b/ppo/metrics.jsonl"), Path("b/grpo/metrics.jsonl")]
    assert plot_metrics.run_names(paths) == ["a/ppo", "b/ppo", "grpo"]


def test_dashboard_of_two_runs_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    ppo_rows = [{"iteration": i, "objective/scores": i / 4, "objective/kl_coef": 0.05, "losses/value_loss": 1 / (i + 1),
                 "val/explained_variance": 0.1 * i, "grad/critic_norm": 1.0, "rollout/eos_rate": 1.0} for i in range(1, 4)]
    ppo = write_metrics(tmp_path / "ppo" / "metrics.jsonl", ppo_rows, tail='{"itera')
    grpo = write_metrics(tmp_path / "grpo" / "metrics.jsonl", GRPO_ROWS)
    out = tmp_path / "dash.png"
    result = subprocess.run([sys.executable, plot_metrics.__file__, str(ppo), str(grpo), "--out", str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote {out}"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def demo_run(demo_runs):
    return demo_runs("grpo")


def test_the_demo_learns_and_the_doctor_finds_nothing_to_say(demo_run):
    assert demo_run.metrics[0]["eval/reward"] < 0.5 and demo_run.metrics[40]["eval/reward"] > 0.9
    assert [line for line in demo_run.stdout.splitlines() if line.startswith("doctor")] == []
    assert [key for row in demo_run.metrics.values() for key in row if key.startswith("doctor/")] == []


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
            {grpo_llm.DOCTOR_WINDOW: 1}
    else:
        assert [line for line in lines if line.startswith("doctor")] == []
        assert [key for row in logged.values() for key in row if key.startswith("doctor/")] == []



# ---------------------------------------------------------------------------------------------------------
# The sampler: our own loop with the KV cache (sample), its distribution (next_token_probs) and draw (sample_from)
# ---------------------------------------------------------------------------------------------------------


def test_the_sampler_draws_each_token_in_proportion_to_its_probability():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    n = 200_000
    torch.manual_seed(0)
    counts = torch.bincount(grpo_llm.sample_from(probs.expand(n, -1)), minlength=len(probs)).double()
    sigma = (n * probs * (1 - probs)).double().sqrt()
    assert counts[probs == 0].sum() == 0  # a token of probability 0 is never drawn
    assert ((counts - n * probs).abs() <= 5 * sigma).all(), counts / n


def test_top_k_and_top_p_keep_the_distribution_transformers_samples_from():
    from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3)) * 3
    for temperature, top_p, top_k in [(1.0, 1.0, 0), (0.7, 1.0, 5), (1.3, 0.8, 0), (0.7, 0.9, 10), (1.0, 0.3, 0)]:
        expected = logits.clone()
        for warper in (TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k) if top_k else None,
                       TopPLogitsWarper(top_p) if top_p < 1 else None):
            expected = warper(None, expected) if warper else expected
        ours = grpo_llm.next_token_probs(logits, temperature, top_p, top_k)
        torch.testing.assert_close(ours / ours.sum(-1, keepdim=True), expected.softmax(-1), atol=1e-6, rtol=0)


def test_min_p_keeps_the_distribution_transformers_samples_from():
    from transformers.generation import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(4)) * 3
    for temperature, top_p, top_k, min_p in [(1.0, 1.0, 0, 0.05), (0.7, 0.9, 10, 0.1), (1.3, 1.0, 0, 0.3)]:
        expected = logits.clone()
        for warper in (TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k) if top_k else None,
                       TopPLogitsWarper(top_p) if top_p < 1 else None, MinPLogitsWarper(min_p)):
            expected = warper(None, expected) if warper else expected
        ours = grpo_llm.next_token_probs(logits, temperature, top_p, top_k, min_p)
        torch.testing.assert_close(ours / ours.sum(-1, keepdim=True), expected.softmax(-1), atol=1e-6, rtol=0)
        without = grpo_llm.next_token_probs(logits, temperature, top_p, top_k)
        assert ((ours > 0).sum(-1) < (without > 0).sum(-1)).any()  # min-p cut tokens the other cuts left


def narrow_llama():
    """A Llama whose 15-token vocabulary outnumbers its hidden state (8): policy_forward hands ResponseLogprobs its
    final hidden states and head, where tiny_policy (hidden 32) gives the model's own logits."""
    config = llama_config()
    config.hidden_size, config.intermediate_size, config.head_dim = 8, 16, 2
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def fresh_llama(**config):
    """tiny_policy's shape, a model of the test's own to change: with a 64-token vocabulary, which outnumbers its
    hidden state (32), policy_forward hands ResponseLogprobs its final hidden states and head, where the 14 tokens of
    tiny_policy's give the model's own logits."""
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(**config))


def repeated_prompts():
    """Two prompts of different lengths (left-padded), three responses each, rows interleaved as a shuffled micro-batch
    would hold them; the second row's response ends early (padding after its EOS)."""
    prompts = torch.tensor([[PAD, PAD, 3, 12, 4, 13], [5, 6, 7, 12, 8, 13]])[[0, 1, 1, 0, 0, 1]]
    responses = torch.randint(2, 14, (6, 5), generator=torch.Generator().manual_seed(8))
    responses[1, 2:] = PAD
    sequences = torch.cat([prompts, responses], 1)
    mask = torch.cat([(prompts != PAD).long(), torch.ones_like(responses)], 1)
    mask[1, 8:] = 0
    return sequences, mask


@pytest.mark.parametrize("rows", [6, 5])  # three responses to each prompt; or a micro-batch that holds two of one's
@pytest.mark.parametrize("model_kind", ["head", "logits"])
def test_a_prompt_run_once_for_its_responses_gives_their_log_probs_and_gradients(model_kind, rows):
    # share_prompts runs each distinct prompt once, its responses attending to its KV cache indexed out to them
    # (prompt_cache). The log-probs, entropies and the gradients through them must be those of running every row whole.
    model = fresh_llama(vocab_size=64) if model_kind == "head" else fresh_llama()
    sequences, mask = (x[:rows] for x in repeated_prompts())
    real = mask[:, 6:].bool()  # what follows a row's EOS is masked in every loss: no side need compute it
    weights = torch.randn(rows, 5, generator=torch.Generator().manual_seed(9)) * real
    calls = []
    hook = model.model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape),
                                                 with_kwargs=True)
    results = []
    for share in (False, True):
        model.zero_grad()
        states, head = response_states(model, sequences, mask, 6, share_prompts=share)
        assert (head is None) == (model_kind == "logits")
        logprobs, entropy = grpo_llm.logprobs_and_entropy(states, head, sequences[:, 6:], 0.8, True)
        ((logprobs + 0.1 * entropy) * weights).sum().backward()
        results.append((logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    # Whole rows; then the 2 prompts once each, and every response but its last token.
    assert calls == [(rows, 11), (2, 6), (rows, 4)]
    (logprobs, entropy, grads), (shared_logprobs, shared_entropy, shared_grads) = results
    torch.testing.assert_close(shared_logprobs[real], logprobs[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(shared_entropy[real], entropy[real], atol=1e-5, rtol=0)
    for got, want in zip(shared_grads, grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # Where the logits come from the model (capped logits, torchrun) and outnumber its hidden state, joining the prompts'
    # to the responses' would copy them: whole rows then. fresh_llama()'s 14 logits are fewer than its 32 states.
    model.config.final_logit_softcapping = 30.0
    calls.clear()
    with torch.no_grad():
        assert response_states(model, sequences, mask, 6, share_prompts=True)[1] is None
    del model.config.final_logit_softcapping
    hook.remove()
    if model_kind == "head":
        assert calls == [(rows, 11)]
    else:
        assert len(calls) == 2


def test_the_transformers_internals_that_prompt_cache_indexes_are_still_there():
    # prompt_cache indexes a DynamicCache's layers out to the rows only where each layer is a DynamicLayer whose
    # batch_select_indices is DynamicLayer's own (keys and values, nothing more). Were an upgrade of transformers to
    # rename or move them, prompt sharing would go quietly off, or fail: this test names what changed.
    internals = transformers.cache_utils
    for name in ("DynamicLayer", "DYNAMIC_LAYER_TYPE_MAPPING"):
        assert hasattr(internals, name), f"transformers {transformers.__version__}: cache_utils.{name} is gone"
    assert callable(getattr(internals.DynamicLayer, "batch_select_indices", None)), (
        f"transformers {transformers.__version__}: DynamicLayer.batch_select_indices is gone; prompt_cache reads it")
    model = narrow_llama().eval()
    sequences, mask = repeated_prompts()
    with torch.no_grad():
        shared = grpo_llm.prompt_cache(model, grpo_llm.distinct_prompts(sequences[:, :6], mask[:, :6]), hidden=True)
    assert shared is not None, (f"transformers {transformers.__version__}: a Llama's cache is no longer a DynamicCache "
                                "of DynamicLayers with DynamicLayer.batch_select_indices; prompt sharing is off")
    assert all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in shared[1].layers), (
        "DynamicLayer no longer holds .keys and .values, which prompt_cache indexes")


def test_prompts_are_shared_only_where_one_repeats(monkeypatch):
    model = narrow_llama().eval()
    sequences, mask = repeated_prompts()
    with torch.no_grad():
        assert grpo_llm.distinct_prompts(sequences[:2, :6], mask[:2, :6]) is None  # two distinct
        prompts = grpo_llm.distinct_prompts(sequences[:, :6], mask[:, :6])
        last, cache = grpo_llm.prompt_cache(model, prompts, hidden=True)
        whole = model(input_ids=sequences[:, :6], attention_mask=mask[:, :6], use_cache=True, output_hidden_states=True,
                      position_ids=grpo_llm.position_ids_from(mask[:, :6]))
    # the same prompt padded differently is another prompt: its mask differs, and so do its positions
    assert cache.get_seq_length() == 6 and last.shape == (6, 1, 8)
    torch.testing.assert_close(last, whole.hidden_states[-1][:, -1:], atol=1e-6, rtol=0)
    for layer, full in zip(cache.layers, whole.cache.layers, strict=True):
        torch.testing.assert_close(layer.keys, full.keys, atol=1e-6, rtol=0)
        torch.testing.assert_close(layer.values, full.values, atol=1e-6, rtol=0)
    # A cache layer registered by a model's own code, holding per-row state beyond keys and values (an indexer's
    # keys) that it selects itself, is not indexed out either.
    class IndexerLayer(transformers.cache_utils.DynamicLayer):
        def batch_select_indices(self, indices):
            raise AssertionError("prompt_cache must not index a cache it does not know")

    monkeypatch.setitem(transformers.cache_utils.DYNAMIC_LAYER_TYPE_MAPPING, "full_attention", IndexerLayer)
    with torch.no_grad():
        assert grpo_llm.prompt_cache(model, prompts, hidden=True) is None
    monkeypatch.undo()
    model.config.layer_types = ["full_attention", "linear_attention"]  # a recurrent state is not a cache to index out
    with torch.no_grad():
        assert grpo_llm.prompt_cache(model, prompts, hidden=True) is None


@pytest.mark.parametrize("greedy", [False, True])
def test_the_sampler_reading_each_prompt_once_samples_what_it_samples_reading_every_row(tiny_policy, greedy):
    prompts = repeated_prompts()[0][:, :6]
    mask = (prompts != PAD).long()
    outputs = []
    for share in (False, True):
        torch.manual_seed(3)
        outputs.append(grpo_llm.sample(tiny_policy.eval(), prompts, mask, 8, [EOS], greedy=greedy, temperature=0.7,
                                       share_prompts=share))
    tokens, shared_tokens = outputs
    assert torch.equal(shared_tokens, tokens)


def test_greedy_decoding_is_transformers_greedy_generate(tiny_policy):
    prompts = torch.randint(2, 14, (16, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(prompts)
    mask[:5, :2] = 0  # left padding
    prompts = prompts.masked_fill(mask == 0, PAD)
    ours = grpo_llm.sample(tiny_policy.eval(), prompts, mask, 10, [EOS], greedy=True)
    theirs = tiny_policy.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                  eos_token_id=EOS, pad_token_id=PAD)[:, prompts.shape[1]:]
    assert ours.shape == theirs.shape
    ours_mask, _ = grpo_llm.response_mask_from_eos(ours, [EOS])
    assert torch.equal(ours.masked_fill(~ours_mask, PAD), theirs)  # transformers pads after EOS


# ---------------------------------------------------------------------------------------------------------
# LoRA (--lora-r): adapters on the policy, the reference is the policy with them off
# ---------------------------------------------------------------------------------------------------------


def test_with_lora_the_reference_is_the_base_model_and_the_adapters_change_the_policy(tiny):
    pytest.importorskip("peft")
    torch.manual_seed(0)
    args = Args(model_name_or_path=str(tiny.policy), lora_r=4, lora_alpha=8.0, max_new_tokens=4, micro_batch_size=4)
    models = grpo_llm.load_models(args, torch.device("cpu"), resume=None)
    assert models.ref_policy is None  # no second model in memory
    for name, weight in models.policy.named_parameters():
        if "lora_B" in name:  # B starts at 0 (the adapters add nothing yet): give them something to add
            weight.data.normal_(0, 0.5)
    rollout = grpo_llm.generate(models, [[3, 4, 12], [5, 13]], args, greedy=False)
    with models.reference() as ref_policy:
        reference, _ = grpo_llm.forward_logprobs(ref_policy, rollout, args)
    base = AutoModelForCausalLM.from_pretrained(tiny.policy, dtype=torch.float32).eval()
    expected, _ = grpo_llm.forward_logprobs(base, rollout, args)
    adapted, _ = grpo_llm.forward_logprobs(models.policy, rollout, args)
    mask = rollout["response_mask"]
    assert torch.equal(reference[mask], expected[mask])
    assert not torch.allclose(adapted[mask], expected[mask], atol=1e-3)


def test_a_lora_checkpoint_holds_the_adapters_resumes_exactly_and_the_final_policy_is_a_plain_model(tiny, tmp_path):
    pytest.importorskip("peft")
    flags = ("--lora-r", 4, "--learning-rate", 2e-3, "--reward-fn", tiny.digit_sum, "--save-every", 1)
    succeeded(run_main(tiny, tmp_path / "run", *flags))
    checkpoint = tmp_path / "run" / "checkpoint-1"
    assert sorted(p.name for p in (checkpoint / "policy").glob("adapter_*")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not (checkpoint / "policy" / "model.safetensors").exists()
    succeeded(run_main(tiny, tmp_path / "resumed", *flags, "--resume-from", checkpoint))
    assert non_timing(read_metrics(tmp_path / "resumed")[2]) == non_timing(read_metrics(tmp_path / "run")[2])
    final, resumed, base = weights(tmp_path / "run" / "policy"), weights(tmp_path / "resumed" / "policy"), weights(tiny.policy)
    assert final.keys() == base.keys()  # the adapters merged: the base model's own tensors, nothing else
    assert all(torch.equal(final[name], resumed[name]) for name in final)
    assert any(not torch.equal(final[name], base[name]) for name in final)
    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "policy")


@pytest.mark.parametrize("model, targets, message", [
    (None, ["qproj"], "--lora-target-modules: qproj matches no module of this model"),
    (None, ["q_proj", "qproj"], "--lora-target-modules: qproj matches no module of this model"),  # peft: no error
    (DEMO_MODEL, ["lm_head"], "--lora-target-modules lm_head: the output head shares its weights with the embeddings"),
])
def test_lora_targets_peft_cannot_place_or_that_a_merge_would_spoil_are_one_error_line(tiny, tmp_path, model, targets, message):
    pytest.importorskip("peft")
    line = single_error_line(run_main(tiny, tmp_path, "--lora-r", 4, "--lora-target-modules", *targets, model=model))
    assert line.startswith(f"error: {message}"), line


def test_a_checkpoint_from_before_lora_existed_resumes_as_full_fine_tuning_only(tiny, tmp_path):
    succeeded(run_main(tiny, tmp_path / "run", "--save-every", 1))
    state_path = tmp_path / "run" / "checkpoint-1" / "training_state.pt"
    state = torch.load(state_path, weights_only=False)
    state["args"] = {k: v for k, v in state["args"].items() if not k.startswith("lora_")}  # as written before LoRA
    torch.save(state, state_path)
    line = single_error_line(run_main(tiny, tmp_path / "run", "--resume-from", state_path.parent, "--lora-r", 4))
    assert "--lora-r 0 in the checkpoint, 4 now" in line


def test_without_peft_lora_stops_with_one_line_saying_to_install_it(tiny, tmp_path):
    with mock.patch.dict(sys.modules, {"peft": None}):  # what the import system meets where peft is not installed
        line = single_error_line(run_main(tiny, tmp_path, "--lora-r", 8))
    assert line == "error: --lora-r needs the peft package: pip install peft"


def test_lora_learns_the_demo(demo_runs):
    run = demo_runs("grpo-lora")
    assert run.metrics[max(run.metrics)]["eval/reward"] >= run.metrics[0]["eval/reward"] + 0.25

# ---------------------------------------------------------------------------------------------------------
# Bad input: one line "error: ..." on stderr and a non-zero exit
# ---------------------------------------------------------------------------------------------------------


def before_loading(flags):
    """Flags of a check that must run before any model loads: the model is an empty directory, which cannot load."""
    return lambda t: ["--model-name-or-path", t.empty_dir, *flags(t)]


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

    with mock.patch.object(grpo_llm, "open", full_metrics, create=True):
        line = single_error_line(run_main(tiny, tmp_path / "out"))
    assert f"cannot write {tmp_path / 'out' / 'metrics.jsonl'} (No space left on device)" in line, line


def test_a_csv_file_with_a_byte_order_mark_reads_as_one_without(tmp_path):
    pytest.importorskip("datasets")
    plain, marked = tmp_path / "plain.csv", tmp_path / "marked.csv"  # Excel's "CSV UTF-8" starts with the mark
    plain.write_text("prompt,answer\n1+1=,2\n2+2=,4\n")
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    rows = [grpo_llm.load_prompts(str(path), "--prompts-path").rows for path in (plain, marked)]
    assert rows[0] == rows[1] == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


# (flags, what the error line must contain). Checked in this process through main(), so a row costs milliseconds.
BAD_INPUT = {
    "config with fewer layers than its weights": (lambda t: ["--model-name-or-path", hostile(t, "fewer_layers")],
                                                  ["fewer_layers", "uses no weights for model.layers.1."]),
    "chat template that fails to render": (
        lambda t: ["--model-name-or-path", hostile(t, "broken_template"), "--chat-template"],
        ["--chat-template: the chat template of", "fails to render", "only renders system turns"]),
    "token ids past the vocabulary": (lambda t: ["--model-name-or-path", hostile(t, "small_vocab")],
                                      ["gives the id 13", "13-token vocabulary"]),
    "prompt and response past the context": (
        lambda t: ["--max-new-tokens", 60], ["plus --max-new-tokens 60", "max_position_embeddings 64"]),
    "prompt of only whitespace": (before_loading(lambda t: ["--prompts-path", hostile(t, "whitespace_prompt.jsonl")]),
                                  ["--prompts-path", "line 2: the prompt is empty or only whitespace"]),
    "reward module exits on import": (
        before_loading(lambda t: ["--reward-fn", f"{hostile(t, 'exits_on_import.py')}:score"]),
        ["exits_on_import.py:score' cannot be imported: SystemExit: 0"]),
    "reward module interrupts on import": (
        before_loading(lambda t: ["--reward-fn", f"{hostile(t, 'interrupts_on_import.py')}:score"]),
        ["interrupts_on_import.py:score' cannot be imported: KeyboardInterrupt"]),
    "answer nan": (before_loading(lambda t: ["--prompts-path", hostile(t, "nan_answer.jsonl"), "--eval-every", 0]),
                   ["line 1", "a text or a number (found nan)"]),
    "answer a list": (before_loading(lambda t: ["--prompts-path", hostile(t, "list_answer.jsonl"), "--eval-every", 0]),
                      ["line 1", "a text or a number (found ['2'])"]),
    "one generation with a group baseline": (lambda t: ["--num-generations", "1"], ["--num-generations 1"]),
    "dynamic sampling with the greedy baseline": (
        before_loading(lambda t: ["--preset", "remax", "--dynamic-sampling"]),
        ["--dynamic-sampling with --baseline greedy", "advantages against the greedy reward"]),
    "unknown preset": (lambda t: ["--preset", "ppo"], ["unknown --preset 'ppo'"]),
    "reward weights that do not match the rewards": (
        lambda t: ["--reward-fn", "exact_match", t.digit_sum, "--reward-weights", "1"], ["has 1 values for 2 rewards"]),
    "missing model directory": (lambda t: ["--model-name-or-path", str(t.root / "no-model")], ["no such directory"]),
    "missing prompts file": (lambda t: ["--prompts-path", str(t.root / "no.jsonl")], ["file not found"]),
    "malformed prompts file": (lambda t: ["--prompts-path", str(t.malformed)], ["line 2: not valid JSON"]),
    "reward function that cannot be imported": (lambda t: ["--reward-fn", t.missing_fn], ["cannot be imported"]),
    "reward function returning the wrong length": (
        lambda t: ["--reward-fn", t.wrong_length], ["returned 1 values for"]),
    "greedy baseline with group scaling": (lambda t: ["--baseline", "greedy", "--scale-rewards", "group"],
                                           ["--baseline greedy cannot be combined with --scale-rewards group"]),
    "greedy baseline with batch scaling": (lambda t: ["--baseline", "greedy", "--scale-rewards", "batch"],
                                           ["--baseline greedy cannot be combined with --scale-rewards batch"]),
    # Every knob's range (RANGES), checked first: a size says "must be positive" before any divisibility message, and
    # a flag that would do nothing without another reports its range first.
    **{" ".join(map(str, flags)): (before_loading(lambda t, flags=flags: flags), [f"{flags[0]} {rule}"])
       for flags, rule in [
           (["--seed", -1], "must be in [0, 2**64)"), (["--seed", 2**64], "must be in [0, 2**64)"),
           (["--eval-every", -1], "must be >= 0"), (["--sample-every", -1], "must be >= 0"),
           (["--save-every", -1], "must be >= 0"), (["--save-total-limit", 0], "must be positive"),
           (["--max-prompt-length", 0], "must be positive"), (["--num-prompts", 0], "must be positive, got 0"),
           (["--num-generations", 0], "must be positive, got 0"), (["--max-new-tokens", 0], "must be positive"),
           (["--temperature", 0], "must be in [0.001, inf)"),
           (["--temperature", "inf"], "must be in [0.001, inf) and finite"),
           (["--top-p", 0], "must be in (0, 1]"), (["--top-p", 1.5], "must be in (0, 1]"), (["--top-k", -1], "must be >= 0"),
           (["--clip-eps", 0], "must be positive"), (["--clip-eps-high", -0.1], "must be positive"),
           (["--dual-clip", 1.0], "must be in (1, inf)"), (["--sapo-temperature-pos", 0], "must be positive"),
           (["--sapo-temperature-neg", -1], "must be positive"), (["--top-entropy-quantile", 0], "must be in (0, 1]"),
           (["--top-entropy-quantile", 1.5], "must be in (0, 1]"), (["--off-policy-mask-threshold", -0.1], "must be >= 0"),
           (["--kl-coef", -0.1], "must be >= 0"), (["--ent-coef", -0.01], "must be >= 0"),
           (["--max-resample-rounds", -1], "must be >= 0"), (["--overlong-buffer-length", -1], "must be >= 0"),
           (["--overlong-penalty", -1], "must be >= 0"), (["--num-iterations", 0], "must be positive"),
           (["--num-epochs", 0], "must be positive"), (["--num-minibatches", 0], "must be positive, got 0"),
           (["--micro-batch-size", 0], "must be positive, got 0"), (["--learning-rate", -1e-4], "must be >= 0"),
           (["--learning-rate", "nan"], "must be >= 0 and finite"), (["--adam-eps", 0], "must be positive"),
           (["--weight-decay", -0.1], "must be >= 0"), (["--lr-warmup-iterations", -1], "must be >= 0"),
           (["--max-grad-norm", 0], "must be positive"), (["--max-grad-norm", -1], "must be positive"),
           (["--min-p", 1], "must be in [0, 1)"), (["--min-p", -0.1], "must be in [0, 1)"),
           (["--entropy-target", -1], "must be >= 0"), (["--ent-coef-delta", 0], "must be positive"),
           (["--ent-coef-min", -1], "must be >= 0"), (["--ent-coef-max", -1], "must be >= 0"),
           (["--ref-sync-every", -1], "must be >= 0"), (["--ref-sync-alpha", 0], "must be in (0, 1]"),
           (["--ref-sync-alpha", 1.5], "must be in (0, 1]"), (["--vespo-k-pos", -1], "must be >= 0"),
           (["--vespo-lambda-pos", 0], "must be positive"), (["--vespo-k-neg", -1], "must be >= 0"),
           (["--vespo-lambda-neg", 0], "must be positive"),
       ]},
    # The knobs of VESPO, adaptive entropy control, reference sync and reward aggregation, where they do nothing.
    "vespo knob without vespo": (before_loading(lambda t: ["--vespo-k-pos", 1]),
                                 ["--vespo-k-pos does nothing without --policy-loss vespo"]),
    "clip with vespo": (before_loading(lambda t: ["--preset", "vespo", "--clip-eps", 0.3]),
                        ["--clip-eps does nothing with --policy-loss sapo or vespo"]),
    "entropy step without a target": (before_loading(lambda t: ["--ent-coef-delta", 0.01]),
                                      ["--ent-coef-delta does nothing without --entropy-target"]),
    "entropy coefficient outside its bounds": (
        before_loading(lambda t: ["--entropy-target", 0.5, "--ent-coef", 2.0]), ["--ent-coef 2.0 must lie in"]),
    "reference sync alpha without sync": (before_loading(lambda t: ["--ref-sync-alpha", 0.5]),
                                          ["--ref-sync-alpha does nothing without --ref-sync-every"]),
    "reference sync without a reference": (before_loading(lambda t: ["--kl-coef", 0, "--ref-sync-every", 2]),
                                           ["--ref-sync-every does nothing with --kl-coef 0"]),
    "reference sync with lora": (before_loading(lambda t: ["--lora-r", 4, "--ref-sync-every", 2]),
                                 ["--ref-sync-every with --lora-r", "adapters off"]),
    "reward aggregation with one reward": (before_loading(lambda t: ["--reward-aggregation", "normalize-then-sum"]),
                                           ["--reward-aggregation does nothing with one reward"]),
    "normalize-then-sum with the greedy baseline": (
        before_loading(lambda t: ["--preset", "remax", "--reward-fn", "exact_match", t.digit_sum,
                                  "--reward-aggregation", "normalize-then-sum"]),
        ["--reward-aggregation normalize-then-sum with --baseline greedy"]),
    "reward weight nan": (before_loading(lambda t: ["--reward-weights", "nan"]), ["--reward-weights must be finite"]),
    "reward weights all 0": (before_loading(lambda t: ["--reward-weights", "0"]), ["--reward-weights are all 0"]),
    # Flags that would do nothing without another (ONLY_WITH).
    "wandb project without track": (
        before_loading(lambda t: ["--wandb-project", "p"]), ["--wandb-project does nothing without --track"]),
    "resample rounds without dynamic sampling": (
        before_loading(lambda t: ["--max-resample-rounds", 2]), ["--max-resample-rounds does nothing without --dynamic-sampling"]),
    "overlong penalty without an overlong buffer": (
        before_loading(lambda t: ["--overlong-penalty", 0.5]), ["--overlong-penalty does nothing with --overlong-buffer-length 0"]),
    "kl estimator with dapo's kl-coef 0": (
        before_loading(lambda t: ["--preset", "dapo", "--kl-estimator", "k1"]), ["--kl-estimator does nothing with --kl-coef 0"]),
    "kl-in with kl-coef 0": (
        before_loading(lambda t: ["--kl-coef", 0, "--kl-in", "reward"]), ["--kl-in does nothing with --kl-coef 0"]),
    "importance-corrected kl without the kl in the loss": (
        before_loading(lambda t: ["--preset", "rloo", "--kl-importance-correction"]),
        ["--kl-importance-correction does nothing without the KL in the loss"]),
    "dual clip with cispo": (
        before_loading(lambda t: ["--preset", "cispo", "--dual-clip", 6]), ["--dual-clip does nothing without --policy-loss clip"]),
    "clip range with sapo": (
        before_loading(lambda t: ["--preset", "sapo", "--clip-eps-high", 0.28]), ["--clip-eps-high does nothing with --policy-loss sapo"]),
    "sapo temperature with the clip": (
        before_loading(lambda t: ["--sapo-temperature-neg", 2]), ["--sapo-temperature-neg does nothing without --policy-loss sapo"]),
    "off-policy masking on-policy": (
        before_loading(lambda t: ["--off-policy-mask-threshold", 0.1]), ["--off-policy-mask-threshold does nothing on-policy"]),
    "fsdp in one process": (before_loading(lambda t: ["--fsdp"]), ["--fsdp does nothing in one process", "torchrun"]),
    "tools without max tool calls": (before_loading(lambda t: ["--tools", "calculator"]),
                                     ["--tools does nothing with --max-tool-calls 0"]),
    "max tool calls without tools": (before_loading(lambda t: ["--max-tool-calls", 1]), ["--max-tool-calls needs --tools"]),
    "tool that cannot be imported": (before_loading(lambda t: ["--max-tool-calls", 1, "--tools", t.root / "no.py:f"]),
                                     ["--tools", "no.py:f' cannot be imported"]),
    "chat template that cannot render a tool message": (
        lambda t: ["--model-name-or-path", hostile(t, "no_tool_template"), "--chat-template", "--tools", "calculator",
                   "--max-tool-calls", 1], ["--tools: the chat template of", "cannot render a tool message",
                                            "no tool turns here"]),
    "chat template that leaves tool messages out": (
        lambda t: ["--model-name-or-path", hostile(t, "drops_tools_template"), "--chat-template", "--tools", "calculator",
                   "--max-tool-calls", 1], ["cannot render a tool message (ValueError: it leaves tool messages out)"]),
    "lora alpha without lora": (before_loading(lambda t: ["--lora-alpha", 32]), ["--lora-alpha does nothing with --lora-r 0"]),
    "lora dropout of 1": (before_loading(lambda t: ["--lora-r", 8, "--lora-dropout", 1]), ["--lora-dropout must be in [0, 1)"]),
    "save total limit without saves": (
        before_loading(lambda t: ["--save-total-limit", 2]), ["--save-total-limit does nothing with --save-every 0"]),
    # Combinations, naming a value that came from the preset as such.
    "dapo's overlong buffer without room": (  # the preset's buffer is a fifth of --max-new-tokens: the budget is to blame
        before_loading(lambda t: ["--preset", "dapo", "--max-new-tokens", 1]),
        ["error: --max-new-tokens 1 leaves no room", "--preset dapo"]),
    "overlong buffer as long as the response": (
        before_loading(lambda t: ["--overlong-buffer-length", 4]),
        ["--overlong-buffer-length 4 must be below --max-new-tokens 4"]),
    "clip with cispo's unbounded lower epsilon": (
        before_loading(lambda t: ["--preset", "cispo", "--policy-loss", "clip"]),
        ["--clip-eps 1.0 (from --preset cispo) must be below 1 with --policy-loss clip"]),
    "lower epsilon of 1 with the clip": (before_loading(lambda t: ["--clip-eps", 1.5]), ["--clip-eps must be below 1"]),
    "dual clip inside the clip range": (
        before_loading(lambda t: ["--preset", "dapo", "--dual-clip", 1.2]), ["--dual-clip 1.2 must exceed", "(1.28)"]),
    "importance-corrected k2": (
        before_loading(lambda t: ["--kl-estimator", "k2", "--kl-importance-correction"]), ["use k3"]),
    "gspo's minibatches do not split the batch": (
        before_loading(lambda t: ["--preset", "gspo", "--num-prompts", 1, "--num-generations", 2]),
        ["--num-minibatches 4 (from --preset gspo)", "2 is not divisible by 4"]),
    # Data files.
    "prompts not utf-8": (
        before_loading(lambda t: ["--prompts-path", t.latin1_prompts]), ["--prompts-path", "line 2", "not UTF-8"]),
    "eval row without answer": (
        before_loading(lambda t: ["--eval-prompts-path", t.answerless_eval]), ["--eval-prompts-path", "line 3", "'answer'"]),
    "field named completions": (
        before_loading(lambda t: ["--prompts-path", t.completions_field]), ["--prompts-path", "line 1", "'completions'"]),
    # Prompts in other forms and fields.
    "dataset split with a prompts file": (
        before_loading(lambda t: ["--dataset-split", "test"]),
        ["--dataset-split does nothing unless --prompts-path names a Hugging Face dataset"]),
    "dataset config with prompts files": (
        before_loading(lambda t: ["--dataset-config", "main"]), ["--dataset-config does nothing unless"]),
    "rows without the prompt field": (
        before_loading(lambda t: ["--prompts-path", t.questions]),
        ["--prompts-path", "line 1: row has no string field 'prompt' (its fields: question, answer)"]),
    "rows without the --prompt-field": (
        before_loading(lambda t: ["--prompts-path", t.questions, "--prompt-field", "text"]),
        ["line 1: row has no string field 'text' (--prompt-field) (its fields: question, answer)"]),
    "prompt field beside a prompt": (
        before_loading(lambda t: ["--prompt-field", "question"]),
        ["line 1: row has a field 'prompt' besides --prompt-field 'question'; rename one"]),
    "answer field beside an answer": (
        before_loading(lambda t: ["--prompts-path", t.questions, "--prompt-field", "question", "--answer-field", "solution"]),
        ["line 1: row has a field 'answer' besides --answer-field 'solution'"]),
    "rows without the --answer-field": (
        before_loading(lambda t: ["--prompts-path", t.solutions, "--prompt-field", "question", "--answer-field", "result",
                                  "--eval-every", 0]),
        ["--prompts-path", "line 1", "--reward-fn exact_match needs the field 'result' (--answer-field)"]),
    "missing parquet file": (before_loading(lambda t: ["--prompts-path", t.root / "no.parquet"]), ["no.parquet: file not found"]),
    "a typo in a relative file name, not a hub dataset": (
        before_loading(lambda t: ["--prompts-path", "data/train.jsnl"]), ["--prompts-path data/train.jsnl: file not found"]),
    "empty prompt field": (before_loading(lambda t: ["--prompt-field", ""]), ["must be two different, non-empty field names"]),
    "prompt field equal to the answer field": (
        before_loading(lambda t: ["--prompt-field", "question", "--answer-field", "question"]), ["must be two different"]),
    "answer null": (before_loading(lambda t: ["--eval-prompts-path", t.null_answer]),
                    ["--eval-prompts-path", "line 1", "needs the field 'answer'"]),
    # The output directory.
    "output dir is a file": (before_loading(lambda t: ["--output-dir", t.train]), ["--output-dir", "not a directory"]),
    "output dir below a file": (before_loading(lambda t: ["--output-dir", t.train / "out"]), ["--output-dir", "cannot write"]),
    # An unset shell variable: '' would otherwise mean the current directory, or no resume at all.
    "output dir empty": (before_loading(lambda t: ["--output-dir", ""]), ["--output-dir is empty"]),
    "resume from empty": (before_loading(lambda t: ["--resume-from", ""]), ["--resume-from is empty"]),
    "output dir name too long": (before_loading(lambda t: ["--output-dir", t.root / ("x" * 300)]),
                                 ["--output-dir", "File name too long"]),
    "resume from name too long": (before_loading(lambda t: ["--resume-from", t.root / ("x" * 300)]),
                                  ["--resume-from", "File name too long"]),
    # Found once the models load.
    "character the tokenizer cannot encode": (
        lambda t: ["--model-name-or-path", DEMO_MODEL, "--prompts-path", t.letter_prompts],
        ["--prompts-path", "line 2", "'x' (U+0078)"]),
    "directory without a tokenizer": (lambda t: ["--model-name-or-path", t.no_tokenizer], ["--model-name-or-path", "cannot load"]),
    "empty prompt": (lambda t: ["--prompts-path", t.empty_prompt], ["--prompts-path", "line 2", "empty"]),
    "reward function that sets RANK": (lambda t: ["--reward-fn", f"{hostile(t, 'sets_rank.py')}:score"],
                                       ["reward function 'score' changed RANK in os.environ"]),
    "reward model without a score head": (lambda t: ["--reward-model-path", t.policy], ["--reward-model-path", "score.weight"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_error_line_and_a_nonzero_exit(tiny, tmp_path, case):
    flags, expected = BAD_INPUT[case]
    with mock.patch.dict("os.environ"):  # a reward function's changes stay in this test
        line = single_error_line(run_main(tiny, tmp_path / "out", *flags(tiny)))
    assert [part for part in expected if part not in line] == [], line


def test_bad_input_in_a_real_process_is_one_line_on_stderr_and_exit_code_1(tiny, tmp_path):
    # The table runs main() in this process; one row found after loading runs as a user would, so that nothing else
    # (a library's warning, a traceback) reaches stderr.
    result = run_script(tiny, tmp_path / "out", "--reward-model-path", tiny.policy)
    assert result.returncode == 1
    assert "--reward-model-path" in single_error_line(result) and "score.weight" in result.stderr


def test_a_bom_at_the_start_of_a_prompts_file_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": "4"}\n')
    prompts = load_prompts(str(path), "--prompts-path")
    assert [row["prompt"] for row in prompts.rows] == ["1+1=", "2+2="] and prompts.where(1).endswith("line 3")


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


def test_non_finite_loss_stops_the_run_and_keeps_the_last_checkpoint(tiny, tmp_path):
    # A reward of 3e38 passes the reward check, but the group mean sums four of them and overflows float32.
    output_dir = tmp_path / "out"
    result = run_main(tiny, output_dir, "--reward-fn", tiny.blows_up, "--eval-every", 0, "--save-every", 1)
    line = single_error_line(result)
    assert "non-finite loss" in line and f"the last checkpoint is {output_dir / 'checkpoint-1'}" in line
    assert list(read_metrics(output_dir)) == [1]
    assert sorted(p.name for p in output_dir.iterdir()) == [".lock", "checkpoint-1", "metrics.jsonl"]
    training_state = torch.load(output_dir / "checkpoint-1" / "training_state.pt", weights_only=False)
    assert training_state["iteration"] == 1
    LlamaForCausalLM.from_pretrained(output_dir / "checkpoint-1" / "policy")


# ---------------------------------------------------------------------------------------------------------
# Edge cases: Dr. GRPO's constant under --mask-truncated, minibatches without loss tokens, repeated reward functions
# ---------------------------------------------------------------------------------------------------------


def test_loss_normalisers_count_a_truncated_row_only_in_dr_grpos_constant():
    mask = torch.tensor([[True, True, True, False], [False, False, False, False], [True, False, False, False]])
    # 4 loss tokens; 2 rows have a token mean; Dr. GRPO divides by all 3 rows x L_max
    assert [n.item() for n in loss_normalisers(mask, "token-mean")] == [4, 2]
    assert [n.item() for n in loss_normalisers(mask, "seq-mean-token-mean")] == [4, 2]
    assert [n.item() for n in loss_normalisers(mask, "seq-mean-token-sum-norm")] == [4, 3]


def test_loss_normalisers_of_a_minibatch_without_loss_tokens_are_one():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    assert [n.item() for n in loss_normalisers(mask, "seq-mean-token-mean")] == [1, 1]
    assert [n.item() for n in loss_normalisers(mask, "seq-mean-token-sum-norm")] == [1, 2]


@pytest.fixture(scope="module")
def tiny_policy(tiny):
    return LlamaForCausalLM.from_pretrained(tiny.policy)


def hand_batch(loss_mask, advantages, **extra):
    """A batch built by hand: the prompt '1+2=' and random digits as responses, attention on every token."""
    B, T = loss_mask.shape
    prompts = torch.tensor([[3, 12, 4, 13]]).repeat(B, 1)
    responses = torch.randint(2, 12, (B, T), generator=torch.Generator().manual_seed(7))
    return dict(dict(query_responses=torch.cat([prompts, responses], 1), attention_mask=torch.ones(B, 4 + T, dtype=torch.long),
                     context_length=4, responses=responses, loss_mask=loss_mask, pg_mask=loss_mask,
                     advantages=torch.tensor(advantages)), **extra)


def update(policy, loss_mask, advantages, *flags, **extra):
    """grpo_update on a hand-built batch: no pi_old unless given (so the ratio is exactly 1) and no reference.
    Returns the update's statistics."""
    batch = hand_batch(loss_mask, advantages, **extra)
    models = SimpleNamespace(policy=policy, ref_policy=object() if "ref_logprobs" in extra else None,
                             autocast=contextlib.nullcontext)
    args = parse_args(["--kl-coef", "0", "--learning-rate", "0", *flags])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.0)
    return grpo_update(models, optimizer, batch, args, torch.Generator().manual_seed(0)), batch


def current_logprobs(policy, batch):
    with torch.no_grad():
        return plain_logprobs(policy, batch["query_responses"], batch["attention_mask"], 4)


def plain_logprobs(policy, sequences, attention_mask, context_length):
    """log pi of each response token from the model's own logits (no padding here, so default positions)."""
    logits = policy(input_ids=sequences, attention_mask=attention_mask).logits[:, context_length - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, sequences[:, context_length:].unsqueeze(-1)).squeeze(-1)


def test_on_policy_the_update_keeps_pi_olds_log_probs_for_the_kl_metric_in_the_batchs_order(tiny_policy):
    mask = torch.tensor([[True, True, False], [True] * 3, [True, False, False], [True] * 3, [True, True, True]])
    expected = current_logprobs(tiny_policy, hand_batch(mask, [0.5, -1.0, 0.2, 0.3, 0.0]))  # a separate pass of pi_old
    _, batch = update(tiny_policy, mask, [0.5, -1.0, 0.2, 0.3, 0.0], "--micro-batch-size", "2",
                      ref_logprobs=torch.zeros(5, 3))  # shuffled, in 3 micro-batches
    torch.testing.assert_close(batch["update_logprobs"], expected, atol=1e-6, rtol=0)


def test_micro_batches_are_the_rows_in_turn():
    assert grpo_llm.micro_batches(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    assert grpo_llm.micro_batches(5, 5) == [slice(0, 5)]


@pytest.mark.parametrize("share_prompts", [False, True])
def test_micro_batches_of_a_pass_give_one_whole_batch_passs_log_probs(tiny_policy, share_prompts):
    # Responses of 5, 2, 3 and 1 tokens, padded to 5, in micro-batches of 2: the reference-style pass and the on-policy
    # update run 4 + 5 columns (with shared prompts, the prompt once and its responses after it), and their log-probs of
    # the real tokens are those of one plain pass over the whole batch.
    mask = torch.arange(5).unsqueeze(0) < torch.tensor([[5], [2], [3], [1]])
    flags = ["--micro-batch-size", "2", "--share-prompts" if share_prompts else "--no-share-prompts"]
    batch = hand_batch(mask, [0.5, -1.0, 0.2, 0.3], response_mask=mask)
    batch["attention_mask"][:, 4:] = mask.long()
    expected = current_logprobs(tiny_policy, batch)
    widths = []
    hook = tiny_policy.model.embed_tokens.register_forward_hook(lambda m, inputs, out: widths.append(inputs[0].shape[1]))
    try:
        with torch.no_grad():
            logprobs, _ = grpo_llm.forward_logprobs(tiny_policy, batch, parse_args(flags))
        update(tiny_policy, mask, [0.5, -1.0, 0.2, 0.3], *flags, attention_mask=batch["attention_mask"])
    finally:
        hook.remove()
    # Shared, each micro-batch runs its prompt once (4 tokens), then its responses but their last token (4)
    assert widths == ([4, 4, 4, 4] if share_prompts else [4 + 5, 4 + 5]) * 2
    torch.testing.assert_close(logprobs[mask], expected[mask], atol=1e-5, rtol=0)
    assert logprobs.shape == (4, 5)


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_with_every_new_knob_neutral_an_update_is_exactly_the_one_before_them(tiny, aggregation):
    # The update as grpo_llm.py computed it before CISPO, SAPO and the masks, written out: PPO's clipped surrogate
    # over the loss mask plus beta * k3, one backward, the norm clip, one AdamW step; off-policy, with a reference.
    mask = torch.tensor([[True, True, True, False, False], [True] * 5, [True, False, False, False, False], [True] * 4 + [False]])
    advantages = [1.0, -0.5, 0.3, -1.2]
    policy, expected = (LlamaForCausalLM.from_pretrained(tiny.policy) for _ in range(2))
    logprobs = current_logprobs(policy, hand_batch(mask, advantages))
    g = torch.Generator().manual_seed(11)
    old, ref = logprobs + 0.3 * torch.randn(4, 5, generator=g), logprobs + 0.3 * torch.randn(4, 5, generator=g)
    batch = hand_batch(mask, advantages, old_logprobs=old, ref_logprobs=ref)
    args = parse_args(["--loss-aggregation", aggregation, "--policy-loss", "clip", "--top-entropy-quantile", "1.0",
                       "--kl-coef", "0.04", "--num-minibatches", "1", "--micro-batch-size", "4"])
    models = SimpleNamespace(policy=policy, ref_policy=object(), autocast=contextlib.nullcontext)
    grpo_update(models, torch.optim.AdamW(policy.parameters(), lr=1e-2, eps=1e-5), batch, args, torch.Generator().manual_seed(0))

    optimizer = torch.optim.AdamW(expected.parameters(), lr=1e-2, eps=1e-5)
    inds = torch.randperm(4, generator=torch.Generator().manual_seed(0))  # grpo_update's one shuffled minibatch
    expected.train()
    new_logprobs, m = plain_logprobs(expected, batch["query_responses"][inds], batch["attention_mask"][inds], 4), mask[inds]
    n_tokens, n_seqs = loss_normalisers(m, aggregation)
    surrogate = clipped_surrogate_loss(torch.exp(new_logprobs - old[inds]),
                                       batch["advantages"][inds].unsqueeze(1).expand_as(new_logprobs), 0.2)[0]
    loss = aggregate_loss(surrogate, m, aggregation, n_tokens, n_seqs, 8) \
        + 0.04 * aggregate_loss(kl_penalty(new_logprobs, ref[inds], "k3"), m, aggregation, n_tokens, n_seqs, 8)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(expected.parameters(), 1.0)
    optimizer.step()
    after, before = dict(policy.named_parameters()), weights(tiny.policy)
    for name, p in expected.named_parameters():  # ResponseLogprobs' gradient is autograd's up to float32 rounding
        torch.testing.assert_close(after[name], p, atol=1e-5, rtol=0)
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"])  # the update did move the weights


def test_the_policy_loss_is_averaged_over_the_high_entropy_tokens_only(tiny_policy):
    # Ratio 1, so each token's loss is -A_i; with token-mean the loss is the mean of -A_i over the selected tokens,
    # while the entropy statistic still averages every loss token.
    mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    selected = torch.tensor([[False, True, False], [True, True, False], [False, False, False]])
    stats, _ = update(tiny_policy, mask, [1.0, -2.0, 4.0], "--loss-aggregation", "token-mean", pg_mask=selected)
    assert stats["losses/policy_loss"] == pytest.approx(-(1.0 - 2.0 - 2.0) / 3)
    all_tokens, _ = update(tiny_policy, mask, [1.0, -2.0, 4.0], "--loss-aggregation", "token-mean")
    assert all_tokens["losses/policy_loss"] == pytest.approx(-(3 * 1.0 + 2 * -2.0 + 4.0) / 6)
    assert stats["policy/entropy"] == all_tokens["policy/entropy"]


def off_policy_batch(policy, seed):
    """A 4 x 3 ragged batch whose sampler's and reference's log-probs differ from the policy's (ratios ~ e^N(0, 0.5)),
    with the policy's own log-probs, the advantages, and the real tokens as (i, t) pairs."""
    mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False], [True, True, True]])
    logprobs = current_logprobs(policy, hand_batch(mask, [0.0] * 4))
    g = torch.Generator().manual_seed(seed)
    old, ref = logprobs + 0.5 * torch.randn(4, 3, generator=g), logprobs + 0.5 * torch.randn(4, 3, generator=g)
    return mask, logprobs, old, ref, [1.5, -1.0, 0.5, -2.0], [(i, t) for i in range(4) for t in range(3) if mask[i, t]]


@pytest.mark.parametrize("policy_loss", ["cispo", "sapo"])
def test_policy_loss_selects_the_loss_the_update_minimises(tiny_policy, policy_loss):
    # With learning rate 0 the reported loss is the token mean of the chosen per-token loss at the current weights.
    mask, logprobs, old, _, advantages, real = off_policy_batch(tiny_policy, 12)
    stats, _ = update(tiny_policy, mask, advantages, "--policy-loss", policy_loss, "--loss-aggregation", "token-mean",
                      "--num-epochs", "2", "--clip-eps", "0.2", "--clip-eps-high", "0.28", old_logprobs=old)
    expected = 0.0
    for i, t in real:
        lp, a = logprobs[i, t].item(), advantages[i]
        w = math.exp(lp - old[i, t].item())
        if policy_loss == "cispo":
            expected += -min(max(w, 0.8), 1.28) * a * lp
        else:
            tau = 1.0 if a > 0 else 1.05
            expected += -4 / tau / (1 + math.exp(-tau * (w - 1))) * a
    assert stats["losses/policy_loss"] == pytest.approx(expected / len(real), rel=1e-5)


@pytest.mark.parametrize("corrected", [False, True])
def test_the_kl_term_of_the_update_is_importance_weighted_only_with_the_flag(tiny_policy, corrected):
    mask, logprobs, old, ref, advantages, real = off_policy_batch(tiny_policy, 13)
    flags = ["--kl-coef", "0.1", "--loss-aggregation", "token-mean", "--num-epochs", "2"]
    stats, _ = update(tiny_policy, mask, advantages, *flags, *(["--kl-importance-correction"] if corrected else []),
                      old_logprobs=old, ref_logprobs=ref)
    expected = 0.0
    for i, t in real:
        lp, log_r = logprobs[i, t].item(), ref[i, t].item() - logprobs[i, t].item()
        k3 = math.exp(log_r) - log_r - 1
        expected += (math.exp(lp - old[i, t].item()) if corrected else 1.0) * k3
    assert stats["losses/kl"] == pytest.approx(expected / len(real), rel=1e-5)


def test_off_policy_masking_removes_exactly_the_masked_sequences_loss_and_counts_them(tiny_policy):
    # Row 0 (A < 0, the sampler's log-probs 1 nat above the policy's: KL 1 > 0.5) is dropped; row 1 has A > 0, row 2
    # a small KL, row 3 a negative one. Dropping row 0 equals zeroing its advantage: the normalisers do not change.
    mask = torch.ones(4, 3, dtype=torch.bool)
    logprobs = current_logprobs(tiny_policy, hand_batch(mask, [0.0] * 4))
    old = logprobs + torch.tensor([[1.0], [1.0], [0.1], [-1.0]])
    flags = ("--num-epochs", "2", "--loss-aggregation", "token-mean")
    masked, _ = update(tiny_policy, mask, [-1.0, 1.0, -1.0, -1.0], *flags, "--off-policy-mask-threshold", "0.5",
                       old_logprobs=old)
    zeroed, _ = update(tiny_policy, mask, [0.0, 1.0, -1.0, -1.0], *flags, old_logprobs=old)
    assert masked["policy/off_policy_masked_fraction"] == pytest.approx(0.25)
    assert masked["losses/policy_loss"] == pytest.approx(zeroed["losses/policy_loss"], abs=1e-7)
    kept, _ = update(tiny_policy, mask, [-1.0, 1.0, -1.0, -1.0], *flags, old_logprobs=old)
    assert kept["losses/policy_loss"] != pytest.approx(masked["losses/policy_loss"], abs=1e-4)


def test_dr_grpo_loss_divides_by_every_sequence_of_the_minibatch_times_max_new_tokens(tiny_policy):
    # Row 1 is truncated (no loss token). With ratio 1 the per-token loss is -A_i, so the Dr. GRPO loss is
    # -(3 * 1.0 + 1 * -0.5) / (3 rows x L_max 5) = -2.5 / 15, not -2.5 / (2 rows x 5).
    mask = torch.tensor([[True, True, True, False], [False, False, False, False], [True, False, False, False]])
    stats, _ = update(tiny_policy, mask, [1.0, 2.0, -0.5], "--preset", "dr-grpo", "--max-new-tokens", "5",
                      "--micro-batch-size", "2")
    assert stats["losses/policy_loss"] == pytest.approx(-2.5 / 15)


TOKEN_STATISTICS = {"policy/entropy", "policy/clipfrac", "policy/clip_ratio_low", "policy/clip_ratio_high",
                    "policy/ratio", "policy/approx_kl"}


def test_an_update_without_loss_tokens_has_no_token_statistics(tiny_policy):
    stats, _ = update(tiny_policy, torch.zeros(4, 3, dtype=torch.bool), [1.0, -1.0, 0.5, -0.5], "--num-minibatches", "2")
    assert not any(key.startswith("policy/") for key in stats), stats.keys()
    assert stats["losses/policy_loss"] == 0.0 and "grad/policy_norm" in stats


def test_token_statistics_average_only_over_minibatches_with_loss_tokens(tiny_policy):
    # Only row 0 has loss tokens; the minibatch without it must not pull the means towards 0.
    mask = torch.tensor([[True, True, False], [False, False, False], [False, False, False], [False, False, False]])
    stats, batch = update(tiny_policy, mask, [1.0, -1.0, 0.5, -0.5], "--num-minibatches", "2", "--micro-batch-size", "2")
    assert TOKEN_STATISTICS <= stats.keys()
    assert stats["policy/ratio"] == pytest.approx(1.0)
    # Entropy of row 0's two response tokens, straight from the model: the logit at position 3 + t predicts token t.
    with torch.no_grad():
        logits = tiny_policy(batch["query_responses"][:1]).logits[0, 3:5]
    expected = torch.distributions.Categorical(logits=logits).entropy().mean().item()
    assert stats["policy/entropy"] == pytest.approx(expected, rel=1e-5)


def console_metrics(**extra):
    return dict({"iteration": 3, "objective/reward": 0.5, "objective/kl": 0.01, "rollout/zero_std_fraction": 0.25,
                 "rollout/response_length": 4.0, "time/iteration": 1.0}, **extra)


def test_console_line_says_no_loss_tokens_when_the_update_had_none(capsys):
    print_line(console_metrics())
    line = capsys.readouterr().out
    assert "no loss tokens" in line and "ent" not in line and "clip" not in line
    print_line(console_metrics(**{"policy/entropy": 1.5, "policy/clipfrac": 0.125}))
    line = capsys.readouterr().out
    assert "ent 1.500 | clip 0.125" in line and "no loss tokens" not in line


def test_reward_names_are_the_short_function_names_with_a_suffix_for_each_repeat():
    specs = ["path/to/file.py:letters", "exact_match", "module:letters", "exact_match", "a.py:letters"]
    assert reward_names(specs) == ["letters", "exact_match", "letters_2", "exact_match_2", "letters_3"]


def test_a_repeated_reward_fn_keeps_both_entries_and_weights(tiny):
    output_dir = tiny.root / "repeated-reward"
    succeeded(run_main(tiny, output_dir, "--reward-fn", tiny.digit_sum, tiny.digit_sum, "--reward-weights", "1", "2",
                       "--num-iterations", "1"))
    m = read_metrics(output_dir)[1]
    assert m["rewards/digit_sum/mean"] > 0.0
    assert m["rewards/digit_sum_2/mean"] == m["rewards/digit_sum/mean"]
    assert m["objective/reward"] == pytest.approx(3 * m["rewards/digit_sum/mean"], rel=1e-5)


def test_reward_metrics_of_a_file_path_function_use_its_short_name(trained):
    assert {"rewards/digit_sum/mean", "rewards/digit_sum/std"} <= trained.metrics[1].keys()
    assert not any(key.startswith("rewards/") and ".py" in key for key in trained.metrics[1])


# ---------------------------------------------------------------------------------------------------------
# Model configurations the demo does not use: attention dropout, shipped sampling settings, chat end-of-turn
# ---------------------------------------------------------------------------------------------------------


def test_disable_dropout_zeroes_the_float_dropout_attributes_of_attention_modules():
    model = LlamaForCausalLM(llama_config(attention_dropout=0.1))
    assert {m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")} == {0.1}
    disable_dropout(model)
    assert {m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")} == {0.0}


def test_learning_rate_zero_with_attention_dropout_in_the_config_gives_ratio_one_and_no_kl(tiny, tmp_path):
    # The update runs in train mode, where Llama attention applies config.attention_dropout unless it is zeroed. With
    # --kl-coef > 0 the rollout computes pi_old in its own eval-mode pass (even at one epoch of one minibatch), so the
    # update's ratio compares the two modes.
    model_dir = tmp_path / "dropout_model"
    LlamaForCausalLM.from_pretrained(tiny.policy, attention_dropout=0.1).save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    succeeded(run_main(tiny, tmp_path / "out", "--num-iterations", 1, "--eval-every", 0, "--learning-rate", 0,
                       "--kl-coef", 0.04, "--num-epochs", 1, "--num-minibatches", 1, model=model_dir))
    metrics = read_metrics(tmp_path / "out")[1]
    assert metrics["policy/approx_kl"] == 0.0 and metrics["policy/ratio"] == 1.0 and metrics["policy/clipfrac"] == 0.0


@pytest.fixture(scope="module")
def shipped_config_run(tiny):
    """Three iterations, without eval, of a model that ships its own sampling settings; a checkpoint every iteration,
    keeping the newest two."""
    model_dir = tiny.root / "sampling_model"
    shutil.copytree(tiny.policy, model_dir)
    shipped = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.3, eos_token_id=EOS)
    shipped.save_pretrained(model_dir)
    output_dir = tiny.root / "shipped_config_run"
    result = succeeded(run_main(tiny, output_dir, "--num-iterations", 3, "--eval-every", 0, "--save-every", 1,
                                "--save-total-limit", 2, model=model_dir))
    return SimpleNamespace(dir=output_dir, stdout=result.stdout)


def test_the_saved_policy_keeps_the_models_own_generation_config(shipped_config_run):
    for saved in (shipped_config_run.dir / "policy", shipped_config_run.dir / "checkpoint-3" / "policy"):
        config = GenerationConfig.from_pretrained(saved)
        assert (config.temperature, config.top_p, config.top_k, config.repetition_penalty) == (0.7, 0.8, 20, 1.3)


def test_save_total_limit_keeps_only_the_newest_checkpoints(shipped_config_run):
    assert sorted(p.name for p in shipped_config_run.dir.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]


def test_the_run_prints_its_stop_tokens_at_start_up(shipped_config_run):
    assert "stop tokens: <eos>\n" in shipped_config_run.stdout


def test_a_run_without_eval_ends_by_saying_where_the_final_policy_is(shipped_config_run):
    last_line = shipped_config_run.stdout.strip().splitlines()[-1]
    assert last_line.endswith(f"final policy in {shipped_config_run.dir / 'policy'}")


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


# ---------------------------------------------------------------------------------------------------------
# The output directory, resume checks and interrupts
# ---------------------------------------------------------------------------------------------------------


def test_a_fresh_run_into_an_earlier_runs_directory_is_refused_and_nothing_is_touched(tiny, trained, tmp_path):
    output_dir = tmp_path / "refused"
    shutil.copytree(trained.dir, output_dir)
    before = {p.relative_to(output_dir): p.stat().st_mtime_ns for p in output_dir.rglob("*") if p.name != ".lock"}
    line = single_error_line(run_main(tiny, output_dir, "--num-iterations", 1))
    assert "--output-dir" in line and "--overwrite" in line
    after = {p.relative_to(output_dir): p.stat().st_mtime_ns for p in output_dir.rglob("*") if p.name != ".lock"}
    assert after == before


def test_overwrite_removes_the_earlier_run_so_no_stale_checkpoint_is_left(tiny, trained, tmp_path):
    output_dir = tmp_path / "overwritten"
    shutil.copytree(trained.dir, output_dir)
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
    shutil.copytree(trained.dir, output_dir)
    before = snapshot(output_dir)
    if failure == "a-model-that-does-not-load":
        line = single_error_line(run_main(tiny, output_dir, "--overwrite", "--reward-model-path", tiny.policy))
        assert "--reward-model-path" in line and "score.weight" in line
    else:
        load = grpo_llm.load_models

        def load_after_a_ctrl_c(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)  # a first Ctrl-C: stop before the first update
            return load(*args, **kwargs)

        handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # not ignored, as under a background shell
        try:
            with mock.patch.object(grpo_llm, "load_models", load_after_a_ctrl_c):
                result = run_main(tiny, output_dir, "--overwrite")
        finally:
            signal.signal(signal.SIGINT, handler)
        assert result.returncode == 128 + signal.SIGINT and "before the first update" in result.stderr
    assert snapshot(output_dir) == before


def test_overwrite_deletes_the_earlier_run_once_the_models_have_loaded(tiny, trained, tmp_path):
    # A reward function that fails on its first call fails after the deletion: the earlier run is gone, as with the
    # Trainer, and the new run has left only its empty metrics file.
    output_dir = tmp_path / "earlier"
    shutil.copytree(trained.dir, output_dir)
    (tmp_path / "failing.py").write_text(FAILING_REWARD)
    result = run_main(tiny, output_dir, "--overwrite", "--reward-fn", f"{tmp_path / 'failing.py'}:fails")
    assert "reward service down" in single_error_line(result)
    assert snapshot(output_dir) == {Path("metrics.jsonl"): b""}


def test_overwrite_never_touches_the_checkpoint_it_resumes_from(tiny, trained, tmp_path):
    output_dir = tmp_path / "nested"
    shutil.copytree(trained.dir, output_dir)
    before = snapshot(output_dir)
    checkpoint = output_dir / "checkpoint-1"  # the output directory is the checkpoint itself
    line = single_error_line(run_main(tiny, checkpoint, *trained.flags, "--resume-from", checkpoint, "--overwrite"))
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

    with mock.patch.object(grpo_llm.torch, "save", disk_full_on_the_second_checkpoint):
        line = single_error_line(run_main(tiny, output_dir, "--save-every", 1, "--eval-every", 0))
    assert "cannot save" in line and "checkpoint-2" in line and "No space left on device" in line
    assert sorted(p.name for p in output_dir.iterdir()) == [".lock", "checkpoint-1", "metrics.jsonl"]
    assert torch.load(output_dir / "checkpoint-1" / "training_state.pt", weights_only=True)["iteration"] == 1


def test_overwrite_is_refused_when_it_would_delete_the_checkpoint_to_resume_from(tiny, trained, tmp_path):
    output_dir = tmp_path / "resume_and_overwrite"
    shutil.copytree(trained.dir, output_dir)
    line = single_error_line(run_main(tiny, output_dir, *trained.flags, "--resume-from", output_dir / "checkpoint-1",
                                      "--overwrite"))
    assert "--overwrite would delete --resume-from" in line
    assert (output_dir / "checkpoint-1" / "training_state.pt").is_file() and list(read_metrics(output_dir)) == [0, 1, 2]


def test_a_second_run_into_a_directory_another_run_holds_is_refused(tiny, tmp_path):
    import fcntl

    output_dir = tmp_path / "out"
    output_dir.mkdir()
    with open(output_dir / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a running run holds
        line = single_error_line(run_main(tiny, output_dir, "--num-iterations", 1))
    assert "--output-dir" in line and "another run is writing to it" in line
    assert sorted(p.name for p in output_dir.iterdir()) == [".lock"]


def changed_checkpoint(tiny, trained, name, change):
    """A copy of the trained run's checkpoint-1 under tiny.root/name, changed once by change(path)."""
    path = tiny.root / name
    if not path.exists():
        shutil.copytree(trained.dir / "checkpoint-1", path)
        change(path)
    return path


def written_by_ppo(path):
    state = torch.load(path / "training_state.pt", weights_only=False)
    state["script"] = "ppo"
    torch.save(state, path / "training_state.pt")


def smaller_policy(path):  # a model of one layer in the checkpoint's place, config and weights agreeing
    config = llama_config()
    config.num_hidden_layers = 1
    LlamaForCausalLM(config).save_pretrained(path / "policy")


def cut_policy_weights(path):
    data = (path / "policy" / "model.safetensors").read_bytes()
    (path / "policy" / "model.safetensors").write_bytes(data[: len(data) // 2])


def cut_in_half(path):
    data = (path / "training_state.pt").read_bytes()
    (path / "training_state.pt").write_bytes(data[: len(data) // 2])


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


# (checkpoint and flags beyond the trained run's, what the error line must contain)
RESUME_ERRORS = {
    "changed-learning-rate": (lambda t, r: [r.dir / "checkpoint-1", "--learning-rate", 1e-3],
                              ["--learning-rate None in the checkpoint, 0.001 now"]),
    "changed-two-flags": (lambda t, r: [r.dir / "checkpoint-1", "--clip-eps", 0.1, "--kl-coef", 0.2],
                          ["--kl-coef 0.04 in the checkpoint, 0.2 now", "--clip-eps 0.2 in the checkpoint, 0.1 now"]),
    "mask-truncated-not-in-the-checkpoint": (lambda t, r: [r.dir / "checkpoint-1", "--mask-truncated"],
                                             ["--mask-truncated False in the checkpoint, True now"]),
    "another-preset": (lambda t, r: [r.dir / "checkpoint-1", "--preset", "dr-grpo"],
                       ["--preset grpo in the checkpoint, dr-grpo now"]),
    "num-iterations-below-the-checkpoint": (lambda t, r: [r.dir / "checkpoint-2", "--num-iterations", 1],
                                            ["--num-iterations 1", "iteration 2"]),
    "checkpoint-of-ppo": (lambda t, r: [changed_checkpoint(t, r, "ppo_checkpoint", written_by_ppo)],
                          ["--resume-from", "a checkpoint of ppo_llm.py, not of grpo_llm.py"]),
    "truncated-training-state": (lambda t, r: [changed_checkpoint(t, r, "truncated_checkpoint", cut_in_half)],
                                 ["--resume-from", "truncated or corrupt"]),
    "training-state-of-something-else": (
        lambda t, r: [changed_checkpoint(t, r, "tensor_state", lambda path: torch.save(torch.zeros(3), path / "training_state.pt"))],
        ["--resume-from", "not a training state"]),
    "damaged-policy-weights": (lambda t, r: [changed_checkpoint(t, r, "damaged_policy", cut_policy_weights)],
                               ["--resume-from", "damaged_policy/policy", "cannot load"]),
    "checkpoint-without-policy": (
        lambda t, r: [changed_checkpoint(t, r, "policyless_checkpoint", lambda path: shutil.rmtree(path / "policy"))],
        ["--resume-from", "incomplete checkpoint, no policy"]),
    "args-a-list": (lambda t, r: [changed_checkpoint(t, r, "args_list", changed_state(args=[]))],
                    ["--resume-from", "args_list", "'args' is a list, not dict"]),
    "iteration-a-string": (lambda t, r: [changed_checkpoint(t, r, "iteration_str", changed_state(iteration="1"))],
                           ["--resume-from", "iteration_str", "'iteration' is a str, not int"]),
    "no-optimizer-state": (lambda t, r: [changed_checkpoint(t, r, "no_optimizer", changed_state(optimizer=REMOVED))],
                           ["--resume-from", "no_optimizer", "'optimizer' is missing"]),
    "no-random-states": (lambda t, r: [changed_checkpoint(t, r, "no_rng", changed_state(rng=[]))],
                         ["--resume-from", "no_rng", "'rng' holds 0 random states, not one per rank of its 1"]),
    "written-by-two-ranks": (
        lambda t, r: [changed_checkpoint(t, r, "two_ranks", changed_state(world_size=2, rng=lambda s: s["rng"] * 2))],
        ["--resume-from", "two_ranks", "written by 2 rank(s), resumed with 1", "--nproc_per_node 2"]),
    "policy-replaced-by-a-smaller-model": (lambda t, r: [changed_checkpoint(t, r, "smaller_policy", smaller_policy)],
                                           ["the policy of", "smaller_policy", "does not fit the optimizer state",
                                            "model.layers.1."]),
}


@pytest.mark.parametrize("case", list(RESUME_ERRORS))
def test_resume_refuses_a_checkpoint_that_does_not_match_its_flags_or_script(tiny, trained, tmp_path, case):
    flags, expected = RESUME_ERRORS[case]
    resume_from, *rest = flags(tiny, trained)
    line = single_error_line(run_main(tiny, tmp_path / "out", *trained.flags, "--resume-from", resume_from, *rest))
    assert [part for part in expected if part not in line] == [], line


def test_a_doctored_training_state_is_refused_and_runs_nothing(tiny, trained, tmp_path):
    marker = tiny.root / "created_by_the_checkpoint"
    path = changed_checkpoint(tiny, trained, "doctored", changed_state(args=OpensAFile(str(marker))))
    line = single_error_line(run_main(tiny, tmp_path / "out", *trained.flags, "--resume-from", path))
    assert "doctored" in line and "could run code" in line, line
    assert not marker.exists()
    torch.load(path / "training_state.pt", weights_only=False)  # the control: unpickled in full, it runs open()
    assert marker.exists()
    marker.unlink()


def test_resume_drops_a_metrics_line_cut_by_a_crash_with_a_warning(tiny, trained, tmp_path):
    output_dir = tmp_path / "cut_line"
    shutil.copytree(trained.dir, output_dir)
    with open(output_dir / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 3, "objective/rew')
    result = succeeded(run_main(tiny, output_dir, *trained.flags, "--resume-from", output_dir / "checkpoint-1"))
    assert "line 4 is not valid JSON" in result.stdout
    assert list(read_metrics(output_dir)) == [0, 1, 2]


def test_resume_refuses_a_metrics_line_that_is_not_a_row_and_changes_nothing(tiny, trained, tmp_path):
    output_dir = tmp_path / "bad_rows"
    shutil.copytree(trained.dir, output_dir)
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    (output_dir / "metrics.jsonl").write_text("\n".join([lines[0], "null", *lines[1:]]) + "\n")
    before = (output_dir / "metrics.jsonl").read_bytes()
    line = single_error_line(run_main(tiny, output_dir, *trained.flags, "--resume-from", output_dir / "checkpoint-1"))
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
        coef = grpo_llm.entropy_coefficient(coef, h, target=0.5, delta=0.01, low=0.0, high=0.045)
        ours.append(coef)
    assert ours == pytest.approx(expected, abs=1e-15)
    assert 0.045 in ours and 0.0 in ours  # both bounds reached


def test_reference_sync_mixes_every_parameter_as_tr_dpo_says():
    # pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref, per parameter; alpha = 1 copies the policy bit for bit
    torch.manual_seed(0)
    policy, reference = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    before = [p.detach().clone() for p in reference.parameters()]
    grpo_llm.sync_reference(reference, policy, 0.3)
    for mixed, old, own in zip(reference.parameters(), before, policy.parameters()):
        for j in range(mixed.numel()):
            assert mixed.flatten()[j].item() == pytest.approx(0.3 * own.flatten()[j].item() + 0.7 * old.flatten()[j].item(),
                                                              abs=1e-6)
    grpo_llm.sync_reference(reference, policy, 1.0)
    assert all(torch.equal(mixed, own) for mixed, own in zip(reference.parameters(), policy.parameters()))


def test_a_reference_synced_to_the_policy_has_no_kl_at_the_next_rollout(tiny, tmp_path):
    # --ref-sync-every 1 --ref-sync-alpha 1: after each update pi_ref = pi_theta (lerp's weight 1 returns the policy's
    # value), so iteration 2's KL, measured on its rollout before its first step, is 0; without the sync it is not.
    synced, plain = tmp_path / "synced", tmp_path / "plain"
    varied = ("--reward-fn", tiny.digit_sum, "--eval-every", 0)  # rewards that vary within a group: the policy moves
    succeeded(run_main(tiny, synced, *varied, "--ref-sync-every", 1, "--ref-sync-alpha", 1))
    succeeded(run_main(tiny, plain, *varied))
    assert abs(read_metrics(synced)[2]["objective/kl"]) < 1e-6
    assert abs(read_metrics(plain)[2]["objective/kl"]) > 1e-4


def test_adaptive_entropy_and_reference_sync_resume_exactly(tiny, tmp_path):
    # The coefficient in use and the mixed reference are in the checkpoint: a resumed run goes on as the whole one.
    flags = ("--entropy-target", 5.0, "--ent-coef", 0.01, "--ent-coef-delta", 0.01, "--ref-sync-every", 1,
             "--ref-sync-alpha", 0.5, "--num-iterations", 3, "--save-every", 1, "--eval-every", 0,
             "--reward-fn", tiny.digit_sum)
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
def digit_sum(prompts, completions, **kw):
    # The digit sum of REWARD_FNS, sending itself the signals in $SIGNALS ("TERM", or "INT INT") on its second call:
    # the first scores the eval before training, the second the rollout of iteration 1.
    global calls
    calls += 1
    if calls == 2:
        for name in os.environ.get("SIGNALS", "").split():
            os.kill(os.getpid(), getattr(signal, "SIG" + name))
    return [float(sum(int(c) for c in text if c.isdigit())) for text in completions]
"""


def interrupting_reward_flags(tiny):
    """The trained run's rewards, with its digit_sum replaced by the one that signals, and no --save-every."""
    (tiny.root / "interrupting.py").write_text(INTERRUPTING_REWARD)
    return ["--reward-fn", "exact_match", f"{tiny.root / 'interrupting.py'}:digit_sum"]


def run_with_signals(tiny, output_dir, signals, *flags):
    command = [sys.executable, str(SCRIPT), *script_flags(tiny, output_dir, *interrupting_reward_flags(tiny), *flags)]
    env = dict(SUBPROCESS_ENV, SIGNALS=signals)
    # As from a terminal: a shell's background job (as CI may be) would otherwise pass SIGINT on as ignored.
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_sigterm_checkpoints_the_iteration_and_resuming_equals_the_uninterrupted_run(tiny, trained, tmp_path):
    # The trained run without --save-every: the checkpoint comes from the signal alone.
    output_dir = tmp_path / "interrupted"
    interrupted = run_with_signals(tiny, output_dir, "TERM")
    checkpoint = output_dir / "checkpoint-1"
    assert interrupted.returncode == 128 + 15, interrupted.stderr
    assert interrupted.stderr.strip().splitlines()[-1] == f"interrupted at iteration 1; resume with --resume-from {checkpoint}"
    last_line = interrupted.stdout.strip().splitlines()[-1]
    assert last_line.startswith("stopped: iteration 1 in") and last_line.endswith(f"; last checkpoint {checkpoint}")
    assert "Traceback" not in interrupted.stderr
    succeeded(run_main(tiny, output_dir, *interrupting_reward_flags(tiny), "--resume-from", checkpoint))
    resumed = read_metrics(output_dir)
    assert list(resumed) == list(trained.metrics) == [0, 1, 2]
    assert [non_timing(resumed[i]) for i in resumed] == [non_timing(trained.metrics[i]) for i in trained.metrics]


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(tiny, tmp_path):
    result = run_with_signals(tiny, tmp_path / "out", "INT INT")
    assert result.returncode == 128 + 2
    assert "Traceback" not in result.stderr and "second Ctrl-C" in result.stderr
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_every_numeric_knob_has_a_declared_range():
    def is_numeric(t):  # int, float, Optional[int], Optional[float]
        return t in (int, float) or (typing.get_origin(t) is typing.Union and set(typing.get_args(t)) - {type(None)} <= {int, float})

    types = typing.get_type_hints(grpo_llm.Args, include_extras=True)  # the script's annotations are strings until resolved
    numeric = {f.name for f in dataclasses.fields(grpo_llm.Args) if is_numeric(types[f.name])}  # derived sizes are Annotated
    assert numeric - set(grpo_llm.RANGES) == set()
    assert set(grpo_llm.RANGES) - numeric == set()


def test_the_output_directory_is_unlocked_when_a_run_fails(tiny, tmp_path):
    import fcntl

    # A response past the model's context is refused once the models have loaded, with the lock held.
    args = parse_args(script_flags(tiny, tmp_path, "--max-new-tokens", 60, "--eval-every", 0))
    with pytest.raises(ConfigError) as failure:  # keeps the traceback, and its frames, alive, as a notebook does
        grpo_llm.train(args)
    assert "max_position_embeddings" in str(failure.value) and (tmp_path / ".lock").exists()
    with open(tmp_path / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the failed run still held it


# ---------------------------------------------------------------------------------------------------------
# torchrun: N ranks compute what one process computes on the same global batch, and no rank ever waits forever.
# Each launch starts 2 gloo ranks on this CPU; the worker is this file run as a script (the end of the file).
# ---------------------------------------------------------------------------------------------------------


def torchrun(*command, timeout=240):
    """`torchrun --nproc_per_node 2 ...`; a rank that blocks in a collective shows up as the timeout."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return subprocess.run([*launcher, *map(str, command)], cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True,
                          timeout=timeout)


UPDATE_FLAGS = ["--num-prompts", "2", "--num-generations", "4", "--max-new-tokens", "5", "--scale-rewards", "batch",
                "--top-entropy-quantile", "0.5", "--loss-aggregation", "token-mean", "--num-epochs", "2",
                "--micro-batch-size", "2", "--kl-coef", "0.04", "--learning-rate", "1e-3"]


def update_on_this_rank(policy_dir, fsdp):
    """compute_advantages and grpo_update on a fixed global batch of 2 groups of 4, of which this rank holds its part
    (one group of two ranks'): global batch std, entropy threshold, loss normalisers and statistics, sharded reference
    and policy forward passes, gradients reduced over ranks. Returns (full weights on rank 0, update statistics)."""
    args = parse_args(UPDATE_FLAGS + (["--fsdp"] if fsdp else []))
    args.reward_weights = [1.0]
    g = torch.Generator().manual_seed(3)
    mask = torch.arange(5).unsqueeze(0) < torch.randint(1, 6, (8, 1), generator=g)
    batch = hand_batch(mask, [0.0] * 8, response_mask=mask, has_eos=mask[:, -1].logical_not(),
                       scores={"r": torch.rand(8, generator=g)})
    part = slice(grpo_llm.rank() * 8 // grpo_llm.world_size(), (grpo_llm.rank() + 1) * 8 // grpo_llm.world_size())
    batch = {k: v[part] if isinstance(v, torch.Tensor) else ({n: s[part] for n, s in v.items()} if k == "scores" else v)
             for k, v in batch.items()}
    policy, reference = (grpo_llm.shard(LlamaForCausalLM.from_pretrained(policy_dir), args) for _ in range(2))
    reference.requires_grad_(False)
    models = SimpleNamespace(policy=policy, ref_policy=reference, reference=lambda: contextlib.nullcontext(reference),
                             autocast=contextlib.nullcontext)
    batch.update(grpo_llm.forward_rollout(models, batch, args))
    grpo_llm.compute_advantages(batch, args)
    grpo_llm.loss_masks(batch, args)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3, eps=1e-5)
    stats = grpo_update(models, optimizer, batch, args, torch.Generator().manual_seed(0))
    return grpo_llm.full_state_dict(policy) or policy.state_dict(), stats


def distributed_worker(policy_dir, out_dir):
    grpo_llm.init_distributed()
    for fsdp in (False, True):
        weights_after, stats = update_on_this_rank(policy_dir, fsdp)
        if grpo_llm.rank() == 0:
            torch.save(dict(weights=weights_after, stats=stats), Path(out_dir) / f"fsdp={fsdp}.pt")
    torch.distributed.destroy_process_group()


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
    before = weights(tiny.policy)
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
    # a plain save_pretrained directory of the model's own class (not FSDP's wrapper class), which loads in one process
    assert json.loads((full / "checkpoint-2" / "policy" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    loaded = LlamaForCausalLM.from_pretrained(full / "checkpoint-2" / "policy").state_dict()
    assert all(torch.equal(loaded[name], w) for name, w in weights(full / "checkpoint-2" / "policy").items())
    succeeded(torchrun(SCRIPT, *script_flags(tiny, resumed, *flags, "--resume-from", full / "checkpoint-1")))
    assert non_timing(read_metrics(resumed)[2]) == non_timing(metrics[2])
    after, expected = weights(resumed / "policy"), weights(full / "policy")
    assert all(torch.equal(after[name], expected[name]) for name in expected)


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
    name = "exact_match_but_not_on_rank_1"  # a reward's name is its function's
    assert ours == [f"[rank 1] error: reward function {name!r} raised ValueError: the reward service is down for rank 1"]
    assert f'{SCRIPT.name}", line' not in result.stderr  # no traceback from the script on any rank


def test_num_prompts_must_split_over_the_torchrun_ranks():
    with mock.patch.dict("os.environ", {"WORLD_SIZE": "2"}):
        with pytest.raises(ConfigError, match="--num-prompts .* must split over the 2 torchrun ranks"):
            check_args(parse_args(["--num-prompts", "3", "--model-name-or-path", str(DEMO_MODEL)]))


# ---------------------------------------------------------------------------------------------------------------
# The real model (SmolLM2-135M-Instruct, README "A real model on a laptop")
# ---------------------------------------------------------------------------------------------------------------


def test_the_shipped_real_model_prompts_are_the_generators_and_eval_is_held_out():
    sys.path.insert(0, str(REPO / "demo"))
    try:
        import make_real_model
    finally:
        sys.path.pop(0)
    train, held_out = make_real_model.arithmetic_prompts()
    assert (REPO / "demo/real/train.jsonl").read_text() == "".join(json.dumps(row) + "\n" for row in train)
    assert (REPO / "demo/real/eval.jsonl").read_text() == "".join(json.dumps(row) + "\n" for row in held_out)
    numbers = [tuple(map(int, re.findall(r"\d+", row["prompt"]))) for row in train + held_out]
    assert all(str(a + b) == row["answer"] for (a, b), row in zip(numbers, train + held_out))
    assert not set(numbers[:len(train)]) & set(numbers[len(train):])


def test_real_model_one_iteration_with_its_chat_template(real_model, tmp_path):
    """A real chat model with pad = EOS = <|im_end|>: the converted directory loads like any Hub model; the script's
    greedy eval (chat template, left-padded batch, last_number) agrees with plain HF greedy generation;
    one iteration trains at the learning rate chosen by size; the saved policy loads with the chat template."""
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in tokenizer.chat_template
    rows = [json.loads(line) for line in (REPO / "demo/real/eval.jsonl").read_text().splitlines()[:6]]
    expected = greedy_last_numbers(real_model, [row["prompt"] for row in rows], 16)
    output_dir = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--model-name-or-path", str(real_model), "--chat-template",
               "--reward-fn", "last_number", "--prompts-path", str(REPO / "demo/real/train.jsonl"),
               "--eval-prompts-path", str(write_jsonl(tmp_path / "eval.jsonl", rows)), "--output-dir", str(output_dir),
               "--num-iterations", "1", "--num-prompts", "2", "--num-generations", "2", "--max-new-tokens", "16",
               "--save-every", "0", "--eval-every", "1"]
    result = succeeded(subprocess.run(command, cwd=REPO, env=REAL_MODEL_ENV, capture_output=True, text=True, timeout=600))
    assert "stop tokens: <|im_end|>" in result.stdout
    assert "learning rate 3e-05, by the policy's size (134.5M parameters)" in result.stdout
    before = read_metrics(output_dir)[0]
    right = sum(number == float(row["answer"]) for (number, _), row in zip(expected, rows))
    assert before["eval/reward"] == pytest.approx(right / len(rows), abs=1e-6)  # a float32 mean
    assert before["eval/eos_rate"] == pytest.approx(sum(ended for _, ended in expected) / len(rows), abs=1e-6)
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
    return grpo_llm.Toolbox(("calculator", *(f"{path}:{name}" for name in ("raises", "sleeps", "echo"))), 0.3)


def test_the_calculator_computes_arithmetic_by_walking_its_syntax_tree():
    for expression, expected in (("374*58", 374 * 58), ("(2+3)**2", 25), ("7/2", 3.5), ("-3+10//3", 0),
                                 (" 2**-2 ", 0.25), ("17 % 5", 2), ("1.5*4", 6.0)):
        assert grpo_llm.calculator(expression) == str(expected), expression


@pytest.mark.parametrize("expression", ["x+1", "(1).real", "abs(-1)", "__import__('os').system('touch pwned')",
                                        "'a'*3", "[1]*3", "1 if 1 else 2", "9**999", "(10**200)**2", "2**3**7",
                                        "10**300*10", "(9**100)**100 % 7", "1e308*10", "(-8)**0.5",
                                        pytest.param("9" * 5000, id="5000-digits")])
def test_the_calculator_refuses_names_attributes_calls_and_huge_powers(expression, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises((ValueError, SyntaxError)):  # Python refuses a literal past 4300 digits as it parses
        grpo_llm.calculator(expression)
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
    ids = grpo_llm.tool_message_ids(tokenizer, [result], Args(max_tool_output_tokens=12), EOS)
    assert tokenizer.decode(ids) == "<tool_response>012345678901</tool_response>"


def test_a_tool_without_a_docstring_for_its_arguments_is_refused_at_start_up(tmp_path):
    (tmp_path / "t.py").write_text(TEST_TOOLS)
    with pytest.raises(ConfigError, match=r"--tools .*t.py:undocumented: no JSON schema"):
        grpo_llm.Toolbox((f"{tmp_path / 't.py'}:undocumented",), 1.0)


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
    assert grpo_llm.format_prompt(renders, "2+2?", True, toolbox.schemas) == \
        "<|im_start|>tools\ncalculator,raises,sleeps,echo<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    listed = grpo_llm.format_prompt(ignores, "2+2?", True, toolbox.schemas)
    assert listed.startswith("<|im_start|>system\nYou may call these tools:\n" + json.dumps(toolbox.schemas[0]))
    assert listed.endswith("<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert grpo_llm.format_prompt(ignores, "2+2?", True) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_a_tool_result_is_appended_as_the_chat_template_renders_a_tool_message_after_the_turn():
    tokenizer = chat_tokenizer(CHATML)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    results = [grpo_llm.ToolResult("8<|im_<|im_end|>end|>4", False), grpo_llm.ToolResult("error: x", True)]  # no turn ends
    ids = grpo_llm.tool_message_ids(tokenizer, results, Args(chat_template=True), end_of_turn)
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
    monkeypatch.setattr(grpo_llm, "sample", scripted_sample(tokenizer, prompts, turns))
    models = SimpleNamespace(tokenizer=tokenizer, policy=torch.nn.Linear(1, 1), eos_token_ids=[EOS],
                             device=torch.device("cpu"), tools=toolbox)
    args = Args(max_new_tokens=max_new_tokens, max_tool_calls=max_tool_calls, tools=("calculator",))
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    return grpo_llm.generate(models, prompt_ids, args, greedy=False), tokenizer


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
                             eos_token_ids=[EOS], device=torch.device("cpu"), tools=grpo_llm.Toolbox(("calculator",), 1.0))
    prompt_ids = [tokenizer(p)["input_ids"] for p in ("37+48=", "3+4=", "15+43=")]
    torch.manual_seed(5)
    with_tools = grpo_llm.generate(models, prompt_ids, args, greedy=False)
    torch.manual_seed(5)
    single = grpo_llm.generate(models, prompt_ids, dataclasses.replace(args, max_tool_calls=0), greedy=False)
    assert with_tools["tool_mask"].sum() == 0 and with_tools["tool_calls"].sum() == 0
    for key, value in single.items():
        assert torch.equal(with_tools[key], value) if isinstance(value, torch.Tensor) else with_tools[key] == value, key


@pytest.fixture(scope="module")
def demo_rollout():
    """A sampled rollout of the tool demo's model, with calls in it."""
    tokenizer = AutoTokenizer.from_pretrained(TOOLS_DEMO / "model")
    policy = AutoModelForCausalLM.from_pretrained(TOOLS_DEMO / "model")
    models = SimpleNamespace(tokenizer=tokenizer, policy=policy, eos_token_ids=[tokenizer.eos_token_id],
                             device=torch.device("cpu"), tools=grpo_llm.Toolbox(("calculator",), 5.0))
    rows = [json.loads(line) for line in (TOOLS_DEMO / "eval.jsonl").read_text().splitlines()[:24]]
    torch.manual_seed(0)
    args = Args(tools=("calculator",), max_tool_calls=1)
    batch = grpo_llm.generate(models, [tokenizer(r["prompt"])["input_ids"] for r in rows], args, greedy=False)
    assert batch["tool_calls"].sum() >= 3 and (batch["tool_calls"] == 0).sum() >= 3  # both kinds of response
    return models, batch, args


def test_the_updates_logprobs_at_model_tokens_are_the_samplers_across_a_tool_call(demo_rollout):
    models, batch, args = demo_rollout
    rows = torch.arange(len(batch["responses"]))
    with torch.no_grad():
        update = grpo_llm.policy_forward(models.policy, batch, rows, args.temperature).logprobs
    c = batch["context_length"]
    for i in torch.nonzero(batch["tool_calls"]).flatten().tolist()[:4]:
        sequence = batch["query_responses"][i][batch["attention_mask"][i].bool()]  # no padding: as the sampler saw it
        prompt_length = int(batch["attention_mask"][i, :c].sum())
        with torch.no_grad():
            logp = models.policy(sequence[None]).logits[0].log_softmax(-1)
        for t in torch.nonzero(batch["response_mask"][i]).flatten().tolist():
            sampler = logp[prompt_length + t - 1, sequence[prompt_length + t]]
            torch.testing.assert_close(update[i, t], sampler, atol=1e-5, rtol=0)


def masked_micro_batch(monkeypatch, batch, at_tools):
    """micro_batch_backward on a rollout's masks, with the policy's log-probs and entropies as leaves; where the tools
    wrote, the entropy and the reference's log-prob are at_tools (None: as elsewhere). Returns (leaves, statistics)."""
    tool = batch["tool_mask"]
    g = torch.Generator().manual_seed(0)
    leaves = dict(logprobs=-torch.rand(tool.shape, generator=g), entropy=torch.rand(tool.shape, generator=g))
    old = leaves["logprobs"] - 0.1 * torch.rand(tool.shape, generator=g)
    ref = old - 0.3 * torch.rand(tool.shape, generator=g)
    if at_tools is not None:
        leaves["entropy"], ref = leaves["entropy"].masked_fill(tool, at_tools), ref.masked_fill(tool, at_tools)
    leaves = {k: v.requires_grad_() for k, v in leaves.items()}
    monkeypatch.setattr(grpo_llm, "policy_forward", lambda *a, **k: grpo_llm.PolicyOutput(leaves["logprobs"],
                                                                                      leaves["entropy"]))
    args = Args(ent_coef=0.01, kl_coef=0.1)
    batch = dict(batch, old_logprobs=old.masked_fill(tool, -50.0), ref_logprobs=ref,
                 advantages=torch.randn(len(old), generator=g))
    grpo_llm.loss_masks(batch, args)
    normalisers = {name: grpo_llm.loss_normalisers(batch["loss_mask"], args.loss_aggregation) for name in ("all", "pg")}
    stats = grpo_llm.micro_batch_backward(SimpleNamespace(autocast=contextlib.nullcontext, policy=None), batch,
                                        torch.arange(len(old)), dict(normalisers, rows=torch.tensor(len(old))), args)
    return leaves, stats


def test_tool_output_gets_no_gradient_and_stays_out_of_the_kl_and_entropy(monkeypatch, toolbox):
    batch, _ = scripted_rollout(monkeypatch, toolbox, TURNS)
    tool, model = batch["tool_mask"], batch["response_mask"]
    leaves, stats = masked_micro_batch(monkeypatch, batch, 40.0)  # far from everything where the tools wrote
    for name in ("logprobs", "entropy"):  # the policy loss, the KL term and the entropy bonus
        grad = leaves[name].grad
        assert (grad[tool] == 0).all() and (grad[model] != 0).all(), name
    _, same = masked_micro_batch(monkeypatch, batch, None)
    for key in ("losses/kl", "policy/entropy", "losses/policy_loss"):
        assert stats[key].item() == pytest.approx(same[key].item(), rel=1e-6), key
    expected = leaves["entropy"].detach()[model].sum().item() / model.sum().item()  # over the model's tokens alone
    assert stats["policy/entropy"].item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("script", ["default", "failing-tool", "slow-tool"])
def test_the_tool_demo_trains_and_reports_its_tool_metrics_and_a_failing_tool_ends_no_run(tiny, tmp_path, script):
    tools = {"default": ["calculator"], "failing-tool": [f"{tmp_path / 'bad.py'}:calculator"],
             "slow-tool": [f"{tmp_path / 'bad.py'}:calculator", "--tool-timeout", "0.01"]}[script]
    (tmp_path / "bad.py").write_text(  # a calculator that fails every call, or answers too late
        "import time\ndef calculator(expression: str) -> str:\n    '''Broken.\n\n    Args:\n        expression: any\n"
        "    '''\n" + ("    time.sleep(1)\n    return '0'\n" if script == "slow-tool" else "    raise RuntimeError('down')\n"))
    result = succeeded(run_main(tiny, tmp_path / "out", "--model-name-or-path", TOOLS_DEMO / "model", "--prompts-path",
                                TOOLS_DEMO / "train.jsonl", "--eval-prompts-path", TOOLS_DEMO / "eval.jsonl",
                                "--max-tool-calls", 1, "--num-prompts", 4, "--max-new-tokens", 16, "--sample-every", 1,
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
             "--num-prompts", 4, "--max-new-tokens", 16, "--num-iterations", 3, "--save-every", 1]
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
             "--max-tool-calls", 1, "--num-prompts", 2, "--max-new-tokens", 16, "--fsdp", "--eval-every", "0"]
    succeeded(torchrun(SCRIPT, *script_flags(tiny, tmp_path / "out", *flags)))
    metrics = read_metrics(tmp_path / "out")
    assert sorted(metrics) == [1, 2] and all(m["tools/calls_per_response"] > 0 for m in metrics.values())

def test_a_built_in_reward_judges_the_text_after_the_last_tool_output(monkeypatch, toolbox):
    batch, tokenizer = scripted_rollout(monkeypatch, toolbox, TURNS)
    assert grpo_llm.last_turns(tokenizer, batch) == ["6", "8", "wrong, try " + call("calculator", expression="x")]

def test_dynamic_sampling_keeps_each_groups_tool_masks_when_it_merges_its_rounds(tiny, tmp_path):
    flags = ["--model-name-or-path", TOOLS_DEMO / "model", "--prompts-path", TOOLS_DEMO / "train.jsonl",
             "--eval-prompts-path", TOOLS_DEMO / "eval.jsonl", "--tools", "calculator", "--max-tool-calls", 1,
             "--preset", "dapo", "--num-prompts", 4, "--max-new-tokens", 16, "--num-minibatches", 1,
             "--micro-batch-size", 16, "--eval-every", 0]
    rounds = []
    merge = grpo_llm.merge_rounds

    def merge_and_check(parts, pad_id):
        merged = merge(parts, pad_id)
        rounds.append(len(parts))
        for start, part in zip(itertools.accumulate([0] + [len(p["rows"]) for p in parts]), parts):
            rows, width = slice(start, start + len(part["rows"])), part["responses"].shape[1]
            for key in ("tool_mask", "response_mask"):  # each round's masks, padded on the right
                assert torch.equal(merged[key][rows, :width], part[key]) and not merged[key][rows, width:].any(), key
            assert torch.equal(merged["tool_calls"][rows], part["tool_calls"])
        attended = merged["attention_mask"][:, merged["context_length"]:].bool()
        assert torch.equal(attended, merged["tool_mask"] | merged["response_mask"])
        return merged

    with mock.patch.object(grpo_llm, "merge_rounds", merge_and_check):
        succeeded(run_main(tiny, tmp_path / "out", *flags))
    assert max(rounds) > 1 and read_metrics(tmp_path / "out")[2]["tools/calls_per_response"] > 0
