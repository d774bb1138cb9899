"""Rule-based rewards on hand-computed cases: answer extraction, exact / normalised / sympy
matching (and that the sympy path never evaluates what it is given), the strict format, language
consistency, and the weighted combination with its per-reward scores."""
from __future__ import annotations

import os
import time

import pytest

from r1jax.rl import rewards as R

GOOD = "add them\n</think>\n<answer>\n42\n</answer>"     # as generated after the prompt's "<think>\n"


def ans(text: str) -> str:
    return f"r\n</think>\n<answer>\n{text}\n</answer>"


@pytest.mark.parametrize("completion,want", [
    (GOOD, "42"),
    ("<think>\nr\n</think>\n<answer> 42 </answer>", "42"),
    ("r</think><answer>1</answer> then <answer>2</answer>", "2"),       # the last block
    ("r</think><answer>1<answer>2</answer>", "2"),                      # the innermost open tag
    ("r\n</think>\n\n  42 \n", "42"),                                   # no tags: after </think>
    ("a</think>b</think> 7", "7"),                                      # the last </think>
    ("r\n</think>\n<answer>\n42", None),                                # truncated answer
    ("r\n</think>\n<answer>\n \n</answer>", None),                      # empty answer
    ("still thinking 42", None),                                        # reasoning never ended
    ("r</think>\n  ", None),
])
def test_extract_answer(completion, want):
    assert R.extract_answer(completion) == want


def test_accuracy_exact():
    assert R.accuracy_exact(GOOD, {"answer": 42}) == 1.0
    assert R.accuracy_exact(GOOD, {"answer": " 42\n"}) == 1.0
    assert R.accuracy_exact(ans("42.0"), {"answer": 42}) == 0.0
    assert R.accuracy_exact(ans("Paris"), {"answer": "paris"}) == 0.0
    assert R.accuracy_exact("no answer", {"answer": "x"}) == 0.0


@pytest.mark.parametrize("text,want", [
    ("$\\boxed{1,000.50}$.", "1000.5"),
    (" The Answer  is\n5. ", "the answer is 5"),
    ("\\(x+1\\)", "x+1"),
    ("'Paris'", "paris"),
    ("+5", "5"), ("- 5", "-5"), ("-0", "0"), ("007", "7"), (".5", "0.5"), ("2.000", "2"),
    ("1,234,567", "1234567"),
    ("1,2,3", "1,2,3"),                                  # a list, not thousands separators
    ("12,34", "12,34"),
    ("\\boxed{1}+\\boxed{2}", "\\boxed{1}+\\boxed{2}"),  # not one box around everything
])
def test_normalize(text, want):
    assert R.normalize(text) == want


def test_accuracy_normalized():
    ex = {"answer": "1.5"}
    for got in ("1.50", "$1.5$", "\\boxed{1.5}", "1.5.", "01.5"):
        assert R.accuracy_normalized(ans(got), ex) == 1.0, got
    assert R.accuracy_normalized(ans("1.05"), ex) == 0.0
    assert R.accuracy_normalized(ans("15"), ex) == 0.0
    assert R.accuracy_normalized(ans("1,000"), {"answer": 1000}) == 1.0
    assert R.accuracy_normalized(ans("New  YORK"), {"answer": "new york"}) == 1.0
    assert R.accuracy_normalized("no answer", ex) == 0.0


@pytest.mark.parametrize("got,ref", [
    ("1/2", "0.5"), ("2*x+x", "3*x"), ("(x+1)^2", "x**2+2*x+1"), ("2x+x", "3 x"),
    ("(x^2-1)/(x-1)", "x+1"), ("0.1+0.2", "0.3"), ("8^(1/3)", "2"), ("2^(1/2)*2^(1/2)", "2"),
    ("x*y - y*x + 1", "1"), ("2(x+1)", "2x+2"), ("$\\boxed{1,000}$", "10^3"), ("-(a-b)", "b-a"),
    ("(a+b+c+d+e+f+g+h)**64", "(h+g+f+e+d+c+b+a)**63*(a+b+c+d+e+f+g+h)"),
])
def test_math_equivalent_matches(got, ref):
    assert R.math_equivalent(ans(got), {"answer": ref}) == 1.0


@pytest.mark.parametrize("got,ref", [
    ("(x+1)^2", "x**2+2*x"), ("1/3", "0.333"), ("x", "y"), ("2^x", "2^x+0"),   # symbolic exponent
    ("sin(x)", "sin(x)+0"),                    # function names are two letters in a row: refused
    ("1e5", "100000"),                         # no scientific notation
    ("1/0", "1/0+0"), ("x=3", "3"), ("", "0"),
])
def test_math_equivalent_rejects(got, ref):
    assert R.math_equivalent(ans(got), {"answer": ref}) == 0.0


def test_math_falls_back_to_the_normalised_match():
    assert R.math_equivalent(ans("New York"), {"answer": "new york"}) == 1.0
    assert R.math_equivalent(ans("sin(x)"), {"answer": "sin(x)"}) == 1.0


def test_math_never_evaluates_and_bounds_the_work(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "system", lambda *a: calls.append(a) or 0)
    evil = ["__import__('os').system('x')", "().__class__", "eval('1')", "x.__dict__", "lambda: 1",
            "9**9**9**9", "x**10**10", "(2**64)**64", "((x**8)**8)**2", "2**(1/2)**99", "(" * 300 + "1" + ")" * 300,
            "1" * 201]
    t = time.perf_counter()
    for text in evil:
        assert R.parse_math(text) is None, text
        assert R.math_equivalent(ans(text), {"answer": "1"}) == 0.0, text
        assert R.math_equivalent(ans("1"), {"answer": text}) == 0.0, text
    assert calls == [] and time.perf_counter() - t < 2.0
    assert R.parse_math("(x**8)**8") is not None                 # the bound itself is allowed


@pytest.mark.parametrize("completion,want", [
    (GOOD, 1.0),
    ("<think>\nr\n</think>\n<answer>\n42\n</answer>", 1.0),      # opens with <think> itself
    ("r\n\nmore\n</think>\n<answer>\n4\n2\n</answer>\n \n", 1.0),  # multi-line parts, trailing space
    ("3 < 5\n</think>\n<answer>\n42\n</answer>", 1.0),           # a bare "<" is not a tag
    ("r\n</think>\n<answer>\n42\n</answer>x", 0.0),              # something after
    ("\n</think>\n<answer>\n42\n</answer>", 0.0),                # empty reasoning
    (" \n</think>\n<answer>\n42\n</answer>", 0.0),               # blank reasoning
    ("r\n</think>\n<answer>\n \n</answer>", 0.0),                # blank answer
    ("r\n</think>\n\n<answer>\n42\n</answer>", 0.0),             # a blank line between blocks
    ("r\n</think>\n<answer>42</answer>", 0.0),                   # no newlines inside the answer tags
    ("<think>r\n</think>\n<answer>\n42\n</answer>", 0.0),        # no newline after <think>
    ("r\n</think>\n<answer>\n4\n</answer>\n<answer>\n2\n</answer>", 0.0),   # two answer blocks
    ("r\n<think>\ns\n</think>\n<answer>\n42\n</answer>", 0.0),   # a tag inside the reasoning
    ("r\n</think>\n42", 0.0),                                    # no answer block
])
def test_format_strict(completion, want):
    assert R.format_strict(completion, {}) == want


@pytest.mark.parametrize("completion,language,want", [
    ("Add three and four.\n</think>\n<answer>\n7\n</answer>", "en", 1.0),
    ("Add 3 and 4 then 好 好.\n</think>", "en", 3 / 5),              # Add and then 好 好 (3, 4 don't count)
    ("我们 计算 3+4=7, 设 x=3\n</think>", "zh", 1.0),                 # x is a variable: not a word
    ("我们 add them\n</think>", "zh", 2 / 4),
    ("Привет world\n</think>", "en", 1 / 2),
    ("<think>\nthink about \\frac{1}{2}\n</think>", "zh", 0.0),        # "think" "about"; tag and \frac skipped
    ("12+7=19\n</think>\n<answer>\nwords here\n</answer>", "zh", 1.0),  # no words before </think>
    ("never closed reasoning", "en", 1.0),
])
def test_language_consistency(completion, language, want):
    assert R.language_consistency(completion, {"language": language}) == pytest.approx(want)


def test_language_defaults_to_english_and_refuses_unknown():
    assert R.language_consistency("这是中文 and English\n</think>", {}) == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="known are en, zh"):
        R.language_consistency("x", {"language": "tlh"})


def test_registry_and_combine():
    assert list(R.REWARDS) == ["accuracy", "accuracy_normalized", "math", "format", "language"]
    reward = R.combine({"accuracy": 1.0, "format": 0.5, "language": 0.1})
    ex = {"answer": "42.0"}
    scores = reward.scores(GOOD, ex)
    assert scores == {"accuracy": 0.0, "format": 1.0, "language": 1.0}
    assert reward.total(scores) == reward(GOOD, ex) == pytest.approx(0.6)
    both = R.combine({"math": 2.0, "accuracy": 1.0})
    assert both(GOOD, ex) == 2.0
    extra = R.combine({"one": 3.0}, registry={"one": lambda c, e: 1.0})
    assert extra("", {}) == 3.0


@pytest.mark.parametrize("weights,match", [
    ({"acc": 1.0}, "unknown reward 'acc'; known: accuracy, accuracy_normalized, math, format, language"),
    ({}, "no rewards given"),
    ({"format": float("nan")}, "finite number"),
])
def test_combine_errors(weights, match):
    with pytest.raises(ValueError, match=match):
        R.combine(weights)
