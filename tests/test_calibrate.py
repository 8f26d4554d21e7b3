"""`cactus calibrate` on a tiny pair: the sweep document, the choice rules, saving a profile
that `generate --profile` then uses, atomic saves, and bad inputs."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from typer.testing import CliRunner

from cactus_cli.app.config.profile_files import builtin_profile_dir, load_profile
from cactus_cli.app.grid import calibration as cal
from cactus_cli.cli.main import app
from cactus_cli.core import fileio
from tests.helpers import assert_one_line_error, calibrate_args, invoke

runner = CliRunner()


def calibrate(tiny, *args):
    base = [
        "calibrate",
        "--verifier",
        tiny["verifier"],
        "--draft",
        tiny["draft_close"],
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--limit",
        "2",
        "-n",
        "12",
        "--delta",
        "0.5,1",
        "-k",
        "1,2,3",
    ]
    return runner.invoke(app, base + [str(a) for a in args])


def test_calibrate_writes_a_profile_that_generate_uses(tiny, isolated_home, tmp_path):
    png = tmp_path / "curve.png"
    r = calibrate(tiny, "--max-divergence", "10", "--save", "tuned", "--plot", png, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert [row["delta"] for row in doc["delta_sweep"]["rows"]] == [0.0, 0.5, 1.0]
    assert doc["delta_sweep"]["rows"][0]["realized_kl_mean"] < 1e-6  # delta = 0 is SpS
    assert doc["chosen"]["delta"] == 1.0  # a loose budget takes the largest delta
    assert doc["chosen"]["num_draft_tokens"] in (1, 2, 3, "auto")
    assert [row["k"] for row in doc["k_sweep"]["rows"]] == [1, 2, 3, "auto"]  # exactly the candidates, and auto
    assert doc["k_sweep"]["verifier_alone_tokens_per_second"] > 0
    assert doc["meter_overhead"] is not None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = isolated_home / "profiles" / "tuned.yaml"
    data = yaml.safe_load(saved.read_text())
    assert data["delta"] == 1.0 and data["num_draft_tokens"] == doc["chosen"]["num_draft_tokens"]
    assert data["calibration"]["constraints"]["max_divergence"] == 10.0
    assert data["description"] == f"calibrated for {tiny['verifier']} / {tiny['draft_close']}"  # not the base's
    g = runner.invoke(app, ["generate", "hi", "--profile", "tuned", "-n", "4", "--json"])
    assert g.exit_code == 0, g.output
    settings = json.loads(g.output)["settings"]
    assert settings["rule_params"]["delta"] == 1.0 and settings["num_draft_tokens"] == data["num_draft_tokens"]
    assert settings["verifier"] == tiny["verifier"]


def test_tight_budget_keeps_sps_and_save_keeps_other_keys(tiny, tmp_path):
    target = tmp_path / "mine.yaml"
    target.write_text(
        f"description: my pair\nverifier: {tiny['verifier']}\ndraft: {tiny['draft_close']}\nmax_tokens: 7\n"
        "rule: cactus-exact\ndivergence: chi2\n"
    )
    r = calibrate(tiny, "--max-divergence", "0", "--save", target)
    assert r.exit_code == 0, r.output
    data = yaml.safe_load(target.read_text())
    assert data["rule"] == "sps" and "delta" not in data  # delta = 0 is saved as what it is: SpS
    assert "divergence" not in data and "rule_params" not in data  # (SpS takes none: refused at load)
    assert load_profile(str(target))[0]["rule"] == "sps"
    assert data["max_tokens"] == 7 and data["description"] == "my pair"
    assert "chosen: SpS (delta = 0)" in r.output and "delta sweep" in r.output and "trade-off" in r.output


def test_a_killed_save_leaves_the_old_profile_intact(tiny, tmp_path, monkeypatch):
    target = tmp_path / "keep.yaml"
    old = f"verifier: {tiny['verifier']}\ndraft: {tiny['draft_close']}\nrule: cactus\ndelta: 0.3\n"
    target.write_text(old)

    real_replace = os.replace

    def killed(src, dst):
        if os.fspath(dst) == os.fspath(target):
            raise KeyboardInterrupt  # the process dies between writing the temp file and the rename
        return real_replace(src, dst)  # other files (the cost-model cache) are written as usual

    monkeypatch.setattr(fileio.os, "replace", killed)
    r = calibrate(tiny, "--save", target)
    assert r.exit_code != 0
    assert target.read_text() == old
    assert sorted(os.listdir(tmp_path)) == ["cactus_home", "keep.yaml"]  # no temp file left behind


def test_choice_rules():
    rows = [
        {"delta": 0.0, "realized_kl_mean": 0.0, "loglik_vs_sps": 0.0},
        {"delta": 0.5, "realized_kl_mean": 0.03, "loglik_vs_sps": -0.01},
        {"delta": 1.0, "realized_kl_mean": 0.06, "loglik_vs_sps": -0.002},
        {"delta": 2.0, "realized_kl_mean": 0.09, "loglik_vs_sps": -0.2},
    ]
    C = cal.Constraints
    assert cal.choose_delta(rows, C(0.05))[0] == 0.5
    assert cal.choose_delta(rows, C(0.1))[0] == 2.0
    assert cal.choose_delta(rows, C(0.1, 0.05))[0] == 1.0
    assert cal.choose_delta(rows, C(0.1, 0.005))[0] == 1.0
    assert cal.choose_delta(rows, C(0.1, 0.001))[0] == 0.0
    # the cost model: no acceptance means no gain; perfect acceptance with a free draft and a flat
    # verify cost means k+1 tokens per call; a verify whose cost grows with width caps the gain
    flat = costs({1: 0.1, 9: 0.1}, draft=0.0)
    assert cal.measured_speedup(flat, 0.0, 4) == pytest.approx(1.0)
    assert cal.measured_speedup(flat, 1.0, 4) == pytest.approx(5.0, rel=1e-2)
    steep = costs({1: 0.1, 5: 0.45}, draft=0.0)  # 5 tokens cost 4.5x one (an AVX2 CPU)
    assert cal.measured_speedup(steep, 0.9, 4) < 1.0
    assert max(range(1, 13), key=lambda k: cal.measured_speedup(costs({1: 0.1, 13: 0.11}, 0.038), 0.85, k)) in (2, 3, 4)


def test_accuracy_and_acceptance_gain_bounds():
    """--max-accuracy-drop takes a delta whose drop is within the allowance and not confirmed by
    its interval; --min-acceptance-gain one that buys at least that much acceptance per step."""

    def row(delta, drop, ci, gain):
        return {
            "delta": delta,
            "realized_kl_mean": 0.01,
            "loglik_vs_sps": 0.0,
            "accuracy_vs_sps": drop,
            "accuracy_vs_sps_ci95": ci,
            "accepted_vs_sps": gain,
        }

    rows = [
        row(0.0, 0.0, (0.0, 0.0), 1.0),
        row(0.25, -0.01, (-0.05, 0.03), 1.08),
        row(0.5, -0.012, (-0.03, -0.001), 1.25),  # within 1.5 points, but the interval confirms a loss
        row(1.0, -0.03, (-0.08, 0.02), 1.3),  # a loss beyond 1.5 points
    ]
    C = cal.Constraints
    assert cal.choose_delta(rows, C(max_accuracy_drop=1.5))[0] == 0.25
    assert cal.choose_delta(rows, C(max_accuracy_drop=5))[0] == 1.0
    assert cal.choose_delta(rows, C(max_accuracy_drop=1.5, min_acceptance_gain=1.2)) == (
        0.0,
        "no delta above 0 met mean realized KL <= 0.05 and accuracy drop <= 1.5 points with its 95% interval "
        "reaching 0 (paired, vs delta = 0) and accepted tokens per step >= 1.2x delta = 0's; SpS (delta = 0) "
        "is the safe choice",
    )
    assert cal.choose_delta(rows, C(min_acceptance_gain=1.2))[0] == 1.0
    assert cal.choose_delta(rows, C(min_acceptance_gain=1.31))[0] == 0.0


def costs(verify: dict[int, float], draft: float):
    from cactus_cli.infer.kpolicy.costs import CostModel

    cm = CostModel()
    for w, t in verify.items():
        cm.add_verify(w, t)
    cm.add_draft(draft if draft > 0 else 1e-12)
    return cm


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--rule", "sps"], "calibrate tunes delta"),
        (["--temperature", "0"], "calibrate needs sampling"),
        (["--plot", "x.txt"], "give a .png path"),
        (["--max-divergence", "-1"], "must be a finite number >= 0"),
        (["--save", str(builtin_profile_dir() / "default.yaml")], "is a built-in profile"),
        (["-k", "0"], "each value must be an integer in 1..64"),
        (["--min-acceptance-gain", "0"], "--min-acceptance-gain must be a finite number > 0"),
    ],
)
def test_bad_inputs(tiny, args, needle):
    assert_one_line_error(calibrate(tiny, *args), needle)


def test_a_fixed_k_replaces_the_profiles_k_auto_bound(tiny, tmp_path):
    """A profile with ``num_draft_tokens: auto`` and ``max_draft_tokens`` calibrated to a fixed k:
    the bound goes (beside a fixed k it is an error that made the saved profile unloadable; the
    full suite met it when the sweep happened to pick k = 2)."""
    from cactus_cli.app.config.profile_files import load_profile, resolve_settings
    from cactus_cli.app.grid.calibrated_profile import save_profile

    target = tmp_path / "auto.yaml"
    target.write_text(
        f"verifier: {tiny['verifier']}\ndraft: {tiny['draft_close']}\nnum_draft_tokens: auto\nmax_draft_tokens: 6\n"
    )
    row = {
        "delta": 1.0,
        "acceptance_rate": 0.5,
        "per_token_acceptance": 0.5,
        "realized_kl_mean": 0.1,
        "loglik_vs_sps": 0.0,
    }
    doc = {
        "rule": "cactus",
        "chosen": {"delta": 1.0, "num_draft_tokens": 2, "reason": "fastest"},
        "delta_sweep": {"rows": [row]},
        "prompts": [1],
        "constraints": {},
        "k_sweep": {
            "rows": [{"k": 2, "tokens_per_second": 9.0}],
            "cost_ratio": 0.3,
            "verifier_alone_tokens_per_second": 7.0,
        },
    }
    doc["environment"] = {"device_name": "Other CPU [avx2] AVX2", "cpu_threads": 2}
    save_profile(target, None, resolve_settings(str(target), {}), doc)
    data, _ = load_profile(str(target))  # loads: no error
    assert data["num_draft_tokens"] == 2 and "max_draft_tokens" not in data
    # the machine its k was timed on is kept, and a start on another one says so
    from types import SimpleNamespace

    import torch

    from cactus_cli.app.runtime import calibrated_elsewhere
    from cactus_cli.infer.load.devices import device_name

    assert data["calibration"]["machine"] == "Other CPU [avx2] AVX2" and data["calibration"]["threads"] == 2
    pair = SimpleNamespace(verifier=SimpleNamespace(device=torch.device("cpu")))
    line = calibrated_elsewhere(resolve_settings(str(target), {}), pair)
    assert line and "k = 2 was calibrated on Other CPU" in line and "cactus calibrate --save" in line
    here = {**data["calibration"], "machine": device_name(torch.device("cpu"))}
    assert (
        calibrated_elsewhere(resolve_settings(str(target), {}).__class__(calibration=here, num_draft_tokens=2), pair)
        is None
    )


@pytest.mark.parametrize(
    "where,needle",
    [
        ("dir", "is a directory"),
        ("missing", "does not exist"),
        ("/proc/cactus-test.yaml", "cannot write in /proc"),
    ],
)
def test_calibrate_save_to_a_bad_place_fails_before_the_run(tiny, tmp_path, where, needle):
    target = {"dir": tmp_path, "missing": tmp_path / "no" / "such" / "x.yaml"}.get(where, where)
    r = invoke(*calibrate_args(tiny), "--save", target)
    assert_one_line_error(r, needle)
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--delta", "0.5,nan"], "--delta: each value must be a finite number"),
        (["--rule", "sps"], "calibrate tunes delta"),
    ],
)
def test_calibrate_validates_before_loading(tmp_path, args, needle):
    r = invoke("calibrate", "--verifier", tmp_path / "missing", "--draft", tmp_path / "missing2", *args)
    assert_one_line_error(r, needle)


@pytest.mark.parametrize("plain, fast", [(10.0, 12.0), (12.0, 10.0)])
def test_calibrate_advice_follows_the_rows_it_prints(plain, fast):
    from cactus_cli.app.grid import calibration as cal
    from cactus_cli.app.grid.sweep import ConfigResult
    from cactus_cli.core.stats import SpecStats
    from cactus_cli.infer.kpolicy.costs import CostModel

    costs = CostModel()  # a steep verify: the model predicts that no k pays
    costs.add_draft(0.01)
    for w in range(1, 8):
        costs.add_verify(w, 0.1 * w)

    def result(tps, a=0.5):
        s = SpecStats()
        s.num_output_tokens, s.total_seconds = int(tps * 10), 10.0
        s.num_draft_tokens, s.num_accepted_tokens = 10, int(10 * a)
        return ConfigResult(None, s, {}, 1)

    def time_config(cfg, label):
        return result(plain if cfg.k == 0 else fast if cfg.k == 2 else fast - 1)

    c = cal.Calibration(rule="cactus", k0=2)
    cal._choose_k(c, costs, cal.DeltaPoint(1.0, result(fast)), [1, 2, 3], {"delta": 1.0}, 8, time_config)
    if fast > plain:  # the table shows k = 2 beating the verifier alone: that is the choice, no advice against it
        assert c.chosen_k == 2 and c.advice == ""
    else:
        assert c.chosen_k == "auto" and f"{plain:.2f} tok/s" in c.advice and f"{fast:.2f} tok/s" in c.advice
