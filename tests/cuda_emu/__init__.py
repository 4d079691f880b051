"""cuda_emu: grpo_ext's CUDA kernel headers run on the CPU (runtime.h says what it emulates and what it cannot)."""
