#!/usr/bin/env python3
"""CPU model of the mma.sync fused NF4 kernel (src/cuda/dev/nf4_fused_mma.cu): runs the kernel's per-thread
address arithmetic (copies, swizzles, dequantization stores, ldmatrix addresses, epilogue) over a byte model of its
shared memory, with ldmatrix and mma.m16n8k16 implemented from the PTX ISA's fragment layouts, and compares the
outputs with X * T^T in float64. It checks the index mapping, the edges and the stage ring without a GPU; the
PTX itself and the timing are the GPU tests' and the bench's business.
  src/cuda/dev/fused-mma-model.py              (a fixed list of ragged shapes, both directions)
Needs numpy."""
import sys

import numpy as np

NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], dtype=np.float32)

THREADS, TILE_M, TILE_N, TILE_K, STAGES = 256, 128, 128, 64, 3
X_TILE, CODE_TILE = TILE_M * TILE_K * 2, TILE_N * TILE_K // 2
STAGE_BYTES = X_TILE + CODE_TILE
W_TILE_OFF = STAGES * STAGE_BYTES
SMEM = W_TILE_OFF + TILE_N * TILE_K * 2 + 1024


def bf16_round(a):
    """float32 -> bf16 values (nearest even), as float32."""
    u = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def bf16_bits(a):
    return (bf16_round(a).view(np.uint32) >> 16).astype(np.uint16)


def swizzle128(row, chunk):
    return row * 128 + ((chunk ^ (row & 7)) << 4)


def swizzle256(row, chunk):
    return row * 256 + ((chunk ^ (row & 7) ^ ((chunk >> 3) << 1)) << 4)


def code_slot(backward, tid):
    return (tid >> 2, tid & 3) if backward else (tid >> 1, tid & 1)


class Smem:
    def __init__(self):
        self.b = np.full(SMEM, 0xA5, dtype=np.uint8)  # poisoned: a read of bytes nobody wrote shows up

    def write(self, at, data):
        raw = np.frombuffer(np.ascontiguousarray(data).tobytes(), dtype=np.uint8)
        assert at % 16 == 0 and len(raw) == 16, (at, len(raw))  # every store here is one 16-byte chunk
        self.b[at:at + 16] = raw

    def row16(self, at):  # 8 b16 elements of a 16-byte ldmatrix row
        assert at % 16 == 0, at
        return self.b[at:at + 16].view(np.uint16)


def ldmatrix_x4(sm, addrs, trans):
    """addrs[lane]: the row address lane gives (lanes 8i.. give matrix i's rows). Returns regs[lane][i] as pairs of
    b16 (low, high) per the PTX layout: non-trans lane l holds (row l/4, cols 2(l%4), +1) of matrix i; .trans
    holds (rows 2(l%4), +1, col l/4)."""
    mats = [np.stack([sm.row16(addrs[8 * i + r]) for r in range(8)]) for i in range(4)]
    regs = [[None] * 4 for _ in range(32)]
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            m = mats[i]
            regs[lane][i] = (m[g, 2 * t], m[g, 2 * t + 1]) if not trans else (m[2 * t, g], m[2 * t + 1, g])
    return regs


def to_f(bits):
    return (np.uint32(bits) << np.uint32(16)).view(np.float32) if np.isscalar(bits) else \
        (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


def mma(acc, a, b0, b1):
    """acc[lane][4] += A(16x16) * B(16x8) from the lanes' fragments (PTX m16n8k16 .row.col layouts)."""
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for r, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[row, col], A[row, col + 1] = to_f(a[lane][r][0]), to_f(a[lane][r][1])
        for r, k in enumerate([2 * t, 2 * t + 8]):
            pair = (b0 if r == 0 else b1)[lane]
            B[k, g], B[k + 1, g] = to_f(pair[0]), to_f(pair[1])
    D = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        acc[lane] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]


def run_cta(bx, by, bz, per_split, x_bits, codes, absmax, shift, M, rows, cols, backward, out):
    n_out, k_red = (cols, rows) if backward else (rows, cols)
    n0, m0 = bx * TILE_N, by * TILE_M
    k_tiles = (k_red + TILE_K - 1) // TILE_K
    kt0 = bz * per_split
    stages = min(k_tiles - kt0, per_split)
    sm = Smem()
    half_cols = cols // 2
    x_flat = x_bits.reshape(-1)
    codes_flat = codes.reshape(-1)

    def thread_consts(tid):
        x_row, x_chunk = tid >> 3, tid & 7
        x_rows = int(np.clip((M - m0 - x_row + 31) // 32 if M - m0 - x_row + 31 >= 0 else 0, 0, 4))
        r, part = code_slot(backward, tid)
        row0 = 64 * kt0 + r if backward else n0 + r
        col0 = n0 + 32 * part if backward else 64 * kt0 + 32 * part
        return x_row, x_chunk, x_rows, r, part, row0, col0

    consts = [thread_consts(t) for t in range(THREADS)]

    def code_valid(c, s):
        row0, col0 = c[5], c[6]
        return (row0 + 64 * s if backward else row0) < rows and col0 < cols

    def issue(s):  # stage s's copies, every thread
        if s >= stages:
            return
        slot = (s % STAGES) * STAGE_BYTES
        for tid in range(THREADS):
            c = consts[tid]
            x_row, x_chunk, x_rows = c[0], c[1], c[2]
            cols_ok = 64 * (kt0 + s) + 8 * x_chunk < k_red
            for j in range(4):
                ok = j < x_rows and cols_ok
                dst = slot + swizzle128(x_row, x_chunk) + 4096 * j
                if ok:
                    e = (m0 + x_row + 32 * j) * k_red + 64 * kt0 + 8 * x_chunk + TILE_K * s
                    sm.write(dst, x_flat[e:e + 8])
                else:
                    sm.write(dst, np.zeros(8, np.uint16))
            ok = code_valid(c, s)
            step = 64 * half_cols if backward else 32
            byte = c[5] * half_cols + c[6] // 2 + step * s
            sm.write(slot + X_TILE + 16 * tid, codes_flat[byte:byte + 16] if ok else np.zeros(16, np.uint8))

    def scale(c, s):
        if not code_valid(c, s):
            return np.float32(0)
        elem_step = 64 * cols if backward else 64
        return absmax[(c[5] * cols + c[6] + elem_step * s) >> shift]

    acc = {w: np.zeros((32, 4, 4, 4)) for w in range(8)}  # [lane][i][j][e]
    issue(0)
    issue(1)
    for s in range(stages):
        issue(s + 2)  # (after the barrier in the kernel; here copies are instantaneous)
        slot = (s % STAGES) * STAGE_BYTES
        for tid in range(THREADS):  # dequantize
            c = consts[tid]
            r, part = c[3], c[4]
            cb = sm.b[slot + X_TILE + 16 * tid: slot + X_TILE + 16 * tid + 16]
            sc = scale(c, s)
            vals = np.empty(32, np.float32)
            vals[0::2] = NF4[cb >> 4] * sc
            vals[1::2] = NF4[cb & 15] * sc
            bits = bf16_bits(vals)
            for j in range(4):
                chunk = 4 * part + j
                at = W_TILE_OFF + (swizzle256(r, chunk) if backward else swizzle128(r, chunk))
                sm.write(at, bits[8 * j:8 * j + 8])
        for warp in range(8):
            wm, wn = warp >> 2, warp & 3
            for kk in range(TILE_K // 16):
                a = []
                for i in range(4):
                    addrs = [slot + swizzle128(64 * wm + (l & 15) + 16 * i, 2 * kk + (l >> 4)) for l in range(32)]
                    a.append(ldmatrix_x4(sm, addrs, False))
                b = [None] * 4
                for jp in range(2):
                    if backward:  # k row, output chunk
                        addrs = [W_TILE_OFF + swizzle256(16 * kk + (l & 7) + 8 * ((l >> 3) & 1),
                                                         4 * wn + (l >> 4) + 2 * jp) for l in range(32)]
                    else:  # output row, k chunk
                        addrs = [W_TILE_OFF + swizzle128(32 * wn + 8 * (l >> 4) + (l & 7) + 16 * jp,
                                                         2 * kk + ((l >> 3) & 1)) for l in range(32)]
                    rr = ldmatrix_x4(sm, addrs, backward)
                    b[2 * jp] = ([rr[l][0] for l in range(32)], [rr[l][1] for l in range(32)])
                    b[2 * jp + 1] = ([rr[l][2] for l in range(32)], [rr[l][3] for l in range(32)])
                for i in range(4):
                    for j in range(4):
                        view = acc[warp][:, i, j, :]
                        mma(view, a[i], b[j][0], b[j][1])
    for warp in range(8):  # epilogue: raw sums into out[split]
        wm, wn = warp >> 2, warp & 3
        for lane in range(32):
            for i in range(4):
                for e2 in range(2):
                    m = m0 + 64 * wm + 16 * i + (lane >> 2) + 8 * e2
                    if m >= M:
                        continue
                    for j in range(4):
                        n = n0 + 32 * wn + 8 * j + 2 * (lane & 3)
                        for e in range(2):
                            if n + e < n_out:
                                out[bz, m, n + e] = acc[warp][lane, i, j, 2 * e2 + e]


def split_plan(M, n_out, k_red, sms=132):
    tiles = -(-n_out // TILE_N) * -(-M // TILE_M)
    k_tiles = -(-k_red // TILE_K)
    splits = 1
    if tiles < sms:
        splits = int(np.clip(2 * sms // max(tiles, 1), 1, max(1, k_tiles // 4)))
    per = -(-k_tiles // splits)
    return -(-k_tiles // per), per


def check(M, N, K, backward, block, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, size=(N, K // 2), dtype=np.uint8)
    absmax = rng.uniform(0.5, 2.0, size=-(-N * K // block)).astype(np.float32)  # blocks run on across rows
    shift = block.bit_length() - 1
    wd = np.empty((N, K), np.float32)
    wd[:, 0::2] = NF4[codes >> 4]
    wd[:, 1::2] = NF4[codes & 15]
    wd = bf16_round(wd * np.repeat(absmax, block)[:N * K].reshape(N, K))
    k_red, n_out = (N, K) if backward else (K, N)
    x = bf16_round(rng.standard_normal((M, k_red)).astype(np.float32))
    ref = x.astype(np.float64) @ (wd.astype(np.float64) if backward else wd.T.astype(np.float64))
    splits, per = split_plan(M, n_out, k_red)
    out = np.full((splits, M, n_out), np.nan)
    for bz in range(splits):
        for by in range(-(-M // TILE_M)):
            for bx in range(-(-n_out // TILE_N)):
                run_cta(bx, by, bz, per, bf16_bits(x), codes, absmax, shift, M, N, K, backward, out)
    got = out.sum(axis=0)
    err = np.max(np.abs(got - ref)) if got.size else 0.0
    ok = np.all(np.isfinite(got)) and err <= 1e-6 * max(1.0, np.max(np.abs(ref)))
    print(f"{'backward' if backward else 'forward '} M={M} N={N} K={K} block={block} splits={splits}: "
          f"max |err| {err:.3g} {'ok' if ok else 'FAIL'}")
    return ok


def main():
    cases = [(1, 1, 64, False, 64), (7, 130, 128, False, 64), (65, 257, 192, False, 128), (130, 70, 256, False, 256),
             (129, 9, 128, False, 64),
             (7, 130, 1024, False, 64),
             (1, 8, 64, True, 64), (7, 200, 192, True, 64), (130, 72, 320, True, 64), (65, 136, 256, True, 128),
             (7, 520, 128, True, 64)]
    ok = all(check(*c, seed=i) for i, c in enumerate(cases))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
