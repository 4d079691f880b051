"""What each GPU architecture the wheel is built for gives an SM, and the card the project benchmarks on: the limits
the kernel reports (``kernel_report.py``, ``row_kernels_report.py``) compute occupancy and bytes in flight from.
"""

# Per-SM limits of each architecture (CUDA C++ Programming Guide, "Compute capabilities"), and a GPU that has it.
ARCHS = {
    "sm_80": {"gpu": "A100", "regs": 65536, "smem": 164 * 1024, "threads": 2048, "blocks": 32},
    "sm_86": {"gpu": "RTX 3090, A10, A40", "regs": 65536, "smem": 100 * 1024, "threads": 1536, "blocks": 16},
    "sm_89": {"gpu": "L40S, L4, RTX 4090", "regs": 65536, "smem": 100 * 1024, "threads": 1536, "blocks": 24},
    "sm_90": {"gpu": "H100, H200", "regs": 65536, "smem": 228 * 1024, "threads": 2048, "blocks": 32},
    "sm_100": {"gpu": "B200, GB200", "regs": 65536, "smem": 228 * 1024, "threads": 2048, "blocks": 32},
    "sm_120": {"gpu": "RTX 5090, RTX PRO 6000", "regs": 65536, "smem": 100 * 1024, "threads": 1536, "blocks": 32},
}
SMEM_RESERVED_PER_BLOCK = 1024
# The architecture of the detailed table (the GPU the project benchmarks on).
DETAIL_ARCH = "sm_90"

# The H100 (sm_90) the targets are set for: lane-instructions per second (132 SMs x 4 schedulers x 32 lanes x 1.98
# GHz), the bytes each SM keeps in flight for 3 TB/s at about 1 us of latency, and its shared memory per SM and per
# block (opt-in).
H100_ISSUE_RATE = 132 * 4 * 32 * 1.98e9
H100_IN_FLIGHT_NEEDED = 3.0e12 * 1e-6 / 132
H100_SHARED_PER_SM, H100_SHARED_PER_BLOCK = 233472, 232448
