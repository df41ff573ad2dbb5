"""benchmarks/gpu_check.py on the CPU: its checks against fabricated metrics rows, its exit status when a check fails,
and one end-to-end run at the tiny shape (--device cpu --tiny), so that the GPU check cannot rot between GPU runs."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


@pytest.fixture(scope="module")
def demo_runs():
    """Overrides conftest.py's autouse fixture for this module, which needs none of the demo runs: started alone, its
    tests would otherwise share the two cores with them."""
    yield None


def row(iteration=1, **overrides):
    """A metrics.jsonl row of a training iteration, as grpo_llm.py writes one, that passes every check."""
    base = {"iteration": iteration, "time/iteration": 1.0, "time/generate": 0.5, "time/update": 0.4,
            "rollout/response_length": 8.0, "objective/kl": 0.0, "policy/ratio": 1.0,
            "losses/policy_loss": 0.1, "losses/kl": 0.0}
    return {**base, **overrides}


def failed(result):
    return sorted(check for check, seen in result.items() if not seen["passed"])


def test_checks_pass_on_good_rows():
    assert failed(gpu_check.checks("ours-grpo", 0, [row(1), row(2)])) == []
    assert failed(gpu_check.checks("trl-grpo", 0, [row(1, **{"objective/kl_per_token": 0.0})])) == []


@pytest.mark.parametrize("name, code, rows, expected", [
    ("ours-grpo", 0, [row(1), row(2, **{"losses/policy_loss": math.nan})], ["finite"]),
    ("ours-ppo", 0, [row(1, **{"losses/value_loss": math.inf})], ["finite"]),
    ("ours-dapo", 0, [row(1, **{"losses/policy_loss": None})], ["finite"]),
    ("ours-ppo", 0, [{k: v for k, v in row(1).items() if not k.startswith("losses/")}], ["finite"]),
    ("ours-grpo", 0, [row(1, **{"objective/kl": 0.5})], ["kl0"]),  # 0.5 / 8 tokens per token
    ("ours-ppo", 0, [row(1, **{"objective/kl": math.nan})], ["kl0"]),
    ("trl-grpo", 0, [row(1, **{"objective/kl_per_token": -0.01})], ["kl0"]),
    ("ours-grpo", 0, [{k: v for k, v in row(1).items() if k != "objective/kl"}], ["kl0"]),
    ("ours-grpo", 0, [row(1), row(2, **{"policy/ratio": 1.01})], ["ratio1"]),
    ("ours-grpo", 0, [row(1, **{"policy/ratio": 1.0}), row(2, **{"policy/ratio": math.nan})], ["ratio1"]),
    ("ours-grpo", 1, [row(1)], ["exit"]),
    ("ours-grpo", "timeout", [row(1)], ["exit"]),
    ("ours-grpo", 0, [], ["rows"]),
])
def test_checks_detect_failures(name, code, rows, expected):
    assert failed(gpu_check.checks(name, code, rows)) == expected


def test_only_the_first_iteration_needs_zero_kl():
    assert failed(gpu_check.checks("ours-grpo", 0, [row(1), row(2, **{"objective/kl": 3.0})])) == []


def test_a_failed_check_exits_1_and_says_what_failed(monkeypatch, capsys, tmp_path):
    """main with each run's metrics fabricated: a NaN loss in ours-ppo's second iteration fails the whole check."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what main sets for --tiny, undone after the test
    models = dict(policy=str(tmp_path), reward=str(tmp_path), policy_params=1000, scorer_params=500)
    monkeypatch.setattr(gpu_check, "build_models", lambda *args: models)

    def launch(command, out, device, timeout):
        out.mkdir(parents=True)
        (out / "console.log").write_text("the run's console\n")
        bad = "ppo_llm.py" in command[3]
        return 0, [row(1), row(2, **{"losses/policy_loss": math.nan if bad else 0.1})], {"bytes": 2**30}

    monkeypatch.setattr(gpu_check, "launch", launch)
    assert gpu_check.main(["--device", "cpu", "--tiny", "--runs", "ours-grpo", "ours-ppo"]) == 1
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line.get("run") for line in lines] == ["ours-grpo", "ours-ppo", None]
    assert lines[0]["checks"]["finite"]["passed"] and not lines[1]["checks"]["finite"]["passed"]
    bad = lines[1]["checks"]["finite"]["value"]
    assert list(bad) == ["losses/policy_loss@2"] and math.isnan(bad["losses/policy_loss@2"])
    assert lines[-1]["checks_passed"] is False and len(lines[-1]["failed"]) == 1
    assert "error: ours-ppo: finite failed" in err and "the run's console" in err


def test_the_saved_tokenizer_stays_inside_the_vocabulary(tmp_path):
    """Loaded back as the scripts load it (the config says qwen2), no token past the embedding's rows."""
    from transformers import AutoTokenizer

    models = gpu_check.build_models(gpu_check.TINY, tmp_path, "cpu")
    for name in ("policy", "reward"):
        tokenizer = AutoTokenizer.from_pretrained(models[name])
        assert len(tokenizer) == max(tokenizer.get_vocab().values()) + 1 == gpu_check.TINY["vocab_size"]
        assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)


def run_check(*flags):
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--tiny", *flags],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    return result, [json.loads(line) for line in result.stdout.splitlines()]


def test_tiny_run_end_to_end():
    result, lines = run_check()
    assert result.returncode == 0, result.stderr
    *runs, summary = lines
    assert [line["run"] for line in runs] == ["ours-grpo", "trl-grpo", "ours-dapo", "ours-ppo"]
    for line in runs:
        assert line["device"] == "cpu" and line["shape"] == "tiny" and line["dtype"] == "bfloat16"
        if line.get("skipped"):
            assert line["run"] == "trl-grpo" and line["trl"] == "not installed"
            assert importlib.util.find_spec("trl") is None
            continue
        assert failed(line["checks"]) == [], line["checks"]
        expected = {"exit", *gpu_check.RUNS[line["run"]]["checks"]}
        assert set(line["checks"]) == expected
        assert line["seconds_per_iteration"] > 0 and line["measured_iterations"] == 1
        assert line["response_length"] == line["sizes"]["max_new_tokens"]  # random weights: no EOS
        for phase in ("generate" if "generate" in line else "rollout", "update"):  # ppo_llm.py: its whole rollout
            assert line[phase]["seconds"] > 0 and line[phase]["tokens_per_sec"] > 0 and line[phase]["tflops"] > 0
            assert line[phase]["mfu"] is None  # no bf16 peak on a CPU
        assert line["peak_memory_gib"] > 0 and line["peak_memory_kind"] == "peak RSS (no GPU)"
    assert summary["summary"] is True and summary["checks_passed"] is True and summary["failed"] == []
    assert summary["policy_params"] > summary["scorer_params"] > 0
    trl_ran = not runs[1].get("skipped")
    assert isinstance(summary["ours_over_trl"], dict) == trl_ran
    if trl_ran:
        assert summary["ours_over_trl"]["iteration_seconds"] > 0 and summary["ours_over_trl"]["peak_memory"] > 0


def test_a_run_past_the_time_limit_fails():
    result, lines = run_check("--runs", "ours-grpo", "--time-limit", "2")
    assert result.returncode == 1
    assert not lines[0]["checks"]["exit"]["passed"] and lines[-1]["checks_passed"] is False
    assert "error: ours-grpo: exit failed" in result.stderr
