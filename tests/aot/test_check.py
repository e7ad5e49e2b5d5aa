"""Reading the compiler's verdicts: XLA:TPU's out-of-memory refusal becomes 'does not fit'
with the bytes it names, and every failure names the config key to change."""
from pipelinerl_jax.aot import check
from pipelinerl_jax.aot.chips import CHIPS
from pipelinerl_jax.aot.programs import Program

# the message libtpu 0.0.42.1 gave for the 7B LoRA train step with FSDP at 2,048 tokens
OOM = ("JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
       "required for HLO temporaries (32.92G) exceeds available HBM (15.75G).")


def test_the_out_of_memory_refusal_gives_need_and_capacity():
    need, have = check.out_of_memory(OOM)
    assert need == int(32.92 * 2**30) and have == int(15.75 * 2**30)
    assert check.out_of_memory("JaxRuntimeError: INTERNAL: something else") is None


def test_a_refused_program_does_not_fit_and_names_its_key():
    def lower():
        raise RuntimeError(OOM)
    prog = Program("learner/train_step", "learner", lower, "learner.micro_batches",
                   {"tokens": 1}, devices=[None] * 4)
    res, _ = check.compile_program(prog, CHIPS["v5e"])
    assert res.out_of_memory and not res.fits and not res.compiled
    assert res.hbm_bytes_per_chip == int(32.92 * 2**30)
    assert res.hbm_capacity_bytes == int(15.75 * 2**30)  # the compiler's own figure
    [msg] = check.failures([res])
    assert msg.startswith("learner/train_step needs more than 32.92 GiB per chip")
    assert msg.endswith("change learner.micro_batches")
    assert res.summary()["out_of_memory"] is True


def test_a_snapshot_beside_the_train_step_counts_both_and_can_tip_the_chip():
    """`alongside`: the published snapshot lives while the next train step runs, so its HBM
    is the step's whole footprint plus the snapshot; a step that fits alone can fail with it
    (compiled here for the CPU host; the arithmetic is the check's, whatever the backend)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pipelinerl_jax.learner import multihost
    cpu = jax.devices("cpu")[:1]
    params = {"w": jax.ShapeDtypeStruct((512, 1024), jnp.float32)}  # 2 MiB
    step = jax.jit(lambda p: jax.tree.map(lambda x: x * 2 + 1, p), donate_argnums=0)
    train = Program("learner/train_step", "learner", lambda: step.lower(params),
                    "learner.micro_batches", {"chunks": 1}, cpu)
    publish = Program("learner/publish", "learner",
                      lambda: multihost.snapshot_program(np.dtype(jnp.bfloat16)).lower(params),
                      "learner.publish_dtype", {}, cpu, alongside=train.name)
    [t, p] = check.check_programs([train, publish], {"learner": CHIPS["v5e"]},
                                  log=lambda *a: None)
    assert p.memory["outputs"] == 512 * 1024 * 2  # the bf16 snapshot
    assert p.memory["alongside"] == t.hbm_bytes_per_chip
    assert p.hbm_bytes_per_chip == t.hbm_bytes_per_chip + p.memory["outputs"]
    small = dataclasses.replace(CHIPS["v5e"], hbm_bytes=t.hbm_bytes_per_chip + 1024)
    [t, p] = check.check_programs([train, publish], {"learner": small}, log=lambda *a: None)
    assert t.fits and not p.fits
    [msg] = check.failures([t, p])
    assert msg.startswith("learner/publish needs") and msg.endswith("learner.publish_dtype")


def test_jobs_compile_programs_at_once_and_report_in_program_order():
    """`jobs=2`: the first program's lowering waits until the second's has started (it could
    not with one at a time), and the results and log come back in program order, equal to a
    sequential check's."""
    import threading

    import jax
    import jax.numpy as jnp
    cpu = jax.devices("cpu")[:1]
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    second_started = threading.Event()

    def first():
        assert second_started.wait(60.0), "the second program never started alongside"
        return jax.jit(lambda a: a @ a).lower(x)

    def second():
        second_started.set()
        return jax.jit(lambda a: a * 2).lower(x)
    progs = [Program("a", "learner", first, "k", {}, cpu),
             Program("b", "learner", second, "k", {}, cpu)]
    lines = []
    both = check.check_programs(progs, {"learner": CHIPS["v5e"]}, log=lines.append, jobs=2)
    assert [r.name for r in both] == ["a", "b"] and all(r.compiled for r in both)
    assert [line.split(" on ")[0] for line in lines] == ["a", "b"]
    second_started.set()  # sequentially the first no longer waits
    alone = check.check_programs(progs, {"learner": CHIPS["v5e"]}, log=lambda *a: None)
    assert [(r.hbm_bytes_per_chip, r.flops) for r in alone] == \
        [(r.hbm_bytes_per_chip, r.flops) for r in both]


def test_a_quick_verdict_keeps_a_margin_and_sends_a_close_call_to_the_full_check():
    """The quick plan's HBM is within 8.4% of the full plan's (measured, 7B/8B): a quick result
    inside `QUICK_MARGIN` of the chip neither fits nor fails; it names the full check."""
    cap = int(CHIPS["v5e"].hbm_bytes)

    def result(used, effort):
        r = check.Result("learner/train_step", "learner", True, "v5e", 4,
                         "learner.micro_batches", {}, hbm_capacity_bytes=cap, effort=effort,
                         margin=check.QUICK_MARGIN if effort is not None else 0.0)
        r.hbm_bytes_per_chip = int(used * cap)
        return r
    assert result(0.95, None).fits  # the full plan: the chip is the limit
    close = result(0.95, check.QUICK_EFFORT)
    assert not close.fits and close.too_close and close.summary()["plan"] == "quick"
    [msg] = check.failures([close])
    assert "inside the quick check's 10% margin; run the full check" in msg
    assert msg.endswith("change learner.micro_batches")
    assert "TOO CLOSE FOR THE QUICK CHECK" in check.describe(close)
    assert result(0.85, check.QUICK_EFFORT).fits
    over = result(1.05, check.QUICK_EFFORT)
    assert not over.fits and not over.too_close
    assert "DOES NOT FIT" in check.describe(over)
