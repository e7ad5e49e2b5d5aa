"""The chip table and topology names."""
import pytest

from pipelinerl_jax.aot import chips
from pipelinerl_jax.sim.hardware import ACCELERATORS


def test_roofline_is_the_larger_of_compute_and_memory_time():
    v5e = chips.CHIPS["v5e"]
    assert v5e.roofline_s(197e12, 0.0) == pytest.approx(1.0)  # a second of peak FLOPs
    assert v5e.roofline_s(0.0, 819e9) == pytest.approx(1.0)  # a second of HBM bandwidth
    assert v5e.roofline_s(197e12, 2 * 819e9) == pytest.approx(2.0)


def test_topology_names_their_chip_and_bad_names_say_how():
    assert chips.chip_of_topology("v5p:2x2x1").name == "v5p"
    assert chips.chips_in("v5e:2x4") == 8
    with pytest.raises(chips.TopologyError, match="<chip>:<shape>"):
        chips.chip_of_topology("v7x:2x2")
    with pytest.raises(chips.TopologyError, match="<chip>:<shape>"):
        chips.chip_of_topology("v5e")


def test_the_simulator_reads_the_same_table():
    for name, chip in chips.CHIPS.items():
        acc = ACCELERATORS[f"tpu-{name}"]
        assert (acc.hbm_bytes, acc.hbm_bw, acc.peak_flops) == (
            chip.hbm_bytes, chip.hbm_bw, chip.peak_bf16_flops)


def test_topology_devices_are_tpu_chips(v5e_2x2):
    devices, chip = v5e_2x2
    assert len(devices) == 4 and chip.name == "v5e"
    assert chips.chip_of_device_kind(devices[0].device_kind) is chips.CHIPS["v5e"]
