"""The `sglang` config section (errors name the key), the Qwen2/GSM8K SGLang config file on
local files, the launch helper's commands, and `make_sglang_engine` driven by the real
`RolloutWorker` into an in-process RolloutQueueServer (stub test server: zero-cost tokens)."""
import importlib.util
import json
import os
import sys

import numpy as np
import pytest
from flax import nnx

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.transport.weight_version import WeightVersion
from pipelinerl_jax.run_config import base_config, resolve, validate
from pipelinerl_jax.rollout.sglang_config import sglang_config, validate_sglang_config
from pipelinerl_jax.testing.sglang_process import ServerProcess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("key, value, match", [
    ("urls", "http://a:1", "sglang.urls: must be a tuple"),
    ("urls", ("https://a:1",), "sglang.urls: 'https://a:1' is not of the form http://host:port"),
    ("urls", ("http://a:1", "http://a:1"), "sglang.urls: lists a server twice"),
    ("concurrency_per_server", 0, "sglang.concurrency_per_server: must be a positive integer"),
    ("max_retries", -1, "sglang.max_retries: must be a non-negative integer"),
    ("request_timeout_s", 0.0, "sglang.request_timeout_s: must be > 0.0"),
    ("pause_mode", "drain", "sglang.pause_mode: must be one of"),
    ("on_abort", "ignore", "sglang.on_abort: must be one of"),
    ("api_key", None, "sglang.api_key: must be a string"),
])
def test_bad_values_name_the_key(key, value, match):
    cfg = sglang_config().to_dict()  # a plain dict: ConfigDict itself refuses some types
    cfg[key] = value
    with pytest.raises(ConfigError, match=match):
        validate_sglang_config(cfg)


def test_experiment_validates_the_section():
    cfg = base_config()
    validate(cfg)  # sampler.kind='jax': no server needed
    cfg.sampler.kind = "sglang"
    with pytest.raises(ConfigError, match=r"sglang\.urls: 0 server\(s\) for 1 rollout worker"):
        validate(cfg)
    cfg.sglang.urls = ("http://10.0.0.2:30000",)
    cfg.rollout.num_workers = 2
    with pytest.raises(ConfigError, match=r"sglang\.urls: 1 server\(s\) for 2"):
        validate(cfg)
    cfg.sglang.urls = ("http://10.0.0.2:30000", "http://10.0.0.2:30001")
    with pytest.raises(ConfigError, match=r"sglang\.eval_urls: held-out evaluation"):
        validate(cfg)  # the evaluator samples on servers of its own
    cfg.sglang.eval_urls = ("http://10.0.0.2:30002",)
    validate(cfg)
    cfg.sglang.typo = 1
    with pytest.raises(ConfigError, match="sglang.typo: unknown key"):
        validate(cfg)


def test_qwen2_gsm8k_config_validates_on_local_files(tmp_path, gsm8k_rows_file):
    """The real-model config with a tiny Qwen2 checkpoint, a BPE tokenizer and a JSONL file
    standing in for Qwen2.5-0.5B and GSM8K."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pipelinerl_jax.models import Decoder, save_pretrained, tiny_config
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["Question: how many beads?\nAnswer:\n#### 42"] * 5,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model_dir = str(tmp_path / "qwen")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(
        model_dir)
    save_pretrained(Decoder(tiny_config("qwen2", vocab_size=320, max_position_embeddings=1024),
                            nnx.Rngs(0)), model_dir)  # holds the config's context

    mod = load(os.path.join(ROOT, "configs", "qwen2_gsm8k_sglang.py"))
    cfg = mod.get_config("gpu8")
    with pytest.raises(ConfigError, match="model.path"):
        validate(cfg)  # the placeholder paths do not exist here
    cfg.model.path = cfg.tokenizer.path = model_dir
    cfg.task.path, cfg.task.eval_path = gsm8k_rows_file
    validate(cfg)
    assert cfg.sampler.kind == "sglang" and len(cfg.sglang.urls) == 4
    assert tuple(cfg.mesh.shape) == (1, 4, 2) and cfg.model.init == "hf"
    assert tuple(mod.get_config("gpu4").mesh.shape) == (1, 4, 1)
    with pytest.raises(ValueError, match="unknown mesh preset"):
        mod.get_config("gpu3")
    # its LoRA variant: the same run, adapters published to the servers
    lora = load(os.path.join(ROOT, "configs", "qwen2_gsm8k_sglang_lora.py")).get_config("gpu8")
    lora.model.path = lora.tokenizer.path = model_dir
    lora.task.path, lora.task.eval_path = gsm8k_rows_file
    validate(lora)
    assert lora.lora.enabled and lora.lora.rank == 16 and lora.sampler.kind == "sglang"


@pytest.fixture
def gsm8k_rows_file(tmp_path):
    """(train, test) GSM8K-format JSONL files."""
    paths = []
    for name, rows in (("train", range(20)), ("test", range(20, 25))):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"question": f"What is {i}+1?",
                                            "answer": f"#### {i + 1}"}) + "\n" for i in rows))
        paths.append(str(path))
    return tuple(paths)


def test_launch_helper_commands():
    launch = load(os.path.join(ROOT, "scripts", "launch_sglang.py"))
    args = launch.parse_args(["--model-path", "/m", "--num-servers", "2", "--gpus-per-server",
                              "2", "--gpus", "4,5,6,7", "--weight-version", "3", "--",
                              "--enable-metrics"])
    (env0, cmd0), (env1, cmd1) = launch.server_commands(args)
    assert env0 == {"CUDA_VISIBLE_DEVICES": "4,5"} and env1 == {"CUDA_VISIBLE_DEVICES": "6,7"}
    flags = dict(zip(cmd1[3::2], cmd1[4::2]))
    assert cmd1[1:3] == ["-m", "sglang.launch_server"] and "--skip-tokenizer-init" in cmd1
    assert flags["--model-path"] == "/m" and flags["--tp-size"] == "2"
    assert cmd1[cmd1.index("--port") + 1] == "30001" and cmd1[-1] == "--enable-metrics"
    assert cmd1[cmd1.index("--host") + 1] == "127.0.0.1"
    assert cmd1[cmd1.index("--weight-version") + 1] == "3"
    assert launch.urls(args) == ("http://127.0.0.1:30000", "http://127.0.0.1:30001")
    with pytest.raises(SystemExit):
        launch.server_commands(launch.parse_args(["--model-path", "/m", "--num-servers", "3",
                                                  "--gpus", "0,1"]))


@pytest.mark.slow
def test_make_sglang_engine_drives_the_rollout_worker(tmp_path):
    from pipelinerl_jax.models import Decoder, flat_params, from_pretrained, save_pretrained
    from pipelinerl_jax.models.factory import resolve_model_config
    from pipelinerl_jax.rollout.factory import make_engine
    from pipelinerl_jax.rollout.worker import RolloutWorker
    from pipelinerl_jax.tasks import get_task
    from pipelinerl_jax.tokenizer import get_tokenizer
    from pipelinerl_jax.transport import RolloutQueueClient, RolloutQueueServer
    from pipelinerl_jax.transport.versioned_dir import write_versioned_dir
    from pipelinerl_jax.transport.weight_sink import weights_dir

    server = ServerProcess(["--stub", "--port", "0", "--vocab-size", "56"])  # char vocabulary
    queue = RolloutQueueServer().start()
    client = RolloutQueueClient(queue.address)
    try:
        cfg = base_config()
        cfg.sampler.kind = "sglang"
        cfg.sglang.urls = (server.url,)
        cfg.sglang.health_deadline_s = 30.0
        cfg.task.median_length, cfg.task.p99_length, cfg.task.max_length = 4, 8, 8
        cfg.sampling.max_new_tokens = 9
        cfg.model.max_seq_len = 32
        cfg.rollout.group_size = 2
        cfg.learner.batch_groups = 2
        cfg.learner.eval_every = 0  # a worker only: no evaluator servers
        validate(cfg)
        cfg = resolve(cfg)
        workdir = str(tmp_path)
        tok = get_tokenizer(cfg.tokenizer)
        model = Decoder(resolve_model_config(cfg.model, tok.vocab_size), nnx.Rngs(0))
        v0 = write_versioned_dir(weights_dir(cfg, workdir), 0, lambda d: save_pretrained(model, d))

        engine = make_engine(cfg, "", 0, workdir)
        assert engine.engine_id == "sglang-0" and engine.version == -1
        worker = RolloutWorker(cfg, engine, get_task(cfg.task), tok, client, workdir=workdir)
        assert not worker.can_admit()  # no weights yet
        worker.on_weights(WeightVersion("full").carrying(0, path=v0))  # version 0 is in v0
        deadline = 50
        while engine.version < 0 and deadline:
            deadline -= 1
            engine.get_completions(timeout=0.1)
        assert engine.version == 0
        client.set_version(0)  # what the learner announces before it publishes version 0
        worker.run(max_groups=3, max_seconds=60)
        batch = client.get_batch(3, timeout_s=30)
        assert batch is not None and len(batch.groups()) == 3
        for r in batch.rollouts:
            assert r.engine_id == "sglang-0" and r.group_size == 2
            assert len(r.completion_ids) == 9 and (r.version == 0).all()
            assert (r.kv_version == 0).all() and np.allclose(r.logp_behaviour, -1.0)
        assert server.stats()["weight_version"] == "0"

        # Weights as arrays: written as the next version directory, then loaded by the server.
        engine.update_weights(flat_params(model), 1)
        assert engine.version == 1 and server.stats()["weight_version"] == "1"
        written = os.path.join(weights_dir(cfg, workdir), "v00000001")
        again = flat_params(from_pretrained(written))
        assert all(np.array_equal(again[k], v) for k, v in flat_params(model).items())
        engine.close()
    finally:
        client.close()
        queue.stop(0)
        server.kill()
        sys.stdout.flush()
