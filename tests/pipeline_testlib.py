"""Helpers for end-to-end tests that run the real entry point (real processes, real gRPC)."""
import json
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A pipeline small enough for CI: a tiny random model, short answers, a few steps.
TINY_FLAGS = (
    "--config.task.median_length=3", "--config.task.p99_length=6", "--config.task.max_length=8",
    "--config.sampling.max_new_tokens=9", "--config.model.max_seq_len=32",
    "--config.engine.max_slots=8",
    "--config.learner.batch_groups=2", "--config.rollout.group_size=2",
    "--config.learner.eval_size=4", "--config.resources.learner_cores=",
    "--config.resources.sampler_cores=",
)


def make_init_checkpoint(path: str, seed: int = 0) -> str:
    """A random tiny model saved in HF format (stands in for the warm start)."""
    from pipelinerl_jax.models.factory import create_model
    from pipelinerl_jax.models import save_pretrained, tiny_config
    from pipelinerl_jax.tokenizer import CharTokenizer
    cfg = tiny_config(vocab_size=CharTokenizer().vocab_size, hidden_size=32,
                      intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16,
                      max_position_embeddings=32)
    save_pretrained(create_model(cfg, seed=seed), path)
    return path


def train_env(extra=None) -> dict:
    """The environment of a train.py run: this checkout first, one CPU device per process
    (as in a real run) unless `extra` says otherwise."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    env.update(extra or {})
    return env


def run_train(workdir, *flags, timeout=600, check=True, env=None, config="default.py"):
    env = train_env(env)
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
           f"--config={os.path.join(ROOT, 'configs', config)}:quick",
           f"--workdir={workdir}", *TINY_FLAGS, *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                         cwd=ROOT)
    if check and out.returncode != 0:
        logs = ""
        logdir = os.path.join(workdir, "logs")
        for name in sorted(os.listdir(logdir)) if os.path.isdir(logdir) else []:
            logs += f"\n--- {name} ---\n" + open(os.path.join(logdir, name)).read()[-3000:]
        raise AssertionError(f"train.py failed ({out.returncode}):\n{out.stderr[-3000:]}{logs}")
    return out


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def stop_process_groups(procs) -> None:
    """SIGTERM to every still-running process group (each started with
    `start_new_session=True`), then SIGKILL to any that has not ended within 60 s."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
