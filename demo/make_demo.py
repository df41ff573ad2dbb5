"""Build the offline demo assets for ppo_llm.py (rerun with `python demo/make_demo.py`; `--tools` builds the
tool-calling demo in demo/tools/ instead, with make_tools_demo.py).

What it builds (all paths relative to this file's folder, demo/):
  model/       a tiny Llama causal LM (Hugging Face format, float32 safetensors) plus a
               character-level tokenizer (<pad>=0, <eos>=1, then digits, '+', '=', ' ').
               It also loads as AutoModelForSequenceClassification(num_labels=1), so the
               same directory can initialise a reward model / value head.
  train.jsonl  RL training prompts  {"prompt": "374+58=", "answer": "432"}
  eval.jsonl   held-out RL eval prompts (prompts disjoint from train.jsonl)
  ptx.txt      correct worked examples ("374+58=432"), one per line, for a
               pretraining-mix LM loss.

Why: the PPO demo must visibly improve a model in a couple of CPU minutes with an
exact-match reward. So the shipped "SFT model" has a systematic, RL-fixable error
instead of being merely weak.

Task: a + b where a is a uniform 3-digit number (100..999) and b has 1 or 2 digits with
equal probability (uniform in 1..9 or in 10..99). The answer is written normally (most
significant digit first) and followed by <eos>. A problem "needs a carry" if column
addition carries anywhere (units or tens column, including a carry propagated into the
hundreds). About 38.75% of problems need no carry (b 1-digit: 1/2; b 2-digit: 0.55*0.5).

Sloppy annotator: the SFT targets were written by an annotator who forgets carries.
On a problem that needs a carry, the SFT target is, with probability P_SLOPPY, the
"no-carry" answer (each digit is (a_i + b_i) mod 10, all carries dropped, e.g.
374+58 -> 322 instead of 432), and otherwise the correct answer; no-carry problems are
always labelled correctly. The SFT model learns both modes: greedy decoding picks the
more likely, wrong, no-carry answer on carry problems (greedy exact-match accuracy
~= the no-carry share, i.e. roughly 0.3-0.45), while sampling at temperature 1 still
puts roughly (1 - P_SLOPPY) of its mass on the correct answer, so PPO with an
exact-match reward gets signal and can move the policy to always carry.
train.jsonl / eval.jsonl / ptx.txt always hold the CORRECT answers.

SFT: plain PyTorch AdamW, cross-entropy only on the answer + <eos> tokens, fresh problems
every step (eval prompts are never used in SFT), 2 CPU threads, everything seeded.
eval.jsonl is stratified to hold exactly round(200 * 0.3875) = 78 no-carry problems (the
population share), so its greedy start does not hinge on a lucky or unlucky 200-row draw.
The script ends by measuring greedy and sampled (temperature 1) accuracy on eval.jsonl,
split by carry / no-carry, with left-padded batched model.generate (checked against
unbatched generation), and the model size.
"""

import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DIR = os.path.join(HERE, "model")

SEED = 0
P_SLOPPY = 0.65  # prob. that the annotator drops the carries on a carry problem
N_TRAIN, N_EVAL, N_PTX = 4000, 200, 500
SFT_STEPS, SFT_BATCH, SFT_LR, WARMUP = 2000, 256, 3e-3, 100
NO_CARRY_SHARE = 0.3875  # exact share of no-carry problems in the task distribution

PAD, EOS = "<pad>", "<eos>"
CHARS = "0123456789+= "


# ----------------------------------------------------------------------------- task
def sample_problem(rng):
    a = rng.randint(100, 999)
    b = rng.randint(1, 9) if rng.random() < 0.5 else rng.randint(10, 99)
    return a, b


def no_carry_sum(a, b):
    da, db = str(a), str(b).rjust(len(str(a)), "0")
    return int("".join(str((int(x) + int(y)) % 10) for x, y in zip(da, db)))


def needs_carry(a, b):
    return no_carry_sum(a, b) != a + b


def prompt_of(a, b):
    return f"{a}+{b}="


def parse_prompt(prompt):
    a, b = prompt.rstrip("=").split("+")
    return int(a), int(b)


# ------------------------------------------------------------------------ tokenizer
def build_tokenizer():
    vocab = {PAD: 0, EOS: 1}
    for c in CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # 1 char = 1 token
    tok.decoder = decoders.Fuse()  # join tokens without spaces
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=32,
    )
    return hf_tok


# ---------------------------------------------------------------------------- model
def build_model(vocab_size):
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=0, eos_token_id=1, bos_token_id=None, max_new_tokens=5
    )
    return model


def make_batch(tok, rng, eval_prompts, batch_size):
    """Right-padded SFT batch; labels = -100 except on answer + <eos> tokens."""
    seqs, masks = [], []
    for _ in range(batch_size):
        while True:
            a, b = sample_problem(rng)
            if prompt_of(a, b) not in eval_prompts:
                break
        if needs_carry(a, b) and rng.random() < P_SLOPPY:
            ans = no_carry_sum(a, b)
        else:
            ans = a + b
        p_ids = tok(prompt_of(a, b))["input_ids"]
        a_ids = tok(str(ans))["input_ids"] + [tok.eos_token_id]
        seqs.append(p_ids + a_ids)
        masks.append([0] * len(p_ids) + [1] * len(a_ids))
    L = max(len(s) for s in seqs)
    ids = torch.full((batch_size, L), tok.pad_token_id, dtype=torch.long)
    att = torch.zeros((batch_size, L), dtype=torch.long)
    lab = torch.full((batch_size, L), -100, dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
        lab[i, : len(s)] = torch.tensor([t if k else -100 for t, k in zip(s, m)])
    return ids, att, lab


def train_sft(model, tok, eval_prompts):
    rng = random.Random(SEED + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / WARMUP)
        * 0.5 * (1 + math.cos(math.pi * min(1.0, s / SFT_STEPS))),
    )
    model.train()
    t0 = time.time()
    for step in range(SFT_STEPS):
        ids, att, lab = make_batch(tok, rng, eval_prompts, SFT_BATCH)
        logits = model(input_ids=ids, attention_mask=att).logits
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), lab[:, 1:].reshape(-1), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 250 == 0 or step == SFT_STEPS - 1:
            print(f"sft step {step:5d}  loss {loss.item():.4f}  {time.time() - t0:6.1f}s", flush=True)
    model.eval()
    return time.time() - t0


# ----------------------------------------------------------------------- evaluation
@torch.no_grad()
def generate_answers(model, tok, prompts, do_sample, batch_size=256):
    outs = []
    for i in range(0, len(prompts), batch_size):
        enc = tok(prompts[i : i + batch_size], return_tensors="pt", padding=True)
        kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
        gen = model.generate(
            **enc, max_new_tokens=5, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **kw
        )
        for row in gen[:, enc["input_ids"].shape[1] :].tolist():
            if tok.eos_token_id in row:
                row = row[: row.index(tok.eos_token_id)]
            outs.append(tok.decode(row, skip_special_tokens=True))
    return outs


@torch.no_grad()
def answer_logprob(model, tok, prompt, answer):
    """log p(answer + <eos> | prompt) under the model (teacher forcing)."""
    p = tok(prompt)["input_ids"]
    a = tok(answer)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([p + a])
    logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
    return sum(logp[len(p) - 1 + k, t].item() for k, t in enumerate(a))


def split_acc(rows, preds):
    c = [p == r["answer"] for r, p in zip(rows, preds)]
    carry = [x for x, r in zip(c, rows) if needs_carry(*parse_prompt(r["prompt"]))]
    nocar = [x for x, r in zip(c, rows) if not needs_carry(*parse_prompt(r["prompt"]))]
    mean = lambda xs: sum(xs) / max(1, len(xs))
    return mean(c), mean(carry), mean(nocar)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main():
    random.seed(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(2)

    # ---- data: eval first, then disjoint train, then ptx text
    rng = random.Random(SEED)
    eval_prompts, train_prompts = {}, {}
    # eval is stratified: exactly round(N_EVAL * NO_CARRY_SHARE) no-carry problems, so that
    # 200 rows reflect the distribution's carry share instead of a lucky/unlucky draw.
    n_no_carry = round(N_EVAL * NO_CARRY_SHARE)
    quota = {False: n_no_carry, True: N_EVAL - n_no_carry}  # keyed by needs_carry
    while len(eval_prompts) < N_EVAL:
        a, b = sample_problem(rng)
        if prompt_of(a, b) not in eval_prompts and quota[needs_carry(a, b)] > 0:
            quota[needs_carry(a, b)] -= 1
            eval_prompts[prompt_of(a, b)] = a + b
    while len(train_prompts) < N_TRAIN:
        a, b = sample_problem(rng)
        if prompt_of(a, b) not in eval_prompts:
            train_prompts[prompt_of(a, b)] = a + b
    eval_rows = [{"prompt": p, "answer": str(s)} for p, s in eval_prompts.items()]
    train_rows = [{"prompt": p, "answer": str(s)} for p, s in train_prompts.items()]
    ptx_lines = []
    while len(ptx_lines) < N_PTX:
        a, b = sample_problem(rng)
        if prompt_of(a, b) not in eval_prompts:
            ptx_lines.append(f"{prompt_of(a, b)}{a + b}")
    write_jsonl(os.path.join(HERE, "train.jsonl"), train_rows)
    write_jsonl(os.path.join(HERE, "eval.jsonl"), eval_rows)
    with open(os.path.join(HERE, "ptx.txt"), "w") as f:
        f.write("\n".join(ptx_lines) + "\n")
    share = lambda rows: sum(not needs_carry(*parse_prompt(r["prompt"])) for r in rows) / len(rows)
    print(f"no-carry share: train {share(train_rows):.3f}  eval {share(eval_rows):.3f}  (population {NO_CARRY_SHARE}; eval is stratified)")

    # ---- tokenizer + model
    tok = build_tokenizer()
    ids = tok("37+48=")["input_ids"]
    assert len(ids) == 6 and tok.decode(ids + [1, 0], skip_special_tokens=True) == "37+48="
    model = build_model(len(tok))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model params: {n_params}")

    train_time = train_sft(model, tok, set(eval_prompts))

    os.makedirs(MODEL_DIR, exist_ok=True)
    model.save_pretrained(MODEL_DIR, safe_serialization=True)
    tok.save_pretrained(MODEL_DIR)

    # ---- reload exactly as users will, and check everything
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    assert tok.pad_token_id == 0 and tok.eos_token_id == 1 and tok.padding_side == "left"
    assert tok("37+48=")["input_ids"] == [tok.convert_tokens_to_ids(c) for c in "37+48="]
    assert tok.decode(tok("37+48=85")["input_ids"], skip_special_tokens=True) == "37+48=85"
    transformers.logging.set_verbosity_error()  # the new score head is expected to be missing
    AutoModelForSequenceClassification.from_pretrained(MODEL_DIR, num_labels=1)
    transformers.logging.set_verbosity_warning()

    prompts = [r["prompt"] for r in eval_rows]
    torch.manual_seed(SEED)
    greedy = generate_answers(model, tok, prompts, do_sample=False)
    unbatched = [generate_answers(model, tok, [p], do_sample=False)[0] for p in prompts]
    n_diff = sum(x != y for x, y in zip(greedy, unbatched))
    assert n_diff == 0, f"batched vs unbatched greedy differ on {n_diff} prompts"
    g_all, g_car, g_no = split_acc(eval_rows, greedy)
    n_samp = 8
    s = [split_acc(eval_rows, generate_answers(model, tok, prompts, do_sample=True)) for _ in range(n_samp)]
    s_all, s_car, s_no = (sum(x[i] for x in s) / n_samp for i in range(3))
    carry_rows = [r for r in eval_rows if needs_carry(*parse_prompt(r["prompt"]))]
    pm_correct = sum(math.exp(answer_logprob(model, tok, r["prompt"], r["answer"])) for r in carry_rows) / len(carry_rows)
    pm_nocarry = sum(
        math.exp(answer_logprob(model, tok, r["prompt"], str(no_carry_sum(*parse_prompt(r["prompt"])))))
        for r in carry_rows
    ) / len(carry_rows)
    size = sum(os.path.getsize(os.path.join(MODEL_DIR, f)) for f in os.listdir(MODEL_DIR))

    print("\n===== demo SFT model on eval.jsonl =====")
    print(f"greedy accuracy          : {g_all:.3f}  (carry {g_car:.3f}, no-carry {g_no:.3f})")
    print(f"sampled accuracy (T=1)   : {s_all:.3f}  (carry {s_car:.3f}, no-carry {s_no:.3f})  mean of {n_samp} draws")
    print(f"carry problems: mean p(correct answer) {pm_correct:.3f}, p(no-carry answer) {pm_nocarry:.3f}")
    print(f"batched == unbatched greedy generation on all {len(prompts)} prompts")
    print(f"SFT train time {train_time:.0f}s, params {n_params}, model dir {size / 1e6:.2f} MB")


if __name__ == "__main__":
    if sys.argv[1:] == ["--tools"]:  # the tool-calling demo, demo/tools/ (make_tools_demo.py)
        import make_tools_demo

        make_tools_demo.main()
    else:
        main()
