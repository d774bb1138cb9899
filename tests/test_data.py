"""The data pipeline on small generated files: every source type, the counts of bad data,
lines mode with token blocks, cleaning, reproducible seeded shuffles, disjoint and complete
per-process shards, iterator state that resumes exactly (in-process and with 2 workers), and
HF-format tokenizers loaded from a directory."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from r1jax import config as configlib
from r1jax.config import ConfigError, DataConfig, DataSource, TextMode
from r1jax.data import text as textlib
from r1jax.data import tokenizer as toklib
from r1jax.data.sources import describe, open_corpus
from r1jax.data.pipeline import lm_batches, split_documents

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) for i in range(n)]


@pytest.fixture(scope="module")
def tok():
    return toklib.train(sentences(200), 300)


def docs_of(batches, tok, eos) -> list[str]:
    """The documents in a stream of packed rows (epochs=1): concatenate the real tokens, cut at EOS."""
    ids = np.concatenate([b["ids"][b["segment_ids"] > 0] for b in batches])
    cuts = np.flatnonzero(ids == eos)
    return [tok.decode(seg.tolist()) for seg in np.split(ids, cuts + 1)[:-1]]


def write_arrayrecord(path: Path, records: list[bytes]) -> None:
    w = ArrayRecordWriter(str(path), "group_size:1")
    for r in records:
        w.write(r)
    w.close()


# ------------------------------------------------------------------------------------ sources
def test_text_documents_count_bad_bytes_and_empty_files(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"plain text\n")
    (tmp_path / "b.txt").write_bytes(b"bad \xff\xfe bytes, an honest \xef\xbf\xbd stays uncounted")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.txt").write_bytes(b" \n\t\n")
    c = open_corpus(DataConfig(source=DataSource.text, paths=[str(tmp_path / "*.txt")]))
    assert [c[i] for i in range(len(c))] == [
        "plain text\n", "bad \ufffd\ufffd bytes, an honest \ufffd stays uncounted"]
    assert (c.stats["files"], c.stats["documents"]) == (4, 2)
    assert (c.stats["skipped_empty"], c.stats["replaced_chars"]) == (2, 2)
    assert c.total_bytes() == 11 + (tmp_path / "b.txt").stat().st_size
    assert "skipped 2 empty" in describe(c)


def test_lines_mode_keeps_every_nonblank_line(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"first line\r\n\r\n   \nsecond \xff line\nno newline at end")
    (tmp_path / "b.txt").write_bytes(b"\nother file\n")
    c = open_corpus(DataConfig(source=DataSource.text, paths=[str(tmp_path / "a.txt"), str(tmp_path / "b.txt")],
                               text_mode=TextMode.lines))
    assert [c[i] for i in range(len(c))] == ["first line", "second \ufffd line", "no newline at end", "other file"]
    assert (c.stats["skipped_empty"], c.stats["replaced_chars"], c.stats["files"]) == (3, 1, 2)
    assert pickle.loads(pickle.dumps(c))[3] == "other file"     # what Grain workers receive


def test_lines_mode_block_size_splits_long_lines_without_loss(tmp_path, tok):
    lines = sentences(30, seed=1) + [" ".join(WORDS * 8)]        # the last is ~100 tokens
    (tmp_path / "l.txt").write_text("\n".join(lines) + "\n")
    c = open_corpus(DataConfig(source=DataSource.text, paths=[str(tmp_path / "l.txt")], text_mode=TextMode.lines))
    eos, block = toklib.eos_id(tok), 16
    # One row holds the whole corpus, so every segment start is a block start.
    rows = list(lm_batches(c, range(len(c)), tok, eos, seq_len=2048, batch_size=1, seed=0, epochs=1,
                           shuffle_rows=0, block_size=block))
    pos = np.concatenate([r["positions"][0][r["segment_ids"][0] > 0] for r in rows])
    lengths = [len(tok.encode(line).ids) + 1 for line in lines]
    assert len(pos) == sum(lengths)                               # nothing dropped
    assert pos.max() == block - 1                                 # positions restart in every block
    assert (pos == 0).sum() == sum(-(-n // block) for n in lengths)
    assert sorted(docs_of(rows, tok, eos)) == sorted(lines)


def test_jsonl_index_counts_malformed_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join([
        b'{"text": "first", "id": 1}',
        b'not json',                       # line 2: the first bad one
        b'',
        b'["a list"]',
        b'{"body": "no text field"}',
        b'{"text": 7}',
        b'{"text": "  "}',
        b'{"text": "caf\xe9 latin-1 byte"}',
        b'{"text": "lone \\udc80 surrogate"}',
        b'{"text": "last"}']) + b"\n")
    c = open_corpus(DataConfig(source=DataSource.jsonl, paths=[str(path)]))
    assert [c[i] for i in range(len(c))] == ["first", "caf\ufffd latin-1 byte", "lone \ufffd surrogate", "last"]
    s = c.stats
    assert (s["bad_records"], s["first_bad"], s["skipped_empty"], s["replaced_chars"]) == (4, f"{path}:2", 2, 2)
    other = tmp_path / "o.jsonl"
    other.write_text(json.dumps({"content": "under another field"}) + "\n")
    c = open_corpus(DataConfig(source=DataSource.jsonl, paths=[str(other)], text_field="content"))
    assert c[0] == "under another field"


def test_parquet_row_groups_random_access(tmp_path):
    texts = [f"row {i}" if i % 5 else ("" if i % 10 else None) for i in range(60)]
    pq.write_table(pa.table({"text": texts[:40], "n": list(range(40))}), tmp_path / "a.parquet", row_group_size=7)
    pq.write_table(pa.table({"text": pa.array([t.encode() if t else t for t in texts[40:]], pa.binary())}),
                   tmp_path / "b.parquet", row_group_size=7)
    c = open_corpus(DataConfig(source=DataSource.parquet, paths=[str(tmp_path / "*.parquet")]))
    want = [t for t in texts if t]
    assert len(c) == len(want) and c.stats["skipped_empty"] == 12
    order = np.random.default_rng(0).permutation(len(c))          # a shuffle crosses row groups and files
    assert [c[i] for i in order] == [want[i] for i in order]
    assert pickle.loads(pickle.dumps(c))[len(c) - 1] == want[-1]
    with pytest.raises(ConfigError, match=r"^data.text_field: column 'body' is not in .*a.parquet"):
        open_corpus(DataConfig(source=DataSource.parquet, paths=[str(tmp_path / "a.parquet")], text_field="body"))
    with pytest.raises(ConfigError, match=r"^data.text_field: column 'n' in .* is int64, not text"):
        open_corpus(DataConfig(source=DataSource.parquet, paths=[str(tmp_path / "a.parquet")], text_field="n"))


def test_arrayrecord_text_and_json_records(tmp_path):
    write_arrayrecord(tmp_path / "t.array_record", [b"", b"first record", b"bad \xff byte", b"  "])
    c = open_corpus(DataConfig(source=DataSource.arrayrecord, paths=[str(tmp_path / "t.array_record")]))
    assert [c[i] for i in range(len(c))] == ["first record", "bad \ufffd byte"]
    assert (c.stats["format"], c.stats["skipped_empty"], c.stats["replaced_chars"]) == ("text", 2, 1)
    write_arrayrecord(tmp_path / "j.array_record", [json.dumps({"text": f"json {i}"}).encode() for i in range(3)]
                      + [b"oops", b'{"title": "x"}'])
    c = open_corpus(DataConfig(source=DataSource.arrayrecord, paths=[str(tmp_path / "j.array_record")]))
    assert [c[i] for i in range(len(c))] == ["json 0", "json 1", "json 2"]
    assert (c.stats["format"], c.stats["bad_records"]) == ("json", 2)
    assert c.stats["first_bad"].endswith("j.array_record:record 3")
    assert pickle.loads(pickle.dumps(c))[2] == "json 2"


def test_empty_corpus_is_one_clear_line(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"")
    (tmp_path / "b.txt").write_bytes(b"\n \n")
    with pytest.raises(ConfigError) as e:
        open_corpus(DataConfig(source=DataSource.text, paths=[str(tmp_path / "*.txt")]))
    assert str(e.value) == "data.paths (text): the corpus is empty: 2 files, 2 empty documents"
    (tmp_path / "r.jsonl").write_text('{"x": 1}\n\n')
    with pytest.raises(ConfigError, match=r"^data.paths \(jsonl\): .*1 bad \(first: .*r.jsonl:1: no \"text\" key "
                                          r"\(data.text_field=text\); its keys: x\)$"):
        open_corpus(DataConfig(source=DataSource.jsonl, paths=[str(tmp_path / "r.jsonl")]))
    with pytest.raises(ConfigError, match=r"^data.paths: '.*nothing\*' matches no file$"):
        open_corpus(DataConfig(source=DataSource.jsonl, paths=[str(tmp_path / "nothing*")]))


def test_cleaning(tmp_path):
    raw = "Cafe\u0301 au lait  \r\nline\ttwo\x00\x07 \rthree\x85\n"
    assert textlib.clean(raw) == "Caf\u00e9 au lait\nline\ttwo\nthree\n"
    (tmp_path / "a.txt").write_text(raw, newline="")
    (tmp_path / "b.txt").write_bytes(b"\x00\x01\x02")                      # nothing left after cleaning
    d = DataConfig(source=DataSource.text, paths=[str(tmp_path / "*.txt")], clean=True)
    c = open_corpus(d)
    assert len(c) == 1 and c[0] == textlib.clean(raw) and c.stats["skipped_empty"] == 1
    assert open_corpus(DataConfig(source=DataSource.text, paths=[str(tmp_path / "a.txt")]))[0] == raw


def test_new_keys_load_and_validate(tmp_path):
    cfg = configlib.load(None, ["data.source=jsonl", f"data.paths=[{tmp_path}/x.jsonl]", "data.text_field=body",
                                "data.block_size=128", "data.clean=true", "data.workers=2"])
    assert (cfg.data.source, cfg.data.text_field, cfg.data.block_size, cfg.data.clean, cfg.data.workers) == (
        DataSource.jsonl, "body", 128, True, 2)
    for overrides, key in [(["data.workers=-1"], "data.workers"), (["data.block_size=-8"], "data.block_size"),
                           (["data.source=parquet"], "data.paths"), (["data.paths=[a.txt]"], "data.paths"),
                           (["data.source=jsonl", "data.paths=[a]", "data.text_mode=lines"], "data.text_mode")]:
        with pytest.raises(ConfigError) as e:
            configlib.load(None, overrides)
        assert str(e.value).startswith(key) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------------- pipeline
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences(120)))
    return open_corpus(DataConfig(source=DataSource.jsonl, paths=[str(path)]))


def take(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


def test_seeded_shuffle_is_reproducible(corpus, tok):
    def first(seed):
        return take(lm_batches(corpus, range(len(corpus)), tok, 1, seq_len=32, batch_size=4, seed=seed), 3)
    a, b, c = first(0), first(0), first(1)
    assert all(np.array_equal(x["ids"], y["ids"]) for x, y in zip(a, b))
    assert not all(np.array_equal(x["ids"], y["ids"]) for x, y in zip(a, c))


def test_process_shards_are_disjoint_and_complete(corpus, tok):
    eos = toklib.eos_id(tok)
    split = split_documents(len(corpus), 0.1, seed=0)
    shards = [docs_of(list(lm_batches(corpus, split.train, tok, eos, seq_len=48, batch_size=2, seed=3,
                                      shard_index=i, shard_count=3, epochs=1, shuffle_rows=0)), tok, eos)
              for i in range(3)]
    assert all(len(set(a) & set(b)) == 0 for i, a in enumerate(shards) for b in shards[i + 1:])
    assert sorted(sum(shards, [])) == sorted(corpus[i] for i in split.train)
    assert {len(s) for s in shards} <= {len(split.train) // 3, len(split.train) // 3 + 1}


def assert_same(want, got):
    for w, g in zip(want, got, strict=True):
        assert w.keys() == g.keys() and all(np.array_equal(w[k], g[k]) for k in w)


def batches(corpus, tok, workers=0):
    return lm_batches(corpus, range(len(corpus)), tok, 1, seq_len=32, batch_size=4, seed=0, block_size=12,
                      shuffle_rows=16, workers=workers)


def test_iterator_state_resumes_exactly_after_json(corpus, tok):
    for k in range(1, 9):                    # with and without a half-packed document in the state
        it = iter(batches(corpus, tok))
        for _ in range(k):
            next(it)
        state = json.loads(json.dumps(it.get_state()))    # what a checkpoint stores
        want = [next(it) for _ in range(3)]
        again = iter(batches(corpus, tok))
        again.set_state(state)
        assert_same(want, [next(again) for _ in range(3)])


@pytest.mark.parametrize("workers", [0, 2])
def test_iterator_checkpoint_restores_exactly(corpus, tok, tmp_path, workers):
    import grain
    from etils import epath
    handler, where = grain.checkpoint.CheckpointHandler(), epath.Path(tmp_path)
    it = iter(batches(corpus, tok, workers))
    for _ in range(5):
        next(it)
    handler.save(where, args=grain.checkpoint.CheckpointSave(it))
    want = [next(it) for _ in range(4)]
    again = handler.restore(where, args=grain.checkpoint.CheckpointRestore(iter(batches(corpus, tok, workers))))
    got = [next(again) for _ in range(4)]
    assert_same(want, got)
    assert got[0]["ids"].shape == (4, 32) and got[0]["ids"].dtype == np.int32
    if workers:
        with pytest.raises(ConfigError, match=r"^data.workers=0: .* ran with 2 workers; resume with data.workers=2$"):
            handler.restore(where, args=grain.checkpoint.CheckpointRestore(iter(batches(corpus, tok, 0))))
        it.close()
        again.close()


# ---------------------------------------------------------------------------------- tokenizer
def test_tokenizer_from_hf_directory(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"       # DeepSeek's special tokens
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    base.decoder = decoders.ByteLevel()
    base.train_from_iterator(sentences(100), trainers.BpeTrainer(
        vocab_size=300, special_tokens=[bos, eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    hf = PreTrainedTokenizerFast(tokenizer_object=base, bos_token=bos, eos_token=eos)
    hf.save_pretrained(tmp_path / "ckpt")                        # tokenizer.json + tokenizer_config.json
    loaded = toklib.load(tmp_path / "ckpt")
    text = "doc 7: alpha beta gamma"
    assert loaded.encode(text).ids == hf(text, add_special_tokens=False)["input_ids"]
    assert toklib.eos_id(loaded) == hf.eos_token_id == 1
    with pytest.raises(ConfigError, match=r"^data.tokenizer: .*tokenizer.json does not exist$"):
        toklib.load(tmp_path)
