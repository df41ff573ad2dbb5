"""Tests for grpo_llm.py: one behaviour per test, expected values derived independently (a plain Python loop, a
hand-computed case, or an identity from the papers). End-to-end runs use the script as a subprocess on tiny models
built here from a config, so nothing is ever downloaded.

Run: python -m pytest -q test_grpo_llm.py
"""

import math
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM, LlamaForSequenceClassification

from conftest import EOS, PAD, SUBPROCESS_ENV, char_tokenizer, llama_config, non_timing, read_metrics, succeeded, write_jsonl
from grpo_llm import (
    PRESETS,
    aggregate_loss,
    clipped_surrogate_loss,
    combine_rewards,
    group_advantages,
    importance_ratio,
    kl_penalty,
    masked_mean,
    merge_rounds,
    overlong_penalty,
    parse_args,
    response_mask_from_eos,
    select_groups,
    zero_std_groups,
)

REPO = Path(__file__).resolve().parent
SCRIPT = REPO / "grpo_llm.py"
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
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    paths = SimpleNamespace(root=root, policy=root / "policy", rm=root / "rm")
    LlamaForCausalLM(llama_config()).save_pretrained(paths.policy)
    char_tokenizer().save_pretrained(paths.policy)
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
    return paths


def run_script(tiny, output_dir, *flags):
    """The script as a user runs it, with tiny budgets; returns the CompletedProcess."""
    command = [
        sys.executable, str(SCRIPT),
        "--model-name-or-path", str(tiny.policy),
        "--prompts-path", str(tiny.train),
        "--eval-prompts-path", str(tiny.eval),
        "--output-dir", str(output_dir),
        "--num-iterations", "2", "--num-prompts", "2", "--num-generations", "4", "--max-new-tokens", "4",
        "--micro-batch-size", "4", "--eval-every", "1", "--sample-every", "0", "--save-every", "0",
        *map(str, flags),
    ]
    return subprocess.run(command, cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300)


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


# ---------------------------------------------------------------------------------------------------------
# Clipped surrogate: loss = max(-A*w, -A*clip(w, 1-eps_low, 1+eps_high)), DAPO Clip-Higher, Dual-Clip
# ---------------------------------------------------------------------------------------------------------


def surrogate(ratio, advantage, **kw):
    loss, low, high = clipped_surrogate_loss(torch.tensor([ratio]), torch.tensor([advantage]), 0.2, **kw)
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
# DAPO's data side: dynamic sampling and the soft overlong penalty
# ---------------------------------------------------------------------------------------------------------


def test_zero_std_groups_are_exactly_the_groups_with_all_rewards_equal():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 0.0, 0.0, 1e-3])
    assert zero_std_groups(rewards, 3).tolist() == [True, False, True, False]


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
# Presets and the command line
# ---------------------------------------------------------------------------------------------------------


def test_dapo_preset_gives_dapos_published_knobs():
    args = parse_args(["--preset", "dapo", "--max-new-tokens", "20"])
    assert (args.clip_eps, args.clip_eps_high) == (0.2, 0.28)
    assert args.dynamic_sampling is True
    assert args.loss_aggregation == "token-mean"
    assert args.kl_coef == 0.0
    assert args.overlong_buffer_length == 20 // 5


def test_an_explicit_flag_overrides_its_preset_and_leaves_the_other_knobs():
    args = parse_args(["--preset", "dapo", "--clip-eps-high", "0.3"])
    assert args.clip_eps_high == 0.3
    assert (args.dynamic_sampling, args.loss_aggregation, args.kl_coef) == (True, "token-mean", 0.0)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_sets_its_knobs(preset):
    args = parse_args(["--preset", preset])
    for knob, value in PRESETS[preset].items():
        if value is not None or knob != "overlong_buffer_length":  # None there is resolved to a fifth of L_max
            assert getattr(args, knob) == value, knob


def help_block(text, flag):
    """The help entry of one flag, joined into one line (tyro wraps and boxes it)."""
    lines = [line.strip("│ ") for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith(flag + " "))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("--"))
    return " ".join(lines[start:end])


@pytest.mark.parametrize("preset, shown", [("dapo", "(default: 0.28)"), ("grpo", "(default: None)")])
def test_help_shows_the_presets_resolved_defaults(preset, shown, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--preset", preset, "--help"])
    assert shown in help_block(capsys.readouterr().out, "--clip-eps-high")


# ---------------------------------------------------------------------------------------------------------
# End to end: the script as a subprocess on the tiny models
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tiny):
    """Two GRPO iterations with exact match plus a reward that varies within groups, a checkpoint each iteration."""
    output_dir = tiny.root / "trained"
    succeeded(run_script(tiny, output_dir, "--reward-fn", "exact_match", tiny.digit_sum, "--save-every", "1"))
    return SimpleNamespace(dir=output_dir, metrics=read_metrics(output_dir))


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


def test_metrics_log_the_eval_before_the_first_update_as_iteration_zero(trained):
    assert "eval/reward" in trained.metrics[0] and "policy/ratio" not in trained.metrics[0]


def test_rollout_kl_is_zero_before_the_first_update_and_positive_after_it(trained):
    # Iteration 1 samples from the initial policy, which is the reference; iteration 2 from the updated policy.
    assert trained.metrics[1]["objective/kl"] == 0.0
    assert trained.metrics[2]["objective/kl"] > 0.0


def test_resumed_run_continues_exactly_where_the_checkpoint_left_off(tiny, trained):
    output_dir = tiny.root / "resumed"
    succeeded(run_script(tiny, output_dir, "--reward-fn", "exact_match", tiny.digit_sum, "--save-every", "1",
                         "--resume-from", trained.dir / "checkpoint-1"))
    resumed = read_metrics(output_dir)
    assert sorted(resumed) == [2]
    assert non_timing(resumed[2]) == non_timing(trained.metrics[2])
    after, expected = weights(output_dir / "policy"), weights(trained.dir / "policy")
    assert all(torch.equal(after[name], expected[name]) for name in expected)


def test_with_learning_rate_zero_the_recomputed_ratio_is_one_and_nothing_is_clipped(tiny):
    # Two epochs, so pi_old is really recomputed in a separate forward pass before the update.
    output_dir = tiny.root / "lr0"
    succeeded(run_script(tiny, output_dir, "--reward-fn", tiny.digit_sum, "--learning-rate", "0", "--num-epochs", "2"))
    metrics = read_metrics(output_dir)
    for iteration in (1, 2):
        assert metrics[iteration]["policy/ratio"] == pytest.approx(1.0, abs=1e-5)
        assert metrics[iteration]["policy/approx_kl"] < 1e-8  # a mean ratio of 1 could hide ratios on both sides of 1
        assert metrics[iteration]["policy/clipfrac"] == 0.0


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_trains_end_to_end(tiny, preset):
    # has_one leaves about a third of the groups flat, so DAPO's dynamic sampling really resamples and merges rounds.
    output_dir = tiny.root / f"preset-{preset}"
    result = succeeded(run_script(tiny, output_dir, "--preset", preset, "--reward-fn", tiny.has_one))
    assert result.stdout.startswith(f"preset {preset}:")
    metrics = read_metrics(output_dir)
    assert sorted(metrics) == [0, 1, 2]
    assert all(math.isfinite(metrics[i]["losses/policy_loss"]) for i in (1, 2))


def test_reward_model_alone_is_the_reward(tiny):
    output_dir = tiny.root / "rm-alone"
    succeeded(run_script(tiny, output_dir, "--reward-model-path", tiny.rm))
    metrics = read_metrics(output_dir)
    for iteration in (1, 2):
        m = metrics[iteration]
        assert "rewards/exact_match/mean" not in m and m["rewards/reward_model/mean"] != 0.0
        assert m["objective/reward"] == pytest.approx(m["rewards/reward_model/mean"], abs=1e-6)


def test_reward_weights_apply_to_the_reward_functions_then_the_reward_model(tiny):
    output_dir = tiny.root / "rm-combined"
    succeeded(run_script(tiny, output_dir, "--reward-fn", "exact_match", "--reward-model-path", tiny.rm,
                         "--reward-weights", "1", "0.5"))
    metrics = read_metrics(output_dir)
    for iteration in (1, 2):
        m = metrics[iteration]
        assert m["rewards/reward_model/mean"] != 0.0
        expected = 1.0 * m["rewards/exact_match/mean"] + 0.5 * m["rewards/reward_model/mean"]
        assert m["objective/reward"] == pytest.approx(expected, abs=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Bad input: one line "error: ..." on stderr and a non-zero exit
# ---------------------------------------------------------------------------------------------------------


BAD_INPUT = {
    "one generation with a group baseline": (lambda t: ["--num-generations", "1"], "--num-generations 1"),
    "unknown preset": (lambda t: ["--preset", "ppo"], "unknown --preset 'ppo'"),
    "reward weights that do not match the rewards": (
        lambda t: ["--reward-fn", "exact_match", t.digit_sum, "--reward-weights", "1"], "has 1 values for 2 rewards"),
    "missing model directory": (lambda t: ["--model-name-or-path", str(t.root / "no-model")], "no such directory"),
    "missing prompts file": (lambda t: ["--prompts-path", str(t.root / "no.jsonl")], "file not found"),
    "malformed prompts file": (lambda t: ["--prompts-path", str(t.malformed)], "line 2: not valid JSON"),
    "reward function that cannot be imported": (lambda t: ["--reward-fn", t.missing_fn], "cannot be imported"),
    "reward function returning the wrong length": (
        lambda t: ["--reward-fn", t.wrong_length], "returned 1 values for"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_error_line_and_a_nonzero_exit(tiny, tmp_path, case):
    flags, message = BAD_INPUT[case]
    result = run_script(tiny, tmp_path / "out", *flags(tiny))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
