"""The test SGLang server's LoRA adapters (`/load_lora_adapter`, `/unload_lora_adapter`, a
request's `lora_path`), as SGLang handles them. Read in sglang's source:

  server_args.py                  --enable-lora, --max-lora-rank, --lora-target-modules
                                  ('all' or module names), --max-loaded-loras
  entrypoints/http_server.py      /load_lora_adapter, /unload_lora_adapter: 200 with
                                  `LoRAUpdateOutput` {success, error_message,
                                  loaded_adapters}, 400 with the same body when not success
  managers/io_struct.py           LoadLoRAAdapterReqInput {lora_name, lora_path, pinned},
                                  UnloadLoRAAdapterReqInput {lora_name}; GenerateReqInput
                                  `lora_path`: one name, or one per prompt
  managers/tokenizer_communicator_mixin.py
                                  load: "LoRA is not enabled. Please set `--enable-lora` to
                                  enable LoRA." without --enable-lora; registered only once
                                  loaded; then, above --max-loaded-loras, the least recently
                                  used unpinned adapters are unloaded. unload: unregistered
                                  first (new requests naming it fail), then it waits for the
                                  requests using it to finish (`wait_for_unload`)
  lora/lora_registry.py           a name registered twice, an unknown name unloaded, a
                                  request naming an adapter not loaded: ValueError with the
                                  loaded names (`register`, `unregister`, `acquire`); a
                                  request's adapter is counted from admission to its end
  lora/lora_manager.py            `validate_new_adapter`: an adapter of a rank above
                                  --max-lora-rank or on modules outside --lora-target-modules
                                  is refused ("... is incompatible with the current LoRA
                                  memory pool configuration ...")

Deviations, on purpose: adapters are read (config, safetensors header) but do not change
generation with the real engine: with `--enable-lora` the server must run `--stub`, whose
token ids then hash the adapter's files, so a test sees which adapter each sample used
(`/_test/record` gives its name). A request naming an adapter on a server without
`--enable-lora` is refused too (not checked against SGLang's source).
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import threading
from typing import Dict, List, Optional

from pipelinerl_jax.testing.sglang_faults import Status

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class LoRARequestError(Exception):
    """A request naming adapters it may not use (answered 400, as SGLang's ValueError)."""


class AdapterRegistry:
    """Loaded adapters in LRU order, with the requests using each. Thread-safe."""

    def __init__(self, enabled: bool, max_rank: Optional[int], targets, max_loaded: Optional[int]):
        self.enabled, self.max_rank, self.max_loaded = enabled, max_rank, max_loaded
        targets = list(targets or ())
        self.targets = set(ALL_TARGETS) if "all" in targets else set(targets)
        self.cv = threading.Condition()
        self.loaded: "collections.OrderedDict[str, dict]" = collections.OrderedDict()
        self.in_use: collections.Counter = collections.Counter()
        self.counts: collections.Counter = collections.Counter()

    def server_args(self) -> dict:
        """What `/get_server_info` reports of the LoRA server args."""
        return {"enable_lora": self.enabled, "max_lora_rank": self.max_rank,
                "lora_target_modules": sorted(self.targets) or None,
                "max_loaded_loras": self.max_loaded}

    def _answer(self, ok: bool, message: Optional[str] = None):
        body = {"success": ok, "error_message": message,
                "loaded_adapters": {n: a["path"] for n, a in self.loaded.items()} if ok
                else None}
        return body if ok else Status(400, body)

    def load(self, body: dict):
        with self.cv:
            self.counts["load_lora_adapter"] += 1
        if not self.enabled:
            return self._answer(False, NOT_ENABLED)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return Status(422, {"detail": "lora_name and lora_path: field required"})
        try:
            adapter = _read_adapter(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            return self._answer(False, f"{type(e).__name__}: {e}")
        with self.cv:
            if name in self.loaded:
                return self._answer(False, f"Failed to load LoRA adapter {name} because it is "
                                           "already loaded")
            if (self.max_rank is not None and adapter["r"] > self.max_rank) or \
                    not set(adapter["targets"]) <= self.targets:
                return self._answer(False, f"LoRA adapter {name} with rank {adapter['r']} is "
                                           "incompatible with the current LoRA memory pool "
                                           "configuration. Please ensure that the LoRA "
                                           "adapter's rank is within the configured "
                                           "`--max-lora-rank` and that the target modules are "
                                           "included in `--lora-target-modules`.")
            self.loaded[name] = dict(adapter, path=path, pinned=bool(body.get("pinned")))
            while self.max_loaded is not None and len(self.loaded) > self.max_loaded:
                lru = next((n for n, a in self.loaded.items() if not a["pinned"]), None)
                if lru is None:
                    return self._answer(False, "Didn't find any LoRA adapters when trying to "
                                               "evict LRU LoRA adapter.")
                self._unload_locked(lru)
                self.counts["evicted"] += 1
            return self._answer(True)

    def unload(self, body: dict):
        with self.cv:
            self.counts["unload_lora_adapter"] += 1
            if not self.enabled:
                return self._answer(False, NOT_ENABLED)
            name = body.get("lora_name")
            if name not in self.loaded:
                return self._answer(False, f"LoRA with name {name} does not exist. Loaded "
                                           f"LoRAs: {list(self.loaded)}")
            self._unload_locked(name)
            return self._answer(True)

    def _unload_locked(self, name: str) -> None:  # holds cv
        del self.loaded[name]  # new requests naming it fail from now on
        self.cv.wait_for(lambda: self.in_use[name] == 0)  # wait_for_unload
        self.in_use.pop(name, None)

    def acquire(self, names: List[Optional[str]]) -> List[Optional[dict]]:
        """Admits requests naming `names` (None: the base): counts them in use and returns
        their adapters; raises `LoRARequestError` naming what is not loaded."""
        wanted = {n for n in names if n is not None}
        if not wanted:
            return [None] * len(names)
        with self.cv:
            if not self.enabled:
                raise LoRARequestError(NOT_ENABLED)
            missing = wanted - set(self.loaded)
            if missing:
                raise LoRARequestError(f"The following requested LoRA adapters are not loaded: "
                                       f"{missing}\nLoaded adapters: {set(self.loaded)}.")
            for n in names:
                if n is not None:
                    self.in_use[n] += 1
                    self.loaded.move_to_end(n)
            return [None if n is None else dict(self.loaded[n], name=n) for n in names]

    def release(self, names: List[Optional[str]]) -> None:
        with self.cv:
            for n in names:
                if n is not None:
                    self.in_use[n] -= 1
            self.cv.notify_all()


def request_adapters(body: dict, num_prompts: int) -> List[Optional[str]]:
    """A /generate body's `lora_path`, one entry per prompt (GenerateReqInput: a single name
    applies to every prompt; a list has one per prompt)."""
    lp = body.get("lora_path")
    if lp is None or isinstance(lp, str):
        return [lp] * num_prompts
    if not isinstance(lp, list) or len(lp) != num_prompts:
        raise LoRARequestError(f"lora_path must be a name or one per prompt ({num_prompts}), "
                               f"got {lp!r:.80}")
    return list(lp)


def _read_adapter(path: str) -> Dict:
    """r, target modules and a digest of a PEFT adapter directory (what SGLang's LoRAConfig
    reads, and the weights file it loads)."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    weights = os.path.join(path, "adapter_model.safetensors")
    from pipelinerl_jax.models.hf_io import read_safetensors_header
    read_safetensors_header(weights)  # a missing or corrupt file is refused here
    digest = hashlib.sha256()
    for fn in (os.path.join(path, "adapter_config.json"), weights):
        with open(fn, "rb") as f:
            digest.update(f.read())
    targets = config["target_modules"]
    return {"r": int(config["r"]), "targets": [targets] if isinstance(targets, str)
            else list(targets), "digest": digest.hexdigest()[:16]}
