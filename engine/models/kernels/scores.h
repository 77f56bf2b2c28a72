// What the engine reads from each row of a step's scores (torch.ops.workbench.row_totals): its
// log Σ exp (the log-normaliser every logprob needs) and its k largest scores with their ids,
// best first, the lower id first among equals (greedy's token is the first; the others are the
// alternatives a token event shows), in one parallel pass, where the scores lie.
//
// Why here: right after a decode step a row of the default model's 49,152 scores sits in the
// caches of the two threads that wrote it, half in each core's. One thread's pass over it, in
// numpy, took ~0.12 ms there (~0.01 ms once hot); the sampler's three passes (argmax, less the
// largest and exponentiated, summed) took ~0.29 ms of an int8-fast token's ~11 ms, and the
// search of its five likeliest alternatives ~0.4 ms more. Here each thread reads the chunks its
// own core wrote (the product's output columns are split between threads the same way).
//
// Each row is cut into chunks of CHUNK scores whatever the batch and the threads: a chunk's
// largest score, Σ e^(score − that) and k largest, then the chunks combined in order. So a row's
// results depend on that row alone (a batched answer's logprobs equal the request's alone, bit
// for bit). A row holding NaN or +inf, or nothing but −inf, gets a NaN total (its request ends
// with an error; its largest scores are then meaningless), as numpy's and torch's would be.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t CHUNK = 4096;

// The k largest scores met so far, best first (among equals, the one met first: the lower id).
struct Largest {
    float* values;
    int64_t* ids;
    int64_t k, count = 0;

    // What a score must beat to get in (−inf until k are in: any score then).
    float bar() const { return count < k ? -std::numeric_limits<float>::infinity() : values[k - 1]; }
    bool full() const { return count == k; }

    void offer(float value, int64_t id) {
        if (full() && !(value > values[k - 1])) return;
        int64_t at = count < k ? count : k - 1;
        while (at > 0 && values[at - 1] < value) {  // equals stay ahead: they came first
            values[at] = values[at - 1];
            ids[at] = ids[at - 1];
            --at;
        }
        values[at] = value;
        ids[at] = id;
        if (count < k) ++count;
    }
};

#ifdef WORKBENCH_AVX512
// Scores x[0 … n) (ids first …): the largest, Σ e^(x − largest), whether all are usable (no NaN,
// no +inf; a score of −inf is a token that can't come), and the k largest into most.
inline void chunk_totals(const float* x, int64_t n, int64_t first, Largest& most, float& top, float& sum,
                         bool& finite) {
    const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 best = lowest, bar = _mm512_set1_ps(most.bar());
    __mmask16 odd = 0;  // lanes that met a NaN or +inf
    // one vector: nearly every one holds no score above the bar of the k largest (a compare)
    auto look = [&](__m512 v, __mmask16 lanes, int64_t t) {
        best = _mm512_max_ps(best, v);
        odd |= _mm512_mask_fpclass_ps_mask(lanes, v, 0x89);  // QNaN, +inf, SNaN (−inf adds nothing)
        __mmask16 above = most.full() ? _mm512_mask_cmp_ps_mask(lanes, v, bar, _CMP_GT_OQ) : lanes;
        while (above) {
            const int lane = __builtin_ctz(above);
            above &= above - 1;
            most.offer(x[t + lane], first + t + lane);
            if (most.full()) {
                bar = _mm512_set1_ps(most.bar());
                above = _mm512_mask_cmp_ps_mask(above, v, bar, _CMP_GT_OQ);
            }
        }
    };
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) look(_mm512_loadu_ps(x + t), 0xFFFF, t);
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - t)) - 1);
    if (tail) look(_mm512_mask_loadu_ps(lowest, tail, x + t), tail, t);
    top = _mm512_reduce_max_ps(best);
    finite = odd == 0;
    const __m512 shift = _mm512_set1_ps(top);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (t = 0; t + 32 <= n; t += 32) {
        acc0 = _mm512_add_ps(acc0, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(x + t), shift)));
        acc1 = _mm512_add_ps(acc1, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(x + t + 16), shift)));
    }
    for (; t < n; t += 16) {
        const __mmask16 lanes = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
        acc0 = _mm512_mask_add_ps(acc0, lanes, acc0,
                                  exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, x + t), shift)));
    }
    sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#else
inline void chunk_totals(const float* x, int64_t n, int64_t first, Largest& most, float& top, float& sum,
                         bool& finite) {
    top = -std::numeric_limits<float>::infinity();
    finite = true;
    for (int64_t t = 0; t < n; ++t) {
        top = std::max(top, x[t]);
        finite = finite && !(x[t] > std::numeric_limits<float>::max()) && x[t] == x[t];  // false for NaN, +inf
        if (!most.full() || x[t] > most.bar()) most.offer(x[t], first + t);
    }
    sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) sum += exp_nonpositive(x[t] - top);
}
#endif

// Scores [R, V] float32, contiguous, and k (1 … V) → (totals float32 [R], values float32 [R, k],
// ids int64 [R, k]): each row's log Σ exp and k largest scores, best first.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> row_totals(const torch::Tensor& scores, int64_t k) {
    TORCH_CHECK(scores.dim() == 2 && scores.is_contiguous() && scores.scalar_type() == at::kFloat &&
                    scores.size(1) > 0, "row_totals: contiguous float32 scores [rows, vocabulary]");
    const int64_t R = scores.size(0), V = scores.size(1), chunks = (V + CHUNK - 1) / CHUNK;
    TORCH_CHECK(k >= 1 && k <= V, "row_totals: k between 1 and the vocabulary's size");
    const float* sp = scores.data_ptr<float>();
    std::vector<float> tops(R * chunks), sums(R * chunks), values(R * chunks * k);
    std::vector<int64_t> ids(R * chunks * k), counts(R * chunks);
    at::parallel_for(0, R * chunks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t r = task / chunks, c = task % chunks;
            Largest most{values.data() + task * k, ids.data() + task * k, k};
            float top, sum;
            bool finite;
            chunk_totals(sp + r * V + c * CHUNK, std::min(CHUNK, V - c * CHUNK), c * CHUNK, most, top, sum, finite);
            tops[task] = top;
            sums[task] = finite ? sum : std::numeric_limits<float>::quiet_NaN();
            counts[task] = most.count;
        }
    });
    auto totals = torch::empty({R}, scores.options());
    auto top_values = torch::empty({R, k}, scores.options());
    auto top_ids = torch::empty({R, k}, scores.options().dtype(at::kLong));
    float* tp = totals.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) {
        const float* top = tops.data() + r * chunks;
        const float* sum = sums.data() + r * chunks;
        float highest = top[0];
        for (int64_t c = 1; c < chunks; ++c) highest = std::max(highest, top[c]);
        float total = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) total += sum[c] * exp_nonpositive(top[c] - highest);
        tp[r] = std::log(total) + highest;
        Largest most{top_values.data_ptr<float>() + r * k, top_ids.data_ptr<int64_t>() + r * k, k};
        for (int64_t task = r * chunks; task < (r + 1) * chunks; ++task)  // in chunk order: lower ids first
            for (int64_t i = 0; i < counts[task]; ++i) most.offer(values[task * k + i], ids[task * k + i]);
        for (int64_t i = most.count; i < k; ++i) {  // NaN everywhere in the row: a total that says so
            most.values[i] = std::numeric_limits<float>::quiet_NaN();
            most.ids[i] = 0;
        }
    }
    return {totals, top_values, top_ids};
}

}  // namespace
