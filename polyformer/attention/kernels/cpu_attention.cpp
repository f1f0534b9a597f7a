// Exact softmax attention for float32 on the CPU, in blocks of query rows: the forward and the
// arithmetic the backward shares with it (the backward is in cpu_backward.cpp, memory and Python
// bindings in cpu_module.cpp).
//
// For each (batch, head) and each block of BLOCK query rows, the scores of the block against a chunk
// of up to CHUNK keys it may see are one BLAS product held in a per-thread buffer (BLOCK x CHUNK
// floats, which stays in L2), the softmax runs on that buffer in place (with a running maximum and
// sum across chunks), and a second product adds the chunk's share of the block's output. A block
// reads only its band of keys, from its first row's first key to its last row's last: causal, up to
// its last row's position (the upper triangle skipped); with a causal sliding window of w keys (row r
// sees r - w < j <= r), also from its first row's first key on; with a bidirectional window (row r
// sees |r - j| <= w // 2, queries and keys one sequence), w // 2 keys either side of the block. The
// work is then O(n w), not O(n^2). Inside a chunk that straddles a row's edges the row is masked.
// The forward keeps the log-sum-exp of each row, from which the backward recomputes the weights (the
// FlashAttention recipe, arXiv:2205.14135 section 3.1). Asked to keep the weights (`keep`), the
// forward instead writes each block's normalised weights over its band into a buffer it returns, for
// the backward to read back: memory that grows with the square of the length, or with length times
// window (the caller decides when it pays). Parallel over (batch, head); inside a task the blocks run
// in order. The products go to the BLAS that PyTorch links (sgemm_).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c, const int* ldc);

namespace polyformer_cpu {

// defined in cpu_module.cpp
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
at::Tensor pooled_tensor(std::vector<int64_t> sizes, at::ScalarType dtype);
at::Tensor empty_floats(std::vector<int64_t> sizes);
int64_t leading(const at::Tensor& t);

// shared with cpu_backward.cpp, which declares them
extern const int64_t BLOCK = 64;  // query rows per block
int64_t CHUNK = 1024;             // keys per chunk: a block's scores (BLOCK x CHUNK floats) stay in L2
std::atomic<int64_t> scored{0};   // query-key entries the score products computed (scored_entries)

}  // namespace polyformer_cpu

namespace {

using namespace polyformer_cpu;

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

}  // namespace

namespace polyformer_cpu {

// Row-major C (m x n) = alpha op(A) op(B) + beta C, through the column-major BLAS: C^T = op(B)^T op(A)^T.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  const int M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  const int LDA = static_cast<int>(lda), LDB = static_cast<int>(ldb), LDC = static_cast<int>(ldc);
  sgemm_(&tb, &ta, &N, &M, &K, &alpha, b, &LDB, a, &LDA, &beta, c, &LDC);
}

// The band: keys row `row` may see are [first_key, visible). All of them; or (causal, top-left
// aligned) those up to its own position, and with a window w > 0 the last w of those; or (not causal,
// window w > 0) those within w // 2 of its position.
int64_t first_key(int64_t row, bool causal, int64_t window) {
  if (window <= 0) return 0;
  return std::max<int64_t>(row - (causal ? window - 1 : window / 2), 0);
}

int64_t visible(int64_t row, int64_t keys, bool causal, int64_t window) {
  if (causal) return std::min(row + 1, keys);
  return window > 0 ? std::min(row + window / 2 + 1, keys) : keys;
}

// The window as the kernels take it, checked: 0 for none, also where it covers every row's keys
// (causal w >= rows: plain causal attention; bidirectional w // 2 >= rows - 1: full attention).
int64_t band(int64_t window, int64_t I, int64_t J, bool causal) {
  TORCH_CHECK(window >= 0, "cpu attention: the window must be >= 0 (0: none)");
  if (window == 0) return 0;
  if (causal) {
    TORCH_CHECK(I - window < J,
                "cpu attention: with a window every query row must see a key (rows - window < keys)");
    return window >= I ? 0 : window;
  }
  TORCH_CHECK(window >= 2, "cpu attention: a bidirectional window must be >= 2 (w // 2 keys each side)");
  TORCH_CHECK(I == J, "cpu attention: a bidirectional window needs as many queries as keys (one sequence)");
  return window / 2 >= I - 1 ? 0 : window;
}

// One (batch, head) slice of a (b, h, t, d) tensor with unit stride in d (Matrix: the same definition
// in cpu_backward.cpp)
struct Matrix {
  const float* data;
  int64_t ld;
};

Matrix slice(const at::Tensor& t, int64_t b, int64_t h) {
  return {t.data_ptr<float>() + b * t.stride(0) + h * t.stride(1), leading(t)};
}

float* slice_mut(at::Tensor& t, int64_t b, int64_t h) {
  return t.data_ptr<float>() + b * t.stride(0) + h * t.stride(1);
}

// The backward's recomputed weights: P (cols x rows, key-major) holds the scaled scores of keys
// j0.. against the rows i0..; each becomes exp(score - lse of its row) where the row sees the key,
// else 0. L: the rows' log-sum-exp from i0 on.
void weights_from_lse(float* P, int64_t cols, int64_t rows, int64_t j0, int64_t i0, const float* L,
                      bool causal, int64_t window) {
  for (int64_t c = 0; c < cols; ++c) {
    float* p = P + c * rows;
    const int64_t key = j0 + c;
    // the rows that see the key: [first, last)
    int64_t first = 0, last = rows;
    if (causal) first = std::min(std::max<int64_t>(key - i0, 0), rows);
    if (window > 0) {
      if (!causal) first = std::min(std::max<int64_t>(key - window / 2 - i0, 0), rows);
      last = std::max(std::min(key + (causal ? window : window / 2 + 1) - i0, rows), first);
    }
    for (int64_t r = 0; r < first; ++r) p[r] = 0.f;
#pragma omp simd
    for (int64_t r = first; r < last; ++r) p[r] = exp_nonpositive(p[r] - L[r]);
    for (int64_t r = last; r < rows; ++r) p[r] = 0.f;
  }
}

}  // namespace polyformer_cpu

namespace {

// Row-major P (rows x cols) = softmax(S) in place for a block whose rows start at query i0 and whose
// columns are the keys from j0 on (the block's band), each row's log-sum-exp into L. Every row sees
// at least one key (`band`), so no row is empty.
void softmax_rows(float* P, int64_t rows, int64_t cols, int64_t i0, int64_t j0, bool causal,
                  int64_t window, float* L) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = P + r * cols;
    const int64_t a = first_key(i0 + r, causal, window) - j0;
    const int64_t n = visible(i0 + r, j0 + cols, causal, window) - j0;
    const float m = row_max(s + a, n - a);
    const float sum = exp_shifted(s + a, n - a, m);
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t c = a; c < n; ++c) s[c] *= inv;
    std::fill(s, s + a, 0.f);
    std::fill(s + n, s + cols, 0.f);
    L[r] = m + std::log(sum);
  }
}

}  // namespace

namespace polyformer_cpu {

// Floats of kept weights per (batch, head): each block of rows times the keys of its band, from its
// first row's first key to its last row's last.
int64_t kept_per_task(int64_t I, int64_t J, bool causal, int64_t window) {
  window = band(window, I, J, causal);
  int64_t n = 0;
  for (int64_t i0 = 0; i0 < I; i0 += BLOCK) {
    const int64_t rows = std::min(BLOCK, I - i0);
    n += rows * (visible(i0 + rows - 1, J, causal, window) - first_key(i0, causal, window));
  }
  return n;
}

// Keys per chunk, for tests that span several chunks with small inputs (a global: not to be changed
// while a kernel runs).
void set_chunk(int64_t keys) {
  TORCH_CHECK(keys >= 1, "set_chunk: keys per chunk must be at least 1");
  CHUNK = keys;
}

int64_t scored_entries(bool reset) {
  return reset ? scored.exchange(0) : scored.load();
}

// Returns (out (b, h, i, dv) laid out as (b, i, h, dv), lse (b, h, i), weights): with keep, weights
// (b, h, kept_per_task) holds each block's softmax weights row-major (rows x keys of its band),
// block after block; without it, an empty tensor.
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                double scale, bool causal, bool keep, int64_t window) {
  check_inputs(q, k, v);
  const int64_t B = q.size(0), H = q.size(1), I = q.size(2), J = k.size(2), D = q.size(3),
                DV = v.size(3);
  window = band(window, I, J, causal);
  const int64_t group = H / k.size(1);      // query heads per kv head (grouped-query attention)
  at::Tensor out = empty_floats({B, I, H, DV}).transpose(1, 2);
  at::Tensor lse = at::empty({B, H, I}, q.options());
  const int64_t per_task = keep ? kept_per_task(I, J, causal, window) : 0;
  at::Tensor weights = keep ? pooled_tensor({B, H, per_task}, at::kFloat) : at::empty({0}, q.options());
  const float alpha = static_cast<float>(scale);
  constexpr float NONE = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    const int64_t chunk_max = keep ? 0 : std::min(CHUNK, J);
    std::vector<float> scores(BLOCK * chunk_max), row_m(BLOCK), row_l(BLOCK), rescale(BLOCK);
    int64_t work = 0;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H;
      const Matrix Q = slice(q, b, h), K = slice(k, b, h / group), V = slice(v, b, h / group);
      const int64_t ldo = out.stride(2);
      float* L = slice_mut(lse, b, h);
      float* W = keep ? weights.data_ptr<float>() + task * per_task : nullptr;
      for (int64_t i0 = 0; i0 < I; i0 += BLOCK) {
        const int64_t rows = std::min(BLOCK, I - i0);
        const int64_t lo = first_key(i0, causal, window), keys = visible(i0 + rows - 1, J, causal, window);
        const float* Qb = Q.data + i0 * Q.ld;
        float* Ob = slice_mut(out, b, h) + i0 * ldo;
        if (keep) {               // all the block's keys at once, its weights kept
          const int64_t width = keys - lo;
          gemm(false, true, rows, width, D, alpha, Qb, Q.ld, K.data + lo * K.ld, K.ld, 0.f, W, width);
          work += rows * width;
          softmax_rows(W, rows, width, i0, lo, causal, window, L + i0);
          gemm(false, false, rows, DV, width, 1.f, W, width, V.data + lo * V.ld, V.ld, 0.f, Ob, ldo);
          W += rows * width;
          continue;
        }
        float* S = scores.data();
        std::fill_n(row_m.data(), rows, NONE);
        std::fill_n(row_l.data(), rows, 0.f);
        // key chunks from the band's first key, with a running maximum and sum per row (online
        // softmax); a row's first keys rescale its (zero) sum and output by exp(-inf) = 0
        for (int64_t j0 = lo; j0 < keys; j0 += CHUNK) {
          const int64_t cols = std::min(CHUNK, keys - j0);
          gemm(false, true, rows, cols, D, alpha, Qb, Q.ld, K.data + j0 * K.ld, K.ld, 0.f, S, cols);
          work += rows * cols;
          for (int64_t r = 0; r < rows; ++r) {
            float* s = S + r * cols;
            // the columns this row sees here: [a, n)
            const int64_t a = std::min(std::max<int64_t>(first_key(i0 + r, causal, window) - j0, 0), cols);
            const int64_t n = std::min(visible(i0 + r, keys, causal, window) - j0, cols);
            if (n <= a) {
              std::fill_n(s, cols, 0.f);
              rescale[r] = 1.f;
              continue;
            }
            const float m = std::max(row_m[r], row_max(s + a, n - a));
            const float sum = exp_shifted(s + a, n - a, m);
            std::fill(s, s + a, 0.f);
            std::fill(s + n, s + cols, 0.f);
            rescale[r] = std::exp(row_m[r] - m);
            row_l[r] = row_l[r] * rescale[r] + sum;
            row_m[r] = m;
          }
          if (j0 > lo) {
            for (int64_t r = 0; r < rows; ++r) {
              float* o = Ob + r * ldo;
              const float c = rescale[r];
#pragma omp simd
              for (int64_t d = 0; d < DV; ++d) o[d] *= c;
            }
          }
          // unnormalised weights times values; each output row is divided by its sum at the end
          // (rows x dv multiplications instead of rows x keys)
          gemm(false, false, rows, DV, cols, 1.f, S, cols, V.data + j0 * V.ld, V.ld, j0 == lo ? 0.f : 1.f,
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
    scored += work;
  });
  return {out, lse, weights};
}

}  // namespace polyformer_cpu
