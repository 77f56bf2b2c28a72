// fp32 and bf16 matrix products for the eager decode steps and the compiled batched step
// (``torch.ops.workbench.dense_linear``): a few rows of activations against weights as nn.Linear
// keeps them, [N, K] row-major, read in place. (The compiled one-sequence step keeps Inductor's
// products, which read weights it packed for them and were faster for one row:
// engine/models/fast.py, FastDecoder.dense.)
//
// A decode step reads every weight once for one row (or a few), so it is bound by the memory's
// speed, and what counts is how many reads are in flight: each thread walks 8 weight rows side by
// side (8 streams the prefetchers follow), fetching 16 KiB ahead as the int8 tiles do, one fused
// multiply-add per 16 weights and one reduction per row at the end. bf16 weights against bf16
// activations use AVX512-BF16's pairwise products (vdpbf16ps: 32 weights an instruction, each
// product exact in fp32) where the CPU has them, else are widened to fp32 as they load. Several
// rows: 8 weight rows × 2 activation rows, 4 × 3, 4 × 4 or 4 × 5 in one tile (at most 20 sums in
// registers), more in tiles of 4 × 4 and one of the rest. Every output's sum runs
// in the same order whatever the tile, so a row's answer is the same alone or beside others.
//
// Measured against PyTorch's F.linear and Inductor's products: docs/benchmarks.md, "The dense products".
// Built only on q8_avx512.h's builds (AVX-512); the AVX2 build defines the operator as F.linear.

#pragma once

namespace {

constexpr int64_t DENSE_ROWS = 8;  // weight rows a one-row tile walks side by side
constexpr int64_t DENSE_AHEAD_BYTES = 16384;

inline bool has_avx512_bf16() {
    static const bool has = __builtin_cpu_supports("avx512bf16");
    return has;
}

inline __m512 load16_masked(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16_masked(const at::BFloat16* p, __mmask16 mask) {
    return widen_bf16(_mm256_maskz_loadu_epi16(mask, p));
}

template <typename T>
inline void store_sum(T* out, __m512 sum) { *out = static_cast<T>(_mm512_reduce_add_ps(sum)); }

// RN weight rows (from n0) × MN activation rows (from m0), widening the weights to fp32.
template <int RN, int MN, typename W, typename Y>
inline void dense_tile(const W* w, const float* x, int64_t K, int64_t n0, int64_t m0, Y* y, int64_t N) {
    __m512 acc[RN][MN];
    for (int r = 0; r < RN; ++r)
        for (int m = 0; m < MN; ++m) acc[r][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[RN];
        for (int r = 0; r < RN; ++r) {
            const W* row = w + (n0 + r) * K + k;
            _mm_prefetch(reinterpret_cast<const char*>(row) + DENSE_AHEAD_BYTES, _MM_HINT_T0);
            wv[r] = load16(row);
        }
        for (int m = 0; m < MN; ++m) {
            const __m512 xv = _mm512_loadu_ps(x + (m0 + m) * K + k);
            for (int r = 0; r < RN; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
        }
    }
    if (k < K) {
        const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
        __m512 wv[RN];
        for (int r = 0; r < RN; ++r) wv[r] = load16_masked(w + (n0 + r) * K + k, mask);
        for (int m = 0; m < MN; ++m) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + (m0 + m) * K + k);
            for (int r = 0; r < RN; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
        }
    }
    for (int m = 0; m < MN; ++m)
        for (int r = 0; r < RN; ++r) store_sum(y + (m0 + m) * N + n0 + r, acc[r][m]);
}

// The same with bf16 activations and vdpbf16ps: pairs of products, exact, summed in fp32.
template <int RN, int MN>
__attribute__((target("avx512bf16"))) inline void bf16_tile(const at::BFloat16* w, const at::BFloat16* x, int64_t K,
                                                            int64_t n0, int64_t m0, at::BFloat16* y, int64_t N) {
    __m512 acc[RN][MN];
    for (int r = 0; r < RN; ++r)
        for (int m = 0; m < MN; ++m) acc[r][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[RN];
        for (int r = 0; r < RN; ++r) {
            const at::BFloat16* row = w + (n0 + r) * K + k;
            _mm_prefetch(reinterpret_cast<const char*>(row) + DENSE_AHEAD_BYTES, _MM_HINT_T0);
            wv[r] = (__m512bh)_mm512_loadu_si512(row);
        }
        for (int m = 0; m < MN; ++m) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + m) * K + k);
            for (int r = 0; r < RN; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);
        }
    }
    if (k < K) {
        const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
        __m512bh wv[RN];
        for (int r = 0; r < RN; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (n0 + r) * K + k);
        for (int m = 0; m < MN; ++m) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (m0 + m) * K + k);
            for (int r = 0; r < RN; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);
        }
    }
    for (int m = 0; m < MN; ++m)
        for (int r = 0; r < RN; ++r) store_sum(y + (m0 + m) * N + n0 + r, acc[r][m]);
}

// Every tile of the product, split across threads by blocks of DENSE_ROWS weight rows; ``tile``
// is called as tile(RN, MN, n0, m0) with RN and MN integral constants. A few activation rows (a
// verification pass's 5, a small batch's) are one tile per weight rows, so each weight is read
// from memory once, in as many streams as the registers allow; more rows, tiles of 4 and one of
// the rest (at most 5: 20 sums, 4 weights and an activation in registers).
template <typename Tile>
void dense_tiles(int64_t M, int64_t N, Tile&& tile) {
    using std::integral_constant;
    auto rest = [&](int64_t n, int64_t m, int64_t left) {
        switch (left) {
            case 1: tile(integral_constant<int, 4>{}, integral_constant<int, 1>{}, n, m); break;
            case 2: tile(integral_constant<int, 4>{}, integral_constant<int, 2>{}, n, m); break;
            case 3: tile(integral_constant<int, 4>{}, integral_constant<int, 3>{}, n, m); break;
            case 4: tile(integral_constant<int, 4>{}, integral_constant<int, 4>{}, n, m); break;
            default: tile(integral_constant<int, 4>{}, integral_constant<int, 5>{}, n, m); break;
        }
    };
    at::parallel_for(0, (N + DENSE_ROWS - 1) / DENSE_ROWS, 16, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
            const int64_t n0 = b * DENSE_ROWS;
            if (n0 + DENSE_ROWS > N) {  // the last rows, one at a time
                for (int64_t n = n0; n < N; ++n)
                    for (int64_t m = 0; m < M; ++m) tile(integral_constant<int, 1>{}, integral_constant<int, 1>{}, n, m);
            } else if (M == 1) {
                tile(integral_constant<int, DENSE_ROWS>{}, integral_constant<int, 1>{}, n0, 0);
            } else if (M == 2) {
                tile(integral_constant<int, DENSE_ROWS>{}, integral_constant<int, 2>{}, n0, 0);
            } else {
                for (int64_t half = n0; half < n0 + DENSE_ROWS; half += 4) {
                    int64_t m = 0;
                    for (; M - m > 5; m += 4) tile(integral_constant<int, 4>{}, integral_constant<int, 4>{}, half, m);
                    rest(half, m, M - m);
                }
            }
        }
    });
}

torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& w) {
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
                "dense weights: a contiguous float32 or bfloat16 [N, K] tensor");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1) && x.scalar_type() == w.scalar_type(),
                "activations: [M, K] with the weights' K and dtype");
    const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
    auto xc = x.contiguous();
    auto y = torch::empty({M, N}, x.options());
    if (w.scalar_type() == at::kFloat) {
        const float *wp = w.data_ptr<float>(), *xp = xc.data_ptr<float>();
        float* yp = y.data_ptr<float>();
        dense_tiles(M, N, [&](auto rn, auto mn, int64_t n0, int64_t m0) {
            dense_tile<decltype(rn)::value, decltype(mn)::value>(wp, xp, K, n0, m0, yp, N);
        });
        return y;
    }
    const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    if (has_avx512_bf16()) {
        const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
        dense_tiles(M, N, [&](auto rn, auto mn, int64_t n0, int64_t m0) {
            bf16_tile<decltype(rn)::value, decltype(mn)::value>(wp, xp, K, n0, m0, yp, N);
        });
        return y;
    }
    auto xf = xc.to(at::kFloat);
    const float* xp = xf.data_ptr<float>();
    dense_tiles(M, N, [&](auto rn, auto mn, int64_t n0, int64_t m0) {
        dense_tile<decltype(rn)::value, decltype(mn)::value>(wp, xp, K, n0, m0, yp, N);
    });
    return y;
}

}  // namespace
