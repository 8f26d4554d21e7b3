"""Settings from profiles, flags and chat's /set: values checked, YAML read safely, flags that would do nothing refused."""

from __future__ import annotations

import time

import pytest

from cactus_cli.app.settings import check_flags_apply, flags_to_settings, parse_params
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
    from cactus_cli.app.profiles import resolve_settings

    with pytest.raises(ConfigError, match="--delta has no effect"):
        check_flags_apply(resolve_settings(None, settings), settings)
    for body, needle in (
        ("draft: some/model\nngram_max: 3\n", "ngram_max applies only to prompt lookup"),
        ("num_draft_tokens: 4\nmax_draft_tokens: 3\n", "max_draft_tokens applies only with"),
    ):
        path = tmp_path / "p.yaml"
        path.write_text(f"verifier: {tiny['verifier']}\n" + body)
        one_line_error(invoke("profiles", "show", path), needle)
