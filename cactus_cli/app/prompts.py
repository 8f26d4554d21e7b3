"""The built-in benchmark prompts: code, maths word problems, instruction following, open-ended
writing and input-grounded tasks written for this project (in the spirit of HumanEval / GSM8K /
IFEval / MT-Bench categories, original text), and ``edit``: 32 real functions of 20-80 lines from
CPython's standard library, each with an instruction whose answer reproduces most of it (made by
benchmarks/make_edit_prompts.py; PSF License, NOTICE). Also the loader for --prompts FILE (JSONL):
``{"prompt", "id"?, "category"?}`` rows, or MT-Bench / Spec-Bench ``question.jsonl`` rows
``{"question_id", "category", "turns": [...]}``, whose later turns are asked after the model's own
answer to the turn before (the grid sweep renders them: app/grid/sweep.py)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from cactus_cli.core.errors import ConfigError
from cactus_cli.core.fileio import read_utf8_file


@dataclass(frozen=True)
class Prompt:
    id: str | int  # as the file gives it
    category: str
    prompt: str
    where: str = ""  # "FILE:LINE" for prompts read from a file, for error messages
    reply: str = ""  # the start of the model's reply, written for it (after the chat template)
    stop: tuple[str, ...] = ()  # where its answer ends, beyond the run's own stop strings
    turns: tuple[str, ...] = ()  # a multi-turn question: the user's turns after ``prompt``
    chat: bool | None = None  # ... rendered through the chat template (set by ``protocol``)

    def protocol(self, chat: bool) -> "Prompt":
        """This prompt as the model gets it, with or without a chat template: as it is, and a
        multi-turn one remembers which, for its later turns (code tasks say more: tasks.py)."""
        return dataclasses.replace(self, chat=chat) if self.turns else self

    def conversation(self, answers: list[str]) -> list[dict[str, str]]:
        """The chat up to the user turn after ``answers`` (the model's own answers so far)."""
        users = (self.prompt, *self.turns)
        messages = []
        for user, answer in zip(users, answers):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return messages + [{"role": "user", "content": users[len(answers)]}]


_BUILTIN = {
    "code": [
        "Write a Python function that returns the n-th Fibonacci number using iteration, with a docstring.",
        "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
        "Implement binary search in Python over a sorted list and return the index or -1.",
        "Write a Python class for a stack with push, pop, peek and is_empty methods.",
        "Write a function that merges two sorted lists into one sorted list without using sort().",
        "Write a Python function that counts how often each word occurs in a text and returns the five most common.",
        "Write a SQL query that lists the ten customers with the highest total order value, given tables customers and orders.",
        "Write a Python function that parses a date in the form YYYY-MM-DD and returns the weekday name.",
    ],
    "math": [
        "A baker makes 48 rolls in the morning and sells three quarters of them by noon. In the afternoon she bakes 30 more and sells 20. How many rolls are left? Explain step by step.",
        "Tom is twice as old as his sister. In five years the sum of their ages will be 40. How old is Tom now? Show your reasoning.",
        "A train leaves at 9:40 and travels 210 km at 84 km/h. At what time does it arrive? Work it out step by step.",
        "A shirt costs 40 dollars. It is discounted by 25 percent, then a 10 percent tax is added. What is the final price? Explain.",
        "A rectangle has a perimeter of 36 cm and its length is twice its width. What is its area? Solve step by step.",
        "Three friends share a bill of 87 dollars. One pays 12 dollars more than each of the other two, who pay equally. How much does each pay?",
        "A tank fills in 6 hours with pipe A and in 3 hours with pipe B. How long does it take with both pipes open? Show the steps.",
        "If 5 workers build a wall in 12 days, how many days would 8 workers need at the same rate? Explain your answer.",
    ],
    "instructions": [
        "List exactly three benefits of regular exercise as a numbered list, each under ten words.",
        "Write a haiku about autumn rain. Do not use the word 'leaf'.",
        "Explain what a hash table is in exactly two sentences.",
        "Give five names for a coffee shop, in lowercase, separated by commas, with no other text.",
        "Summarize the water cycle in one paragraph of at most 60 words.",
        "Write a formal email declining a meeting invitation. Keep it under 80 words and end with 'Best regards'.",
        "Translate into French: 'The library opens at nine and closes at six on weekdays.'",
        "Reply with a JSON object with keys 'city' and 'country' for the capital of Japan, and nothing else.",
    ],
    "writing": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Describe a busy market in a city at dawn, using all five senses.",
        "Write a persuasive paragraph arguing that cities should plant more trees.",
        "Write a letter from a grandparent to a grandchild who is starting university.",
        "Explain to a ten-year-old why the sky is blue.",
        "Write a product description for a solar-powered backpack.",
        "Write the opening paragraph of a mystery novel set on a night train.",
        "Compare living in a small town and a big city in a balanced short essay.",
    ],
    # input-grounded: the answer reuses much of the input (edit code, answer from a passage),
    # where prompt lookup drafts long runs for free
    "grounded": [
        "Add type hints to this function and return the whole function:\n\n"
        "def average_price(items, currency):\n"
        "    total = 0\n"
        "    count = 0\n"
        "    for item in items:\n"
        "        if item.currency == currency:\n"
        "            total += item.price\n"
        "            count += 1\n"
        "    if count == 0:\n"
        "        return None\n"
        "    return total / count\n",
        "Fix the bug in this code and show the corrected code:\n\n"
        "def find_max(numbers):\n"
        "    best = 0\n"
        "    for n in numbers:\n"
        "        if n > best:\n"
        "            best = n\n"
        "    return best\n\n"
        "print(find_max([-5, -2, -9]))\n",
        "Rename the variable `data` to `records` everywhere in this code and return it:\n\n"
        "def load(path):\n"
        "    data = []\n"
        "    with open(path) as f:\n"
        "        for line in f:\n"
        "            data.append(line.strip().split(','))\n"
        "    print(len(data), 'rows')\n"
        "    return data\n",
        "Rewrite this code to use f-strings instead of format():\n\n"
        "name = 'Ada'\n"
        "age = 36\n"
        "print('Name: {}'.format(name))\n"
        "print('Age: {} years'.format(age))\n"
        "print('{} will be {} next year'.format(name, age + 1))\n",
        "Answer from the passage, quoting the sentence that supports your answer.\n\n"
        "Passage: The Harbor Street library opened in 1952 in a former customs house. It was "
        "enlarged in 1987, when a reading room for children was added on the east side. Since "
        "2015 the library has lent tools as well as books, and its most borrowed item is a "
        "cordless drill.\n\nQuestion: When was the children's reading room added, and where?",
        "Answer from the passage, quoting it where you can.\n\n"
        "Passage: The river ferry runs every 20 minutes from 6:00 to 22:00 on weekdays and every "
        "30 minutes from 8:00 to 20:00 at weekends. Bicycles travel free; dogs need a half-price "
        "ticket. The crossing takes seven minutes.\n\nQuestion: How often does the ferry run on "
        "a Saturday, and what does a dog cost?",
        "Continue this list with five more entries in exactly the same format:\n\n"
        "- id: 101, name: alpha, status: active\n"
        "- id: 102, name: beta, status: active\n"
        "- id: 103, name: gamma, status: inactive\n"
        "- id: 104, name: delta, status: active\n",
        "Add a docstring to each method of this class and return the whole class:\n\n"
        "class Counter:\n"
        "    def __init__(self):\n"
        "        self.counts = {}\n\n"
        "    def add(self, key):\n"
        "        self.counts[key] = self.counts.get(key, 0) + 1\n\n"
        "    def most_common(self, n):\n"
        "        return sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]\n",
    ],
}

BUILTIN_PROMPTS: list[Prompt] = [
    Prompt(f"{cat}-{i + 1}", cat, text) for cat, texts in _BUILTIN.items() for i, text in enumerate(texts)
]
EDIT_FILE = Path(__file__).parent / "data" / "edit.jsonl"
ON_REQUEST = ("edit",)  # categories used only when --category names them (their prompts are 300-900 tokens)


@cache
def edit_prompts() -> tuple[Prompt, ...]:
    """The ``edit`` category: a standard-library function and an instruction to change it."""
    rows = [json.loads(line) for line in EDIT_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    return tuple(Prompt(r["id"], r["category"], r["prompt"]) for r in rows)


def builtin_prompts(categories: list[str] | None) -> list[Prompt]:
    """The built-in prompts, interleaved by category; the long ``edit`` ones only when
    ``categories`` is given (``select`` keeps those named)."""
    return interleaved(BUILTIN_PROMPTS + list(edit_prompts()) if categories else BUILTIN_PROMPTS)


def interleaved(prompts: list[Prompt]) -> list[Prompt]:
    """Round-robin over categories, so --limit N still covers every category."""
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out, i = [], 0
    while len(out) < len(prompts):
        for items in by_cat.values():
            if i < len(items):
                out.append(items[i])
        i += 1
    return out


def load_prompts(path: str | None, limit: int | None, categories: list[str] | None = None) -> list[Prompt]:
    """The built-in set (interleaved by category) or a JSONL file (``{"prompt"}`` rows or
    MT-Bench / Spec-Bench ``{"question_id", "category", "turns"}`` rows); ``categories`` keeps
    only those categories, then ``limit`` the first N."""
    check_limit(limit)
    if path is None:
        prompts = builtin_prompts(categories)
    else:
        prompts = []
        for n, row, where in read_jsonl(path, "--prompts", "prompts"):
            first, *later = row_turns(row, where)
            prompts.append(
                Prompt(row_id(row, f"p{n}", where), row_category(row, where), first, where, turns=tuple(later))
            )
    return select(prompts, categories, limit)


def check_limit(limit: int | None) -> None:
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")


def row_id(row: dict, default: str, where: str) -> str | int:
    """A row's 'id' (or MT-Bench's 'question_id') as given (a string or an integer: results name
    it the same way), else ``default``."""
    key = "id" if "id" in row or "question_id" not in row else "question_id"
    ident = row.get(key, default)
    if isinstance(ident, bool) or not isinstance(ident, (str, int)):
        raise ConfigError(f"{where}: {key!r} must be a string or an integer, got {ident!r}")
    return ident


def row_category(row: dict, where: str) -> str:
    """A row's 'category' (a non-empty string), else "default"."""
    category = row.get("category", "default")
    if not isinstance(category, str) or not category.strip():
        raise ConfigError(f"{where}: 'category' must be a non-empty string, got {category!r}")
    return category


def row_turns(row: dict, where: str) -> list[str]:
    """A row's user turns: its 'prompt', or MT-Bench / Spec-Bench's 'turns' (each a non-empty string)."""
    if "turns" not in row:
        return [row["prompt"]]
    if "prompt" in row:
        raise ConfigError(f"{where}: give 'prompt' or 'turns', not both")
    turns = row["turns"]
    if not isinstance(turns, list) or not turns:
        raise ConfigError(f"{where}: 'turns' must be a non-empty list of the user's turns, got {turns!r:.60}")
    for j, turn in enumerate(turns):
        if not isinstance(turn, str) or not turn.strip():
            raise ConfigError(f"{where}: 'turns'[{j}] must be a non-empty string, got {turn!r:.60}")
    return turns


def read_jsonl(path: str, flag: str, what: str) -> list[tuple[int, dict, str]]:
    """The rows of a JSONL file of objects with a non-empty string 'prompt' (or a list of
    'turns': ``row_turns`` checks them), as (line number, row, "FILE:LINE"); anything else is an
    error naming the file and line. Lines end at "\n" only (U+2028 and its kind are text inside a
    JSON string); a FIFO (``--prompts <(gen)``) is read like a file. A line nested deeper than Python's JSON reader goes (about 1,000 levels)
    is an error."""

    file = Path(path).expanduser()
    if file.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a JSONL file")
    if not file.exists():
        raise ConfigError(f"{flag} {path}: no such file")
    try:
        text = read_utf8_file(file, f"the {what} file").removeprefix("\ufeff")  # (a byte-order mark some editors write)
    except OSError as err:
        raise ConfigError(f"{flag} {path}: cannot read it ({err.strerror or err})") from None
    rows = []
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{n}: not valid JSON ({err.msg})") from None
        except RecursionError:
            raise ConfigError(f"{path}:{n}: nested too deeply to read; each line must be a flat object") from None
        if not isinstance(row, dict) or (
            "turns" not in row and (not isinstance(row.get("prompt"), str) or not row["prompt"].strip())
        ):
            raise ConfigError(
                f"{path}:{n}: each line must be an object with a non-empty string 'prompt' "
                "or MT-Bench / Spec-Bench 'turns' (a list of the user's turns)"
            )
        try:  # (JSON can carry a lone surrogate, "\ud800", that no tokenizer takes)
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(
                f"{path}:{n}: the text holds an unpaired surrogate escape (\\ud800 to \\udfff); write valid Unicode"
            ) from None
        rows.append((n, row, f"{path}:{n}"))
    if not rows:
        raise ConfigError(f"{flag} {path}: the file has no {what}")
    return rows


def select(items: list, categories: list[str] | None, limit: int | None) -> list:
    """Keep ``categories`` (each must exist), then the first ``limit``."""
    if categories:
        known = sorted({p.category for p in items})
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise ConfigError(f"--category: nothing in category {unknown[0]!r} (there are: {', '.join(known)})")
        items = [p for p in items if p.category in categories]
    return items[:limit] if limit else items
