"""lm-evaluation-harness, a client no one here wrote, against the real server: its
``local-completions`` model scores a multiple-choice task by log-likelihood (``echo`` +
``logprobs`` on token-id prompts, tokenized through the server's ``/tokenizer_info`` and
``/tokenize``) and runs a generate-until task, batched; ``local-chat-completions`` runs the
generate-until task on the chat route. Every number it reports must equal the library's own
scoring of the same tokens.

The tasks live in tests/files/lm_eval (local JSON data: the test machines have no hub access).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from nasd_core import SamplingParams, generate
from tests.deployments.conftest import DEFAULT_APP

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "files" / "lm_eval"


@pytest.fixture(scope="module")
def app(serve_session):
    return serve_session.deploy({"default": DEFAULT_APP})["default"]


@pytest.fixture(scope="module")
def model(gguf_model):
    """The library's reference: the server's default weights (the embedded model's GGUF blocks)."""
    return gguf_model


@pytest.fixture(scope="module")
def lm_eval(monkeypatch_module):
    # No hub on the test machines: the tasks' data are local files, read offline.
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.chdir(ROOT)  # the task files name their data relative to the repository
    return importlib.import_module("lm_eval")  # a dev dependency: imported once offline is set


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def evaluate(lm_eval, model: str, model_args: dict[str, object], task: str, **kwargs) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=",".join(f"{key}={value}" for key, value in model_args.items()),
        tasks=[task],
        task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True,
        **kwargs,
    )


def read_docs(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / name).read_text().splitlines()]


def library_loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """The continuation's log-likelihood and whether it is the greedy one, from the library's
    prompt logprobs of the same tokens lm-eval sends (its ``_encode_pair``: trailing spaces of
    the context move to the continuation; the continuation is what the whole adds)."""
    num_spaces = len(context) - len(context.rstrip())
    if num_spaces:
        context, continuation = context[:-num_spaces], context[-num_spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    num_context = len(tokenizer.encode(context, add_special_tokens=False))
    result = generate(model, tokenizer, whole, SamplingParams(max_tokens=0, prompt_logprobs=1))
    scored = result.prompt_logprobs[num_context:]
    assert len(scored) == len(whole) - num_context
    return sum(entry.logprob for entry in scored), all(entry.logprob >= entry.top[0][1] for entry in scored)


def test_loglikelihood_task_equals_the_library_scoring(app, lm_eval, model, tokenizer):
    results = evaluate(
        lm_eval,
        "local-completions",
        {"base_url": f"{app.api_url}/completions", "model": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        "nasd_tiny_choice",
        batch_size=4,  # several prompts per request
    )
    docs = read_docs("choices.jsonl")
    samples = sorted(results["samples"]["nasd_tiny_choice"], key=lambda sample: sample["doc_id"])
    assert len(samples) == len(docs)
    num_correct = 0
    for sample, doc in zip(samples, docs):
        expected = [
            library_loglikelihood(model, tokenizer, doc["question"], choice) for choice in doc["choices"]
        ]
        served = [tuple(resp[0]) for resp in sample["resps"]]
        assert [value for value, _ in served] == pytest.approx([value for value, _ in expected], abs=1e-3)
        assert [greedy for _, greedy in served] == [greedy for _, greedy in expected]
        scores = [value for value, _ in expected]
        num_correct += scores.index(max(scores)) == doc["answer"]
    assert results["results"]["nasd_tiny_choice"]["acc,none"] == pytest.approx(num_correct / len(docs))


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_generate_until_task_equals_the_library(app, lm_eval, model, tokenizer, route):
    stop = [",", ".", "\n"]
    if route == "completions":
        model_name, args = "local-completions", {"base_url": f"{app.api_url}/completions"}
    else:
        model_name, args = "local-chat-completions", {"base_url": f"{app.api_url}/chat/completions"}
    results = evaluate(
        lm_eval,
        model_name,
        {**args, "model": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        "nasd_tiny_continue",
        **({"apply_chat_template": True} if route == "chat" else {"batch_size": 4}),
    )
    docs = read_docs("continuations.jsonl")
    samples = sorted(results["samples"]["nasd_tiny_continue"], key=lambda sample: sample["doc_id"])
    num_correct = 0
    for sample, doc in zip(samples, docs, strict=True):
        if route == "completions":
            prompt = doc["question"]
        else:
            messages = [{"role": "user", "content": doc["question"]}]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        expected = generate(model, tokenizer, prompt, SamplingParams(max_tokens=12, stop=stop)).text
        assert sample["resps"][0][0] == expected
        num_correct += expected.strip() == doc["answer"]
    assert results["results"]["nasd_tiny_continue"]["exact_match,none"] == pytest.approx(
        num_correct / len(docs)
    )
