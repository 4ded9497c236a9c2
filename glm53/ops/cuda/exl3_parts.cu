// EXL3 decode form, the split sums: fp32 parts of y = xr @ W_hat for up to 16 rows, W_hat decoded from
// the trellis in registers straight into mma.sync B fragments (glm53/ops/cuda_exl3.py launches it; the
// Triton kernels of glm53/ops/triton_exl3.py finish each block: the ordered sum of the splits, the output
// rotation, SiLU, the experts' weighted sum).
//
// Why CUDA: the format's TENSOR_CORE_PERM puts the 8 values one lane holds of a 16x16 tile's two
// m16n8k16 B fragments at 8 consecutive stream positions, so a lane decodes its fragments from 2-3 words
// it loads itself and hands them to the MMA in registers. Triton picks the operand layout itself and
// moves a computed operand through shared memory (docs/decisions/exl3-decode-form.md).
//
// Bits: a program's part is triton_exl3's _one_split, operation for operation: the same values (the
// codebooks below round each value once, as glm53/exl3/decode.py does), the same m16n8k16 MMAs (fp16
// in, fp32 accumulate) in the same k16 order from zero at the split's first step. A row's part depends
// on its own inputs only (rows of an MMA never mix). triton_exl3.forms_agree checks it per device.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int HAD = 128;          // the Hadamard block: a step's rows and a program's output columns
constexpr int SPLIT_STEPS = 8;    // triton_exl3.SPLIT_STEPS
constexpr int ROWS = 16;          // the decode tile (triton_exl3.DECODE.bm)
constexpr int WARPS = 4;          // a program: 4 warps, 128 output columns (the Hadamard block)
constexpr int TILES = 2;          // 16-column tiles a warp
constexpr int R = 4;              // tile rows a chunk of loads (the next chunk's words load while one decodes)
constexpr int LDA = SPLIT_STEPS * HAD + 8;  // halves between the inputs' rows in shared memory (+8: ldmatrix
                                            // rows fall on different banks)

// glm53.exl3.bank.TABLE_FIELDS
enum Field { BASE, STRIDE_R, STEP_KB, STEP_NB, BITS2, CODEBOOK, SUH, SUH_STEP, SVH, SVH_STEP, IN_READ, OUT_READ,
             NF };

// The end (exclusive) of value p's window in the tile's bit stream, in bits: K bits a value, K = bits2 / 2
// (half-integer K: values alternate floor and ceil), the window the 16 bits ending there.
__host__ __device__ constexpr int value_end(int p, int bits2) {
    return ((p + 1) * bits2 - ((p + 1) & 1) * (bits2 & 1)) / 2;
}

__device__ __forceinline__ uint32_t as_u32(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ half2 as_h2(uint32_t u) { return *reinterpret_cast<half2*>(&u); }

// Two values (fp16 pair, first in the low half) from their 16-bit states: glm53/exl3/decode.py's codebooks.
// CB 0 3inst, 1 mcg: the hash's two fp16 halves (exponents 2^-3..2^0) added, one rounding; 2 mul1: the
// hash's byte sum + 1024 (exact in fp16: 0x6400 is 1024) times 1/147.7 plus -10.38 as one fp16 FMA.
template <int CB>
__device__ __forceinline__ uint32_t decode_pair(uint32_t s0, uint32_t s1) {
    if constexpr (CB == 2) {
        uint32_t h0 = __dp4a(s0 * 0x83DCD12Du, 0x01010101u, 0x6400u);
        uint32_t h1 = __dp4a(s1 * 0x83DCD12Du, 0x01010101u, 0x6400u);
        half2 h = as_h2(__byte_perm(h0, h1, 0x5410));
        return as_u32(__hfma2(h, as_h2(0x1EEE1EEEu), as_h2(0xC931C931u)));
    } else {
        uint32_t x0 = CB == 0 ? s0 * 89226354u + 64248484u : s0 * 0xCBAC1FEDu;
        uint32_t x1 = CB == 0 ? s1 * 89226354u + 64248484u : s1 * 0xCBAC1FEDu;
        x0 = (x0 & 0x8FFF8FFFu) ^ 0x3B603B60u;
        x1 = (x1 & 0x8FFF8FFFu) ^ 0x3B603B60u;
        return as_u32(__hadd2(as_h2(__byte_perm(x0, x1, 0x5410)), as_h2(__byte_perm(x0, x1, 0x7632))));
    }
}

// The 16-bit state `dist` bits past the top of hi:lo (dist <= 48).
template <int DIST>
__device__ __forceinline__ uint32_t state_at(uint32_t hi, uint32_t lo) {
    if constexpr (DIST <= 16) {
        return (hi >> (16 - DIST)) & 0xFFFFu;
    } else {
        return __funnelshift_r(lo, hi, 48 - DIST) & 0xFFFFu;
    }
}

// A lane's 8 values of one 16x16 tile as its B fragments: b[0], b[1] for output columns 0-7 (rows 2q, 2q+1
// and 2q+8, 2q+9 of the tile, q = lane % 4, column lane / 4), b[2], b[3] for columns 8-15.
template <int BITS2, int CB>
__device__ __forceinline__ void decode_fragments(uint32_t a, uint32_t b, uint32_t c, int offset, uint32_t frag[4]) {
    constexpr int E0 = value_end(0, BITS2);
    uint32_t hi = __funnelshift_l(b, a, offset);  // the lane's stream from its first window on
    uint32_t lo = __funnelshift_l(c, b, offset);
    frag[0] = decode_pair<CB>(state_at<0>(hi, lo), state_at<value_end(1, BITS2) - E0>(hi, lo));
    frag[1] = decode_pair<CB>(state_at<value_end(2, BITS2) - E0>(hi, lo), state_at<value_end(3, BITS2) - E0>(hi, lo));
    frag[2] = decode_pair<CB>(state_at<value_end(4, BITS2) - E0>(hi, lo), state_at<value_end(5, BITS2) - E0>(hi, lo));
    frag[3] = decode_pair<CB>(state_at<value_end(6, BITS2) - E0>(hi, lo), state_at<value_end(7, BITS2) - E0>(hi, lo));
}

__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t a[4], const __half* p) {
    uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(addr));
}

// The warp's columns (TILES 16-column tiles) of one split: acc[tile][half][4] += the inputs in shared memory
// (rows 0-15, columns from the split's first step) times the decoded tiles, k16 by k16 in order. The split's
// tile rows run in chunks of R; a chunk's words (R x TILES x 3) are loaded before the previous chunk decodes.
// (Measured, H100, a token's 256-expert layer: 2 tiles x 4 rows 201 us; 2 x 8 271; 1 x 8 231; 1 x 4 224:
// docs/decisions/exl3-decode-form.md.)
template <int BITS2, int CB>
__device__ __forceinline__ void split_sum(const int32_t* __restrict__ words, const int64_t* __restrict__ row,
                                          int nb, int col_tile, int first, int last, const __half* sx,
                                          float acc[TILES][2][4]) {
    constexpr int W = 4 * BITS2;  // int32 words a tile
    const int lane = threadIdx.x & 31;
    const int start = value_end(8 * lane, BITS2) - 16 + 128 * BITS2;  // the lane's first window; one stream ahead
    const int w0 = (start >> 5) % W, offset = start & 31;
    const int w1 = w0 + 1 == W ? 0 : w0 + 1, w2 = w1 + 1 == W ? 0 : w1 + 1;
    const int64_t stride_r = row[STRIDE_R] / 2, step_kb = row[STEP_KB] / 2;
    const int32_t* block = words + (row[BASE] + nb * row[STEP_NB]) / 2 + first * step_kb + col_tile * W;
    // ldmatrix x4: lanes 0-15 give rows 0-15 at k, lanes 16-31 the same rows at k + 8
    const __half* sa = sx + (lane & 15) * LDA + (lane >> 4) * 8;
    const int chunks = (last - first) * 8 / R;
    auto load = [&](uint32_t (&buf)[R][TILES][3], int chunk) {
        const int kt = chunk * R;
        const int32_t* rows = block + (kt >> 3) * step_kb + (kt & 7) * stride_r;
#pragma unroll
        for (int i = 0; i < R; ++i) {
#pragma unroll
            for (int t = 0; t < TILES; ++t) {
                const int32_t* tile = rows + i * stride_r + t * W;
                buf[i][t][0] = __ldg(tile + w0);
                buf[i][t][1] = __ldg(tile + w1);
                buf[i][t][2] = __ldg(tile + w2);
            }
        }
    };
    auto compute = [&](const uint32_t (&buf)[R][TILES][3], int chunk) {
#pragma unroll
        for (int i = 0; i < R; ++i) {
            uint32_t a[4];
            ldmatrix_x4(a, sa + (chunk * R + i) * 16);
#pragma unroll
            for (int t = 0; t < TILES; ++t) {
                uint32_t frag[4];
                decode_fragments<BITS2, CB>(buf[i][t][0], buf[i][t][1], buf[i][t][2], offset, frag);
                mma_16816(acc[t][0], a, frag[0], frag[1]);
                mma_16816(acc[t][1], a, frag[2], frag[3]);
            }
        }
    };
    uint32_t even[R][TILES][3], odd[R][TILES][3];
    load(even, 0);
    for (int c = 0; c < chunks; c += 2) {
        if (c + 1 < chunks) load(odd, c + 1);
        compute(even, c);
        if (c + 1 < chunks) {
            if (c + 2 < chunks) load(even, c + 2);
            compute(odd, c + 1);
        }
    }
}

template <int CB>
__device__ __forceinline__ void split_sum_any(int bits2, const int32_t* words, const int64_t* row, int nb,
                                              int col_tile, int first, int last, const __half* sx,
                                              float acc[TILES][2][4]) {
    switch (bits2) {
        case 4: split_sum<4, CB>(words, row, nb, col_tile, first, last, sx, acc); break;
        case 5: split_sum<5, CB>(words, row, nb, col_tile, first, last, sx, acc); break;
        case 6: split_sum<6, CB>(words, row, nb, col_tile, first, last, sx, acc); break;
        case 7: split_sum<7, CB>(words, row, nb, col_tile, first, last, sx, acc); break;
        default: split_sum<8, CB>(words, row, nb, col_tile, first, last, sx, acc); break;
    }
}

// Program (group, output block nb, split * n_proj + projection): the split's part of the group's rows.
// mode 0: one matrix (mat_p0), rows group * 16 + r < rows of xr. mode 1: tokens' MLP slots (T tokens, K routed
// experts each from ids, then the shared expert as id `shared` when has_shared): the group is slot g (token
// g / KP, place g % KP), it runs when g is its expert's first slot, and takes every token routed to that
// expert, token r in tile row r (slot r * KP + place). The matrix of projection p: the expert's (mat_p + e) or
// the shared one's (shared_p). Inputs: xr + p * xr_proj + slot * in_width; parts: ws + split * split_stride +
// slot * out_stride + p * proj_cols + nb * 128.
template <int CB>
__device__ __forceinline__ void split_parts(const int32_t* __restrict__ words, const int64_t* __restrict__ table,
                                            const __half* __restrict__ xr, float* __restrict__ ws, int mode, int rows,
                                            const int64_t* __restrict__ ids, int stride_ids, int T, int K, int shared,
                                            int has_shared, int mat_p0, int mat_p1, int shared_p0, int shared_p1,
                                            int n_proj, int in_width, long long xr_proj, int out_stride, int proj_cols,
                                            long long split_stride) {
    __shared__ __align__(16) __half sx[ROWS * LDA];
    __shared__ int slot_of[ROWS];
    __shared__ int first_slot;
    const int g = blockIdx.x, nb = blockIdx.y;
    const int split = blockIdx.z / n_proj, p = blockIdx.z % n_proj;
    int e = 0;
    if (mode == 1) {
        const int kp = K + has_shared;
        const int tok = g / kp, place = g % kp;
        e = place < K ? static_cast<int>(ids[tok * stride_ids + place]) : shared;
        if (threadIdx.x == 0) first_slot = 1 << 30;
        __syncthreads();
        if (threadIdx.x < ROWS) {
            const int r = threadIdx.x;
            int slot = -1;
            for (int c = 0; r < T && c < kp; ++c) {
                const int id = c < K ? static_cast<int>(ids[r * stride_ids + c]) : shared;
                if (id == e) slot = r * kp + c;
            }
            slot_of[r] = slot;
            if (slot >= 0) atomicMin(&first_slot, slot);
        }
        __syncthreads();
        if (first_slot != g) return;  // another slot of this expert runs its tokens
    } else if (threadIdx.x < ROWS) {
        const int r = g * ROWS + threadIdx.x;
        slot_of[threadIdx.x] = r < rows ? r : -1;
    }
    const bool is_shared = mode == 1 && e == shared;
    const int m = mode == 0 ? mat_p0 : p == 0 ? (is_shared ? shared_p0 : mat_p0 + e) : (is_shared ? shared_p1 : mat_p1 + e);
    const int64_t* row = table + static_cast<int64_t>(m) * NF;
    const int n_steps = static_cast<int>(row[IN_READ] / HAD);
    const int first = split * SPLIT_STEPS, last = min(n_steps, first + SPLIT_STEPS);
    if (first >= last) return;
    __syncthreads();
    // the split's inputs, 16 rows (zeros where no row), 16 bytes a thread a pass
    const int cols = (last - first) * HAD;
    for (int v = threadIdx.x; v < ROWS * (cols / 8); v += blockDim.x) {
        const int r = v / (cols / 8), c = (v % (cols / 8)) * 8;
        const int slot = slot_of[r];
        uint4 val = make_uint4(0, 0, 0, 0);
        if (slot >= 0) {
            val = *reinterpret_cast<const uint4*>(xr + p * xr_proj + static_cast<long long>(slot) * in_width +
                                                  first * HAD + c);
        }
        *reinterpret_cast<uint4*>(sx + r * LDA + c) = val;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float acc[TILES][2][4] = {};
    split_sum_any<CB>(static_cast<int>(row[BITS2]), words, row, nb, warp * TILES, first, last, sx, acc);
    // acc[t][h]: rows lane / 4 (0, 1) and lane / 4 + 8 (2, 3), columns 2 (lane % 4) + {0, 1} of tile t's half h
    float* base = ws + split * split_stride + p * proj_cols + nb * HAD + warp * TILES * 16 + 2 * (lane & 3);
#pragma unroll
    for (int half_row = 0; half_row < 2; ++half_row) {
        const int slot = slot_of[(lane >> 2) + 8 * half_row];
        if (slot < 0) continue;
        float* out = base + static_cast<long long>(slot) * out_stride;
#pragma unroll
        for (int t = 0; t < TILES; ++t) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                *reinterpret_cast<float2*>(out + t * 16 + h * 8) =
                    make_float2(acc[t][h][2 * half_row], acc[t][h][2 * half_row + 1]);
            }
        }
    }
}

}  // namespace

#define EXL3_PARTS_KERNEL(NAME, CB)                                                                             \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME(                                               \
        const int32_t* words, const int64_t* table, const __half* xr, float* ws, int mode, int rows,              \
        const int64_t* ids, int stride_ids, int T, int K, int shared, int has_shared, int mat_p0, int mat_p1,    \
        int shared_p0, int shared_p1, int n_proj, int in_width, long long xr_proj, int out_stride, int proj_cols, \
        long long split_stride) {                                                                                 \
        split_parts<CB>(words, table, xr, ws, mode, rows, ids, stride_ids, T, K, shared, has_shared, mat_p0,      \
                        mat_p1, shared_p0, shared_p1, n_proj, in_width, xr_proj, out_stride, proj_cols,           \
                        split_stride);                                                                            \
    }

EXL3_PARTS_KERNEL(exl3_parts_3inst, 0)
EXL3_PARTS_KERNEL(exl3_parts_mcg, 1)
EXL3_PARTS_KERNEL(exl3_parts_mul1, 2)

// The host side: one launch on the caller's stream (torch's current stream; a CUDA graph captures it), grid
// (groups, n_blocks, n_splits * n_proj). codebook 0, 1 or 2: the bank's one codebook. Returns
// cudaGetLastError's code.
extern "C" int exl3_parts_launch(void* stream, int codebook, int groups, int n_blocks, int n_splits,
                                 const void* words, const void* table, const void* xr, void* ws, int mode, int rows,
                                 const void* ids, int stride_ids, int T, int K, int shared, int has_shared,
                                 int mat_p0, int mat_p1, int shared_p0, int shared_p1, int n_proj, int in_width,
                                 long long xr_proj, int out_stride, int proj_cols, long long split_stride) {
    dim3 grid(groups, n_blocks, n_splits * n_proj), block(WARPS * 32);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    auto w = static_cast<const int32_t*>(words);
    auto tb = static_cast<const int64_t*>(table);
    auto x = static_cast<const __half*>(xr);
    auto o = static_cast<float*>(ws);
    auto id = static_cast<const int64_t*>(ids);
#define EXL3_LAUNCH(NAME)                                                                                       \
    NAME<<<grid, block, 0, s>>>(w, tb, x, o, mode, rows, id, stride_ids, T, K, shared, has_shared, mat_p0,      \
                                mat_p1, shared_p0, shared_p1, n_proj, in_width, xr_proj, out_stride, proj_cols, \
                                split_stride)
    switch (codebook) {
        case 0: EXL3_LAUNCH(exl3_parts_3inst); break;
        case 1: EXL3_LAUNCH(exl3_parts_mcg); break;
        case 2: EXL3_LAUNCH(exl3_parts_mul1); break;
        default: return static_cast<int>(cudaErrorInvalidValue);
    }
#undef EXL3_LAUNCH
    return static_cast<int>(cudaGetLastError());
}

extern "C" const char* exl3_error_string(int code) {
    return cudaGetErrorString(static_cast<cudaError_t>(code));
}
