"""The embedded default corpus: a made-up language from a stochastic grammar, deterministic from a seed."""
from __future__ import annotations

import bisect
import itertools
import random
from pathlib import Path

# What an LSTM can learn here, and a unigram or bigram model cannot (all of it on purpose):
# - word classes in a grammar (determiner, adjective, noun, verb, preposition, ...);
# - number agreement: plural nouns end in "-s", singular present verbs end in "-s"
#   ("ze drobel frimas" / "ze drobels frima"), also across relative clauses and PPs
#   (e.g. "ze drobel ke ti kamos vuren frimas": frimas agrees with drobel, not kamos);
# - nesting: relative clauses, prepositional phrases, "sa" complement clauses;
# - topics: each noun, verb and adjective belongs to one of N_TOPICS topics, and a
#   sentence mostly stays in its topic, so earlier words predict later ones.
# Within each class word frequencies follow Zipf's law, as in real text.

N_TOPICS = 16
# Words per class (stems; nouns and verbs get two forms each): about 3,300 word types.
N_NOUNS, N_INTRANS, N_TRANS, N_COMP, N_ADJ, N_ADV = 1000, 150, 260, 24, 320, 80
TOPIC_CUM = list(itertools.accumulate(1.0 / (t + 2) for t in range(N_TOPICS)))

# Function words, fixed so that sentences stay readable from seed to seed.
DET_SG = ["ta", "en", "sel"]          # "a", "one", "this": singular only
DET_PL = ["ti", "mor", "sels"]        # plural only
DET_ANY = "ze"                        # "the": either number, so the noun tells
PRON_SG, PRON_PL = "hi", "tey"
PREPS = ["ob", "vin", "ul", "pra", "dal", "ter", "sim", "ak", "fen", "gor", "ins", "roth"]
CONJ = ["ond", "bu", "ir"]            # "and", "but", "or": join two clauses
SUBORD = ["wen", "fo", "ifa"]         # "when", "because", "if"
REL, COMP = "ke", "sa"                # "who/which", "that"
FUNCTION_WORDS = set(DET_SG + DET_PL + PREPS + CONJ + SUBORD + [DET_ANY, PRON_SG, PRON_PL, REL, COMP])

# Words are consonant-vowel syllables with an optional final consonant: "drobel", "kamo", "spirun".
ONSETS = "b d f g k l m n p r t v z b d g k m n p r t br dr gr kl pl st tr sk fl sp ch sh th".split()
VOWELS = "a e i o u a e i o u a o ai ou".split()
CODAS = ["", "", "", "n", "l", "r", "m", "k", "nd", "rt"]


class _Class:
    """The words of one class, split into topics, with Zipf weights inside each topic."""

    def __init__(self, words: list, zipf_a: float = 1.0, n_topics: int = N_TOPICS):
        # Word i belongs to topic i % n_topics; inside a topic the k-th word has weight 1/(k+1.5)^a.
        self.topic_words = [words[t::n_topics] for t in range(n_topics)]
        self.topic_cum = [list(itertools.accumulate(1.0 / (k + 1.5) ** zipf_a for k in range(len(ws))))
                          for ws in self.topic_words]

    def pick(self, rng: random.Random, topic: int | None = None):
        if topic is None:  # off topic: any topic, uniformly
            topic = rng.randrange(len(self.topic_words))
        words, cum = self.topic_words[topic], self.topic_cum[topic]
        return words[bisect.bisect(cum, rng.random() * cum[-1])]


class _Language:
    def __init__(self, seed: int):
        rng = random.Random(f"lexicon-{seed}")
        taken = set(FUNCTION_WORDS)

        def stems(n, syllables):
            out = []
            while len(out) < n:
                k = rng.choice(syllables)
                s = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(k)) + rng.choice(CODAS)
                forms = {s, s + "s", s + "li"}  # every form any class could build: keep all words distinct
                if not forms & taken:
                    taken.update(forms)
                    out.append(s)
            return out

        # No stem ends in "s" (no coda is "s"), so the suffixes below never collide.
        # A noun is (singular, plural); a verb is (singular "-s", plural bare stem).
        self.nouns = _Class([(s, s + "s") for s in stems(N_NOUNS, [2, 2, 2, 3])])
        self.intrans = _Class([(s + "s", s) for s in stems(N_INTRANS, [1, 2, 2])])
        self.trans = _Class([(s + "s", s) for s in stems(N_TRANS, [1, 2, 2])])
        self.comp = _Class([(s + "s", s) for s in stems(N_COMP, [2])])
        self.adjs = _Class(stems(N_ADJ, [2, 3]))
        self.advs = _Class([s + "li" for s in stems(N_ADV, [1, 2])])
        self.preps = _Class(PREPS, zipf_a=0.8, n_topics=1)


class _Generator:
    """One sentence per call; `depth` shrinks the odds of further nesting."""

    def __init__(self, lang: _Language, rng: random.Random):
        self.lang, self.rng = lang, rng

    def topical(self, cls: _Class, topic: int, p: float):
        return cls.pick(self.rng, topic if self.rng.random() < p else None)

    def sentence(self) -> list:
        r = self.rng
        topic = bisect.bisect(TOPIC_CUM, r.random() * TOPIC_CUM[-1])  # some topics are more common
        words = self.clause(topic, 0)
        if r.random() < 0.25:  # a fronted phrase: "pra ze kamo ..."
            words = [self.lang.preps.pick(r)] + self.noun_phrase(int(r.random() < 0.4), topic, 1) + words
        if r.random() < 0.2:
            words = [r.choice(SUBORD)] + self.clause(topic, 1) + words
        for _ in range(2):  # up to two more clauses joined by "and", "but", "or"
            if r.random() > 0.3:
                break
            words += [r.choice(CONJ)] + self.clause(topic, 1)
        return words

    def clause(self, topic: int, depth: int) -> list:
        num = 0 if self.rng.random() < 0.55 else 1  # 0 singular, 1 plural
        return self.noun_phrase(num, topic, depth, subject=True) + self.verb_phrase(num, topic, depth)

    def noun_phrase(self, num: int, topic: int, depth: int, subject=False) -> list:
        r, lang = self.rng, self.lang
        if subject and depth == 0 and r.random() < 0.08:
            return [(PRON_SG, PRON_PL)[num]]
        words = [DET_ANY if r.random() < 0.45 else r.choice((DET_SG, DET_PL)[num])]
        if r.random() < 0.45:
            words.append(self.topical(lang.adjs, topic, 0.7))
            if r.random() < 0.2:
                words.append(self.topical(lang.adjs, topic, 0.7))
        words.append(self.topical(lang.nouns, topic, 0.9)[num])
        if r.random() < 0.4 * 0.6**depth:
            words += [lang.preps.pick(r)] + self.noun_phrase(int(r.random() < 0.4), topic, depth + 1)
        if r.random() < 0.25 * 0.6**depth:
            words += self.relative(num, topic, depth + 1)
        return words

    def relative(self, num: int, topic: int, depth: int) -> list:
        r = self.rng
        if r.random() < 0.6:  # subject relative: "ke" + a verb phrase agreeing with the head noun
            return [REL] + self.verb_phrase(num, topic, depth)
        # Object relative: the inner verb agrees with the inner subject, and the object is the gap.
        inner = 0 if r.random() < 0.55 else 1
        return [REL] + self.noun_phrase(inner, topic, depth + 1) + [self.topical(self.lang.trans, topic, 0.9)[inner]]

    def verb_phrase(self, num: int, topic: int, depth: int) -> list:
        r, lang = self.rng, self.lang
        words = [lang.advs.pick(r)] if r.random() < 0.12 else []
        u = r.random()
        if u < 0.33:
            words.append(self.topical(lang.intrans, topic, 0.9)[num])
            if r.random() < 0.6 * 0.6**depth:
                words += [lang.preps.pick(r)] + self.noun_phrase(int(r.random() < 0.4), topic, depth + 1)
        elif u < 0.88 or depth >= 2:
            words.append(self.topical(lang.trans, topic, 0.9)[num])
            words += self.noun_phrase(int(r.random() < 0.45), topic, depth + 1)
            if r.random() < 0.3 * 0.6**depth:
                words += [lang.preps.pick(r)] + self.noun_phrase(int(r.random() < 0.4), topic, depth + 1)
        else:
            sub_topic = topic if r.random() < 0.7 else r.randrange(N_TOPICS)
            words += [self.topical(lang.comp, topic, 0.9)[num], COMP] + self.clause(sub_topic, depth + 1)
        if r.random() < 0.08:
            words.append(lang.advs.pick(r))
        return words


def generate(seed: int = 0, n_train: int = 9500, n_valid: int = 950, n_test: int = 950) -> dict:
    """Return {"train"|"valid"|"test": list of sentences (lists of words, no <eos>)}; counts are sentences.

    The lexicon and each split have their own RNG stream, so changing n_train leaves valid and test alone.
    """
    lang = _Language(seed)
    out = {}
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
        gen = _Generator(lang, random.Random(f"{split}-{seed}"))
        out[split] = [gen.sentence() for _ in range(n)]
    return out


def files(dirpath) -> list[Path]:
    """The files `write` writes into dirpath."""
    return [Path(dirpath) / f"ptb.{split}.txt" for split in ("train", "valid", "test")]


def write(dirpath, seed: int = 0) -> Path:
    """Write the corpus as ptb.train.txt, ptb.valid.txt, ptb.test.txt (PTB format) into dirpath."""
    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    splits = generate(seed)
    for path in files(dirpath):
        text = "".join(" ".join(words) + "\n" for words in splits[path.name.split(".")[1]])
        path.write_bytes(text.encode("utf-8"))
    return dirpath
