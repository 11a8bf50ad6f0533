"""Offload in the planner: where transfers go, what they cost, and what they did.

The planner's third decision per tag moves its values to host memory and back (`Policy.offload`,
JAX's `Offloadable` to "pinned_host"). Here: the host bandwidth a target plans with
(`offload_bandwidth`, `targets.PEAKS`), the transfer seconds left unhidden by its layers'
compute (`transfer_seconds`), and a plan's check against the same tags saved (`verify`).
The probe, the bandwidths and measured cases: docs/plan.md ("Offload").
"""

from __future__ import annotations

import dataclasses

from remat_kit.measure import targets
from remat_kit.decide.cost_model import PLANNED_BASES
from remat_kit.decide.offload_probe import CPU_OFFLOAD_NOTE


def offload_bandwidth(target: targets.Target, offload: "bool | float | None") -> float | None:
    """Bytes/s each way of offload's transfers on `target`, or None where offload is
    not planned (`Planner`'s offload argument: None, True, False or bytes/s).

    None and False: offload is not planned. True asks for it, at the target's
    listed host bandwidth (TPU v5e / v5p, H100, H200), or on the CPU at this
    machine's measured memory bandwidth (a transfer is a copy); the planner then
    plans it only where the offload probe shows it lowers device memory
    (`remat_kit.decide.offload_probe`: XLA's TPU and GPU compiles keep part of an
    offloaded residual on the device, and on unrolled TPU stacks the peak rose).

    Raises:
      TargetError: offload=True on a target that lists no host bandwidth.
    """
    if offload is False or offload is None:
        return None
    if offload is not True:  # a bandwidth in bytes/s
        return float(offload)
    if target.platform == "cpu":
        return target.roofline.bandwidth
    found = (target.peaks or {}).get("host_bandwidth")
    if found is None:
        listed = ", ".join(k for k, v in targets.PEAKS.items() if "host_bandwidth" in v)
        raise targets.TargetError(
            f"offload needs the target's host memory bandwidth: {target} lists none; "
            f"targets with host memory: {listed} (and cpu, where host memory is device "
            "memory)")
    return found


def transfer_seconds(costs, policy) -> float:
    """Predicted seconds of `policy`'s host transfers not hidden behind its layers'
    forward compute (`CostModel.excess` of the tags it offloads), under the planner's
    cost model `costs` (`PlannerCosts`); 0 where it offloads nothing or the planner plans
    no offload.

    policy: a `Policy`, or a tuple of one per layer (`Planner` plans).
    """
    layered = isinstance(policy, tuple)
    policies = policy if layered else (policy,)
    if costs.host_bandwidth is None or not any(p.remat and p.offload for p in policies):
        return 0.0

    def deciding(item):  # (the policy that decides item, its tag name)
        return (policies[item[1]], item[0]) if layered else (policy, item)

    total = 0.0
    for base in {p.base for p in policies}:
        model = costs.model_for(base if base in PLANNED_BASES else "nothing",
                                len(policies) if layered else 1)
        total += model.excess([t for t in model.transfer if deciding(t)[0].base == base
                               and deciding(t)[0].decide(deciding(t)[1]) == "offload"])
    return total


def verify(planner, policy, record) -> list[str]:
    """Notes on what offloading did to the compiled device memory: `record` (of
    `policy`) against the same policy with its offloaded tags saved instead, compiled
    by `planner` (one more compile), beside what the offload probe predicted
    (`Probe.predict`); [] for a record that offloads nothing."""
    if not record.offloaded_bytes:
        return []
    layered = isinstance(policy, tuple)
    twin = tuple(dataclasses.replace(p, save=p.save | p.offload, offload=frozenset())
                 for p in (policy if layered else (policy,)))
    saving = planner.record_of(twin if layered else twin[0])
    host = record.host_temp_size_in_bytes
    notes = [f"offloads {record.offloaded_bytes:,} bytes (host temp "
             f"{'n/a' if host is None else f'{host:,}'} bytes)"]
    if saving.error or saving.memory_bytes is None:
        return notes + [f"saving them instead did not compile ({saving.error})"]
    fall = saving.memory_bytes - record.memory_bytes
    probe = planner.offload_probe
    notes.append(f"device memory {fall:,} bytes below saving them "
                 f"({fall / record.offloaded_bytes:.3f} of the offloaded bytes"
                 + (f"; the probe predicted {probe.figure:.3f}: "
                    f"{probe.predict(saving.memory_bytes, record.offloaded_bytes):,} bytes, "
                    f"compiled {record.memory_bytes:,})" if probe else ")"))
    if planner.target.platform == "cpu":
        notes.append(CPU_OFFLOAD_NOTE)
    return notes


__all__ = ["CPU_OFFLOAD_NOTE", "offload_bandwidth", "transfer_seconds", "verify"]
