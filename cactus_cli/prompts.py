"""The built-in benchmark prompts, written for this project: code, maths word problems,
instruction following and open-ended writing (in the spirit of HumanEval / GSM8K / IFEval /
MT-Bench categories, original text). Also the loader for --prompts FILE (JSONL)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cactus_cli.errors import ConfigError


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    prompt: str
    where: str = ""  # "FILE:LINE" for prompts read from a file, for error messages


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
}

BUILTIN_PROMPTS: list[Prompt] = [
    Prompt(f"{cat}-{i + 1}", cat, text) for cat, texts in _BUILTIN.items() for i, text in enumerate(texts)
]


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


def load_prompts(path: str | None, limit: int | None) -> list[Prompt]:
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    if path is None:
        prompts = interleaved(BUILTIN_PROMPTS)
    else:
        from cactus_cli.fileio import read_utf8_file

        file = Path(path).expanduser()
        if file.is_dir():
            raise ConfigError(f"--prompts {path}: is a directory; give a JSONL file")
        if not file.is_file():
            raise ConfigError(f"--prompts {path}: no such file")
        prompts = []
        for n, line in enumerate(read_utf8_file(file, "the prompts file").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{n}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                raise ConfigError(f"{path}:{n}: each line must be an object with a non-empty string 'prompt'")
            prompts.append(Prompt(str(row.get("id", f"p{n}")), str(row.get("category", "default")), row["prompt"],
                                  f"{path}:{n}"))
        if not prompts:
            raise ConfigError(f"--prompts {path}: the file has no prompts")
    return prompts[:limit] if limit else prompts
