// The warp-level tensor-core product the sm_80+ kernels share: mma.sync m16n8k16, bf16 operands, fp32 accumulate.
#pragma once

#include <cstdint>

namespace qmm::cuda::common {

// d += a·b for one 16 x 8 tile over k = 16: a the row-major A fragment (4 registers of bf16 pairs), b0/b1 the
// column-major B fragment, in mma.sync's register layout.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                               std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace qmm::cuda::common
