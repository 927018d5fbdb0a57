// The sm_80+ PTX the warp-level kernels share: shared-state addresses, cp.async, ldmatrix and mma.sync (bf16
// operands, fp32 accumulation), and programmatic dependent launch (sm_90), each a thin inline wrapper.
#pragma once

#include <cstdint>

namespace qmm::cuda::common {

// The shared-state address of a pointer into shared memory, as ldmatrix, stmatrix and cp.async take it.
__device__ __forceinline__ std::uint32_t shared_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1.
__device__ __forceinline__ void cp_async_16(std::uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
// The same, or 16 zero bytes where !valid (src is then not read).
__device__ __forceinline__ void cp_async_16_or_zero(std::uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

// kBytes (4, 8 or 16) global -> shared through L1, or zeros where !valid (src is then not read).
template <int kBytes>
__device__ __forceinline__ void cp_async_ca_or_zero(std::uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(kBytes),
               "r"(valid ? kBytes : 0) : "memory");
}

// Closes the copies issued since the last commit into one group; waits until at most kPending groups are in
// flight (each thread for its own copies: a barrier makes them visible to the others).
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Programmatic dependent launch (sm_90; no-ops on older GPUs, where launch_overlapping's attribute is ignored).
// pdl_wait: blocks until the stream's previous kernel has finished and its writes are visible; a kernel launched
// with launch_overlapping calls it before its first global read or write. pdl_launch_dependents: lets the stream's
// next such kernel launch its blocks as this one's leave the SMs.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Byte offset of the 16-byte chunk `chunk` (8 b16 along the contiguous dimension) of row `row` in a tile of
// 128-byte rows XOR-swizzled by row (the 128-byte swizzle of TMA and wgmma): 8 consecutive rows at one chunk, an
// ldmatrix matrix, hit 8 different bank groups.
__device__ __forceinline__ int sw128_offset(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// Four 8 x 8 b16 matrices from shared memory (lanes 8i.. give matrix i's row addresses), as mma fragments; .trans
// hands each lane the transposed matrices' elements.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x2_trans(std::uint32_t& r0, std::uint32_t& r1, std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r0), "=r"(r1)
               : "r"(addr)
               : "memory");
}

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
