"""Tiny tokenizers for the tiny pipelines (`tiny_models`), made from a small in-memory vocabulary: a CLIP BPE
tokenizer trained on `WORDS`, and a T5 sentencepiece-style one. Nothing is downloaded."""

from __future__ import annotations

WORDS = (  # noqa: SIM905 - one readable line of words
    "a an the of and on in with photo picture painting drawing cat dog red blue "
    "green astronaut horse riding moon sky tree house car beautiful small big"
).split()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte -> printable unicode mapping."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


def _learn_bpe_merges(words: list[str], num_merges: int) -> list[tuple[str, str]]:
    """Tiny classic BPE trainer with CLIP's '</w>' end-of-word convention."""
    corpus = {tuple(w[:-1]) + (w[-1] + "</w>",): 1 for w in words}
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: dict[tuple[str, str], int] = {}
        for sym, freq in corpus.items():
            for i in range(len(sym) - 1):
                pairs[(sym[i], sym[i + 1])] = pairs.get((sym[i], sym[i + 1]), 0) + freq
        if not pairs:
            break
        best = max(sorted(pairs), key=lambda p: pairs[p])
        merges.append(best)
        new_corpus = {}
        for sym, freq in corpus.items():
            out, i = [], 0
            while i < len(sym):
                if i < len(sym) - 1 and (sym[i], sym[i + 1]) == best:
                    out.append(sym[i] + sym[i + 1])
                    i += 2
                else:
                    out.append(sym[i])
                    i += 1
            new_corpus[tuple(out)] = freq
        corpus = new_corpus
    return merges


def make_clip_tokenizer(max_length: int = 77):
    """A real CLIPTokenizer (byte-level BPE) with a ~600-entry vocab."""
    from transformers import CLIPTokenizer

    base = list(_bytes_to_unicode().values())
    vocab_list = base + [c + "</w>" for c in base]
    merges = _learn_bpe_merges(WORDS, 80)
    for a, b in merges:
        tok = a + b
        if tok not in vocab_list:
            vocab_list.append(tok)
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(vocab_list)}
    tok = CLIPTokenizer(
        vocab=vocab,
        merges=[(a, b) for a, b in merges],
        model_max_length=max_length,
    )
    return tok


def make_t5_tokenizer(max_length: int = 512):
    """A real T5Tokenizer (Unigram, sentencepiece-style) built from a vocab list."""
    from transformers import T5Tokenizer

    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -2.0) for w in WORDS]
    pieces += [("\u2581", -3.0)]
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-"
    pieces += [(c, -5.0) for c in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)
