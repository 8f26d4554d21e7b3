"""Settings from profiles, flags and chat's /set: values checked, YAML read safely, flags that would do nothing refused."""

from __future__ import annotations

import time

import pytest

from cactus_cli.app.config.parsing import parse_params
from cactus_cli.app.config.settings import check_flags_apply, flags_to_settings
from cactus_cli.core.errors import ConfigError
from tests.helpers import (
    ALIAS_BOMB,
    assert_one_line_error,
    invoke,
    one_line_error,
    pair_args,
    tiny_args,
)


@pytest.mark.parametrize(
    "flag,value,needle",
    [
        ("--seed", 2**64, "--seed must be an integer in 0..2^63-1"),
        ("--seed", -1, "--seed must be an integer in 0..2^63-1"),
        ("--device", "cuda:abc", "cuda:N (N a GPU index)"),
        ("--temperature", 1e-38, "--temperature must be 0 (greedy) or a number in 0.001..1e4"),
        ("--delta", 1e39, "--delta must be a number in 0..1e+06"),
    ],
)
def test_out_of_range_values(tiny, flag, value, needle):
    assert_one_line_error(invoke("generate", "hi", *pair_args(tiny), flag, value), needle)


def test_profiles_list_flags_a_bad_profile_and_lists_the_rest(isolated_home):
    folder = isolated_home / "profiles"
    folder.mkdir(parents=True)
    (folder / "broken.yaml").write_text("rule: [unclosed\n")
    (folder / "fine.yaml").write_text("rule: sps\n")
    r = invoke("profiles", "list")
    assert r.exit_code == 0
    assert "fine" in r.stdout and "default" in r.stdout and "broken" in r.stdout
    assert "invalid profile:" in r.stderr and "broken.yaml" in r.stderr


@pytest.mark.parametrize("value", ["[unclosed", "!!python/object/apply:os.system ['true']", "*alias"])
def test_param_yaml_errors_are_one_line(value):
    with pytest.raises(ConfigError, match="--param epsilon"):
        parse_params([f"epsilon={value}"])


def test_a_yaml_alias_bomb_is_refused_at_once(isolated_home):
    folder = isolated_home / "profiles"
    folder.mkdir(parents=True)
    (folder / "bomb.yaml").write_text("verifier: x\ncalibration:\n  " + ALIAS_BOMB.replace("\n", "\n  ") + "\n")
    t0 = time.monotonic()
    r = invoke("profiles", "show", "bomb")
    assert time.monotonic() - t0 < 10
    one_line_error(r, "YAML aliases")


def test_settings_that_do_nothing_are_errors(tiny, tmp_path):
    base = tiny_args(tiny)
    one_line_error(invoke("bench", *base, "-k", "2", "--max-draft-tokens", "50"), "--max-draft-tokens only applies")
    one_line_error(invoke("eval", *base, "--rules", "sps", "--delta", "0.5"), "--delta has no effect")
    none = [a for a in tiny_args(tiny) if a != tiny["draft_close"] and a != "--draft"]
    one_line_error(
        invoke("generate", "hi", *none, "--draft", "none", "--max-draft-tokens", "5"),
        "--max-draft-tokens has no effect without a draft",
    )
    settings = flags_to_settings(rule="sps", delta=0.5, ngram_max=2, verifier=tiny["verifier"], draft=tiny["draft"])
    from cactus_cli.app.config.profile_files import resolve_settings

    with pytest.raises(ConfigError, match="--delta has no effect"):
        check_flags_apply(resolve_settings(None, settings), settings)
    for body, needle in (
        ("draft: some/model\nngram_max: 3\n", "ngram_max applies only to prompt lookup"),
        ("num_draft_tokens: 4\nmax_draft_tokens: 3\n", "max_draft_tokens applies only with"),
    ):
        path = tmp_path / "p.yaml"
        path.write_text(f"verifier: {tiny['verifier']}\n" + body)
        one_line_error(invoke("profiles", "show", path), needle)


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
def test_cross_vocab_with_a_draft_that_has_no_model_is_an_error(tiny, lookup):
    from tests.helpers import assert_one_line_error, invoke

    args = ["--verifier", tiny["verifier"], "--draft", lookup, "--device", "cpu", "--dtype", "float32"]
    assert_one_line_error(
        invoke("generate", "hi", *args, "--cross-vocab", "intersection", "-n", "2"), f"--draft {lookup} has no model"
    )


def test_numbers_in_e_notation_are_read_as_numbers_everywhere_yaml_is(tiny):
    from cactus_cli.app.config.parsing import parse_params, parse_yaml

    assert parse_params(["epsilon=1e-3", "scale=2E+2"]) == {"epsilon": 0.001, "scale": 200.0}
    assert parse_yaml("delta: 5e-1\nname: 1e3x\n", "profile.yaml") == {"delta": 0.5, "name": "1e3x"}


@pytest.mark.parametrize("number", ["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    "command, flag",
    [
        ("calibrate", "--max-divergence"),
        ("calibrate", "--max-quality-drop"),
        ("calibrate", "--max-accuracy-drop"),
        ("calibrate", "--min-acceptance-gain"),
        ("bench", "--delta"),
        ("generate", "--param"),
        ("generate", "--top-p"),
    ],
)
def test_a_number_that_is_not_finite_is_refused_in_one_line(tiny, command, flag, number):
    from tests.helpers import assert_one_line_error, invoke

    value = f"epsilon={'.' + number.lstrip('-') if number != '-inf' else '-.inf'}" if flag == "--param" else number
    args = [command, *(["hi"] if command == "generate" else []), "--verifier", tiny["verifier"]]
    args += ["--draft", tiny["draft"], "--device", "cpu"]
    args += ["--rules", "cactus"] if command == "bench" else ["--rule", "tas" if flag == "--param" else "cactus"]
    if command == "calibrate" and flag == "--max-accuracy-drop":
        args += ["--tasks", "humaneval"]
    r = invoke(*args, flag, value)
    assert_one_line_error(r, "must be")
    assert "finite" in r.output or "in 0..100" in r.output or "in (0, 1]" in r.output


def test_a_profile_or_set_value_that_is_not_finite_is_refused():
    from cactus_cli.app.config.parsing import parse_yaml
    from cactus_cli.app.config.settings import check_layer

    for text in ("delta: .nan\n", "top_p: .inf\n", "rule_params: {epsilon: .nan}\n"):
        with pytest.raises(ConfigError, match="finite number"):
            check_layer(parse_yaml(text, "p.yaml"), "p.yaml")


def test_a_profile_that_names_no_rule_decodes_as_the_shipped_default(isolated_home, tmp_path):
    """The default profile decodes with SpS; the built-in default (a profile or a Session
    without `rule`) is the same rule, and delta alone is refused rather than silently ignored."""
    from cactus_cli.app.config.profile_files import load_profile, resolve_settings

    (tmp_path / "mine.yaml").write_text("verifier: embedded:qwen2.5-coder-1.5b\n")
    default, _ = load_profile("default")
    assert resolve_settings(str(tmp_path / "mine.yaml"), {}).rule == default["rule"] == "sps"
    assert load_profile("cactus")[0]["rule"] == "cactus"
    (tmp_path / "delta.yaml").write_text("verifier: embedded:qwen2.5-coder-1.5b\ndelta: 0.5\n")
    with pytest.raises(ConfigError, match="delta"):
        resolve_settings(str(tmp_path / "delta.yaml"), {})
