// The int8 kernels of q8_gemm.cpp for CPUs with AVX2 but not AVX-512 VNNI (most desktop and
// laptop CPUs before 2021, AMD's before Zen 4): the same operators, weights layout and numerics
// (the activations quantized per block of 32, integer dot products per block, the same scales),
// on 256-bit vectors, as llama.cpp's AVX2 dot products do:
//   q8: vpmaddubsw multiplies unsigned by signed bytes and saturates at 16 bits, so the
//       activations stay signed and each product is taken as |x| · (w with x's sign), which is at
//       most 2 · 127 · 127 per pair; vpmaddwd then adds pairs of those into 32-bit lanes.
//   q4: the weights' nibbles (0 … 15) are the unsigned side and the activations the signed
//       one: 2 · 15 · 127 per pair, so a block's eight products add up in 16 bits before vpmaddwd.
// A group of 16 interleaved columns (see q8_gemm.cpp) is two vectors of 8 columns here.
//
// Each output row y[m] depends on x[m] alone; every sum is exact in integers, so the results
// equal the AVX-512 kernel's but for the order of the float additions of the blocks' products.

#include "q8_common.h"

namespace {

constexpr bool Q8_OFFSET = false;
constexpr int ROW_TILE = 4, COL_TILE = 1, ROW1_COL_TILE = 2;
constexpr bool FEW_ROWS_TOGETHER = false;  // 16 ymm registers: the rows past the tiles go one at a time

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

inline int32_t sum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, bool offset, bool with_sums, QuantizedRows& out) {
    TORCH_CHECK(!offset, "the AVX2 kernels keep the activations signed");
    const int64_t blocks = K / BLOCK;
    out.codes.resize(M * K);
    out.scales.resize(M * blocks);
    if (with_sums) out.sums.resize(M * blocks);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    at::parallel_for(0, M * blocks, 64, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const int64_t m = i / blocks, b = i % blocks;
            const T* src = x + m * K + b * BLOCK;
            __m256 v[4];
            __m256 amax = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
            for (int k = 0; k < 4; ++k) {
                v[k] = load8(src + 8 * k);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
                unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v[k], v[k], _CMP_UNORD_Q));
            }
            float top = max8(amax);
            if (_mm256_movemask_ps(unordered)) top = NAN_SCALE;  // max skips a NaN: keep it
            const float scale = top / 127.0f;
            const float inv = top > 0.0f ? 127.0f / top : 0.0f;
            const __m256 vinv = _mm256_set1_ps(inv);
            __m256i q[4];
            for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], vinv));  // nearest even
            if (with_sums) {
                const __m256i all = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
                out.sums[i] = scale * static_cast<float>(sum8(all));
            }
            // 32 int32 → 32 int8 in order: the packs work within 128-bit halves, the permute mends it
            const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.codes.data() + m * K + b * BLOCK),
                                _mm256_permutevar8x32_epi32(words, order));
            out.scales[i] = scale;
        }
    });
}

inline void store8(float* y, __m256 v) { _mm256_storeu_ps(y, v); }
inline void store8(at::BFloat16* y, __m256 v) {
    // round to nearest even, as c10::BFloat16 does (NaN never arises from finite int products)
    __m256i bits = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y), packed);
}

inline __m256 halves8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline __m256i broadcast4(const uint8_t* p) { return _mm256_set1_epi32(four_bytes(p)); }

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Rows m0 … m0+TM of columns 16·g0 … 16·(g0+TN): q8. Index [j][h]: group j's columns 8h … 8h+7.
template <int TM, int TN, typename T>
inline void q8_tile(const int8_t* w, const at::Half* ws, const QuantizedRows& xq, int64_t m0, int64_t g0,
                    int64_t K, int64_t N, T* y) {
    const int64_t blocks = K / BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[TM][TN][2];
    for (int i = 0; i < TM; ++i)
        for (int j = 0; j < TN; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m256i dots[TM][TN][2];
        for (int i = 0; i < TM; ++i)
            for (int j = 0; j < TN; ++j) dots[i][j][0] = dots[i][j][1] = _mm256_setzero_si256();
        for (int t = 0; t < 8; ++t) {
            __m256i xb[TM], xabs[TM];
            for (int i = 0; i < TM; ++i) {
                xb[i] = broadcast4(xq.codes.data() + (m0 + i) * K + b * BLOCK + 4 * t);
                xabs[i] = _mm256_sign_epi8(xb[i], xb[i]);
            }
            for (int j = 0; j < TN; ++j) {
                const int8_t* line = w + (((g0 + j) * blocks + b) * 8 + t) * 64;
                fetch_line_ahead(line);
                for (int h = 0; h < 2; ++h) {
                    const __m256i wv = load32(line + 32 * h);
                    for (int i = 0; i < TM; ++i) {
                        const __m256i pairs = _mm256_maddubs_epi16(xabs[i], _mm256_sign_epi8(wv, xb[i]));
                        dots[i][j][h] = _mm256_add_epi32(dots[i][j][h], _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
        }
        for (int j = 0; j < TN; ++j)
            for (int h = 0; h < 2; ++h) {
                const __m256 scale = halves8(ws + ((g0 + j) * blocks + b) * 16 + 8 * h);
                for (int i = 0; i < TM; ++i) {
                    const __m256 xs = _mm256_set1_ps(xq.scales[(m0 + i) * blocks + b]);
                    acc[i][j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[i][j][h]), _mm256_mul_ps(scale, xs),
                                                   acc[i][j][h]);
                }
            }
    }
    for (int i = 0; i < TM; ++i)
        for (int j = 0; j < TN; ++j)
            for (int h = 0; h < 2; ++h) store8(y + (m0 + i) * N + (g0 + j) * 16 + 8 * h, acc[i][j][h]);
}

// Rows m0 … m0+TM of columns 16·g0 … 16·(g0+TN): q4 (Q4_1 × Q8_1).
template <int TM, int TN, typename T>
inline void q4_tile(const uint8_t* w, const at::Half* d, const at::Half* mins, const QuantizedRows& xq, int64_t m0,
                    int64_t g0, int64_t K, int64_t N, T* y) {
    const int64_t blocks = K / BLOCK;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[TM][TN][2];
    for (int i = 0; i < TM; ++i)
        for (int j = 0; j < TN; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        __m256i pairs[TM][TN][2];  // 16-bit sums: at most 8 · 2 · 15 · 127 = 30480
        for (int i = 0; i < TM; ++i)
            for (int j = 0; j < TN; ++j) pairs[i][j][0] = pairs[i][j][1] = _mm256_setzero_si256();
        for (int v = 0; v < 4; ++v) {
            __m256i x0[TM], x1[TM];
            for (int i = 0; i < TM; ++i) {
                const uint8_t* x = xq.codes.data() + (m0 + i) * K + b * BLOCK + 8 * v;
                x0[i] = broadcast4(x);
                x1[i] = broadcast4(x + 4);
            }
            for (int j = 0; j < TN; ++j) {
                const uint8_t* line = w + (((g0 + j) * blocks + b) * 4 + v) * 64;
                fetch_line_ahead(line);
                for (int h = 0; h < 2; ++h) {
                    const __m256i packed = load32(line + 32 * h);
                    const __m256i lo = _mm256_and_si256(packed, nibble);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
                    for (int i = 0; i < TM; ++i)
                        pairs[i][j][h] = _mm256_add_epi16(pairs[i][j][h],
                                                          _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0[i]),
                                                                           _mm256_maddubs_epi16(hi, x1[i])));
                }
            }
        }
        for (int j = 0; j < TN; ++j)
            for (int h = 0; h < 2; ++h) {
                const __m256 scale = halves8(d + ((g0 + j) * blocks + b) * 16 + 8 * h);
                const __m256 low = halves8(mins + ((g0 + j) * blocks + b) * 16 + 8 * h);
                for (int i = 0; i < TM; ++i) {
                    const __m256 xs = _mm256_set1_ps(xq.scales[(m0 + i) * blocks + b]);
                    const __m256 sum = _mm256_set1_ps(xq.sums[(m0 + i) * blocks + b]);
                    const __m256i dots = _mm256_madd_epi16(pairs[i][j][h], ones);
                    acc[i][j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(scale, xs),
                                                   _mm256_fmadd_ps(low, sum, acc[i][j][h]));
                }
            }
    }
    for (int i = 0; i < TM; ++i)
        for (int j = 0; j < TN; ++j)
            for (int h = 0; h < 2; ++h) store8(y + (m0 + i) * N + (g0 + j) * 16 + 8 * h, acc[i][j][h]);
}

}  // namespace

#include "q8_ops.h"
