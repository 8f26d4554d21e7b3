"""The lm-eval model `cactus` end to end on local tasks (a JSONL file, a task YAML, --limit):
generation through the engine, log-likelihoods from the verifier alone, per-request stats.
Needs the `eval` extra; the README's test command (and CI) install it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import lm_eval  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise RuntimeError(
            'lm-eval is missing in CI: the test command must install ".[demo,test,eval,serve]"'
        ) from None
    pytest.skip('the eval extra is not installed (pip install -e ".[eval]")', allow_module_level=True)

import math
import os

import pytest
import torch

from cactus_cli.app.config.settings import flags_to_settings
from cactus_cli.core.errors import ConfigError

ROWS = [
    {"prompt": "the cat sat on the", "answer": "mat", "choices": ["mat", "sky", "sea"], "label": 0},
    {"prompt": "the dog ran on the", "answer": "road", "choices": ["road", "moon", "fish"], "label": 0},
    {"prompt": "one two three", "answer": "four", "choices": ["four", "ten", "red"], "label": 0},
    {"prompt": "the bird sang and then it", "answer": "flew", "choices": ["flew", "swam", "ate"], "label": 0},
]


@pytest.fixture
def task_dir(tmp_path):
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["</s>"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""")
    (tmp_path / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    return tmp_path


def evaluate(tiny, task_dir, tasks, **args):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import cactus_cli.app.eval.lm_eval_adapter  # noqa: F401  registers "cactus"

    model_args = {
        "verifier": tiny["verifier"],
        "draft": tiny["draft_close"],
        "device": "cpu",
        "dtype": "float32",
        "compile": "off",
        **args,
    }
    return lm_eval.simple_evaluate(
        model="cactus",
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(task_dir)),
        limit=4,
        log_samples=True,
    )


def test_generation_goes_through_the_engine_and_greedy_equals_the_verifier(tiny, task_dir, tmp_path):
    stats = tmp_path / "stats.jsonl"
    spec = evaluate(tiny, task_dir, ["tiny_gen"], k=3, stats_file=str(stats))
    alone = evaluate(tiny, task_dir, ["tiny_gen"], draft="none")
    assert "exact_match,none" in spec["results"]["tiny_gen"]
    texts = [s["resps"] for s in spec["samples"]["tiny_gen"]]
    assert texts == [s["resps"] for s in alone["samples"]["tiny_gen"]]  # greedy: the verifier's text
    assert all(t[0][0].strip() for t in texts)
    lines = [json.loads(line) for line in stats.read_text().splitlines()]
    assert len(lines) == 4
    assert sum(r["num_output_tokens"] for r in lines) > 0
    assert any(r["mean_acceptance_length"] and r["mean_acceptance_length"] > 1 for r in lines)


def test_loglikelihood_is_the_verifiers_own(tiny, task_dir):
    from cactus_cli.infer.pair.loader import load_pair

    out = evaluate(tiny, task_dir, ["tiny_mc"], rule="cactus", delta=5.0)
    assert "acc,none" in out["results"]["tiny_mc"]
    pair = load_pair(tiny["verifier"], None, None, "cpu", dtype="float32")
    tok, model = pair.tokenizer, pair.verifier.model
    sample = out["samples"]["tiny_mc"][0]
    assert len(sample["arguments"]) == 3  # one (context, continuation) request per choice
    for (context, choice), resp in zip(sample["arguments"], sample["resps"]):
        got = resp[0][0]
        ctx = tok(context, add_special_tokens=False)["input_ids"]
        whole = tok(context + choice, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([whole[:-1]])).logits[0].float(), -1)
        want = sum(float(logp[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))
        assert abs(float(got) - want) < 1e-3  # delta=5 changes nothing here: scoring is the verifier's


def test_cactus_lm_eval_command_line(tiny, task_dir, tmp_path):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    args = (
        f"verifier={tiny['verifier']},draft={tiny['draft_close']},device=cpu,dtype=float32,compile=off,"
        f"rule=cactus,delta=1.0,k=2"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cactus_cli.app.eval.lm_eval_adapter",
            "--model",
            "cactus",
            "--model_args",
            args,
            "--tasks",
            "tiny_gen",
            "--include_path",
            str(task_dir),
            "--limit",
            "2",
            "--output_path",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tiny_gen" in proc.stdout and "exact_match" in proc.stdout
    assert "cactus: 2 generations" in proc.stderr  # per-run acceptance and speed in the log
    assert list(Path(tmp_path / "out").rglob("results_*.json"))


def test_lm_eval_model_args_without_draft():
    out = flags_to_settings(rule="cactus", delta=1.0)  # KeyError: 'draft' before
    assert out["rule"] == "cactus" and "draft" not in out


def test_lm_eval_stats_file_in_a_missing_folder_fails_at_creation(tiny, tmp_path):
    pytest.importorskip("lm_eval")
    from cactus_cli.app.eval.lm_eval_adapter import CactusLM

    with pytest.raises(ConfigError, match="folder .* does not exist"):
        CactusLM(
            verifier=tiny["verifier"],
            draft=tiny["draft"],
            device="cpu",
            compile="off",
            quantize="none",
            dtype="float32",
            stats_file=str(tmp_path / "no" / "stats.jsonl"),
        )


def test_lm_eval_continuation_longer_than_the_context(tiny):
    pytest.importorskip("lm_eval")
    from cactus_cli.app.eval.lm_eval_adapter import CactusLM
    from cactus_cli.core.errors import ContextLimitError

    lm = CactusLM(
        verifier=tiny["short_context"], draft="none", device="cpu", compile="off", quantize="none", dtype="float32"
    )
    with pytest.raises(ContextLimitError, match="does not fit the verifier's context window of 16"):
        lm._score([5, 6], list(range(5, 30)))  # size mismatch RuntimeError before
    assert math.isfinite(lm._score([5, 6], [7, 8])[0])
