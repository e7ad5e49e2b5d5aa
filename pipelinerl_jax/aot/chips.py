"""TPU chips: peak bf16 FLOP/s, HBM capacity and HBM bandwidth per chip, and the topologies
JAX compiles for.

Numbers are Google Cloud's published per-chip specifications (dense bf16, no sparsity):

    v4    275 TFLOP/s, 32 GiB HBM2,  1,200 GB/s   https://cloud.google.com/tpu/docs/v4
    v5e   197 TFLOP/s, 16 GB HBM2,     819 GB/s   https://cloud.google.com/tpu/docs/v5e
    v5p   459 TFLOP/s, 95 GB HBM2e,  2,765 GB/s   https://cloud.google.com/tpu/docs/v5p
    v6e   918 TFLOP/s, 32 GB HBM,    1,640 GB/s   https://cloud.google.com/tpu/docs/v6e

Capacities are read as the pages write them (GB = 1e9 bytes), below what libtpu's compiler
says a chip can give a program (15.75 GiB = 16.9e9 bytes on a v5e), so a program judged to
fit here has that margin. A program the compiler itself finds too big fails to compile with
its own figures, which the check reports instead (`check.out_of_memory`).

A topology name is `<chip>:<shape>` as `jax.experimental.topologies.get_topology_desc`
takes it: `v5e:2x2` (4 chips), `v5e:2x4` (8), `v5p:2x2x1` (4 chips = a v5p-8: v5p slices
are named by TensorCores, two per chip), `v6e:2x4`, `v4:2x2x1`. JAX names a v5e device
"TPU v5 lite"; `chip_of_device_kind` maps the names back.
"""
from __future__ import annotations

import dataclasses
import math
import os
GB, GiB = 1e9, float(1 << 30)


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    peak_bf16_flops: float  # FLOP/s
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    device_kind: str  # jax Device.device_kind

    def roofline_s(self, flops: float, bytes_accessed: float) -> float:
        """Lower bound of a program's time on one chip: the larger of its compute time at
        peak and its HBM traffic at full bandwidth (Williams et al., 2009)."""
        return max(flops / self.peak_bf16_flops, bytes_accessed / self.hbm_bw)


CHIPS = {
    "v4": Chip("v4", 275e12, 32 * GiB, 1200 * GB, "TPU v4"),
    "v5e": Chip("v5e", 197e12, 16 * GB, 819 * GB, "TPU v5 lite"),
    "v5p": Chip("v5p", 459e12, 95 * GB, 2765 * GB, "TPU v5"),
    "v6e": Chip("v6e", 918e12, 32 * GB, 1640 * GB, "TPU v6 lite"),
}


class TopologyError(ValueError):
    """A topology name JAX or the chip table does not know."""


def chip_of_topology(name: str) -> Chip:
    """The chip of topology `name` (`v5e:2x4` -> v5e)."""
    chip = name.split(":", 1)[0].lower()
    if chip not in CHIPS or ":" not in name:
        raise TopologyError(f"topology {name!r}: need '<chip>:<shape>' with chip one of "
                            f"{sorted(CHIPS)}, e.g. 'v5e:2x4'")
    return CHIPS[chip]


def chip_of_device_kind(kind: str) -> Chip:
    for chip in CHIPS.values():
        if chip.device_kind == kind:
            return chip
    raise TopologyError(f"no chip in the table is JAX device kind {kind!r}")


def chips_in(name: str) -> int:
    """Chips in topology `name`: the product of its shape (`v5e:2x4` -> 8)."""
    shape = name.split(":", 1)[1]
    return math.prod(int(x) for x in shape.lower().split("x"))


def topology(name: str) -> tuple:
    """(abstract devices of TPU topology `name`, the `Chip` one device is). Where JAX gives a
    device per TensorCore (v4: 8 devices for the 4 chips of `v4:2x2x1`) a device is that
    share of its chip. Uses libtpu's compiler; no TPU is needed."""
    from jax.experimental import topologies
    chip = chip_of_topology(name)
    # Compiling opens no chip: let several compiling processes load libtpu at once (its
    # lockfile otherwise admits one process per host).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        devices = list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as e:  # libtpu missing, or a shape it rejects
        raise TopologyError(f"topology {name!r}: {type(e).__name__}: {e} (is libtpu installed? "
                            f"pip install -e '.[tpu]')") from None
    share = chips_in(name) / len(devices)
    if share != 1:
        chip = dataclasses.replace(chip, peak_bf16_flops=chip.peak_bf16_flops * share,
                                   hbm_bytes=chip.hbm_bytes * share, hbm_bw=chip.hbm_bw * share)
    return devices, chip
