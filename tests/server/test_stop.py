"""Stop strings across token boundaries: held back while they might begin, never emitted."""
from server.stop import StopMatcher


def feed(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = "".join(m.push(p) for p in pieces)
    return out + m.flush(), m.stopped


def test_stop_string_split_over_tokens_is_cut_before_it():
    assert feed(["</end>"], ["Hello </", "en", "d> more"]) == ("Hello ", True)


def test_partial_match_that_fails_is_released():
    assert feed(["STOP"], ["a ST", "OR", "Y"]) == ("a STORY", False)


def test_text_is_held_only_while_it_may_start_a_stop_string():
    m = StopMatcher(["abc"])
    assert m.push("xxab") == "xx"
    assert m.push("x") == "abx"


def test_earliest_of_several_stop_strings_wins():
    assert feed(["world", "lo w"], ["hello world"]) == ("hel", True)


def test_held_text_is_flushed_at_the_end_and_nothing_after_a_stop():
    m = StopMatcher(["###"])
    assert m.push("done #") == "done "
    assert m.flush() == "#"
    m = StopMatcher(["x"])
    m.push("axb")
    assert m.push("more") == "" and m.flush() == ""


def test_no_stop_strings_passes_text_through():
    assert feed([], ["a", "b"]) == ("ab", False)
