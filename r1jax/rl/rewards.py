"""Rule-based rewards for R1's post-training (R1 §2.2.2 accuracy and format, §2.3.2 language
consistency), each a plain callable `reward(completion, example) -> float`.

`completion` is the decoded assistant text. r1jax's generation prompt ends `<think>\\n`, so a
completion normally starts inside the reasoning ("...\\n</think>\\n<answer>\\n42\\n</answer>");
one that opens with `<think>` itself is read the same way. `example` is the task record: its
"answer" (anything `str()` turns into the reference answer) and task fields such as "language".

- `accuracy_exact`: the extracted answer equals the reference, character for character.
- `accuracy_normalized`: equal after `normalize` (case, whitespace, `$`/`\\boxed{}` wrappers,
  edge punctuation, thousands separators, "1.50" == "1.5").
- `math_equivalent`: equal as expressions (sympy), else as `accuracy_normalized`. Only a small
  whitelisted grammar is parsed, by `ast` into sympy objects built here: nothing is ever `eval`ed
  (sympy's `parse_expr` evals), and the grammar bounds the work (see `parse_math`).
- `format_strict`: the whole turn is `<think>\\n…\\n</think>\\n<answer>\\n…\\n</answer>`.
- `language_consistency`: the share of the reasoning's words in the example's language.

`REWARDS` names them; `combine` makes their weighted sum, which also reports each part (GRPO logs
every reward's mean and std).
"""
from __future__ import annotations

import ast
import dataclasses
import math
import random
import re
from fractions import Fraction
from typing import Any, Callable, Mapping

import sympy

Example = Mapping[str, Any]
Reward = Callable[[str, Example], float]

OPEN, CLOSE = "<answer>", "</answer>"
THINK, END_THINK = "<think>", "</think>"


def extract_answer(completion: str) -> str | None:
    """The stripped text inside the last `<answer>…</answer>`; with no answer block, the text after
    the last `</think>`. None when that is empty, when there is no `</think>` either (the reasoning
    never ended), or when the tail holds an unclosed answer tag (a truncated answer is no answer)."""
    end = completion.rfind(CLOSE)
    start = completion.rfind(OPEN, 0, end) if end >= 0 else -1
    if start >= 0:
        return completion[start + len(OPEN):end].strip() or None
    think = completion.rfind(END_THINK)
    if think < 0:
        return None
    tail = completion[think + len(END_THINK):]
    if OPEN in tail or CLOSE in tail:
        return None
    return tail.strip() or None


def accuracy_exact(completion: str, example: Example) -> float:
    """1.0 iff the extracted answer is exactly the reference answer (both stripped)."""
    return float(extract_answer(completion) == str(example["answer"]).strip())


# ------------------------------------------------------------------------------- normalised match

_WRAPS = (("\\boxed{", "}"), ("\\fbox{", "}"), ("\\(", "\\)"), ("\\[", "\\]"), ("$", "$"))
_LEAD, _TRAIL = " \t\r\n\"'`", " \t\r\n\"'`.,;:!?"   # a leading "." may start ".5": kept
# a number whose commas (if any) are thousands separators; not a piece of a longer token
_NUMBER = re.compile(r"(?<![\w.,])(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?![\w.]|,\d)")
_SEPARATOR = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def _balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        depth += (ch == "{") - (ch == "}")
        if depth < 0:
            return False
    return depth == 0


def unwrap(text: str) -> str:
    """`text` without surrounding whitespace, quotes, trailing punctuation, `$…$`, `\\(…\\)`,
    `\\[…\\]` and `\\boxed{…}` (repeatedly, so "$\\boxed{5}$." is "5"); case is kept."""
    while True:
        s = text.lstrip(_LEAD).rstrip(_TRAIL)
        for head, tail in _WRAPS:
            inner = s[len(head):len(s) - len(tail)]
            # `\boxed{1}+\boxed{2}` also starts and ends like a box: unwrap only a whole one
            if len(s) >= len(head) + len(tail) and s.startswith(head) and s.endswith(tail) \
                    and _balanced(inner) and not (head == "$" and "$" in inner):
                s = inner
                break
        if s == text:
            return s
        text = s


def _canonical_number(m: re.Match) -> str:
    whole, _, frac = m.group(0).replace(",", "").partition(".")
    whole, frac = whole.lstrip("0") or "0", frac.rstrip("0")
    return f"{whole}.{frac}" if frac else whole


def normalize(text: str) -> str:
    """`unwrap`ped, case-folded, whitespace collapsed to single spaces, every number written
    canonically (thousands separators dropped, leading zeros and trailing fractional zeros
    dropped: "1,000.50" -> "1000.5", "007" -> "7", ".5" -> "0.5"), and a whole-answer sign canonical ("+5" -> "5",
    "- 5" -> "-5", "-0" -> "0"). Numbers compare by value here, so digit strings whose leading
    zeros matter (a reversed "0120") need `accuracy_exact` or the task's own reward."""
    s = " ".join(unwrap(text).casefold().split())
    s = _NUMBER.sub(_canonical_number, s)
    signed = re.fullmatch(r"([+-]) ?(\d+(?:\.\d+)?)", s)
    if signed:
        sign, number = signed.groups()
        s = number if sign == "+" or number == "0" else "-" + number
    return s


def accuracy_normalized(completion: str, example: Example) -> float:
    """1.0 iff the extracted answer and the reference are equal after `normalize`."""
    got = extract_answer(completion)
    return float(got is not None and normalize(got) == normalize(str(example["answer"])))


# -------------------------------------------------------------------------- math equivalence

MAX_CHARS = 200
MAX_POWER = 64          # the product of |exponent| along any nesting of powers (bounds every number)
_MATH_CHARS = re.compile(rf"[0-9A-Za-z+\-*/^().\s]{{1,{MAX_CHARS}}}")
_IMPLICIT = re.compile(r"(?<=[0-9A-Za-z)])\s*(?=[A-Za-z(])")       # "2x", "3(x+1)", "x(y)", ")("
_OPS = {ast.Add: sympy.Add, ast.Sub: lambda a, b: a - b, ast.Mult: sympy.Mul, ast.Div: lambda a, b: a / b}


class _Refused(Exception):
    """Outside the grammar parse_math accepts."""


def _build(node: ast.AST, src: str, power: int) -> sympy.Expr:
    """The sympy object for `node`, refusing all but numbers, one-letter symbols, + - * / **,
    unary signs; `power` is the product of the exponents this node sits under."""
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_build(node.left, src, power), _build(node.right, src, power))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        exp = _build(node.right, src, power)
        if not exp.is_Rational or abs(exp) > MAX_POWER:       # symbolic or huge exponents: refused
            raise _Refused
        scale = power * max(1, math.ceil(abs(exp)))
        if scale > MAX_POWER:                                 # (2**64)**64 and (x**8)**9 alike
            raise _Refused
        return sympy.Pow(_build(node.left, src, scale), exp)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _build(node.operand, src, power)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        # from the literal's own text, so "0.1" is exactly 1/10 (no binary float in between)
        value = Fraction(ast.get_source_segment(src, node) or "")
        return sympy.Rational(value.numerator, value.denominator)
    if isinstance(node, ast.Name) and len(node.id) == 1 and node.id.isascii():
        return sympy.Symbol(node.id)
    raise _Refused


def parse_math(text: str) -> sympy.Expr | None:
    """`text` as a sympy expression, or None when outside the grammar: at most 200 characters of
    digits, one-letter symbols (no two letters in a row, so no function names; "e" and "I" are
    plain symbols), + - * / ^ ** ( ) . and spaces; implicit products ("2x", "3(x+1)"); exponents
    rational numbers, their product along nested powers at most 64. No scientific notation ("1e5"
    is refused). Numbers stay exact rationals. Parsed by `ast`, built here: nothing is evaluated
    but sympy arithmetic on these objects, and the bounds keep every number under ~2**43000."""
    s = _SEPARATOR.sub("", unwrap(text))
    if not _MATH_CHARS.fullmatch(s) or re.search(r"[A-Za-z]{2}", s):
        return None
    src = _IMPLICIT.sub("*", s.replace("^", "**")).strip()
    try:
        expr = _build(ast.parse(src, mode="eval").body, src, 1)
    except Exception:   # SyntaxError, _Refused, too-deep nesting, sympy's own errors: all refusals
        return None
    return None if expr.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo) else expr


def _same_number(a: sympy.Expr, b: sympy.Expr) -> bool:
    if a == b:
        return True
    if a.is_Rational and b.is_Rational:                       # exact and different
        return False
    diff, size = sympy.N(a - b, 50), sympy.N(a, 50)           # radicals: compare to 40 digits
    return bool(abs(diff) <= sympy.Float("1e-40", 50) * max(1, abs(size)))


def equivalent(a: sympy.Expr, b: sympy.Expr, points: int = 3) -> bool:
    """Whether two parsed expressions are equal: structurally after sympy's evaluation, else at
    `points` random positive rational points (exactly: a polynomial or rational identity that
    fails is nonzero at a random point of such a large set with probability ~degree/2**31, the
    Schwartz-Zippel bound). Deterministic: the points come from a fixed seed."""
    if a - b == 0:
        return True
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    need = points if symbols else 1
    rng, bad = random.Random(0), (sympy.zoo, sympy.nan, sympy.oo, -sympy.oo)
    for _ in range(4 * need):
        at = {x: sympy.Rational(rng.randint(1, 2**31), rng.randint(1, 2**31)) for x in symbols}
        va, vb = a.xreplace(at), b.xreplace(at)
        if va.has(*bad) or vb.has(*bad):                      # a pole: try another point
            continue
        if not _same_number(va, vb):
            return False
        need -= 1
        if need == 0:
            return True
    return False


def math_equivalent(completion: str, example: Example) -> float:
    """1.0 iff the extracted answer matches the reference by `accuracy_normalized`, or both parse
    (`parse_math`) and are `equivalent`: "1/2" ~ "0.5", "2*x+x" ~ "3x", "(x+1)^2" ~ "x**2+2*x+1".
    Anything refused or failing is 0.0, never an exception in the trainer."""
    if accuracy_normalized(completion, example):
        return 1.0
    got = extract_answer(completion)
    if got is None:
        return 0.0
    try:
        a, b = parse_math(got), parse_math(str(example["answer"]))
        return float(a is not None and b is not None and equivalent(a, b))
    except Exception:
        return 0.0


# ------------------------------------------------------------------------------------- format

_TAG = r"</?(?:think|answer)>"
_PART = rf"(?=\s*(?!{_TAG})\S)(?:(?!{_TAG}).)*"   # some non-blank text, and no tag inside it
FORMAT = re.compile(rf"<think>\n{_PART}\n</think>\n<answer>\n{_PART}\n</answer>\s*", re.DOTALL)
"""The whole turn: `<think>`, newline, reasoning, newline, `</think>`, newline, `<answer>`,
newline, answer, newline, `</answer>`, then only whitespace. The reasoning and the answer each
hold a non-blank character and no think/answer tag (so a second block anywhere fails)."""


def format_strict(completion: str, example: Example) -> float:
    """1.0 iff the turn (the completion, with the generation prompt's `<think>\\n` put back when it
    does not open with `<think>`) fully matches `FORMAT`."""
    text = completion if completion.startswith(THINK) else THINK + "\n" + completion
    return float(FORMAT.fullmatch(text) is not None)


# -------------------------------------------------------------------------- language consistency

_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002ebef"
# a CJK character is a word; otherwise a word is a run of letters (no digits, no underscore)
_WORD = re.compile(rf"[{_CJK}]|(?:(?![{_CJK}])[^\W\d_])+")
_LATEX = re.compile(r"\\[A-Za-z]+")
_LATIN = re.compile(r"[A-Za-z\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u024f]+")
LANGUAGES: dict[str, Callable[[str], bool]] = {
    "en": lambda w: _LATIN.fullmatch(w) is not None,
    "zh": lambda w: re.fullmatch(f"[{_CJK}]", w) is not None,
}


def reasoning(completion: str) -> str:
    """The chain of thought: what comes before the first `</think>` (all of it when the reasoning
    never closed), without an opening `<think>`."""
    cot = completion.split(END_THINK, 1)[0]
    return cot[len(THINK):] if cot.startswith(THINK) else cot


def language_consistency(completion: str, example: Example) -> float:
    """R1 §2.3.2: the proportion of the reasoning's words in example["language"] ("en" default).

    Words: runs of letters, and each CJK character. Digits, punctuation and math never count
    either way; neither do LaTeX commands (`\\frac`), tags, or a lone Latin letter (a variable,
    "x"; English loses only "a" and "I"). A reasoning with no words scores 1.0: there is nothing in
    the wrong language, and pure math ("12+7=19") should not be punished; an empty reasoning is
    the format reward's business."""
    language = example.get("language", "en")
    if language not in LANGUAGES:
        raise ValueError(f"language {language!r}: known are {', '.join(LANGUAGES)}")
    text = re.sub(_TAG, " ", _LATEX.sub(" ", reasoning(completion)))
    words = [w for w in _WORD.findall(text) if not (len(w) == 1 and w.isascii())]
    if not words:
        return 1.0
    return sum(map(LANGUAGES[language], words)) / len(words)


# ------------------------------------------------------------------------------ registry, sums

REWARDS: dict[str, Reward] = {
    "accuracy": accuracy_exact,
    "accuracy_normalized": accuracy_normalized,
    "math": math_equivalent,
    "format": format_strict,
    "language": language_consistency,
}


@dataclasses.dataclass(frozen=True)
class Combined:
    """A weighted sum of named rewards; `scores` gives each part, `total` sums given parts (so a
    trainer that logs the parts computes each reward once)."""
    rewards: dict[str, Reward]
    weights: dict[str, float]

    def scores(self, completion: str, example: Example) -> dict[str, float]:
        return {name: float(fn(completion, example)) for name, fn in self.rewards.items()}

    def total(self, scores: Mapping[str, float]) -> float:
        return sum(self.weights[name] * scores[name] for name in self.weights)

    def __call__(self, completion: str, example: Example) -> float:
        return self.total(self.scores(completion, example))


def combine(weights: Mapping[str, float], registry: Mapping[str, Reward] = REWARDS) -> Combined:
    """The reward sum(weight * reward) over `weights`' names, looked up in `registry` (pass a
    larger one, e.g. with r1jax.data.tasks.TASK_REWARDS, for task rewards)."""
    if not weights:
        raise ValueError(f"no rewards given; known: {', '.join(registry)}")
    for name, w in weights.items():
        if name not in registry:
            raise ValueError(f"unknown reward {name!r}; known: {', '.join(registry)}")
        if not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"reward {name!r}: weight must be a finite number, got {w!r}")
    return Combined({n: registry[n] for n in weights}, {n: float(w) for n, w in weights.items()})
