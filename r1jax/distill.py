"""python -m r1jax.distill generate --teacher SRC (--input IN.jsonl | --task NAME --n N) --output OUT.jsonl [flags]

Sequence-level distillation, R1's way (R1 §2.3.3; notes/posttraining.md §4.1): sample K completions
per prompt from the teacher with the generator `python -m r1jax.generate` runs, keep those a
verifier accepts (rejection sampling: the combined reward >= a threshold), and write SFT JSONL that
a student trains on with `loss.objective: sft`.

Prompts are rendered with the teacher's chat template and tokenized as serving tokenizes a chat
request. A kept sample becomes `{"messages": [...prompt..., {"role": "assistant", "content": TEXT}],
"reward": x, "source": {...}}`, where TEXT is the assistant turn as data/sft.py reads it: what the
generation prompt already wrote of the turn (R1's `<think>\\n`) followed by the completion decoded
with its special tokens (r1jax's own chat tokenizers make `</think>` one), without the final EOS.
The verifier scores that same TEXT, so it judges exactly what the student will learn. `sft.encode`
of the record gives back the teacher's prompt ids, the sampled ids and the EOS whenever the sample
is the canonical tokenization of its text; a sample that is not (a BPE teacher may sample "a","b"
where its tokenizer writes "ab") still carries its text, the student trains on that text's own
tokens (what distilling into another tokenizer does anyway), and the summary counts it.

Sample k of prompt i draws with a seed hashed from (--seed, i, k): the output depends on the
seeds, never on batching. The output is written to a temporary file beside --output and renamed
when complete.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, TextIO

from r1jax.data import chat, sft, tasks
from r1jax.generate import REQUEST_FIELDS, InputError
from r1jax.rl import rewards

KEEP = ("all", "first", "best")
REGISTRY = {**rewards.REWARDS, **tasks.TASK_REWARDS}
# a well-formed turn: a reward that needs a field the prompt lacks fails on it before any compile
_PROBE = tasks.assistant("probe", "0")


@dataclasses.dataclass(frozen=True)
class Prompt:
    messages: list[dict]          # the conversation up to the turn to sample
    example: dict                 # the fields the verifier reads ("answer", "task", ...)
    ids: tuple[int, ...]          # the rendered prompt's tokens, as serving tokenizes it
    opening: str                  # what the generation prompt writes of the assistant's turn
    where: str                    # the input line or task prompt, for errors


@dataclasses.dataclass(frozen=True)
class Settings:
    samples: int = 4
    temperature: float = 0.7
    top_p: float = 0.95
    max_new_tokens: int = 256
    seed: int = 0
    threshold: float = 1.0
    keep: str = "first"
    drop_truncated: bool = False
    source: dict = dataclasses.field(default_factory=dict)     # what every record's "source" carries


@dataclasses.dataclass
class Sample:
    prompt: int
    index: int
    seed: int
    text: str                     # the assistant turn (TEXT)
    scores: dict[str, float]
    reward: float
    finish_reason: str
    ids: list[int]                # the sampled completion ids, EOS included when it stopped there
    accepted: bool


@dataclasses.dataclass
class Tally:
    prompts: int = 0
    samples: int = 0
    accepted: int = 0
    passed: int = 0               # prompts with at least one accepted sample
    reward_sum: float = 0.0
    written: int = 0
    truncated: int = 0            # hit max_new_tokens without an EOS
    retokenized: int = 0          # written records whose text SFT tokenizes differently from the sample
    tokens: int = 0
    seconds: float = 0.0

    def line(self, k: int) -> str:
        rate = lambda a, b: a / b if b else 0.0
        return (f"distill: {self.prompts} prompts, {self.samples} samples, {self.accepted} accepted "
                f"({rate(self.accepted, self.samples):.1%}), pass@{k} {self.passed}/{self.prompts} "
                f"({rate(self.passed, self.prompts):.1%}), mean reward {rate(self.reward_sum, self.samples):.4f}; "
                f"{self.written} records written ({self.retokenized} retokenized); {self.truncated} truncated; "
                f"{self.tokens} tokens in {self.seconds:.1f}s ({rate(self.tokens, self.seconds):.1f} tokens/s, "
                f"compiles included)")


# ------------------------------------------------------------------------------------- inputs

def sample_seed(seed: int, prompt: int, sample: int) -> int:
    """The generator seed of sample `sample` of prompt `prompt`: hashed, so neighbouring prompts
    and runs with neighbouring --seed draw unrelated streams."""
    digest = hashlib.sha256(f"{seed}/{prompt}/{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def parse_reward(spec: str) -> rewards.Combined:
    """`name[=weight],...` over rewards.REWARDS and tasks.TASK_REWARDS."""
    weights: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        name, _, w = part.partition("=")
        try:
            weights[name.strip()] = float(w) if w else 1.0
        except ValueError:
            raise InputError(f"--reward {spec}: weight {w!r} of {name!r} is not a number") from None
    try:
        return rewards.combine(weights, REGISTRY)
    except ValueError as e:
        raise InputError(f"--reward {spec}: {e}") from None


def read_input(path: Path) -> list[tuple[list[dict], dict, str]]:
    """(messages, verifier fields, where) per line of `path`: `{"messages": [...]}` (ending before
    the turn to sample) or `{"prompt": "text"}` (one user message), plus any fields the verifier
    reads; `where` names the line in errors."""
    if not path.is_file():
        raise InputError(f"--input {path}: no such file")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or ("messages" in obj) == ("prompt" in obj):
            raise InputError(f'{where}: must be a JSON object with exactly one of "messages" and "prompt"')
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise InputError(f'{where}: "prompt" must be a non-empty string')
            messages = [{"role": "user", "content": obj["prompt"]}]
        else:
            try:
                messages = chat.check(obj["messages"])
            except chat.ChatError as e:
                raise InputError(f"{where}: {e}") from None
            if messages[-1]["role"] == "assistant":
                raise InputError(f"{where}: the last message is an assistant turn; give the conversation "
                                 "before the turn to sample")
        out.append((messages, {k: v for k, v in obj.items() if k != "messages"}, where))
    if not out:
        raise InputError(f"--input {path}: no prompts")
    return out


def task_input(name: str, n: int, seed: int, split: str) -> list[tuple[list[dict], dict, str]]:
    try:
        examples = tasks.generate(name, n, seed, split)
    except ValueError as e:
        raise InputError(f"--task {name}: {e}") from None
    return [([{"role": "user", "content": e["prompt"]}], e, f"--task {name} prompt {i}")
            for i, e in enumerate(examples)]


def opening(template: chat.Template, messages: list[dict]) -> str:
    """The part of the assistant's turn the generation prompt already wrote: R1's prompt ends
    `<｜Assistant｜><think>\\n` after the conversation, and the turn is `<think>\\n` + completion
    (the header is the template's, not the turn's). Empty for a template that opens no `<think>`."""
    bare = template.render(messages, add_generation_prompt=False)
    full = template.render(messages, add_generation_prompt=True)
    added = full[len(bare):] if full.startswith(bare) else full
    i = added.rfind(rewards.THINK)
    return added[i:] if i >= 0 else ""


def prepare(items, tokenizer, template: chat.Template, reward: rewards.Combined, max_len: int = 0) -> list[Prompt]:
    """Each (messages, example, where) rendered, tokenized and checked against the verifier (a
    reward that needs a field the example lacks is named here, before anything compiles)."""
    out = []
    for messages, example, where in items:
        try:
            text = template.render(messages, add_generation_prompt=True)
        except chat.ChatError as e:
            raise InputError(f"{where}: {e}") from None
        ids = tuple(tokenizer.encode(text, add_special_tokens=False).ids)
        if max_len and len(ids) >= max_len:
            raise InputError(f"{where}: {len(ids)} prompt tokens do not fit infer.max_len={max_len}")
        for name, fn in reward.rewards.items():
            try:
                fn(_PROBE, example)
            except KeyError as e:
                raise InputError(f"{where}: reward {name} needs the field {e}") from None
            except Exception as e:     # e.g. an unknown task or language
                raise InputError(f"{where}: reward {name}: {e}") from None
        out.append(Prompt(messages, example, ids, opening(template, messages), where))
    return out


# ----------------------------------------------------------------------------- sample, verify

def _body(ids: list[int], finish_reason: str, eos: int) -> list[int]:
    """The completion's ids without the EOS it stopped on (SFT appends the EOS itself)."""
    return ids[:-1] if finish_reason == "stop" and ids[-1:] == [eos] else ids


def _scores(reward: rewards.Combined, text: str, p: Prompt) -> dict[str, float]:
    try:
        return reward.scores(text, p.example)
    except KeyError as e:          # a field the probe in `prepare` did not reach
        raise InputError(f"{p.where}: the reward needs the field {e}") from None


def select(samples: list[Sample], keep: str) -> list[Sample]:
    """The accepted samples of one prompt to write: all, the first (by sample index), or the best
    (the highest reward; the first of equals)."""
    ok = [s for s in samples if s.accepted]
    if keep == "all" or not ok:
        return ok
    if keep == "first":
        return ok[:1]
    return [max(ok, key=lambda s: (s.reward, -s.index))]


def record(p: Prompt, s: Sample, source: dict) -> dict:
    return {"messages": p.messages + [{"role": "assistant", "content": s.text}], "reward": s.reward,
            "source": {**source, "prompt": s.prompt, "sample": s.index, "seed": s.seed,
                       "finish_reason": s.finish_reason, "completion_tokens": len(s.ids), "scores": s.scores,
                       "example": p.example}}


def distill(gen, tokenizer, template: chat.Template, prompts: list[Prompt], reward: rewards.Combined,
            st: Settings, out: TextIO, log: Callable[[str], None] = lambda s: None) -> Tally:
    """Sample, verify and write: st.samples completions of every prompt with `gen` (a Generator),
    scored by `reward`, the ones kept (st.keep) written to `out` as SFT records in prompt order."""
    from r1jax.infer.generator import Request
    eos = sft.eos_id(tokenizer)
    tally = Tally(prompts=len(prompts))
    K = st.samples
    per_call = max(1, 4 * gen.infer.batch_size // K)      # prompts a generate() call: progress, bounded memory
    t0 = time.perf_counter()
    for start in range(0, len(prompts), per_call):
        chunk = range(start, min(start + per_call, len(prompts)))
        seeds = [(i, k, sample_seed(st.seed, i, k)) for i in chunk for k in range(K)]
        reqs = [Request(prompt_ids=prompts[i].ids, max_new_tokens=st.max_new_tokens, temperature=st.temperature,
                        top_p=st.top_p, seed=s) for i, _, s in seeds]
        done = gen.generate(reqs)
        by_prompt: dict[int, list[Sample]] = {i: [] for i in chunk}
        for (i, k, seed), c in zip(seeds, done):
            ids = list(c.completion_ids)
            text = prompts[i].opening + tokenizer.decode(_body(ids, c.finish_reason, eos), skip_special_tokens=False)
            scores = _scores(reward, text, prompts[i])
            total = reward.total(scores)
            truncated = c.finish_reason == "length"
            accepted = total >= st.threshold and not (truncated and st.drop_truncated)
            by_prompt[i].append(Sample(i, k, seed, text, scores, total, c.finish_reason, ids, accepted))
            tally.samples += 1
            tally.accepted += accepted
            tally.reward_sum += total
            tally.truncated += truncated
            tally.tokens += c.completion_tokens
        for i, samples in by_prompt.items():
            tally.passed += any(s.accepted for s in samples)
            for s in select(samples, st.keep):
                rec = record(prompts[i], s, st.source)
                ids, _ = sft.encode(rec, tokenizer, template)
                want = list(prompts[i].ids) + _body(s.ids, s.finish_reason, eos) + [eos]
                tally.retokenized += ids.tolist() != want
                out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                tally.written += 1
        tally.seconds = time.perf_counter() - t0
        log(f"distill: {chunk.stop}/{len(prompts)} prompts, {tally.accepted}/{tally.samples} samples accepted, "
            f"{tally.tokens / tally.seconds:.1f} tokens/s")
    return tally


# -------------------------------------------------------------------------------------- the CLI

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m r1jax.distill", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="sample from the teacher, keep what the verifier accepts, write SFT JSONL")
    g.add_argument("--teacher", required=True, help="a run directory, orbax:DIR or hf:DIR (as generate --model)")
    g.add_argument("--input", help='JSONL of {"messages": [...]} or {"prompt": "text"} plus the verifier\'s fields')
    g.add_argument("--task", help=f"generated prompts of a task ({', '.join(tasks.TASKS)})")
    g.add_argument("--n", type=int, help="--task: how many prompts")
    g.add_argument("--split", default="train", help="--task: train or eval")
    g.add_argument("--task-seed", type=int, default=0, help="--task: the problems' seed")
    g.add_argument("--output", required=True, help="SFT JSONL of the kept samples")
    g.add_argument("--force", action="store_true", help="overwrite an existing --output")
    g.add_argument("--samples", type=int, default=4, help="completions sampled per prompt (K)")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--seed", type=int, default=0, help="every sample's seed derives from it")
    g.add_argument("--batch-size", type=int, default=None, help="rows decoded together (infer.batch_size)")
    g.add_argument("--reward", default=None,
                   help=f"name[=weight],... over {', '.join(REGISTRY)} (default: task_exact with --task, "
                        "else accuracy)")
    g.add_argument("--threshold", type=float, default=1.0, help="keep a sample whose combined reward >= this")
    g.add_argument("--keep", default="first", choices=KEEP,
                   help="per prompt: every accepted sample, the first, or the best-scoring")
    g.add_argument("--drop-truncated", action="store_true",
                   help="reject samples that reached --max-new-tokens without ending (SFT would teach an EOS there)")
    g.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="the teacher's config overrides, e.g. mesh.tensor=8 infer.cache_dtype=fp32")
    return ap


def _check_flags(a) -> None:
    if (a.input is None) == (a.task is None):
        raise InputError("give --input IN.jsonl or --task NAME --n N")
    if a.task is not None and (a.n is None or a.n < 1):
        raise InputError("--task needs --n N (N >= 1 prompts)")
    if a.input is not None and (a.n is not None or a.task_seed != 0 or a.split != "train"):
        raise InputError("--n, --split and --task-seed go with --task, not --input")
    if a.samples < 1:
        raise InputError(f"--samples {a.samples}: must be >= 1")
    if a.batch_size is not None and a.batch_size < 1:
        raise InputError(f"--batch-size {a.batch_size}: must be >= 1")
    for k in ("max_new_tokens", "temperature", "top_p"):
        v = getattr(a, k)
        if not REQUEST_FIELDS[k][0](v):
            raise InputError(f"--{k.replace('_', '-')} {v}: must be {REQUEST_FIELDS[k][1]}")
    out = Path(a.output)
    if out.is_dir():
        raise InputError(f"--output {out}: is a directory")
    if not out.parent.is_dir():
        raise InputError(f"--output {out}: {out.parent} does not exist")
    if out.exists() and not a.force:
        raise InputError(f"--output {out}: exists (--force overwrites it)")


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    log = lambda s: print(s, file=sys.stderr, flush=True)

    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    from r1jax.config import ConfigError
    from r1jax.infer import source as sourcelib
    # every flag, the teacher's files and every prompt are checked before anything loads or compiles
    try:
        _check_flags(a)
        spec = a.reward or ("task_exact" if a.task else "accuracy")
        reward = parse_reward(spec)
        items = task_input(a.task, a.n, a.task_seed, a.split) if a.task else read_input(Path(a.input))
        overrides = list(a.set) + ([f"infer.batch_size={a.batch_size}"] if a.batch_size is not None else [])
        try:
            src = sourcelib.resolve(a.teacher, overrides)
        except ConfigError as e:
            msg = str(e)
            raise InputError("--teacher" + msg[len("--model"):] if msg.startswith("--model") else msg) from None
        tokenizer = src.tokenizer()
        if tokenizer is None:
            raise InputError(f"--teacher {a.teacher}: has no tokenizer.json (distillation writes text)")
        sft.eos_id(tokenizer)
        template = chat.for_directory(src.tokenizer_path.parent)
        prompts = prepare(items, tokenizer, template, reward, src.cfg.infer.max_len)
    except (InputError, ConfigError) as e:
        return fail(str(e))

    source: dict[str, Any] = {"teacher": a.teacher}
    source.update({"task": a.task, "split": a.split, "task_seed": a.task_seed} if a.task else {"input": a.input})
    st = Settings(samples=a.samples, temperature=a.temperature, top_p=a.top_p, max_new_tokens=a.max_new_tokens,
                  seed=a.seed, threshold=a.threshold, keep=a.keep, drop_truncated=a.drop_truncated, source=source)
    t0 = time.perf_counter()
    try:
        gen = src.generator(tokenizer, log)
    except ConfigError as e:
        return fail(str(e))
    log(f"loaded {a.teacher} in {time.perf_counter() - t0:.1f}s; chat template {template.name}; "
        f"{len(prompts)} prompts x {a.samples} samples; reward {spec} >= {a.threshold}, keep {a.keep}")

    out = Path(a.output)
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"     # beside it: the rename stays on one filesystem
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            tally = distill(gen, tokenizer, template, prompts, reward, st, f, log)
        os.replace(tmp, out)
    except InputError as e:           # a prompt whose fields a reward lacks
        return fail(str(e))
    finally:
        tmp.unlink(missing_ok=True)
    print(tally.line(a.samples) + f"; {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
