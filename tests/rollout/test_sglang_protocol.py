"""The SGLang wire format on its own: request bodies of the two forms, answer parsing
(per-token version spans, the fallback without them, KV versions by pause mode, malformed
answers), and the error messages taken from SGLang's error bodies."""
import types

import numpy as np
import pytest

from pipelinerl_jax.rollout.sglang_client import HTTPError, error_message
from pipelinerl_jax.rollout.sglang_protocol import (Job, ProtocolError, Sample, abort_rids,
                                                    answer_items, generate_body, parse_output,
                                                    version_of)
from tests.rollout.conftest import request


def job(n=1, seed=None, tokens=(), sent_version=3):
    r = request("q", [5, 6, 7], max_new_tokens=10, n=n, temperature=0.5, top_k=0,
                stop_token_ids=(2,))
    samples = [Sample(r, i, r.prompt_ids, None if seed is None else seed + i, 10, 0.0)
               for i in range(n)]
    if tokens:
        samples[0].tokens.append(np.asarray(tokens, np.int32))
    return Job(samples, "q/4", server=types.SimpleNamespace(url="http://s:1"),
               sent_version=sent_version)


def test_request_forms():
    single = generate_body(job(tokens=(9, 9)))  # a resubmitted sample: prefix, reduced budget
    assert single["input_ids"] == [5, 6, 7, 9, 9] and single["rid"] == "q/4/0"
    assert single["sampling_params"] == {"temperature": 0.5, "top_p": 1.0, "top_k": -1,
                                         "stop_token_ids": [2], "no_stop_trim": True,
                                         "max_new_tokens": 8}
    assert single["return_logprob"] is True
    batched = generate_body(job(n=3, seed=40))
    assert batched["input_ids"] == [[5, 6, 7]] * 3 and batched["rid"] == ["q/4/0", "q/4/1", "q/4/2"]
    assert [sp["sampling_seed"] for sp in batched["sampling_params"]] == [40, 41, 42]
    assert abort_rids(job(n=3, seed=40)) == batched["rid"]
    # Without seeds too: one rid per sample, never sampling_params.n (SGLang would rename the
    # children and ignore an abort of the parent rid).
    unseeded = generate_body(job(n=3))
    assert unseeded["input_ids"] == [[5, 6, 7]] * 3 and unseeded["rid"] == batched["rid"]
    assert all("n" not in sp and "sampling_seed" not in sp
               for sp in unseeded["sampling_params"])
    assert abort_rids(job(n=3)) == unseeded["rid"]


def out(tokens, logps, finish, **meta):
    return {"output_ids": tokens, "meta_info": dict(
        finish_reason=finish, output_token_logprobs=[[lp, t, None] for lp, t in zip(logps, tokens)],
        **meta)}


@pytest.mark.parametrize("mode, kv", [("retract", [3, 3, 4, 4]), ("in_place", [3, 3, 3, 3])])
def test_spans_give_per_token_versions(mode, kv):
    item = out([1, 2, 3, 4], [-0.5, -1.0, -1.5, -2.0], {"type": "length", "length": 4},
               weight_version="4", weight_versions=[{"version": "3", "start": 0, "end": 2},
                                                    {"version": "4", "start": 2, "end": 4}])
    seg = parse_output(item, job(), mode)
    assert seg["versions"].tolist() == [3, 3, 4, 4] and seg["exact"]
    assert seg["kv_versions"].tolist() == kv and seg["reason"] == "length"
    np.testing.assert_array_equal(seg["logps"], np.float32([-0.5, -1.0, -1.5, -2.0]))


def test_without_spans_the_oldest_possible_version_and_inexact():
    item = out([1, 2], [-1.0, -1.0], {"type": "stop", "matched": 2}, weight_version="5")
    seg = parse_output(item, job(sent_version=3), "retract")
    assert seg["versions"].tolist() == [3, 3] and not seg["exact"] and seg["reason"] == "stop"
    seg = parse_output(item, job(sent_version=5), "retract")
    assert seg["versions"].tolist() == [5, 5] and seg["exact"]
    assert version_of("default") == -1 and version_of(" 12 ") == 12


@pytest.mark.parametrize("item, error", [
    (out([1, 2], [-1.0], {"type": "length"}), "do not match output_ids"),
    ({"output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}}},
     "output_token_logprobs missing"),
    (out([1], [None], {"type": "length"}), "no log-prob"),
    (out([1], [-1.0], {"type": "paused"}), "unknown finish_reason"),
])
def test_malformed_answers(item, error):
    with pytest.raises(ProtocolError, match=error):
        parse_output(item, job(), "retract")
    with pytest.raises(ProtocolError, match="expected 2 outputs"):
        answer_items([item], job(n=2))


def test_abort_with_status_400_is_the_requests_fault():
    item = out([], [], {"type": "abort", "message": "prompt too long", "status_code": 400})
    with pytest.raises(HTTPError, match="HTTP 400: prompt too long"):
        parse_output(item, job(), "retract")


@pytest.mark.parametrize("body, message", [
    (b'{"error": {"message": "The input is too long."}}', "The input is too long."),
    (b'{"object": "error", "message": "field required", "type": "Bad Request", "code": 400}',
     "field required"),
    (b'{"success": false, "message": "Failed to update weights"}', "Failed to update weights"),
    (b"Internal Server Error", "Internal Server Error"),
])
def test_error_bodies(body, message):
    assert error_message(body) == message


# ------------------------------------------------------------------ what sglang-jax answers

def resent(tokens, logps, every):
    """An answer whose log-probs were resent from offset 0 at every `every`-th token, as
    sglang-jax 0.1.0rc0 does (every=50; measured with scripts/sglang_conformance.py)."""
    item = out(tokens, logps, {"type": "length", "length": len(tokens)},
               completion_tokens=len(tokens))
    pairs = item["meta_info"]["output_token_logprobs"]
    item["meta_info"]["output_token_logprobs"] = [list(p) for j in range(every, len(pairs), every)
                                                  for p in pairs[:j]] + pairs
    return item


@pytest.mark.parametrize("c, every", [(10, 4), (8, 4), (9, 1), (3, 50)])
def test_resent_logprobs_keep_the_last_completion_tokens(c, every):
    tokens, logps = [1 + i % 5 for i in range(c)], [-0.1 * (i + 1) for i in range(c)]
    item = resent(tokens, logps, every)
    seg = parse_output(item, job(), "retract", max_tokens=10)
    assert seg["tokens"].tolist() == tokens
    np.testing.assert_allclose(seg["logps"], logps, rtol=1e-6)


def test_resent_logprobs_that_are_not_a_repetition_are_refused():
    tokens, logps = [1, 2, 3, 4, 5], [-0.1, -0.2, -0.3, -0.4, -0.5]
    item = resent(tokens, logps, 2)  # lead: [p0, p1] + [p0, p1, p2, p3]
    item["meta_info"]["output_token_logprobs"][1][0] = -0.25  # one resent value differs
    with pytest.raises(ProtocolError, match=r"output_token_logprobs: 11 entries for 5 "
                                            r"completion_tokens.*not resent prefixes"):
        parse_output(item, job(), "retract")
    shifted = resent(tokens, logps, 2)
    shifted["meta_info"]["output_token_logprobs"].insert(0, [-0.9, 7, None])  # a stray entry
    with pytest.raises(ProtocolError, match="not resent prefixes"):
        parse_output(shifted, job(), "retract")
    for bad_count, error in ((None, "no meta_info.completion_tokens"),
                             (4, "completion_tokens: 4, but the answer has 5 output_ids"),
                             ("5", "completion_tokens: must be an integer")):
        item = resent(tokens, logps, 2)
        item["meta_info"]["completion_tokens"] = bad_count
        if bad_count is None:
            del item["meta_info"]["completion_tokens"]
        with pytest.raises(ProtocolError, match=error):
            parse_output(item, job(), "retract")


def test_no_weight_version_at_all_means_the_version_the_engine_installed():
    item = out([1, 2], [-1.0, -1.0], {"type": "length", "length": 2})  # no label, no spans
    seg = parse_output(item, job(sent_version=4), "retract")
    assert seg["versions"].tolist() == [4, 4] and seg["exact"]
    j = job(sent_version=4)
    j.server.version = 5  # the engine refit that server while the request ran
    seg = parse_output(item, j, "in_place")
    assert seg["versions"].tolist() == [4, 4] and not seg["exact"]
    assert seg["kv_versions"].tolist() == [4, 4]
    item["meta_info"]["weight_version"] = "default"  # an explicit non-integer label: unknown
    assert parse_output(item, job(sent_version=4), "retract")["versions"].tolist() == [-1, -1]


def test_lora_jobs_name_their_adapter_and_every_token_is_its_version():
    j = job(n=2, seed=1, sent_version=5)
    assert "lora_path" not in generate_body(j)  # no adapter: the base, as before
    j.adapter = "v5.3"
    assert generate_body(j)["lora_path"] == ["v5.3", "v5.3"]  # one per prompt
    single = job(sent_version=5)
    single.adapter = "v5.3"
    assert generate_body(single)["lora_path"] == "v5.3"
    # the server's labels name its base (and may even span versions): the adapter decides
    item = out([1, 2, 3], [-0.5, -1.0, -1.5], {"type": "stop", "matched": 3},
               weight_version="0", weight_versions=[{"version": "0", "start": 0, "end": 3}])
    seg = parse_output(item, single, "in_place", lora=True)
    assert seg["versions"].tolist() == [5, 5, 5] and seg["kv_versions"].tolist() == [5, 5, 5]
    assert seg["exact"] and seg["reason"] == "stop"
    assert parse_output(item, single, "in_place")["versions"].tolist() == [0, 0, 0]


def test_lora_error_bodies_name_the_servers_message():
    body = b'{"success": false, "error_message": "LoRA with name v1 does not exist.", ' \
           b'"loaded_adapters": null}'
    assert error_message(body) == "LoRA with name v1 does not exist."
