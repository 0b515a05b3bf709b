"""Incremental detokenization: valid UTF-8 at every step, stop strings held back."""

from engine import SamplingParams
from engine.detokenizer import IncrementalDetokenizer


def stream(tokenizer, ids, stop=(), include=False):
    detok = IncrementalDetokenizer(tokenizer, [1], list(stop), include, True)
    pieces = []
    for t in ids:
        detok.update(t, check_stop=True)
        pieces.append(detok.output_text(finished=False))
        if detok.stop_string:
            break
    return detok, pieces


def test_emoji_and_cjk_never_split(llm):
    tok = llm.tokenizer
    text = " Hello 😀🎉 世界, ça va? 🇫🇷"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    detok, pieces = stream(tok, ids)
    for a, b in zip(pieces, pieces[1:]):
        assert "\ufffd" not in a and b.startswith(a)
    assert detok.output_text(finished=True) == text


def test_stop_string_is_held_back_then_cut(llm):
    tok = llm.tokenizer
    ids = tok.encode(" one two three four", add_special_tokens=False)
    detok, pieces = stream(tok, ids, stop=["three"])
    assert detok.stop_string == "three"
    assert detok.output_text(finished=True) == " one two "
    assert all(not p.endswith(" thr") for p in pieces)
    assert all("three" not in p for p in pieces)


def test_emoji_stream_from_the_model(llm):
    engine = llm.engine
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reply with three emojis that show happiness."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    engine.add_request(
        "emoji", llm.tokenizer.encode(prompt, add_special_tokens=False), SamplingParams(temperature=0, max_tokens=12)
    )
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out.outputs[0].text)
    assert any(ord(ch) > 0x1F000 for ch in seen[-1])  # an emoji came out
    for a, b in zip(seen, seen[1:]):
        assert "\ufffd" not in b and b.startswith(a)
