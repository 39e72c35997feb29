"""Which trace events are communication, which are compute, and of which collective kind.

Rules (applied once per distinct event name, then broadcast to events by name id):

GPU traces (events with a ``stream`` argument, as in Holistic Trace Analysis):
  * communication: kernels whose name matches ``^nccl.*Kernel``: both NCCL naming schemes,
    ``ncclKernel_AllReduce_RING_LL_Sum_float(...)`` (NCCL < 2.19) and
    ``ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)`` (2.19 and later), the collective kind
    read from either (or from the event's ``Collective name`` argument when torch writes one,
    as for ``ncclDevKernel_Generic``);
  * memory (neither): names starting ``Memcpy``, ``Memset`` or ``dma``;
  * synchronisation (neither): ``Stream Wait Event`` and names containing ``Sync``
    (``Event Sync``, ``Context Sync``, ``cudaDeviceSynchronize``-like entries);
  * compute: every other kernel, except names HTA leaves out (containing ``Memcpy`` or
    ``Sync``, or starting ``Memset``). Events whose category says they are no kernel
    (``gpu_memcpy``, ``gpu_memset``, ``cuda_sync``, ...) are never compute whatever their name:
    :mod:`cpdpkit.profiler.overlap` checks the category per event.

CPU events (any thread):
  * backend worker collectives: ``gloo:*`` (gloo's ``pt_gloo_runloop`` threads), ``mpi:*``,
    ``ucc:*`` — the time the collective is in flight;
  * c10d call sites on the training thread: ``c10d::*`` ops and ``record_param_comms``;
  * cpdpkit labels (the contract of :mod:`cpdpkit.labels`): ``cpdpkit::emu::<op>[...]``
    (modeled link time, carries the tier) and communication phases ``cpdpkit::<component>::<phase>``
    (issuing a collective or waiting for it); phases of local work (``kind is None``, e.g. SlowMo's
    outer update) are compute, not communication.
  * compute candidates: ``cpu_op`` events that are none of the above.

Canonical collective kinds: all_reduce, all_gather, reduce_scatter, broadcast, barrier,
all_to_all, send_recv, other.
"""

from __future__ import annotations

import functools
import re

from cpdpkit.labels import EMU_PREFIX, KINDS, EmuLabel, parse_emu_label, parse_rank_ranges, phase_by_label
from cpdpkit.profiler._record import record

__all__ = [
    "KINDS",
    "STEP_NAME",
    "step_number",
    "canonical_kind",
    "NameClass",
    "classify_name",
    "EmuLabel",
    "parse_emu_label",
    "parse_rank_ranges",
]

# Holistic Trace Analysis 0.5.0's kernel rules (hta/utils/utils.py), reproduced verbatim.
_NCCL_KERNEL = re.compile(r"^nccl.*Kernel")
_MEMORY_KERNEL = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
_NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
# CUPTI's synchronisation records (torch >= 2.3 writes them on the GPU streams, category
# ``cuda_sync``); the ones named ``... Sync`` are already out through ``_NOT_COMPUTE``
_SYNC_KERNEL = re.compile(r"^Stream Wait Event")

_BACKEND_PREFIXES = ("gloo:", "mpi:", "ucc:")
# the step markers torch.profiler writes on the training thread (group 1: the step number)
STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")


def step_number(name: str) -> int:
    """The step number of a ``ProfilerStep#N`` marker (a row of ``RankTrace.rows_of(steps=True)``)."""
    m = STEP_NAME.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a ProfilerStep#N marker")
    return int(m.group(1))


def canonical_kind(text: str) -> str:
    """Map a collective's name in any spelling (``allreduce``, ``AllGather``, ``_allgather_base_``,
    ``ncclKernel_ReduceScatter_...``, ``all_to_allv``) to a canonical kind."""
    t = text.lower().replace("_", "").replace(" ", "")
    for prefix in ("ncclkernel", "nccldevkernel", "c10d::", "gloo:", "mpi:", "ucc:", "nccl:"):
        if t.startswith(prefix):
            t = t[len(prefix) :]
    if "allreduce" in t:
        return "all_reduce"
    if "reducescatter" in t:
        return "reduce_scatter"
    if "allgather" in t:
        return "all_gather"
    if "alltoall" in t or "all2all" in t:
        return "all_to_all"
    if "broadcast" in t or "bcast" in t:
        return "broadcast"
    if "barrier" in t:
        return "barrier"
    if "sendrecv" in t or t.startswith(("send", "recv", "isend", "irecv", "p2p")):
        return "send_recv"
    return "other"


@record
class NameClass:
    """What one event name means. ``role`` is one of: ``gpu_comm``, ``gpu_compute``,
    ``gpu_memory``, ``gpu_other`` (for events on a GPU stream) or ``backend``, ``callsite``,
    ``emu``, ``phase``, ``cpu`` (for CPU events); ``kind`` is the canonical collective kind
    (``None`` for non-communication)."""

    gpu_role: str
    cpu_role: str
    kind: str | None
    cpu_kind: str | None
    reads_comm_args: bool


def _gpu_role(name: str) -> str:
    if _NCCL_KERNEL.match(name):
        return "gpu_comm"
    if _MEMORY_KERNEL.match(name):
        return "gpu_memory"
    if not _NOT_COMPUTE.match(name) and not _SYNC_KERNEL.match(name):
        return "gpu_compute"
    return "gpu_other"


def _cpu_role(name: str) -> tuple[str, str | None]:
    if name.startswith(_BACKEND_PREFIXES):
        return "backend", canonical_kind(name.split(":", 1)[1])
    if name.startswith(EMU_PREFIX):
        label = parse_emu_label(name)
        return "emu", label.kind if label else "other"
    phase = phase_by_label(name)
    if phase is not None:
        return ("phase", phase.kind) if phase.is_communication else ("cpu", None)
    if name.startswith("c10d::"):
        return "callsite", canonical_kind(name[len("c10d::") :])
    if name == "record_param_comms":
        return "callsite", "other"
    return "cpu", None


@functools.lru_cache(maxsize=1 << 16)  # ranks of a run share most names
def classify_name(name: str) -> NameClass:
    """Classify one event name (see the module docstring for the rules)."""
    gpu_role = _gpu_role(name)
    cpu_role, cpu_kind = _cpu_role(name)
    kind = canonical_kind(name) if gpu_role == "gpu_comm" else None
    reads = gpu_role == "gpu_comm" or name == "record_param_comms"
    return NameClass(gpu_role, cpu_role, kind, cpu_kind, reads)
