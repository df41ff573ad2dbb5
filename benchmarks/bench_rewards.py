"""Reward functions both sides of benchmarks/bench_trl.py load: ours with --reward-fn benchmarks/bench_rewards.py:NAME,
TRL's GRPOTrainer as reward_funcs. Same signature in both: (prompts, completions, **dataset columns) -> floats."""

import re

_FILLER = re.compile(r"<(\d+)>")


def exact_match(prompts, completions, answer, **_):
    """The demo's reward: 1.0 if the completion, stripped, is the answer (as ours' built-in exact_match)."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def even_tokens(prompts, completions, **_):
    """For the real-vocab shape's random model, whose samples are filler tokens <n> (bench_trl.py's tokenizer): the
    fraction of them with an even n. About 0.5 at the start, and learnable: half the vocabulary raises it."""
    scores = []
    for completion in completions:
        found = _FILLER.findall(completion)
        scores.append(sum(int(n) % 2 == 0 for n in found) / len(found) if found else 0.0)
    return scores


REWARDS = {"exact_match": exact_match, "even_tokens": even_tokens}
