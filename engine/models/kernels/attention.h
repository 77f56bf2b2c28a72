// One decode step's attention for a batch of rows, each over its own cache up to its own
// position (torch.ops.workbench.attend_rows), in plain C++ the compiler vectorizes for the
// build's instruction set. What it replaces in a batched step: per row, two small matrix
// products over the whole cache with the unwritten slots masked out, where MKL spent as long
// packing each row's keys as multiplying them (20% of a 16-row int8-fast step), and every row
// read the longest row's span. Here each (row, KV head) reads its keys and values once, up to its
// position, for the query heads that share them (GQA), and computes in fp32 (keys and values in
// fp32 or bf16). A row's result depends on that row alone, whatever else is in the batch.
//
// The paged form (torch.ops.workbench.attend_paged) reads the same slots through a block table:
// slot t of a row lives in block table[row][t / block tokens] of the pool, at t % block tokens.
// The loops below take the address of slot t from an accessor (Strided for one contiguous cache
// per row, Paged for the pool), fetched once per slot: the arithmetic is the same either way.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// An int8 cache, laid out as llama.cpp's q8_0 cache: a slot's D keys (or values) of one KV head
// in blocks of 32, each block 34 bytes, its scale (fp16) then its 32 codes; value i is block
// i / 32's scale × code i % 32. The pool's last dimension is D / 32 × 34 bytes (int8 tensors).
struct Q8 {};
constexpr int64_t Q8_BLOCK = 32, Q8_BLOCK_BYTES = 34;

// A Q8 block's scale (its first two bytes, fp16).
inline float q8_scale(const int8_t* block) {
    uint16_t bits;
    std::memcpy(&bits, block, 2);
    return _cvtsh_ss(bits);
}

// Element ``at`` on of one slot's row of a Q8 cache: what a pointer is to the other caches
// (row + n, row[d]; load16 reads 16 values from a multiple of 16).
struct Q8Slot {
    const int8_t* row;
    int64_t at;
    Q8Slot operator+(int64_t n) const { return {row, at + n}; }
    float operator[](int64_t d) const {
        const int8_t* block = row + (at + d) / Q8_BLOCK * Q8_BLOCK_BYTES;
        return q8_scale(block) * static_cast<float>(block[2 + (at + d) % Q8_BLOCK]);
    }
};

// What a cache of type C is stored as, what a slot's row is read through, and its bytes.
template <typename C>
struct CacheOf {
    using Stored = C;
    using Slot = const C*;
    static Slot slot(const Stored* p) { return p; }
    static const char* address(Slot s) { return reinterpret_cast<const char*>(s); }
    static int64_t row_bytes(int64_t dim) { return dim * static_cast<int64_t>(sizeof(C)); }
};
template <>
struct CacheOf<Q8> {
    using Stored = int8_t;
    using Slot = Q8Slot;
    static Slot slot(const Stored* p) { return {p, 0}; }
    static const char* address(Slot s) { return reinterpret_cast<const char*>(s.row); }
    static int64_t row_bytes(int64_t dim) { return dim / Q8_BLOCK * Q8_BLOCK_BYTES; }
};

template <typename C>
const typename CacheOf<C>::Stored* stored(const torch::Tensor& t) {
    return t.data_ptr<typename CacheOf<C>::Stored>();
}

// Slot t's keys (or values) of one (row, KV head) in a cache laid out [rows, KV heads, slots, D].
template <typename T>
struct Strided {
    const typename CacheOf<T>::Stored* base;
    int64_t stride;
    typename CacheOf<T>::Slot operator()(int64_t t) const { return CacheOf<T>::slot(base + t * stride); }
};

// The same in a pool laid out [blocks, KV heads, block tokens, D], through a row's block table,
// from slot ``first`` on (a sliding window's first slot: the loops count from 0 either way).
template <typename T>
struct Paged {
    const typename CacheOf<T>::Stored* base;  // the pool at this KV head
    const int64_t* table;
    int64_t block_stride, slot_stride, block_tokens;
    int shift;  // log2(block_tokens) where it is a power of two, else -1
    int64_t first = 0;
    typename CacheOf<T>::Slot operator()(int64_t t) const {
        t += first;
        const int64_t i = shift >= 0 ? t >> shift : t / block_tokens;
        const int64_t at = shift >= 0 ? t & (block_tokens - 1) : t - i * block_tokens;
        return CacheOf<T>::slot(base + table[i] * block_stride + at * slot_stride);
    }
};

// e^x for x ≤ 0 (a score minus the row's largest): 2^n · e^r with |r| ≤ ln2/2 and a degree-6
// polynomial for e^r (relative error ~1e-7, about an ulp, as Sleef's expf in torch.softmax).
// Written so the compiler vectorizes a loop of it (std::exp is a call per element).
inline float exp_nonpositive(float x) {
    x = std::max(x, -87.0f);  // below, e^x is under float's smallest normal: 2^-126 stands for it
    const float n = __builtin_floorf(x * 1.44269504f + 0.5f);
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
    const float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f +
                                             r * (0.00833333377f + r * 0.00138888892f)))));
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

// Heads g0 … g1 - 1's scores [·, n] → e^(score - the head's largest), their sums in total.
inline void softmax_numerators(float* scores, int64_t n, int64_t g0, int64_t g1, float* total) {
    for (int64_t g = g0; g < g1; ++g) {
        float* sg = scores + g * n;
        float top = sg[0];
        for (int64_t t = 1; t < n; ++t) top = std::max(top, sg[t]);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) {
            sg[t] = exp_nonpositive(sg[t] - top);
            sum += sg[t];
        }
        total[g] = sum;
    }
}

// Heads g0 … g1 - 1's numerators rounded to bfloat16 (to nearest, ties to even) and kept in fp32:
// what PyTorch's CPU flash attention weighs the values with under bf16 queries (it sums the
// numerators in fp32, then stores them in the queries' type for the product with the values).
// The bf16 precisions round as transformers' attention does there, so the fast path's answers
// stay the reference's, in prompt chunks and decode steps alike.
inline void round_numerators_bf16(float* scores, int64_t n, int64_t g0, int64_t g1) {
    uint32_t* bits = reinterpret_cast<uint32_t*>(scores + g0 * n);
    const int64_t count = (g1 - g0) * n;
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) bits[i] = (bits[i] + 0x7FFFu + ((bits[i] >> 16) & 1u)) & 0xFFFF0000u;
}

// Query heads g0 … g1 - 1 of a KV head (their scaled fp32 queries in query, [group, dim]) over
// slots 0 … n - 1 of its keys and values (rows ks and vs elements apart): scores [group, n]
// become the softmax's numerators, total[g] their sums, acc [group, dim] the weighted values.
// The plain loops, for any head size; the AVX-512 ones below where they apply.
// Soft-capped scores (Gemma 2's attention): cap · tanh(score / cap), where cap > 0.
inline void cap_scores(float* scores, int64_t n, int64_t g0, int64_t g1, float cap) {
    if (cap <= 0.0f) return;
    for (int64_t i = g0 * n; i < g1 * n; ++i) scores[i] = cap * std::tanh(scores[i] / cap);
}

template <typename T, typename K, typename V>
void attend_plain(const float* query, const K& keys, const V& values, int64_t n, int64_t dim, int64_t g0,
                  int64_t g1, bool reduced, float* key, float* scores, float* total, float* acc, float cap = 0.0f) {
    for (int64_t t = 0; t < n; ++t) {
        const auto krow = keys(t);
        for (int64_t d = 0; d < dim; ++d) key[d] = static_cast<float>(krow[d]);
        for (int64_t g = g0; g < g1; ++g) {
            const float* qg = query + g * dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += qg[d] * key[d];
            scores[g * n + t] = dot;
        }
    }
    cap_scores(scores, n, g0, g1, cap);
    softmax_numerators(scores, n, g0, g1, total);
    if (reduced) round_numerators_bf16(scores, n, g0, g1);
    std::fill(acc + g0 * dim, acc + g1 * dim, 0.0f);
    for (int64_t t = 0; t < n; ++t) {
        const auto vrow = values(t);
        for (int64_t d = 0; d < dim; ++d) key[d] = static_cast<float>(vrow[d]);
        for (int64_t g = g0; g < g1; ++g) {
            const float p = scores[g * n + t];
            float* a = acc + g * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += p * key[d];
        }
    }
}

#ifdef WORKBENCH_AVX512  // q8_avx512.h's builds: its load16 reads fp32 or bf16
// The AVX-512 loops, for head sizes that are a multiple of 16 up to 256: each score one vector
// dot product reduced once (the plain loops' reductions added the 16 lanes one after another), the
// softmax 16 scores at a time, and the weighted values summed in registers, up to 4 query heads ×
// 64 dimensions at a time, slot after slot (the plain loops stored and reloaded every sum at every
// slot). Measured alone at the default model's shapes (9 query heads on 3 KV heads of 64), 16 rows
// at position 64 of 128 slots: 155 → 105 µs in fp32, 157 → 97 µs in bf16; 16 rows at 500 of
// 1,024: 1,569 → 940 µs in fp32. Then, over 30 layers' caches (from memory, as in a step), 16 rows
// near position 75 of 128: 1.35× faster in fp32, 1.49× in bf16; one row near 700 of 1,024: 1.46×
// and 1.76×. Half of that from reading each value row once, in order (the loops had walked the
// cache once per 16 dimensions, a 64-byte piece every 256 bytes, and waited on memory at every
// step), half from the softmax (the compiler had left its loops scalar). Later, the scores 16
// slots at a time (sums16) and 3 heads' weighted values in one pass (the default model's group,
// which had been 2 + 1, reading each value row twice): over 30 layers' caches, 16 rows near 60
// of 128 in bf16 1.2 → 1.06 ms, one row near 700 of 1,024 in fp32 1.44 → 1.22 ms; in a whole
// int8-fast step at one row near 700, 1.02× (16 rows in fp32 read their keys from memory: no change).
constexpr int64_t FAST_DIM = 256;

// 16 values of a Q8 cache's row from element p.at (a multiple of 16: within one block), as fp32.
inline __m512 load16(Q8Slot p) {
    const int8_t* block = p.row + p.at / Q8_BLOCK * Q8_BLOCK_BYTES;
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + p.at % Q8_BLOCK));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), _mm512_set1_ps(q8_scale(block)));
}

// exp_nonpositive on 16 lanes: the same steps (here for the softmax below and scores.h).
inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // maxps returns its second operand where one is NaN: x's NaN stays
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x));
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(0.00138888892f), _mm512_set1_ps(0.00833333377f));
    p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.0416666679f));
    p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.166666672f));
    p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// One head's scores [n] → e^(score - the head's largest), their sum returned.
inline float softmax_head16(float* sg, int64_t n) {
    const int64_t whole = n / 16 * 16;
    const __mmask16 rest = static_cast<__mmask16>((1u << (n - whole)) - 1);
    __m512 most = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < whole; t += 16) most = _mm512_max_ps(most, _mm512_loadu_ps(sg + t));
    if (rest) most = _mm512_mask_max_ps(most, rest, most, _mm512_maskz_loadu_ps(rest, sg + whole));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(most));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < whole; t += 16) {
        const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), top));
        _mm512_storeu_ps(sg + t, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (rest) {
        const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(rest, sg + whole), top));
        _mm512_mask_storeu_ps(sg + whole, rest, e);
        sum = _mm512_mask_add_ps(sum, rest, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

// Heads g0 … g1 - 1's scores [·, n] → e^(score - the head's largest), their sums in total.
inline void softmax_numerators16(float* scores, int64_t n, int64_t g0, int64_t g1, float* total) {
    for (int64_t g = g0; g < g1; ++g) total[g] = softmax_head16(scores + g * n, n);
}

// Dimensions 16·c0 … 16·(c0 + C) - 1 of heads g … g + H - 1's weighted values.
template <int H, int C, typename V>
inline void weigh_values(const float* scores, int64_t n, const V& values, int64_t c0, int64_t dim,
                         int64_t g, float* acc) {
    __m512 sums[H][C];
    for (int h = 0; h < H; ++h)
        for (int c = 0; c < C; ++c) sums[h][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
        __m512 v[C];
        const auto row = values(t);
        for (int c = 0; c < C; ++c) v[c] = load16(row + 16 * (c0 + c));
        for (int h = 0; h < H; ++h) {
            const __m512 p = _mm512_set1_ps(scores[(g + h) * n + t]);
            for (int c = 0; c < C; ++c) sums[h][c] = _mm512_fmadd_ps(p, v[c], sums[h][c]);
        }
    }
    for (int h = 0; h < H; ++h)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (g + h) * dim + 16 * (c0 + c), sums[h][c]);
}

// All dim / 16 pieces of heads g … g + H - 1's weighted values, 4 at a time.
template <int H, typename V>
inline void weigh_pieces(const float* scores, int64_t n, const V& values, int64_t chunks, int64_t dim,
                         int64_t g, float* acc) {
    int64_t c0 = 0;
    for (; c0 + 4 <= chunks; c0 += 4) weigh_values<H, 4>(scores, n, values, c0, dim, g, acc);
    switch (chunks - c0) {
        case 3: weigh_values<H, 3>(scores, n, values, c0, dim, g, acc); break;
        case 2: weigh_values<H, 2>(scores, n, values, c0, dim, g, acc); break;
        case 1: weigh_values<H, 1>(scores, n, values, c0, dim, g, acc); break;
        default: break;
    }
}

// The 16 sums of 16 vectors' lanes (lane j: the sum of d[j]'s), in 45 shuffles and adds where
// a reduction per vector takes ~9 with a longer chain of dependencies: pairs of vectors
// interleaved and added within each 128-bit lane, then pairs of those, then the four lanes.
inline __m512 sums16(const __m512 (&d)[16]) {
    __m512 quads[4];
    for (int q = 0; q < 4; ++q) {
        const __m512* v = d + 4 * q;
        const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
        const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
        quads[q] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))));
    }  // quads[q]'s 128-bit lane l: vectors 4q … 4q + 3's sums over their lane l
    const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                      _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}

// Heads g0 … g1 - 1's scores over slots 0 … n - 1, 16 slots at a time: per head, 16 dot
// products in registers, summed by sums16 and stored as one vector (the last slots masked). Each
// key's pieces of 16 are read where they lie, from L1 after the first head (a copy in a stack
// array sized at run time had GCC call memcpy for every slot). CH: the pieces a key has, where
// known at compile time (the common head sizes, whose loops unroll); 0: ``dim`` / 16 at run time.
// ahead: fetch the next 16 keys and these 16 slots' values into L1 while the scores are computed
// (in a batched step each (row, KV head) reads its own keys and values from memory: whole
// 16-row int8-fast steps 1.02-1.06× faster, alternating, 4 runs near positions 30 and 300; one
// row, whose task is split by query heads and whose stream the hardware follows, 0.99×: not asked).
// A cache of fp16 or bf16 under several query heads: the 16 keys converted to fp32 once, into
// keys32 (L1), for all the heads, where each head had converted them again (16 rows near
// positions 73 and 300, over 30 layers' caches from memory: 1.10× and 1.11× faster; a whole
// 16-row int8-fast step near 41-105: 1.02×, alternating in one process).
template <int CH, typename T, typename K, typename V>
inline void score_slots(const float* query, const K& keys, const V& values, int64_t n,
                        int64_t dim, int64_t g0, int64_t g1, bool ahead, float* scores) {
    const int64_t chunks = CH ? CH : dim / 16;
    const int64_t row = CacheOf<T>::row_bytes(dim);
    auto fetch = [row](typename CacheOf<T>::Slot slot) {
        for (int64_t l = 0; l < row; l += 64) _mm_prefetch(CacheOf<T>::address(slot) + l, _MM_HINT_T0);
    };
    alignas(64) float keys32[16 * 16 * (CH ? CH : 1)];
    const bool once = CH && !std::is_same<T, float>::value && g1 - g0 > 1;
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const int64_t count = std::min<int64_t>(16, n - t0);
        typename CacheOf<T>::Slot k[16];
        for (int64_t j = 0; j < count; ++j) k[j] = keys(t0 + j);
        if (ahead) {  // the next 16 keys, and the values these 16 slots will weigh
            for (int64_t j = 16; j < std::min<int64_t>(32, n - t0); ++j) fetch(keys(t0 + j));
            for (int64_t j = 0; j < count; ++j) fetch(values(t0 + j));
        }
        if (once)
            for (int64_t j = 0; j < count; ++j)
                for (int64_t c = 0; c < chunks; ++c)
                    _mm512_store_ps(keys32 + (j * chunks + c) * 16, load16(k[j] + 16 * c));
        for (int64_t g = g0; g < g1; ++g) {
            const float* qg = query + g * dim;
            auto dot = [&](int j) {  // slot t0 + j's score, as 16 lanes to sum
                auto piece = [&](int64_t c) {
                    return once ? _mm512_load_ps(keys32 + (j * chunks + c) * 16) : load16(k[j] + 16 * c);
                };
                __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qg), piece(0));
                for (int64_t c = 1; c < chunks; ++c) sum = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), piece(c), sum);
                return sum;
            };
            __m512 d[16];
            if (count == 16) {
#pragma GCC unroll 16
                for (int j = 0; j < 16; ++j) d[j] = dot(j);
                _mm512_storeu_ps(scores + g * n + t0, sums16(d));
            } else {
                for (int j = 0; j < 16; ++j) d[j] = j < count ? dot(j) : _mm512_setzero_ps();
                _mm512_mask_storeu_ps(scores + g * n + t0, static_cast<__mmask16>((1u << count) - 1), sums16(d));
            }
        }
    }
}

template <typename T, typename K, typename V>
void attend_vectors(const float* query, const K& keys, const V& values, int64_t n, int64_t dim, int64_t g0,
                    int64_t g1, bool ahead, bool reduced, float* scores, float* total, float* acc, float cap = 0.0f) {
    const int64_t chunks = dim / 16;
    switch (chunks) {
        case 4: score_slots<4, T>(query, keys, values, n, dim, g0, g1, ahead, scores); break;
        case 8: score_slots<8, T>(query, keys, values, n, dim, g0, g1, ahead, scores); break;
        case 16: score_slots<16, T>(query, keys, values, n, dim, g0, g1, ahead, scores); break;
        default: score_slots<0, T>(query, keys, values, n, dim, g0, g1, ahead, scores); break;
    }
    cap_scores(scores, n, g0, g1, cap);
    softmax_numerators16(scores, n, g0, g1, total);
    if (reduced) round_numerators_bf16(scores, n, g0, g1);
    int64_t g = g0;
    for (; g + 4 <= g1; g += 4) weigh_pieces<4>(scores, n, values, chunks, dim, g, acc);
    for (; g + 3 <= g1; g += 3) weigh_pieces<3>(scores, n, values, chunks, dim, g, acc);
    for (; g + 2 <= g1; g += 2) weigh_pieces<2>(scores, n, values, chunks, dim, g, acc);
    for (; g < g1; ++g) weigh_pieces<1>(scores, n, values, chunks, dim, g, acc);
}

// A prompt chunk's attention in tiles: rows r0 … r1 - 1 of a chunk (consecutive positions of one
// sequence, so the same keys and values) at one KV head, their query heads side by side as
// (r1 - r0) × group heads over the tile's last row's slots, n. Each key and value is read and
// converted once for the whole tile, where a row at a time read them once per row. A row's
// scores past its own position are computed and then left out: its softmax runs over its own
// slots, and the numerators past them are exact zeros, which add nothing to its weighted values;
// so a row's result equals attend_paged's for that row alone, bit for bit (a token's attention is
// the same in any chunk and in a decode step: the batch-invariant mode relies on it).
template <typename C, typename K, typename V>
void attend_tile(const float* query, const K& keys, const V& values, int64_t n, int64_t dim, int64_t group,
                 int64_t first, int64_t j0, int64_t j1, bool ahead, bool reduced, float* scores, float* total,
                 float* acc) {
    const int64_t chunks = dim / 16;
    switch (chunks) {
        case 4: score_slots<4, C>(query, keys, values, n, dim, j0, j1, ahead, scores); break;
        case 8: score_slots<8, C>(query, keys, values, n, dim, j0, j1, ahead, scores); break;
        case 16: score_slots<16, C>(query, keys, values, n, dim, j0, j1, ahead, scores); break;
        default: score_slots<0, C>(query, keys, values, n, dim, j0, j1, ahead, scores); break;
    }
    for (int64_t j = j0; j < j1; ++j) {  // head j is row j / group's: its slots 0 … first + j / group
        const int64_t own = first + j / group + 1;
        total[j] = softmax_head16(scores + j * n, own);
        std::fill(scores + j * n + own, scores + (j + 1) * n, 0.0f);
    }
    if (reduced) round_numerators_bf16(scores, n, j0, j1);
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) weigh_pieces<4>(scores, n, values, chunks, dim, j, acc);
    for (; j + 3 <= j1; j += 3) weigh_pieces<3>(scores, n, values, chunks, dim, j, acc);
    for (; j + 2 <= j1; j += 2) weigh_pieces<2>(scores, n, values, chunks, dim, j, acc);
    for (; j < j1; ++j) weigh_pieces<1>(scores, n, values, chunks, dim, j, acc);
}

constexpr int64_t CHUNK_TILE = 16;  // rows a tile

template <typename T, typename C>
void attend_chunk_tiles(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                        const int64_t* table, int64_t start, double scale, torch::Tensor& out) {
    const int64_t count = q.size(0), heads = q.size(1), dim = q.size(3), kv_heads = keys.size(1);
    const int64_t group = heads / kv_heads;
    const auto* kp = stored<C>(keys);
    const auto* vp = stored<C>(values);
    const int64_t tokens = keys.size(2);
    int shift = -1;
    for (int i = 0; i < 31; ++i)
        if ((int64_t{1} << i) == tokens) shift = i;
    const T* qp = q.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const float s = static_cast<float>(scale);
    constexpr bool reduced = std::is_same<T, at::BFloat16>::value;
    const int64_t tiles = (count + CHUNK_TILE - 1) / CHUNK_TILE, pairs = tiles * kv_heads;
    const int64_t most = CHUNK_TILE * group;  // heads a tile has
    const int64_t parts = std::min(most, (4 * at::get_num_threads() + pairs - 1) / pairs);
    at::parallel_for(0, pairs * parts, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> query(most * dim), acc(most * dim), total(most), scores;
        for (int64_t task = begin; task < end; ++task) {
            const int64_t pair = task / parts, tile = pair / kv_heads, h = pair % kv_heads;
            const int64_t r0 = tile * CHUNK_TILE, r1 = std::min(count, r0 + CHUNK_TILE);
            const int64_t all = (r1 - r0) * group, share = (all + parts - 1) / parts;
            const int64_t j0 = task % parts * share, j1 = std::min(all, j0 + share);
            if (j0 >= j1) continue;
            const int64_t n = start + r1;  // the tile's last row's slots
            for (int64_t j = j0; j < j1; ++j) {
                const T* qrow = qp + (r0 + j / group) * q.stride(0) + (h * group + j % group) * dim;
                for (int64_t d = 0; d < dim; ++d) query[j * dim + d] = static_cast<float>(qrow[d]) * s;
            }
            scores.resize(all * n);
            const Paged<C> k{kp + h * keys.stride(1), table, keys.stride(0), keys.stride(2), tokens, shift};
            const Paged<C> v{vp + h * values.stride(1), table, values.stride(0), values.stride(2), tokens, shift};
            attend_tile<C>(query.data(), k, v, n, dim, group, start + r0, j0, j1, parts == 1, reduced,
                           scores.data(), total.data(), acc.data());
            for (int64_t j = j0; j < j1; ++j) {
                T* orow = op + ((r0 + j / group) * heads + h * group + j % group) * dim;
                const float inv = 1.0f / total[j];
                for (int64_t d = 0; d < dim; ++d) orow[d] = static_cast<T>(acc[j * dim + d] * inv);
            }
        }
    });
}
#endif

// T: the queries' and the result's type; C: the cache's (the same, or fp16 under fp32 queries).
// rows_of(b, h) gives the accessors of row b's keys and values at KV head h.
// window > 0: row b attends to its last ``window`` slots only (positions[b] - window + 1 …), a
// sliding-window layer's; rows_of(b, h, first) then gives accessors from slot ``first`` on.
// softcap > 0: the scores soft-capped before the softmax (Gemma 2).
template <typename T, typename C, typename At>
void attend_impl(const torch::Tensor& q, int64_t kv_heads, int64_t dim, const At& rows_of, const int64_t* positions,
                 double scale, torch::Tensor& out, int64_t window = 0, double softcap = 0.0) {
    const float cap = static_cast<float>(softcap);
    const int64_t batch = q.size(0);
    const int64_t group = q.size(1) / kv_heads;
    const T* qp = q.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const float s = static_cast<float>(scale);
    constexpr bool reduced = std::is_same<T, at::BFloat16>::value;
    // A task: one (row, KV head) and a share of its query heads. Few pairs (one sequence: 3 KV
    // heads on the default model, for 2 threads) are split by query heads so that the threads
    // get even shares; a head's result is the same whichever share computed it.
    // An int8 cache's values cost more to convert than a 16-bit one's: its tasks take as many query
    // heads as the threads allow, so each converts a slot once for more of them.
    const int64_t pairs = batch * kv_heads;
    const int64_t spread = std::is_same<C, Q8>::value ? 1 : 4;
    const int64_t parts = std::min(group, (spread * at::get_num_threads() + pairs - 1) / pairs);
    const int64_t share = (group + parts - 1) / parts;
#ifdef WORKBENCH_AVX512
    const bool vectors = dim % 16 == 0 && dim <= FAST_DIM;
#endif
    at::parallel_for(0, pairs * parts, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> query(group * dim), acc(group * dim), key(dim), total(group), scores;
        for (int64_t task = begin; task < end; ++task) {
            const int64_t pair = task / parts, b = pair / kv_heads, h = pair % kv_heads;
            const int64_t first = window > 0 ? std::max<int64_t>(0, positions[b] - window + 1) : 0;
            const int64_t n = positions[b] + 1 - first;
            const int64_t g0 = task % parts * share, g1 = std::min(group, g0 + share);
            if (g0 >= g1) continue;
            const T* qrow = qp + b * q.stride(0) + h * group * dim;  // a row's heads lie side by side
            for (int64_t i = g0 * dim; i < g1 * dim; ++i) query[i] = static_cast<float>(qrow[i]) * s;
            scores.resize(group * n);
            const auto rows = rows_of(b, h, first);
#ifdef WORKBENCH_AVX512
            if (vectors)
                attend_vectors<C>(query.data(), rows.first, rows.second, n, dim, g0, g1, parts == 1, reduced, scores.data(),
                                  total.data(), acc.data(), cap);
            else
#endif
                attend_plain<C>(query.data(), rows.first, rows.second, n, dim, g0, g1, reduced, key.data(), scores.data(),
                                total.data(), acc.data(), cap);
            T* orow = op + (b * q.size(1) + h * group) * dim;
            for (int64_t g = g0; g < g1; ++g) {
                const float inv = 1.0f / total[g];
                for (int64_t d = 0; d < dim; ++d) orow[g * dim + d] = static_cast<T>(acc[g * dim + d] * inv);
            }
        }
    });
}

template <typename T, typename C>
void attend_rows_impl(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                      const int64_t* positions, double scale, torch::Tensor& out) {
    const auto* kp = stored<C>(keys);
    const auto* vp = stored<C>(values);
    const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
    const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);
    auto rows_of = [=](int64_t b, int64_t h, int64_t) {  // no window here: first is 0
        return std::make_pair(Strided<C>{kp + b * ks0 + h * ks1, ks2}, Strided<C>{vp + b * vs0 + h * vs1, vs2});
    };
    attend_impl<T, C>(q, keys.size(1), q.size(3), rows_of, positions, scale, out);
}

template <typename T, typename C>
void attend_paged_impl(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                       const torch::Tensor& table, const int64_t* positions, double scale, torch::Tensor& out,
                       int64_t window, double softcap) {
    const auto* kp = stored<C>(keys);
    const auto* vp = stored<C>(values);
    const int64_t* tp = table.data_ptr<int64_t>();
    const int64_t ts = table.stride(0), tokens = keys.size(2);
    int shift = -1;
    for (int i = 0; i < 31; ++i)
        if ((int64_t{1} << i) == tokens) shift = i;
    const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
    const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);
    auto rows_of = [=](int64_t b, int64_t h, int64_t first) {
        return std::make_pair(Paged<C>{kp + h * ks1, tp + b * ts, ks0, ks2, tokens, shift, first},
                              Paged<C>{vp + h * vs1, tp + b * ts, vs0, vs2, tokens, shift, first});
    };
    attend_impl<T, C>(q, keys.size(1), q.size(3), rows_of, positions, scale, out, window, softcap);
}

// The row a cache of keys' type keeps for a head of ``dim`` values: dim elements, or a Q8 cache's bytes.
int64_t cache_row(const torch::Tensor& keys, int64_t dim) {
    return keys.scalar_type() == at::kChar ? CacheOf<Q8>::row_bytes(dim) : dim;
}

void check_attention_types(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                           const char* name) {
    const auto cache = keys.scalar_type();
    TORCH_CHECK(cache == values.scalar_type() &&
                    (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                    (cache == q.scalar_type() || cache == at::kHalf || cache == at::kBFloat16 || cache == at::kChar),
                name,
                ": q float32 or bfloat16, keys and values of one type: q's, float16, bfloat16 or int8 (q8_0 blocks)");
    TORCH_CHECK(cache != at::kChar || q.size(3) % Q8_BLOCK == 0, name,
                ": an int8 cache needs a head size that is a multiple of 32");
    TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, name, ": the cache's last dimension contiguous");
}

template <typename X>
struct Tag {
    using type = X;
};

// f(Tag<queries' type>, Tag<cache's type>) for the types check_attention_types takes.
template <typename F>
void with_types(const torch::Tensor& q, const torch::Tensor& keys, F&& f) {
    auto cache = [&](auto t) {
        switch (keys.scalar_type()) {
            case at::kHalf: f(t, Tag<at::Half>{}); break;
            case at::kBFloat16: f(t, Tag<at::BFloat16>{}); break;
            case at::kChar: f(t, Tag<Q8>{}); break;
            default: f(t, Tag<float>{}); break;
        }
    };
    if (q.scalar_type() == at::kFloat) cache(Tag<float>{});
    else cache(Tag<at::BFloat16>{});
}

// a batched step's queries are a slice of the rotated queries and keys ([B, heads + KV heads, 1,
// D]): rows apart, each row's heads side by side, read as they lie (a copy was 0.15 ms of a
// 16-row int8-fast step)
torch::Tensor heads_side_by_side(const torch::Tensor& q) {
    return q.stride(3) == 1 && q.stride(1) == q.size(3) ? q : q.contiguous();
}

// q [B, H, 1, D]; keys and values [B, KV heads, capacity, D] (the last dimension contiguous), of
// q's type or fp16 under fp32 queries (the quantized precisions' cache, as llama.cpp's F16);
// positions [B] int64: row b attends to its slots 0…positions[b]. Returns [B, H, 1, D], q's type.
torch::Tensor attend_rows(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                          const torch::Tensor& positions, double scale) {
    TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && keys.dim() == 4 && values.sizes() == keys.sizes(),
                "attend_rows: q [B, H, 1, D], keys and values [B, KV heads, capacity, D]");
    check_attention_types(q, keys, values, "attend_rows");
    TORCH_CHECK(q.size(0) == keys.size(0) && cache_row(keys, q.size(3)) == keys.size(3) &&
                    q.size(1) % keys.size(1) == 0,
                "attend_rows: q's rows, head size and heads must match the cache's");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == q.size(0),
                "attend_rows: positions, int64 [B]");
    auto qc = heads_side_by_side(q);
    auto pc = positions.contiguous();
    const int64_t* pp = pc.data_ptr<int64_t>();
    for (int64_t b = 0; b < pc.size(0); ++b)
        TORCH_CHECK(pp[b] >= 0 && pp[b] < keys.size(2), "attend_rows: a position outside the cache");
    auto out = torch::empty({q.size(0), q.size(1), 1, q.size(3)}, q.options());
    with_types(qc, keys, [&](auto t, auto c) {
        attend_rows_impl<typename decltype(t)::type, typename decltype(c)::type>(qc, keys, values, pp, scale, out);
    });
    return out;
}

#ifdef WORKBENCH_AVX512
// Whether rows 0 … B - 1 are one sequence's consecutive positions (speculation's last token and
// its guesses in one batched step): each row's position one past the row before's, over the same
// blocks. Then they are a prompt chunk's rows: attend_chunk's tiles read each block once for them
// all (the rows apart read it once each), with each row's result the same.
bool one_sequence(const int64_t* tp, int64_t stride, const int64_t* pp, int64_t rows, int64_t tokens) {
    if (rows < 2) return false;
    for (int64_t b = 1; b < rows; ++b) {
        if (pp[b] != pp[0] + b) return false;
        for (int64_t i = 0; i <= pp[b] / tokens; ++i)
            if (tp[b * stride + i] != tp[i]) return false;
    }
    return true;
}
#endif

// The paged forms' queries and pool: q [rows, H, 1, D]; keys and values [blocks, KV heads, block
// tokens, D] of the types check_attention_types takes, each block's slots side by side.
void check_pool(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values, const char* name) {
    TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && keys.dim() == 4 && values.sizes() == keys.sizes(),
                name, ": q [rows, H, 1, D], keys and values [blocks, KV heads, block tokens, D]");
    check_attention_types(q, keys, values, name);
    TORCH_CHECK(cache_row(keys, q.size(3)) == keys.size(3) && q.size(1) % keys.size(1) == 0,
                name, ": q's head size and heads must match the pool's");
    TORCH_CHECK(keys.stride(2) == keys.size(3) && values.stride(2) == values.size(3), name,
                ": a block's slots side by side");
}

// The same through block tables: keys and values are the pool, [blocks, KV heads, block tokens,
// D]; table [B, W] int64 names row b's blocks in the order of its tokens; row b attends to its
// slots 0…positions[b], so its first positions[b] / block tokens + 1 entries must be blocks of the pool.
// window > 0 (a sliding-window layer): only its last ``window`` slots, and only their blocks are read
// (the entries before them may name blocks given back). softcap > 0: scores soft-capped (Gemma 2).
torch::Tensor attend_paged(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                           const torch::Tensor& table, const torch::Tensor& positions, double scale,
                           int64_t window, double softcap) {
    check_pool(q, keys, values, "attend_paged");
    TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(0) == q.size(0) &&
                    table.stride(1) == 1,
                "attend_paged: table, int64 [B, W], each row's blocks side by side");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == q.size(0),
                "attend_paged: positions, int64 [B]");
    auto qc = heads_side_by_side(q);
    auto pc = positions.contiguous();
    const int64_t* pp = pc.data_ptr<int64_t>();
    const int64_t* tp = table.data_ptr<int64_t>();
    const int64_t tokens = keys.size(2), blocks = keys.size(0);
    for (int64_t b = 0; b < pc.size(0); ++b) {
        TORCH_CHECK(pp[b] >= 0 && pp[b] / tokens < table.size(1), "attend_paged: a position past its block table");
        const int64_t first = window > 0 ? std::max<int64_t>(0, pp[b] - window + 1) : 0;
        for (int64_t i = first / tokens; i <= pp[b] / tokens; ++i) {
            const int64_t block = tp[b * table.stride(0) + i];
            TORCH_CHECK(block >= 0 && block < blocks, "attend_paged: a block outside the pool");
        }
    }
    auto out = torch::empty({q.size(0), q.size(1), 1, q.size(3)}, q.options());
#ifdef WORKBENCH_AVX512
    if (window <= 0 && softcap <= 0 && q.size(3) % 16 == 0 && q.size(3) <= FAST_DIM &&
        one_sequence(tp, table.stride(0), pp, pc.size(0), tokens)) {
        with_types(qc, keys, [&](auto t, auto c) {
            attend_chunk_tiles<typename decltype(t)::type, typename decltype(c)::type>(qc, keys, values, tp, pp[0],
                                                                                       scale, out);
        });
        return out;
    }
#endif
    with_types(qc, keys, [&](auto t, auto c) {
        attend_paged_impl<typename decltype(t)::type, typename decltype(c)::type>(qc, keys, values, table, pp, scale,
                                                                                  out, window, softcap);
    });
    return out;
}

// A prompt chunk's attention through its sequence's block table: q [count, H, 1, D], one row per
// new token at positions start … start + count - 1 (their keys and values already in the pool);
// table [W] int64, the sequence's blocks in the order of its tokens. Row i attends to slots
// 0 … start + i (its last ``window`` of them where window > 0). Returns [count, H, 1, D], q's
// type: each row as attend_paged gives it alone.
torch::Tensor attend_chunk(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                           const torch::Tensor& table, int64_t start, double scale, int64_t window, double softcap) {
    check_pool(q, keys, values, "attend_chunk");
    TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 1 && table.stride(0) == 1,
                "attend_chunk: table, int64 [W], the blocks side by side");
    const int64_t count = q.size(0), tokens = keys.size(2);
    TORCH_CHECK(start >= 0 && count > 0 && (start + count - 1) / tokens < table.size(0),
                "attend_chunk: the chunk's positions past its block table");
    const int64_t* tp = table.data_ptr<int64_t>();
    const int64_t first = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
    for (int64_t i = first / tokens; i <= (start + count - 1) / tokens; ++i)
        TORCH_CHECK(tp[i] >= 0 && tp[i] < keys.size(0), "attend_chunk: a block outside the pool");
    auto qc = heads_side_by_side(q);
    auto out = torch::empty({count, q.size(1), 1, q.size(3)}, q.options());
#ifdef WORKBENCH_AVX512
    if (q.size(3) % 16 == 0 && q.size(3) <= FAST_DIM && window <= 0 && softcap <= 0) {  // else a row at a time
        with_types(qc, keys, [&](auto t, auto c) {
            attend_chunk_tiles<typename decltype(t)::type, typename decltype(c)::type>(qc, keys, values, tp, start,
                                                                                       scale, out);
        });
        return out;
    }
#endif
    // elsewhere a row at a time (the plain loops), through the same table for every row
    auto positions = torch::arange(start, start + count, table.options());
    auto rows = table.view({1, -1}).expand({count, table.size(0)});
    const int64_t* pp = positions.data_ptr<int64_t>();
    with_types(qc, keys, [&](auto t, auto c) {
        attend_paged_impl<typename decltype(t)::type, typename decltype(c)::type>(qc, keys, values, rows, pp, scale,
                                                                                  out, window, softcap);
    });
    return out;
}

// Rows' new keys (or values) written into an int8 pool as q8_0 blocks, as llama.cpp quantizes
// them into its q8_0 cache: per block of 32, the scale d = the largest magnitude / 127 (kept as
// fp16), each code round(x / d) (half away from zero), all zeros where the block is. pool [blocks,
// KV heads, block tokens, D / 32 × 34] int8; blocks and slots [R] int64 (row r goes to slot
// slots[r] of block blocks[r]); x [R, KV heads, D] float32 or bfloat16.
void write_q8(torch::Tensor pool, const torch::Tensor& blocks, const torch::Tensor& slots, const torch::Tensor& x) {
    TORCH_CHECK(pool.scalar_type() == at::kChar && pool.dim() == 4 && pool.stride(3) == 1,
                "write_q8: pool int8 [blocks, KV heads, block tokens, D / 32 × 34], its last dimension contiguous");
    TORCH_CHECK(x.dim() == 3 && x.size(1) == pool.size(1) && x.size(2) % Q8_BLOCK == 0 &&
                    CacheOf<Q8>::row_bytes(x.size(2)) == pool.size(3),
                "write_q8: x [R, KV heads, D] with D a multiple of 32 and the pool's rows D / 32 × 34 bytes");
    TORCH_CHECK(blocks.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && blocks.dim() == 1 &&
                    slots.dim() == 1 && blocks.size(0) == x.size(0) && slots.size(0) == x.size(0),
                "write_q8: blocks and slots int64 [R]");
    auto xs = x.to(at::kFloat).contiguous();
    auto bc = blocks.contiguous(), sc = slots.contiguous();
    const int64_t* bp = bc.data_ptr<int64_t>();
    const int64_t* sp = sc.data_ptr<int64_t>();
    const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2);
    for (int64_t r = 0; r < rows; ++r)
        TORCH_CHECK(bp[r] >= 0 && bp[r] < pool.size(0) && sp[r] >= 0 && sp[r] < pool.size(2),
                    "write_q8: a slot outside the pool");
    const float* xp = xs.data_ptr<float>();
    int8_t* pp = pool.data_ptr<int8_t>();
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < heads; ++h) {
            const float* src = xp + (r * heads + h) * dim;
            int8_t* row = pp + bp[r] * pool.stride(0) + h * pool.stride(1) + sp[r] * pool.stride(2);
            for (int64_t b = 0; b < dim / Q8_BLOCK; ++b) {
                const float* v = src + b * Q8_BLOCK;
                int8_t* block = row + b * Q8_BLOCK_BYTES;
                float top = 0.0f;
                for (int64_t i = 0; i < Q8_BLOCK; ++i) top = std::max(top, std::fabs(v[i]));
                const float d = top / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
                const uint16_t bits = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
                std::memcpy(block, &bits, 2);
                for (int64_t i = 0; i < Q8_BLOCK; ++i) block[2 + i] = static_cast<int8_t>(std::round(v[i] * inv));
            }
        }
}

}  // namespace
