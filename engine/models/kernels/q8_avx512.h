// int8 × int8 matrix multiply in blocks of 32, for the fast path's int8-fast and int4-fast
// layers on CPUs with AVX-512 VNNI (q8_gemm.cpp; q8_gemm_amx.cpp for fewer rows than AMX takes):
// the activations are quantized to int8 per block of 32 inputs as they arrive (as llama.cpp's
// Q8_0 / Q8_1), and every product of a block is an integer dot product (vpdpbusd), scaled by the
// weight block's and the activation block's scales.
//
// Layouts (contiguous; see "interleaved" below for the weights' order):
//   q8 weights   int8 codes, symmetric (round(w / s)), an fp16 scale s per block of 32 inputs
//   q4 weights   4-bit codes q, w = d · q + m, an fp16 d and m per block of 32 inputs
//   activations  x  float32 or bfloat16 [M, K]; K a multiple of 32
//   output       y  the activations' dtype [M, N] (N padded to a multiple of 16 by the caller)
//
// vpdpbusd multiplies unsigned by signed bytes, so activations are stored as q + 128 (u8) and
// the 128 · Σw each block picks up is taken back (for q8: per weight block, from the same
// instruction with a vector of ones); for q4 the weights are the unsigned side and the
// activations the signed one, the block's activation sum carrying the minimum (Q4_1 · Q8_1).
//
// Each output row y[m] depends on x[m] alone: a batched answer equals the request alone.
// Threads: ATen's pool (torch.set_num_threads), split over the output columns.

#pragma once

#include "q8_common.h"

#define WORKBENCH_AVX512  // attention.h's vector loops use load16 below

namespace {

constexpr bool Q8_OFFSET = true;
constexpr int ROW_TILE = 4, COL_TILE = 2, ROW1_COL_TILE = 2;
constexpr bool FEW_ROWS_TOGETHER = true;  // 5 rows × 2 groups: 10 sums, 10 dots and 4 more of 32 registers

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen_bf16(__m256i raw) {  // 16 bf16 values as fp32 (the same bits, 16 places up)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::BFloat16* p) {
    return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const at::Half* p) {  // the quantized precisions' KV cache (AVX-512F's vcvtph2ps)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Room in out for M rows of K activations.
inline void quantized_room(int64_t M, int64_t K, bool with_sums, QuantizedRows& out) {
    out.codes.resize(M * K);
    out.scales.resize(M * (K / BLOCK));
    if (with_sums) out.sums.resize(M * (K / BLOCK));
}

// Blocks begin … end - 1 of the activations (block i: row i / (K / 32), its (i % (K / 32))th 32),
// into out (sized by quantized_room).
template <typename T>
void quantize_blocks(const T* x, int64_t K, bool offset, bool with_sums, QuantizedRows& out, int64_t begin,
                     int64_t end) {
    const int64_t blocks = K / BLOCK;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t i = begin; i < end; ++i) {
        const int64_t m = i / blocks, b = i % blocks;
        const T* src = x + m * K + b * BLOCK;
        __m512 lo = load16(src), hi = load16(src + 16);
        __m512 amax = _mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi));
        float top = _mm512_reduce_max_ps(amax);
        if (_mm512_cmp_ps_mask(lo, hi, _CMP_UNORD_Q)) top = NAN_SCALE;  // max skips a NaN: keep it
        const float scale = top / 127.0f;
        const float inv = top > 0.0f ? 127.0f / top : 0.0f;
        const __m512 vinv = _mm512_set1_ps(inv);
        __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vinv));  // round to nearest even
        __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vinv));
        if (with_sums) {
            out.sums[i] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
        }
        uint8_t* dst = out.codes.data() + m * K + b * BLOCK;
        if (offset) {
            const __m512i bias = _mm512_set1_epi32(128);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtusepi32_epi8(_mm512_add_epi32(qlo, bias)));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16),
                             _mm512_cvtusepi32_epi8(_mm512_add_epi32(qhi, bias)));
        } else {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qhi));
        }
        out.scales[i] = scale;
    }
}

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, bool offset, bool with_sums, QuantizedRows& out) {
    quantized_room(M, K, with_sums, out);
    at::parallel_for(0, M * (K / BLOCK), 64, [&](int64_t begin, int64_t end) {
        quantize_blocks(x, K, offset, with_sums, out, begin, end);
    });
}

inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
inline void store16(at::BFloat16* y, __m512 v) {
    // round to nearest even, as c10::BFloat16 does (NaN never arises from finite int products)
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

inline __m512 halves16(const at::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i broadcast4(const uint8_t* p) { return _mm512_set1_epi32(four_bytes(p)); }

// The weights are interleaved for these loops: 16 output columns side by side, each 32-bit lane
// of a vector holding 4 consecutive inputs of one column, so one vpdpbusd adds 4 products to
// each of 16 columns and the sums never need adding across lanes.
//   q8: [N/16, K/32, 8, 16, 4] int8 (block b's inputs 4t … 4t+3 of column 16g + lane)
//   q4: [N/16, K/32, 4, 16, 4] bytes: the low nibbles are inputs 4(2v) …, the high 4(2v+1) …
//   scales (and q4's minimums): [N/16, K/32, 16] fp16

// Rows m0 … m0+TM of columns 16·g0 … 16·(g0+TN): q8.
template <int TM, int TN, typename T>
inline void q8_tile(const int8_t* w, const at::Half* ws, const QuantizedRows& xq, int64_t m0, int64_t g0,
                    int64_t K, int64_t N, T* y) {
    const int64_t blocks = K / BLOCK;
    const __m512i ones = _mm512_set1_epi8(1);
    __m512 acc[TM][TN];
    for (int i = 0; i < TM; ++i)
        for (int j = 0; j < TN; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m512i dots[TM][TN];
        __m512i taken[TN];
        for (int j = 0; j < TN; ++j) {
            taken[j] = _mm512_setzero_si512();
            for (int i = 0; i < TM; ++i) dots[i][j] = _mm512_setzero_si512();
        }
        for (int t = 0; t < 8; ++t) {
            __m512i wv[TN];
            for (int j = 0; j < TN; ++j) {
                fetch_line_ahead(w + (((g0 + j) * blocks + b) * 8 + t) * 64);
                wv[j] = _mm512_loadu_si512(w + (((g0 + j) * blocks + b) * 8 + t) * 64);
                taken[j] = _mm512_dpbusd_epi32(taken[j], ones, wv[j]);
            }
            for (int i = 0; i < TM; ++i) {
                const __m512i xb = broadcast4(xq.codes.data() + (m0 + i) * K + b * BLOCK + 4 * t);
                for (int j = 0; j < TN; ++j) dots[i][j] = _mm512_dpbusd_epi32(dots[i][j], xb, wv[j]);
            }
        }
        for (int j = 0; j < TN; ++j) {
            const __m512 scale = halves16(ws + ((g0 + j) * blocks + b) * 16);
            const __m512i back = _mm512_slli_epi32(taken[j], 7);  // the 128 · Σw the offset added
            for (int i = 0; i < TM; ++i) {
                const __m512 xs = _mm512_set1_ps(xq.scales[(m0 + i) * blocks + b]);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dots[i][j], back)),
                                            _mm512_mul_ps(scale, xs), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < TM; ++i)
        for (int j = 0; j < TN; ++j) store16(y + (m0 + i) * N + (g0 + j) * 16, acc[i][j]);
}

// Rows m0 … m0+TM of columns 16·g0 … 16·(g0+TN): q4 (Q4_1 × Q8_1).
template <int TM, int TN, typename T>
inline void q4_tile(const uint8_t* w, const at::Half* d, const at::Half* mins, const QuantizedRows& xq, int64_t m0,
                    int64_t g0, int64_t K, int64_t N, T* y) {
    const int64_t blocks = K / BLOCK;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 acc[TM][TN];
    for (int i = 0; i < TM; ++i)
        for (int j = 0; j < TN; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m512i dots[TM][TN];
        for (int i = 0; i < TM; ++i)
            for (int j = 0; j < TN; ++j) dots[i][j] = _mm512_setzero_si512();
        for (int v = 0; v < 4; ++v) {
            __m512i lo[TN], hi[TN];
            for (int j = 0; j < TN; ++j) {
                fetch_line_ahead(w + (((g0 + j) * blocks + b) * 4 + v) * 64);
                const __m512i packed = _mm512_loadu_si512(w + (((g0 + j) * blocks + b) * 4 + v) * 64);
                lo[j] = _mm512_and_si512(packed, nibble);
                hi[j] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
            }
            for (int i = 0; i < TM; ++i) {
                const uint8_t* x = xq.codes.data() + (m0 + i) * K + b * BLOCK + 8 * v;
                const __m512i x0 = broadcast4(x), x1 = broadcast4(x + 4);
                for (int j = 0; j < TN; ++j) {
                    dots[i][j] = _mm512_dpbusd_epi32(dots[i][j], lo[j], x0);
                    dots[i][j] = _mm512_dpbusd_epi32(dots[i][j], hi[j], x1);
                }
            }
        }
        for (int j = 0; j < TN; ++j) {
            const __m512 scale = halves16(d + ((g0 + j) * blocks + b) * 16);
            const __m512 low = halves16(mins + ((g0 + j) * blocks + b) * 16);
            for (int i = 0; i < TM; ++i) {
                const __m512 xs = _mm512_set1_ps(xq.scales[(m0 + i) * blocks + b]);
                const __m512 sum = _mm512_set1_ps(xq.sums[(m0 + i) * blocks + b]);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[i][j]), _mm512_mul_ps(scale, xs),
                                            _mm512_fmadd_ps(low, sum, acc[i][j]));
            }
        }
    }
    for (int i = 0; i < TM; ++i)
        for (int j = 0; j < TN; ++j) store16(y + (m0 + i) * N + (g0 + j) * 16, acc[i][j]);
}

}  // namespace
