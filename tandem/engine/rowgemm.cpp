// Tandem's CPU kernel for Linear layers (tandem/engine/rowgemm.py builds and loads it; the rules
// are in that module's docstring).
//
// out[m, n] = sum over k of x[m, k] * w[n, k], summed by one fused multiply-add per k in the order
// of k, one float32 accumulator per output, whatever the number of rows, the ISA or the thread
// split. Weights are packed as tiles of NB outputs: [tiles, K, NB], k-major, so a step over k
// reads NB consecutive weights. K is walked in blocks of KB (the accumulators go to memory and
// back between blocks, which changes no bit), so a tile's block stays in cache while every row
// block of a long input passes over it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t NB = 64;    // outputs per tile
constexpr int64_t KB = 512;   // inputs per block of a tile

#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#define TARGET_AVX2_F16C __attribute__((target("avx2,fma,f16c")))

// Runs Tile::run<R> over m rows: MAX rows at a time, then the rest in one call.
template <typename Tile, int R, typename W, typename X, typename C>
void rest(int64_t left, const W* w, const X* x, int64_t ldx, C* c, int64_t ldc, int64_t kn, bool first) {
  if constexpr (R > 0) {
    if (left == R)
      Tile::template run<R>(w, x, ldx, c, ldc, kn, first);
    else
      rest<Tile, R - 1>(left, w, x, ldx, c, ldc, kn, first);
  }
}

template <typename Tile, int MAX, typename W, typename X, typename C>
void by_rows(const W* w, const X* x, int64_t ldx, C* c, int64_t ldc, int64_t m, int64_t kn, bool first) {
  int64_t r = 0;
  for (; r + MAX <= m; r += MAX) Tile::template run<MAX>(w, x + r * ldx, ldx, c + r * ldc, ldc, kn, first);
  rest<Tile, MAX - 1>(m - r, w, x + r * ldx, ldx, c + r * ldc, ldc, kn, first);
}

// Every tile of outputs, split among threads: its k-blocks in order, each block's `rows` over all
// m rows (`unit` inputs per step of `rows`: 1, a pair or four), then done(tile). Every layout
// here starts a tile's block at (tile * k + k0) * NB. A thread calls finish() when its share is done.
template <typename W, typename X, typename C, typename Rows, typename Done, typename Finish>
void over_tiles(const W* w, const X* x, C* c, int64_t m, int64_t k, int64_t tiles, int64_t unit, Rows rows,
                Done done, Finish finish) {
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      for (int64_t k0 = 0; k0 < k; k0 += KB)
        rows(w + (t * k + k0) * NB, x + k0, k, c + t * NB, tiles * NB, m, std::min(KB, k - k0) / unit, k0 == 0);
      done(t);
    }
    finish();
  });
}

constexpr auto nothing = [](int64_t) {};
constexpr auto no_finish = [] {};

// ---- AVX-512: a tile's 64 outputs are 4 vectors; up to 6 rows at a time (24 accumulators) ----

template <typename T> TARGET_AVX512 inline __m512 load16(const T* p);
template <> TARGET_AVX512 inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> TARGET_AVX512 inline __m512 load16<at::BFloat16>(const at::BFloat16* p) {
  __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

template <typename T, int R>
TARGET_AVX512 void tile512(const T* w, const float* x, int64_t ldx, float* c, int64_t ldc, int64_t kn, bool first) {
  __m512 acc[R][4];
  for (int r = 0; r < R; r++)
    for (int i = 0; i < 4; i++) acc[r][i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + 16 * i);
  for (int64_t k = 0; k < kn; k++) {
    const T* wk = w + k * NB;
    __m512 w0 = load16(wk), w1 = load16(wk + 16), w2 = load16(wk + 32), w3 = load16(wk + 48);
    for (int r = 0; r < R; r++) {
      __m512 xk = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xk, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xk, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xk, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xk, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int i = 0; i < 4; i++) _mm512_storeu_ps(c + r * ldc + 16 * i, acc[r][i]);
}

template <typename T> struct Fma512 {
  template <int R, typename... A> static void run(A... a) { tile512<T, R>(a...); }
};

template <typename T>
void rows512(const T* w, const float* x, int64_t ldx, float* c, int64_t ldc, int64_t m, int64_t kn, bool first) {
  by_rows<Fma512<T>, 6>(w, x, ldx, c, ldc, m, kn, first);
}

// ---- AVX2: a whole tile (8 vectors) a row at a time, or halves of it up to 3 rows at a time ----
// AVX2's 16 registers hold the accumulators of one row for a whole tile, or of 3 rows for half of
// it. A pass over part of a tile reads part of each 256-byte run of its weights, which streams
// from memory slower than the whole tile read in order; from SHARED_FROM rows on, using each
// weight read for 3 rows wins (docs/benchmarks.md, "Tandem's own CPU kernel"). Each output is
// summed alike either way. The int8 kernel below switches at the same count of rows.
constexpr int64_t SHARED_FROM = 3;

template <typename T> TARGET_AVX2 inline __m256 load8(const T* p);
template <> TARGET_AVX2 inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <> TARGET_AVX2 inline __m256 load8<at::BFloat16>(const at::BFloat16* p) {
  __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// R rows over V vectors (8 V outputs) of a tile
template <typename T, int R, int V>
TARGET_AVX2 void part256(const T* w, const float* x, int64_t ldx, float* c, int64_t ldc, int64_t kn, bool first) {
  __m256 acc[R][V];
  for (int r = 0; r < R; r++)
    for (int i = 0; i < V; i++) acc[r][i] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc + 8 * i);
  for (int64_t k = 0; k < kn; k++) {
    const T* wk = w + k * NB;
    for (int i = 0; i < V; i++) {
      __m256 wi = load8(wk + 8 * i);
      for (int r = 0; r < R; r++) acc[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * ldx + k]), wi, acc[r][i]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int i = 0; i < V; i++) _mm256_storeu_ps(c + r * ldc + 8 * i, acc[r][i]);
}

template <typename T, int V> struct Fma256 {
  template <int R, typename... A> static void run(A... a) { part256<T, R, V>(a...); }
};

template <typename T>
void rows256(const T* w, const float* x, int64_t ldx, float* c, int64_t ldc, int64_t m, int64_t kn, bool first) {
  if (m < SHARED_FROM) {
    by_rows<Fma256<T, 8>, 1>(w, x, ldx, c, ldc, m, kn, first);
    return;
  }
  for (int64_t h = 0; h < NB; h += 32) by_rows<Fma256<T, 4>, 3>(w + h, x, ldx, c + h, ldc, m, kn, first);
}

// ---- AVX512-BF16: bfloat16 inputs and weights, a pair of k's per instruction ----
// Weights packed as [tiles, K / 2, NB, 2]; each vdpbf16ps adds a pair of products (k, k + 1) to
// an accumulator, pairs in the order of k.

#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

template <int R>
TARGET_BF16 void tile_dp(const uint16_t* w, const uint16_t* x, int64_t ldx, float* c, int64_t ldc, int64_t pairs,
                         bool first) {
  __m512 acc[R][4];
  for (int r = 0; r < R; r++)
    for (int i = 0; i < 4; i++) acc[r][i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + 16 * i);
  for (int64_t p = 0; p < pairs; p++) {
    const uint16_t* wp = w + p * 2 * NB;
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
    __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
    for (int r = 0; r < R; r++) {
      int32_t two;
      __builtin_memcpy(&two, x + r * ldx + 2 * p, sizeof two);
      __m512bh xp = (__m512bh)_mm512_set1_epi32(two);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xp, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xp, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xp, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xp, w3);
    }
  }
  for (int r = 0; r < R; r++)
    for (int i = 0; i < 4; i++) _mm512_storeu_ps(c + r * ldc + 16 * i, acc[r][i]);
}

struct PairsBf16 {
  template <int R, typename... A> static void run(A... a) { tile_dp<R>(a...); }
};

// ---- int8: uint8 inputs (int8 + 128) against int8 weights ----
// Weights packed as [tiles, K / 4, NB, 4]; sums are int32, exact in any order, so every ISA gives
// the same numbers. The caller takes 128 * (the weights' sum) off each output.

// AVX512-VNNI: four k's of an output per instruction.

#define TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

template <int R>
TARGET_VNNI void tile_vnni(const int8_t* w, const uint8_t* x, int64_t ldx, int32_t* c, int64_t ldc, int64_t quads,
                           bool first) {
  // each accumulator its own variable: GCC spills an array of integer vectors every step
  __m512i a[6][4];
  for (int r = 0; r < R; r++)
    for (int i = 0; i < 4; i++) a[r][i] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(c + r * ldc + 16 * i);
  __m512i a00 = a[0][0], a01 = a[0][1], a02 = a[0][2], a03 = a[0][3];
  __m512i a10 = R > 1 ? a[1][0] : a00, a11 = R > 1 ? a[1][1] : a00, a12 = R > 1 ? a[1][2] : a00, a13 = R > 1 ? a[1][3] : a00;
  __m512i a20 = R > 2 ? a[2][0] : a00, a21 = R > 2 ? a[2][1] : a00, a22 = R > 2 ? a[2][2] : a00, a23 = R > 2 ? a[2][3] : a00;
  __m512i a30 = R > 3 ? a[3][0] : a00, a31 = R > 3 ? a[3][1] : a00, a32 = R > 3 ? a[3][2] : a00, a33 = R > 3 ? a[3][3] : a00;
  __m512i a40 = R > 4 ? a[4][0] : a00, a41 = R > 4 ? a[4][1] : a00, a42 = R > 4 ? a[4][2] : a00, a43 = R > 4 ? a[4][3] : a00;
  __m512i a50 = R > 5 ? a[5][0] : a00, a51 = R > 5 ? a[5][1] : a00, a52 = R > 5 ? a[5][2] : a00, a53 = R > 5 ? a[5][3] : a00;
  const int32_t* x4 = reinterpret_cast<const int32_t*>(x);
  int64_t ld4 = ldx / 4;
#define ROW(r, A0, A1, A2, A3)                              \
  if (R > r) {                                              \
    __m512i xq = _mm512_set1_epi32(x4[r * ld4 + q]);        \
    A0 = _mm512_dpbusd_epi32(A0, xq, w0);                   \
    A1 = _mm512_dpbusd_epi32(A1, xq, w1);                   \
    A2 = _mm512_dpbusd_epi32(A2, xq, w2);                   \
    A3 = _mm512_dpbusd_epi32(A3, xq, w3);                   \
  }
  for (int64_t q = 0; q < quads; q++) {
    const int8_t* wq = w + q * 4 * NB;
    __m512i w0 = _mm512_loadu_si512(wq), w1 = _mm512_loadu_si512(wq + 64);
    __m512i w2 = _mm512_loadu_si512(wq + 128), w3 = _mm512_loadu_si512(wq + 192);
    ROW(0, a00, a01, a02, a03)
    ROW(1, a10, a11, a12, a13)
    ROW(2, a20, a21, a22, a23)
    ROW(3, a30, a31, a32, a33)
    ROW(4, a40, a41, a42, a43)
    ROW(5, a50, a51, a52, a53)
  }
#undef ROW
  __m512i out[6][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23},
                       {a30, a31, a32, a33}, {a40, a41, a42, a43}, {a50, a51, a52, a53}};
  for (int r = 0; r < R; r++)
    for (int i = 0; i < 4; i++) _mm512_storeu_si512(c + r * ldc + 16 * i, out[r][i]);
}

struct QuadsInt8 {
  template <int R, typename... A> static void run(A... a) { tile_vnni<R>(a...); }
};

// AVX2: both sides widened to int16; each vpmaddwd adds the products of two k's of an output, so
// an accumulator holds two partial sums for each of four outputs, added together at the end. H
// quarters of a tile (16 outputs each) at a time, R rows (4 H R accumulators: the whole tile's
// 16 spill a few, which still beats the quarters' strided reads for a row alone).
template <int R, int H>
TARGET_AVX2 void part_int8(const int8_t* w, const uint8_t* x, int64_t ldx, int32_t* c, int64_t ldc, int64_t quads,
                           bool first) {
  __m256i acc[R][4 * H];
  for (int r = 0; r < R; r++)
    for (int i = 0; i < 4 * H; i++) acc[r][i] = _mm256_setzero_si256();
  const int32_t* x4 = reinterpret_cast<const int32_t*>(x);
  int64_t ld4 = ldx / 4;
  for (int64_t q = 0; q < quads; q++) {
    const int8_t* wq = w + q * 4 * NB;
    __m256i xq[R];
    for (int r = 0; r < R; r++) xq[r] = _mm256_cvtepu8_epi16(_mm_set1_epi32(x4[r * ld4 + q]));
    for (int i = 0; i < 4 * H; i++) {
      __m256i wi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + 16 * i)));
      for (int r = 0; r < R; r++) acc[r][i] = _mm256_add_epi32(acc[r][i], _mm256_madd_epi16(wi, xq[r]));
    }
  }
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2 * H; h++) {
      // hadd leaves outputs (0, 1, 4, 5 | 2, 3, 6, 7) of the eight; the permute puts them in order
      __m256i sums = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][2 * h], acc[r][2 * h + 1]), 0xD8);
      __m256i* out = reinterpret_cast<__m256i*>(c + r * ldc + 8 * h);
      if (!first) sums = _mm256_add_epi32(sums, _mm256_loadu_si256(out));
      _mm256_storeu_si256(out, sums);
    }
}

template <int H> struct PartInt8 {
  template <int R, typename... A> static void run(A... a) { part_int8<R, H>(a...); }
};

// As for floats: a row at a time over a whole tile below SHARED_FROM rows, else quarters, 3 rows at a time.
void rows_int8_avx2(const int8_t* w, const uint8_t* x, int64_t ldx, int32_t* c, int64_t ldc, int64_t m,
                    int64_t quads, bool first) {
  if (m < SHARED_FROM) {
    by_rows<PartInt8<4>, 1>(w, x, ldx, c, ldc, m, quads, first);
    return;
  }
  for (int64_t q = 0; q < NB; q += 16) by_rows<PartInt8<1>, 3>(w + 4 * q, x, ldx, c + q, ldc, m, quads, first);
}

// AMX (Intel's tile unit, where the CPU has AMX-INT8 and Linux lets the process use it): a
// tile instruction multiplies up to 16 rows by 64 inputs of 16 outputs, reading the weights as
// packed for VNNI (a quad of one output's four weights is a tile row's 4 bytes; a tile row holds 16
// outputs, and the next quad is NB * 4 bytes on). A row's sums are the same exact integers as
// VNNI's, so a call picks the unit by its count of rows with no change to any row's result: below
// AMX_FROM rows VNNI's row blocks (a decode step reads the weights as fast on either), from it the
// tiles (a verify pass's or a prefill's rows cost less there). The quads past the last whole 16 of
// a block are VNNI's.

#define TARGET_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni")))

constexpr int64_t AMX_FROM = 4;

struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// The rows this thread's tiles are configured for, 0 when released. A thread configures its tiles
// when a call's rows differ and releases them when its share of the call is done (release_tiles),
// as other libraries' kernels may use the tiles between calls.
thread_local int64_t tile_rows = 0;

// tmm0-3: the sums of 16 outputs each (4 bytes each); tmm4: `rows` rows of 64 inputs; tmm5-7: 16 quads
// of 16 outputs
TARGET_AMX void configure_tiles(int64_t rows) {
  if (tile_rows == rows) return;
  tile_rows = rows;
  TileConfig config;
  for (int t = 0; t < 8; t++) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = t < 5 ? rows : 16;
  }
  _tile_loadconfig(&config);
}

TARGET_AMX void release_tiles() {
  if (tile_rows == 0) return;
  _tile_release();
  tile_rows = 0;
}

TARGET_AMX void rows_amx(const int8_t* w, const uint8_t* x, int64_t ldx, int32_t* c, int64_t ldc, int64_t m,
                         int64_t quads, bool first) {
  if (m < AMX_FROM) {
    by_rows<QuadsInt8, 6>(w, x, ldx, c, ldc, m, quads, first);
    return;
  }
  int64_t whole = quads / 16 * 16, ldw = 4 * NB, ldcb = 4 * ldc;
  for (int64_t r0 = 0; r0 < m; r0 += 16) {
    configure_tiles(std::min<int64_t>(16, m - r0));
    const uint8_t* xr = x + r0 * ldx;
    int32_t* cr = c + r0 * ldc;
    if (first) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    } else {
      _tile_loadd(0, cr, ldcb); _tile_loadd(1, cr + 16, ldcb); _tile_loadd(2, cr + 32, ldcb); _tile_loadd(3, cr + 48, ldcb);
    }
    for (int64_t q = 0; q < whole; q += 16) {
      const int8_t* wq = w + q * ldw;
      _tile_loadd(4, xr + 4 * q, ldx);
      _tile_loadd(5, wq, ldw);
      _tile_dpbusd(0, 4, 5);
      _tile_loadd(6, wq + 64, ldw);
      _tile_dpbusd(1, 4, 6);
      _tile_loadd(7, wq + 128, ldw);
      _tile_dpbusd(2, 4, 7);
      _tile_loadd(5, wq + 192, ldw);
      _tile_dpbusd(3, 4, 5);
    }
    _tile_stored(0, cr, ldcb); _tile_stored(1, cr + 16, ldcb); _tile_stored(2, cr + 32, ldcb); _tile_stored(3, cr + 48, ldcb);
  }
  if (whole < quads) by_rows<QuadsInt8, 6>(w + whole * ldw, x + 4 * whole, ldx, c, ldc, m, quads - whole, false);
}

// Linux lets a process use AMX's tile data once it asks (5.16 on; arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA), for all its threads.
bool has_amx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
  static const bool allowed = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return allowed;
}

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

bool has_vnni() { return has_avx512() && __builtin_cpu_supports("avx512vnni"); }

enum Int8Isa : int64_t { INT8_NONE = 0, INT8_AVX2 = 1, INT8_VNNI = 2, INT8_AMX = 3 };

// Found once: every int8 call asks, and in a virtual machine each CPUID traps to the hypervisor.
int64_t best_int8() {
  static const int64_t best = [] {
    __builtin_cpu_init();
    if (has_vnni()) return has_amx() ? INT8_AMX : INT8_VNNI;
    return __builtin_cpu_supports("avx2") ? INT8_AVX2 : INT8_NONE;
  }();
  return best;
}

// The row blocks of the int8 kernel for `which` (0: the best here), checked against this CPU.
using Int8Rows = void (*)(const int8_t*, const uint8_t*, int64_t, int32_t*, int64_t, int64_t, int64_t, bool);
Int8Rows int8_rows(int64_t which, const char* op) {
  int64_t best = best_int8();
  if (which == INT8_NONE) which = best;
  TORCH_CHECK(best != INT8_NONE, op, ": this CPU has neither AVX512-VNNI nor AVX2");
  TORCH_CHECK(which >= 0 && which <= best, op, ": int8 ISA ", which, " (1 AVX2, 2 AVX512-VNNI, 3 AMX-INT8) is beyond this CPU's ",
              best);
  if (which == INT8_AMX) return rows_amx;
  if (which == INT8_VNNI) return by_rows<QuadsInt8, 6, int8_t, uint8_t, int32_t>;
  return rows_int8_avx2;
}

// weight [N, K] int8 -> [tiles, K / 4, NB, 4], zero-padded to whole tiles and a K of fours
at::Tensor pack_quads(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "rowgemm_pack_quads: an int8 weight");
  int64_t n = weight.size(0), k = weight.size(1), tiles = (n + NB - 1) / NB, k4 = (k + 3) / 4 * 4;
  auto padded = at::zeros({tiles * NB, k4}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  return padded.view({tiles, NB, k4 / 4, 4}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] uint8, packed by pack_quads -> [M, tiles * NB] int32: sum over k of x * w
at::Tensor linear_quads(const at::Tensor& x, const at::Tensor& packed, int64_t which) {
  TORCH_CHECK(x.scalar_type() == at::kByte && x.dim() == 2 && x.is_contiguous(),
              "rowgemm_linear_quads: x is a contiguous uint8 [rows, in_features]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == NB && packed.size(3) == 4 && packed.is_contiguous(),
              "rowgemm_linear_quads: not packed in fours");
  auto rows = int8_rows(which, "rowgemm_linear_quads");
  int64_t tiles = packed.size(0), k = 4 * packed.size(1), m = x.size(0);
  TORCH_CHECK(x.size(1) <= k && x.size(1) > k - 4, "rowgemm_linear_quads: x has ", x.size(1), " features, the weight ", k);
  auto xs = x.size(1) == k ? x : at::constant_pad_nd(x, {0, k - x.size(1)});
  auto c = at::empty({m, tiles * NB}, x.options().dtype(at::kInt));
  if (m == 0) return c;
  auto w = packed.data_ptr<int8_t>();
  auto xp = xs.data_ptr<uint8_t>();
  int32_t* cp = c.data_ptr<int32_t>();
  over_tiles(w, xp, cp, m, k, tiles, 4, rows, nothing, release_tiles);
  return c;
}

// Each row's scale: its largest magnitude over 127 (at least 1e-12 / 127); the row as uint8:
// round(x / scale) to even, + 128. The same float operations as tandem.engine.gemm.Int8Linear's.
void quantize_row(const float* x, int64_t k, int64_t k4, uint8_t* q, float* scale) {
  float top = 0.f;
  for (int64_t i = 0; i < k; i++) top = std::max(top, std::fabs(x[i]));
  float s = std::max(top, 1e-12f) / 127.f;
  for (int64_t i = 0; i < k; i++) q[i] = static_cast<uint8_t>(std::nearbyint(x[i] / s) + 128.f);
  for (int64_t i = k; i < k4; i++) q[i] = 128;
  *scale = s;
}

// The same, 16 inputs at a time (the same operations on each: the same bytes and scale).
TARGET_AVX512 void quantize_row512(const float* x, int64_t k, int64_t k4, uint8_t* q, float* scale) {
  __m512 top16 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) top16 = _mm512_max_ps(top16, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  float top = _mm512_reduce_max_ps(top16);
  for (; i < k; i++) top = std::max(top, std::fabs(x[i]));
  float s = std::max(top, 1e-12f) / 127.f;
  __m512 s16 = _mm512_set1_ps(s), half = _mm512_set1_ps(128.f);
  for (i = 0; i + 16 <= k; i += 16) {
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), s16), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_add_ps(v, half))));
  }
  for (; i < k; i++) q[i] = static_cast<uint8_t>(std::nearbyint(x[i] / s) + 128.f);
  for (i = k; i < k4; i++) q[i] = 128;
  *scale = s;
}

// out[r, j] = (c[r, j] - off[j]) * sc[j] * rs for the outputs j0 <= j < j1 of a row
void scale_row(const int32_t* c, const int32_t* off, const float* sc, float rs, float* out, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; j++) out[j] = static_cast<float>(c[j] - off[j]) * sc[j] * rs;
}

TARGET_AVX512 void scale_row512(const int32_t* c, const int32_t* off, const float* sc, float rs, float* out,
                                int64_t j0, int64_t j1) {
  __m512 rs16 = _mm512_set1_ps(rs);
  int64_t j = j0;
  for (; j + 16 <= j1; j += 16) {
    __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(c + j), _mm512_loadu_si512(off + j)));
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_mul_ps(v, _mm512_loadu_ps(sc + j)), rs16));
  }
  scale_row(c, off, sc, rs, out, j, j1);
}

// x [M, K] float32 -> [M, N] float32: each row quantized on a scale of its own, the exact int8
// sums, less offsets[n] (128 times the weights' sum), times scales[n] (the weights'), times the
// row's scale, in that order
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets,
                       const at::Tensor& scales, int64_t n, int64_t which) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "rowgemm_linear_int8: x is a contiguous float32 [rows, in_features]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == NB && packed.size(3) == 4 && packed.is_contiguous(),
              "rowgemm_linear_int8: not packed in fours");
  auto rows = int8_rows(which, "rowgemm_linear_int8");
  int64_t tiles = packed.size(0), k4 = 4 * packed.size(1), m = x.size(0), k = x.size(1);
  TORCH_CHECK(k <= k4 && k > k4 - 4, "rowgemm_linear_int8: x has ", k, " features, the weight ", k4);
  TORCH_CHECK(n <= tiles * NB && offsets.numel() == n && scales.numel() == n, "rowgemm_linear_int8: ", n, " outputs");
  auto q = at::empty({m, k4}, x.options().dtype(at::kByte));
  auto row_scale = at::empty({m}, x.options());
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  auto c = at::empty({m, tiles * NB}, x.options().dtype(at::kInt));
  const float* xp = x.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* rs = row_scale.data_ptr<float>();
  bool avx512 = has_avx512();
  auto quantize = avx512 ? quantize_row512 : quantize_row;
  auto scale = avx512 ? scale_row512 : scale_row;
  at::parallel_for(0, m, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) quantize(xp + r * k, k, k4, qp + r * k4, rs + r);
  });
  auto w = packed.data_ptr<int8_t>();
  int32_t* cp = c.data_ptr<int32_t>();
  const int32_t* off = offsets.data_ptr<int32_t>();
  const float* sc = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t ldc = tiles * NB;
  over_tiles(w, qp, cp, m, k4, tiles, 4, rows, [&](int64_t t) {
    for (int64_t r = 0; r < m; r++) scale(cp + r * ldc, off, sc, rs[r], op + r * n, t * NB, std::min(n, (t + 1) * NB));
  }, release_tiles);
  return out;
}

// ---- int4: weights in groups of G inputs, a float32 scale per output and group ----
//
// Weights packed as [tiles, K / 8, NB, 4] bytes: the byte of output o at (p, j) holds weight
// (o, 8p + j) + 8 in its low nibble and (o, 8p + 4 + j) + 8 in its high one, so one 64-byte load
// unpacks to two of VNNI's quad registers; a float16 scale per output and group. Inputs are the
// int8 path's rows as signed bytes (a scale per row). The nibbles are multiplied as they are (0 to
// 15, the unsigned operand of VNNI's and AVX2's byte products, the inputs the signed one), and
// each group's sum then loses 8 times the group's inputs' sum: the exact integer sum of weights
// times inputs, with no per-output offsets to read beside the weights. Each group's sum times its
// scale is added to a float32 accumulator in the order of the groups: one order whatever the rows
// of a call or the thread split.

constexpr int64_t G = 64;     // inputs per group

template <int R>
TARGET_VNNI void tile_vnni4(const uint8_t* w, const uint8_t* x, int64_t ldx, float* c, int64_t ldc,
                            const uint16_t* sw, const int32_t* xs, int64_t ldxs, int64_t groups, bool first) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int32_t* x4 = reinterpret_cast<const int32_t*>(x);
  int64_t ld4 = ldx / 4;
  for (int64_t g = 0; g < groups; g++) {
    __m512i a[4][4];
    for (int r = 0; r < R; r++)
      for (int i = 0; i < 4; i++) a[r][i] = _mm512_setzero_si512();
    for (int64_t p = g * G / 8; p < (g + 1) * G / 8; p++) {
      const uint8_t* wp = w + p * 4 * NB;
      __m512i lo[4], hi[4];
      for (int i = 0; i < 4; i++) {
        __m512i v = _mm512_loadu_si512(wp + 64 * i);
        lo[i] = _mm512_and_si512(v, low);
        hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < R; r++) {
        __m512i xa = _mm512_set1_epi32(x4[r * ld4 + 2 * p]), xb = _mm512_set1_epi32(x4[r * ld4 + 2 * p + 1]);
        for (int i = 0; i < 4; i++) a[r][i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[r][i], lo[i], xa), hi[i], xb);
      }
    }
    // the float32 sums live in c (in cache) between groups, leaving the registers to the rows
    bool fresh = first && g == 0;
    for (int i = 0; i < 4; i++) {
      __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sw + g * NB + 16 * i)));
      for (int r = 0; r < R; r++) {
        float* cr = c + r * ldc + 16 * i;
        __m512 sum = fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(cr);
        __m512i exact = _mm512_sub_epi32(a[r][i], _mm512_set1_epi32(xs[r * ldxs + g]));
        _mm512_storeu_ps(cr, _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), s, sum));
      }
    }
  }
}

// AVX2: vpmaddubsw adds the products of a pair of k's in int16, exactly: with nibbles of 0 to 15
// and inputs of -128 to 127 a pair is at most 2 * 15 * 128 in magnitude, and the low and high
// nibbles' pairs of Q consecutive quad pairs at most 2 * 2 * 15 * 128 * Q, within int16 for Q = 4.
// vpmaddwd by ones then adds an output's two int16 sums into int32. The group's sums are VNNI's exact integers, scaled and added
// to c by the same float32 operations, so a row's result is the same on either ISA. V vectors (8 V
// outputs) of a tile, R rows.
constexpr int64_t Q = 4;

template <int R, int V>
TARGET_AVX2_F16C void part_avx2_4(const uint8_t* w, const uint8_t* x, int64_t ldx, float* c, int64_t ldc,
                                  const uint16_t* sw, const int32_t* xs, int64_t ldxs, int64_t groups, bool first) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int32_t* x4 = reinterpret_cast<const int32_t*>(x);
  int64_t ld4 = ldx / 4;
  for (int64_t g = 0; g < groups; g++) {
    __m256i a[R][V];
    for (int r = 0; r < R; r++)
      for (int v = 0; v < V; v++) a[r][v] = _mm256_setzero_si256();
    for (int64_t p0 = g * G / 8; p0 < (g + 1) * G / 8; p0 += Q) {
      __m256i s[R][V];
      for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) s[r][v] = _mm256_setzero_si256();
      for (int64_t p = p0; p < p0 + Q; p++) {
        const uint8_t* wp = w + p * 4 * NB;
        __m256i xa[R], xb[R];
        for (int r = 0; r < R; r++) {
          xa[r] = _mm256_set1_epi32(x4[r * ld4 + 2 * p]);
          xb[r] = _mm256_set1_epi32(x4[r * ld4 + 2 * p + 1]);
        }
        for (int v = 0; v < V; v++) {
          __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * v));
          __m256i lo = _mm256_and_si256(b, low);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
          for (int r = 0; r < R; r++)
            s[r][v] = _mm256_add_epi16(s[r][v], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa[r]),
                                                                 _mm256_maddubs_epi16(hi, xb[r])));
        }
      }
      for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) a[r][v] = _mm256_add_epi32(a[r][v], _mm256_madd_epi16(s[r][v], ones));
    }
    bool fresh = first && g == 0;
    for (int v = 0; v < V; v++) {
      __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sw + g * NB + 8 * v)));
      for (int r = 0; r < R; r++) {
        float* cr = c + r * ldc + 8 * v;
        __m256 sum = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(cr);
        __m256i exact = _mm256_sub_epi32(a[r][v], _mm256_set1_epi32(xs[r * ldxs + g]));
        _mm256_storeu_ps(cr, _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), sc, sum));
      }
    }
  }
}

enum Int4Isa : int64_t { INT4_NONE = 0, INT4_AVX2 = 1, INT4_VNNI = 2 };

int64_t best_int4() {
  static const int64_t best = [] {
    __builtin_cpu_init();
    if (has_vnni()) return INT4_VNNI;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")
               ? INT4_AVX2 : INT4_NONE;
  }();
  return best;
}

// One block of a tile (`groups` groups) for m rows from row 0: VNNI 4 rows at a time; AVX2 as its
// int8 kernel, a row at a time over the whole tile below SHARED_FROM rows, else quarters, 3 rows
// at a time.
void tile_int4(int64_t isa, const uint8_t* w, const uint8_t* x, int64_t ldx, float* c, int64_t ldc,
               const uint16_t* sw, const int32_t* xs, int64_t ldxs, int64_t m, int64_t groups, bool first) {
  using Part = void (*)(const uint8_t*, const uint8_t*, int64_t, float*, int64_t, const uint16_t*, const int32_t*,
                        int64_t, int64_t, bool);
  auto blocks = [&](int64_t most, Part full, const Part* fewer, int64_t o0) {
    int64_t r = 0;
    for (; r + most <= m; r += most)
      full(w + 4 * o0, x + r * ldx, ldx, c + r * ldc + o0, ldc, sw + o0, xs + r * ldxs, ldxs, groups, first);
    if (r < m)
      fewer[m - r](w + 4 * o0, x + r * ldx, ldx, c + r * ldc + o0, ldc, sw + o0, xs + r * ldxs, ldxs, groups, first);
  };
  if (isa == INT4_VNNI) {
    static const Part fewer[] = {nullptr, tile_vnni4<1>, tile_vnni4<2>, tile_vnni4<3>};
    blocks(4, tile_vnni4<4>, fewer, 0);
  } else if (m < SHARED_FROM) {
    static const Part fewer[] = {nullptr, part_avx2_4<1, 8>};
    blocks(1, part_avx2_4<1, 8>, fewer, 0);
  } else {
    static const Part fewer[] = {nullptr, part_avx2_4<1, 2>, part_avx2_4<2, 2>};
    for (int64_t o = 0; o < NB; o += 16) blocks(3, part_avx2_4<3, 2>, fewer, o);
  }
}

// x [M, K] float32 -> [M, N] float32: each row quantized as for int8 (k padded with zeros to the
// weight's K, a multiple of G), as signed bytes, the grouped sums above, times the row's scale.
// packed [tiles, K / 8, NB, 4] uint8; scales [tiles, K / G, NB] float16.
at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                       int64_t which) {
  int64_t best = best_int4();
  if (which == INT4_NONE) which = best;
  TORCH_CHECK(best != INT4_NONE, "rowgemm_linear_int4: int4 layers need AVX512-VNNI or AVX2");
  TORCH_CHECK(which >= 0 && which <= best, "rowgemm_linear_int4: int4 ISA ", which,
              " (1 AVX2, 2 AVX512-VNNI) is beyond this CPU's ", best);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "rowgemm_linear_int4: x is a contiguous float32 [rows, in_features]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == NB && packed.size(3) == 4 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte, "rowgemm_linear_int4: not packed in nibbles");
  int64_t tiles = packed.size(0), kw = 8 * packed.size(1), m = x.size(0), k = x.size(1), groups = kw / G;
  TORCH_CHECK(kw % G == 0 && k <= kw && k > kw - G, "rowgemm_linear_int4: x has ", k, " features, the weight ", kw);
  TORCH_CHECK(scales.numel() == tiles * groups * NB && scales.is_contiguous() && scales.scalar_type() == at::kHalf,
              "rowgemm_linear_int4: scales are float16 [tiles, groups, ", NB, "]");
  TORCH_CHECK(n <= tiles * NB, "rowgemm_linear_int4: ", n, " outputs");
  auto q = at::empty({m, kw}, x.options().dtype(at::kByte));
  auto row_scale = at::empty({m}, x.options());
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  auto c = at::empty({m, tiles * NB}, x.options());
  const float* xp = x.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* rs = row_scale.data_ptr<float>();
  auto quantize = has_avx512() ? quantize_row512 : quantize_row;
  auto sums = at::empty({m, groups}, x.options().dtype(at::kInt));     // 8 times each row's inputs' sum by group
  int32_t* xs = sums.data_ptr<int32_t>();
  at::parallel_for(0, m, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      uint8_t* row = qp + r * kw;
      quantize(xp + r * k, k, kw, row, rs + r);
      for (int64_t g = 0; g < groups; g++) {
        int32_t total = 0;
        for (int64_t j = g * G; j < (g + 1) * G; j++) {
          row[j] ^= 0x80;                                 // uint8 (int8 + 128) -> int8's bits
          total += static_cast<int8_t>(row[j]);
        }
        xs[r * groups + g] = 8 * total;
      }
    }
  });
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* sw = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* cp = c.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t ldc = tiles * NB;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      for (int64_t k0 = 0; k0 < kw; k0 += KB) {
        const uint8_t* wb = w + (t * kw + k0) * NB / 2;
        int64_t at = (t * groups + k0 / G) * NB, blocks = std::min(KB, kw - k0) / G;
        tile_int4(which, wb, qp + k0, kw, cp + t * NB, ldc, sw + at, xs + k0 / G, groups, m, blocks, k0 == 0);
      }
      int64_t j1 = std::min(n, (t + 1) * NB);
      for (int64_t r = 0; r < m; r++)
        for (int64_t j = t * NB; j < j1; j++) op[r * n + j] = cp[r * ldc + j] * rs[r];
    }
  });
  return out;
}

// ---- dispatch ----

enum Isa : int64_t { NONE = 0, AVX2 = 1, AVX512 = 2, AVX512_BF16 = 3 };

int64_t best_isa() {
  __builtin_cpu_init();
  if (has_avx512()) return __builtin_cpu_supports("avx512bf16") ? AVX512_BF16 : AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
  return NONE;
}

template <typename T>
void run(Isa isa, const T* w, const float* x, float* c, int64_t m, int64_t k, int64_t tiles) {
  auto rows = isa == AVX512 ? rows512<T> : rows256<T>;
  over_tiles(w, x, c, m, k, tiles, 1, rows, nothing, no_finish);
}

// weight [N, K] bfloat16 -> [tiles, K / 2, NB, 2], zero-padded to whole tiles and an even K
at::Tensor pack_pairs(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "rowgemm_pack_pairs: a bfloat16 weight");
  int64_t n = weight.size(0), k = weight.size(1), tiles = (n + NB - 1) / NB, even = k + k % 2;
  auto padded = at::zeros({tiles * NB, even}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  return padded.view({tiles, NB, even / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "rowgemm_pack: a weight is [out_features, in_features]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "rowgemm_pack: weights are float32 or bfloat16");
  int64_t n = weight.size(0), k = weight.size(1), tiles = (n + NB - 1) / NB;
  auto padded = at::zeros({tiles * NB, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({tiles, NB, k}).transpose(1, 2).contiguous();
}

// x [M, K] bfloat16, packed by pack_pairs -> [M, tiles * NB] float32
at::Tensor linear_pairs(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "rowgemm_linear_pairs: x is a contiguous bfloat16 [rows, in_features]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == NB && packed.size(3) == 2 && packed.is_contiguous(),
              "rowgemm_linear_pairs: not packed in pairs");
  TORCH_CHECK(best_isa() == AVX512_BF16, "rowgemm_linear_pairs: this CPU has no AVX512-BF16");
  int64_t tiles = packed.size(0), pairs = packed.size(1), m = x.size(0);
  TORCH_CHECK(x.size(1) == 2 * pairs || x.size(1) == 2 * pairs - 1, "rowgemm_linear_pairs: x has ", x.size(1),
              " features, the weight ", 2 * pairs);
  auto xs = x.size(1) == 2 * pairs ? x : at::constant_pad_nd(x, {0, 1});
  auto c = at::empty({m, tiles * NB}, x.options().dtype(at::kFloat));
  if (m == 0) return c;
  auto w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto xp = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>());
  float* cp = c.data_ptr<float>();
  int64_t k = 2 * pairs;
  over_tiles(w, xp, cp, m, k, tiles, 2, by_rows<PairsBf16, 6, uint16_t, uint16_t, float>, nothing, no_finish);
  return c;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "rowgemm_linear: x is a contiguous float32 [rows, in_features]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NB && packed.is_contiguous(), "rowgemm_linear: not packed");
  int64_t tiles = packed.size(0), k = packed.size(1), m = x.size(0);
  TORCH_CHECK(x.size(1) == k, "rowgemm_linear: x has ", x.size(1), " features, the weight ", k);
  int64_t best = best_isa();
  if (isa == NONE) isa = best;
  TORCH_CHECK(isa != NONE && isa <= best, "rowgemm_linear: this CPU has neither AVX-512 nor AVX2 with FMA");
  if (isa == AVX512_BF16) isa = AVX512;
  auto c = at::empty({m, tiles * NB}, x.options());
  if (m == 0) return c;
  if (packed.scalar_type() == at::kFloat)
    run<float>(Isa(isa), packed.data_ptr<float>(), x.data_ptr<float>(), c.data_ptr<float>(), m, k, tiles);
  else if (packed.scalar_type() == at::kBFloat16)
    run<at::BFloat16>(Isa(isa), packed.data_ptr<at::BFloat16>(), x.data_ptr<float>(), c.data_ptr<float>(), m, k,
                      tiles);
  else
    TORCH_CHECK(false, "rowgemm_linear: weights are float32 or bfloat16");
  return c;
}

}  // namespace

TORCH_LIBRARY(tandem, m) {
  m.def("rowgemm_isa() -> int", [] { return best_isa(); });
  m.def("rowgemm_pack(Tensor weight) -> Tensor", pack);
  m.def("rowgemm_linear(Tensor x, Tensor packed, int isa=0) -> Tensor", linear);
  m.def("rowgemm_pack_pairs(Tensor weight) -> Tensor", pack_pairs);
  m.def("rowgemm_linear_pairs(Tensor x, Tensor packed) -> Tensor", linear_pairs);
  m.def("rowgemm_int8_isa() -> int", [] { return best_int8(); });
  m.def("rowgemm_pack_quads(Tensor weight) -> Tensor", pack_quads);
  m.def("rowgemm_linear_quads(Tensor x, Tensor packed, int which=0) -> Tensor", linear_quads);
  m.def("rowgemm_linear_int8(Tensor x, Tensor packed, Tensor offsets, Tensor scales, int n, int which=0) -> Tensor",
        linear_int8);
  m.def("rowgemm_int4_isa() -> int", [] { return best_int4(); });
  m.def("rowgemm_linear_int4(Tensor x, Tensor packed, Tensor scales, int n, int which=0) -> Tensor",
        linear_int4);
}
