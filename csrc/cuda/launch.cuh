// The two things the kernel headers take from outside C++ and CUDA, as macros, so that the headers compile as plain
// C++ too: tests/cuda_emu (the CPU execution harness) defines both before it includes them.
#pragma once

// GRPO_LAUNCH(grid, block, shared_bytes, stream, kernel)(args...) launches kernel<<<grid, block, shared_bytes,
// stream>>>(args...). The kernel comes last because its template arguments may hold commas.
#ifndef GRPO_LAUNCH
#define GRPO_LAUNCH(grid, block, shared_bytes, stream, ...) __VA_ARGS__<<<grid, block, shared_bytes, stream>>>
#endif

// ATen's device-side assert (torch/headeronly/macros/Macros.h, which the bindings include first); assert() where
// the headers are compiled without torch.
#ifndef CUDA_KERNEL_ASSERT
#include <cassert>
#define CUDA_KERNEL_ASSERT(cond) assert(cond)
#endif
