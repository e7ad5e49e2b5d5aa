"""Start N SGLang servers on this GPU host with the flags pipeline RL needs, and wait for them.

    python scripts/launch_sglang.py --model-path /data/models/Qwen2.5-0.5B-Instruct \
        --num-servers 4 --gpus-per-server 1 --base-port 30000 --weight-version 0
    python scripts/launch_sglang.py ... --dry-run      # print the commands, start nothing

Server i gets GPUs [i*tp, (i+1)*tp) of --gpus (CUDA_VISIBLE_DEVICES), HTTP port base_port + i
and NCCL port nccl_base_port + i (explicit, so servers on one host never draw the same random
port). Flags (checked against sglang's `srt/server_args.py`): `--model-path`, `--tp-size`,
`--mem-fraction-static`, `--skip-tokenizer-init` (we send token ids, never text),
`--weight-version` (the label `meta_info.weight_version` reports until the first refit),
`--host` (127.0.0.1 unless you expose it), `--port`, `--nccl-port`, `--random-seed`, and
optionally `--context-length`, `--max-running-requests`, `--dtype`, `--api-key`; anything
after `--` is passed through. Logs go to --log-dir/sglang_<port>.log. The script prints the
`sglang.urls` value for the experiment config, waits until every /health answers 200 (or
--wait-s passes), then stays in the foreground; Ctrl-C stops all servers.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="local HF checkpoint directory")
    p.add_argument("--num-servers", type=int, default=1)
    p.add_argument("--gpus-per-server", type=int, default=1, help="tensor parallel size")
    p.add_argument("--gpus", default="", help="GPU ids to use, e.g. '0,1,2,3' (default: "
                                              "0 .. num_servers*gpus_per_server-1)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 to expose)")
    p.add_argument("--advertise-host", default="", help="host name in the printed urls "
                                                        "(default: --host)")
    p.add_argument("--base-port", type=int, default=30000)
    p.add_argument("--nccl-base-port", type=int, default=31000)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--weight-version", default="0")
    p.add_argument("--context-length", type=int, default=0, help="0 = the model's")
    p.add_argument("--max-running-requests", type=int, default=0, help="0 = SGLang's choice")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--api-key", default="")
    p.add_argument("--seed", type=int, default=0, help="server i gets --random-seed seed+i")
    p.add_argument("--log-dir", default="sglang_logs")
    p.add_argument("--wait-s", type=float, default=900.0, help="health deadline (0 = no wait)")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--python", default=sys.executable)
    args, extra = p.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    elif extra:
        p.error(f"unrecognized arguments {extra} (pass SGLang flags after '--')")
    args.extra = extra
    if args.num_servers < 1 or args.gpus_per_server < 1:
        p.error("--num-servers and --gpus-per-server must be >= 1")
    return args


def server_commands(args) -> list:
    """[(env overrides, argv)] of every server."""
    tp = args.gpus_per_server
    gpus = ([g.strip() for g in args.gpus.split(",") if g.strip()] if args.gpus
            else [str(i) for i in range(args.num_servers * tp)])
    if len(gpus) < args.num_servers * tp:
        raise SystemExit(f"--gpus lists {len(gpus)} GPUs; {args.num_servers} servers x "
                         f"{tp} GPUs need {args.num_servers * tp}")
    out = []
    for i in range(args.num_servers):
        cmd = [args.python, "-m", "sglang.launch_server",
               "--model-path", args.model_path,
               "--tp-size", str(tp),
               "--mem-fraction-static", str(args.mem_fraction_static),
               "--skip-tokenizer-init",
               "--weight-version", str(args.weight_version),
               "--host", args.host,
               "--port", str(args.base_port + i),
               "--nccl-port", str(args.nccl_base_port + i),
               "--random-seed", str(args.seed + i),
               "--dtype", args.dtype]
        if args.context_length:
            cmd += ["--context-length", str(args.context_length)]
        if args.max_running_requests:
            cmd += ["--max-running-requests", str(args.max_running_requests)]
        if args.api_key:
            cmd += ["--api-key", args.api_key]
        env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tp:(i + 1) * tp])}
        out.append((env, cmd + list(args.extra)))
    return out


def urls(args) -> tuple:
    host = args.advertise_host or ("127.0.0.1" if args.host == "0.0.0.0" else args.host)
    return tuple(f"http://{host}:{args.base_port + i}" for i in range(args.num_servers))


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def main(argv=None) -> int:
    args = parse_args(argv)
    commands = server_commands(args)
    print(f'config: --config.sglang.urls="{urls(args)!r}"', flush=True)
    if args.dry_run:
        for env, cmd in commands:
            print(" ".join(f"{k}={v}" for k, v in env.items()), shlex.join(cmd))
        return 0
    os.makedirs(args.log_dir, exist_ok=True)
    procs = []
    for (env, cmd), url in zip(commands, urls(args)):
        log = open(os.path.join(args.log_dir, f"sglang_{url.rsplit(':', 1)[1]}.log"), "ab")
        procs.append(subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))

    def stop(code: int = 0):
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        raise SystemExit(code)
    signal.signal(signal.SIGTERM, lambda *_: stop(0))
    signal.signal(signal.SIGINT, lambda *_: stop(0))

    deadline = time.monotonic() + args.wait_s
    pending = set(urls(args)) if args.wait_s > 0 else set()
    while pending and time.monotonic() < deadline:
        for p, url in zip(procs, urls(args)):
            if p.poll() is not None:
                print(json.dumps({"url": url, "exited": p.returncode,
                                  "log": args.log_dir}), flush=True)
                stop(1)
        pending = {u for u in pending if not healthy(u)}
        time.sleep(2.0)
    print(json.dumps({"ready": sorted(set(urls(args)) - pending), "not_ready": sorted(pending)}),
          flush=True)
    while all(p.poll() is None for p in procs):
        time.sleep(5.0)
    print(json.dumps({"exited": [u for p, u in zip(procs, urls(args)) if p.poll() is not None]}),
          flush=True)
    stop(1)
    return 1


if __name__ == "__main__":
    sys.exit(main())
