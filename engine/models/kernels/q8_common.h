// What the int8 kernels share whatever the instruction set (q8_gemm.cpp: AVX-512 VNNI,
// q8_gemm_avx2.cpp: AVX2): the activations' quantized rows, the walk over output tiles split
// across threads, and the checks of the operands. The weights' layout, one for both, is
// described in q8_gemm.cpp.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;

// The scale of a block of activations holding a NaN: NaN, so that every output of its row is NaN
// (the engine's check of the scores then ends that request with an error) where the block's
// codes alone would have made finite nonsense of it; an infinity gives an infinite scale, codes
// 0 and NaN products (0 · ∞) by itself.
constexpr float NAN_SCALE = std::numeric_limits<float>::quiet_NaN();

// One row of activations, quantized per block of 32: codes (q + 128 for an unsigned side, or q
// itself for a signed one), each block's scale, and (q4) each block's sum of q · scale.
struct QuantizedRows {
    std::vector<uint8_t> codes;   // [M, K]
    std::vector<float> scales;    // [M, K/32]
    std::vector<float> sums;      // [M, K/32]: s · Σq (q4 only)
};

// The 4 bytes at p, repeated in every 32-bit lane.
inline int32_t four_bytes(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// Every (rows, column groups) tile of the product, split across threads by column tiles (TN
// groups of 16 columns where there are TM rows or more, else TN1: a few rows have registers to
// spare). Each column tile takes every row while its weights are in cache: row tiles of TM, then
// (FEW_ROWS_TOGETHER: where the registers hold them) one tile of the rows left, or of TM + 1 where
// one would be left, else the rest a row at a time (a verification pass's 5 rows
// read the weights from memory once and sum each weight block once, as one row does; row tiles
// over all the columns, then the last row over them again, read them twice).
template <int TM, int TN, typename Tile>
void row_tiles(int64_t m0, int64_t g, int64_t width, Tile& tile) {
    using std::integral_constant;
    int64_t c = 0;
    for (; c + TN <= width; c += TN) tile(integral_constant<int, TM>{}, integral_constant<int, TN>{}, m0, g + c);
    for (; c < width; ++c) tile(integral_constant<int, TM>{}, integral_constant<int, 1>{}, m0, g + c);
}

// The rows left after the full row tiles (fewer than TM: ``left``), as one tile of R rows.
template <int R, int TM, int TN, typename Tile>
void rows_left(int64_t left, int64_t m0, int64_t g, int64_t width, Tile& tile) {
    if constexpr (R < TM) {
        if (left == R) row_tiles<R, TN>(m0, g, width, tile);
        else rows_left<R + 1, TM, TN>(left, m0, g, width, tile);
    }
}

template <int TM, int TN, int TN1, bool FEW_ROWS_TOGETHER, typename Tile>
void tiles(int64_t M, int64_t groups, Tile&& tile) {
    const int64_t wide = M >= TM ? TN : TN1;  // the column tile the threads split by
    at::parallel_for(0, (groups + wide - 1) / wide, 1, [&](int64_t begin, int64_t end) {
        const int64_t last = std::min(end * wide, groups);
        for (int64_t g = begin * wide; g < last; g += wide) {
            const int64_t width = std::min(wide, last - g);
            int64_t m0 = 0;
            for (; m0 + TM <= M; m0 += TM) {
                if (FEW_ROWS_TOGETHER && M - m0 == TM + 1) {  // one row more than a tile: one tile of them all
                    row_tiles<TM + 1, TN>(m0, g, width, tile);
                    m0 = M;
                    break;
                }
                row_tiles<TM, TN>(m0, g, width, tile);
            }
            if (!FEW_ROWS_TOGETHER || M - m0 == 1)
                for (; m0 < M; ++m0) row_tiles<1, TN1>(m0, g, width, tile);
            else if (m0 < M) rows_left<2, TM, TN>(M - m0, m0, g, width, tile);
        }
    });
}

// How far ahead of its load each 64 bytes of weights are fetched into L1 (prefetcht0), by the
// VNNI and AVX2 tiles. Every weight comes from memory at every step (a token reads them all once),
// and the hardware's prefetchers alone kept too few lines in flight. Whole decode steps with and
// without, alternating (AVX-512 machine with AMX): int8-fast, one sequence, 1.17-1.20× faster at
// 16 KiB ahead (1.05× at 1 KiB, 1.11× at 2 KiB, 1.18× at 32 KiB, 1.10× at 64 KiB), 4 sequences
// 1.36×, 8 sequences 1.31×; int4-fast, one sequence, 1.07-1.09× (its weights half the bytes). The
// AVX2 build on the same machine: int8-fast 1.35×, int4-fast 1.21×, 4 sequences 2.0×. A fetch
// past the weights' end is harmless (a prefetch never faults). The AMX tiles keep their own,
// shorter distance (q8_gemm_amx.cpp: 8 and 16 KiB there were 0.94× of 4).
constexpr int64_t LINE_AHEAD_BYTES = 16384;

inline void fetch_line_ahead(const void* line) {
    _mm_prefetch(static_cast<const char*>(line) + LINE_AHEAD_BYTES, _MM_HINT_T0);
}

// ``run(x's data, y's data)`` with the activations' element type (float32 or bfloat16).
template <typename Run>
void by_dtype(const torch::Tensor& x, torch::Tensor& y, Run&& run) {
    if (x.scalar_type() == at::kFloat) run(x.data_ptr<float>(), y.data_ptr<float>());
    else run(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
}

void check(const torch::Tensor& x, int64_t K) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "activations: a contiguous [M, K] tensor");
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "activations: float32 or bfloat16");
    TORCH_CHECK(x.size(1) == K && K % BLOCK == 0, "activations: K a multiple of 32, as the weights'");
}

}  // namespace
