// cuda_emu's stand-in for the CUDA runtime header: the execution model of ../runtime.h.
#pragma once

#include "../runtime.h"
