"""The chat REPL: multi-turn conversation over one engine whose KV caches carry over between
turns (only the new turn is encoded), slash commands, Ctrl-C handling, scripted mode."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from cactus_cli.app.config.parsing import parse_yaml
from cactus_cli.app.config.profile_files import resolve_settings
from cactus_cli.app.config.settings import Settings, check_rule_param, check_value, rule_param_specs
from cactus_cli.app.session import Session
from cactus_cli.core.acceptance import RULES
from cactus_cli.core.errors import CactusError, ConfigError, ContextLimitError
from cactus_cli.core.fileio import atomic_write, decode_input
from cactus_cli.core.stats import SpecStats

HELP = """commands:
  /help               this list
  /stats              session totals (vLLM metric names) and prefill tokens saved by cache reuse
  /set KEY=VALUE      change rule, a rule parameter (delta, ...), k (a number or auto), max_draft_tokens, temperature, top_p,
                      top_k or max_tokens from the next turn
  /set                show those settings
  /reset              forget the conversation (and the caches)
  /save PATH          save the transcript: .json, or Markdown for any other suffix
  /profile NAME       switch to another profile (reloads models if they differ)
  /exit               leave (Ctrl-D works too)
multi-line input: end a line with \\ to continue, or wrap a block in triple quotes \"\"\""""

SETTABLE = {  # (and every rule parameter: /set delta=0.5, /set divergence=chi2)
    "rule": "rule",
    "k": "num_draft_tokens",
    "num_draft_tokens": "num_draft_tokens",
    "max_draft_tokens": "max_draft_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_tokens": "max_tokens",
}
MODEL_KEYS = (
    "verifier",
    "draft",
    "tokenizer",
    "cross_vocab",
    "device",
    "dtype",
    "draft_params",
    "compile",
    "quantize",
    "tp",
)


@dataclass
class Turn:
    user: str
    reply: str
    interrupted: bool
    stats: dict[str, Any]


@dataclass
class ChatSession:
    session: Session  # the loaded pair; its settings are the chat's (/set and /profile change them)
    flags: dict[str, Any]  # command-line flags, re-applied over a /profile switch
    load_session: Callable[[Settings], Session]
    out: Any  # the ui module's console-ish helpers, see commands/chat.py
    history: list[dict[str, str]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    totals: SpecStats = field(default_factory=SpecStats)
    turn_seed: int = 0

    def __post_init__(self) -> None:
        self.turn_seed = int(self.settings.seed or 0)

    @property
    def settings(self) -> Settings:
        return self.session.settings

    @settings.setter
    def settings(self, value: Settings) -> None:
        self.session.settings = value

    # ------------------------------------------------------------------ loop

    def run(self, lines: Iterator[str]) -> None:
        """Read user turns from ``lines`` until /exit or end of input."""
        for line in lines:
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if not self.command(text):
                    return
                continue
            self.reply(line.rstrip("\n"))

    def reply(self, user: str) -> None:
        messages = self.history + [{"role": "user", "content": user}]  # (the session puts the system prompt first)
        params = replace(self.session.params(), seed=self.turn_seed)
        self.turn_seed += 1
        view = self.out.reply_view()
        parts: list[str] = []
        interrupted = False
        try:
            events = self.session.generate(messages, params=params, reuse_cache=True)
            with view:
                for ev in events:
                    parts.append(ev.text)
                    view.update(ev)
                    if ev.finish_reason == "context":
                        self.out.note("the context window is full; /reset to start a new conversation")
        except ContextLimitError as err:
            self.out.error(f"{err}; /reset to start a new conversation")
            return
        except KeyboardInterrupt:
            interrupted = True
        reply = "".join(parts)
        if interrupted:
            self.out.note("[reply interrupted; the partial reply is kept]")
        self.history += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        self.turns.append(Turn(user, reply, interrupted, view.stats.to_dict()))
        self.totals.merge(view.stats)  # the live view ends with the turn's stats line; /stats has totals

    # ------------------------------------------------------------------ commands

    def command(self, line: str) -> bool:
        """Run a slash command; False means leave."""
        name, _, arg = line[1:].partition(" ")
        arg = arg.strip()
        handler = {
            "help": lambda: self.out.info(HELP),
            "stats": self.show_stats,
            "set": lambda: self.set(arg),
            "reset": self.reset,
            "save": lambda: self.save(arg),
            "profile": lambda: self.switch_profile(arg),
        }.get(name.lower())
        if name.lower() in ("exit", "quit", "q"):
            return False
        if handler is None:
            self.out.error(f"unknown command /{name}; /help lists them")
            return True
        try:
            handler()
        except CactusError as err:
            self.out.error(str(err))
        return True

    def show_stats(self) -> None:
        d = self.totals.to_dict()
        d["turns"] = len(self.turns)
        d["prefill_tokens_saved"] = d["reused_prefix_tokens"]

        if self.session.has_drafter:  # a draft model or prompt lookup
            d["cost_model"] = self.session.cost_summary()
        self.out.stats_table(d)

    def set(self, arg: str) -> None:
        if not arg:
            s = self.settings
            shown = [f"{k}={getattr(s, v)}" for k, v in SETTABLE.items() if k != "num_draft_tokens"]
            self.out.info("  ".join(shown[:1] + [f"{k}={v}" for k, v in s.rule_kwargs().items()] + shown[1:]))
            return
        key, sep, raw = arg.partition("=")
        key = key.strip().lower()
        params = rule_param_specs()
        if not sep or (key not in SETTABLE and key not in params):
            known = [k for k in SETTABLE if k != "num_draft_tokens"] + list(params)
            raise ConfigError(f"/set expects KEY=VALUE with KEY one of: {', '.join(known)}")
        try:
            value = parse_yaml(raw.strip(), f"/set {key}")
        except ConfigError:
            value = raw.strip()  # not YAML: taken as the text it is (and checked below)
        if key in params:
            self.set_param(key, value)
            return
        field_name = SETTABLE[key]
        problem = check_value(field_name, value)
        if problem:
            raise ConfigError(f"/set {key}: {problem}")
        if field_name in ("num_draft_tokens", "max_draft_tokens") and self.settings.draft is None:
            raise ConfigError(f"/set {key}: there is no draft model in this session")
        if field_name == "max_draft_tokens" and self.settings.num_draft_tokens != "auto":
            raise ConfigError(
                f"/set {key}: applies only with -k auto (this session fixes k = "
                f"{self.settings.num_draft_tokens}); /set k=auto first"
            )

        trial = Settings(**{**self.settings.to_dict(), field_name: value})
        trial.rule_kwargs()  # the rule and its parameters must still agree
        self.settings = trial
        self.out.info(f"{key} = {value} (from the next turn)")

    def set_param(self, key: str, value: Any) -> None:
        """/set for a rule parameter: the session's rule must take it."""
        if problem := check_rule_param(key, value):
            raise ConfigError(f"/set {key}: {problem}")
        if key not in RULES[self.settings.rule].param_names():
            takes = [name for name, rule in RULES.items() if key in rule.param_names()]
            raise ConfigError(
                f"/set {key}: has no effect with rule {self.settings.rule!r}; /set rule={' or '.join(takes)} first"
            )
        value = float(value) if isinstance(value, int) and not isinstance(value, bool) else value
        trial = Settings(**{**self.settings.to_dict(), "rule_params": {**self.settings.rule_params, key: value}})
        trial.rule_kwargs()
        self.settings = trial
        self.out.info(f"{key} = {value} (from the next turn)")

    def reset(self) -> None:
        self.history = []
        self.session.reset()
        self.out.info("conversation cleared")

    def save(self, arg: str) -> None:
        if not arg:
            raise ConfigError("/save needs a path, e.g. /save chat.md or /save chat.json")
        path = Path(arg).expanduser()
        if path.is_dir():
            raise ConfigError(f"/save {arg}: is a directory; give a file path")
        if not path.parent.is_dir():
            raise ConfigError(f"/save {arg}: folder {path.parent} does not exist")
        doc = {
            "settings": self.settings.to_dict(),
            "turns": [t.__dict__ for t in self.turns],
            "stats": self.totals.to_dict(),
        }
        if path.suffix.lower() == ".json":
            text = json.dumps(doc, indent=2)
        else:
            lines = ["# cactus chat", ""]
            if self.settings.system:
                lines += [f"**system:** {self.settings.system}", ""]
            for t in self.turns:
                lines += [
                    "## user",
                    "",
                    t.user,
                    "",
                    "## assistant" + (" (interrupted)" if t.interrupted else ""),
                    "",
                    t.reply,
                    "",
                ]
            text = "\n".join(lines) + "\n"
        try:
            atomic_write(path, text)
        except OSError as err:
            raise ConfigError(f"/save {arg}: {err.strerror or err}") from None
        self.out.info(f"saved {len(self.turns)} turns to {path}")

    def switch_profile(self, name: str) -> None:
        if not name:
            raise ConfigError("/profile needs a name; `cactus profiles list` shows them")
        new = resolve_settings(name, self.flags)
        new = replace(new, seed=self.settings.seed)
        if any(getattr(new, k) != getattr(self.settings, k) for k in MODEL_KEYS):
            if self.settings.tp > 1 or new.tp > 1:
                raise ConfigError(
                    f"/profile {name}: other models under --tp need a new `cactus chat`; "
                    "this session keeps its tensor-parallel group"
                )
            self.out.info(f"loading the models of profile {name}…")
            self.session = self.load_session(new)
        self.settings = new
        params = " ".join(f"{k}={v}" for k, v in new.rule_kwargs().items())
        self.out.info(f"profile {name}: rule={new.rule} {params} k={new.num_draft_tokens}".replace("  ", " "))


def _line_source(interactive: bool, history_file: Path | None) -> Callable[[str], str]:
    """input() with line editing and history on a terminal; UTF-8 lines from stdin otherwise."""
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())

            if history_file is not None:
                try:
                    readline.read_history_file(history_file)
                except OSError:
                    pass
        except ImportError:  # not on every platform
            pass
        return input
    stream = getattr(sys.stdin, "buffer", None)

    def get(p: str) -> str:
        raw = stream.readline() if stream is not None else sys.stdin.readline().encode()
        if not raw:
            raise EOFError
        return decode_input(raw, "a chat line").rstrip("\r\n")

    return get


def read_turns(interactive: bool, prompt: str = "you> ", history_file: Path | None = None) -> Iterator[str]:
    """User turns: with line editing and history on a terminal, one per line otherwise.
    A trailing backslash continues a line; a block between triple quotes is one turn."""
    get = _line_source(interactive, history_file)

    def read(p: str) -> str:
        while True:
            try:
                return get(p)
            except UnicodeDecodeError:  # a terminal in another encoding: say so, keep the session
                print("warning: that line was not valid UTF-8; type it again", file=sys.stderr)

    try:
        while True:
            try:
                line = read(prompt)
            except EOFError:
                return
            # a block or a continued line cut off by the end of input is still a turn: never drop it
            if line.strip() == '"""':
                block: list[str] = []
                try:
                    while (nxt := read("... ")).strip() != '"""':
                        block.append(nxt)
                except EOFError:
                    if block:
                        yield "\n".join(block)
                    return
                line = "\n".join(block)
            while line.endswith("\\"):
                try:
                    line = line[:-1] + "\n" + read("... ")
                except EOFError:
                    yield line[:-1]
                    return
            yield line
    finally:
        if interactive and history_file is not None:
            try:
                import readline

                os.close(os.open(history_file, os.O_WRONLY | os.O_CREAT, 0o600))  # never readable by others
                readline.write_history_file(history_file)
                os.chmod(history_file, 0o600)  # (an older file, made with another mode)
            except (ImportError, OSError) as err:
                print(f"warning: --history {history_file}: could not save ({err})", file=sys.stderr)
