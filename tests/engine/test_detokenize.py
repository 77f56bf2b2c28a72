import random

import pytest

from engine.generation.detokenize import IncrementalDetokenizer

TEXTS = [
    "Hello world",
    "Emoji 😀🚀 and a family 👨‍👩‍👧 and a flag 🇫🇷!",
    "日本語のテキスト, 中文文本, 한국어",
    "Café naïve résumé façade Ångström jalapeño",
    "  leading spaces and\ttabs\nand new lines\n\n",
    "مرحبا بالعالم and עברית mixed",
    "x",
]


def pieces_for(tokenizer, ids):
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(i) for i in ids]
    pieces[-1] += detok.flush()
    return pieces


@pytest.mark.parametrize("which", ["byte_tokenizer", "sp_tokenizer"])
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_concatenate_to_decode(request, which, text):
    tokenizer = request.getfixturevalue(which)
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 0
    pieces = pieces_for(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids)


@pytest.mark.parametrize("which", ["byte_tokenizer", "sp_tokenizer"])
def test_random_id_sequences_concatenate_to_decode(request, which):
    """Random ids include split multi-byte characters that never complete."""
    tokenizer = request.getfixturevalue(which)
    rng = random.Random(1234)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 25))]
        assert "".join(pieces_for(tokenizer, ids)) == tokenizer.decode(ids), ids


def test_a_split_character_is_held_until_complete(byte_tokenizer):
    # a character the tiny tokenizer has no merge for: its UTF-8 bytes arrive as separate tokens
    ids = byte_tokenizer("🦑")["input_ids"]
    assert len(ids) > 1
    pieces = pieces_for(byte_tokenizer, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "🦑"
    assert not any("\ufffd" in p for p in pieces)


def test_leading_space_of_a_word_is_kept(sp_tokenizer):
    ids = sp_tokenizer("one two three")["input_ids"]
    pieces = pieces_for(sp_tokenizer, ids)
    assert "".join(pieces) == "one two three"
    assert any(p.startswith(" ") for p in pieces[1:])


@pytest.fixture
def cleanup_tokenizer(sp_tokenizer):
    """A tokenizer whose decode deletes the space before punctuation ("one ." -> "one.")."""
    import copy

    tokenizer = copy.deepcopy(sp_tokenizer)
    tokenizer.clean_up_tokenization_spaces = True
    return tokenizer


def test_cleanup_of_spaces_before_punctuation(cleanup_tokenizer):
    ids = cleanup_tokenizer("one . two , three !")["input_ids"]
    assert cleanup_tokenizer.decode(ids) == "one. two, three!"
    assert "".join(pieces_for(cleanup_tokenizer, ids)) == "one. two, three!"


def test_random_ids_with_space_cleanup(cleanup_tokenizer):
    rng = random.Random(99)
    for _ in range(300):
        ids = [rng.randrange(len(cleanup_tokenizer)) for _ in range(rng.randrange(1, 25))]
        assert "".join(pieces_for(cleanup_tokenizer, ids)) == cleanup_tokenizer.decode(ids), ids


def test_a_tokenizer_with_its_own_decode_is_asked(byte_tokenizer):
    """The detokenizer calls the Rust tokenizer directly only where ``decode`` would hand it the
    ids unchanged; a tokenizer class with its own ``_decode`` is asked itself."""
    import copy

    tokenizer = copy.deepcopy(byte_tokenizer)
    base = type(tokenizer)

    class Shouting(base):
        def _decode(self, token_ids, **kwargs):
            return base._decode(self, token_ids, **kwargs).upper()

    tokenizer.__class__ = Shouting
    ids = tokenizer("one two three")["input_ids"]
    assert tokenizer.decode(ids) == "ONE TWO THREE"
    assert "".join(pieces_for(tokenizer, ids)) == "ONE TWO THREE"
