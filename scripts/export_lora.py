"""Export a LoRA run's adapters: a PEFT adapter directory and/or a merged HF checkpoint.

    python scripts/export_lora.py --workdir=runs/default_lora --peft=exports/adapter \
        [--merged=exports/merged] [--step=N] [--dtype=bfloat16]

Reads the run's `config.json` (its `lora` section) and its latest complete checkpoint (or
`--step`), which holds only the adapters (docs/lora.md); the base is the one the checkpoint
names (`lora_base`: path and sha256), checked against the files on disk before anything is
written. `--peft`: `adapter_config.json` + `adapter_model.safetensors`, loadable by
`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), DIR)` and by
SGLang's `/load_lora_adapter`. `--merged`: the base with the adapters merged in (float32
merge), an ordinary HF checkpoint directory. `--dtype`: the stored dtype of both (default
float32). Prints one JSON line (what was written).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def export_run(workdir: str, peft_dir: str = None, merged_dir: str = None, step: int = None,
               dtype: str = "float32") -> dict:
    import ml_collections

    from pipelinerl_jax.learner.checkpoint import Checkpointer
    from pipelinerl_jax.models import flat_params, load_config
    from pipelinerl_jax.models.lora import adapter_params, base_identity, lora_spec
    from pipelinerl_jax.models.peft_io import write_merged_dir, write_peft_dir

    with open(os.path.join(workdir, "config.json")) as f:
        cfg = ml_collections.ConfigDict(json.load(f))
    spec = lora_spec(cfg)
    if spec is None:
        raise SystemExit(f"{workdir}: not a LoRA run (lora.enabled is off in its config.json)")
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    try:
        state, meta, step = ckpt.read_state(step)
    finally:
        ckpt.close()
    base = meta.get("lora_base")
    if not base:
        raise SystemExit(f"{workdir}: checkpoint step {step} names no base (lora_base)")
    on_disk = base_identity(base["path"])
    if on_disk["sha256"] != base["sha256"]:
        raise SystemExit(f"{base['path']} is not the base the adapters of step {step} were "
                         f"trained on (sha256 {on_disk['sha256']} != {base['sha256']})")
    adapters = adapter_params(flat_params(state["params"]))
    model_config = load_config(base["path"])
    out = {"workdir": os.path.abspath(workdir), "step": step, "version": meta.get("version"),
           "base": base["path"], "rank": spec.rank, "alpha": spec.alpha,
           "targets": list(spec.targets), "adapter_tensors": len(adapters)}
    if peft_dir:
        write_peft_dir(adapters, model_config, spec, peft_dir, base_model=base["path"],
                       dtype=dtype)
        out["peft"] = os.path.abspath(peft_dir)
    if merged_dir:
        write_merged_dir(adapters, spec, base["path"], merged_dir, dtype=dtype)
        out["merged"] = os.path.abspath(merged_dir)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="the LoRA run's directory")
    p.add_argument("--peft", help="write the PEFT adapter directory here")
    p.add_argument("--merged", help="write the merged HF checkpoint here")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest complete)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a = p.parse_args(argv)
    if not (a.peft or a.merged):
        p.error("nothing to write: give --peft and/or --merged")
    print(json.dumps(export_run(a.workdir, a.peft, a.merged, a.step, a.dtype)), flush=True)


if __name__ == "__main__":
    main()
