// cuda_emu's stand-in for cuda_bf16.h: __nv_bfloat16 and the conversions the kernels use.
#pragma once

#include "../half_types.h"
