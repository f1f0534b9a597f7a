// The backward of the exact softmax attention in cpu_attention.cpp (whose forward, band of keys and
// shared arithmetic it uses), in the same blocks of query rows and chunks of keys, over the same
// band: with the forward's log-sum-exp it recomputes the weights (the FlashAttention recipe,
// arXiv:2205.14135 section 3.1) with five products per block and chunk:
//   S = scale Q K^T, P = exp(S - lse), dV += P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)),
//   dQ = scale dS K, dK += scale dS^T Q;
// with the forward's kept weights it reads P back: four products and no exp per block. Parallel over
// (batch, head); inside a task the blocks run in order, so dK and dV accumulate without races.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace polyformer_cpu {

// defined in cpu_module.cpp
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
int64_t leading(const at::Tensor& t);

// defined in cpu_attention.cpp
extern const int64_t BLOCK;
extern int64_t CHUNK;
extern std::atomic<int64_t> scored;
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
int64_t first_key(int64_t row, bool causal, int64_t window);
int64_t visible(int64_t row, int64_t keys, bool causal, int64_t window);
int64_t band(int64_t window, int64_t I, int64_t J, bool causal);
int64_t kept_per_task(int64_t I, int64_t J, bool causal, int64_t window);
struct Matrix {           // the same definition as in cpu_attention.cpp
  const float* data;
  int64_t ld;
};
Matrix slice(const at::Tensor& t, int64_t b, int64_t h);
float* slice_mut(at::Tensor& t, int64_t b, int64_t h);
void weights_from_lse(float* P, int64_t cols, int64_t rows, int64_t j0, int64_t i0, const float* L,
                      bool causal, int64_t window);

// dq (b, h, i, d), and dk, dv per query head (b, h, j, d*), zeroed, for grad_out (b, h, i, dv) given the
// forward's out, lse and weights (kept, or empty: recomputed); any layout with unit stride in d.
void backward_into(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                   const at::Tensor& weights, double scale, bool causal, int64_t window, at::Tensor& dq,
                   at::Tensor& dk, at::Tensor& dv) {
  check_inputs(q, k, v);
  TORCH_CHECK(grad_out.stride(3) == 1 && leading(grad_out) >= grad_out.size(3) && out.stride(3) == 1 &&
                  lse.is_contiguous(),
              "cpu attention backward: unexpected layout of grad_out, out or lse");
  const int64_t B = q.size(0), H = q.size(1), I = q.size(2), J = k.size(2), D = q.size(3),
                DV = v.size(3);
  window = band(window, I, J, causal);
  const bool kept = weights.numel() > 0;
  const int64_t per_task = kept_per_task(I, J, causal, window);
  TORCH_CHECK(!kept || (weights.is_contiguous() && weights.dim() == 3 && weights.size(0) == B &&
                        weights.size(1) == H && weights.size(2) == per_task),
              "cpu attention backward: the kept weights do not match q and k");
  const int64_t group = H / k.size(1);
  const float alpha = static_cast<float>(scale);

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    const int64_t chunk_max = std::min(CHUNK, J);
    std::vector<float> p_buf(kept ? 0 : BLOCK * chunk_max), dp_buf(BLOCK * (kept ? J : chunk_max)),
        delta(BLOCK);
    int64_t work = 0;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H;
      const Matrix Q = slice(q, b, h), K = slice(k, b, h / group), V = slice(v, b, h / group);
      const Matrix dO = slice(grad_out, b, h), O = slice(out, b, h);
      const float* L = lse.data_ptr<float>() + (b * H + h) * I;
      float* dQ = slice_mut(dq, b, h);
      float* dK = slice_mut(dk, b, h);
      float* dV = slice_mut(dv, b, h);
      const int64_t ldq = dq.stride(2), ldk = dk.stride(2), ldv = dv.stride(2);
      const float* W = kept ? weights.data_ptr<float>() + task * per_task : nullptr;
      for (int64_t i0 = 0; i0 < I; i0 += BLOCK) {
        const int64_t rows = std::min(BLOCK, I - i0);
        const int64_t lo = first_key(i0, causal, window), keys = visible(i0 + rows - 1, J, causal, window);
        float* P = p_buf.data();
        float* dP = dp_buf.data();
        for (int64_t r = 0; r < rows; ++r) {
          const float* o = O.data + (i0 + r) * O.ld;
          const float* g = dO.data + (i0 + r) * dO.ld;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t c = 0; c < DV; ++c) acc += o[c] * g[c];
          delta[r] = acc;
        }
        const float* Qb = Q.data + i0 * Q.ld;
        const float* dOb = dO.data + i0 * dO.ld;
        if (kept) {               // the forward's weights, row-major over the block's band of keys
          const int64_t width = keys - lo;
          const float* Pk = W;
          W += rows * width;
          gemm(true, false, width, DV, rows, 1.f, Pk, width, dOb, dO.ld, 1.f, dV + lo * ldv, ldv);
          gemm(false, true, rows, width, DV, 1.f, dOb, dO.ld, V.data + lo * V.ld, V.ld, 0.f, dP, width);
          work += rows * width;
          for (int64_t r = 0; r < rows; ++r) {
            const float* p = Pk + r * width;
            float* ds = dP + r * width;
            const float dr = delta[r];
#pragma omp simd
            for (int64_t c = 0; c < width; ++c) ds[c] = p[c] * (ds[c] - dr);
          }
          gemm(false, false, rows, D, width, alpha, dP, width, K.data + lo * K.ld, K.ld, 0.f, dQ + i0 * ldq,
               ldq);
          gemm(true, false, width, D, rows, alpha, dP, width, Qb, Q.ld, 1.f, dK + lo * ldk, ldk);
          continue;
        }
        // key chunks of the band; transposed blocks (cols x rows): the two products that accumulate
        // into dK and dV then read their left operand in order, which the BLAS runs about a quarter
        // faster
        for (int64_t j0 = lo; j0 < keys; j0 += CHUNK) {
          const int64_t cols = std::min(CHUNK, keys - j0);
          const float* Kc = K.data + j0 * K.ld;
          gemm(false, true, cols, rows, D, alpha, Kc, K.ld, Qb, Q.ld, 0.f, P, rows);
          work += rows * cols;
          weights_from_lse(P, cols, rows, j0, i0, L + i0, causal, window);
          gemm(false, false, cols, DV, rows, 1.f, P, rows, dOb, dO.ld, 1.f, dV + j0 * ldv, ldv);
          gemm(false, true, cols, rows, DV, 1.f, V.data + j0 * V.ld, V.ld, dOb, dO.ld, 0.f, dP, rows);
          for (int64_t c = 0; c < cols; ++c) {
            const float* p = P + c * rows;
            float* ds = dP + c * rows;
#pragma omp simd
            for (int64_t r = 0; r < rows; ++r) ds[r] = p[r] * (ds[r] - delta[r]);
          }
          gemm(true, false, rows, D, cols, alpha, dP, rows, Kc, K.ld, j0 == lo ? 0.f : 1.f, dQ + i0 * ldq,
               ldq);
          gemm(false, false, cols, D, rows, alpha, dP, rows, Qb, Q.ld, 1.f, dK + j0 * ldk, ldk);
        }
      }
    }
    scored += work;
  });
}

}  // namespace polyformer_cpu
