"""The wire protocol without sockets: feed bytes, expect requests; build a
response, expect bytes."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobserver.wire.framing import (
    Request,
    RequestParser,
    Response,
    encode_response,
    escape,
    unescape,
)
from jobserver.wire.limits import MAX_BODY, MAX_HEAD, MAX_HEADERS, MAX_LINE

# Hypothesis runs each property many times; a few hundred examples find the
# framing bugs quickly and keep the whole file to a few seconds.
FAST = settings(max_examples=200, deadline=None)


def feed_all(*chunks: bytes) -> tuple[list[Request], RequestParser]:
    """Feed the chunks one by one to a fresh parser; collect every request."""
    parser = RequestParser()
    requests: list[Request] = []
    for chunk in chunks:
        requests += parser.feed(chunk)
    return requests, parser


def parse(data: bytes) -> list[Request]:
    requests, parser = feed_all(data)
    assert parser.error is None, parser.error
    return requests


def error_of(*chunks: bytes) -> str:
    _, parser = feed_all(*chunks)
    assert parser.error is not None, "expected a ProtocolError"
    return parser.error.status


# Framing.


def test_method_line_headers_and_no_body() -> None:
    [request] = parse(b"CreateJob\r\nname: hello\r\njobPriority: 500\r\n\r\n")
    assert request.method_line == "CreateJob"
    assert request.headers == {"name": "hello", "jobpriority": "500"}
    assert request.body == b""
    assert not request.invalid_utf8


def test_bare_newlines_as_netcat_sends_them() -> None:
    [request] = parse(b"GetJob\nname: a\n\n")
    assert request.method_line == "GetJob"
    assert request.headers == {"name": "a"}


def test_verb_is_the_method_line_up_to_the_first_space() -> None:
    [request] = parse(b"  CreateJob / HTTP/1.1 \n\n")
    assert request.method_line == "CreateJob / HTTP/1.1"
    assert request.verb == "CreateJob"


def test_header_names_are_case_insensitive() -> None:
    [request] = parse(b"GetJob\r\nNaMe: x\r\n\r\n")
    assert request.get("name") == request.get("NAME") == "x"
    assert request.has("Name")
    assert not request.has("data")


def test_empty_header_value_counts_as_set() -> None:
    [request] = parse(b"GetJobs\nnumResults:\n\n")
    assert request.has("numResults")
    assert request.get("numResults") == ""


def test_value_is_trimmed_of_spaces_only_and_unescaped() -> None:
    [request] = parse(b'CreateJob\ndata:   {"a":"x\\\\ny\\"z"}  \nraw:\t tab\n\n')
    assert request.get("data") == '{"a":"x\\ny"z"}'
    # Only 0x20 is trimmed from values, as in Bedrock.
    assert request.get("raw") == "\t tab"


def test_duplicate_header_last_one_wins() -> None:
    [request] = parse(b"CreateJob\nname: first\nNAME: second\n\n")
    assert request.get("name") == "second"


def test_line_without_colon_is_a_header_with_empty_value() -> None:
    [request] = parse(b"Ping\njustaname\n\n")
    assert request.headers == {"justaname": ""}


def test_continuation_line_extends_previous_value() -> None:
    [request] = parse(b"CreateJob\ndata: abc\n def\n\n")
    assert request.get("data") == "abc def"


def test_content_length_frames_the_body() -> None:
    [request] = parse(b"CreateJob\nContent-Length: 5\n\nhello")
    assert request.body == b"hello"


def test_body_may_hold_blank_lines_and_the_next_request_follows() -> None:
    first, second = parse(b"A\ncontent-length: 6\n\n\r\n\r\nxyB\n\n")
    assert first.body == b"\r\n\r\nxy"
    assert second.method_line == "B"


def test_absent_content_length_means_empty_body() -> None:
    # Unlike Bedrock, which would swallow the rest of the buffer as a body.
    first, second = parse(b"A\n\nB\n\n")
    assert (first.method_line, first.body) == ("A", b"")
    assert (second.method_line, second.body) == ("B", b"")


def test_several_requests_in_one_feed_come_out_in_order() -> None:
    data = b"".join(f"Cmd{i}\nn: {i}\n\n".encode() for i in range(20))
    assert [r.method_line for r in parse(data)] == [f"Cmd{i}" for i in range(20)]


def test_blank_lines_between_requests_are_skipped() -> None:
    assert [r.method_line for r in parse(b"\r\n\n\rA\n\n\n\r\nB\r\n\r\n")] == ["A", "B"]


def test_incomplete_request_waits_for_more_bytes() -> None:
    parser = RequestParser()
    assert parser.feed(b"GetJob\nname: a\n") == []
    assert parser.buffered > 0
    [request] = parser.feed(b"\n")
    assert request.get("name") == "a"
    assert parser.buffered == 0


def test_body_waits_until_content_length_bytes_arrive() -> None:
    parser = RequestParser()
    assert parser.feed(b"A\nContent-Length: 4\n\nab") == []
    first, second = parser.feed(b"cdB\n\n")
    assert first.body == b"abcd"
    assert second.method_line == "B"


def test_separator_split_across_reads() -> None:
    stream = b"A\r\nx: 1\r\n\r\nB\n\n"
    for cut in range(len(stream) + 1):
        requests, parser = feed_all(stream[:cut], stream[cut:])
        assert [r.method_line for r in requests] == ["A", "B"], cut
        assert parser.error is None


def test_feeding_one_byte_at_a_time() -> None:
    stream = b"\nCreateJob\r\nname: a\r\nContent-Length: 3\r\n\r\nxyzGetJob\nname: b\n\n"
    requests, _ = feed_all(*(bytes([b]) for b in stream))
    assert [(r.method_line, r.get("name"), r.body) for r in requests] == [
        ("CreateJob", "a", b"xyz"),
        ("GetJob", "b", b""),
    ]


def test_continuation_line_never_frames_a_body() -> None:
    # A folded ` Content-Length: 3` belongs to the method line, not to the
    # headers, so it must not make the parser swallow three bytes.
    first, second = parse(b"A\n Content-Length: 3\n\nabcB\n\n")
    assert first.method_line == "A Content-Length: 3"
    assert first.body == b""
    assert second.method_line == "abcB"


# Invalid UTF-8 keeps the stream in step.


def test_invalid_utf8_head_is_flagged_and_stream_stays_in_step() -> None:
    bad, good = parse(b"Get\xffJob\nname: a\n\nPing\n\n")
    assert bad.invalid_utf8
    assert good.method_line == "Ping"
    assert not good.invalid_utf8


def test_invalid_utf8_head_still_honours_content_length() -> None:
    bad, good = parse(b"A\nname: \xc3\x28\nContent-Length: 3\n\n\n\nxPing\n\n")
    assert bad.invalid_utf8
    assert bad.body == b"\n\nx"
    assert good.method_line == "Ping"


def test_body_is_bytes_and_not_decoded() -> None:
    [request] = parse(b"A\nContent-Length: 2\n\n\xff\xfe")
    assert request.body == b"\xff\xfe"
    assert not request.invalid_utf8


# Bad Content-Length.


@pytest.mark.parametrize(
    "value", [b"-1", b"abc", b"", b"1.5", b"0x10", b"+5", b"1 2", b"9" * 13]
)
def test_malformed_content_length(value: bytes) -> None:
    assert error_of(b"A\nContent-Length: " + value + b"\n\n") == "400 Malformed Content-Length"


def test_content_length_name_is_case_insensitive_and_trimmed() -> None:
    [request] = parse(b"A\ncOnTeNt-LeNgTh :\t2 \n\nhi")
    assert request.body == b"hi"


def test_last_content_length_wins_like_any_header() -> None:
    [request] = parse(b"A\nContent-Length: 9\nContent-Length: 1\n\nz")
    assert request.body == b"z"


# Limits: the error is set, and requests before it are still returned.


def test_requests_before_an_error_are_returned() -> None:
    requests, parser = feed_all(b"A\n\nB\nContent-Length: x\n\nC\n\n")
    assert [r.method_line for r in requests] == ["A"]
    assert parser.error is not None
    assert parser.error.status == "400 Malformed Content-Length"


def test_parser_stays_broken_after_an_error() -> None:
    _, parser = feed_all(b"A\nContent-Length: -1\n\n")
    assert parser.feed(b"Ping\n\n") == []
    assert parser.buffered == 0


def test_body_at_limit_and_over() -> None:
    [request] = parse(b"A\nContent-Length: %d\n\n" % MAX_BODY + b"x" * MAX_BODY)
    assert len(request.body) == MAX_BODY
    assert error_of(b"A\nContent-Length: %d\n\n" % (MAX_BODY + 1)) == "413 Body too large"


def test_header_count_at_limit_and_over() -> None:
    def head(count: int) -> bytes:
        return b"A\n" + b"".join(b"h%d: v\n" % i for i in range(count)) + b"\n"

    [request] = parse(head(MAX_HEADERS))
    assert len(request.headers) == MAX_HEADERS
    assert error_of(head(MAX_HEADERS + 1)) == "431 Too many headers"


def long_line(length: int) -> bytes:
    """A header line of exactly `length` bytes."""
    return b"x: " + b"a" * (length - 3)


def test_line_at_limit_and_over() -> None:
    [request] = parse(b"A\n" + long_line(MAX_LINE) + b"\n\n")
    assert len(request.get("x") or "") == MAX_LINE - 3
    assert error_of(b"A\n" + long_line(MAX_LINE + 1) + b"\n\n") == "414 Line too long"


def test_over_long_line_is_refused_before_the_head_ends() -> None:
    # The peer never sends the blank line; the parser must not keep buffering.
    assert error_of(b"A\n" + long_line(MAX_LINE + 1)) == "414 Line too long"


def test_line_at_limit_split_before_its_line_end() -> None:
    # The trailing CR is the line end, not part of the line.
    line = b"A\n" + long_line(MAX_LINE)
    [request] = feed_all(line + b"\r", b"\n\r\n")[0]
    assert request.method_line == "A"


def head_of_size(size: int) -> bytes:
    """A head of exactly `size` bytes, lines within MAX_LINE and few headers."""
    lines = [b"A"]
    left = size - 1
    i = 0
    while left > 0:
        # Each line costs a newline before it.
        body = min(left - 1, MAX_LINE)
        name = b"h%d: " % i
        lines.append(name + b"v" * max(0, body - len(name)))
        left -= 1 + len(lines[-1])
        i += 1
    head = b"\n".join(lines)
    assert len(head) == size
    return head


def test_head_at_limit_and_over() -> None:
    [request] = parse(head_of_size(MAX_HEAD) + b"\n\n")
    assert request.method_line == "A"
    assert error_of(head_of_size(MAX_HEAD + 1) + b"\n\n") == "413 Request too large"


def test_over_large_head_is_refused_before_it_ends() -> None:
    assert error_of(head_of_size(MAX_HEAD + 1)) == "413 Request too large"


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_head_at_limit_split_inside_the_separator(cut: int) -> None:
    # A head that fits must fit however the stream is split: the partial
    # separator at the end of a read is not part of the head.
    stream = head_of_size(MAX_HEAD) + b"\r\n\r\n"
    requests, parser = feed_all(stream[:-cut], stream[-cut:])
    assert parser.error is None
    assert [r.method_line for r in requests] == ["A"]


# Any split of the stream gives the same requests.

# Content-Length frames the body the strategy draws; Origin marks a
# browser's request, which the wire port refuses (framing._refuse_browser).
_NAME = st.text(string.ascii_letters + string.digits + "-_", min_size=1, max_size=12).filter(
    lambda n: n.lower() not in ("content-length", "origin")
)
# Values are sent escaped; unescaping restores them except for outer spaces,
# which the parser trims.
_VALUE = st.text(
    st.characters(blacklist_categories=("Cs",)), max_size=30
).filter(lambda v: v == v.strip(" "))
_METHOD = st.from_regex(r"[A-Za-z]{1,12}( /[a-z0-9]{0,6})?", fullmatch=True)
_EOL = st.sampled_from([b"\r\n", b"\n"])


@st.composite
def requests_and_bytes(draw: st.DrawFn) -> tuple[list[tuple[str, dict[str, str], bytes]], bytes]:
    """Some requests, and one way a client could write them on the wire."""
    expected = []
    stream = b""
    for _ in range(draw(st.integers(1, 4))):
        method = draw(_METHOD)
        # Names that differ only in case are one header: the last one wins,
        # as the comprehension below also keeps the last.
        headers = draw(st.dictionaries(_NAME, _VALUE, max_size=5))
        body = draw(st.binary(max_size=20))
        eol = draw(_EOL)
        lines = [method.encode()]
        lines += [f"{n}: {escape(v)}".encode() for n, v in headers.items()]
        if body or draw(st.booleans()):
            lines.append(b"Content-Length: %d" % len(body))
        stream += draw(st.sampled_from([b"", b"\n", b"\r\n"]))
        stream += eol.join(lines) + eol + eol + body
        expected.append((method, {n.lower(): v for n, v in headers.items()}, body))
    return expected, stream


def summary(requests: list[Request]) -> list[tuple[str, dict[str, str], bytes]]:
    return [
        (r.method_line, {k: v for k, v in r.headers.items() if k != "content-length"}, r.body)
        for r in requests
    ]


@FAST
@given(case=requests_and_bytes(), data=st.data())
def test_any_split_gives_the_same_requests(
    case: tuple[list[tuple[str, dict[str, str], bytes]], bytes], data: st.DataObject
) -> None:
    expected, stream = case
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    requests, parser = feed_all(*chunks)
    assert parser.error is None
    assert summary(requests) == expected
    assert parser.buffered == 0


# Streams made of the pieces a head's end is found among: where a read
# ends inside a run of blanks and line breaks must not change where the
# head ends.
_SEPARATOR_PIECES = st.lists(
    st.sampled_from([b"Ping", b"a: b", b" ", b"\t", b"\r", b"\n", b"\r\n"]), max_size=40
).map(b"".join)


@FAST
@given(stream=_SEPARATOR_PIECES, data=st.data())
def test_any_split_among_blanks_and_line_breaks_parses_alike(
    stream: bytes, data: st.DataObject
) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    whole, whole_parser = feed_all(stream)
    split, split_parser = feed_all(*chunks)
    assert split == whole
    assert (split_parser.error and split_parser.error.status) == (
        whole_parser.error and whole_parser.error.status
    )


@FAST
@given(stream=st.binary(max_size=200), data=st.data())
def test_any_split_of_arbitrary_bytes_parses_alike(stream: bytes, data: st.DataObject) -> None:
    # Whatever the bytes, the split never changes the requests or the error.
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    whole, whole_parser = feed_all(stream)
    split, split_parser = feed_all(*chunks)
    assert split == whole
    assert (split_parser.error and split_parser.error.status) == (
        whole_parser.error and whole_parser.error.status
    )


# Escaping.


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (r"a\nb", "a\nb"),
        (r"\r\t\b\f", "\r\t\b\f"),
        (r"\\", "\\"),
        (r"\"quoted\"", '"quoted"'),
        (r"\/", "/"),
        (r"\x", "x"),
        (r"\u00e9t\u00E9", "été"),
        (r"\u20ac", "€"),
        (r"\u12", "u12"),
        (r"\u12g4", "u12g4"),
        ("trailing\\", "trailing\\"),
        ("\\", "\\"),
        ("plain", "plain"),
    ],
)
def test_unescape(raw: str, value: str) -> None:
    assert unescape(raw) == value


@pytest.mark.parametrize("raw", [r"\ud800", r"\uDFFF", r"\udbff"])
def test_lone_surrogate_escape_becomes_replacement_character(raw: str) -> None:
    assert unescape(raw) == "\ufffd"


def test_surrogate_pair_escapes_are_not_paired() -> None:
    # Bedrock decodes each \uXXXX on its own; no UTF-16 pairing.
    assert unescape(r"\ud83d\ude00") == "\ufffd\ufffd"


def test_escape_keeps_a_value_on_one_line() -> None:
    assert escape("a\\b\r\n\tc") == r"a\\b\r\n\tc"


@FAST
@given(st.text(st.characters(blacklist_categories=("Cs",))))
def test_unescape_undoes_escape(value: str) -> None:
    escaped = escape(value)
    assert "\n" not in escaped and "\r" not in escaped
    assert unescape(escaped) == value


@FAST
@given(st.text(alphabet=st.sampled_from("\\unrtbf0123789abcdefABCDEFgé "), max_size=40))
def test_unescape_always_yields_encodable_text(raw: str) -> None:
    # A lone surrogate from `\uD800` could never be stored or sent as UTF-8.
    unescape(raw).encode("utf-8")


# Responses.


def test_encode_plain_response() -> None:
    assert encode_response(Response("200 OK", b'{"jobID":1}')) == (
        b'200 OK\r\nContent-Length: 11\r\n\r\n{"jobID":1}'
    )


def test_encode_empty_body_still_has_content_length() -> None:
    assert encode_response(Response("404 No job found")) == (
        b"404 No job found\r\nContent-Length: 0\r\n\r\n"
    )


def test_headers_sorted_case_insensitively_content_length_last() -> None:
    response = Response(
        "200 OK",
        b"xy",
        {"nodeName": "n", "Content-Length": "999", "commitCount": "4", "Zeta": "z", "alpha": "a"},
    )
    assert encode_response(response) == (
        b"200 OK\r\nalpha: a\r\ncommitCount: 4\r\nnodeName: n\r\nZeta: z\r\n"
        b"Content-Length: 2\r\n\r\nxy"
    )


def test_close_adds_connection_close() -> None:
    assert encode_response(Response("200 OK", headers={"zz": "1"}), close=True) == (
        b"200 OK\r\nConnection: close\r\nzz: 1\r\nContent-Length: 0\r\n\r\n"
    )


def test_header_values_are_escaped_bodies_are_not() -> None:
    response = Response("200 OK", b"a\r\nb", {"error": "line1\nline2\\"})
    assert encode_response(response) == (
        b"200 OK\r\nerror: line1\\nline2\\\\\r\nContent-Length: 4\r\n\r\na\r\nb"
    )


def test_response_code() -> None:
    assert Response("402 Missing name").code == 402


@FAST
@given(
    headers=st.dictionaries(_NAME, _VALUE, max_size=6),
    body=st.binary(max_size=40),
    close=st.booleans(),
)
def test_encoded_response_parses_back(headers: dict[str, str], body: bytes, close: bool) -> None:
    # A response has the same shape as a request, so our own parser reads
    # it back: status as method line, every header, the body.
    # The server never sets Connection itself; `close` is how it asks. An
    # `Origin` header is a browser's, which the parser refuses on purpose
    # (framing._refuse_browser): hypothesis once drew that name.
    headers = {n: v for n, v in headers.items() if n.lower() not in ("connection", "origin")}
    wire = encode_response(Response("200 OK", body, headers), close=close)
    lines = wire.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    names = [line.split(b":", 1)[0].decode() for line in lines[1:]]
    assert names[-1] == "Content-Length"
    assert names[:-1] == sorted(names[:-1], key=str.lower)
    [parsed] = parse(wire)
    assert parsed.method_line == "200 OK"
    assert parsed.body == body
    expected = {n.lower(): v for n, v in headers.items()} | {"content-length": str(len(body))}
    if close:
        expected["connection"] = "close"
    assert parsed.headers == expected
    assert parsed.wants_close == close


def test_continuation_lines_are_unescaped_like_the_first_line() -> None:
    (request,) = parse(b'CreateJobs\njobs: [{"x":"a\\\\b"},\n {"x":"a\\\\b"}]\n\n')
    assert request.get("jobs") == '[{"x":"a\\b"}, {"x":"a\\b"}]'


@pytest.mark.parametrize("blank", [b"       ", b"\t", b" \t "])
def test_a_line_of_blanks_ends_the_head(blank: bytes) -> None:
    # The Bedrock::Jobs page's sample session has such a line; pasted into
    # nc it must end the request, not continue the last header.
    data = b"CreateJob\nname: SendEmail\n" + blank + b"\nPing\n\n"
    requests = parse(data)
    assert [r.verb for r in requests] == ["CreateJob", "Ping"]
    assert requests[0].get("name") == "SendEmail"
    # Split anywhere, the same.
    for cut in range(1, len(data)):
        assert [r.verb for r in feed_all(data[:cut], data[cut:])[0]] == ["CreateJob", "Ping"]
