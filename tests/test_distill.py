"""`python -m r1jax.distill generate` on a tiny random teacher: every sample kept at threshold 0
and each record encoding (sft.encode) to the teacher's prompt ids + the ids the generator samples
for that seed + EOS; the verifier filtering exactly the samples whose reward, computed here, is
under the threshold; the same --seed giving the same file; one-line errors and exit 2 before
anything loads, with no output written.

The teacher's tokenizer has one token per character, so every sampled id sequence is the
canonical tokenization of its text and the round trip is exact for all samples (a BPE teacher's
random samples mostly are not: the summary counts those as retokenized)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from r1jax import config as configlib
from r1jax import distill
from r1jax import weights
from r1jax.convert import hf
from r1jax.data import chat, sft
from r1jax.rl import rewards

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--samples", "3", "--max-new-tokens", "12", "--seed", "7"]


def char_tokenizer(vocab_size: int) -> Tokenizer:
    """One token per character (ASCII, then CJK to fill the vocabulary), R1's markers whole;
    `<think>`/`</think>` are plain added tokens, as in DeepSeek's tokenizer.json."""
    specials = ["<|bos|>", "<|eos|>", "<|pad|>", chat.BOS, chat.EOS, chat.USER, chat.ASSISTANT]
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    chars += [chr(0x4E00 + i) for i in range(vocab_size - len(specials) - 2 - len(chars))]
    vocab = {t: i for i, t in enumerate(specials + ["<think>", "</think>"] + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    return tok


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("teacher") / "hf"
    m = configlib.load(ROOT / "configs" / "tiny.yaml", ["model.num_nextn_predict_layers=0"]).model
    hf.save(weights.create(m, seed=1), m, d)
    char_tokenizer(m.vocab_size).save(str(d / "tokenizer.json"))
    return f"hf:{d}"


def run(capsys, teacher, *args) -> tuple[int, str, str]:
    rc = distill.main(["generate", "--teacher", teacher, *args])
    out, err = capsys.readouterr()
    return rc, out, err


def summary(out: str) -> dict[str, int]:
    m = re.search(r"(\d+) prompts, (\d+) samples, (\d+) accepted .*pass@\d+ (\d+)/.*mean reward ([\d.]+); "
                  r"(\d+) records written \((\d+) retokenized\)", out)
    keys = ("prompts", "samples", "accepted", "passed", "mean", "written", "retokenized")
    return {k: float(v) if k == "mean" else int(v) for k, v in zip(keys, m.groups())}


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_every_sample_kept_round_trips_and_repeats(teacher, tmp_path, capsys):
    out = tmp_path / "all.jsonl"
    rc, stdout, err = run(capsys, teacher, "--task", "reverse", "--n", "4", "--threshold", "0.0", "--keep", "all",
                          "--output", str(out), *ARGS)
    assert rc == 0, err
    s = summary(stdout)
    assert (s["prompts"], s["samples"], s["accepted"], s["passed"], s["written"]) == (4, 12, 12, 4, 12)
    assert s["retokenized"] == 0
    got = records(out)
    assert [(r["source"]["prompt"], r["source"]["sample"]) for r in got] == [(i, k) for i in range(4) for k in range(3)]
    assert list(sft.read([str(out)])) == [{"messages": r["messages"]} for r in got]     # SFT reads it as is

    # each record is the teacher's sample: regenerate it from its seed with the generator itself
    from r1jax.infer import source as sourcelib
    from r1jax.infer.generator import Request
    src = sourcelib.resolve(teacher)
    tok = src.tokenizer()
    eos = sft.eos_id(tok)
    template = chat.Template()
    prompts = [tok.encode(chat.render_r1(r["messages"][:-1]), add_special_tokens=False).ids for r in got]
    assert all(r["source"]["seed"] == distill.sample_seed(7, r["source"]["prompt"], r["source"]["sample"]) for r in got)
    again = src.generator(tok).generate([Request(tuple(p), max_new_tokens=12, temperature=0.7, top_p=0.95,
                                                 seed=r["source"]["seed"]) for p, r in zip(prompts, got)])
    for r, p, c in zip(got, prompts, again):
        turn = r["messages"][-1]["content"]
        assert turn.startswith("<think>\n") and r["source"]["finish_reason"] == c.finish_reason
        ids, mask = sft.encode(r, tok, template)
        sampled = c.completion_ids + ([] if c.completion_ids[-1:] == [eos] else [eos])
        assert ids.tolist() == p + sampled
        assert mask.tolist() == [0] * len(p) + [1] * len(sampled)
        assert r["reward"] == 0.0 and r["source"]["scores"] == {"task_exact": 0.0}

    # the same seed: the same file; another seed: other samples
    rc, stdout2, err = run(capsys, teacher, "--task", "reverse", "--n", "4", "--threshold", "0.0", "--keep", "all",
                           "--output", str(tmp_path / "again.jsonl"), *ARGS)
    assert rc == 0, err
    assert (tmp_path / "again.jsonl").read_bytes() == out.read_bytes()
    rc, _, err = run(capsys, teacher, "--task", "reverse", "--n", "4", "--threshold", "0.0", "--keep", "all",
                     "--output", str(out), "--force", *ARGS[:-1], "8")
    assert rc == 0, err
    assert [r["messages"] for r in records(out)] != [r["messages"] for r in got]


def test_the_verifier_filters(teacher, tmp_path, capsys):
    # a random model never writes the reversed digits inside <answer>: everything is rejected
    out = tmp_path / "exact.jsonl"
    rc, stdout, err = run(capsys, teacher, "--task", "reverse", "--n", "4", "--output", str(out), *ARGS)
    assert rc == 0, err
    assert "4 prompts, 12 samples, 0 accepted (0.0%), pass@3 0/4 (0.0%), mean reward 0.0000; 0 records" in stdout
    assert len(stdout.strip().splitlines()) == 1
    assert out.read_text() == ""

    # a reward that varies over random text: the share of the reasoning's words in the line's language
    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"prompt": "Say something.", "language": "en"}) + "\n\n" + json.dumps(
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "说点什么"}],
         "language": "zh"}) + "\n")
    every, kept = tmp_path / "every.jsonl", tmp_path / "kept.jsonl"
    rc, _, err = run(capsys, teacher, "--input", str(src), "--reward", "language", "--threshold", "0",
                     "--keep", "all", "--output", str(every), *ARGS)
    assert rc == 0, err
    rc, stdout, err = run(capsys, teacher, "--input", str(src), "--reward", "language=2", "--threshold", "1.5",
                          "--keep", "all", "--output", str(kept), *ARGS)
    assert rc == 0, err
    scored = {(r["source"]["prompt"], r["source"]["sample"]):
              rewards.language_consistency(r["messages"][-1]["content"], r["source"]["example"]) for r in records(every)}
    assert len(scored) == 6
    want = {key for key, x in scored.items() if 2 * x >= 1.5}
    assert 0 < len(want) < 6                  # English text from this teacher is rare, Chinese common
    got = records(kept)
    assert {(r["source"]["prompt"], r["source"]["sample"]) for r in got} == want
    assert all(r["reward"] == 2 * scored[r["source"]["prompt"], r["source"]["sample"]] for r in got)
    s = summary(stdout)
    assert (s["samples"], s["accepted"], s["written"]) == (6, len(want), len(want))
    assert s["passed"] == len({p for p, _ in want})
    assert s["mean"] == pytest.approx(2 * sum(scored.values()) / 6, abs=1e-4)


def _sample(prompt, index, reward, accepted=True):
    return distill.Sample(prompt, index, 0, "", {}, reward, "stop", [1], accepted)


def test_keep_policies_and_seeds():
    samples = [_sample(0, 0, 0.2, False), _sample(0, 1, 0.5), _sample(0, 2, 0.9), _sample(0, 3, 0.9)]
    assert [s.index for s in distill.select(samples, "all")] == [1, 2, 3]
    assert [s.index for s in distill.select(samples, "first")] == [1]
    assert [s.index for s in distill.select(samples, "best")] == [2]
    assert distill.select(samples[:1], "best") == []
    seeds = {distill.sample_seed(s, i, k) for s in (0, 1) for i in range(10) for k in range(4)}
    assert len(seeds) == 80 and all(0 <= x < 2**32 for x in seeds)
    # R1's format opens the assistant's turn with <think>\n; a template that does not, with nothing
    msgs = [{"role": "user", "content": "hi"}]
    assert distill.opening(chat.Template(), msgs) == "<think>\n"
    plain = chat.Template("{% for m in messages %}{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}"
                          "Assistant: {% endif %}")
    assert distill.opening(plain, msgs) == ""


@pytest.mark.parametrize("args,message", [
    (["--input", "{bad}"], "line 2: not JSON"),
    (["--input", "{last}"], "line 1: the last message is an assistant turn"),
    (["--input", "{plain}", "--reward", "accuracy,shiny=2"], "unknown reward 'shiny'"),
    (["--input", "{plain}"], "line 1: reward accuracy needs the field 'answer'"),
    (["--task", "juggling", "--n", "2"], "--task juggling: unknown task 'juggling'"),
    (["--task", "reverse"], "--task needs --n N"),
    (["--task", "reverse", "--n", "2", "--teacher", "{nowhere}"], "--teacher {nowhere}: not a run directory"),
    (["--task", "reverse", "--n", "2", "--output", "{exists}"], "exists (--force overwrites it)"),
])
def test_bad_input_is_one_line_and_exit_2(teacher, tmp_path, capsys, args, message):
    files = {"bad": '{"prompt": "a", "answer": "1"}\n{"prompt": \n', "plain": '{"prompt": "a"}\n',
             "last": json.dumps({"messages": [{"role": "user", "content": "a"},
                                              {"role": "assistant", "content": "b"}]}) + "\n"}
    for name, text in files.items():
        (tmp_path / f"{name}.jsonl").write_text(text)
    (tmp_path / "exists.jsonl").write_text("keep me\n")
    paths = {name: str(tmp_path / f"{name}.jsonl") for name in [*files, "exists"]} | {"nowhere": str(tmp_path / "no")}
    args = [a.format(**paths) for a in args]
    out = args[args.index("--output") + 1] if "--output" in args else str(tmp_path / "out.jsonl")
    if "--output" not in args:
        args += ["--output", out]
    if "--teacher" not in args:
        args = ["--teacher", teacher, *args]
    rc = distill.main(["generate", *args])
    stdout, err = capsys.readouterr()
    assert rc == 2 and stdout == ""
    assert message.format(**paths) in err and len(err.strip().splitlines()) == 1, err
    assert not Path(out).exists() or Path(out).read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []
