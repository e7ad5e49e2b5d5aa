"""The conformance checks of `SGLangEngine` against a real sglang-jax server (`sglang_jax.py`
starts it; `scripts/sglang_conformance.py` and `tests/rollout/test_sglang_real.py` run these).

Each check returns `Row`s: 'ok' (as SGLang's protocol says and the engine expects), 'gap'
(the server differs or lacks a feature; the engine copes or the gap is documented), 'FAIL' (the
engine's result is wrong), 'skip' (could not be observed this time, e.g. a request finished
before the pause reached it).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, List

import numpy as np

from pipelinerl_jax.testing.sglang_jax import CONTEXT, VOCAB, RealServer, Reference, http_call



@dataclasses.dataclass
class Row:
    name: str
    expected: str
    observed: str
    verdict: str  # ok | gap | FAIL | skip


ENGINE_CFG = dict(health_deadline_s=120.0, health_check_interval_s=1.0, max_retries=2,
                  backoff_initial_s=0.05, backoff_max_s=0.5, request_timeout_s=300.0,
                  control_timeout_s=60.0, concurrency_per_server=8)
PROMPT = np.asarray([1, 5, 6, 7, 8], np.int32)
LOGP_TOL = 2e-3  # |server log-prob - ours|, float32 on both sides


def request(rid, max_new, n=1, seed=None, temperature=1.0, stop=(), prompt=PROMPT):
    from pipelinerl_jax.records import GenerationRequest, SamplingParams
    return GenerationRequest(rid, np.asarray(prompt, np.int32), SamplingParams(
        max_new_tokens=max_new, n=n, seed=seed, temperature=temperature,
        stop_token_ids=tuple(stop)))


def collect(eng, n: int, timeout: float = 120.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += eng.get_completions(timeout=0.2)
    if len(got) < n:
        raise TimeoutError(f"{len(got)} of {n} samples finished in {timeout}s")
    return sorted(got, key=lambda c: (c.request_id, c.sample_index))


class Conformance:
    """The checks; `rows` accumulates their results, `max_logp_diff` the largest
    |behaviour log-prob - ours| seen."""

    def __init__(self, reference: Reference, log: Callable[[str], None] = print):
        self.ref, self.log = reference, log
        self.rows: List[Row] = []
        self.max_logp_diff = 0.0
        self._seq = 0

    def add(self, name, expected, observed, verdict) -> Row:
        row = Row(name, expected, observed, verdict)
        self.rows.append(row)
        self.log(f"[{verdict:>4}] {name}: {observed}")
        return row

    def run(self, name: str, fn, *args) -> None:
        """`fn(*args)`; an exception is a FAIL row naming it (the other checks go on)."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a broken check must not hide the others
            self.add(name, "(check ran)", f"{type(e).__name__}: {str(e)[:300]}", "FAIL")

    def engine(self, urls, version=0, **cfg):
        from pipelinerl_jax.rollout.sglang_engine import SGLangEngine
        return SGLangEngine(list(urls), dict(ENGINE_CFG, **cfg), vocab_size=VOCAB,
                            max_seq_len=CONTEXT, version=version)

    def rid(self, tag: str) -> str:
        self._seq += 1
        return f"{tag}-{self._seq}"

    def logp_diff(self, completions, temperature=1.0) -> float:
        """max |behaviour log-prob - ours| over `completions`; where they differ is logged."""
        worst = 0.0
        for c in completions:
            if len(c.token_ids):
                d = np.abs(self.ref.logprobs(c.prompt_ids, c.token_ids, temperature)
                           - c.logp_behaviour)
                worst = max(worst, float(d.max()))
                bad = np.nonzero(d >= LOGP_TOL)[0]
                if len(bad):
                    self.log(f"  {c.request_id}[{c.sample_index}]: {len(bad)} of "
                             f"{len(d)} log-probs differ from ours, first at {bad[:5].tolist()}")
        self.max_logp_diff = max(self.max_logp_diff, worst)
        return worst

    # ------------------------------------------------------------------ server surface

    def check_endpoints(self, url: str) -> None:
        from pipelinerl_jax.rollout.sglang_client import (REFIT_ENDPOINTS, ServerClient,
                                                          missing_endpoints)
        client = ServerClient(url)
        missing = missing_endpoints(client, REFIT_ENDPOINTS + ("/abort_request", "/flush_cache"))
        client.close()
        needed = [p for p in missing if p != "/update_weights_from_disk"]
        self.add("endpoints", "pause, update_weights_from_disk, continue, abort, flush",
                 f"missing: {', '.join(missing) or 'none'}",
                 "FAIL" if needed else "gap" if missing else "ok")
        status, info = http_call(url, "GET", "/get_model_info")
        has = isinstance(info, dict) and "weight_version" in info
        self.add("weight_version label", "/get_model_info has weight_version",
                 f"HTTP {status}, weight_version {'present' if has else 'absent'}",
                 "ok" if has else "gap")

    def check_refit_probe(self, url: str) -> None:
        from pipelinerl_jax.rollout.sglang_client import MissingEndpointError
        from pipelinerl_jax.rollout.sglang_engine import SGLangEngine
        try:
            eng = SGLangEngine([url], ENGINE_CFG, vocab_size=VOCAB, max_seq_len=CONTEXT,
                               require_refit=True)
        except MissingEndpointError as e:
            named = url in str(e) and "/update_weights_from_disk" in str(e)
            self.add("refit config fails at start-up", "MissingEndpointError naming server "
                     "and endpoint", str(e).split(" (HTTP")[0][-90:], "ok" if named else "FAIL")
            return
        eng.close()
        self.add("refit config fails at start-up", "(server has the endpoint)", "probe passed",
                 "ok")

    def check_resent_logprobs(self, url: str) -> None:
        status, a = http_call(url, "POST", "/generate", {
            "input_ids": PROMPT.tolist(), "return_logprob": True,
            "sampling_params": {"max_new_tokens": 120, "temperature": 1.0}})
        meta = a["meta_info"]
        n, c = len(meta["output_token_logprobs"]), meta["completion_tokens"]
        self.add("raw output_token_logprobs", "completion_tokens entries",
                 f"{n} entries for {c} tokens (prefixes resent at every 50th)",
                 "ok" if n == c else "gap")

    # ------------------------------------------------------------------ generation

    def check_generation(self, url: str) -> None:
        with self.engine([url]) as eng:
            seeded = eng.generate([request(self.rid("seeded"), 120, n=4, seed=11)], timeout=300)
            again = eng.generate([request(self.rid("again"), 120, n=4, seed=11)], timeout=300)
            par = eng.generate([request(self.rid("par"), 60, n=3)], timeout=300)
            cool = eng.generate([request(self.rid("t07"), 40, n=2, seed=5, temperature=0.7)],
                                timeout=300)
            greedy = eng.generate([request(self.rid("greedy"), 40, temperature=0.0)],
                                  timeout=300)[0]
            st = eng.stats()
        shapes = all(len(c.token_ids) == 120 and c.finish_reason == "length" for c in seeded)
        distinct = len({tuple(c.token_ids) for c in seeded})
        d = self.logp_diff(seeded + again + par)
        self.add("generate n=4 seeded (>50 tokens)", "4 x 120 tokens, log-probs = ours",
                 f"{len(seeded)} x {[len(c.token_ids) for c in seeded]}, {distinct} distinct, "
                 f"max |dlogp| {d:.1e}, request errors {st['request_errors']}",
                 "ok" if shapes and d < LOGP_TOL and st["request_errors"] == 0 else "FAIL")
        same = [bool(np.array_equal(a.token_ids, b.token_ids)) for a, b in zip(seeded, again)]
        self.add("seeds reproduce", "same seed -> same samples",
                 f"per sample {same} (batched copies of one prompt share a prefill)",
                 "ok" if all(same) else "gap" if same[0] else "FAIL")
        ndist = len({tuple(c.token_ids) for c in par})
        self.add("n=3 without seed", "3 different samples",
                 f"{ndist} distinct of {len(par)} (--enable-deterministic-sampling gives every "
                 "unseeded request the same default seed)" if ndist < 3 else f"{ndist} distinct",
                 "ok" if ndist == 3 else "gap")
        d07 = self.logp_diff(cool, 0.7)
        self.add("temperature 0.7 log-probs", "log softmax(logits / 0.7)", f"max |dlogp| {d07:.1e}",
                 "ok" if d07 < LOGP_TOL else "FAIL")
        arg = self.ref.logits(greedy.prompt_ids, greedy.token_ids).argmax(-1)
        dg = self.logp_diff([greedy], 1.0)
        ok = np.array_equal(arg, greedy.token_ids) and dg < LOGP_TOL
        self.add("greedy (T=0)", "our argmax; log-probs at T=1",
                 f"argmax match {np.array_equal(arg, greedy.token_ids)}, max |dlogp| {dg:.1e}",
                 "ok" if ok else "FAIL")
        self.greedy = greedy
        versions = {int(v) for c in seeded + par for v in c.version}
        self.add("token versions", "the engine's version (0) on every token",
                 f"versions {sorted(versions)}, inexact {st['inexact_provenance_samples']}",
                 "ok" if versions == {0} and not st["inexact_provenance_samples"] else "FAIL")

    def check_stress(self, url: str, rounds: int = 8) -> None:
        """Batched decoding, repeated: per round two seeded n=4 requests, the second sent a
        little later each round so that its prefill joins the first one's running decode at
        varying points; every sample must equal our log-probs and round 0's tokens."""
        first, differ, irreproducible, total = {}, 0, 0, 0
        with self.engine([url]) as eng:
            for r in range(rounds):
                for k in range(2):
                    eng.submit(request(self.rid(f"stress{k}"), 60, n=4, seed=31 + k))
                    time.sleep(0.03 * r * (k == 0))
                for c in collect(eng, 8, 300):
                    key = (c.request_id.split("-")[0], c.sample_index)
                    total += 1
                    differ += self.logp_diff([c]) >= LOGP_TOL
                    if key in first:
                        irreproducible += not np.array_equal(first[key], c.token_ids)
                    first.setdefault(key, c.token_ids)
        self.add(f"batched decode x{rounds} rounds", "every sample = our log-probs, "
                 "same seed -> same tokens",
                 f"{differ} of {total} samples differ from our log-probs, "
                 f"{irreproducible} of {total - 8} not reproduced",
                 "ok" if differ == 0 and irreproducible == 0 else "FAIL")

    def check_stop(self, url: str) -> None:
        toks = self.greedy.token_ids.tolist()
        k = next((i for i in range(3, len(toks)) if toks[i] not in toks[:i]), None)
        if k is None:
            self.add("stop token", "ends at the stop token", "no fresh token in the greedy run",
                     "skip")
            return
        with self.engine([url]) as eng:
            c = eng.generate([request(self.rid("stop"), 40, temperature=0.0, stop=(toks[k],))],
                             timeout=300)[0]
        ok = c.finish_reason == "stop" and c.token_ids.tolist() == toks[:k + 1]
        self.add("stop token", f"finish 'stop' after {k + 1} tokens, stop token kept",
                 f"finish {c.finish_reason!r}, {len(c.token_ids)} tokens", "ok" if ok else "FAIL")

    # ------------------------------------------------------------------ pause / abort

    def check_pause(self, url: str, mode: str) -> None:
        """A seeded sample paused mid-generation and resumed equals the unpaused one ('abort':
        the server aborts it, the engine resubmits prompt + tokens so far)."""
        max_new = 450
        with self.engine([url], pause_mode=mode) as eng:
            ref = eng.generate([request(self.rid("unpaused"), max_new, seed=21)], timeout=300)[0]
            eng.submit(request(self.rid(f"pause-{mode}"), max_new, seed=21))
            time.sleep(0.4)
            if mode == "abort":  # what a refit with pause_mode='abort' does on the server
                status, _ = http_call(url, "POST", "/pause_generation", {"mode": "abort"})
            else:
                eng.pause()
            time.sleep(1.5)
            early = eng.get_completions(timeout=0.0)
            flush, _ = http_call(url, "POST", "/flush_cache", {})
            if mode == "abort":
                http_call(url, "POST", "/continue_generation", {})
            else:
                eng.resume()
            out = early or collect(eng, 1, 300)
            st = eng.stats()
        c = out[0]
        d = self.logp_diff([c])
        same = np.array_equal(c.token_ids, ref.token_ids)
        extra = f", resubmitted {st['resubmitted_samples']}" if mode == "abort" else ""
        if early and early[0].finish_reason != "abort":
            self.add(f"pause {mode}", "request held, then finishes as if unpaused",
                     "finished before the pause reached it", "skip")
            return
        self.add(f"pause {mode}", "request held, then equal to the unpaused sample",
                 f"{len(c.token_ids)} tokens, equal {same}, max |dlogp| {d:.1e}, flush while "
                 f"paused -> HTTP {flush}{extra}",
                 "ok" if same and d < LOGP_TOL and c.finish_reason == "length" else "FAIL")

    def check_client_abort(self, url: str, seeded: bool) -> None:
        """engine.abort of an n=3 request: every sample must stop early."""
        form = "batched (seeded)" if seeded else "parallel (n, no seed)"
        with self.engine([url]) as eng:
            rid = self.rid("abort")
            eng.submit(request(rid, 450, n=3, seed=3 if seeded else None))
            time.sleep(0.5)
            t0 = time.monotonic()
            eng.abort(rid)
            out = collect(eng, 3, 300)
            dt = time.monotonic() - t0
        lengths = [len(c.token_ids) for c in out]
        reasons = sorted({c.finish_reason for c in out})
        stopped = all(c.finish_reason == "abort" and len(c.token_ids) < 450 for c in out)
        self.add(f"client abort n=3 {form}", "all 3 stop early ('abort')",
                 f"{reasons}, lengths {lengths}, {dt:.1f}s after abort",
                 "ok" if stopped else "FAIL")

    def check_abort_rids(self, url: str) -> None:
        """Which rids /abort_request matches: exact, prefix, parent of parallel children."""
        def run(body, abort_rid, delay=0.4):
            box = []
            t = threading.Thread(target=lambda: box.append(http_call(url, "POST", "/generate",
                                                                     body, 300)))
            t.start()
            time.sleep(delay)
            http_call(url, "POST", "/abort_request", {"rid": abort_rid, "abort_all": False})
            t.join()
            items = box[0][1]
            items = items if isinstance(items, list) else [items]
            return [(it["meta_info"]["id"], it["meta_info"]["finish_reason"]["type"])
                    for it in items]
        sp = {"max_new_tokens": 450, "temperature": 1.0}
        base = self.rid("raw")
        exact = run({"input_ids": [PROMPT.tolist()] * 2, "rid": [f"{base}/0", f"{base}/1"],
                     "sampling_params": sp, "return_logprob": True}, f"{base}/0")
        prefix = run({"input_ids": [PROMPT.tolist()] * 2, "rid": [f"{base}p/0", f"{base}p/1"],
                      "sampling_params": sp, "return_logprob": True}, f"{base}p/")
        parent = run({"input_ids": PROMPT.tolist(), "rid": f"{base}n",
                      "sampling_params": dict(sp, n=2), "return_logprob": True}, f"{base}n")
        kinds = lambda r: [k for _, k in r]
        self.add("abort by exact rid", "that request aborted", f"{kinds(exact)}",
                 "ok" if kinds(exact) == ["abort", "length"] else "gap")
        self.add("abort by rid prefix", "SGLang scheduler: prefix match",
                 f"{kinds(prefix)} (the tokenizer manager drops rids it does not hold exactly)",
                 "ok" if kinds(prefix) == ["abort", "abort"] else "gap")
        fresh = all(i != f"{base}n" and not i.startswith(f"{base}n") for i, _ in parent)
        self.add("abort parallel n=2 by parent rid", "children aborted",
                 f"{kinds(parent)}; children's meta_info.id are "
                 f"{'fresh uuids' if fresh else 'derived from the parent'}",
                 "ok" if kinds(parent) == ["abort", "abort"] else "gap")

    def check_flush(self, url: str) -> None:
        idle, _ = http_call(url, "POST", "/flush_cache", {})
        box = []
        t = threading.Thread(target=lambda: box.append(http_call(url, "POST", "/generate", {
            "input_ids": PROMPT.tolist(), "return_logprob": True,  # never mix without (crash)
            "sampling_params": {"max_new_tokens": 300}}, 300)))
        t.start()
        time.sleep(0.4)
        busy, _ = http_call(url, "POST", "/flush_cache", {})
        t.join()
        self.add("flush_cache", "200 idle; refused while requests run (as SGLang)",
                 f"idle HTTP {idle}, busy HTTP {busy}",
                 "ok" if idle == 200 and busy == 400 else "gap")

    # ------------------------------------------------------------------ two servers

    def check_reroute(self, a: RealServer, b: RealServer) -> None:
        """Kill server b mid-run: its requests finish on a; b restarted is re-admitted."""
        with self.engine([a.url, b.url]) as eng:
            rids = [self.rid("route") for _ in range(6)]
            for i, rid in enumerate(rids):
                eng.submit(request(rid, 300, n=2, seed=100 + i))
            deadline = time.monotonic() + 30
            while eng.stats()["servers"][1]["in_flight"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            on_b = eng.stats()["servers"][1]["in_flight"]
            b.kill()
            out = collect(eng, 12, 300)
            st = eng.stats()
            full = all(len(c.token_ids) == 300 and c.finish_reason == "length" for c in out)
            d = self.logp_diff(out)
            self.add("kill 1 of 2 servers mid-run", "its requests rerouted, all complete",
                     f"{on_b} samples were on it; {len(out)}/12 complete, rerouted "
                     f"{st['rerouted_requests']}, down {len(st['servers_down'])}, "
                     f"max |dlogp| {d:.1e}",
                     "ok" if full and st["rerouted_requests"] >= 1 and d < LOGP_TOL
                     else "FAIL")
            b.start()
            deadline = time.monotonic() + 60
            while b.url not in eng.health()["servers_up"] and time.monotonic() < deadline:
                time.sleep(0.5)
            back = b.url in eng.health()["servers_up"]
            before = eng.stats()["servers"][1]["requests"]
            eng.generate([request(self.rid("back"), 20, n=2, seed=i) for i in range(8)],
                         timeout=300)
            used = eng.stats()["servers"][1]["requests"] - before
        self.add("restarted server re-admitted", "back in routing, serves again",
                 f"re-admitted {back} (start-up {b.startup_s[-1]:.0f}s), {used} requests after",
                 "ok" if back and used > 0 else "FAIL")
