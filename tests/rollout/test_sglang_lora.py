"""LoRA over SGLang (docs/lora.md): the test server's `/load_lora_adapter`,
`/unload_lora_adapter` and per-request `lora_path` follow SGLang's source
(testing/sglang_lora.py cites it), and `SGLangEngine(lora=...)` publishes each version as a
PEFT directory loaded under a version-named adapter, names it in every request sent after,
keeps exact per-token provenance across in-flight updates, unloads old adapters once no
request uses them, and refuses at start-up servers that cannot take adapters (sglang-jax:
no /load_lora_adapter)."""
import json
import os
import threading
import time
import urllib.error

import pytest
from flax import nnx

from pipelinerl_jax.models import Decoder, LoRASpec, adapter_params, add_lora, tiny_config
from pipelinerl_jax.models.peft_io import write_peft_dir
from pipelinerl_jax.rollout.sglang_client import MissingEndpointError
from pipelinerl_jax.rollout.sglang_engine import SGLangEngine
from pipelinerl_jax.testing.sglang_process import ServerProcess
from pipelinerl_jax.transport.weight_version import WeightVersion
from tests.rollout.conftest import request

BASE_SHA = "0" * 64  # the servers' base (the fake servers do not check it)

pytestmark = pytest.mark.slow  # starts other processes: left out of the fast tier (pytest.ini)

VOCAB = 56
MODEL = tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_heads=4,
                    num_kv_heads=2, head_dim=8, dtype="float32", param_dtype="float32")
SPEC = LoRASpec(rank=4, alpha=8.0)
FAST = dict(health_deadline_s=60.0, backoff_initial_s=0.01, backoff_max_s=0.05)


def _adapters(seed: int, spec=SPEC):
    model = add_lora(Decoder(MODEL, nnx.Rngs(0)), spec, nnx.Rngs(seed))
    return adapter_params(model)


@pytest.fixture(scope="module")
def peft_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    out = {v: write_peft_dir(_adapters(10 + v), MODEL, SPEC, str(root / f"v{v}"))
           for v in range(3)}
    out["rank8"] = write_peft_dir(_adapters(20, LoRASpec(8, 8.0)), MODEL, LoRASpec(8, 8.0),
                                  str(root / "rank8"))
    out["lm_head"] = write_peft_dir(_adapters(21), MODEL, SPEC, str(root / "lm_head"))
    cfg_path = os.path.join(out["lm_head"], "adapter_config.json")
    cfg = json.load(open(cfg_path))
    cfg["target_modules"] = cfg["target_modules"] + ["lm_head"]
    json.dump(cfg, open(cfg_path, "w"))
    return out


@pytest.fixture(scope="module")
def server():
    p = ServerProcess(["--stub", "--port", "0", "--vocab-size", str(VOCAB), "--enable-lora",
                       "--max-lora-rank", "4", "--lora-target-modules", "all",
                       "--max-loaded-loras", "3"])
    yield p
    p.kill()


@pytest.fixture(scope="module")
def plain_server():
    p = ServerProcess(["--stub", "--port", "0", "--vocab-size", str(VOCAB)])
    yield p
    p.kill()


def _post(server, path, body):
    """(status, JSON body) of a POST, 4xx included."""
    try:
        return 200, server.call("POST", path, body)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _reset(server):
    for name in server.stats()["lora_loaded"]:
        _post(server, "/unload_lora_adapter", {"lora_name": name})
    server.configure(delay_s=0.0, lora_endpoints=True)
    server.call("POST", "/_test/reset")


def test_the_test_server_loads_and_unloads_as_sglang_does(server, plain_server, peft_dirs):
    _reset(server)
    status, body = _post(server, "/load_lora_adapter", {"lora_name": "a", "lora_path":
                                                        peft_dirs[0]})
    assert status == 200 and body["success"] and body["loaded_adapters"] == {"a": peft_dirs[0]}
    status, body = _post(server, "/load_lora_adapter", {"lora_name": "a",
                                                        "lora_path": peft_dirs[1]})
    assert status == 400 and body["success"] is False
    assert "because it is already loaded" in body["error_message"]
    for bad in ("rank8", "lm_head"):  # above --max-lora-rank / outside the target modules
        status, body = _post(server, "/load_lora_adapter", {"lora_name": bad,
                                                            "lora_path": peft_dirs[bad]})
        assert status == 400 and "incompatible with the current LoRA memory pool" in \
            body["error_message"]
    status, body = _post(server, "/load_lora_adapter", {"lora_name": "gone",
                                                        "lora_path": "/nonexistent"})
    assert status == 400 and body["success"] is False
    status, body = _post(server, "/generate", {"input_ids": [1, 2], "lora_path": "b",
                                               "sampling_params": {"max_new_tokens": 2}})
    assert status == 400 and "requested LoRA adapters are not loaded" in \
        body["error"]["message"]
    status, body = _post(server, "/unload_lora_adapter", {"lora_name": "b"})
    assert status == 400 and "LoRA with name b does not exist" in body["error_message"]
    # an adapter changes what is generated; the base is still served
    outs = {name: _post(server, "/generate", {"input_ids": [1, 2, 3], "lora_path": name,
                                              "rid": "r", "sampling_params":
                                              {"max_new_tokens": 6}})[1]["output_ids"]
            for name in ("a", None)}
    assert outs["a"] != outs[None]
    # unload waits for the requests using the adapter (wait_for_unload)
    server.configure(delay_s=1.0)
    done = {}

    def gen():
        _post(server, "/generate", {"input_ids": [1], "lora_path": "a",
                                    "sampling_params": {"max_new_tokens": 2}})
        done["gen"] = time.monotonic()
    t = threading.Thread(target=gen)
    t.start()
    time.sleep(0.4)
    t0 = time.monotonic()
    status, _ = _post(server, "/unload_lora_adapter", {"lora_name": "a"})
    waited = time.monotonic() - t0
    t.join()
    assert status == 200 and waited >= 0.3  # the request still had ~0.6 s of its 1 s delay
    server.configure(delay_s=0.0)
    # --max-loaded-loras 3: a fourth evicts the least recently used (a request counts as a use)
    for v in range(3):
        assert _post(server, "/load_lora_adapter", {"lora_name": f"m{v}",
                                                    "lora_path": peft_dirs[v]})[0] == 200
    _post(server, "/generate", {"input_ids": [1], "lora_path": "m0",
                                "sampling_params": {"max_new_tokens": 1}})
    status, body = _post(server, "/load_lora_adapter", {"lora_name": "m3",
                                                        "lora_path": peft_dirs[2]})
    assert status == 200 and sorted(body["loaded_adapters"]) == ["m0", "m2", "m3"]
    # a server without --enable-lora refuses loads and requests naming an adapter
    status, body = _post(plain_server, "/load_lora_adapter", {"lora_name": "a",
                                                              "lora_path": peft_dirs[0]})
    assert status == 400 and "--enable-lora" in body["error_message"]
    info = plain_server.call("GET", "/get_server_info")
    assert info["enable_lora"] is False
    _reset(server)


def _engine(server, tmp_path, **kw):
    return SGLangEngine([server.url], FAST, vocab_size=VOCAB, max_seq_len=64, version=-1,
                        weights_dir=str(tmp_path / "weights"), model_config=MODEL,
                        serves=WeightVersion("lora", BASE_SHA, SPEC), require_refit=True, **kw)


def test_engine_publishes_adapters_and_keeps_provenance_exact(server, peft_dirs, tmp_path):
    _reset(server)
    with _engine(server, tmp_path) as eng:
        eng.update_weights(_adapters(10), 0)  # arrays: written as a PEFT dir, then loaded
        assert os.path.isfile(tmp_path / "weights" / "v00000000" / "adapter_config.json")
        out = eng.generate([request("a", [1, 2, 3], max_new_tokens=5, n=2, seed=1),
                            request("b", [4, 5], max_new_tokens=4)], timeout=30)
        rec = {r["rid"]: r for r in server.record()}
        names = {r["lora_path"] for r in rec.values()}
        assert len(names) == 1 and next(iter(names)).startswith("v0.")
        for c in out:
            assert (c.version == 0).all() and (c.kv_version == 0).all()
        answered = sorted(r["output_ids"] for r in rec.values())
        assert sorted(c.token_ids.tolist() for c in out) == answered

        # in flight across an update: the request keeps its adapter (and version 0) to the
        # end, the next ones name version 1's, and v0's adapter is unloaded after it
        server.configure(delay_s=1.5)
        eng.submit(request("slow", [7, 8], max_new_tokens=3))
        time.sleep(0.5)
        eng.update_weights(peft_dirs[1], 1)
        loaded = server.stats()["lora_loaded"]
        assert len(loaded) == 2  # v0's still serves "slow"
        server.configure(delay_s=0.0)
        slow, deadline = [], time.monotonic() + 30
        while not slow and time.monotonic() < deadline:
            slow = eng.get_completions(timeout=1.0)
        assert [c.request_id for c in slow] == ["slow"] and (slow[0].version == 0).all()
        after = eng.generate([request("c", [1, 2], max_new_tokens=3)], timeout=30)[0]
        assert (after.version == 1).all()
        deadline = time.monotonic() + 10
        while len(server.stats()["lora_loaded"]) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        (live,) = server.stats()["lora_loaded"]
        assert live.startswith("v1.")
        record = server.record()
        assert {r["lora_path"] for r in record if r["rid"].startswith("slow")} == \
            {n for n in loaded if n.startswith("v0.")}
        assert {r["lora_path"] for r in record if r["rid"].startswith("c/")} == {live}

        # lag injection goes back to an older version: loaded again under a new name
        eng.update_weights(peft_dirs[0], 0, allow_older=True)
        assert (eng.generate([request("d", [3], max_new_tokens=2)])[0].version == 0).all()
        assert eng.stats()["servers"][0]["adapter"].startswith("v0.")
        # a load the server refuses is reported; it keeps serving its adapter
        with pytest.raises(RuntimeError, match="incompatible"):
            eng.update_weights(peft_dirs["rank8"], 2)
        assert (eng.generate([request("e", [3], max_new_tokens=2)])[0].version == 0).all()
    _reset(server)


def test_servers_that_cannot_take_adapters_are_refused_at_startup(server, plain_server,
                                                                 tmp_path):
    _reset(server)
    with pytest.raises(MissingEndpointError, match="not launched with --enable-lora"):
        _engine(plain_server, tmp_path)
    with pytest.raises(MissingEndpointError, match="--max-lora-rank 4 < lora.rank 8"):
        SGLangEngine([server.url], FAST, vocab_size=VOCAB, max_seq_len=64, version=-1,
                     serves=WeightVersion("lora", BASE_SHA, LoRASpec(8, 16.0)),
                     require_refit=True)
    server.configure(lora_endpoints=False)  # sglang-jax: no /load_lora_adapter
    try:
        with pytest.raises(MissingEndpointError) as e:
            _engine(server, tmp_path)
        assert f"{server.url} has no /load_lora_adapter" in str(e.value)
        assert "sglang-jax serves LoRA adapters only from --lora-paths" in str(e.value)
    finally:
        server.configure(lora_endpoints=True)
    _engine(server, tmp_path).close()  # a server that has them passes
