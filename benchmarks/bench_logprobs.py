"""Training-time log-prob cost: ppo_llm.py's --chunked-logprobs against its default path, side by side.

  ours:  policy_forward with chunked=True: the final hidden states of the positions before the response tokens and
         the output head, through ResponseLogprobs (float32 logits / temperature a few positions at a time, its own
         backward pass: the logits never exist whole, nor their gradient).
  peer:  policy_forward with chunked=False, Part 1's definition: the model's logits at the response positions
         (logits_to_keep), log_softmax(logits.float() / temperature), gathered at the tokens.

For each: wall time of forward + backward of the mean log-prob (median of --repeats after --warmup), and peak
memory of that step. Model: a randomly initialised LlamaForCausalLM built in memory (no download), vocab 32000,
hidden 256, 2 layers, 4 heads; batch 8, prompt 384, response 128, no padding. Also checks the two variants'
log-probs (and entropies) agree. Run:
    python benchmarks/bench_logprobs.py                 # CPU, 2 threads
    python benchmarks/bench_logprobs.py --device cuda   # GPU
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ppo_llm import Batch, policy_forward


def log_probs(chunked: bool, entropy: bool):
    def of(model, seq, mask, ctx, temperature):
        batch = Batch(seq, mask, ctx, seq[:, ctx:], mask[:, ctx:].bool())
        return policy_forward(model, batch, temperature, chunked, entropy=entropy)[:2]
    return of


VARIANTS = {"ours": True, "peer": False}  # chunked


def child(a):
    """One variant in a fresh process, so its peak memory is not polluted by the other's."""
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    torch.manual_seed(0)  # same weights and tokens in both processes
    config = LlamaConfig(vocab_size=32000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=688, max_position_embeddings=a.prompt + a.response)
    model = LlamaForCausalLM(config).to(device)
    seq = torch.randint(0, config.vocab_size, (a.batch, a.prompt + a.response), device=device)
    mask = torch.ones_like(seq)
    fn = log_probs(VARIANTS[a.child], entropy=False)

    def step():
        model.zero_grad(set_to_none=True)
        logprobs, _ = fn(model, seq, mask, a.prompt, a.temperature)
        logprobs.mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    # Peak memory. CPU: ru_maxrss is the process's RSS high-water mark (KiB on Linux); the baseline is read after
    # imports, model and inputs exist, so the difference is what the forward + backward adds on top (activations,
    # logits, gradients). It is only honest because each variant runs in its own fresh process. CUDA: the
    # allocator's max_memory_allocated above what is allocated before the first step.
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base

    with torch.no_grad():  # untimed: outputs for the agreement check
        logprobs, entropy = log_probs(VARIANTS[a.child], entropy=True)(model, seq, mask, a.prompt, a.temperature)
    torch.save({"logprobs": logprobs.cpu(), "entropy": entropy.cpu()}, Path(a.out) / f"{a.child}.pt")
    print(json.dumps({"time": statistics.median(times), "peak": peak}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=384)
    p.add_argument("--response", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)

    print(f"device={a.device} threads={a.threads} batch={a.batch} prompt={a.prompt} response={a.response} "
          f"vocab=32000 temperature={a.temperature} median of {a.repeats} after {a.warmup} warm-up")
    res = {}
    with tempfile.TemporaryDirectory() as out:
        for name in VARIANTS:
            cmd = [sys.executable, __file__, "--child", name, "--out", out] + sys.argv[1:]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode:
                sys.exit(f"{name} failed:\n{proc.stderr}")
            res[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        o, q = (torch.load(Path(out) / f"{n}.pt") for n in VARIANTS)

    dlp = (o["logprobs"] - q["logprobs"]).abs().max().item()
    dent = (o["entropy"] - q["entropy"]).abs().max().item()
    print(f"\n{'variant':<8}{'fwd+bwd (ms)':>14}{'peak mem (MiB)':>16}")
    for name, r in res.items():
        print(f"{name:<8}{r['time'] * 1e3:>14.1f}{r['peak'] / 2**20:>16.1f}")
    print(f"{'peer/ours':<8}{res['peer']['time'] / res['ours']['time']:>13.2f}x"
          f"{res['peer']['peak'] / res['ours']['peak']:>15.2f}x")
    print(f"\nmax |logprob ours - peer| = {dlp:.2e}   max |entropy ours - peer| = {dent:.2e}"
          f"   (log-probs span {o['logprobs'].min():.2f}..{o['logprobs'].max():.2f})")
    if dlp > 1e-4:
        sys.exit("log-probs disagree")


if __name__ == "__main__":
    main()
