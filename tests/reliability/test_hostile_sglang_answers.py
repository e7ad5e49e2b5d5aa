"""Hostile SGLang servers: answers fuzzed around a valid one (fields missing, wrong types,
NaN/inf/positive log-probs, out-of-vocabulary or non-integer ids, more tokens than asked for,
bogus version spans and labels) and arbitrary JSON. Each parse either yields a segment that
satisfies every invariant the queue will check, or raises `ProtocolError` naming the field;
never another exception (the engine turns ProtocolError into a failed request, which the
rollout worker drops and counts). Bodies that are not JSON end as `HTTPError`."""
import http.server
import math
import threading
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pipelinerl_jax.rollout.sglang_client import HTTPError, ServerClient, ServerUnavailable
from pipelinerl_jax.rollout.sglang_protocol import (Job, ProtocolError, Sample, answer_items,
                                                    parse_output)
from pipelinerl_jax.records import GenerationRequest, SamplingParams

VOCAB, MAX_NEW = 64, 8
COUNTS = {"parsed": 0, "rejected": 0}


def _job(n=1):
    r = GenerationRequest("q", np.asarray([5, 6, 7], np.int32),
                          SamplingParams(max_new_tokens=MAX_NEW, n=n))
    return Job([Sample(r, i, r.prompt_ids, None, MAX_NEW, 0.0) for i in range(n)], "q/1",
               server=types.SimpleNamespace(url="http://s:1"), sent_version=3)


def _valid(c=4):
    return {"output_ids": list(range(1, c + 1)),
            "meta_info": {"id": "q/1/0", "finish_reason": {"type": "length", "length": c},
                          "weight_version": "3",
                          "weight_versions": [{"version": "3", "start": 0, "end": c}],
                          "output_token_logprobs": [[-0.5 - i, i + 1, None] for i in range(c)],
                          "prompt_tokens": 3, "completion_tokens": c}}


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=8) |
    st.floats(allow_nan=True, allow_infinity=True),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)
BAD_NUMBERS = st.sampled_from([math.nan, math.inf, -math.inf, 0.5, 1e300, True, "-1.0", None,
                               [-1.0], -1, 0, 2**31, -2**31 - 1, 3.0, VOCAB, -7])
PATHS = [("output_ids",), ("meta_info",), ("meta_info", "output_token_logprobs"),
         ("meta_info", "finish_reason"), ("meta_info", "finish_reason", "type"),
         ("meta_info", "weight_version"), ("meta_info", "weight_versions")]


def _mutate(item, draw):
    """One random edit of `item` (in place)."""
    kind = draw(st.sampled_from(["delete", "replace", "logprob", "token", "span", "extend",
                                 "truncate"]))
    meta = item.get("meta_info") if isinstance(item.get("meta_info"), dict) else {}
    pairs = meta.get("output_token_logprobs")
    if kind in ("delete", "replace"):
        path = draw(st.sampled_from(PATHS))
        node = item
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            if kind == "delete":
                node.pop(path[-1], None)
            else:
                node[path[-1]] = draw(JSON)
    elif kind in ("logprob", "token") and isinstance(pairs, list) and any(
            isinstance(p, list) and len(p) >= 2 for p in pairs):
        # only rows still shaped [logprob, token, ...]: an earlier "replace" may have left
        # `[[], None]` there, which the parser must refuse as it is (the fuzzer edits no more)
        rows = [j for j, p in enumerate(pairs) if isinstance(p, list) and len(p) >= 2]
        i = rows[draw(st.integers(0, len(rows) - 1))]
        value = draw(BAD_NUMBERS)
        pairs[i][0 if kind == "logprob" else 1] = value
        ids = item.get("output_ids")
        if kind == "token" and isinstance(ids, list) and i < len(ids) and draw(st.booleans()):
            ids[i] = value  # consistent, but still bad (an earlier edit may have cut the ids)
    elif kind == "span":
        meta["weight_versions"] = draw(st.lists(st.fixed_dictionaries(
            {"version": st.one_of(BAD_NUMBERS, st.sampled_from(["3", "default", "-4", "x"])),
             "start": st.one_of(st.integers(-3, 12), BAD_NUMBERS),
             "end": st.one_of(st.integers(-3, 12), BAD_NUMBERS)}), max_size=3))
    elif kind == "extend" and isinstance(pairs, list):  # more tokens than asked for
        extra = draw(st.integers(1, 20))
        pairs.extend([[-1.0, 1, None]] * extra)
        if isinstance(item.get("output_ids"), list):
            item["output_ids"].extend([1] * extra)
    elif kind == "truncate" and isinstance(pairs, list) and pairs:
        del pairs[-1]


def _check_segment(seg):
    c = len(seg["tokens"])
    assert 0 <= c <= MAX_NEW
    assert seg["tokens"].dtype == np.int32 and ((seg["tokens"] >= 0) & (seg["tokens"] < VOCAB)).all()
    assert seg["logps"].shape == (c,) and np.isfinite(seg["logps"]).all()
    assert (seg["logps"] <= 0).all()
    for key in ("versions", "kv_versions"):
        assert seg[key].shape == (c,) and seg[key].dtype == np.int32 and (seg[key] >= -1).all()
    assert (seg["kv_versions"] <= seg["versions"]).all()
    assert seg["reason"] in ("stop", "length", "abort")


def _parse(item, pause_mode="retract"):
    try:
        seg = parse_output(item, _job(), pause_mode, vocab_size=VOCAB, max_tokens=MAX_NEW)
    except ProtocolError as e:
        assert str(e), "a rejection must say why"
        COUNTS["rejected"] += 1
        return None
    except HTTPError as e:  # an abort the server blames on the request (status 400)
        assert e.status == 400
        COUNTS["rejected"] += 1
        return None
    _check_segment(seg)
    COUNTS["parsed"] += 1
    return seg


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.integers(0, MAX_NEW), st.integers(0, 3),
       st.sampled_from(["retract", "in_place", "abort"]))
def test_fuzzed_answers_parse_to_valid_segments_or_are_refused(data, c, edits, pause_mode):
    item = _valid(c)
    for _ in range(edits):
        _mutate(item, data.draw)
    seg = _parse(item, pause_mode)
    if edits == 0:
        assert seg is not None and seg["tokens"].tolist() == list(range(1, c + 1))


@settings(max_examples=150, deadline=None)
@given(JSON)
def test_arbitrary_json_is_refused_with_a_protocol_error(answer):
    try:
        items = answer_items(answer, _job())
    except ProtocolError:
        COUNTS["rejected"] += 1
        return
    _parse(items[0])


@pytest.mark.parametrize("item, field", [
    ({"output_ids": [1]}, "meta_info: missing"),
    ({**_valid(2), "output_ids": "12"}, "output_ids: must be a list"),
    (_valid(2) | {"meta_info": {**_valid(2)["meta_info"],
                                "output_token_logprobs": [[0.3, 1], [-1.0, 2]]}},
     r"output_token_logprobs\[0\]: log-prob must be a finite number <= 0, got 0.3"),
    (_valid(2) | {"output_ids": [1, 64], "meta_info": {**_valid(2)["meta_info"],
                                                      "output_token_logprobs": [[-1, 1],
                                                                                [-1, 64]]}},
     r"output_ids\[1\]: token id 64 outside the vocabulary \[0, 64\)"),
    (_valid(9), "9 tokens, more than the 8 asked for"),
    (_valid(2) | {"meta_info": {**_valid(2)["meta_info"], "weight_versions": [
        {"version": "3", "start": 0, "end": 5}]}}, r"weight_versions\[0\]: span \[0, 5\)"),
    (_valid(2) | {"meta_info": {**_valid(2)["meta_info"], "weight_versions": None,
                                "weight_version": "-5"}}, "weight_version: weight version"),
])
def test_each_refusal_names_the_field(item, field):
    with pytest.raises(ProtocolError, match=field):
        parse_output(item, _job(), "retract", vocab_size=VOCAB, max_tokens=MAX_NEW)


BODIES = [b"{", b"not json", b"\xff\xfe\x00", b"[1, 2", b"<html>502 Bad Gateway</html>",
          b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [[NaN, 1]], '
          b'"finish_reason": {"type": "length"}}}', b"1e999", b"", b"null", b"[]", b'"text"']


@pytest.fixture(scope="module")
def garbage_server():
    """An HTTP server answering each POST /generate with the next body of BODIES (200)."""
    bodies = iter(BODIES)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = next(bodies)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_bodies_that_are_not_valid_answers_end_as_clear_errors(garbage_server, report):
    client = ServerClient(garbage_server, max_retries=0)
    outcomes = []
    for body in BODIES:
        try:
            answer = client.post("/generate", {"input_ids": [1]})
            items = answer_items(answer, _job())
            parse_output(items[0], _job(), "retract", vocab_size=VOCAB, max_tokens=MAX_NEW)
            outcomes.append("parsed")
        except HTTPError as e:
            assert "answer is not JSON" in str(e), e
            outcomes.append("not json")
        except ProtocolError as e:
            outcomes.append(f"protocol: {e}")
        except ServerUnavailable as e:  # pragma: no cover - would be a client bug
            pytest.fail(f"{body!r}: {e}")
    assert "parsed" not in outcomes
    assert outcomes.count("not json") >= 5
    assert any("log-prob must be a finite number" in o for o in outcomes)  # JSON NaN
    report(f"[fuzz] SGLang answers: {COUNTS['parsed'] + COUNTS['rejected'] + len(BODIES)} "
           f"cases ({COUNTS['parsed']} parsed to valid segments, {COUNTS['rejected']} refused "
           f"with ProtocolError, {len(BODIES)} raw bodies)")
