// The operators, for a kernel file that has defined (in its anonymous namespace) what they call:
//   quantize_rows(x, M, K, offset, with_sums, out)    the activations, per block of 32
//   q8_tile<TM, TN>(…), q4_tile<TM, TN>(…)            one tile of rows × column groups
//   Q8_OFFSET                                           q8's activations stored as q + 128
//   ROW_TILE, COL_TILE, ROW1_COL_TILE                   the tiles the registers hold (rows × groups of
//                                                       16 columns; groups for a single row)
//   FEW_ROWS_TOGETHER                                   whether up to ROW_TILE + 1 rows fit one tile
// and, where it defines WORKBENCH_AMX (q8_gemm_amx.cpp), for products of at least AMX_ROWS rows:
//   amx_allowed()                                       whether this process may use the tiles
//   quantized_room(…), quantize_blocks(…)               quantize_rows's two halves: room, then a
//                                                       range of blocks (q8_avx512.h)
//   amx_tiles(M, groups, items, quantize, tile)         the activations' blocks quantized, then the
//                                                       walk over AMX tiles of 16 rows × 16 columns
//   q8_amx<FULL>(…), q4_amx<FULL>(…)                    one such tile (FULL: 16 rows, else fewer)
// It also defines the batched decode step's attention (attention.h: with its AVX-512 loops where
// the file is built on q8_avx512.h, WORKBENCH_AVX512) and each row of scores' log-normaliser and
// largest few (scores.h).
// Included once, last, by each kernel file (one of which a process loads).

#pragma once

#include "attention.h"
#include "scores.h"

#ifdef WORKBENCH_AVX512
#include "dense.h"
#else
namespace {
torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& w) { return at::linear(x, w); }
}  // namespace
#endif

torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales) {
    TORCH_CHECK(w.dim() == 5 && w.size(2) == 8 && w.size(3) == 16 && w.size(4) == 4 && w.scalar_type() == at::kChar &&
                    w.is_contiguous(), "q8 weights: contiguous int8 [N/16, K/32, 8, 16, 4]");
    const int64_t M = x.size(0), groups = w.size(0), K = w.size(1) * BLOCK, N = groups * 16;
    check(x, K);
    TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
                    scales.size(0) == groups && scales.size(1) == K / BLOCK && scales.size(2) == 16,
                "q8 scales: contiguous fp16 [N/16, K/32, 16]");
    auto y = torch::empty({M, N}, x.options());
    QuantizedRows xq;
    const int8_t* wp = w.data_ptr<int8_t>();
    const at::Half* sp = scales.data_ptr<at::Half>();
    by_dtype(x, y, [&](const auto* xp, auto* yp) {
#ifdef WORKBENCH_AMX
        if (M >= AMX_ROWS && amx_allowed()) {  // signed activations: AMX multiplies signed by signed
            quantized_room(M, K, false, xq);
            amx_tiles(M, groups, M * (K / BLOCK),
                      [&](int64_t begin, int64_t end) { quantize_blocks(xp, K, false, false, xq, begin, end); },
                      [&](auto full, int64_t m0, int rows, int64_t g) {
                          q8_amx<decltype(full)::value>(wp, sp, xq, m0, rows, g, K, N, yp);
                      });
            return;
        }
#endif
        quantize_rows(xp, M, K, Q8_OFFSET, false, xq);
        auto tile = [&](auto tm, auto tn, int64_t m0, int64_t g0) {
            q8_tile<decltype(tm)::value, decltype(tn)::value>(wp, sp, xq, m0, g0, K, N, yp);
        };
        tiles<ROW_TILE, COL_TILE, ROW1_COL_TILE, FEW_ROWS_TOGETHER>(M, groups, tile);
    });
    return y;
}

torch::Tensor q4_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& d,
                        const torch::Tensor& mins) {
    TORCH_CHECK(w.dim() == 5 && w.size(2) == 4 && w.size(3) == 16 && w.size(4) == 4 && w.scalar_type() == at::kByte &&
                    w.is_contiguous(), "q4 weights: contiguous uint8 [N/16, K/32, 4, 16, 4]");
    const int64_t M = x.size(0), groups = w.size(0), K = w.size(1) * BLOCK, N = groups * 16;
    check(x, K);
    TORCH_CHECK(d.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf && d.is_contiguous() &&
                    mins.is_contiguous() && d.dim() == 3 && d.size(0) == groups && d.size(1) == K / BLOCK &&
                    d.size(2) == 16 && mins.sizes() == d.sizes(),
                "q4 scales and minimums: contiguous fp16 [N/16, K/32, 16]");
    auto y = torch::empty({M, N}, x.options());
    QuantizedRows xq;
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const at::Half* dp = d.data_ptr<at::Half>();
    const at::Half* mp = mins.data_ptr<at::Half>();
    by_dtype(x, y, [&](const auto* xp, auto* yp) {
#ifdef WORKBENCH_AMX
        if (M >= AMX_ROWS && amx_allowed()) {
            quantized_room(M, K, true, xq);
            amx_tiles(M, groups, M * (K / BLOCK),
                      [&](int64_t begin, int64_t end) { quantize_blocks(xp, K, false, true, xq, begin, end); },
                      [&](auto full, int64_t m0, int rows, int64_t g) {
                          q4_amx<decltype(full)::value>(wp, dp, mp, xq, m0, rows, g, K, N, yp);
                      });
            return;
        }
#endif
        quantize_rows(xp, M, K, false, true, xq);
        auto tile = [&](auto tm, auto tn, int64_t m0, int64_t g0) {
            q4_tile<decltype(tm)::value, decltype(tn)::value>(wp, dp, mp, xq, m0, g0, K, N, yp);
        };
        tiles<ROW_TILE, COL_TILE, ROW1_COL_TILE, FEW_ROWS_TOGETHER>(M, groups, tile);
    });
    return y;
}

// Reads every byte of ``data`` (contiguous, whole 64-byte lines) once: each thread its own share,
// as ``streams`` runs side by side (a line of each in turn, as a matrix product reads several
// rows at once), the lines OR-ed together in registers and returned so the reads can't be dropped.
// What the memory's read bandwidth is measured with (engine/estimates/hardware.py): the memory
// delivers more to a core reading two or more runs at once than one (measured on a 2-core EPYC:
// 35 GB/s with one run a thread, 53 with two; a PyTorch sum, 37), so the ceiling is the best count.
torch::Tensor read_bytes(const torch::Tensor& data, int64_t streams) {
    TORCH_CHECK(data.is_contiguous() && data.nbytes() % 64 == 0, "read_bytes: a contiguous tensor of whole 64-byte lines");
    TORCH_CHECK(streams >= 1 && streams <= 64, "read_bytes: 1 to 64 streams");
    const char* base = static_cast<const char*>(data.data_ptr());
    const int64_t lines = static_cast<int64_t>(data.nbytes() / 64);
    const int threads = at::get_num_threads();
    std::vector<uint64_t> seen(static_cast<size_t>(threads) * 8, 0);
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const int64_t first = lines * t / threads, last = lines * (t + 1) / threads;
            const int64_t run = (last - first) / streams;
            uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            auto take = [&](int64_t line) {
                const uint64_t* w = reinterpret_cast<const uint64_t*>(base + line * 64);
#pragma omp simd
                for (int i = 0; i < 8; ++i) acc[i] |= w[i];
            };
            for (int64_t i = 0; i < run; ++i)
                for (int64_t s = 0; s < streams; ++s) take(first + s * run + i);
            for (int64_t line = first + streams * run; line < last; ++line) take(line);  // what the runs left
            for (int i = 0; i < 8; ++i) seen[t * 8 + i] = acc[i];
        }
    });
    uint64_t all = 0;
    for (uint64_t v : seen) all |= v;
    return torch::tensor(static_cast<int64_t>(all & 0x7FFFFFFFFFFFFFFFull));
}

TORCH_LIBRARY(workbench, m) {
    m.def("read_bytes(Tensor data, int streams=1) -> Tensor");
    m.def("q8_linear(Tensor x, Tensor w, Tensor scales) -> Tensor");
    m.def("q4_linear(Tensor x, Tensor w, Tensor d, Tensor mins) -> Tensor");
    m.def("dense_linear(Tensor x, Tensor w) -> Tensor");
    m.def("attend_rows(Tensor q, Tensor keys, Tensor values, Tensor positions, float scale) -> Tensor");
    m.def("attend_paged(Tensor q, Tensor keys, Tensor values, Tensor table, Tensor positions, float scale, "
          "int window=0, float softcap=0.) -> Tensor");
    m.def("attend_chunk(Tensor q, Tensor keys, Tensor values, Tensor table, int start, float scale, "
          "int window=0, float softcap=0.) -> Tensor");
    m.def("row_totals(Tensor scores, int k) -> (Tensor, Tensor, Tensor)");
    m.def("write_q8(Tensor(a!) pool, Tensor blocks, Tensor slots, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(workbench, CPU, m) {
    m.impl("read_bytes", &read_bytes);
    m.impl("q8_linear", &q8_linear);
    m.impl("q4_linear", &q4_linear);
    m.impl("dense_linear", &dense_linear);
    m.impl("attend_rows", &attend_rows);
    m.impl("attend_paged", &attend_paged);
    m.impl("attend_chunk", &attend_chunk);
    m.impl("row_totals", &row_totals);
    m.impl("write_q8", &write_q8);
}
