"""Build the offline tool-calling demo (rerun with `python demo/make_tools_demo.py`): demo/tools/.

What it builds (paths relative to demo/tools/):
  model/       a tiny Llama causal LM (Hugging Face format, float32 safetensors) and a tokenizer whose tokens are
               <pad>, <eos>, the numbers 0-99 (a number is split into two-digit tokens from the left: 1776 -> 17 76),
               '*', '=', and four tokens for the Hermes tool-call format:
                 <tool_call>{"name": "calculator", "arguments": {"expression": "    "}}</tool_call>
                 <tool_response>    </tool_response>
  train.jsonl  RL training prompts  {"prompt": "37*48=", "answer": "1776"}, a and b in 10..99
  eval.jsonl   held-out RL eval prompts (disjoint from train.jsonl)

The task: a two-digit product. The SFT annotator uses the calculator on P_TOOL of the problems:
    37*48=<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call><eos>
          <tool_response>1776</tool_response>1776<eos>
(the tool response is context: no loss on it). On the others it answers at once with an estimate, the product of
both numbers rounded to tens (37*48 -> 40*50 = 2000), which is right only where both are multiples of ten. The SFT
model learns both: greedy decoding takes the more likely way, the estimate, and scores about 0; sampling calls the
calculator on about P_TOOL of the prompts and is then right as often as it copies the expression and the result
correctly. RL with an exact-match reward on the final answer (the text after the last tool response) should make it
call the calculator on every prompt. Everything is seeded; SFT uses plain PyTorch on 2 CPU threads.
"""

import json
import os
import random
import time

import torch
import torch.nn.functional as F
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools")
SEED, P_TOOL = 0, 0.3
N_TRAIN, N_EVAL = 4000, 200
SFT_STEPS, SFT_BATCH, SFT_LR, WARMUP = 1500, 256, 3e-3, 100
PAD, EOS = "<pad>", "<eos>"
CALL_OPEN, CALL_CLOSE = '<tool_call>{"name": "calculator", "arguments": {"expression": "', '"}}</tool_call>'
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"


def build_tokenizer():
    vocab = {PAD: 0, EOS: 1}
    for token in [str(n) for n in range(10)] + [f"{n:02d}" for n in range(100)] + ["*", "=", CALL_OPEN, CALL_CLOSE,
                                                                                    RESULT_OPEN, RESULT_CLOSE]:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\d\d|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in (CALL_OPEN, CALL_CLOSE, RESULT_OPEN,
                                                                             RESULT_CLOSE)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="left",
                                   clean_up_tokenization_spaces=False, model_max_length=32)


def build_model(vocab_size):
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(pad_token_id=0, eos_token_id=1, bos_token_id=None, max_new_tokens=16)
    return model


def estimate(a, b):
    return (a + 5) // 10 * 10 * ((b + 5) // 10 * 10)


def example(tok, a, b, use_tool):
    """(token ids, loss mask) of one SFT example: the prompt and the tool response are context, the rest targets."""
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    parts = [(ids(f"{a}*{b}="), 0)]
    if use_tool:
        parts += [(ids(f"{CALL_OPEN}{a}*{b}{CALL_CLOSE}") + [tok.eos_token_id], 1),
                  (ids(f"{RESULT_OPEN}{a * b}{RESULT_CLOSE}"), 0), (ids(str(a * b)) + [tok.eos_token_id], 1)]
    else:
        parts += [(ids(str(estimate(a, b))) + [tok.eos_token_id], 1)]
    return [t for p, _ in parts for t in p], [m for p, m in parts for _ in p]


def train_sft(model, tok, held_out):
    rng = random.Random(SEED + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.01, betas=(0.9, 0.98))
    schedule = lambda s: min(1.0, (s + 1) / WARMUP) * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * s / SFT_STEPS)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float(schedule(s)))
    model.train()
    start = time.time()
    for step in range(SFT_STEPS):
        examples = []
        while len(examples) < SFT_BATCH:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            if (a, b) not in held_out:
                examples.append(example(tok, a, b, rng.random() < P_TOOL))
        width = max(len(ids) for ids, _ in examples)
        ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in examples])
        labels = torch.tensor([[t if m else -100 for t, m in zip(i, k)] + [-100] * (width - len(i))
                               for i, k in examples])
        attention = (torch.arange(width)[None] < torch.tensor([len(i) for i, _ in examples])[:, None]).long()
        logits = model(input_ids=ids, attention_mask=attention).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 250 == 0 or step == SFT_STEPS - 1:
            print(f"sft step {step:5d}  loss {loss.item():.4f}  {time.time() - start:6.1f}s", flush=True)
    model.eval()
    return time.time() - start


def main():
    random.seed(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    rng = random.Random(SEED)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    eval_pairs, train_pairs = pairs[:N_EVAL], pairs[N_EVAL : N_EVAL + N_TRAIN]
    os.makedirs(HERE, exist_ok=True)
    for name, rows in (("train.jsonl", train_pairs), ("eval.jsonl", eval_pairs)):
        with open(os.path.join(HERE, name), "w") as f:
            f.writelines(json.dumps({"prompt": f"{a}*{b}=", "answer": str(a * b)}) + "\n" for a, b in rows)
    tok = build_tokenizer()
    assert tok("37*48=")["input_ids"] == [tok.convert_tokens_to_ids(t) for t in ("37", "*", "48", "=")]
    model = build_model(len(tok))
    seconds = train_sft(model, tok, set(eval_pairs))
    model.save_pretrained(os.path.join(HERE, "model"))
    tok.save_pretrained(os.path.join(HERE, "model"))
    tok = AutoTokenizer.from_pretrained(os.path.join(HERE, "model"))
    text = f"{CALL_OPEN}37*48{CALL_CLOSE}{RESULT_OPEN}1776{RESULT_CLOSE}1776"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    print(f"SFT {seconds:.0f}s, {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main()
