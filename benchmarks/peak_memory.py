"""Run a Python script as its users launch it (`python SCRIPT ARGS...`) and write its peak memory to a JSON file.

  python benchmarks/peak_memory.py PEAK.json SCRIPT ARGS...

On a GPU the peak is the CUDA caching allocator's high-water mark (torch.cuda.max_memory_allocated, and
max_memory_reserved beside it: what the allocator held from the driver), counted from the script's start; without one
it is the process's peak resident memory (getrusage's ru_maxrss). gpu_check.py runs each side through it, so that both
are measured alike: the scripts themselves log no memory.
"""

import json
import resource
import runpy
import sys
from pathlib import Path

import torch


def peak_memory() -> dict:
    if torch.cuda.is_available():
        return dict(kind="cuda max_memory_allocated", bytes=torch.cuda.max_memory_allocated(),
                    reserved_bytes=torch.cuda.max_memory_reserved())
    return dict(kind="peak RSS (no GPU)", bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def main() -> None:
    out, script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)  # what `python SCRIPT` puts first
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        runpy.run_path(script, run_name="__main__")  # its `if __name__ == "__main__":` block runs, as when launched
    finally:
        Path(out).write_text(json.dumps(peak_memory()))


if __name__ == "__main__":
    main()
