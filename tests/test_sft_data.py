"""SFT data (r1jax/data/sft.py): masks against ones built by hand from the rendered strings, the
<think>-stripping template pitfall, packing that keeps examples whole, resumable iterator state,
the masked next-token loss against NumPy, and one-line errors for bad JSONL."""
from __future__ import annotations

import collections
import json

import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from r1jax.config import ConfigError
from r1jax.data import chat, sft
from r1jax.data import tokenizer as toklib
from r1jax.model import Output
from r1jax.train.objectives import NextToken

B, E, U, A = chat.BOS, chat.EOS, chat.USER, chat.ASSISTANT
SPECIALS = [B, E, U, A, "<think>", "</think>"]      # as in DeepSeek-R1's tokenizer: added tokens
WORDS = "be brief what is two plus add them again four six and three".split() + [f"w{i}" for i in range(40)]

CONVERSATION = {"messages": [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\nfour"},
    {"role": "user", "content": "and three plus three"},
    {"role": "assistant", "content": "<think>\nadd again\n</think>\nsix"}]}

# DeepSeek's HF chat template in miniature: every assistant turn keeps only what follows </think>.
STRIPPING = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{% set content = m['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")


def _tokenizer() -> Tokenizer:
    """Whitespace-split words; R1's markers and think tags are added tokens (so split anywhere)."""
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *SPECIALS, *WORDS])}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.add_special_tokens(SPECIALS)
    return t


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return _tokenizer()


def _ids(tok, words: str) -> list[int]:
    return [tok.token_to_id(w) for w in words.split()]


def test_hand_built_mask_two_turns(tok):
    """system + user + assistant + user + assistant, rendered in R1's format by hand."""
    prompt = (B + "be brief" + U + "what is two plus two" + A + "\nfour" + E
              + U + "and three plus three" + A + "<think>\n")
    assert chat.Template().render(CONVERSATION["messages"][:-1]) == prompt
    context = [B, *"be brief".split(), U, *"what is two plus two".split(), A, "four", E,
               U, *"and three plus three".split(), A, "<think>"]
    completion = ["add", "again", "</think>", "six", E]    # the content's "<think>\n" is already in the prompt
    want_ids = [tok.token_to_id(w) for w in context + completion]
    last = [0] * len(context) + [1] * len(completion)
    every = list(last)
    every[context.index("four")] = every[context.index(E)] = 1   # the earlier answer as it is in context
    for turns, want_mask in (("last", last), ("all", every)):
        ids, mask = sft.encode(CONVERSATION, tok, chat.Template(), turns=turns)
        assert ids.dtype == mask.dtype == np.int32
        assert ids.tolist() == want_ids and mask.tolist() == want_mask, turns
    # the prompt's ids are what serving feeds for this conversation
    assert want_ids[:len(context)] == tok.encode(prompt, add_special_tokens=False).ids


def test_bos_comes_from_the_template_once():
    """DeepSeek's tokenizer.json also adds BOS in its post-processor; the template already wrote it."""
    t = _tokenizer()
    t.post_processor = processors.TemplateProcessing(single=f"{B} $A", special_tokens=[(B, t.token_to_id(B))])
    ids, _ = sft.encode(CONVERSATION, t, chat.Template())
    assert ids.tolist().count(t.token_to_id(B)) == 1 and ids[0] == t.token_to_id(B)


def test_content_without_think_newline_opens_it_once(tok):
    msgs = [{"role": "user", "content": "two plus two"}, {"role": "assistant", "content": "<think>add</think>four"}]
    ids, mask = sft.encode({"messages": msgs}, tok, chat.Template())
    assert [tok.id_to_token(i) for i in ids[mask == 1]] == ["add", "</think>", "four", E]
    assert [tok.id_to_token(i) for i in ids].count("<think>") == 1


def test_stripping_template_pitfall(tok):
    msgs = CONVERSATION["messages"]
    t = chat.Template(STRIPPING, bos=B, eos=E)
    full = t.render(msgs, add_generation_prompt=False)
    # (a) the stock way loses the reasoning of every turn, and the generation prompt is no prefix of it
    assert "add again" not in full and "add them" not in full
    assert not full.startswith(t.render(msgs[:-1], add_generation_prompt=True))
    # (b) encode keeps it: the mask covers exactly reasoning + answer + EOS
    ids, mask = sft.encode(CONVERSATION, tok, t)
    assert [tok.id_to_token(i) for i in ids[mask == 1]] == ["add", "again", "</think>", "six", E]
    assert ids.tolist() == sft.encode(CONVERSATION, tok, chat.Template())[0].tolist()
    ids_all, mask_all = sft.encode(CONVERSATION, tok, t, turns="all")
    assert [tok.id_to_token(i) for i in ids_all[mask_all == 1]] == ["four", E, "add", "again", "</think>", "six", E]


def test_byte_level_tokenizer_keeps_serving_ids_and_completion():
    """An r1jax-trained BPE: R1's markers are plain text to it, its EOS is <|eos|>."""
    bpe = toklib.train([" ".join(WORDS), chat.Template().render(CONVERSATION["messages"])] * 4, 300)
    ids, mask = sft.encode(CONVERSATION, bpe, chat.Template())
    prompt = bpe.encode(chat.Template().render(CONVERSATION["messages"][:-1]), add_special_tokens=False).ids
    n = len(prompt)
    assert ids[:n].tolist() == prompt and not mask[:n].any() and mask[n:].all()
    assert ids[-1] == bpe.token_to_id("<|eos|>")
    assert bpe.decode(ids[n:-1].tolist()) == "add again\n</think>\nsix"
    ids_all, mask_all = sft.encode(CONVERSATION, bpe, chat.Template(), turns="all")
    assert ids_all.tolist() == ids.tolist() and (mask_all >= mask).all()
    assert bpe.decode(ids[(mask_all == 1) & (mask == 0)].tolist()).startswith("\nfour<｜end▁of▁sentence")


def _examples(n: int, seed: int = 0) -> list[dict]:
    """Distinct examples of 4..23 tokens (prompt 4 + k words, completion m words + EOS)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k, m = rng.integers(1, 8), rng.integers(0, 12)
        user = " ".join([f"w{i}"] + [f"w{j}" for j in rng.integers(0, 40, k - 1)])
        answer = " ".join(f"w{j}" for j in rng.integers(0, 40, m))
        out.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
    return out


def _segments(batch: dict):
    """Every (ids, loss_mask) segment of a batch, after checking its segment ids and positions."""
    for r in range(batch["ids"].shape[0]):
        seg, pos = batch["segment_ids"][r], batch["positions"][r]
        pad = seg == 0
        assert not batch["loss_mask"][r][pad].any() and not pos[pad].any()
        k = int(seg.max())
        for s in range(1, k + 1):
            where = np.flatnonzero(seg == s)
            assert where.tolist() == list(range(where[0], where[-1] + 1))   # contiguous
            assert pos[where].tolist() == list(range(len(where)))          # positions restart
            yield tuple(batch["ids"][r][where].tolist()), tuple(batch["loss_mask"][r][where].tolist())
        if not pad.all():                                                     # padding only at the end
            assert not seg[: np.flatnonzero(~pad)[-1]].tolist().count(0)


def test_packing_keeps_examples_whole_once_per_epoch(tok):
    seq_len, bs = 48, 3
    exs = _examples(40)
    for user, answer in ((40, 10), (46, 1)):   # 55 tokens, 4 trained after the cut; 52, prompt alone fills seq_len
        exs.append({"messages": [{"role": "user", "content": " ".join(["w1"] * user)},
                                 {"role": "assistant", "content": " ".join(["w2"] * answer)}]})
    want = collections.Counter()
    for ex in exs:
        ids, mask = sft.encode(ex, tok, chat.Template())
        want[tuple(ids[:seq_len].tolist()), tuple(mask[:seq_len].tolist())] += 1
    st = sft.stats(exs, tok, chat.Template(), seq_len)
    assert (st.examples, st.truncated, st.no_target, st.longest) == (42, 2, 1, 55)
    assert st.target_tokens == sum(sum(m) for _, m in want.elements())
    for shards in (1, 2):
        got = collections.Counter()
        segments = []
        for s in range(shards):
            sizes = []
            for batch in sft.sft_batches(exs, tok, chat.Template(), seq_len=seq_len, batch_size=bs, seed=3,
                                         shard_index=s, shard_count=shards, epochs=1):
                assert set(batch) == {"ids", "segment_ids", "positions", "loss_mask"}
                assert all(v.dtype == np.int32 and v.shape[1] == seq_len for v in batch.values())
                sizes.append(batch["ids"].shape[0])
                segments += batch["segment_ids"].max(axis=1).tolist()
                got.update(_segments(batch))
            assert all(n == bs for n in sizes[:-1]) and 0 < sizes[-1] <= bs   # epochs=1: the last may be partial
        assert got == want, shards                # every example exactly once, none split or altered
        assert max(segments) >= 3 and 0 not in segments


def test_state_round_trip_resumes_with_next_batch(tok):
    ds = sft.sft_batches(_examples(15), tok, chat.Template(), seq_len=24, batch_size=2, seed=5)
    it = iter(ds)
    for _ in range(4):
        next(it)
    state = json.loads(json.dumps(it.get_state()))        # as the checkpoint stores it
    ref = [next(it) for _ in range(12)]                   # crosses epochs (15 examples ~ 5 batches)
    it2 = iter(ds)
    it2.set_state(state)
    for a in ref:
        b = next(it2)
        assert all(np.array_equal(a[k], b[k]) for k in a)
        assert a["ids"].shape == (2, 24)                  # epochs=None: whole batches only


def test_sft_loss_is_masked_cross_entropy(tok):
    batch = next(iter(sft.sft_batches(_examples(12), tok, chat.Template(), seq_len=24, batch_size=3,
                                      seed=1, turns="all")))
    ids, seg, lm = batch["ids"], batch["segment_ids"], batch["loss_mask"]
    Bn, T = ids.shape
    W = tok.get_vocab_size()
    logits = np.random.default_rng(0).normal(size=(Bn, T, W)).astype(np.float32) * 3
    obj = NextToken(masked=True, mtp_depth=0)
    loss_sum, n, _ = obj(Output(jnp.asarray(logits), None, {}), {k: jnp.asarray(v) for k, v in batch.items()})
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    terms = [-logp[b, t, ids[b, t + 1]] for b in range(Bn) for t in range(T - 1)
             if lm[b, t + 1] == 1 and seg[b, t + 1] == seg[b, t] != 0]
    assert int(n) == len(terms) == int(lm.sum()) > 0      # each segment opens with prompt tokens (mask 0)
    assert float(obj.tokens({k: jnp.asarray(v) for k, v in batch.items()})) == len(terms)
    np.testing.assert_allclose(float(loss_sum / n), np.mean(terms), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("line,words", [
    ('{"messages": [{"role": "user", "content": "hi"}]}', "the last message must have role assistant"),
    ('{"messages": [{"role": "bot", "content": "hi"}]}', "messages[0].role must be one of"),
    ('{"prompt": "hi"}', "each line must be a JSON object"),
    ('{"prompt": "hi", "completion": ["x"]}', "must both be strings or both be lists"),
    ('{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "user", "content": "x"}]}',
     "completion messages must have role assistant"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "needs a system or user message before it"),
    ('[1, 2]', "each line must be a JSON object"),
    ('{"messages": [', "not valid JSON"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, words):
    good = json.dumps({"prompt": "hi", "completion": "yo"})
    p = tmp_path / "train.jsonl"
    p.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(ConfigError) as e:
        sft.read([str(p)])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"data.paths: {p} line 3: ") and words in msg, msg


def test_read_normalises_all_forms(tmp_path):
    p = tmp_path / "a.jsonl"
    conv = {"prompt": [{"role": "system", "content": "s"},
                       {"role": "user", "content": [{"type": "text", "text": "q"}]}],
            "completion": [{"role": "assistant", "content": "a"}]}
    p.write_text("\n".join(json.dumps(r) for r in (CONVERSATION, {"prompt": "q", "completion": "a", "id": 7}, conv)))
    got = sft.read([str(p)])
    assert got[0] == CONVERSATION
    assert got[1] == {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert got[2]["messages"][1] == {"role": "user", "content": "q"} and len(got[2]["messages"]) == 3
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match=r"empty.jsonl has no records"):
        sft.read([str(tmp_path / "empty.jsonl")])
    with pytest.raises(ConfigError, match="does not exist"):
        sft.read([str(tmp_path / "missing.jsonl")])


def test_turns_all_needs_prefix_renderings(tok):
    """R1's format gathers system messages at the front: a late one changes the earlier text."""
    msgs = [{"role": "user", "content": "two"}, {"role": "assistant", "content": "four"},
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "three"},
            {"role": "assistant", "content": "six"}]
    assert sft.encode({"messages": msgs}, tok, chat.Template())[1].sum() == 2         # six + EOS
    with pytest.raises(chat.ChatError, match="train with turns=last"):
        sft.encode({"messages": msgs}, tok, chat.Template(), turns="all")
    with pytest.raises(ConfigError, match="turns='some'"):
        sft.encode({"messages": msgs}, tok, chat.Template(), turns="some")
