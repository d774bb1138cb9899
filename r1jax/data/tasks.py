"""Generated verifiable tasks for R1-style post-training, no download: digit reversal, multi-digit
arithmetic and countdown (notes/grpo.md §5, notes/posttraining.md §6).

Each task (`TASKS[name]`, a `Task`) gives
- `generate(n, seed, split="train", **difficulty)`: n records, the same for the same arguments.
  A record is {"task", "prompt" (the user message; it asks for the answer inside
  <answer></answer>), "answer" (str), and the task's fields}.
- `solution(example)`: a short worked answer in the assistant format
  "<think>\\n{reasoning}\\n</think>\\n<answer>\\n{answer}\\n</answer>", for cold-start SFT (a few
  tokens a step: the models are tiny).
- `exact_reward` and `partial_reward(completion, example)`: 1.0 iff right, and a score in [0, 1]
  that gives GRPO a signal before any exact success (notes/posttraining.md §6.2: partial credit
  learns from step 0 where exact reward leaves every group at zero variance).

Held-out evaluation: every problem belongs to one split, by a hash of its identity (`Task.key`),
so an eval set never shares a problem with any train set, whatever the seeds and sizes. A train
set is a stream (a problem may repeat); an eval set holds distinct problems.
"""
from __future__ import annotations

import ast
import collections
import dataclasses
import hashlib
import inspect
import random
import re
from fractions import Fraction
from typing import Any, Callable, Mapping

from r1jax.rl.rewards import Reward, extract_answer

Example = Mapping[str, Any]
EVAL_PERCENT = 10                       # the share of each task's problems held out for eval
SPLITS = ("train", "eval")
ASK = " Put the answer inside <answer></answer>."


def assistant(reasoning: str, answer: str) -> str:
    """The assistant turn as format_strict wants it."""
    return f"<think>\n{reasoning}\n</think>\n<answer>\n{answer}\n</answer>"


def _span(name: str, value: int | tuple[int, int] | list[int], least: int) -> tuple[int, int]:
    """A difficulty that is a number or an inclusive [lo, hi] range, as (lo, hi)."""
    lo, hi = (value, value) if isinstance(value, int) else tuple(value)
    if not (isinstance(lo, int) and isinstance(hi, int) and least <= lo <= hi):
        raise ValueError(f"{name}: want an int >= {least} or a range [lo, hi] of them, got {value!r}")
    return lo, hi


def _in_eval(task: str, key: str) -> bool:
    # sha256, not hash(): the same partition in every process (hash() is salted per process)
    return int(hashlib.sha256(f"{task}|{key}".encode()).hexdigest()[:8], 16) % 100 < EVAL_PERCENT


@dataclasses.dataclass(frozen=True)
class Task:
    """One verifiable task. `make(rng, **difficulty)` draws one problem's fields (with "prompt"
    and "answer"); `key(example)` names the problem (equal keys: the same problem)."""
    name: str
    make: Callable[..., dict]
    key: Callable[[Example], str]
    solution: Callable[[Example], str]
    exact_reward: Reward
    partial_reward: Reward

    def generate(self, n: int, seed: int, split: str = "train", **difficulty: Any) -> list[dict]:
        """n problems of `split` at `difficulty` (the keyword arguments of `make`), seeded."""
        if split not in SPLITS:
            raise ValueError(f"split: want one of {', '.join(SPLITS)}, got {split!r}")
        known = [p for p in inspect.signature(self.make).parameters if p != "rng"]
        if unknown := sorted(set(difficulty) - set(known)):
            raise ValueError(f"{self.name}: unknown difficulty {', '.join(unknown)}; known: {', '.join(known)}")
        rng = random.Random(f"{self.name}/{split}/{seed}")     # a str seed: the same in every process
        out, seen, tries = [], set(), 0
        while len(out) < n:
            tries += 1
            if tries > 100 * n + 1000:
                raise ValueError(f"{self.name}: {split} split has too few distinct problems at "
                                 f"{difficulty or 'the default difficulty'} for n={n}")
            example = self.make(rng, **difficulty)
            key = self.key(example)
            if _in_eval(self.name, key) != (split == "eval") or (split == "eval" and key in seen):
                continue
            seen.add(key)
            out.append({"task": self.name, **example})
        return out


# ------------------------------------------------------------------------------------- reverse

def _reverse_make(rng: random.Random, digits: int | tuple[int, int] = 4) -> dict:
    """A string of `digits` digits (leading zeros allowed) to write backwards."""
    lo, hi = _span("digits", digits, 1)
    number = "".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi)))
    return {"prompt": f"Reverse the digits {number}.{ASK}", "answer": number[::-1],
            "number": number, "digits": len(number)}


def _reverse_solution(example: Example) -> str:
    answer = example["answer"]
    return assistant(f"{' '.join(example['number'])}\nreversed: {' '.join(answer)}", answer)


def _reverse_exact(completion: str, example: Example) -> float:
    """1.0 iff the answer is the reversed string (no inner spaces)."""
    return float(extract_answer(completion) == example["answer"])


def _reverse_partial(completion: str, example: Example) -> float:
    """The share of positions right, counted from the left over the longer of answer and target,
    so a missing or an extra digit costs: "3214" for "3124" is 2/4, "312" is 3/4, "31240" 4/5."""
    got, want = extract_answer(completion), example["answer"]
    if got is None:
        return 0.0
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want))


REVERSE = Task("reverse", _reverse_make, lambda e: e["number"], _reverse_solution,
               _reverse_exact, _reverse_partial)


# ---------------------------------------------------------------------------------- arithmetic

def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1)


def _arithmetic_make(rng: random.Random, digits: int | tuple[int, int] = 3, ops: str = "+-*") -> dict:
    """a op b with operands of `digits` digits each (drawn separately in a range) and op from
    `ops`; a subtraction puts the larger operand first, so answers are never negative."""
    lo, hi = _span("digits", digits, 1)
    if not ops or set(ops) - set("+-*"):
        raise ValueError(f"ops: want a non-empty string of + - *, got {ops!r}")
    op = rng.choice(ops)
    a, b = _operand(rng, rng.randint(lo, hi)), _operand(rng, rng.randint(lo, hi))
    if op == "-" and a < b:
        a, b = b, a
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return {"prompt": f"Compute {a} {op} {b}.{ASK}", "answer": str(value), "a": a, "b": b, "op": op}


def _column_steps(a: int, b: int, op: str) -> list[str]:
    """Schoolbook columns from the right: "8+7+1=16" (with the carry), "12-8=4" (borrowed),
    "5-3-1=1" (paying the borrow back)."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(len(xs)):                                  # a has at least b's digits here
        x, y = int(xs[i]), int(ys[i]) if i < len(ys) else 0
        if op == "+":
            s = x + y + carry
            steps.append(f"{x}+{y}{'+1' if carry else ''}={s}")
            carry = s // 10
        else:
            d = x - y - carry
            steps.append(f"{x + 10 if d < 0 else x}-{y}{'-1' if carry else ''}={d % 10}")
            carry = int(d < 0)
    return steps


def _arithmetic_solution(example: Example) -> str:
    a, b, op = example["a"], example["b"], example["op"]
    if op == "*":
        steps = [f"{a}*{int(d) * 10 ** i}={a * int(d) * 10 ** i}"
                 for i, d in enumerate(str(b)[::-1]) if d != "0"] or [f"{a}*0=0"]
        if len(steps) > 1:
            steps.append(f"sum={a * b}")
    else:
        # columns run over the longer operand (addition commutes; a subtraction's a is the larger)
        steps = _column_steps(max(a, b), min(a, b), "+") if op == "+" else _column_steps(a, b, "-")
    return assistant("\n".join(steps), example["answer"])


def _arithmetic_exact(completion: str, example: Example) -> float:
    """1.0 iff the answer is the result's decimal digits exactly."""
    return float(extract_answer(completion) == example["answer"])


def _arithmetic_partial(completion: str, example: Example) -> float:
    """The share of digits right, aligned from the right (units with units) over the longer of
    answer and target: "56188" for "56088" is 4/5, "6088" 4/5, "156088" 5/6."""
    got, want = extract_answer(completion), example["answer"]
    if got is None:
        return 0.0
    return sum(a == b for a, b in zip(got[::-1], want[::-1])) / max(len(got), len(want))


ARITHMETIC = Task("arithmetic", _arithmetic_make, lambda e: f"{e['a']}{e['op']}{e['b']}",
                  _arithmetic_solution, _arithmetic_exact, _arithmetic_partial)


# ----------------------------------------------------------------------------------- countdown

_ARITH = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_COUNTDOWN_CHARS = re.compile(r"[0-9+\-*/()\s]{1,200}")


def _countdown_make(rng: random.Random, count: int | tuple[int, int] = 3, max_number: int = 20,
                    max_target: int = 100) -> dict:
    """`count` numbers in 1..max_number, combined pairwise at random until one value is left (as
    in the game: + and *, - only to a positive result, / only exactly); that value is the target
    if it is in 1..max_target and not one of the numbers (else draw again). The expression built
    is the known solution; it uses every number once."""
    lo, hi = _span("count", count, 2)
    if not (isinstance(max_number, int) and isinstance(max_target, int) and max_number >= 1 and max_target >= 1):
        raise ValueError(f"max_number, max_target: want ints >= 1, got {max_number!r}, {max_target!r}")
    for _ in range(10_000):
        numbers = [rng.randint(1, max_number) for _ in range(rng.randint(lo, hi))]
        items = [(str(x), x, False) for x in numbers]        # (text, value, compound)
        while len(items) > 1:
            (ta, a, ca), (tb, b, cb) = [items.pop(rng.randrange(len(items))) for _ in range(2)]
            if a < b:
                (ta, a, ca), (tb, b, cb) = (tb, b, cb), (ta, a, ca)
            ops = ["+", "*"] + (["-"] if a > b else []) + (["/"] if b > 1 and a % b == 0 else [])
            op = rng.choice(ops)
            ta, tb = (f"({ta})" if ca else ta), (f"({tb})" if cb else tb)
            if op in "+*" and rng.random() < 0.5:             # both orders of what commutes
                ta, tb = tb, ta
            value = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b
            items.append((f"{ta}{op}{tb}", value, True))
        text, target, _ = items[0]
        if 1 <= target <= max_target and target not in numbers:
            listed = ", ".join(map(str, numbers))
            return {"prompt": f"Use the numbers {listed}, each at most once, with + - * / and "
                              f"parentheses to make {target}.{ASK}",
                    "answer": text, "numbers": numbers, "target": target}
    raise ValueError(f"countdown: no target in 1..{max_target} from {count} numbers up to {max_number}")


class _Invalid(Exception):
    """Not an expression over the allowed numbers."""


def _countdown_steps(text: str, numbers: list[int]) -> tuple[Fraction, list[str]] | None:
    """The exact value of `text` and its steps ("7*3=21"), or None unless it is an arithmetic
    expression (+ - * / and parentheses over non-negative integer literals, no unary sign) using
    each given number at most once (a number listed twice may be used twice), with no division by
    zero. Read by a character whitelist and `ast`; never evaluated as Python."""
    if not _COUNTDOWN_CHARS.fullmatch(text):
        return None
    used, steps = [], []

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            a, b = value(node.left), value(node.right)
            op = _ARITH[type(node.op)]
            if op == "/" and b == 0:
                raise _Invalid
            out = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b
            steps.append(f"{a}{op}{b}={out}")
            return out
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise _Invalid

    try:
        result = value(ast.parse(text.strip(), mode="eval").body)
    except Exception:               # SyntaxError (also leading zeros, "1 2"), _Invalid, deep nesting
        return None
    if collections.Counter(used) - collections.Counter(numbers):
        return None
    return result, steps


def _countdown_solution(example: Example) -> str:
    _, steps = _countdown_steps(example["answer"], example["numbers"])
    return assistant("\n".join(steps), example["answer"])


def _countdown_exact(completion: str, example: Example) -> float:
    """1.0 iff the answer is an expression over the numbers, each at most once, equal to the
    target exactly (fractions along the way are fine: 8/3*3 is 8)."""
    got = extract_answer(completion)
    found = None if got is None else _countdown_steps(got, example["numbers"])
    return float(found is not None and found[0] == example["target"])


def _countdown_partial(completion: str, example: Example) -> float:
    """0.1 for a well-formed expression over the allowed numbers, plus 0.9 / (1 + |value -
    target|): 1.0 on target, 0.55 one off, 0.325 three off; 0.0 for anything else. The closeness
    term decays fast, so echoing a given number near the target earns little."""
    got = extract_answer(completion)
    found = None if got is None else _countdown_steps(got, example["numbers"])
    if found is None:
        return 0.0
    return float(Fraction(1, 10) + Fraction(9, 10) / (1 + abs(found[0] - example["target"])))


COUNTDOWN = Task("countdown", _countdown_make,
                 lambda e: f"{sorted(e['numbers'])}->{e['target']}",  # the same numbers in any order
                 _countdown_solution, _countdown_exact, _countdown_partial)


# -------------------------------------------------------------------------- registry, dispatch

TASKS: dict[str, Task] = {t.name: t for t in (REVERSE, ARITHMETIC, COUNTDOWN)}


def get(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name]


def generate(task: str, n: int, seed: int, split: str = "train", **difficulty: Any) -> list[dict]:
    """`TASKS[task].generate(n, seed, split, **difficulty)`."""
    return get(task).generate(n, seed, split, **difficulty)


def solution(example: Example) -> str:
    """The worked answer of any task's record (by its "task")."""
    return get(example["task"]).solution(example)


def exact_reward(completion: str, example: Example) -> float:
    """The exact reward of the record's own task: one reward for a mix of tasks."""
    return get(example["task"]).exact_reward(completion, example)


def partial_reward(completion: str, example: Example) -> float:
    """The partial-credit reward of the record's own task."""
    return get(example["task"]).partial_reward(completion, example)


# for rewards.combine(weights, registry={**rewards.REWARDS, **TASK_REWARDS})
TASK_REWARDS: dict[str, Reward] = {"task_exact": exact_reward, "task_partial": partial_reward}
