// One decode step's attention for a batch of rows, each over its own cache up to its own
// position (torch.ops.workbench.attend_rows), in plain C++ the compiler vectorizes for the
// build's instruction set. What it replaces in a batched step: per row, two small matrix
// products over the whole cache with the unwritten slots masked out, where MKL spent as long
// packing each row's keys as multiplying them (20% of a 16-row int8-fast step), and every row
// read the longest row's span. Here each (row, KV head) reads its keys and values once, up to its
// position, for the query heads that share them (GQA), and computes in fp32 (keys and values in
// fp32 or bf16). A row's result depends on that row alone, whatever else is in the batch.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

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

template <typename T>
void attend_rows_impl(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                      const int64_t* positions, double scale, torch::Tensor& out) {
    const int64_t batch = keys.size(0), kv_heads = keys.size(1), dim = keys.size(3);
    const int64_t group = q.size(1) / kv_heads;
    const T* qp = q.data_ptr<T>();
    const T* kp = keys.data_ptr<T>();
    const T* vp = values.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
    const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);
    const float s = static_cast<float>(scale);
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> query(group * dim), acc(group * dim), key(dim), total(group), scores;
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = task / kv_heads, h = task % kv_heads, n = positions[b] + 1;
            const T* qrow = qp + (b * q.size(1) + h * group) * dim;  // q is [B, H, 1, D], contiguous
            for (int64_t i = 0; i < group * dim; ++i) query[i] = static_cast<float>(qrow[i]) * s;
            scores.resize(group * n);
            const T* kbase = kp + b * ks0 + h * ks1;
            for (int64_t t = 0; t < n; ++t) {
                const T* krow = kbase + t * ks2;
                for (int64_t d = 0; d < dim; ++d) key[d] = static_cast<float>(krow[d]);
                for (int64_t g = 0; g < group; ++g) {
                    const float* qg = query.data() + g * dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < dim; ++d) dot += qg[d] * key[d];
                    scores[g * n + t] = dot;
                }
            }
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int64_t g = 0; g < group; ++g) {
                float* sg = scores.data() + g * n;
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
            const T* vbase = vp + b * vs0 + h * vs1;
            for (int64_t t = 0; t < n; ++t) {
                const T* vrow = vbase + t * vs2;
                for (int64_t d = 0; d < dim; ++d) key[d] = static_cast<float>(vrow[d]);
                for (int64_t g = 0; g < group; ++g) {
                    const float p = scores[g * n + t];
                    float* a = acc.data() + g * dim;
#pragma omp simd
                    for (int64_t d = 0; d < dim; ++d) a[d] += p * key[d];
                }
            }
            T* orow = op + (b * q.size(1) + h * group) * dim;
            for (int64_t g = 0; g < group; ++g) {
                const float inv = 1.0f / total[g];
                for (int64_t d = 0; d < dim; ++d) orow[g * dim + d] = static_cast<T>(acc[g * dim + d] * inv);
            }
        }
    });
}

// q [B, H, 1, D]; keys and values [B, KV heads, capacity, D] (the last dimension contiguous);
// positions [B] int64: row b attends to its slots 0…positions[b]. Returns [B, H, 1, D].
torch::Tensor attend_rows(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                          const torch::Tensor& positions, double scale) {
    TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && keys.dim() == 4 && values.sizes() == keys.sizes(),
                "attend_rows: q [B, H, 1, D], keys and values [B, KV heads, capacity, D]");
    TORCH_CHECK(q.size(0) == keys.size(0) && q.size(3) == keys.size(3) && q.size(1) % keys.size(1) == 0,
                "attend_rows: q's rows, head size and heads must match the cache's");
    TORCH_CHECK(q.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type() &&
                    (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
                "attend_rows: q, keys and values all float32 or all bfloat16");
    TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "attend_rows: the cache's last dimension contiguous");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == q.size(0),
                "attend_rows: positions, int64 [B]");
    auto qc = q.contiguous();
    auto pc = positions.contiguous();
    const int64_t* pp = pc.data_ptr<int64_t>();
    for (int64_t b = 0; b < pc.size(0); ++b)
        TORCH_CHECK(pp[b] >= 0 && pp[b] < keys.size(2), "attend_rows: a position outside the cache");
    auto out = torch::empty({q.size(0), q.size(1), 1, q.size(3)}, q.options());
    if (q.scalar_type() == at::kFloat) attend_rows_impl<float>(qc, keys, values, pp, scale, out);
    else attend_rows_impl<at::BFloat16>(qc, keys, values, pp, scale, out);
    return out;
}

}  // namespace
