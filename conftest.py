"""Shared by test_ppo_llm.py and test_grpo_llm.py: tiny character-level models built from a config (loaded through
the same from_pretrained path as a real model, never downloaded) and helpers to run and read the scripts."""

import json
import math
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast

# Tiny models run fastest on one thread, and OpenMP threads spin badly when the two cores are shared.
torch.set_num_threads(1)
SUBPROCESS_ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

CHARS = "0123456789+="
VOCAB = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
PAD, EOS = 0, 1


def char_tokenizer(pad_token="<pad>", vocab=VOCAB):
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad_token, eos_token="<eos>", padding_side="left")


def llama_config(pad_token_id=PAD, vocab_size=len(VOCAB), **extra):
    return LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                       pad_token_id=pad_token_id, eos_token_id=EOS, bos_token_id=None, **extra)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def succeeded(result):
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def read_metrics(output_dir):
    """metrics.jsonl as {iteration: row}; row 0 is the eval before the first update."""
    rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    by_iteration = {row["iteration"]: row for row in rows}
    assert len(by_iteration) == len(rows), "an iteration was logged twice"
    return by_iteration


def non_timing(metrics):
    """Everything but wall-clock measurements; NaN becomes a string so that NaN == NaN."""
    return {k: ("nan" if isinstance(v, float) and math.isnan(v) else v)
            for k, v in metrics.items() if not k.startswith(("time/", "perf/"))}
