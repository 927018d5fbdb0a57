// NF4 kernels that tests and benchmarks force through Nf4GemmOptions::path. Programs choose a path by intent
// (ops.h: Auto, DequantGemm, Fused); these values lie past those members, are accepted by the entry points and
// named by nf4_path_name, and are not part of the public API.
#pragma once

#include "qmm/ops.h"

namespace qmm::nf4_forced {

constexpr Nf4Path kReference = static_cast<Nf4Path>(16);    // the CPU backend's loops (a GPU context refuses it)
constexpr Nf4Path kSmallM = static_cast<Nf4Path>(17);       // the few-row kernels (src/cuda/nf4/nf4_small_m.cu)
constexpr Nf4Path kFusedShared = static_cast<Nf4Path>(18);  // src/cuda/dev/nf4_fused_shared.cu (QMM_DEV_KERNELS)
constexpr Nf4Path kFusedMma = static_cast<Nf4Path>(19);     // src/cuda/dev/nf4_fused_mma.cu (QMM_DEV_KERNELS)
constexpr Nf4Path kSmallMSlice = static_cast<Nf4Path>(20);  // src/cuda/nf4/nf4_slice.cu, forward

// Every path an entry point accepts, for front ends that take them by name (nf4_path_name names each).
constexpr Nf4Path kAllPaths[] = {Nf4Path::Auto, Nf4Path::DequantGemm, Nf4Path::Fused, kReference,
                                 kSmallM,       kSmallMSlice,         kFusedShared,   kFusedMma};

}  // namespace qmm::nf4_forced
