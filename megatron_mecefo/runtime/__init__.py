"""Runtime support that lets megatron-core run where it was not built to (CPU + gloo)."""

from megatron_mecefo.runtime.cpu import (
    LAYERS,
    PATCHED_CALL_SITES,
    CpuRuntime,
    PatchedCallSite,
    enable_cpu_runtime,
    quiet_cpu_warnings,
)

__all__ = [
    "LAYERS",
    "PATCHED_CALL_SITES",
    "CpuRuntime",
    "PatchedCallSite",
    "enable_cpu_runtime",
    "quiet_cpu_warnings",
]
