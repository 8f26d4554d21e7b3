"""Options shared by generate, chat, bench and calibrate, declared once. Every option defaults
to None, meaning "not given", so the profile underneath keeps its value (defaults < profile < flags).
What the values mean and how they are checked lives with the settings (app/config/settings.py)."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import click
import typer
from typer.core import TyperCommand

from cactus_cli.cli.edge import user_errors
from cactus_cli.core.errors import ConfigError
from cactus_cli.core.fileio import check_output_file

MODEL = "Models"
DECODING = "Speculative decoding"
SAMPLING = "Sampling"
RUNTIME = "Runtime"

Profile = Annotated[
    Optional[str],
    typer.Option(
        "--profile",
        "-p",
        help="Profile name (see `cactus profiles list`) or path to a YAML file. Default: the `default` profile.",
        rich_help_panel=MODEL,
    ),
]
Verifier = Annotated[
    Optional[str],
    typer.Option(
        "--verifier",
        help="Verifier (large) model: hub id, local folder, .gguf file, or embedded:NAME.",
        rich_help_panel=MODEL,
    ),
]
Draft = Annotated[
    Optional[str],
    typer.Option(
        "--draft",
        help="Draft (small) model, same sources as --verifier; or a drafter that needs no model: {drafters}; `NAME+MODEL` lets MODEL draft when the drafter has nothing; `none` runs the verifier alone. bench and eval take a comma list, e.g. ngram,suffix,embedded:qwen2.5-coder-0.5b.",
        rich_help_panel=MODEL,
    ),
]
Remember = Annotated[
    Optional[str],
    typer.Option(
        "--remember",
        help="With --draft suffix: load the history tree (earlier prompts and outputs) from this file and save it back after every answer, so the next run drafts from what this one wrote. Off by default: nothing you type is written to disk unless you ask. The file keeps the most recent documents within 65,536 tokens (at most 4,096 documents, 16 MB); runs sharing it merge their documents under a lock; a file it cannot use (another format or tokenizer, damaged, too large) is moved aside to FILE.bad-<time>, never overwritten.",
        rich_help_panel=MODEL,
    ),
]
History = Annotated[
    Optional[str],
    typer.Option(
        "--history",
        help="Keep the lines typed at chat's prompt (line editing's up-arrow history) in this file, mode 0600, across sessions. Off by default: what you type (keys, passwords) is never written to disk unless you ask.",
        rich_help_panel=MODEL,
    ),
]
CrossVocabOpt = Annotated[
    Optional[str],
    typer.Option(
        "--cross-vocab",
        help="A draft whose tokenizer differs from the verifier's: `string` re-tokenizes the draft's text into verifier tokens (one-hot drafts); `intersection` drafts from the draft's distribution over the tokens both vocabularies spell alike; `auto` (default) picks string. Both keep SpS exactly lossless. bench and eval take a comma list (string,intersection) and time each method side by side.",
        rich_help_panel=MODEL,
    ),
]
Tokenizer = Annotated[
    Optional[str],
    typer.Option(
        "--tokenizer",
        help="Tokenizer for both models (default: the verifier's; needed for a bare .gguf).",
        rich_help_panel=MODEL,
    ),
]
Rule = Annotated[
    Optional[str],
    typer.Option("--rule", "-r", help="Acceptance rule: {rules}.", rich_help_panel=DECODING),
]
Delta = Annotated[
    Optional[float],
    typer.Option(
        "--delta",
        "-d",
        help="Divergence budget of {delta_rules} (the parameter delta; 0 = lossless SpS).",
        rich_help_panel=DECODING,
    ),
]
DraftParam = Annotated[
    Optional[list[str]],
    typer.Option(
        "--draft-param",
        help="A parameter of a drafter that needs no model, as KEY=VALUE, repeatable: {draft_params}.",
        rich_help_panel=MODEL,
    ),
]
Param = Annotated[
    Optional[list[str]],
    typer.Option(
        "--param",
        help="A rule parameter as KEY=VALUE, repeatable: {params}.",
        rich_help_panel=DECODING,
    ),
]


def rule_help(text: str) -> str:
    """``text`` with {rules}, {delta_rules} and {params} filled in from the rule registry (RULES),
    {drafters} and {draft_params} from the drafters' (KINDS), {backends} and {backend_names} from
    the backends' (BACKENDS): what --help lists is what the registries hold, one registered later
    included. Imported when a command's help is shown, not at start (the registries import torch)."""
    if "{" not in text:
        return text
    from cactus_cli.core.acceptance import RULES
    from cactus_cli.infer.backends.registry import BACKENDS, CHOICES
    from cactus_cli.infer.draft import KINDS

    params = {}
    for rule in RULES.values():
        for prm in rule.params:
            params.setdefault(prm.name, (prm, []))[1].append(rule.name)
    listed = "; ".join(f"{name} ({', '.join(rules)}: {prm.valid_range})" for name, (prm, rules) in params.items())
    drafters = "; ".join(f"`{k.name}` drafts by {k.summary}" for k in KINDS.values())
    draft_params = "; ".join(f"{p.name} for {k.name}, {p.valid_range}" for k in KINDS.values() for p in k.params)
    return text.format(
        drafters=drafters,
        draft_params=draft_params or "none",
        backends="; ".join(f"{b.name} runs {b.summary}" for b in BACKENDS.values()),
        backend_names=", ".join(CHOICES),
        rules=", ".join(RULES),
        delta_rules=" / ".join(r.name for r in RULES.values() if "delta" in r.param_names()),
        params=listed,
    )


class RuleHelpCommand(TyperCommand):
    """A command whose options' help may name the rules and their parameters (``rule_help``)."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        for param in self.params:
            if getattr(param, "help", None):
                param.help = rule_help(param.help)
        super().format_help(ctx, formatter)


NumDraft = Annotated[
    Optional[str],
    typer.Option(
        "--num-draft-tokens",
        "-k",
        help="Draft tokens per verification step (k), or `auto`: before each step pick k in 0..--max-draft-tokens for the most tokens per second, from the step costs measured on this machine (k = 0 is plain decoding).",
        rich_help_panel=DECODING,
    ),
]
MaxDraft = Annotated[
    Optional[int],
    typer.Option(
        "--max-draft-tokens",
        help="Largest k that `-k auto` may pick (default 64: it drafts only as long as the measured costs and the draft's expected acceptance say pays).",
        rich_help_panel=DECODING,
    ),
]
Temperature = Annotated[
    Optional[float],
    typer.Option("--temperature", "-t", help="Sampling temperature; 0 = greedy.", rich_help_panel=SAMPLING),
]
TopK = Annotated[
    Optional[int], typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).", rich_help_panel=SAMPLING)
]
TopP = Annotated[
    Optional[float], typer.Option("--top-p", help="Nucleus sampling mass (1 = off).", rich_help_panel=SAMPLING)
]
MaxTokens = Annotated[
    Optional[int],
    typer.Option(
        "--max-tokens",
        "-n",
        help="Stop after this many new tokens. serve: the most any answer may have (a request without max_tokens otherwise runs to its end or the context window).",
        rich_help_panel=SAMPLING,
    ),
]
Seed = Annotated[
    Optional[int],
    typer.Option(
        "--seed",
        "-s",
        help="Random seed (same seed, device and fixed k: same text; -k auto follows measured timings).",
        rich_help_panel=SAMPLING,
    ),
]
Stop = Annotated[
    Optional[list[str]],
    typer.Option("--stop", help="Stop when this string appears; repeatable.", rich_help_panel=SAMPLING),
]
Device = Annotated[
    Optional[str],
    typer.Option("--device", help="auto (CUDA if present), cpu, cuda, cuda:N, mps.", rich_help_panel=RUNTIME),
]
Dtype = Annotated[
    Optional[str], typer.Option("--dtype", help="auto, float32, float16, bfloat16.", rich_help_panel=RUNTIME)
]
Compile = Annotated[
    Optional[str],
    typer.Option(
        "--compile",
        help="auto, on, off: static KV caches and compiled fixed-shape steps (CUDA graphs on CUDA). auto = on for CUDA; on a CPU only where an earlier run measured it faster. Compiling takes a while once per run and is not counted in tokens/s.",
        rich_help_panel=RUNTIME,
    ),
]
Quantize = Annotated[
    Optional[str],
    typer.Option(
        "--quantize",
        help="none, int8, int4, w8a8, auto: int8 / int4 weight-only quantization of every Linear layer (lm_head included), activations in bfloat16; w8a8 (CPU): int8 weights times int8 activations quantized per row at each call (fbgemm's int8 GEMM; SmoothQuant first; lm_head included). Cached after the first start. auto: on a CPU int8 or w8a8, whichever is faster here (measured once), w8a8 only where its measured quality on this model is within 0.03 nats/token; none on a GPU. `cactus models quality` measures what each costs.",
        rich_help_panel=RUNTIME,
    ),
]
Tp = Annotated[
    Optional[int],
    typer.Option(
        "--tp",
        help="Shard the verifier over N processes with tensor parallelism (transformers' TP plans; NCCL on CUDA, gloo in float32 on a CPU). Starts the other ranks itself, or runs under torchrun.",
        rich_help_panel=RUNTIME,
    ),
]
Backend = Annotated[
    Optional[str],
    typer.Option(
        "--backend",
        help="What runs the models: {backends}; auto (default): the first of them, in that order, that runs the models with the settings given and is installed (a setting one of them lacks, such as --quantize, --dtype, --compile on, --tp or a GPU, passes it over).",
        rich_help_panel=RUNTIME,
    ),
]
Threads = Annotated[
    Optional[int],
    typer.Option(
        "--threads",
        help="CPU threads for either backend (default: the CPUs this process may use).",
        rich_help_panel=RUNTIME,
    ),
]
ChatTemplate = Annotated[
    Optional[bool],
    typer.Option(
        "--chat-template/--no-chat-template",
        help="Wrap the prompt in the model's chat template (default: when the tokenizer has one).",
        rich_help_panel=RUNTIME,
    ),
]
NoColor = Annotated[
    bool,
    typer.Option("--no-color", help="No colours in the live view (NO_COLOR is honoured too).", rich_help_panel=RUNTIME),
]
System = Annotated[
    Optional[str], typer.Option("--system", help="System prompt (with a chat template).", rich_help_panel=RUNTIME)
]

# name -> (annotation, Settings key or None for options that are not settings)
SHARED: dict[str, tuple[Any, str | None]] = {
    "profile": (Profile, None),
    "verifier": (Verifier, "verifier"),
    "draft": (Draft, "draft"),
    "tokenizer": (Tokenizer, "tokenizer"),
    "cross_vocab": (CrossVocabOpt, "cross_vocab"),
    "rule": (Rule, "rule"),
    "delta": (Delta, "delta"),
    "param": (Param, "rule_params"),
    "draft_param": (DraftParam, "draft_params"),
    "num_draft_tokens": (NumDraft, "num_draft_tokens"),
    "max_draft_tokens": (MaxDraft, "max_draft_tokens"),
    "temperature": (Temperature, "temperature"),
    "top_k": (TopK, "top_k"),
    "top_p": (TopP, "top_p"),
    "max_tokens": (MaxTokens, "max_tokens"),
    "seed": (Seed, "seed"),
    "stop": (Stop, "stop"),
    "device": (Device, "device"),
    "dtype": (Dtype, "dtype"),
    "compile": (Compile, "compile"),
    "quantize": (Quantize, "quantize"),
    "tp": (Tp, "tp"),
    "backend": (Backend, "backend"),
    "threads": (Threads, "threads"),
    "chat_template": (ChatTemplate, "chat_template"),
    "system": (System, "system"),
    "no_color": (NoColor, None),
    "remember": (Remember, "remember"),
    "history": (History, "history"),
}
MODEL_AND_SAMPLING = (
    "profile",
    "verifier",
    "draft",
    "draft_param",
    "tokenizer",
    "cross_vocab",
    "param",
    "temperature",
    "top_k",
    "top_p",
    "max_tokens",
    "seed",
    "device",
    "dtype",
    "chat_template",
    "no_color",
    "max_draft_tokens",
    "tp",
    "threads",
)
GENERATION = MODEL_AND_SAMPLING + (
    "rule",
    "delta",
    "num_draft_tokens",
    "stop",
    "system",
    "compile",
    "quantize",
    "remember",
    "backend",
)


@dataclass
class Shared:
    """What the shared options said: the profile to start from, --no-color, and the flags as
    Settings keys (``...`` where not given, so the profile's value shows through)."""

    profile: str | None
    no_color: bool
    flags: dict[str, Any]


def shared_options(*names: str) -> Callable:
    """Add the shared options ``names`` to a Typer command, declared once here. The command takes
    one parameter ``shared: Shared`` instead of a dozen copies of the same declarations."""

    def deco(fn: Callable) -> Callable:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != "shared"]
        ordered = sorted(names, key=list(SHARED).index)  # --help lists them in SHARED's order
        added = [
            inspect.Parameter(
                n, inspect.Parameter.KEYWORD_ONLY, annotation=SHARED[n][0], default=False if n == "no_color" else None
            )
            for n in ordered
        ]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            from cactus_cli.app.config.settings import (
                flags_to_settings,  # (here, not above: --help stays torch-free)
            )

            given = {n: kwargs.pop(n) for n in names}
            with user_errors():
                flags = flags_to_settings(**{SHARED[n][1]: v for n, v in given.items() if SHARED[n][1]})
            return fn(*args, **kwargs, shared=Shared(given.get("profile"), bool(given.get("no_color")), flags))

        wrapper.__signature__ = sig.replace(parameters=own + added)  # what Typer reads
        return wrapper

    return deco


def plot_option(text: str) -> Any:
    """The --plot PNG option of bench and calibrate, with the command's own help ``text``
    (checked before the run by ``check_plot``, drawn by ``draw_plot``)."""
    return Annotated[Optional[Path], typer.Option("--plot", help=text)]


def check_plot(plot: Path | None) -> Path | None:
    """--plot checked before the run: a .png path that can be written, and matplotlib to draw it."""
    if plot is None:
        return None
    if plot.suffix.lower() != ".png":
        raise ConfigError(f"--plot {plot}: give a .png path")
    plot = check_output_file(plot, "--plot")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError('--plot needs matplotlib: pip install -e ".[plot]"') from None
    return plot


def draw_plot(draw: Callable[[dict, Path], None], doc: dict, plot: Path) -> None:
    """``draw`` ``doc`` to the --plot PNG: a write that fails is the user's error, said plainly."""
    try:
        draw(doc, plot)
    except OSError as e:
        raise ConfigError(f"--plot: could not write {plot} ({e.strerror or e})") from None
