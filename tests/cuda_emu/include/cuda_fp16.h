// cuda_emu's stand-in for cuda_fp16.h: __half and the conversions the kernels use.
#pragma once

#include "../half_types.h"
