"""Tests for grpo_llm_tools.py, grpo_llm.py plus multi-turn tool calling: that it is the base file but for the
definitions its docstring names, and that its tools behave as docs/tools.md says. Expected values are derived
independently (a plain loop, a hand-computed case); the scripted rollouts replace the sampler with a fixed script.

Run: python -m pytest -q test_grpo_llm_tools.py
"""

import ast
import contextlib
import dataclasses
import io
import json
import re
import string
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo_llm_tools
from conftest import EOS, SUBPROCESS_ENV, char_tokenizer, non_timing, read_metrics, succeeded, write_jsonl
from grpo_llm_tools import Args, Batch, Toolbox, ToolResult, calculator, replace

REPO = Path(__file__).resolve().parent
BASE, VARIANT = REPO / "grpo_llm.py", REPO / "grpo_llm_tools.py"
TOOLS_DEMO = REPO / "demo" / "tools"
DEMO_FLAGS = ["--model-name-or-path", TOOLS_DEMO / "model", "--prompts-path", TOOLS_DEMO / "train.jsonl",
              "--eval-prompts-path", TOOLS_DEMO / "eval.jsonl", "--tools", "calculator", "--max-tool-calls", "1"]


@pytest.fixture(scope="module", autouse=True)
def demo_process(request, tmp_path_factory):
    """The tool demo as docs/tools.md runs it, started with the module when a test needs its metrics, so that it runs
    beside the other tests on the second core."""
    if not any("tool_demo_metrics" in item.fixturenames for item in request.session.items):
        yield None
        return
    out = tmp_path_factory.mktemp("tool_demo")
    flags = [*DEMO_FLAGS, "--num-iterations", 15, "--eval-every", 15]  # it calls the calculator every time by 10
    process = subprocess.Popen([sys.executable, str(VARIANT), *map(str, flags), "--output-dir", str(out)],
                               cwd=REPO, env=SUBPROCESS_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield SimpleNamespace(process=process, out=out)
    process.kill()
    process.communicate()


@pytest.fixture
def tool_demo_metrics(demo_process):
    """The tool demo's run, waited for: its metrics."""
    _, stderr = demo_process.process.communicate(timeout=600)
    assert demo_process.process.returncode == 0, stderr
    return read_metrics(demo_process.out)


def run_main(*argv):
    """grpo_llm_tools.main() in this process on a command line; returns what the subprocess would."""
    stdout, stderr = io.StringIO(), io.StringIO()
    argv = [str(VARIANT), *map(str, argv)]
    with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            grpo_llm_tools.main()
        except SystemExit as e:
            code = e.code
    return subprocess.CompletedProcess(argv, code, stdout.getvalue(), stderr.getvalue())


# ---------------------------------------------------------------------------------------------------------
# The variant is the base file plus tools: every shared definition the same, but those its docstring names
# ---------------------------------------------------------------------------------------------------------


def top_level_definitions(source):
    """{name: its source, decorators and comments included} of every top-level function, class and assignment."""
    lines, found = source.splitlines(), {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names = [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                     if isinstance(t, ast.Name)]
        else:
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        for name in names:
            assert name not in found, f"{name} is defined twice"
            found[name] = "\n".join(lines[start - 1 : node.end_lineno])
    return found


def named_in_docstring(source):
    """(changed, added): the names the variant's docstring lists after 'Changed from grpo_llm.py:' and 'added:'."""
    text = " ".join(ast.get_docstring(ast.parse(source)).split())
    changed, added = re.search(r"Changed from grpo_llm\.py: (.*?); added: (.*?)\.", text).groups()
    return set(changed.split(", ")), set(added.split(", "))


def undeclared_differences(base_source, variant_source):
    """The shared definitions whose source differs, but for those the variant's docstring names as changed."""
    base, variant = top_level_definitions(base_source), top_level_definitions(variant_source)
    changed, _ = named_in_docstring(variant_source)
    return sorted(name for name in base.keys() & variant.keys() if base[name] != variant[name] and name not in changed)


def test_every_definition_shared_with_the_base_is_identical_but_those_the_docstring_names():
    base_source, variant_source = BASE.read_text(), VARIANT.read_text()
    assert undeclared_differences(base_source, variant_source) == []
    base, variant = top_level_definitions(base_source), top_level_definitions(variant_source)
    changed, added = named_in_docstring(variant_source)
    # the docstring is exact: each name it calls changed does differ, and the added ones are the variant's own
    assert {name for name in base.keys() & variant.keys() if base[name] != variant[name]} == changed
    assert variant.keys() - base.keys() == added and base.keys() <= variant.keys()


@pytest.mark.parametrize("name, old, new", [
    ("group_advantages", "(r.std(1, keepdim=True) + eps)", "(r.std(1, keepdim=True) + 2 * eps)"),
    ("forward_rollout", "@torch.no_grad()\ndef forward_rollout", "def forward_rollout"),  # a decorator
    ("KL_ESTIMATORS", '"k2": lambda x: 0.5 * x**2,', '"k2": lambda x: 0.5 * x**2,  # a comment'),
])
def test_the_sync_check_reports_a_shared_definition_edited_in_one_file_only(name, old, new):
    variant_source = VARIANT.read_text()
    assert variant_source.count(old) == 1
    assert undeclared_differences(BASE.read_text(), variant_source.replace(old, new)) == [name]


# ---------------------------------------------------------------------------------------------------------
# The masks: no gradient, KL or entropy at tool tokens; the rollout's turns
# ---------------------------------------------------------------------------------------------------------


PRINTABLE = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(string.printable)}}
TEST_TOOLS = '''
import time


def raises(x: int) -> int:
    """Fail on purpose.

    Args:
        x: any number
    """
    raise ValueError(f"no good: {x}")


def sleeps(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


def surrogate() -> str:
    """Answer with what no tokenizer can encode."""
    return "\\ud800"


def calculator(expression: str) -> str:
    """A second tool of the built-in one's name.

    Args:
        expression: anything
    """
    return expression


def undocumented(x):
    return x
'''


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@pytest.fixture(scope="module")
def toolbox(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(TEST_TOOLS)
    tools = ("calculator", f"{path}:raises", f"{path}:sleeps", f"{path}:surrogate")
    return Toolbox(Args(tools=tools, max_tool_calls=2, tool_timeout=0.3), char_tokenizer(vocab=PRINTABLE))


def scripted_sample(tokenizer, turns):
    """A stand-in for sample(): after prompt p the policy writes turns[p][k] as its k-th turn, then EOS."""
    said = {}

    def sample(model, input_ids, attention_mask, max_new_tokens, *rest):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            text = tokenizer.decode([t for t, m in zip(ids, mask) if m])
            prompt = next(p for p in turns if text.startswith(p))
            k = said[prompt] = said.get(prompt, -1) + 1
            rows.append((tokenizer(turns[prompt][k])["input_ids"] + [EOS])[:max_new_tokens])
        return torch.tensor([r + [EOS] * (max(map(len, rows)) - len(r)) for r in rows])
    return sample


def scripted_rollout(monkeypatch, toolbox, turns, max_new_tokens=600):
    tokenizer = char_tokenizer(vocab=PRINTABLE)
    monkeypatch.setattr(grpo_llm_tools, "sample", scripted_sample(tokenizer, turns))
    models = SimpleNamespace(tokenizer=tokenizer, policy=torch.nn.Linear(1, 1), eos_token_ids=[EOS],
                             device=torch.device("cpu"), tools=toolbox)
    args = Args(max_new_tokens=max_new_tokens, tools=("calculator",), max_tool_calls=2)
    return grpo_llm_tools.generate(models, [tokenizer(p)["input_ids"] for p in turns], args, greedy=False), tokenizer


TURNS = {"2*3=": [call("calculator", expression="2*3"), "6"],
         "9-1=": ["8"],
         "5*5=": [call("calculator", expression="5*5"), call("nope"),
                  "wrong, try " + call("calculator", expression="x")]}


def test_the_rollout_appends_each_tool_result_and_masks_it_out_of_the_trained_tokens(monkeypatch, toolbox):
    batch, tokenizer = scripted_rollout(monkeypatch, toolbox, TURNS)
    expected = {  # (the response, the tool output in brackets), calls, failures
        0: ([call("calculator", expression="2*3"), "<eos>", "[<tool_response>6</tool_response>]", "6", "<eos>"], 1, 0),
        1: (["8", "<eos>"], 0, 0),
        2: ([call("calculator", expression="5*5"), "<eos>", "[<tool_response>25</tool_response>]", call("nope"),
             "<eos>", "[<tool_response>error: there is no tool 'nope'; the tools are calculator, raises, sleeps, surrogate"
             "</tool_response>]", "wrong, try " + call("calculator", expression="x"), "<eos>"], 2, 1)}
    for row, (parts, calls, failures) in expected.items():
        ids, tool, model = (x[row].tolist() for x in (batch.responses, batch.tool_mask, batch.response_mask))
        assert tokenizer.decode([i for i, t, m in zip(ids, tool, model) if t or m]) == \
            "".join(p.strip("[]") for p in parts)
        assert tokenizer.decode([i for i, t in zip(ids, tool) if t]) == "".join(p[1:-1] for p in parts if p[0] == "[")
        assert not any(t and m for t, m in zip(tool, model))
        assert (batch.tool_calls[row].item(), batch.tool_failures[row].item()) == (calls, failures)
    assert batch.has_eos.tolist() == [True, True, True]
    assert torch.equal(batch.attention_mask[:, batch.context_length :].bool(), batch.tool_mask | batch.response_mask)


def test_a_built_in_reward_judges_the_text_after_the_last_tool_output_and_a_reward_fn_gets_the_counts(
        monkeypatch, toolbox):
    batch, tokenizer = scripted_rollout(monkeypatch, toolbox, TURNS)
    assert grpo_llm_tools.last_turns(tokenizer, batch) == ["6", "8", "wrong, try " + call("calculator", expression="x")]
    models = SimpleNamespace(reward_model=None, tokenizer=tokenizer, device=torch.device("cpu"))
    rows = [{"prompt": p, "answer": a} for p, a in zip(TURNS, ["6", "8", "25"])]

    def counts(prompts, completions, tool_calls, tool_failures, **_):
        return [10 * c + f for c, f in zip(tool_calls, tool_failures)]
    reward_fns = [("exact_match", grpo_llm_tools.exact_match_reward), ("counts", counts)]
    scores = grpo_llm_tools.score_responses(models, reward_fns, batch, rows, Args())
    assert scores.tolist() == [[1.0, 10.0], [1.0, 0.0], [0.0, 21.0]]


def test_the_rollout_stops_at_max_new_tokens_counting_the_tool_output(monkeypatch, toolbox):
    turns = {"2*3=": [call("calculator", expression="2*3"), "6"]}
    width = len(call("calculator", expression="2*3")) + 1 + len("<tool_response>")  # the call, EOS, part of the output
    batch, _ = scripted_rollout(monkeypatch, toolbox, turns, max_new_tokens=width)
    assert batch.responses.shape[1] == width and batch.tool_mask[0, -1] and not batch.has_eos[0]


@pytest.mark.parametrize("kl_in", ["loss", "reward"])
def test_tool_output_gets_no_gradient_and_stays_out_of_the_kl_and_the_entropy(monkeypatch, toolbox, kl_in):
    batch, _ = scripted_rollout(monkeypatch, toolbox, TURNS)
    tool, model = batch.tool_mask, batch.response_mask  # what the tools wrote, what the model wrote
    assert torch.equal(batch.attention_mask[:, batch.context_length :].bool(), tool | model) and not (tool & model).any()
    g = torch.Generator().manual_seed(0)
    leaves = dict(logprobs=-torch.rand(tool.shape, generator=g),
                  entropy=torch.rand(tool.shape, generator=g).masked_fill(tool, 1e3))  # huge where the tools wrote
    leaves = {k: v.requires_grad_() for k, v in leaves.items()}
    monkeypatch.setattr(grpo_llm_tools, "policy_forward", lambda *a, **k: (leaves["logprobs"], leaves["entropy"]))
    old = (leaves["logprobs"].detach() - 0.1 * torch.rand(tool.shape, generator=g)).masked_fill(tool, -50.0)
    ref = (old - 0.3 * torch.rand(tool.shape, generator=g)).masked_fill(tool, 40.0)  # far away at tool tokens
    args = Args(ent_coef=0.01, kl_coef=0.1, kl_in=kl_in, kl_estimator="k1" if kl_in == "reward" else "k3",
                num_generations=3, num_epochs=2)
    batch = grpo_llm_tools.compute_advantages(replace(batch, logprobs=old, ref_logprobs=ref,
                                                      scores=torch.tensor([[1.0], [0.0], [0.5]])), args)
    if kl_in == "reward":  # -beta * sum_t k1_t over the model's tokens alone
        kl = [sum(o - r for o, r, m in zip(old[i].tolist(), ref[i].tolist(), model[i].tolist()) if m) for i in range(3)]
        assert (batch.rewards - torch.tensor([1.0, 0.0, 0.5])).tolist() == pytest.approx([-0.1 * x for x in kl],
                                                                                         rel=1e-5)
    counts = (grpo_llm_tools.loss_counts(batch.loss_mask, args.loss_aggregation),) * 2
    models = SimpleNamespace(autocast=contextlib.nullcontext, policy=None)
    stats = grpo_llm_tools.micro_batch_backward(models, batch, counts, torch.tensor(3), args)
    for name in ("logprobs", "entropy"):  # the policy loss (and the KL), the entropy bonus
        grad = leaves[name].grad
        assert (grad[tool] == 0).all() and (grad[model] != 0).all(), name
    expected = leaves["entropy"].detach()[model].sum().item() / model.sum().item()  # over the model's tokens alone
    assert stats["policy/entropy"].item() == pytest.approx(expected, rel=1e-6)


def test_with_no_call_the_multi_turn_rollout_is_the_single_turn_rollout_token_for_token(toolbox):
    tokenizer = AutoTokenizer.from_pretrained(REPO / "demo" / "model")  # digits, + and =: it can write no tool call
    models = SimpleNamespace(tokenizer=tokenizer, policy=AutoModelForCausalLM.from_pretrained(REPO / "demo" / "model"),
                             eos_token_ids=[tokenizer.eos_token_id], device=torch.device("cpu"), tools=toolbox)
    args = Args(max_new_tokens=8, tools=("calculator",), max_tool_calls=1)
    prompt_ids = [tokenizer(p)["input_ids"] for p in ("37+48=", "3+4=", "15+43=", "8+61=", "99+1=")]
    torch.manual_seed(5)
    with_tools = grpo_llm_tools.generate(models, prompt_ids, args, greedy=False)
    torch.manual_seed(5)
    single = grpo_llm_tools.generate(models, prompt_ids, dataclasses.replace(args, max_tool_calls=0), greedy=False)
    assert with_tools.tool_mask.sum() == 0 and with_tools.tool_calls.sum() == 0 and single.tool_mask is None
    assert len(set(single.response_mask.sum(1).tolist())) > 1  # responses of several lengths, padded
    for field in dataclasses.fields(Batch):
        value = getattr(single, field.name)
        if value is not None:
            assert torch.equal(getattr(with_tools, field.name), value) if isinstance(value, torch.Tensor) else \
                getattr(with_tools, field.name) == value, field.name


# ---------------------------------------------------------------------------------------------------------
# The calculator and the calls
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, expected", [
    ("374*58", "21692"), ("(2+3)**2", "25"), ("7/2", "3.5"), ("-3+10//3", "0"), (" 2**-2 ", "0.25"), ("17 % 5", "2"),
    ("1.5*4", "6.0"), ("x+1", ValueError), ("(1).real", ValueError), ("abs(-1)", ValueError),
    ("__import__('os').system('touch pwned')", ValueError), ("'a'*3", ValueError), ("[1]*3", ValueError),
    ("1 if 1 else 2", ValueError), ("9**999", ValueError), ("(10**200)**2", ValueError), ("2**3**7", ValueError),
    ("10**300*10", ValueError), ("1e308*10", ValueError), ("(-8)**0.5", ValueError), ("2**-1000", str(2**-1000)),
    ("0.5**-1000", ValueError),
    pytest.param("9" * 5000, SyntaxError, id="5000-digits"),  # Python refuses a literal past 4300 digits as it parses
])
def test_the_calculator_computes_arithmetic_and_refuses_names_attributes_calls_and_huge_powers(
        expression, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if isinstance(expected, str):
        assert calculator(expression) == expected
    else:
        with pytest.raises(expected):
            calculator(expression)
    assert not (tmp_path / "pwned").exists()


# A turn's text -> (the results the model is given back, how many of them failed).
TOOL_CALLS = {
    "well-formed": (call("calculator", expression="21*4"), ["84"], 0),
    "two-in-one-turn": (call("calculator", expression="2+3") + " then " + call("calculator", expression="6*7"),
                        ["5", "42"], 0),
    "malformed-json": ('<tool_call>{"name": calculator}</tool_call>',
                       ["error: the tool call is not valid JSON (Expecting value: line 1 column 10 (char 9))"], 1),
    "nested-past-the-recursion-limit": ("<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>",
                                        ["error: the tool call is not valid JSON (maximum recursion depth exceeded "
                                         "while decoding a JSON array from a unicode string)"], 1),
    "not-an-object": ("<tool_call>[1, 2]</tool_call>",
                      ["error: there is no tool None; the tools are calculator, raises, sleeps, surrogate"], 1),
    "unknown-tool": (call("search", query="x"), ["error: there is no tool 'search'; the tools are calculator, raises, "
                                                 "sleeps, surrogate"], 1),
    "missing-argument": (call("calculator"), ["error: calculator failed: TypeError: calculator() missing 1 required "
                                              "positional argument: 'expression'"], 1),
    "tool-that-raises": (call("raises", x=3), ["error: raises failed: ValueError: no good: 3"], 1),
    "tool-past-its-timeout": (call("sleeps", seconds=5), ["error: sleeps ran past --tool-timeout 0.3s"], 1),
    "output-the-tokenizer-cannot-encode": (call("surrogate"), ["error: surrogate failed: TypeError: TextEncodeInput "
                                                               "must be Union[TextInputSequence, Tuple[InputSequence, "
                                                               "InputSequence]]"], 1),
    "no-call": ("just an answer: 42", [], 0),
}


@pytest.mark.parametrize("case", list(TOOL_CALLS))
def test_each_tool_call_gives_the_model_its_result_or_an_error_and_counts_the_failures(toolbox, case):
    text, expected, failures = TOOL_CALLS[case]
    tokenizer = char_tokenizer(vocab=PRINTABLE)
    results = [toolbox.run(c, tokenizer) for c in toolbox.calls_in(text, tokenizer)]
    assert [r.text for r in results] == expected and sum(r.failed for r in results) == failures


def test_a_tool_output_longer_than_its_cap_is_cut_to_max_tool_output_tokens():
    tokenizer = char_tokenizer(vocab=PRINTABLE)
    ids = grpo_llm_tools.tool_message_ids(tokenizer, [ToolResult("0123456789" * 3, False)],
                                         Args(max_tool_output_tokens=12), EOS)
    assert tokenizer.decode(ids) == "<tool_response>012345678901</tool_response>"


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_one_token_of_tool_output_is_enough_to_start_and_a_prompt_cut_from_its_schemas_is_refused():
    Toolbox(Args(tools=("calculator",), max_tool_calls=1, max_tool_output_tokens=1), char_tokenizer(vocab=PRINTABLE))
    tokenizer = char_tokenizer(vocab=PRINTABLE)
    tokenizer.chat_template = "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"
    rows, schemas = [{"prompt": "1+1="}], [{"type": "function", "function": {"name": "calculator"}}]
    args = Args(chat_template=True, max_prompt_length=40)
    whole = tokenizer.decode(grpo_llm_tools.tokenize_prompts(tokenizer, rows, replace(args, max_prompt_length=99), "p",
                                                            schemas)[0])
    assert whole.startswith('[{"type": "function"') and whole.endswith("1+1=") and len(whole) > 40
    with pytest.raises(grpo_llm_tools.ConfigError, match="1 prompts with the tools' schemas are longer than"):
        grpo_llm_tools.tokenize_prompts(tokenizer, rows, args, "p", schemas)
    assert tokenizer.decode(grpo_llm_tools.tokenize_prompts(tokenizer, rows, args, "p", None)[0]) == "null1+1="


def test_a_tool_result_is_appended_as_the_chat_template_renders_a_tool_message_after_the_turn():
    tokenizer = char_tokenizer(vocab=dict(PRINTABLE, **{"<|im_start|>": 200, "<|im_end|>": 201}))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    results = [ToolResult("8<|im_end|>4", False), ToolResult("error: x", True)]  # a tool's <|im_end|> ends no turn
    ids = grpo_llm_tools.tool_message_ids(tokenizer, results, Args(chat_template=True), 201)
    # the model wrote <|im_end|>; what the template puts after it, then both tool turns and the next assistant header
    assert tokenizer.decode(ids) == \
        "\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>tool\nerror: x<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------------------------
# End to end: resume, and the tool flags' bad inputs
# ---------------------------------------------------------------------------------------------------------


def test_a_resumed_tool_using_run_continues_exactly_where_the_checkpoint_left_off(tmp_path):
    evals = write_jsonl(tmp_path / "eval.jsonl", [json.loads(line) for line in
                                                  (TOOLS_DEMO / "eval.jsonl").read_text().splitlines()[:8]])
    flags = [*DEMO_FLAGS, "--eval-prompts-path", evals, "--num-prompts", 8, "--num-iterations", 2, "--save-every", 1,
             "--num-epochs", 2, "--eval-every", 2]
    succeeded(run_main(*flags, "--output-dir", tmp_path / "whole"))
    succeeded(run_main(*flags, "--output-dir", tmp_path / "resumed", "--resume-from",
                       tmp_path / "whole" / "checkpoint-1"))
    whole, resumed = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "resumed")
    assert sorted(resumed) == [0, 1, 2] and resumed[2]["tools/calls_per_response"] > 0  # rows 0-1: the checkpoint's
    assert [non_timing(resumed[i]) for i in (0, 1, 2)] == [non_timing(whole[i]) for i in (0, 1, 2)]
    before, after = (load_file(tmp_path / d / "policy" / "model.safetensors") for d in ("whole", "resumed"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("flags, message", [
    (["--max-tool-calls", 1], "--max-tool-calls does nothing without --tools"),
    (["--tools", "calculator"], "--tools does nothing without --max-tool-calls"),
    (["--max-tool-output-tokens", 5], "--max-tool-output-tokens does nothing without --max-tool-calls"),
    (["--tool-timeout", 3], "--tool-timeout does nothing without --max-tool-calls"),
    (["--tools", "calculator", "--max-tool-calls", -1], "--max-tool-calls must be in [0, inf), got -1"),
    (["--tools", "calculator", "--max-tool-calls", 1, "--tool-timeout", 0], "--tool-timeout must be in (0, 1e9]"),
    (["--tools", "calculator", "--max-tool-calls", 1, "--tool-timeout", 1e10], "--tool-timeout must be in (0, 1e9]"),
    (["--tools", "calculator", "{tools}:calculator", "--max-tool-calls", 1], "a second tool named calculator"),
    (["--tools", "calculator", "--max-tool-calls", 1, "--max-tool-output-tokens", 0],
     "--max-tool-output-tokens must be in (0, inf)"),
    (["--tools", "no_such_file.py:f", "--max-tool-calls", 1], "--tools 'no_such_file.py:f' cannot be imported"),
    (["--tools", "{tools}:undocumented", "--max-tool-calls", 1], "no JSON schema from its signature and docstring"),
    (["--tools", "calculator", "--max-tool-calls", 1, "--chat-template", "--model-name-or-path", "{refuses}"],
     "tokenizer cannot write a tool message (TemplateError: no tool role)"),
    (["--tools", "calculator", "--max-tool-calls", 1, "--prompts-path", "{fields}"],
     "line 1: a field named tool_calls is a reward function's argument"),
])
def test_a_bad_tool_flag_is_one_error_line(tmp_path, flags, message):
    (tmp_path / "tools.py").write_text(TEST_TOOLS)
    refuses = char_tokenizer(vocab=PRINTABLE)  # a chat template without the tool role
    refuses.chat_template = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}" \
                            "{% endif %}{{ m.content }}{% endfor %}"
    refuses.save_pretrained(tmp_path / "refuses")
    (tmp_path / "fields.jsonl").write_text('{"prompt": "1+1=", "answer": "2", "tool_calls": [1]}\n')
    flags = [str(f).format(tools=tmp_path / "tools.py", refuses=tmp_path / "refuses", fields=tmp_path / "fields.jsonl")
             for f in flags]
    result = run_main(*DEMO_FLAGS[:6], "--output-dir", tmp_path / "out", *flags)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], \
        result.stderr


# ---------------------------------------------------------------------------------------------------------
# The demo learns to call the calculator (last: its run, started with the module, runs beside the others)
# ---------------------------------------------------------------------------------------------------------


def test_the_tool_demo_learns_to_call_the_calculator(tool_demo_metrics):
    metrics = tool_demo_metrics
    assert metrics[0]["eval/reward"] <= 0.05 and metrics[15]["eval/reward"] >= 0.9
    assert metrics[0]["eval/tool_calls_per_response"] == 0 and metrics[15]["eval/tool_calls_per_response"] >= 0.95
    for row in (metrics[i] for i in range(1, 16)):
        assert 0 < row["tools/calls_per_response"] <= 1.1 and 0 <= row["tools/failure_rate"] < 0.2  # refused: > 1
        assert 0 < row["tools/token_fraction"] < 1
    assert metrics[15]["tools/calls_per_response"] > metrics[1]["tools/calls_per_response"] + 0.5
    assert any("</tool_call><tool_response>" in completion for _, completion, _ in metrics[15]["samples"])


def test_dynamic_sampling_keeps_each_groups_tool_mask_when_it_merges_its_rounds(tmp_path, monkeypatch):
    kept_groups, merged = grpo_llm_tools.kept_groups, []

    def check(kept, last_round, models, args, rounds):  # every kept row's tool output, before and after the merge
        batch, rows = kept_groups(kept, last_round, models, args, rounds)
        def tool_text(b):
            return [models.tokenizer.decode(r[t]) for r, t in zip(b.responses, b.tool_mask)]
        assert tool_text(batch) == [text for b, _ in kept for text in tool_text(b)]
        merged.append(len(kept))
        return batch, rows

    monkeypatch.setattr(grpo_llm_tools, "kept_groups", check)
    succeeded(run_main(*DEMO_FLAGS[:4], *DEMO_FLAGS[6:], "--preset", "dapo", "--num-prompts", 4, "--max-new-tokens", 16, "--eval-every", 0,
                       "--num-iterations", 2, "--output-dir", tmp_path))
    assert merged and max(merged) > 1  # some iteration merged rounds of different widths


def test_two_ranks_with_tools_take_their_own_numbers_of_turns_under_fsdp(tmp_path):
    # On rank 1 every tool answer fills what is left of --max-new-tokens, so its responses end after one turn, while
    # rank 0 samples a second turn after each call: under FSDP2 no collective may run between the turns.
    (tmp_path / "ranked.py").write_text(
        "import os\ndef calculator(expression: str) -> str:\n    '''Long answers on rank 1.\n\n    Args:\n"
        "        expression: any\n    '''\n    return '1' * 50 if os.environ['RANK'] == '1' else '42'\n")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(VARIANT)]
    flags = [*DEMO_FLAGS[:4], "--tools", f"{tmp_path / 'ranked.py'}:calculator", "--max-tool-calls", 1, "--num-prompts",
             2, "--max-new-tokens", 16, "--fsdp", "--eval-every", 0, "--num-iterations", 2, "--output-dir", tmp_path / "o"]
    succeeded(subprocess.run([*launcher, *map(str, flags)], cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True,
                             timeout=300))
    metrics = read_metrics(tmp_path / "o")
    assert sorted(metrics) == [1, 2] and all(m["tools/calls_per_response"] > 0 for m in metrics.values())
