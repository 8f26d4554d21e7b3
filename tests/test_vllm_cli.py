"""``--backend vllm``: the divergence each request spent (the plugin's ledger), the settings as vLLM
takes them, and ``generate`` / ``bench`` through vLLM's engine where vLLM is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from cactus_cli.cli.main import app
from cactus_cli.core.errors import ModelError
from cactus_cli.infer.backends.vllm.plugin import Ledger
from cactus_cli.infer.backends.vllm.rows import RowRule, transform


def test_transform_writes_the_kl_of_each_changed_rows_target():
    """``spent`` holds KL(h || q) of each rewritten row (h read back from the log h it wrote), 0 for
    rows left alone; cactus-exact holds its budget, the closed form comes close."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=g) * 2
    drafts = torch.randint(0, 40, (6,), generator=g)
    specs = [RowRule.of({"rule": "cactus", "delta": 0.5})] * 2 + [None, RowRule("sps")]
    specs += [RowRule.of({"rule": "cactus-exact", "delta": 0.3, "divergence": "kl"})] * 2
    spent = torch.full((6,), -1.0, dtype=torch.float64)
    out = transform(logits, drafts, None, specs, spent)
    q = torch.softmax(logits.double(), -1)
    h = torch.exp(out.double())
    kl = (h * (torch.log(h) - torch.log(q))).sum(-1)
    assert torch.allclose(spent, torch.where(torch.tensor([1, 1, 0, 0, 1, 1]) > 0, kl, 0.0), atol=1e-5)
    assert spent[:2].min() > 0 and spent[2:4].abs().max() == 0
    assert spent[4:].max() <= 0.3 + 1e-5


def test_the_ledger_keeps_the_rows_each_request_emitted_from():
    """Request a: 1 accepted then a rejection (2 tokens from rows 0 and 1); b: greedy (not kept); c: all
    3 accepted and a bonus token (rows 0-2; the bonus spends nothing). Ids are vLLM's engine-core
    ones (the front end's id and a suffix); what is taken is forgotten."""
    ledger = Ledger()
    meta = SimpleNamespace(all_greedy=False, temperature=torch.tensor([1.0, 0.0, 0.7]))
    spent = torch.tensor([0.1, 0.2, 0.3, 9.0, 9.0, 0.4, 0.5, 0.6], dtype=torch.float64)
    out = torch.tensor([[5, 6, -1, -1], [1, -1, -1, -1], [7, 8, 9, 10]])
    ledger.record(["a-1f2e3d4c", "b-00000000", "c-abcdef01"], [3, 2, 3], meta, spent, out)
    assert ledger.take("a") == pytest.approx([0.1, 0.2])
    assert ledger.take("b") == []
    assert ledger.take("c") == pytest.approx([0.4, 0.5, 0.6])
    assert ledger.take("c") == [] and not ledger.spent


def test_commands_on_cactus_s_engine_refuse_the_vllm_backend():
    from cactus_cli.infer.backends.registry import choose
    from cactus_cli.infer.load.sources import Source

    with pytest.raises(ModelError, match="--backend vllm runs generate, bench, serve"):
        choose("vllm", [("verifier", Source("folder", "/x"))], None, torch.device("cpu"))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--quantize", "int8"], "--quantize int8 does not apply to --backend vllm"),
        (["--draft", "suffix"], "--draft suffix: cactus runs no vLLM proposer for it"),
        (["--rule", "tas"], "does not verify against a target distribution h"),
    ],
)
def test_what_vllm_does_not_take_is_one_line_naming_it(tiny_vllm_pair, args, needle):
    base = ["generate", "--verifier", tiny_vllm_pair["verifier"], "--draft", tiny_vllm_pair["draft"]]
    r = CliRunner().invoke(app, base + ["--backend", "vllm", *args, "the cat"])
    assert r.exit_code != 0 and needle in r.output and "Traceback" not in r.output, r.output


def test_engine_arguments_that_are_not_an_object_are_refused(tiny_vllm_pair, monkeypatch):
    monkeypatch.setenv("CACTUS_VLLM_ARGS", "[1, 2]")
    base = ["generate", "--verifier", tiny_vllm_pair["verifier"], "--draft", tiny_vllm_pair["draft"]]
    r = CliRunner().invoke(app, base + ["--backend", "vllm", "the cat"])
    assert r.exit_code != 0 and "CACTUS_VLLM_ARGS must be a JSON object" in r.output


# ---------------------------------------------------------------------- vLLM's engine


def test_each_requests_stats_are_what_vllm_counted_and_its_spending_fits_them(llm, tiny_vllm_pair):
    """Three requests in one batch through offline.Engine: their accepted tokens and drafts add up to
    vLLM's own counters; each spent one value per token emitted from a drafted position (accepted +
    the rejected position of each step that ended in one); SpS spends nothing, Cactus spends,
    cactus-exact within its budget."""
    from transformers import AutoTokenizer

    from cactus_cli.infer.backends.vllm import offline

    pytest.importorskip("vllm")
    tok = AutoTokenizer.from_pretrained(tiny_vllm_pair["verifier"])
    ids = tok("the cat sat on the", add_special_tokens=False)["input_ids"]
    rules = [{"rule": "sps"}, {"rule": "cactus", "delta": 1.0}, {"rule": "cactus-exact", "delta": 0.2}]
    requests = [offline.Request(ids, seed=5 + i, extra=r, max_tokens=32) for i, r in enumerate(rules)]

    def counted() -> tuple[float, float]:
        got = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        return got.get("vllm:spec_decode_num_accepted_tokens", 0.0), got.get("vllm:spec_decode_num_drafts", 0.0)

    before = counted()
    done = offline.Engine(llm, 4).run(requests, concurrency=3)
    after = counted()
    assert sum(d.stats.num_accepted_tokens for d in done) == after[0] - before[0]
    assert sum(d.stats.num_drafts for d in done) == after[1] - before[1] > 0
    for d in done:
        assert len(d.spent) == d.stats.num_accepted_tokens + d.stats.num_rejections
        assert sum(d.stats.acceptance_histogram) == d.stats.num_drafts
    sps, cactus, exact = (d.spent for d in done)
    assert max(sps) == 0 and max(cactus) > 0 and max(exact) <= 0.2 + 1e-5


def test_bench_on_vllm_reports_each_rule_and_the_divergence_it_spent(llm, tiny_vllm_pair, tmp_path, monkeypatch):
    """``cactus bench --backend vllm`` end to end on the session's engine (offline.start hands it
    over: a start takes a minute): a row per rule with vLLM's acceptance and per-position rates,
    and per speculative row the divergence spent against its budget (SpS: none)."""
    from cactus_cli.infer.backends.vllm import offline

    pytest.importorskip("vllm")

    asked: list[int] = []

    class Kept(offline.Engine):
        def close(self) -> None:  # (the session's engine outlives this test)
            pass

        def run(self, requests, concurrency=1):
            asked.extend(len(r.ids) for r in requests)
            return super().run(requests, concurrency)

    started = []
    monkeypatch.setattr(offline, "start", lambda p, *a, **kw: started.append(p.k) or Kept(llm, p.k))
    prompts = tmp_path / "p.jsonl"
    questions = [  # (Spec-Bench's question.jsonl: the first question has two turns)
        {"question_id": 81, "category": "writing", "turns": ["the cat sat", "then the dog"]},
        {"question_id": 7, "category": "qa", "turns": ["a dog ran"]},
    ]
    prompts.write_text("".join(json.dumps(q) + "\n" for q in questions))
    args = ["bench", "--verifier", tiny_vllm_pair["verifier"], "--draft", tiny_vllm_pair["draft"]]
    args += ["--backend", "vllm", "--rules", "sps,cactus", "--delta", "1", "-k", "4", "--max-tokens", "16"]
    r = CliRunner().invoke(app, args + ["--temperature", "1", "--prompts", str(prompts), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    rows = {row["config"]: row for row in doc["results"]}
    assert set(rows) == {"verifier alone", "sps k=4", "cactus δ=1 k=4"} and started == [4, 0]
    assert rows["cactus δ=1 k=4"]["mean_acceptance_length"] > 1
    assert all(set(row["by_category"]) == {"writing", "qa"} for row in rows.values())
    assert len(asked) == 3 * 3 and asked[1] > asked[0] + 2  # per row: both questions and the second turn after
    assert len(rows["sps k=4"]["per_position_acceptance_rate"]) == 4
    spent = doc["environment"]["vllm"]
    assert doc["environment"]["vllm_version"].startswith("0.32")
    assert spent["sps k=4"]["kl_spent_max"] == 0 and spent["cactus δ=1 k=4"]["kl_spent_mean"] > 0
    assert spent["cactus δ=1 k=4"]["kl_budget"] == 1.0


def test_generate_on_vllm_starts_an_engine_and_says_what_it_spent(tiny_vllm_pair):
    """``cactus generate --backend vllm`` as a user runs it (its own engine, started here; the
    engine arguments a user may add through CACTUS_VLLM_ARGS): the answer, vLLM's k and rule, and
    one spent value per token emitted from a drafted position."""
    pytest.importorskip("vllm")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")  # (its own process: an engine's end ends the session's)
    env["CACTUS_VLLM_ARGS"] = '{"enforce_eager": true, "dtype": "float32", "gpu_memory_utilization": 0.1}'
    args = ["generate", "--verifier", tiny_vllm_pair["verifier"], "--draft", tiny_vllm_pair["draft"], "--backend"]
    args += ["vllm", "-k", "3", "--rule", "cactus", "--delta", "0.5", "--temperature", "1", "--max-tokens", "12"]
    run = [sys.executable, "-m", "cactus_cli", *args, "--seed", "3", "--json", "the cat sat on"]
    r = subprocess.run(run, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)  # (vLLM's log lines go to stderr: stdout is the JSON alone)
    assert doc["vllm"]["k"] == 3 and doc["vllm"]["rule"] == {"rule": "cactus", "delta": 0.5}
    s = doc["stats"]
    assert 0 < s["num_output_tokens"] <= 12 and doc["text"]
    # (one value per accepted token and per rejection: the exact count is checked on the engine above)
    assert s["num_accepted_tokens"] <= doc["vllm"]["positions_spent"] <= s["num_draft_tokens"]
    assert doc["vllm"]["positions_spent"] > 0


def test_serve_on_vllm_hands_vllm_serve_the_pair_the_rule_and_the_engine_arguments(tiny_vllm_pair, monkeypatch):
    """``cactus serve --backend vllm`` becomes vLLM's OpenAI server (exec): the converted pair, the
    profile's rule as the engine's default, the drafts, and CACTUS_VLLM_ARGS as vLLM's flags."""
    import os as os_mod

    pytest.importorskip("vllm")
    ran = []
    monkeypatch.setattr(os_mod, "execve", lambda path, argv, env: ran.append((argv, env)))
    monkeypatch.setenv("CACTUS_VLLM_ARGS", '{"enforce_eager": true, "enable_chunked_prefill": false}')
    args = ["serve", "--verifier", tiny_vllm_pair["verifier"], "--draft", tiny_vllm_pair["draft"], "--backend"]
    args += ["vllm", "-k", "3", "--rule", "cactus", "--delta", "0.5", "--port", "8123", "--parallel", "4"]
    r = CliRunner().invoke(app, args + ["--api-key", "sekrit"])
    assert r.exit_code == 0, r.output
    ((argv, env),) = ran
    assert env["VLLM_API_KEY"] == "sekrit" and "sekrit" not in " ".join(argv) + r.output  # (not in ps, not said)
    assert argv[1:5] == ["-m", "vllm.entrypoints.launchers.api_server.entry", "--model", tiny_vllm_pair["verifier"]]
    flags = {flag: argv[i + 1] for i, flag in enumerate(argv) if flag.startswith("--") and i + 1 < len(argv)}
    assert flags["--port"] == "8123" and flags["--max-num-seqs"] == "4"
    assert json.loads(flags["--additional-config"]) == {"cactus": {"rule": "cactus", "delta": 0.5}}
    spec = json.loads(flags["--speculative-config"])
    assert spec["method"] == "draft_model" and spec["num_speculative_tokens"] == 3
    assert "--enforce-eager" in argv and "--no-enable-chunked-prefill" in argv and "--no-enable-prefix-caching" in argv


def test_a_servers_request_takes_the_rule_fields_cactus_serve_takes(tiny_vllm_pair):
    """In vLLM's OpenAI server, top-level ``rule`` and ``delta`` (as ``cactus serve`` takes them) reach
    the request's extra_args (vLLM's own vllm_xargs win); a bad one is the request's one-line error."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from cactus_cli.infer.backends.vllm import plugin

    plugin.register()  # (the checks of a request's rule fields)
    plugin._patch_requests()  # (the server's modules imported now: in `vllm serve` they are before register)
    user = [{"role": "user", "content": "hi"}]
    made = ChatCompletionRequest(model="m", messages=user, rule="cactus", delta=0.5).to_sampling_params(8, {})
    assert made.extra_args == {"rule": "cactus", "delta": 0.5}
    both = ChatCompletionRequest(model="m", messages=user, delta=0.5, vllm_xargs={"delta": 1.0})
    assert both.to_sampling_params(8, {}).extra_args == {"delta": 1.0}
    assert ChatCompletionRequest(model="m", messages=user).to_sampling_params(8, {}).extra_args is None
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="extra_args.delta: rule 'cactus'"):
        ChatCompletionRequest(model="m", messages=user, delta=-1).to_sampling_params(8, {})


def test_bench_on_vllm_keeps_the_rows_done_when_a_later_engine_does_not_start(
    llm, tiny_vllm_pair, monkeypatch, tmp_path
):
    """The verifier-alone engine starts after the speculative rows: if it fails, those rows are still
    reported (stdout), the error is one line and the exit code non-zero."""
    from cactus_cli.core.errors import ConfigError
    from cactus_cli.infer.backends.vllm import offline

    pytest.importorskip("vllm")

    class Kept(offline.Engine):
        def close(self) -> None:
            pass

    def start(p, *a, **kw):
        if p.k == 0:
            raise ConfigError("vLLM did not start: no room")
        return Kept(llm, p.k)

    monkeypatch.setattr(offline, "start", start)
    args = ["bench", "--verifier", tiny_vllm_pair["verifier"], "--draft", tiny_vllm_pair["draft"], "--backend"]
    args += ["vllm", "--rules", "sps", "-k", "4", "--max-tokens", "8", "--limit", "1", "--temperature", "1"]
    r = CliRunner().invoke(app, args + ["--out", str(tmp_path)])  # (the table, as a user sees it, and the files)
    assert r.exit_code != 0 and "vLLM did not start: no room" in r.stderr and "Traceback" not in r.output
    assert "sps k=4" in r.stdout
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert [row["config"] for row in doc["results"]] == ["sps k=4"] and doc["interrupted"]
