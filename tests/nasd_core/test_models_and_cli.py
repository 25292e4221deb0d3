"""Model loading (embedded GGUF, converted-weights cache, errors) and the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nasd_core.errors import ModelLoadError
from nasd_core.loader import load_model, resolve_model_dir

ROOT = Path(__file__).resolve().parents[2]


def test_embedded_model_is_loaded_from_the_converted_cache(model, tokenizer):
    model_dir = Path(resolve_model_dir(None))
    assert (model_dir / "config.json").is_file()
    assert (model_dir / "model.safetensors").is_file()
    assert model.config.vocab_size == 49152
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.chat_template  # the chat template survived the conversion
    assert not model.training


def test_unknown_model_raises_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "no-such-model"))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "nasd_core", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )


def test_cli_generates_and_reports_stats():
    done = run_cli("Repeat exactly: red, green, blue, red, green, blue", "--max-tokens", "12", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["num_tokens"] <= 12 and report["text"]
    assert report["stats"]["num_emitted"] == report["num_tokens"]


def test_cli_rejects_bad_arguments_with_exit_code_2():
    done = run_cli("hello", "--max-tokens", "0")
    assert done.returncode == 2
    assert "max_tokens" in done.stderr
