// Device code of the small-M NF4 GEMMs, one kernel (or family) per header: the forward table kernel (M <= 32),
// the pair kernel (M <= 16), the GEMV (M = 1) and the input gradient (M <= 16). (The slice kernel, which Auto does
// not take, is in src/cuda/dev/.)
// Host side: nf4_small_m.cu.
#pragma once

#include "cuda/nf4/nf4_device.cuh"
#include "cuda/nf4/nf4_lane_tables.cuh"
#include "cuda/nf4/nf4_table_kernel.cuh"
#include "cuda/nf4/nf4_pair_kernel.cuh"
#include "cuda/nf4/nf4_gemv_kernel.cuh"
#include "cuda/nf4/nf4_small_m_backward_kernel.cuh"
