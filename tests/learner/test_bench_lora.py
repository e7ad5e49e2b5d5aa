"""scripts/bench_lora.py --smoke: full fine-tuning vs LoRA on the tiny model. The bytes the
script derives from shapes alone equal those of the states it then builds and trains."""

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench_smoke]  # benchmark scripts, tiny shapes


def test_smoke_prints_one_json_line_whose_bytes_match_the_real_states(device_check_cpu):
    """`bench_lora.py --smoke` as device_check's `lora` part runs it (tests/conftest.py runs
    the check once per session; its log holds the script's own JSON line)."""
    _, result, _, part_json = device_check_cpu
    assert result["lora"]["status"] == "ok", result["lora"]
    out = part_json("lora")
    sizes, timed = out["bytes_full_shape"], out["timed"]
    assert timed["layers"] == 2  # the smoke model is timed whole: its bytes are comparable
    for kind in ("full", "lora"):
        assert timed[kind]["learner_state_bytes"] == sizes[kind]["learner_state_bytes"]
        assert timed[kind]["publish_bytes"] == sizes[kind]["publish_bytes"]
        assert timed[kind]["received_bytes"] == sizes[kind]["publish_bytes"]
        assert timed[kind]["step_s"] > 0 and timed[kind]["compile_s"] > 0
    assert 0 < out["publish_bytes_ratio"] < 0.1 and 0 < out["learner_state_bytes_ratio"] < 0.5
    # AdamW: two float32 moments per trained parameter (plus a few scalars)
    lora = sizes["lora"]
    assert 2 * lora["param_bytes"] <= lora["optimizer_bytes"] < 2 * lora["param_bytes"] + 1024
