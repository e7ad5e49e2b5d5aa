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
