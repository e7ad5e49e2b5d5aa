"""The test SGLang server's fault switches: status and raw answers, malformed bodies, and
sglang-jax's departures from SGLang (`sglang_server.py` applies them per request; its
docstring lists the switches).
"""
from __future__ import annotations

import json
from typing import Any, List, Optional

DEFAULT_SWITCHES = dict(startup_503_s=0.0, fail_every=0, fail_status=503, corrupt_every=0,
                        abort_every=0,
                        abort_next=0, abort_after_tokens=2, delay_s=0.0, version_spans=True,
                        auto_step=True,
                        resend_logprobs_every=0, update_endpoint=True, weight_version_field=True,
                        lora_endpoints=True)


class Status:
    """A JSON answer with a non-200 status."""

    def __init__(self, status: int, body: Any):
        self.status, self.body = status, body


class Raw:
    """A 200 answer whose body is these bytes, as they are (not JSON-encoded)."""

    def __init__(self, body: bytes):
        self.body = body


CORRUPTIONS = ("not_json", "nan_logprob", "out_of_vocab", "no_meta_info")


def corrupt(outputs: List[dict], k: int) -> Any:
    """A misbehaving server's answer (switch corrupt_every), cycling through CORRUPTIONS."""
    kind = CORRUPTIONS[k % len(CORRUPTIONS)]
    if kind == "not_json":
        return Raw(json.dumps(outputs).encode()[:40])  # cut off mid-answer
    first = outputs[0]
    pairs = first["meta_info"].get("output_token_logprobs") or [[0.0, 0, None]]
    if kind == "nan_logprob":
        pairs[0][0] = float("nan")  # json.dumps writes NaN, which json.loads accepts
    elif kind == "out_of_vocab":
        first["output_ids"] = [1 << 20] + first["output_ids"][1:]
        pairs[0][1] = 1 << 20
    else:
        del first["meta_info"]
    return outputs


# ---------------------------------------------------------------- sglang-jax's gaps (switches)
# What sglang-jax 0.1.0rc0 does differently from SGLang (scripts/sglang_conformance.py), so
# that the default suite covers the engine's handling of it. resend_logprobs_every=k: every
# k-th token resends the log-probs from offset 0 (k=50 there), so an answer of c tokens
# carries the prefixes k, 2k, ... < c before its c entries; update_endpoint=false: 404 on the
# weight endpoints; weight_version_field=false: no weight_version (answers, /get_model_info)
# and no per-token spans; lora_endpoints=false: 404 on the LoRA endpoints (sglang-jax's
# http_server.py has no /load_lora_adapter: adapters only from --lora-paths at launch).
_WEIGHT_PATHS = ("/update_weights_from_disk", "/update_weight_version", "/get_weight_version")
_LORA_PATHS = ("/load_lora_adapter", "/unload_lora_adapter")


def gap_route(switches: dict, path: str) -> Optional[Status]:
    if (not switches["update_endpoint"] and path in _WEIGHT_PATHS) or (
            not switches["lora_endpoints"] and path in _LORA_PATHS):
        return Status(404, {"detail": "Not Found"})
    return None


def gap_info(info: dict, switches: dict) -> dict:
    if not switches["weight_version_field"]:
        info.pop("weight_version", None)
    return info


def gap_answer(out: dict, switches: dict) -> dict:
    meta = out["meta_info"]
    if not switches["weight_version_field"]:
        meta.pop("weight_version", None)
        meta.pop("weight_versions", None)
    k, pairs = switches["resend_logprobs_every"], meta.get("output_token_logprobs")
    if k and pairs:
        meta["output_token_logprobs"] = [p for j in range(k, len(pairs), k)
                                         for p in pairs[:j]] + pairs
    return out
