"""Stop strings against a naive reference: after every token, str.find of each stop over the
whole text so far (cut at the earliest hit), and, while streaming, hold back the longest tail
that is a prefix of a stop. The incremental scan must agree piece for piece, whatever the token
boundaries, and its work must not grow with the length of the text."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise.runtime.output import TextSequence
from headwise.runtime.sampling import MAX_STOP_CHARS, MAX_STOPS, SamplingParams


class TableDecoder:
    """Token id -> text piece: a decoder whose pieces the test chooses (the token boundaries)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def push(self, token: int) -> str:
        return self.pieces[token]

    def flush(self) -> str:
        return ""


def naive(pieces: list[str], stops: tuple[str, ...], max_tokens: int):
    """-> (streamed pieces, final text, finish reason, tokens used), by full rescans."""
    text, emitted, out = "", 0, []
    for n, piece in enumerate(pieces[:max_tokens], 1):
        text += piece
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            text = text[: min(hits)]
            out.append(text[emitted:])
            return out, text, "stop", n
        end = len(text)
        if n < max_tokens:
            for s in stops:
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        end = min(end, len(text) - k)
                        break
        out.append(text[emitted:end])
        emitted = max(emitted, end)
    return out, text, "length", min(len(pieces), max_tokens)


def run(pieces, stops, max_tokens):
    seq = TextSequence([1], SamplingParams(max_new_tokens=max_tokens, stop=stops), frozenset(), TableDecoder(pieces))
    out = []
    for token in range(len(pieces)):
        seq.push(token)
        out.append(seq.new_text())
        if seq.finish_reason:
            break
    return out, seq


# a small alphabet so that stops occur, overlap and straddle tokens often
text_st = st.text(alphabet="abc", min_size=0, max_size=6)
stop_st = st.text(alphabet="abc", min_size=1, max_size=5)


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(text_st, min_size=1, max_size=30),
    stops=st.lists(stop_st, min_size=0, max_size=5),
    max_tokens=st.integers(1, 40),
)
def test_matches_naive_full_rescan(pieces, stops, max_tokens):
    stops = tuple(stops)
    want_out, want_text, want_reason, want_n = naive(pieces, stops, max_tokens)
    out, seq = run(pieces, stops, max_tokens)
    finished = seq.finish_reason or "length"
    assert (seq.text, finished, len(seq.token_ids)) == (want_text, want_reason, want_n)
    assert out == want_out
    if seq.finish_reason:  # a finished sequence has streamed all of its text
        assert "".join(out) == seq.text


def test_work_per_token_does_not_grow_with_the_text():
    """16 stops of the maximum length, built so that the text keeps almost matching them
    (the worst case of a naive tail check): the comparisons of a token stay bounded by a
    constant times its new characters, at token 100 as at token 3,000."""
    stops = tuple("a" * (MAX_STOP_CHARS - 1) + chr(ord("b") + j) for j in range(MAX_STOPS))
    pieces = ["aaa", "a", "aa"] * 1000  # 2 chars a token on average, never a stop
    seq = TextSequence([1], SamplingParams(max_new_tokens=len(pieces), stop=stops), frozenset(), TableDecoder(pieces))
    per_token, streamed = [], ""
    for token in range(len(pieces)):
        before = seq.stops.compared
        seq.push(token)
        per_token.append(seq.stops.compared - before)
        streamed += seq.new_text()
        if seq.finish_reason is None:  # held back: the tail that could still become a stop
            assert len(streamed) == max(0, len(seq.text) - (MAX_STOP_CHARS - 1))
    assert seq.finish_reason == "length" and streamed == seq.text
    new_chars = sum(len(p) for p in pieces)
    # KMP: at most 2 comparisons per character per stop in total (one advance, one fall-back)
    assert sum(per_token) <= 2 * new_chars * len(stops)
    late = per_token[-300:]
    assert max(late) <= 2 * 3 * len(stops), max(late)  # a late token costs what an early one does


def test_sampling_params_bound_stops():
    SamplingParams(stop=("x" * MAX_STOP_CHARS,))
    SamplingParams(stop=tuple(str(i) for i in range(MAX_STOPS)))
    with pytest.raises(ValueError, match=f"at most {MAX_STOPS} stop strings"):
        SamplingParams(stop=tuple(str(i) for i in range(MAX_STOPS + 1)))
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_CHARS} characters"):
        SamplingParams(stop=("x" * (MAX_STOP_CHARS + 1),))
