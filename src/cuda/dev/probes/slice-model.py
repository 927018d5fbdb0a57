#!/usr/bin/env python3
"""CPU model of the small-M slice kernel (nf4_small_m_slice_kernel in src/cuda/nf4/nf4_slice_kernel.cuh, host side
slice_launch in src/cuda/nf4/nf4_slice.cu): runs the kernel's schedule and per-lane arithmetic over a byte model of
its ring stages (the copies PairIssue makes, pair_piece's swizzle, the lanes' code and scale reads), the pair
table's lookups, mma.m16n8k16 from the PTX ISA's fragment layouts, the scale after each block, the sums in shared
memory and each pass's reduction, and compares the outputs (C, or gate, up and h; split-K partials through the
reduction) with the scale-after contract computed directly in float64. It checks the schedule (every row group and
slice once, every sum read where it was written, inside the shared memory the host asks for) and the index mapping
without a GPU; cp.async, the PTX and the timing are the GPU tests' and the bench's business.
  src/cuda/dev/probes/slice-model.py      (a fixed list of ragged shapes, one and two weights, both scale formats)
Needs numpy."""
import sys

import numpy as np

NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], dtype=np.float32)

# The kernel's constants (nf4_pair_kernel.cuh, nf4_slice_kernel.cuh) and the limits of an sm_90 GPU with 132 SMs.
WARPS, SLICE_K, DEPTH, MAX_ROWS = 16, 256, 3, 16
ROW_BYTES, CODE_BYTES = 128, 16 * 128
STEP_BYTES = CODE_BYTES + 16 * 16
TABLE_BYTES, CODE2_BYTES = 65536, 1024
FIXED = TABLE_BYTES + 2 * CODE2_BYTES + (WARPS + 1) * DEPTH * STEP_BYTES
SMS, OPTIN = 132, 232448


def bf16_round(a):
    """float32 -> bf16 values (nearest even), as float32."""
    u = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    one, sixteen = np.uint64(1), np.uint64(16)
    u = (u + np.uint64(0x7FFF) + ((u >> sixteen) & one)) & np.uint64(0xFFFF0000)
    return u.astype(np.uint32).view(np.float32)


def slice_launch(m, n, k, weights, sms=SMS, optin=OPTIN):
    """The host's grid (slice_launch), as a dict."""
    slices = k // SLICE_K
    splits = (slices + WARPS - 1) // WARPS
    per_split = (slices + splits - 1) // splits
    wr = WARPS // per_split
    groups = weights * ((n + 15) // 16)
    per_split_blocks = max(1, sms // splits)
    gpb = (groups + per_split_blocks - 1) // per_split_blocks
    gpb += gpb % weights
    blocks = (groups + gpb - 1) // gpb
    group_sum_bytes = per_split * 16 * m * 4
    needed = (gpb + wr - 1) // wr
    pass_iters = max(1, min((optin - FIXED) // (group_sum_bytes * wr), needed))
    if weights == 2 and pass_iters * wr % 2 == 1 and pass_iters < needed:
        pass_iters = pass_iters - 1 if pass_iters > 1 else 2
    pass_groups = pass_iters * wr
    return dict(weights=weights, slices=slices, per_split=per_split, wr=wr, groups=groups, gpb=gpb,
                pass_groups=pass_groups, splits=splits, blocks=blocks, smem=FIXED + pass_groups * group_sum_bytes,
                sums_floats=pass_groups * group_sum_bytes // 4)


class Weight:
    """An NF4 weight [n, k] in blocks of 64: codes (two per byte, first element in the high nibble) and scales,
    plain (absmax) or double-quantized (q, absmax2 per 256 blocks, code2, offset)."""

    def __init__(self, rng, n, k, dq):
        self.n, self.k, self.dq = n, k, dq
        self.codes = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
        blocks = n * k // 64
        if dq:
            self.q = rng.integers(0, 256, size=blocks, dtype=np.uint8)
            self.absmax2 = rng.uniform(0.5, 1.0, size=(blocks + 255) // 256).astype(np.float32)
            self.code2 = rng.uniform(-1, 1, size=256).astype(np.float32)
            self.offset = np.float32(0.03125)
        else:
            self.absmax = rng.uniform(0.1, 1.0, size=blocks).astype(np.float32)

    def scale(self, block):
        """The block's scale in the CPU's operation order (no fused multiply-add)."""
        if not self.dq:
            return self.absmax[block]
        return np.float32(np.float32(self.code2[self.q[block]] * self.absmax2[block >> 8]) + self.offset)

    def values(self):
        """bf16(code value) as [n, k] float32."""
        hi, lo = self.codes >> 4, self.codes & 15
        return bf16_round(NF4[np.stack([hi, lo], axis=2).reshape(self.n, self.k)])


def reference(a_bf16, w):
    """The scale-after contract in float64: sum over blocks of scale * sum(a * bf16(code))."""
    v = w.values().astype(np.float64).reshape(w.n, w.k // 64, 64)
    a = a_bf16.astype(np.float64).reshape(a_bf16.shape[0], w.k // 64, 64)
    part = np.einsum("mbj,nbj->mnb", a, v)
    scales = np.array([[w.scale(r * (w.k // 64) + b) for b in range(w.k // 64)] for r in range(w.n)],
                      dtype=np.float64)
    return (part * scales[None]).sum(axis=2)


def pair_piece(r, p):
    return p ^ (2 * (r & 3))


def ring_stage(w, n0, slice_index):
    """One ring stage as the kernel's issue fills it (one slice of 256 k at row n0): bytes [STEP_BYTES]. The
    kernel's offsets (copy_code, copy_swap, copy_scale) are checked against the pair kernel's layout (pair_piece;
    the scale slot as PairIssue fills it) on the way."""
    stage = np.zeros(STEP_BYTES, dtype=np.uint8)
    kb = w.k // 64
    for lane in range(32):
        r, h = lane >> 1, lane & 1
        copy_code = ROW_BYTES * r + 64 * (h ^ ((r >> 1) & 1))
        copy_swap = 32 * (r & 1)
        copy_scale = CODE_BYTES + 16 * r + (4 if w.dq else 8) * h
        row = n0 + r
        if row >= w.n:
            continue  # cp.async with source size 0: zeros
        at = row * w.k + slice_index * SLICE_K  # the row's first element of the slice
        src = w.codes.reshape(-1)[(at >> 1) + 64 * h:][:64]
        for p in range(4):
            dst = copy_code + ((16 * p) ^ copy_swap)
            assert dst == ROW_BYTES * r + 16 * pair_piece(r, 4 * h + p), "copy offsets off the pair layout"
            stage[dst:dst + 16] = src[16 * p:16 * p + 16]
        b = at >> 6  # the slice's first block
        assert b == row * kb + 4 * slice_index
        assert copy_scale == CODE_BYTES + 16 * r + (4 if w.dq else 8) * (lane & 1)
        if w.dq:
            src = np.frombuffer(w.absmax2[b >> 8].tobytes(), dtype=np.uint8) if h else w.q[b:b + 4]
            stage[copy_scale:copy_scale + 4] = src
        else:
            stage[copy_scale:copy_scale + 8] = np.frombuffer(w.absmax[b + 2 * h:b + 2 * h + 2].tobytes(),
                                                             dtype=np.uint8)
    return stage


def words(stage, at, count):
    return np.frombuffer(stage[at:at + 4 * count].tobytes(), dtype=np.uint32)


NF4_BF16 = None  # bf16(NF4), set in main


def pair_table_entry(byte):
    """The pair table's entry for a code byte: (low half, high half) = bf16 values of (high nibble, low nibble)."""
    return NF4_BF16[byte >> 4], NF4_BF16[byte & 15]


def mma(a_frag, b_frag, c):
    """mma.m16n8k16 (bf16 in, fp32 accumulate) from per-lane fragments (PTX ISA layouts): a_frag [32][4] pairs,
    b_frag [32][2] pairs, c [32][4] accumulators, updated in place."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for r, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[row, col:col + 2] = a_frag[lane][r]
        for r, k0 in enumerate([2 * t, 2 * t + 8]):
            B[k0:k0 + 2, g] = b_frag[lane][r]
    D = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for r, (row, col) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
            c[lane][r] = np.float32(c[lane][r] + D[row, col])


def run_kernel(a_bf16, ws, L):
    """The kernel over the whole grid; returns the outputs per weight [M, N] (after the reduction with split K)."""
    m, k = a_bf16.shape
    n = ws[0].n
    W, wr_count, per_split = L["weights"], L["wr"], L["per_split"]
    pass_groups, pass_rows = L["pass_groups"], 16 * L["pass_groups"]
    pass_iters = pass_groups // wr_count
    nt8 = 1 if m <= 8 else 2  # n8 tiles of A rows
    partial = np.full((W, L["splits"], m, n), np.nan)
    covered = np.zeros((L["groups"], L["slices"]), dtype=int)
    for split in range(L["splits"]):
        slice0 = split * per_split
        slices_here = min(per_split, L["slices"] - slice0)
        for block in range(L["blocks"]):
            g_begin = block * L["gpb"]
            g_end = min(L["groups"], g_begin + L["gpb"])
            passes = (g_end - g_begin + pass_groups - 1) // pass_groups
            sums = np.full(L["sums_floats"], np.nan)
            for p in range(passes):
                for warp in range(WARPS):
                    wk, wr = warp % per_split, warp // per_split
                    if not (wr < wr_count and wk < slices_here):
                        continue
                    span = g_end - g_begin
                    full, rem = divmod(span, pass_groups)
                    n_mine = full * pass_iters + ((rem - wr + wr_count - 1) // wr_count if rem > wr else 0)
                    s_index = slice0 + wk
                    # B fragments: lane (g, t), block c, tile jt, word q: A[8 jt + g][256 s + 64 c + 16 t + 2q, +1]
                    # (zero past M)
                    bf = np.zeros((32, 4, nt8, 8, 2), dtype=np.float32)
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        for jt in range(nt8):
                            if 8 * jt + g < m:
                                for c in range(4):
                                    x = a_bf16[8 * jt + g, SLICE_K * s_index + 64 * c + 16 * t:][:16]
                                    bf[lane, c, jt] = x.reshape(8, 2)
                    for j in range(pass_iters):
                        i = p * pass_iters + j
                        if i >= n_mine:
                            break
                        v = g_begin + wr + wr_count * i  # the kernel's: a pass's groups are consecutive
                        assert v == g_begin + p * pass_groups + wr + wr_count * j
                        which, n0 = v % W, 16 * (v // W)
                        covered[v, s_index] += 1
                        w = ws[which]
                        stage = ring_stage(w, n0, s_index)
                        acc = np.zeros((32, nt8, 4), dtype=np.float32)
                        part = [[np.zeros((32, 4), dtype=np.float32) for _ in range(nt8)] for _ in range(4)]
                        sw = np.zeros((32, 2, 4), dtype=np.uint32)
                        cw = np.zeros((32, 4, 4), dtype=np.uint32)
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            for half in range(2):
                                sw[lane, half] = words(stage, CODE_BYTES + 16 * (g + 8 * half), 4)
                                for c in range(4):
                                    # the kernel's: from lane_code = 128 g + 16 (t >> 1) + 8 (t & 1), piece_swap
                                    at = (ROW_BYTES * g + 16 * (t >> 1) + 8 * (t & 1)) + ROW_BYTES * 8 * half + \
                                        ((32 * c) ^ (32 * (g & 3)))
                                    assert at == ROW_BYTES * (g + 8 * half) + 16 * pair_piece(g, 2 * c + (t >> 1)) + \
                                        8 * (t & 1), "code reads off the pair layout"
                                    cw[lane, c, 2 * half:2 * half + 2] = words(stage, at, 2)
                        for s in range(4):
                            for c in range(4):
                                a_frag = [[None] * 4 for _ in range(32)]
                                for lane in range(32):
                                    for r in range(4):
                                        word = int(cw[lane, c, (r & 1) * 2 + (s >> 1)])
                                        b = 2 * (s & 1) + (r >> 1)
                                        a_frag[lane][r] = pair_table_entry((word >> (8 * b)) & 0xFF)
                                for jt in range(nt8):
                                    b_frag = [[bf[ln, c, jt, 2 * s], bf[ln, c, jt, 2 * s + 1]] for ln in range(32)]
                                    mma(a_frag, b_frag, part[c][jt])
                        # double-quantized: lane (g, t) forms block t's scales of its rows, the others shuffle them
                        lane_sc = np.zeros((32, 2), dtype=np.float32)
                        if w.dq:
                            for lane in range(32):
                                for half in range(2):
                                    q = (int(sw[lane, half, 0]) >> (8 * (lane & 3))) & 0xFF
                                    am2 = sw[lane, half, 1:2].view(np.float32)[0]
                                    lane_sc[lane, half] = np.float32(np.float32(w.code2[q] * am2) + w.offset)
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            for c in range(4):
                                sc = []
                                for half in range(2):
                                    if w.dq:
                                        sc.append(lane_sc[(lane & ~3) | c, half])
                                    else:
                                        sc.append(sw[lane, half, c:c + 1].view(np.float32)[0])
                                for jt in range(nt8):
                                    for r in range(4):
                                        acc[lane, jt, r] = np.float32(acc[lane, jt, r] +
                                                                      np.float32(sc[r >> 1] * part[c][jt][lane, r]))
                            rl = 16 * (wr + wr_count * j)
                            for jt in range(nt8):
                                for r in range(4):
                                    mm = 8 * jt + 2 * t + (r & 1)
                                    if mm < m:
                                        idx = (wk * pass_rows + rl + g + 8 * (r >> 1)) * m + mm
                                        assert np.isnan(sums[idx]), "a sum written twice in one pass"
                                        sums[idx] = acc[lane, jt, r]
                # the pass's reduction (write_slice_pass)
                group0 = g_begin + p * pass_groups
                groups_here = min(pass_groups, g_end - group0)
                assert groups_here % W == 0, "a pass splits a row's gate and up"
                for rr in range(16 * groups_here // W):
                    q, r = rr >> 4, rr & 15
                    row = 16 * (group0 // W + q) + r
                    if row >= n:
                        continue
                    for wt in range(W):
                        for mm in range(m):
                            total = np.float32(0)
                            for kk in range(slices_here):
                                val = sums[(kk * pass_rows + 16 * (W * q + wt) + r) * m + mm]
                                assert not np.isnan(val), "a sum read before it was written"
                                total = np.float32(total + val)
                            assert np.isnan(partial[wt, split, mm, row]), "an output written twice"
                            partial[wt, split, mm, row] = total
                sums[:] = np.nan
    assert (covered == 1).all(), "a row group and slice not computed exactly once"
    assert not np.isnan(partial).any(), "an output never written"
    return partial.sum(axis=1)  # the split-K reduction (in split order; float64 here)


def check(m, n, k, weights, dq, seed, sms=SMS, min_passes=1):
    """One case against the reference; fewer SMs than SMS give a small N the schedule of a large one."""
    rng = np.random.default_rng(seed)
    L = slice_launch(m, n, k, weights, sms=sms)
    assert L["smem"] <= OPTIN, "more shared memory than a block gets"
    ws = [Weight(rng, n, k, dq) for _ in range(weights)]
    a = bf16_round(rng.uniform(-1, 1, size=(m, k)).astype(np.float32))
    got = run_kernel(a, ws, L)
    worst = 0.0
    for wt, w in enumerate(ws):
        ref = reference(a, w)
        err = np.abs(got[wt] - ref) / (np.abs(ref).max() + 1e-30)
        worst = max(worst, err.max())
    passes = -(-L["gpb"] // L["pass_groups"])
    ok = worst < 1e-5 and passes >= min_passes
    print(f"M {m:2d} N {n:5d} K {k:5d} weights {weights} dq {int(dq)} on {sms} SMs: splits {L['splits']} per_split "
          f"{L['per_split']} warps/slice {L['wr']} blocks {L['blocks']} groups/block {L['gpb']} pass "
          f"{L['pass_groups']} ({passes} per block) smem {L['smem']} | {'ok' if ok else 'FAIL'} (worst {worst:.1e})")
    return ok


def main():
    global NF4_BF16
    NF4_BF16 = bf16_round(NF4)
    shapes = [(1, 1, 256), (8, 17, 256), (3, 65, 1536), (7, 33, 3328), (5, 20, 4352), (2, 18, 1280), (8, 40, 768),
              (9, 17, 512), (16, 33, 1280), (13, 20, 4352)]
    ok = True
    for seed, (m, n, k) in enumerate(shapes):
        for weights in (1, 2):
            ok &= check(m, n, k, weights, dq=seed % 2 == 1, seed=seed)
    # Several passes per block: few SMs (the same schedule a large N gives the full GPU), one and two n8 tiles.
    for m in (8, 16):
        for weights in (1, 2):
            ok &= check(m, 300, 4096, weights, dq=True, seed=99, sms=2, min_passes=2)
    print("all ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
