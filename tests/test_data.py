"""Vocabulary, Corpus and the PTB-format reader, including every kind of bad input."""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

import mpedu.cli.commands as cli
from conftest import FUZZ
from mpedu.lm import Corpus, CorpusError, EOS, PAD, UNK, Vocabulary, load_corpus, read_sentences


PTB = Path(__file__).resolve().parents[2] / "shared" / "data" / "ptb"


def write_corpus(folder: Path, train="a b c\nb c\n", valid="a b\n", test="c d\n") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, text in (("train", train), ("valid", valid), ("test", test)):
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        (folder / f"ptb.{split}.txt").write_bytes(data)
    return folder


# ---- Vocabulary -------------------------------------------------------------------------------

def test_vocabulary_specials_come_first_then_count_then_word():
    v = Vocabulary.build([["b", "a", "c"], ["c", "b", "c"], ["d"]])
    assert v.itos == [PAD, UNK, EOS, "c", "b", "a", "d"]  # c:3, b:2, then a and d tied at 1
    assert (v.pad_id, v.unk_id, v.eos_id) == (0, 1, 2)
    assert len(v) == 7 and v.stoi["b"] == 4


def test_vocabulary_min_count_max_size_and_unknown_words():
    sentences = [["x"] * 5 + ["y"] * 3 + ["z"]]
    assert Vocabulary.build(sentences, min_count=2).itos[3:] == ["x", "y"]
    v = Vocabulary.build(sentences, max_size=1)
    assert v.itos[3:] == ["x"]
    assert v.encode(["x", "y", "never-seen"]) == [3, 1, 1]


def test_vocabulary_does_not_duplicate_unk_from_the_text():
    v = Vocabulary.build([["<unk>", "a", "<unk>"]])  # PTB writes <unk> in its files
    assert v.itos == [PAD, UNK, EOS, "a"] and v.encode(["<unk>"]) == [1]


def test_vocabulary_round_trips_through_json_and_weights_only_checkpoints(tmp_path):
    v = Vocabulary.build([["the", "cat", "sat"], ["the", "dog"]])
    assert Vocabulary.from_dict(json.loads(json.dumps(v.to_dict()))).itos == v.itos
    torch.save({"vocab": v.to_dict()}, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert Vocabulary.from_dict(loaded["vocab"]).stoi == v.stoi


def test_vocabulary_decode_accepts_tensors_and_rejects_bad_tables():
    v = Vocabulary.build([["a", "b"]])
    assert v.decode(torch.tensor([3, 4, 2])) == ["a", "b", EOS]
    with pytest.raises(ValueError, match="must start with"):
        Vocabulary(["a", "b", "c"])
    with pytest.raises(ValueError, match="twice"):
        Vocabulary([PAD, UNK, EOS, "a", "a"])


# ---- Corpus -----------------------------------------------------------------------------------

def test_sentences_are_int64_ids_ending_in_eos(tmp_path):
    c = load_corpus(write_corpus(tmp_path / "c"))
    assert isinstance(c, Corpus) and c.name == str(tmp_path / "c")
    assert [s.tolist() for s in c.train] == [[c.vocab.stoi[w] for w in "a b c".split()] + [2],
                                             [c.vocab.stoi["b"], c.vocab.stoi["c"], 2]]
    assert all(s.dtype == torch.int64 and s.dim() == 1 for s in c.train + c.valid + c.test)
    assert c.tokens("train") == 7 and c.tokens("valid") == 3


def test_vocabulary_comes_from_train_only(tmp_path):
    c = load_corpus(write_corpus(tmp_path / "c"))
    assert "d" not in c.vocab.stoi  # d occurs only in test
    assert c.vocab.decode(c.test[0]) == ["c", UNK, EOS]


def test_unigram_perplexity_is_add_one_smoothed_train_unigrams(tmp_path):
    c = load_corpus(write_corpus(tmp_path / "c"))
    # train ids: a b c <eos> b c <eos> -> counts a1 b2 c2 eos2 unk0, +1 each over 5 (pad excluded): /12
    p = {"a": 2 / 12, "b": 3 / 12, "c": 3 / 12, EOS: 3 / 12, UNK: 1 / 12}
    expected = math.exp(-(math.log(p["c"]) + math.log(p[UNK]) + math.log(p[EOS])) / 3)
    assert c.unigram_perplexity("test") == pytest.approx(expected)
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        c.unigram_perplexity("dev")


def test_embedded_corpus_is_cached_but_callers_get_their_own_tensors():
    a = load_corpus()
    a.train[0][0] = 999
    b = load_corpus()
    assert b.train[0][0] != 999
    assert a.name == "embedded(seed=0)" and len(b.vocab) > 2_500
    assert all(int(s[-1]) == 2 and (s[:-1] != 2).all() for s in b.train[:200])


# ---- Bad input --------------------------------------------------------------------------------

def test_missing_folder_names_the_path_and_the_three_files(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_corpus(tmp_path / "nope")
    msg = str(e.value)
    assert str(tmp_path / "nope") in msg and all(f"ptb.{s}.txt" in msg for s in ("train", "valid", "test"))
    assert isinstance(e.value, CorpusError)


def test_missing_file_names_it(tmp_path):
    folder = write_corpus(tmp_path / "c")
    (folder / "ptb.valid.txt").unlink()
    with pytest.raises(CorpusError, match=r"lacks ptb\.valid\.txt"):
        load_corpus(folder)
    with pytest.raises(FileNotFoundError, match="no such corpus file"):
        read_sentences(folder / "ptb.valid.txt")


@pytest.mark.parametrize("text", ["", "\n\n  \n\t\n"], ids=["empty", "blank-lines-only"])
def test_a_file_without_sentences_is_an_error_naming_it(tmp_path, text):
    folder = write_corpus(tmp_path / "c", test=text)
    with pytest.raises(CorpusError, match=r"ptb\.test\.txt contains no sentences"):
        load_corpus(folder)


def test_undecodable_bytes_name_the_file_and_line(tmp_path):
    folder = write_corpus(tmp_path / "c", train=b"fine line\nstill fine\nbad \xff byte\n")
    with pytest.raises(CorpusError, match=r"ptb\.train\.txt:3: not valid UTF-8"):
        load_corpus(folder)


def test_blank_lines_are_skipped_and_counted(tmp_path):
    folder = write_corpus(tmp_path / "c", train="\n a b \n\n\n c\n   \n")
    c = load_corpus(folder)
    assert [c.vocab.decode(s) for s in c.train] == [["a", "b", EOS], ["c", EOS]]
    assert c.blank_lines == {"train": 4, "valid": 0, "test": 0}


def test_a_very_long_line_is_an_error_that_names_the_option(tmp_path):
    folder = write_corpus(tmp_path / "c", valid="short line\n" + "w " * 50 + "\n")
    with pytest.raises(CorpusError, match=r"ptb\.valid\.txt:2: .*50 tokens.*max_line_tokens=40"):
        load_corpus(folder, max_line_tokens=40)
    assert load_corpus(folder, max_line_tokens=50).tokens("valid") == 3 + 51


def test_the_padding_token_may_not_appear_in_text(tmp_path):
    folder = write_corpus(tmp_path / "c", train="a b\na <pad> b\n")
    with pytest.raises(CorpusError, match=r"ptb\.train\.txt:2: the token <pad> is reserved"):
        load_corpus(folder)


def test_reader_handles_ptb_spacing_crlf_and_a_byte_order_mark(tmp_path):
    path = tmp_path / "x.txt"
    path.write_bytes("\ufeff the cat \r\n a dog \n".encode("utf-8"))
    assert read_sentences(path) == [["the", "cat"], ["a", "dog"]]
    # old Mac line ends (a bare CR) end sentences too: the file was one sentence, or one over-long line
    path.write_bytes(b"the cat\ra dog\r\rsat\r")
    assert read_sentences(path) == [["the", "cat"], ["a", "dog"], ["sat"]]
    path.write_bytes(b"a b\rc d\ra <pad> b\r")                          # its line numbers count the CRs
    with pytest.raises(CorpusError, match=r"x\.txt:3: the token <pad> is reserved"):
        read_sentences(path)
    path.write_bytes(b"w " * 60)                                       # no line ends at all
    with pytest.raises(CorpusError, match="line ends may be missing.*command line reads at most 10,000"):
        read_sentences(path, max_line_tokens=50)


def test_a_split_too_short_for_the_stream_batch_is_named(tmp_path):
    from mpedu.lm import LSTMLM
    from mpedu.training import train
    corpus = load_corpus(write_corpus(tmp_path / "c", train="a b c d e f g\n" * 20, valid="a b\n"))
    model = LSTMLM.from_config("tiny", vocab_size=len(corpus.vocab))
    with pytest.raises(ValueError, match="'s valid split: batch_size=8 is more than the 3 tokens"):
        train(model, corpus, epochs=1, batch_size=8, bptt=4, progress=False, log=lambda *a: None)


# ---- Real Penn Treebank files -----------------------------------------------------------------

@pytest.fixture(scope="module")
def ptb(tmp_path_factory):
    if not (PTB / "ptb.valid.txt").is_file() or not (PTB / "ptb.test.txt").is_file():
        pytest.skip(f"Penn Treebank files not found in {PTB}")
    folder = tmp_path_factory.mktemp("ptb")
    shutil.copy(PTB / "ptb.valid.txt", folder / "ptb.train.txt")  # train on valid: train is not shipped
    shutil.copy(PTB / "ptb.test.txt", folder / "ptb.test.txt")
    lines = (PTB / "ptb.test.txt").read_text().splitlines(keepends=True)
    (folder / "ptb.valid.txt").write_text("".join(lines[: len(lines) // 2]))
    return load_corpus(folder)


def test_ptb_token_and_sentence_counts(ptb):
    assert (len(ptb.train), ptb.tokens("train")) == (3_370, 73_760)
    assert (len(ptb.test), ptb.tokens("test")) == (3_761, 82_430)
    assert len(ptb.valid) == 3_761 // 2
    assert sum(ptb.blank_lines.values()) == 0


def test_ptb_vocabulary(ptb):
    assert len(ptb.vocab) <= 10_000 + 3
    assert ptb.vocab.stoi["the"] == 3  # the most frequent word
    assert "<unk>" not in ptb.vocab.itos[3:] and "N" in ptb.vocab.stoi
    unk = ptb.test.cat().eq(ptb.vocab.unk_id).float().mean().item()
    assert 0.03 < unk < 0.15, f"<unk> rate on test {unk:.1%}"  # PTB's own <unk> plus words unseen in valid
    assert 200 < ptb.unigram_perplexity("test") < 1_500


# ---------------------------------------------------------------- bad corpus files

def _corpus(folder: Path, train_text: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ptb.train.txt").write_bytes(train_text)
    for split in ("valid", "test"):
        (folder / f"ptb.{split}.txt").write_bytes(b"a b c\nb c a\n")
    return folder


@pytest.mark.parametrize("content, words", [
    (b"", "contains no sentences"),
    (b"\n\n  \n", "contains no sentences"),
    (bytes(range(1, 256)) * 4, "not valid UTF-8"),          # (a NUL byte would be refused first, as UTF-16)
    (bytes(range(256)) * 4, "holds NUL bytes"),
    (b"w " * 20_000 + b"\n", "longer than max_line_tokens"),
    (b"a <pad> b\n", "reserved for padding"),
])
def test_bad_corpus_files_exit_2_naming_the_file(capsys, tmp_path, content, words):
    folder = _corpus(tmp_path / "data", content)
    code = cli.main(["train", "--devices", "1", "--data", str(folder), "--epochs", "1", "--no-progress",
                     "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("mpedu: error:") and words in err and "ptb.train.txt" in err, err


def test_one_huge_sentence_trains(capsys, tmp_path):
    folder = _corpus(tmp_path / "data", b" ".join(b"w%d" % (k % 50) for k in range(3000)) + b"\n")
    code = cli.main(["train", "--config", "tiny", "--data", str(folder), "--epochs", "1", "--limit-batches", "1",
                     "--no-progress", "--out", str(tmp_path / "out"), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["epochs"] == 1


@given(st.binary(max_size=400))
@FUZZ
def test_random_corpus_bytes_load_or_name_the_file(tmp_path, data):
    folder = _corpus(tmp_path / "fuzz", data)
    try:
        corpus = load_corpus(folder)
    except ValueError as e:
        assert "ptb.train.txt" in str(e)
    else:
        assert len(corpus.train) >= 1


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le"])
def test_a_utf16_corpus_without_a_byte_order_mark_is_refused_naming_the_line(tmp_path, encoding):
    # valid UTF-8 byte for byte ('t', NUL, 'h', NUL, ...): read as UTF-8 it would train on words like 't\x00h\x00e'
    text = "the cat sat\nthe dog ran\n".encode(encoding)
    for split in ("train", "valid", "test"):
        (tmp_path / f"ptb.{split}.txt").write_bytes(text)
    with pytest.raises(CorpusError, match=r"ptb.train.txt:1: holds NUL bytes .*UTF-16 or UTF-32 file\? Save it as UTF-8"):
        load_corpus(tmp_path)


def test_a_file_without_line_ends_is_refused_before_its_words_are_made(tmp_path):
    import tracemalloc
    _corpus(tmp_path, b" ".join(b"w%d" % i for i in range(200_000)))   # one line of 200,000 tokens, 1.3 MB
    tracemalloc.start()
    try:
        with pytest.raises(CorpusError, match=r"ptb.train.txt:1: a line of 200,000 tokens is longer than "
                                              r"max_line_tokens=10,000"):
            load_corpus(tmp_path, max_line_tokens=10_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6_000_000        # the line and its text; split into 200,000 strings it held over 13 MB


def test_old_mac_line_ends_are_many_lines_not_one_long_one(tmp_path):
    _corpus(tmp_path, b"a b c\r" * 5_000)                   # 5,000 sentences of 3 tokens, separated by CR only
    assert len(load_corpus(tmp_path, max_line_tokens=10).train) == 5_000
