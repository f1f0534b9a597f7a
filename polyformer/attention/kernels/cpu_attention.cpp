// Exact softmax attention for float32 on the CPU, forward and backward, in blocks of query rows.
//
// For each (batch, head) and each block of BLOCK query rows, the scores of the block against a chunk
// of up to CHUNK keys it may see are one BLAS product held in a per-thread buffer (BLOCK x CHUNK
// floats, which stays in L2), the softmax runs on that buffer in place (with a running maximum and
// sum across chunks), and a second product adds the chunk's share of the block's output. A causal
// block reads only the keys up to its last row, so the products skip the upper triangle.
// The forward keeps the log-sum-exp of each row; the backward recomputes the weights from it (the
// FlashAttention recipe, arXiv:2205.14135 section 3.1) with five products per block:
//   S = scale Q K^T, P = exp(S - lse), dV += P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)),
//   dQ = scale dS K, dK += scale dS^T Q.
// Asked to keep the weights (`keep`), the forward instead writes each block's normalised weights over
// all its keys into a buffer it returns, and the backward reads them back: four products and no exp
// per block, for memory that grows with the square of the length (the caller decides when it pays).
// The buffers come from a pool that hands a buffer out again once nothing else holds it, so that the
// steps of a training loop write into memory the process has already touched (polyformer/buffers.py).
// Parallel over (batch, head); inside a task the blocks run in order, so dK and dV accumulate
// without races. The products go to the BLAS that PyTorch itself links (sgemm_).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c, const int* ldc);

namespace {

constexpr int64_t BLOCK = 64;    // query rows per block
int64_t CHUNK = 1024;             // keys per chunk: a block's scores (BLOCK x CHUNK floats) stay in L2

// exp(x) for x <= 0, written so that the compiler vectorises the loops that call it: x = n ln2 + f
// with n an integer and |f| <= ln2 / 2, 2^n built in the exponent bits, e^f by its Taylor series to
// degree 7 (truncation below 6e-9 relative). Arguments under -87 give about 1.6e-38, not 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 * 2^23
  const float f = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;  // ln2, split for precision
  float p = 1.0f / 5040.0f + f * (1.0f / 40320.0f);
  p = 1.0f / 720.0f + f * p;
  p = 1.0f / 120.0f + f * p;
  p = 1.0f / 24.0f + f * p;
  p = 1.0f / 6.0f + f * p;
  p = 0.5f + f * p;
  p = 1.0f + f * p;
  p = 1.0f + f * p;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The largest of s[0..n), n >= 1: sixteen running maxima side by side, so that the compiler keeps them
// in one vector register (a plain max reduction stays scalar without -ffast-math).
inline float row_max(const float* s, int64_t n) {
  constexpr int64_t W = 16;
  float lanes[W];
  for (int64_t j = 0; j < W; ++j) lanes[j] = s[0];
  int64_t c = 0;
  for (; c + W <= n; c += W) {
    for (int64_t j = 0; j < W; ++j) lanes[j] = s[c + j] > lanes[j] ? s[c + j] : lanes[j];
  }
  float m = lanes[0];
  for (int64_t j = 1; j < W; ++j) m = lanes[j] > m ? lanes[j] : m;
  for (; c < n; ++c) m = s[c] > m ? s[c] : m;
  return m;
}

// s[c] = exp(s[c] - m) for c < n, m at least each of them; returns their sum
inline float exp_shifted(float* s, int64_t n, float m) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < n; ++c) {
    const float e = exp_nonpositive(s[c] - m);
    s[c] = e;
    sum += e;
  }
  return sum;
}

// Row-major C (m x n) = alpha op(A) op(B) + beta C, through the column-major BLAS: C^T = op(B)^T op(A)^T.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  const int M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  const int LDA = static_cast<int>(lda), LDB = static_cast<int>(ldb), LDC = static_cast<int>(ldc);
  sgemm_(&tb, &ta, &N, &M, &K, &alpha, b, &LDB, a, &LDA, &beta, c, &LDC);
}

// Keys row `row` may see: all of them, or (causal, top-left aligned) those up to its own position.
inline int64_t visible(int64_t row, int64_t keys, bool causal) {
  return causal ? std::min(row + 1, keys) : keys;
}

struct Matrix {           // one (batch, head) slice of a (b, h, t, d) tensor with unit stride in d
  const float* data;
  int64_t ld;
};

// The BLAS wants a leading dimension of at least the row length; a length-1 sequence dimension may
// carry any stride (torch ignores it), so its rows are given the row length.
inline int64_t leading(const at::Tensor& t) {
  return t.size(2) <= 1 ? std::max<int64_t>(t.size(3), 1) : t.stride(2);
}

inline Matrix slice(const at::Tensor& t, int64_t b, int64_t h) {
  return {t.data_ptr<float>() + b * t.stride(0) + h * t.stride(1), leading(t)};
}

inline float* slice_mut(at::Tensor& t, int64_t b, int64_t h) {
  return t.data_ptr<float>() + b * t.stride(0) + h * t.stride(1);
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4,
                "cpu attention takes float32 CPU tensors of shape (batch, heads, seq, dim)");
    TORCH_CHECK(t->stride(3) == 1 && leading(*t) >= t->size(3),
                "cpu attention needs unit stride in the last dimension and rows that do not overlap");
  }
  TORCH_CHECK(q.size(0) == k.size(0) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
              k.size(0) == v.size(0) && k.size(1) == v.size(1) && k.size(2) == v.size(2) &&
              q.size(3) == k.size(3),
              "cpu attention: q, k, v disagree in batch, heads (a multiple of the kv heads), key length "
              "or head dim");
  TORCH_CHECK(k.size(2) > 0, "cpu attention needs at least one key");
}

// Floats of kept weights per (batch, head): each block of rows times the keys its last row sees.
int64_t kept_per_task(int64_t I, int64_t J, bool causal) {
  int64_t n = 0;
  for (int64_t i0 = 0; i0 < I; i0 += BLOCK) {
    const int64_t rows = std::min(BLOCK, I - i0);
    n += rows * visible(i0 + rows - 1, J, causal);
  }
  return n;
}

// Byte buffers for large training tensors (the kept weights and the large outputs and gradients here;
// polyformer/buffers.py hands them to Python). A buffer is free when the pool holds its storage alone
// (the tensor handed out, and whatever saved it for the backward, are gone). A request takes the
// smallest free buffer of at least its size and at most twice it, or a new one. Free buffers are
// dropped, least recently used first, only while they add up to more than the most the pool has had
// handed out at once: a training loop's steps keep every buffer they use (the sizes of one step
// differ, and dropping one kind to make room for another would fault fresh pages in every step),
// while requests of ever new sizes cannot make it grow past twice what a step holds.
struct Buffer {
  at::Tensor bytes;
  int64_t last_use;
};
std::mutex pool_lock;
std::vector<Buffer> pool;
int64_t pool_clock = 0, held_peak = 0;

inline bool unheld(const Buffer& b) { return b.bytes.storage().use_count() == 1; }

// (held, free) bytes of the pool (pool_lock held)
std::pair<int64_t, int64_t> pool_bytes() {
  int64_t held = 0, free = 0;
  for (const Buffer& b : pool) (unheld(b) ? free : held) += b.bytes.numel();
  return {held, free};
}

// drop least recently used free buffers while the free bytes exceed `limit` (pool_lock held)
void evict(int64_t limit) {
  int64_t free = pool_bytes().second;
  while (free > limit) {
    auto oldest = pool.end();
    for (auto it = pool.begin(); it != pool.end(); ++it) {
      if (unheld(*it) && (oldest == pool.end() || it->last_use < oldest->last_use)) oldest = it;
    }
    free -= oldest->bytes.numel();
    pool.erase(oldest);
  }
}

at::Tensor pooled_bytes(int64_t n) {
  std::lock_guard<std::mutex> guard(pool_lock);
  Buffer* best = nullptr;
  for (Buffer& b : pool) {
    const int64_t size = b.bytes.numel();
    if (unheld(b) && size >= n && size <= 2 * n && (!best || size < best->bytes.numel())) best = &b;
  }
  if (!best) {
    pool.push_back({at::empty({n}, at::TensorOptions().dtype(at::kByte)), 0});
    best = &pool.back();
  }
  best->last_use = ++pool_clock;
  at::Tensor handed = best->bytes.narrow(0, 0, n);
  held_peak = std::max(held_peak, pool_bytes().first);
  evict(held_peak);
  return handed;
}

// A contiguous tensor of these sizes and dtype on a pooled buffer's storage: not a view of the pool's
// byte tensor, so autograd takes it as a fresh tensor and views of it have it as their base.
at::Tensor pooled_tensor(std::vector<int64_t> sizes, at::ScalarType dtype) {
  const int64_t n = c10::multiply_integers(sizes);
  const at::Tensor raw = pooled_bytes(std::max<int64_t>(n, 1) * c10::elementSize(dtype));
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(raw.storage(), 0, sizes);
}

// A float32 tensor of these sizes, contiguous: from the pool from 1 MiB up (outputs and gradients of a
// training step, which would otherwise fault in fresh pages every step), else a plain allocation.
at::Tensor empty_floats(std::vector<int64_t> sizes) {
  if (c10::multiply_integers(sizes) * 4 < (int64_t{1} << 20)) {
    return at::empty(sizes, at::TensorOptions().dtype(at::kFloat));
  }
  return pooled_tensor(std::move(sizes), at::kFloat);
}

// Row-major P (rows x cols) = softmax(S) in place for a block whose rows start at query i0, each row's
// log-sum-exp into L. Every row sees key 0, so no row is empty.
void softmax_rows(float* P, int64_t rows, int64_t cols, int64_t i0, bool causal, float* L) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = P + r * cols;
    const int64_t n = std::min(visible(i0 + r, cols, causal), cols);
    const float m = row_max(s, n);
    const float sum = exp_shifted(s, n, m);
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) s[c] *= inv;
    std::fill(s + n, s + cols, 0.f);
    L[r] = m + std::log(sum);
  }
}

}  // namespace

// (buffers, free buffers, bytes held) of the pool; with release, the free ones are dropped first (and
// the most handed out at once starts again from what is held now)
std::vector<int64_t> pool_state(bool release) {
  std::lock_guard<std::mutex> guard(pool_lock);
  if (release) {
    evict(0);
    held_peak = pool_bytes().first;
  }
  int64_t free = 0;
  for (const Buffer& b : pool) free += unheld(b);
  const auto [held, free_bytes] = pool_bytes();
  return {static_cast<int64_t>(pool.size()), free, held + free_bytes};
}

// Returns (out (b, h, i, dv) laid out as (b, i, h, dv), lse (b, h, i), weights): with keep, weights
// (b, h, kept_per_task) holds each block's softmax weights row-major (rows x keys its last row sees),
// block after block; without it, an empty tensor.
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                double scale, bool causal, bool keep) {
  check_inputs(q, k, v);
  const int64_t B = q.size(0), H = q.size(1), I = q.size(2), J = k.size(2), D = q.size(3),
                DV = v.size(3);
  const int64_t group = H / k.size(1);      // query heads per kv head (grouped-query attention)
  at::Tensor out = empty_floats({B, I, H, DV}).transpose(1, 2);
  at::Tensor lse = at::empty({B, H, I}, q.options());
  const int64_t per_task = keep ? kept_per_task(I, J, causal) : 0;
  at::Tensor weights = keep ? pooled_tensor({B, H, per_task}, at::kFloat) : at::empty({0}, q.options());
  const float alpha = static_cast<float>(scale);

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    const int64_t chunk_max = keep ? 0 : std::min(CHUNK, J);
    std::vector<float> scores(BLOCK * chunk_max), row_m(BLOCK), row_l(BLOCK), rescale(BLOCK);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H;
      const Matrix Q = slice(q, b, h), K = slice(k, b, h / group), V = slice(v, b, h / group);
      const int64_t ldo = out.stride(2);
      float* L = slice_mut(lse, b, h);
      float* W = keep ? weights.data_ptr<float>() + task * per_task : nullptr;
      for (int64_t i0 = 0; i0 < I; i0 += BLOCK) {
        const int64_t rows = std::min(BLOCK, I - i0);
        const int64_t keys = visible(i0 + rows - 1, J, causal);
        const float* Qb = Q.data + i0 * Q.ld;
        float* Ob = slice_mut(out, b, h) + i0 * ldo;
        if (keep) {               // all the block's keys at once, its weights kept
          gemm(false, true, rows, keys, D, alpha, Qb, Q.ld, K.data, K.ld, 0.f, W, keys);
          softmax_rows(W, rows, keys, i0, causal, L + i0);
          gemm(false, false, rows, DV, keys, 1.f, W, keys, V.data, V.ld, 0.f, Ob, ldo);
          W += rows * keys;
          continue;
        }
        float* S = scores.data();
        // key chunks with a running maximum and sum per row (online softmax): every row sees key 0,
        // so after the first chunk each row's maximum is finite
        for (int64_t j0 = 0; j0 < keys; j0 += CHUNK) {
          const int64_t cols = std::min(CHUNK, keys - j0);
          gemm(false, true, rows, cols, D, alpha, Qb, Q.ld, K.data + j0 * K.ld, K.ld, 0.f, S, cols);
          for (int64_t r = 0; r < rows; ++r) {
            float* s = S + r * cols;
            const int64_t n = std::min(visible(i0 + r, keys, causal) - j0, cols);  // visible here
            if (n <= 0) {
              std::fill_n(s, cols, 0.f);
              rescale[r] = 1.f;
              continue;
            }
            const float m = j0 == 0 ? row_max(s, n) : std::max(row_m[r], row_max(s, n));
            const float sum = exp_shifted(s, n, m);
            for (int64_t c = n; c < cols; ++c) s[c] = 0.f;
            rescale[r] = j0 == 0 ? 1.f : std::exp(row_m[r] - m);
            row_l[r] = j0 == 0 ? sum : row_l[r] * rescale[r] + sum;
            row_m[r] = m;
          }
          if (j0 > 0) {
            for (int64_t r = 0; r < rows; ++r) {
              float* o = Ob + r * ldo;
              const float c = rescale[r];
#pragma omp simd
              for (int64_t d = 0; d < DV; ++d) o[d] *= c;
            }
          }
          // unnormalised weights times values; each output row is divided by its sum at the end
          // (rows x dv multiplications instead of rows x keys)
          gemm(false, false, rows, DV, cols, 1.f, S, cols, V.data + j0 * V.ld, V.ld, j0 == 0 ? 0.f : 1.f,
               Ob, ldo);
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* o = Ob + r * ldo;
          const float inv = 1.f / row_l[r];
#pragma omp simd
          for (int64_t d = 0; d < DV; ++d) o[d] *= inv;
          L[i0 + r] = row_m[r] + std::log(row_l[r]);
        }
      }
    }
  });
  return {out, lse, weights};
}

namespace {

// dq (b, h, i, d), and dk, dv per query head (b, h, j, d*), zeroed, for grad_out (b, h, i, dv) given the
// forward's out, lse and weights (kept, or empty: recomputed); any layout with unit stride in d.
void backward_into(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                   const at::Tensor& weights, double scale, bool causal, at::Tensor& dq, at::Tensor& dk,
                   at::Tensor& dv) {
  check_inputs(q, k, v);
  TORCH_CHECK(grad_out.stride(3) == 1 && leading(grad_out) >= grad_out.size(3) && out.stride(3) == 1 &&
                  lse.is_contiguous(),
              "cpu attention backward: unexpected layout of grad_out, out or lse");
  const int64_t B = q.size(0), H = q.size(1), I = q.size(2), J = k.size(2), D = q.size(3),
                DV = v.size(3);
  const bool kept = weights.numel() > 0;
  const int64_t per_task = kept_per_task(I, J, causal);
  TORCH_CHECK(!kept || (weights.is_contiguous() && weights.dim() == 3 && weights.size(0) == B &&
                        weights.size(1) == H && weights.size(2) == per_task),
              "cpu attention backward: the kept weights do not match q and k");
  const int64_t group = H / k.size(1);
  const float alpha = static_cast<float>(scale);

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    const int64_t chunk_max = std::min(CHUNK, J);
    std::vector<float> p_buf(kept ? 0 : BLOCK * chunk_max), dp_buf(BLOCK * (kept ? J : chunk_max)),
        delta(BLOCK);
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
        const int64_t keys = visible(i0 + rows - 1, J, causal);
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
        if (kept) {               // the forward's weights, row-major over all the block's keys
          const float* Pk = W;
          W += rows * keys;
          gemm(true, false, keys, DV, rows, 1.f, Pk, keys, dOb, dO.ld, 1.f, dV, ldv);
          gemm(false, true, rows, keys, DV, 1.f, dOb, dO.ld, V.data, V.ld, 0.f, dP, keys);
          for (int64_t r = 0; r < rows; ++r) {
            const float* p = Pk + r * keys;
            float* ds = dP + r * keys;
            const float dr = delta[r];
#pragma omp simd
            for (int64_t c = 0; c < keys; ++c) ds[c] = p[c] * (ds[c] - dr);
          }
          gemm(false, false, rows, D, keys, alpha, dP, keys, K.data, K.ld, 0.f, dQ + i0 * ldq, ldq);
          gemm(true, false, keys, D, rows, alpha, dP, keys, Qb, Q.ld, 1.f, dK, ldk);
          continue;
        }
        // key chunks; transposed blocks (cols x rows): the two products that accumulate into dK and dV
        // then read their left operand in order, which the BLAS runs about a quarter faster
        for (int64_t j0 = 0; j0 < keys; j0 += CHUNK) {
          const int64_t cols = std::min(CHUNK, keys - j0);
          const float* Kc = K.data + j0 * K.ld;
          gemm(false, true, cols, rows, D, alpha, Kc, K.ld, Qb, Q.ld, 0.f, P, rows);
          for (int64_t c = 0; c < cols; ++c) {
            float* p = P + c * rows;
            // first row that sees key j0 + c
            const int64_t first = causal ? std::min(std::max<int64_t>(j0 + c - i0, 0), rows) : 0;
            for (int64_t r = 0; r < first; ++r) p[r] = 0.f;
#pragma omp simd
            for (int64_t r = first; r < rows; ++r) p[r] = exp_nonpositive(p[r] - L[i0 + r]);
          }
          gemm(false, false, cols, DV, rows, 1.f, P, rows, dOb, dO.ld, 1.f, dV + j0 * ldv, ldv);
          gemm(false, true, cols, rows, DV, 1.f, V.data + j0 * V.ld, V.ld, dOb, dO.ld, 0.f, dP, rows);
          for (int64_t c = 0; c < cols; ++c) {
            const float* p = P + c * rows;
            float* ds = dP + c * rows;
#pragma omp simd
            for (int64_t r = 0; r < rows; ++r) ds[r] = p[r] * (ds[r] - delta[r]);
          }
          gemm(true, false, rows, D, cols, alpha, dP, rows, Kc, K.ld, j0 == 0 ? 0.f : 1.f, dQ + i0 * ldq, ldq);
          gemm(false, false, cols, D, rows, alpha, dP, rows, Qb, Q.ld, 1.f, dK + j0 * ldk, ldk);
        }
      }
    }
  });
}

// dK and dV of each query head, zeroed (tasks of one kv head's group run on different threads)
at::Tensor per_query_head(int64_t B, int64_t H, int64_t J, int64_t D) {
  return empty_floats({B, J, H, D}).zero_().transpose(1, 2);
}

// dK or dV per query head (b, h, j, d) summed over each kv head's group of `group` heads
at::Tensor grouped(const at::Tensor& t, int64_t group) {
  return t.reshape({t.size(0), t.size(1) / group, group, t.size(2), t.size(3)}).sum(2);
}

}  // namespace

// Returns (dq, dk, dv) for grad_out (b, h, i, dv) given the forward's out, lse and weights (kept, or
// empty: recomputed).
std::vector<at::Tensor> backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                 const at::Tensor& weights, double scale, bool causal) {
  check_inputs(q, k, v);
  const int64_t B = q.size(0), H = q.size(1), I = q.size(2), J = k.size(2), group = H / k.size(1);
  at::Tensor dq = empty_floats({B, I, H, q.size(3)}).transpose(1, 2);
  at::Tensor dk = per_query_head(B, H, J, k.size(3)), dv = per_query_head(B, H, J, v.size(3));
  backward_into(grad_out, q, k, v, out, lse, weights, scale, causal, dq, dk, dv);
  if (group > 1) return {dq, grouped(dk, group), grouped(dv, group)};
  return {dq, dk, dv};
}

// The same gradients for q, k and v that are one projection's columns, side by side: heads of q, then
// of k, then of v, in each row of a (b, t, C) tensor. Returns that tensor's gradient, written in
// place of the three (no concatenation afterwards).
at::Tensor backward_packed(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                           const at::Tensor& weights, double scale, bool causal) {
  check_inputs(q, k, v);
  const int64_t B = q.size(0), H = q.size(1), I = q.size(2), HK = k.size(1), group = H / HK;
  const int64_t D = q.size(3), DV = v.size(3);
  TORCH_CHECK(k.size(2) == I, "cpu attention backward_packed: keys and queries must be the same rows");
  const int64_t C = H * D + HK * D + HK * DV;
  at::Tensor dqkv = empty_floats({B, I, C});
  auto columns = [&](int64_t start, int64_t heads, int64_t d) {
    return dqkv.narrow(2, start, heads * d).view({B, I, heads, d}).transpose(1, 2);
  };
  at::Tensor dq = columns(0, H, D), dk = columns(H * D, HK, D), dv = columns(H * D + HK * D, HK, DV);
  if (group == 1) {
    dk.zero_();
    dv.zero_();
    backward_into(grad_out, q, k, v, out, lse, weights, scale, causal, dq, dk, dv);
    return dqkv;
  }
  at::Tensor dk_heads = per_query_head(B, H, I, D), dv_heads = per_query_head(B, H, I, DV);
  backward_into(grad_out, q, k, v, out, lse, weights, scale, causal, dq, dk_heads, dv_heads);
  dk.copy_(grouped(dk_heads, group));
  dv.copy_(grouped(dv_heads, group));
  return dqkv;
}

// Keys per chunk, for tests that span several chunks with small inputs (a global: not to be changed
// while a kernel runs).
void set_chunk(int64_t keys) {
  TORCH_CHECK(keys >= 1, "set_chunk: keys per chunk must be at least 1");
  CHUNK = keys;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_chunk", &set_chunk, "keys per chunk (default 1024)");
  m.def("kept_per_task", &kept_per_task, "floats of kept weights per (batch, head)");
  m.def("pool_state", &pool_state, "(buffers, free buffers, bytes) of the buffer pool; release drops the "
        "free ones first");
  m.def("pooled_bytes", &pooled_bytes, "a uint8 tensor of n bytes from the buffer pool");
  m.def("pooled_tensor", &pooled_tensor, "a contiguous tensor of these sizes and dtype from the buffer pool");
  // the GIL is released: other Python threads run while a kernel does
  m.def("forward", &forward, "exact attention forward (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("backward", &backward, "exact attention backward (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("backward_packed", &backward_packed, "exact attention backward into one (b, t, q|k|v columns) "
        "gradient (float32, CPU)", py::call_guard<py::gil_scoped_release>());
}
