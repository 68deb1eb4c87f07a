#!/usr/bin/env python3
"""Compares the C tokenizer (src/policy/tokenizer.c) with the sentencepiece library on random text.

    python3 tests/tokenizer_vs_sentencepiece.py TOOL MODEL [--count N] [--seed S]

TOOL is the compiled tests/tokenize_tool.c (this script builds nothing):

    cc -std=c11 -O2 -D_GNU_SOURCE -Iinclude -Isrc tests/tokenize_tool.c \\
       src/policy/tokenizer.c src/util/error.c -lm -o build/tokenize_tool

MODEL is a sentencepiece BPE model, e.g. ../shared/fixtures/tokenizer/tok.model. Needs the PyPI
packages `sentencepiece`, `protobuf` and `numpy`.

Besides MODEL itself (N strings), the script checks variants of it that exercise what MODEL leaves
at identity (N/3 strings each): add_dummy_prefix + remove_extra_whitespaces, whitespace as suffix,
unescaped whitespace, precompiled charsmaps (nmt_nfkc and nfkc_cf, taken from tiny models trained
on the spot), UNUSED pieces (resegmentation), tied / signed-zero / NaN scores (merge order),
CONTROL pieces spelled in the text with no unk piece and a NUL piece, no byte fallback (unknown
runs -> one unk), and extra user-defined symbols that overlap each other and ordinary pieces.
The strings mix scripts, emoji (ZWJ sequences, skin tones, flags, keycaps), combining marks,
whitespace runs, digits, punctuation, underscores, control characters, special-piece look-alikes
and malformed UTF-8.
Then Pi0.5's discrete state: `tokenize_tool --bins` against numpy.digitize (openpi's binning) on
random float32 and float64 states (bin edges and their neighbours, signed zeros, infinities, NaN,
every magnitude), and `tokenize_tool --pi05` against openpi's PaligemmaTokenizer.tokenize(prompt,
state) (its code copied below) on random prompts, states and max_len, with MODEL and each variant.
Every mismatch is printed with the string and both id lists; the exit status is 1 if any.
"""
import argparse
import io
import os
import random
import subprocess
import sys
import tempfile

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as model_pb2

SPACE = "\u2581"

SCRIPTS = {
    "latin": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "latin_ext": "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿßœŒłŁđĐşŞğĞıİžŽčČ",
    "cyrillic": "абвгдеёжзийклмнопрстуфхцчшщъыьэюяАБВГДЕЁЖЗИЙКЛМНОПРСТУФХЦЧШЩЭЮЯ",
    "greek": "αβγδεζηθικλμνξοπρστυφχψωΑΒΓΔΕΖΗΘΙΚΛΜΝΞΟΠΡΣΤΥΦΧΨΩάέήίόύώ",
    "arabic": "ابتثجحخدذرزسشصضطظعغفقكلمنهويءآأؤإئة٠١٢٣٤٥٦٧٨٩",
    "hebrew": "אבגדהוזחטיךכלםמןנסעףפץצקרשת",
    "devanagari": "अआइईउऊएऐओऔकखगघचछजझटठडढणतथदधनपफबभमयरलवशषसहािीुूेैोौ्ं",
    "thai": "กขฃคฅฆงจฉชซฌญฎฏฐฑฒณดตถทธนบปผฝพฟภมยรลวศษสหฬอฮะาำิีึืุู",
    "cjk": "把杯子放进水槽机器人手臂抓取红色方块桌面上的东西打开抽屉关闭门窗",
    "kana": "あいうえおかきくけこさしすせそたちつてとアイウエオカキクケコサシスセソ",
    "hangul": "가나다라마바사아자차카타파하로봇팔컵",
    "fullwidth": "ＡＢＣａｂｃ０１２３！？（）＿　",
    "compat": "ﬁﬂﬃ①②③½¼™℃㎏㎞ⅫⅣ¹²³ｶﾞﾊﾟ",
}
COMBINING = "\u0300\u0301\u0302\u0303\u0308\u030a\u0327\u0331\u064b\u064e\u0650\u05b7\u093c\u20d7"
EMOJI = [
    "🤖", "😀", "👍", "❤", "❤️", "🍎", "🔴", "🟦", "✋", "🦾",
    "👍🏽", "👋🏿", "🧑🏻‍🔧",  # skin tones
    "👨‍👩‍👧‍👦", "👩‍❤️‍💋‍👨", "🏳️‍🌈", "🧑‍🤝‍🧑",  # ZWJ sequences
    "🇺🇸", "🇯🇵", "🇫🇷",  # flags
    "1️⃣", "#️⃣",  # keycaps
]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\x0b", "\x0c", "\u3000", "\u00a0",
          "\u2002", "\u200b", "\u200d", "\ufeff", " \t \n "]
PUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^`{|}~") + ["_", "__", "...", "?!", "—", "–", "«»", "“”", "¿", "¡"]
SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<loc0000>", "<loc0001>", "<loc00", "<loc0000",
            "<start_of_turn", "<s>", "</s>", "<unk>", "<pad>", "<0x41>", "<0xZZ>", SPACE, SPACE * 3,
            "\ufffd", "\x00", "\x01", "\x1f", "\x7f", "\ue000", "\uffff", "\U0010ffff"]
MALFORMED = [b"\x80", b"\xbf", b"\xc3", b"\xe6\x8a", b"\xf0\x9f\x98", b"\xc0\xaf", b"\xe0\x80\xaf",
             b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf5", b"\xf8\x88\x80\x80\x80",
             b"\xfe", b"\xff", b"\xc3\x28", b"\xe2\x28\xa1"]

# A small corpus for training throwaway models whose precompiled charsmaps the variants borrow.
CHARSMAP_CORPUS = ["pick up the red cup ﬁne Ｆｕｌｌ ①② Ⅻ", "the quick brown fox jumps", "ｶﾞﾊﾟ ½ ™"] * 30


def random_piece_text(rng, words):
    kind = rng.choices(
        ["word", "ascii", "digits", "script", "combining", "emoji", "space", "punct", "special",
         "malformed"],
        weights=[30, 10, 8, 20, 4, 6, 10, 8, 3, 2])[0]
    if kind == "word":
        w = rng.choice(words)
        return (w.replace(SPACE, " ") if rng.random() < 0.9 else w).encode()
    if kind == "ascii":
        return "".join(rng.choice(SCRIPTS["latin"]) for _ in range(rng.randint(1, 10))).encode()
    if kind == "digits":
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12))).encode()
    if kind == "script":
        chars = SCRIPTS[rng.choice(list(SCRIPTS))]
        return "".join(rng.choice(chars) for _ in range(rng.randint(1, 8))).encode()
    if kind == "combining":
        base = rng.choice("aeiouAEIOnсп")
        return (base + "".join(rng.choice(COMBINING) for _ in range(rng.randint(1, 3)))).encode()
    if kind == "emoji":
        return "".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 3))).encode()
    if kind == "space":
        return rng.choice(SPACES).encode()
    if kind == "punct":
        return "".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 3))).encode()
    if kind == "special":
        return rng.choice(SPECIALS).encode()
    return rng.choice(MALFORMED)


def random_text(rng, words):
    if rng.random() < 0.01:  # a long one
        n = rng.randint(100, 600)
    else:
        n = rng.randint(0, 14)
    parts = []
    for _ in range(n):
        parts.append(random_piece_text(rng, words))
        if rng.random() < 0.4:
            parts.append(b" ")
    return b"".join(parts)


def make_strings(rng, words, count, fixed):
    strings = list(fixed)
    while len(strings) < count:
        strings.append(random_text(rng, words))
    return strings[:max(count, len(fixed))]


def trained_charsmap(rule):
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CHARSMAP_CORPUS), model_writer=out, model_type="bpe",
        vocab_size=40, hard_vocab_limit=False, normalization_rule_name=rule, minloglevel=3)
    proto = model_pb2.ModelProto()
    proto.ParseFromString(out.getvalue())
    return proto.normalizer_spec.precompiled_charsmap


def variants(base, seed):
    """(name, serialized model) pairs: the model as given, then edited copies of it."""
    Piece = model_pb2.ModelProto.SentencePiece
    yield "model", base

    def edited(edit):
        proto = model_pb2.ModelProto()
        proto.ParseFromString(base)
        edit(proto)
        return proto.SerializeToString()

    def dummy_prefix(p):
        p.normalizer_spec.add_dummy_prefix = True
        p.normalizer_spec.remove_extra_whitespaces = True
    yield "add_dummy_prefix+remove_extra_whitespaces", edited(dummy_prefix)

    def suffix(p):
        dummy_prefix(p)
        p.trainer_spec.treat_whitespace_as_suffix = True
    yield "treat_whitespace_as_suffix", edited(suffix)

    def no_escape(p):
        p.normalizer_spec.add_dummy_prefix = True
        p.normalizer_spec.escape_whitespaces = False
    yield "escape_whitespaces=false", edited(no_escape)

    nfkc = trained_charsmap("nmt_nfkc")
    def charsmap_nfkc(p):
        dummy_prefix(p)
        p.normalizer_spec.name = "nmt_nfkc"
        p.normalizer_spec.precompiled_charsmap = nfkc
    yield "charsmap nmt_nfkc", edited(charsmap_nfkc)

    nfkc_cf = trained_charsmap("nfkc_cf")
    def charsmap_nfkc_cf(p):
        p.normalizer_spec.name = "nfkc_cf"
        p.normalizer_spec.precompiled_charsmap = nfkc_cf
    yield "charsmap nfkc_cf", edited(charsmap_nfkc_cf)

    def unused(p):
        rng = random.Random(seed)
        for piece in p.pieces:
            if piece.type == Piece.NORMAL and rng.random() < 0.25:
                piece.type = Piece.UNUSED
    yield "UNUSED pieces", edited(unused)

    def tied_scores(p):
        rng = random.Random(seed)
        for piece in p.pieces:
            if piece.type == Piece.NORMAL:
                piece.score = rng.choice([0.0, -0.0, -1.0, -1.0, 2.5, float("nan")])
    yield "tied, signed-zero and NaN scores", edited(tied_scores)

    def reserved_pieces(p):
        for piece in p.pieces:
            if piece.piece in ("ing", "q", SPACE + "the"):
                piece.type = Piece.CONTROL
        p.pieces[3].type = Piece.CONTROL  # no unk piece: allowed with byte_fallback
        p.pieces.add(piece="\0", type=Piece.NORMAL)  # made UNUSED and unmapped by sentencepiece
    yield "control pieces in text, no unk, NUL piece", edited(reserved_pieces)

    def no_byte_fallback(p):
        p.trainer_spec.byte_fallback = False
        for piece in p.pieces:
            if piece.type == Piece.BYTE:
                piece.type = Piece.NORMAL
    yield "byte_fallback=false", edited(no_byte_fallback)

    def user_symbols(p):
        existing = {piece.piece for piece in p.pieces}
        candidates = ["<loc00", "<loc000", "ab", "abc", SPACE * 4, SPACE * 5, "\n\n", "🤖", "a b",
                      "the", SPACE + "the", SPACE + "th", "12", "é", "<0x41>x", "ick", "up the"]
        for s in (c for c in candidates if c not in existing):
            piece = p.pieces.add()
            piece.piece = s
            piece.type = Piece.USER_DEFINED
    yield "extra user-defined symbols", edited(user_symbols)


def run_tool(tool, model_path, strings):
    stdin = "".join(s.hex() + "\n" for s in strings)
    proc = subprocess.run([tool, model_path], input=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} failed ({proc.returncode}): {proc.stderr.strip()}")
    lines = proc.stdout.split("\n")[:-1]
    if len(lines) != len(strings):
        raise RuntimeError(f"{tool} printed {len(lines)} lines for {len(strings)} strings")
    return [[int(x) for x in line.split()] for line in lines]


def check_variant(name, serialized, tool, strings, path, max_report=20):
    sp = spm.SentencePieceProcessor(model_proto=serialized)
    ours = run_tool(tool, path, strings)
    mismatches = 0
    for text, got in zip(strings, ours):
        want = sp.encode(text)
        if got == want:
            continue
        mismatches += 1
        if mismatches <= max_report:
            print(f"MISMATCH [{name}] text={text!r} ({text.decode('utf-8', 'backslashreplace')!r})")
            print(f"  sentencepiece: {want} {[sp.id_to_piece(i) for i in want]}")
            print(f"  C tokenizer:   {got} {[sp.id_to_piece(i) if 0 <= i < sp.vocab_size() else '?' for i in got]}")
    print(f"{name}: {len(strings) - mismatches}/{len(strings)} match")
    return mismatches


def openpi_tokenize(sp, max_len, prompt, state):
    """openpi's PaligemmaTokenizer.tokenize (src/openpi/models/tokenizer.py), with `sp` as its model."""
    cleaned_text = prompt.strip().replace("_", " ").replace("\n", " ")
    if state is not None:
        discretized_state = np.digitize(state, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
        state_str = " ".join(map(str, discretized_state))
        full_prompt = f"Task: {cleaned_text}, State: {state_str};\nAction: "
        tokens = sp.encode(full_prompt, add_bos=True)
    else:
        tokens = sp.encode(cleaned_text, add_bos=True) + sp.encode("\n")
    tokens_len = len(tokens)
    if tokens_len < max_len:
        padding = [False] * (max_len - tokens_len)
        mask = [True] * tokens_len + padding
        tokens = tokens + padding
    else:
        tokens = tokens[:max_len]
        mask = [True] * max_len
    return np.asarray(tokens), np.asarray(mask)


def random_state(rng, dtype):
    """A state vector of `dtype` mixing plain values, bin edges, their neighbours and specials."""
    edges = np.linspace(-1, 1, 257).astype(dtype)
    values = []
    for _ in range(rng.randint(0, 40)):
        kind = rng.random()
        if kind < 0.3:
            values.append(dtype(rng.uniform(-1.3, 1.3)))
        elif kind < 0.7:  # an edge or one of its nearest neighbours in this dtype
            edge = edges[rng.randrange(257)]
            values.append(np.nextafter(edge, dtype(rng.choice([-np.inf, 0, np.inf])), dtype=dtype))
        elif kind < 0.85:
            values.append(dtype(rng.choice([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45,
                                            1e30, -1e30, np.finfo(dtype).max, -np.finfo(dtype).max])))
        else:  # any bit pattern
            bits = rng.getrandbits(8 * np.dtype(dtype).itemsize)
            values.append(np.array([bits], dtype=f"u{np.dtype(dtype).itemsize}").view(dtype)[0])
    return np.array(values, dtype=dtype)


def state_hex(state):
    """The state's values as little-endian float64s, which is what the C API takes (exact for
    float32: numpy compares a float32 state with the float64 edges in float64 too)."""
    with np.errstate(invalid="ignore"):  # signaling NaNs among the random bit patterns
        return state.astype("<f8").tobytes().hex()


def check_state_bins(tool, rng, count, max_report=20):
    states = [random_state(rng, np.float32 if i % 2 else np.float64) for i in range(count)]
    proc = subprocess.run([tool, "--bins"], input="".join(state_hex(s) + "\n" for s in states),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} --bins failed ({proc.returncode}): {proc.stderr.strip()}")
    lines = proc.stdout.split("\n")[:-1]
    total = bad = 0
    edges = np.linspace(-1, 1, 256 + 1)[:-1]
    for state, line in zip(states, lines, strict=True):
        with np.errstate(invalid="ignore"):
            want = np.digitize(state, bins=edges) - 1  # openpi's binning, on the state's own dtype
        got = [int(x) for x in line.split()]
        total += len(state)
        for x, w, g in zip(state, want, got, strict=True):
            if w != g:
                bad += 1
                if bad <= max_report:
                    print(f"MISMATCH [state bin] {state.dtype} {x!r}: numpy {w}, C {g}")
    print(f"state bins: {total - bad}/{total} values match numpy.digitize")
    return total, bad


def check_pi05_prompts(name, tool, model_path, serialized, words, rng, count, max_report=20):
    """Pi0.5 prompts, a third of them long (the C tokenizer then encodes only as far as max_len
    needs, in chunks: this checks that the ids kept are still the ones of encoding it all)."""
    sp = spm.SentencePieceProcessor(model_proto=serialized)
    fixed = ["pick up the fork", "  open_the drawer\n", "", "Put 3 cups\nin the sink!"]
    cases = []
    for i in range(count):
        if i < len(fixed):
            text = fixed[i]
        elif i % 3 == 0:
            text = b" ".join(random_text(rng, words) for _ in range(rng.randint(5, 60)))
        else:
            text = random_text(rng, words)
        # openpi takes a str: valid UTF-8 only, and the C API's NUL-terminated string has no NUL
        prompt = text.decode("utf-8", "replace").replace("\0", " ") if isinstance(text, bytes) else text
        cases.append((prompt, random_state(rng, rng.choice([np.float32, np.float64]))))
    bad = 0
    for max_len in (1, 24, 200, rng.randint(2, 300)):
        stdin = "".join(p.encode().hex() + " " + state_hex(s) + "\n" for p, s in cases)
        proc = subprocess.run([tool, "--pi05", model_path, str(max_len)], input=stdin,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{tool} --pi05 failed ({proc.returncode}): {proc.stderr.strip()}")
        for (prompt, state), line in zip(cases, proc.stdout.split("\n")[:-1], strict=True):
            valid, *got = (int(x) for x in line.split())
            with np.errstate(invalid="ignore"):
                tokens, mask = openpi_tokenize(sp, max_len, prompt, state)
            if got == tokens.tolist() and valid == int(mask.sum()):
                continue
            bad += 1
            if bad <= max_report:
                print(f"MISMATCH [{name}, Pi0.5, max_len {max_len}] prompt={prompt!r} state={state!r}")
                print(f"  openpi: {tokens.tolist()} ({int(mask.sum())} valid)")
                print(f"  C:      {got} ({valid} valid)")
    total = 4 * len(cases)
    print(f"{name}: {total - bad}/{total} Pi0.5 prompts match openpi's PaligemmaTokenizer.tokenize")
    return total, bad


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tool", help="compiled tests/tokenize_tool.c")
    parser.add_argument("model", help="sentencepiece BPE .model file")
    parser.add_argument("--count", type=int, default=6000, help="strings for the model itself")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    with open(args.model, "rb") as f:
        base = f.read()
    proto = model_pb2.ModelProto()
    proto.ParseFromString(base)
    words = [p.piece for p in proto.pieces if p.type == model_pb2.ModelProto.SentencePiece.NORMAL]
    fixed = [b"", b" ", b"  ", b"\n", b"a", b"pick up the fork", b"  leading and trailing  ",
             "<start_of_turn>user pick_up<end_of_turn>\n".encode()]

    total = mismatches = prompts_total = prompts_bad = 0
    with tempfile.TemporaryDirectory() as tmpdir:
        for i, (name, serialized) in enumerate(variants(base, args.seed)):
            count = args.count if i == 0 else max(args.count // 3, 1)
            strings = make_strings(random.Random(args.seed + i), words, count, fixed)
            path = os.path.join(tmpdir, "variant.model")
            with open(path, "wb") as f:
                f.write(serialized)
            mismatches += check_variant(name, serialized, args.tool, strings, path)
            total += len(strings)
            n, bad = check_pi05_prompts(name, args.tool, path, serialized, words,
                                        random.Random(args.seed + i), max(count // 20, 1))
            prompts_total += n
            prompts_bad += bad
    bins_total, bins_bad = check_state_bins(args.tool, random.Random(args.seed), max(args.count, 1))
    print(f"{total - mismatches}/{total} strings match sentencepiece {spm.__version__}, "
          f"{bins_total - bins_bad}/{bins_total} state values bin as numpy {np.__version__} digitize, "
          f"{prompts_total - prompts_bad}/{prompts_total} Pi0.5 prompts match openpi's")
    return 1 if mismatches or bins_bad or prompts_bad else 0


if __name__ == "__main__":
    sys.exit(main())
