// The AMX build of the int8 kernels (CPUs with AMX-INT8, which all have AVX-512 VNNI): products
// of AMX_ROWS rows or more (prompts, batches) run on AMX tiles, 16 rows × 16 columns at a time;
// fewer rows (one token's decode) on q8_avx512.h's VNNI tiles, which stream the weights as fast.
//
// The weights need no other layout: one block of 32 inputs × 16 columns of q8_avx512.h's
// interleaved weights, [8, 16, 4] int8, is exactly an AMX B tile of 8 rows × 64 bytes (each row
// 4 inputs of 16 columns); q4's [4, 16, 4] bytes are unpacked per block into such a tile (row
// 2v the low nibbles of part v, row 2v+1 the high ones). An A tile is 16 rows × 32 bytes of the
// quantized activations (one block of every row), a C tile the 16 × 16 int32 dot products.
// AMX adds no scales: each block's products are stored and scaled into fp32 sums with AVX-512,
// in the same order of operations as the VNNI tiles, so a row's result is the same whichever
// tiles computed it (and whatever other rows were in the product).
//
// q8: both sides signed (tdpbssd), the activations stored as q, not q + 128. q4: signed
// activations × unsigned nibbles (tdpbsud), as the VNNI tiles' Q4_1 × Q8_1.

#include "q8_avx512.h"

#include <omp.h>
#include <sys/syscall.h>
#include <utility>
#include <unistd.h>

namespace {

constexpr int64_t AMX_ROWS = 16;
constexpr int TILE_ROWS = 16;

// How far ahead of its tile load a block of weights is fetched into L1 (prefetcht0): a tile load
// that misses the cache holds up the tiles, where the prefetches keep the memory busy while they
// compute. On a whole model's products of 16 rows (every weight from memory, as in a batched
// decode step), 1.13-1.24× faster for q8 at 2-6 KiB ahead, 1.0-1.09× for q4 (less bound by
// memory); 16 sequences through the engine core, int8-fast: 1.13×. q8 also fetches 16 KiB ahead
// into L2 (prefetcht1): L1 holds too few lines in flight to cover the memory's latency alone;
// 1.10-1.12× on the same products (8-24 KiB alike), where q4 (half the bytes per block) was
// 0.96-0.99×.
constexpr int64_t AHEAD_BYTES = 4096, FAR_AHEAD_BYTES = 16384;

template <bool FAR>
inline void fetch_ahead(const void* block, int bytes) {
    const char* p = static_cast<const char*>(block);
    for (int l = 0; l < bytes; l += 64) {  // past the weights' end: harmless (a prefetch never faults)
        _mm_prefetch(p + AHEAD_BYTES + l, _MM_HINT_T0);
        if constexpr (FAR) _mm_prefetch(p + FAR_AHEAD_BYTES + l, _MM_HINT_T1);
    }
}

// ldtilecfg's 64-byte operand (palette 1).
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// Tiles 0 and 1: the activations of an even and an odd block; 2 and 3: their weights; 4 and 5:
// their products. Two sets, so the next block's product runs while this one's is scaled.
void configure(int rows) {
    TileConfig c;
    for (int t = 0; t < 2; ++t) {
        c.rows[t] = rows, c.colsb[t] = BLOCK;
        c.rows[2 + t] = BLOCK / 4, c.colsb[2 + t] = 64;
        c.rows[4 + t] = rows, c.colsb[4 + t] = 64;
    }
    // inline, not _tile_loadconfig: GCC 12 declares that one as reading 8 bytes of the 64
    asm volatile("ldtilecfg %0" ::"m"(c));
}

// Linux gives a process AMX's register state only when it asks (arch_prctl, Linux 5.16+); where
// it refuses, the VNNI tiles do all the rows.
bool amx_allowed() {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    static const bool allowed = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return allowed;
}

// Every 16-row × 16-column tile of column groups begin … end - 1: whole tiles of 16 rows, then
// the rows left (fewer, with their own configuration).
template <typename Tile>
void amx_columns(int64_t M, int64_t begin, int64_t end, Tile&& tile) {
    const int64_t whole = M / TILE_ROWS * TILE_ROWS;
    if (whole) {
        configure(TILE_ROWS);
        for (int64_t m0 = 0; m0 < whole; m0 += TILE_ROWS)
            for (int64_t g = begin; g < end; ++g) tile(std::true_type{}, m0, TILE_ROWS, g);
    }
    if (M > whole) {
        configure(static_cast<int>(M - whole));
        for (int64_t g = begin; g < end; ++g) tile(std::false_type{}, whole, static_cast<int>(M - whole), g);
    }
    _tile_release();
}

// A product's activations quantized (quantize(begin, end): blocks begin … end - 1 of its items),
// then its tiles, in one parallel region: each thread quantizes its share of the blocks, waits
// at a barrier for the others', and takes its share of the columns. Two regions (a fork and a
// join each) had cost ~1.5 µs more per product, 121 products a decode step: the whole model's
// products at 16 rows 1.03× faster (q8; q4 1.03×), at 24 and 512 rows 1.01×, alternating in one
// process. Nothing in the region may throw (an exception can't leave it: no checks in there).
// Nested in another parallel region the team is this thread alone, by OpenMP's default of one
// active level (the operators are called from Python, never from a parallel region).
template <typename Quantize, typename Tile>
void amx_tiles(int64_t M, int64_t groups, int64_t items, Quantize&& quantize, Tile&& tile) {
    const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups)));
#pragma omp parallel num_threads(threads)
    {
        const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t per = (items + n - 1) / n, share = (groups + n - 1) / n;
        quantize(std::min(items, t * per), std::min(items, (t + 1) * per));
#pragma omp barrier
        amx_columns(M, std::min(groups, t * share), std::min(groups, (t + 1) * share), tile);
    }
}

// GCC's tile loads are asm statements that name no memory (its tile store clobbers all memory,
// which keeps the products' reads after it), so the compiler would be free to move the stores of
// unpacked weights after the tile load that reads them: a barrier on each side of every tile load
// and store of memory the code also touches (its cost, measured: none, since RowSums).
inline void memory_barrier() { asm volatile("" ::: "memory"); }

// The loop both kinds share, a block of 32 inputs at a time: weights(b, set) gives block b's B
// tile (set: which of two buffers, for a kind that unpacks), dot(set) multiplies set's tiles,
// scale(b, products) adds block b's int32 products into the fp32 sums. Pipelined: block b+1's
// product is under way on the tile unit while block b's is stored and scaled (13% faster at 512
// rows than one block at a time).
template <typename Weights, typename Dot, typename Scale>
__attribute__((always_inline)) inline void amx_blocks(const uint8_t* a, int64_t K, Weights&& weights, Dot&& dot, Scale&& scale) {
    const int64_t blocks = K / BLOCK;
    alignas(64) int32_t products[TILE_ROWS][16];
    auto issue = [&](int64_t b, auto set) {  // the tile numbers are literals in GCC's intrinsics
        const void* block = weights(b, decltype(set)::value);
        memory_barrier();
        if constexpr (decltype(set)::value == 0) {
            _tile_loadd(0, a + b * BLOCK, K);
            _tile_loadd(2, block, 64);
            _tile_zero(4);
        } else {
            _tile_loadd(1, a + b * BLOCK, K);
            _tile_loadd(3, block, 64);
            _tile_zero(5);
        }
        memory_barrier();
        dot(set);
    };
    const std::integral_constant<int, 0> even;
    const std::integral_constant<int, 1> odd;
    issue(0, even);
    for (int64_t b = 0; b < blocks; b += 2) {
        if (b + 1 < blocks) issue(b + 1, odd);
        memory_barrier();
        _tile_stored(4, products, 64);
        memory_barrier();
        scale(b, products);
        if (b + 1 < blocks) {
            if (b + 2 < blocks) issue(b + 2, even);
            memory_barrier();
            _tile_stored(5, products, 64);
            memory_barrier();
            scale(b + 1, products);
        }
    }
}

// The fp32 sums of a tile's rows, in 16 registers through the loop over blocks: variables reached
// by constant indices (for_rows), where GCC kept an array of 16 vectors in memory (too large for
// its scalar replacement), loading and storing every row's sums at every block; warm in cache,
// a product of 16 rows by 576 × 3072 weights took 48 µs instead of 51-58. With q8's fetch into L2
// (above), a whole int8-fast decode step of 16 sequences: 1.09× faster than before both
// (alternating in one process: 9.00 against 9.76 ms).
struct RowSums {
    __m512 r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, r15;
    template <int I>
    __m512& at() {
        static_assert(I >= 0 && I < TILE_ROWS, "a row of the tile");
        if constexpr (I == 0) return r0; else if constexpr (I == 1) return r1;
        else if constexpr (I == 2) return r2; else if constexpr (I == 3) return r3;
        else if constexpr (I == 4) return r4; else if constexpr (I == 5) return r5;
        else if constexpr (I == 6) return r6; else if constexpr (I == 7) return r7;
        else if constexpr (I == 8) return r8; else if constexpr (I == 9) return r9;
        else if constexpr (I == 10) return r10; else if constexpr (I == 11) return r11;
        else if constexpr (I == 12) return r12; else if constexpr (I == 13) return r13;
        else if constexpr (I == 14) return r14; else return r15;
    }
};

// f(row) for each row of a tile, row an integral constant: all 16 where FULL, else the first rows.
template <bool FULL, typename F, std::size_t... I>
__attribute__((always_inline)) inline void for_rows(int rows, F&& f, std::index_sequence<I...>) {
    ((FULL || static_cast<int>(I) < rows ? f(std::integral_constant<int, I>{}) : void()), ...);
}
template <bool FULL, typename F>
__attribute__((always_inline)) inline void for_rows(int rows, F&& f) {
    for_rows<FULL>(rows, f, std::make_index_sequence<TILE_ROWS>{});
}

// Rows m0 … m0+rows (16 where FULL) of columns 16·g … 16·g+15: q8.
template <bool FULL, typename T>
void q8_amx(const int8_t* w, const at::Half* ws, const QuantizedRows& xq, int64_t m0, int rows_left, int64_t g,
            int64_t K, int64_t N, T* y) {
    const int64_t blocks = K / BLOCK;
    const int rows = FULL ? TILE_ROWS : rows_left;
    RowSums acc;
    for_rows<FULL>(rows, [&](auto i) { acc.at<i>() = _mm512_setzero_ps(); });
    const int8_t* wg = w + g * blocks * BLOCK * 16;
    amx_blocks(
        xq.codes.data() + m0 * K, K,
        [&](int64_t b, int) {
            fetch_ahead<true>(wg + b * BLOCK * 16, BLOCK * 16);
            return wg + b * BLOCK * 16;
        },
        [](auto set) {
            if constexpr (decltype(set)::value == 0) _tile_dpbssd(4, 0, 2);
            else _tile_dpbssd(5, 1, 3);
        },
        [&](int64_t b, const int32_t (*dots)[16]) __attribute__((always_inline)) {
            const __m512 scale = halves16(ws + (g * blocks + b) * 16);
            for_rows<FULL>(rows, [&](auto i) __attribute__((always_inline)) {
                const __m512 xs = _mm512_set1_ps(xq.scales[(m0 + i) * blocks + b]);
                acc.at<i>() = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[i])),
                                              _mm512_mul_ps(scale, xs), acc.at<i>());
            });
        });
    for_rows<FULL>(rows, [&](auto i) { store16(y + (m0 + i) * N + g * 16, acc.at<i>()); });
}

// Rows m0 … m0+rows (16 where FULL) of columns 16·g … 16·g+15: q4 (Q4_1 × Q8_1).
template <bool FULL, typename T>
void q4_amx(const uint8_t* w, const at::Half* d, const at::Half* mins, const QuantizedRows& xq, int64_t m0,
            int rows_left, int64_t g, int64_t K, int64_t N, T* y) {
    const int64_t blocks = K / BLOCK;
    const int rows = FULL ? TILE_ROWS : rows_left;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    RowSums acc;
    for_rows<FULL>(rows, [&](auto i) { acc.at<i>() = _mm512_setzero_ps(); });
    alignas(64) uint8_t unpacked[2][BLOCK / 4][64];
    const uint8_t* wg = w + g * blocks * BLOCK * 8;
    amx_blocks(
        xq.codes.data() + m0 * K, K,
        [&](int64_t b, int set) {
            fetch_ahead<false>(wg + b * BLOCK * 8, BLOCK * 8);
            for (int v = 0; v < 4; ++v) {
                const __m512i packed = _mm512_loadu_si512(wg + (b * 4 + v) * 64);
                _mm512_store_si512(unpacked[set][2 * v], _mm512_and_si512(packed, nibble));
                _mm512_store_si512(unpacked[set][2 * v + 1], _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble));
            }
            return &unpacked[set][0][0];
        },
        [](auto set) {
            if constexpr (decltype(set)::value == 0) _tile_dpbsud(4, 0, 2);
            else _tile_dpbsud(5, 1, 3);
        },
        [&](int64_t b, const int32_t (*dots)[16]) __attribute__((always_inline)) {
            const __m512 scale = halves16(d + (g * blocks + b) * 16);
            const __m512 low = halves16(mins + (g * blocks + b) * 16);
            for_rows<FULL>(rows, [&](auto i) __attribute__((always_inline)) {
                const __m512 xs = _mm512_set1_ps(xq.scales[(m0 + i) * blocks + b]);
                const __m512 sum = _mm512_set1_ps(xq.sums[(m0 + i) * blocks + b]);
                acc.at<i>() = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[i])),
                                              _mm512_mul_ps(scale, xs), _mm512_fmadd_ps(low, sum, acc.at<i>()));
            });
        });
    for_rows<FULL>(rows, [&](auto i) { store16(y + (m0 + i) * N + g * 16, acc.at<i>()); });
}

}  // namespace

#define WORKBENCH_AMX
#include "q8_ops.h"
