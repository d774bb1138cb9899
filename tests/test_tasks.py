"""Generated tasks: hand-computed worked solutions and rewards (exact and partial credit),
determinism by seed, difficulty knobs, train/eval disjointness, and every generated record's own
solution scoring 1.0 on every reward that applies."""
from __future__ import annotations

import json

import pytest

from r1jax.data import tasks as T
from r1jax.rl import rewards as R


def ans(text: str) -> str:
    return f"r\n</think>\n<answer>\n{text}\n</answer>"


def example(task: str, **fields) -> dict:
    return {"task": task, "prompt": "", **fields}


# ------------------------------------------------------------------------------- hand-computed

def test_reverse_rewards_and_solution():
    ex = example("reverse", number="4213", answer="3124", digits=4)
    assert T.solution(ex) == "<think>\n4 2 1 3\nreversed: 3 1 2 4\n</think>\n<answer>\n3124\n</answer>"
    for got, exact, partial in [("3124", 1.0, 1.0), ("3214", 0.0, 2 / 4), ("312", 0.0, 3 / 4),
                                ("31240", 0.0, 4 / 5), ("4213", 0.0, 0.0), ("3 1 2 4", 0.0, 1 / 7)]:
        assert T.exact_reward(ans(got), ex) == exact, got
        assert T.partial_reward(ans(got), ex) == pytest.approx(partial), got
    assert T.partial_reward("r\n</think>\n<answer>\n", ex) == 0.0        # no answer
    lead = example("reverse", number="0120", answer="0210", digits=4)   # leading zeros are digits
    assert T.exact_reward(ans("0210"), lead) == 1.0 and T.exact_reward(ans("210"), lead) == 0.0
    assert T.partial_reward(ans("210"), lead) == pytest.approx(0 / 4)   # 2,1,0 vs 0,2,1: left-aligned


@pytest.mark.parametrize("a,op,b,reasoning,answer", [
    (824, "+", 796, "4+6=10\n2+9+1=12\n8+7+1=16", "1620"),
    (7, "+", 95, "5+7=12\n9+0+1=10", "102"),                    # columns over the longer operand
    (52, "-", 38, "12-8=4\n5-3-1=1", "14"),
    (1000, "-", 999, "10-9=1\n10-9-1=0\n10-9-1=0\n1-0-1=0", "1"),
    (123, "*", 45, "123*5=615\n123*40=4920\nsum=5535", "5535"),
    (123, "*", 40, "123*40=4920", "4920"),
    (9, "*", 0, "9*0=0", "0"),
])
def test_arithmetic_solutions(a, op, b, reasoning, answer):
    ex = example("arithmetic", a=a, b=b, op=op, answer=answer)
    assert T.solution(ex) == f"<think>\n{reasoning}\n</think>\n<answer>\n{answer}\n</answer>"


def test_arithmetic_rewards():
    ex = example("arithmetic", a=123, b=456, op="*", answer="56088")
    for got, exact, partial in [("56088", 1.0, 1.0), ("56188", 0.0, 4 / 5), ("6088", 0.0, 4 / 5),
                                ("156088", 0.0, 5 / 6), ("56,088", 0.0, 3 / 6), ("88", 0.0, 2 / 5),
                                ("abc", 0.0, 0.0)]:
        assert T.exact_reward(ans(got), ex) == exact, got
        assert T.partial_reward(ans(got), ex) == pytest.approx(partial), got


def test_countdown_rewards():
    ex = example("countdown", numbers=[7, 3, 5], target=26, answer="(7*3)+5")
    assert T.solution(ex) == "<think>\n7*3=21\n21+5=26\n</think>\n<answer>\n(7*3)+5\n</answer>"
    for got, exact, partial in [
        ("7*3+5", 1.0, 1.0), (" 5 + 3 * 7 ", 1.0, 1.0),
        ("7*3", 0.0, 0.25),                           # 0.1 + 0.9 / (1 + 5)
        ("5*(7-3)+7", 0.0, 0.0),                      # 7 used twice
        ("7*4+5", 0.0, 0.0),                          # 4 is not given
        ("7*3+5 = 26", 0.0, 0.0), ("-7+3*5", 0.0, 0.0), ("7**3", 0.0, 0.0), ("07*3+5", 0.0, 0.0),
        ("7/3*5", 0.0, 0.1 + 0.9 * 3 / 46),            # 35/3 is 43/3 away
        ("__import__('os')", 0.0, 0.0), ("", 0.0, 0.0),
    ]:
        assert T.exact_reward(ans(got), ex) == exact, got
        assert T.partial_reward(ans(got), ex) == pytest.approx(partial), got
    assert T.partial_reward(ans("5*5"), {**ex, "numbers": [5, 5, 2]}) == pytest.approx(0.55)  # one off
    twice = example("countdown", numbers=[8, 3, 3], target=8, answer="8/3*3")
    assert T.exact_reward(ans("8/3*3"), twice) == 1.0                   # exact fractions on the way
    assert T.exact_reward(ans("8/(3-3)"), twice) == T.partial_reward(ans("8/(3-3)"), twice) == 0.0


# ------------------------------------------------------------------------------- generation

DIFFICULTIES = [("reverse", {}), ("reverse", {"digits": [2, 7]}), ("arithmetic", {}),
                ("arithmetic", {"digits": (1, 4), "ops": "-"}), ("countdown", {}),
                ("countdown", {"count": [3, 4], "max_number": 50, "max_target": 500})]


@pytest.mark.parametrize("task,difficulty", DIFFICULTIES)
def test_every_solution_scores_one(task, difficulty):
    for split in T.SPLITS:
        for ex in T.generate(task, 100, 3, split, **difficulty):
            assert ex["task"] == task and "<answer></answer>" in ex["prompt"]
            assert json.loads(json.dumps(ex)) == ex                      # plain JSON records
            s = T.solution(ex)
            assert T.exact_reward(s, ex) == T.partial_reward(s, ex) == 1.0, (ex, s)
            assert R.format_strict(s, ex) == R.accuracy_exact(s, ex) == R.language_consistency(s, ex) == 1.0


def test_difficulty_knobs():
    assert {len(e["number"]) for e in T.generate("reverse", 200, 0, digits=(2, 3))} == {2, 3}
    for e in T.generate("arithmetic", 100, 0, digits=2, ops="*"):
        assert e["op"] == "*" and 10 <= e["a"] <= 99 and 10 <= e["b"] <= 99
        assert e["answer"] == str(e["a"] * e["b"]) and e["prompt"].startswith(f"Compute {e['a']} * {e['b']}.")
    for e in T.generate("arithmetic", 100, 0, ops="-"):
        assert int(e["answer"]) >= 0
    for e in T.generate("countdown", 100, 0, count=4, max_number=9, max_target=50):
        assert len(e["numbers"]) == 4 and max(e["numbers"]) <= 9
        assert 1 <= e["target"] <= 50 and e["target"] not in e["numbers"]


def test_deterministic_by_seed():
    for task in T.TASKS:
        assert T.generate(task, 20, 7) == T.generate(task, 20, 7)
        assert T.generate(task, 20, 7) != T.generate(task, 20, 8)
        assert T.generate(task, 5, 7) == T.generate(task, 20, 7)[:5]     # a prefix of the stream


def test_train_and_eval_are_disjoint():
    for task, difficulty in DIFFICULTIES:
        t = T.TASKS[task]
        train = {t.key(e) for seed in (0, 1) for e in t.generate(300, seed, "train", **difficulty)}
        evals = [t.key(e) for e in t.generate(50, 0, "eval", **difficulty)]
        assert len(set(evals)) == len(evals)                                # distinct held-out problems
        assert not train & set(evals), task
        assert not train & {t.key(e) for e in t.generate(50, 1, "eval", **difficulty)}
    # countdown's key ignores the numbers' order: one problem however it is listed
    key = T.COUNTDOWN.key
    assert key({"numbers": [3, 7, 5], "target": 26}) == key({"numbers": [7, 5, 3], "target": 26})


def test_dispatch_and_combined_rewards():
    mixed = [e for task in T.TASKS for e in T.generate(task, 3, 0)]
    reward = R.combine({"task_exact": 1.0, "task_partial": 0.5, "format": 0.25},
                       registry={**R.REWARDS, **T.TASK_REWARDS})
    for e in mixed:
        assert reward.scores(T.solution(e), e) == {"task_exact": 1.0, "task_partial": 1.0, "format": 1.0}
        assert reward(T.solution(e), e) == 1.75
        assert reward("no idea", e) == 0.0


@pytest.mark.parametrize("call,match", [
    (lambda: T.generate("sort", 1, 0), "unknown task 'sort'; known: reverse, arithmetic, countdown"),
    (lambda: T.generate("reverse", 1, 0, split="test"), "split: want one of train, eval"),
    (lambda: T.generate("reverse", 1, 0, length=3), "reverse: unknown difficulty length; known: digits"),
    (lambda: T.generate("reverse", 1, 0, digits=0), "digits: want an int >= 1"),
    (lambda: T.generate("arithmetic", 1, 0, ops="/"), "ops: want a non-empty string of"),
    (lambda: T.generate("countdown", 1, 0, count=[4, 3]), "count: want an int >= 2"),
    (lambda: T.generate("reverse", 20, 0, split="eval", digits=1), "too few distinct problems"),
])
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
