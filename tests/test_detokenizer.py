"""kernels.serving.detokenizer: incremental UTF-8 decoding with stop strings, against a brute-force
definition on random byte streams (multi-byte characters, stop strings that span tokens, overlap,
or are prefixes of one another)."""
import random

import pytest

from kernels.serving.detokenizer import Detokenizer

ALPHABET = ["a", "b", "ab", "\n", "é", "☕"]          # 1-, 2- and 3-byte characters


def brute_force(tokens: list[int], stop: list[str]) -> tuple[str, bool]:
    """The answer by definition: after each token decode the whole prefix (complete characters only);
    at the first token where some stop string occurs, the text before the earliest occurrence."""
    for k in range(1, len(tokens) + 1):
        text = bytes(tokens[:k]).decode("utf-8", errors="ignore")
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return text[:min(hits)], True
    return bytes(tokens).decode("utf-8", errors="replace"), False


def run(tokens, stop):
    d = Detokenizer(stop)
    pieces, stopped = [], False
    for t in tokens:
        piece, stopped = d.push(t)
        pieces.append(piece)
        if stopped:
            break
    if not stopped:
        pieces.append(d.flush())
    return pieces, stopped


def test_random_streams_equal_the_definition():
    rng = random.Random(0)
    for case in range(2000):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 12)))
        stop = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        tokens = list(text.encode())
        pieces, stopped = run(tokens, stop)
        want, want_stopped = brute_force(tokens, stop)
        assert ("".join(pieces), stopped) == (want, want_stopped), (case, text, stop, pieces)
        sent = ""
        for p in pieces:                               # nothing of a stop string ever goes out
            sent += p
            assert not any(s in sent for s in stop), (case, text, stop, pieces)


def test_held_text_goes_out_once_it_cannot_become_a_stop():
    d = Detokenizer(["END"])
    assert [d.push(t) for t in b"xEN"] == [("x", False), ("", False), ("", False)]
    assert d.push(ord("d")) == ("ENd", False)          # "ENd" is no prefix of "END": released
    assert [d.push(t) for t in b"END"][-1] == ("", True) and d.text == "xENd"


def test_half_a_character_is_held_then_replaced_at_the_end():
    d = Detokenizer()
    assert [d.push(t) for t in "☕".encode()] == [("", False), ("", False), ("☕", False)]
    d2 = Detokenizer()
    d2.push("☕".encode()[0])
    assert d2.flush() == "\ufffd"


@pytest.mark.parametrize("stop", [[""], [3], "ab"])
def test_bad_stop_strings_are_refused(stop):
    with pytest.raises(ValueError, match="stop strings must be non-empty strings"):
        Detokenizer(stop if isinstance(stop, list) else [stop, ""])


def test_push_after_a_stop_is_an_error():
    d = Detokenizer(["a"])
    assert d.push(ord("a")) == ("", True)
    with pytest.raises(RuntimeError, match="push after a stop"):
        d.push(ord("b"))
