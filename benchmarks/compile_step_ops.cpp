// The C product and attention kernels (minillm/kernels/int4_matmul.c, paged_decode.c) as PyTorch operators in
// C++, for benchmarks/compile_step.py: called from a compiled graph without a trip through Python. The kernels'
// addresses come from the libraries minillm builds (set_kernels), so this file holds no kernel of its own.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

namespace {

using Product = void (*)(int64_t, const void *, const void *, const void *, int64_t, int64_t, int64_t, const float *,
                         const float *, float *, int64_t);
using Attention = void (*)(const float *, const float *, const float *, const int32_t *, const int32_t *, float *,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t);
Product product_fn = nullptr;
Attention attention_fn = nullptr;

void set_kernels(int64_t product, int64_t attention) {
    product_fn = reinterpret_cast<Product>(product);
    attention_fn = reinterpret_cast<Attention>(attention);
}

// x W^T (+ residual), W int4 (with zero points) or int8 in the C kernel's layout.
at::Tensor product(const at::Tensor &x, const at::Tensor &q, const at::Tensor &scale,
                   const std::optional<at::Tensor> &zero, int64_t group, int64_t n,
                   const std::optional<at::Tensor> &residual) {
    const at::Tensor xc = x.contiguous();
    at::Tensor out = at::empty({xc.size(0), n}, xc.options());
    product_fn(zero ? 4 : 8, q.data_ptr(), scale.data_ptr(), zero ? zero->data_ptr() : nullptr, n, xc.size(1), group,
               xc.data_ptr<float>(), residual ? residual->contiguous().data_ptr<float>() : nullptr,
               out.data_ptr<float>(), xc.size(0));
    return out;
}

// The new tokens' keys and values into their slots of the paged caches [blocks, block_size, kv_heads, dim].
void store(const at::Tensor &k, const at::Tensor &v, at::Tensor &k_cache, at::Tensor &v_cache,
           const at::Tensor &slots) {
    k_cache.view({-1, k.size(1), k.size(2)}).index_copy_(0, slots, k);
    v_cache.view({-1, v.size(1), v.size(2)}).index_copy_(0, slots, v);
}

// One query token per sequence, q [seqs, heads, dim], over the paged caches.
at::Tensor attention(const at::Tensor &q, const at::Tensor &k_cache, const at::Tensor &v_cache,
                     const at::Tensor &tables, const at::Tensor &lens, double scale) {
    const at::Tensor qc = q.contiguous();
    at::Tensor out = at::empty_like(qc);
    attention_fn(qc.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                 tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<float>(), qc.size(0), qc.size(1),
                 k_cache.size(2), qc.size(2), k_cache.size(1), tables.size(1), static_cast<float>(scale),
                 qc.stride(0));
    return out;
}

}  // namespace

TORCH_LIBRARY(minillm_cpp, m) {
    m.def("set_kernels(int product, int attention) -> ()", &set_kernels);
    m.def("product(Tensor x, Tensor q, Tensor scale, Tensor? zero, int group, int n, Tensor? residual) -> Tensor");
    m.def("store(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
    m.def("attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(minillm_cpp, CPU, m) {
    m.impl("product", &product);
    m.impl("store", &store);
    m.impl("attention", &attention);
}
