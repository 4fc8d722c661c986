// spec-cli's CPU kernels: GGUF weight blocks times 8-bit activation blocks, attention over the static KV cache,
// RMS norm, q/k norm + rope + KV writes, the gated FFN activation. Loaded with ctypes by spec_cli/model/kernels/__init__.py (plain C entry points, no Python or torch headers).
//
// Batch invariance by construction: every output element is computed by the same sequence of operations whatever
// the number of rows in the call, the rows beside it, the thread count or which thread computes it. Rows are
// quantized one at a time; a weight row (or a group of 8 packed ones, X8) is multiplied with 1 to 8 activation rows
// at a time by one template whose per-row arithmetic does not depend on how many rows share the weight loads;
// threads take whole output columns. Integer block sums are exact, so the AVX2, AVX-512 VNNI and scalar forms of a
// packed product give the same bits.
// No -ffast-math and no FMA contraction (setup.py), so the compiler cannot reassociate any of it.
//
// Numerics follow ggml's CPU backend (activations quantized per block as quantize_row_q8_0/q8_1/q8_K do; integer
// block dot products; float scales applied per block), so logits stay close to llama.cpp's on the same GGUF.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#include <sched.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define SC_X86 1
#define SC_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define SC_X86 0
#endif

namespace {

// ------------------------------------------------------------------------------------------------ half floats

float f16_table[65536];

float half_to_float_exact(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalize
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

struct TableInit {
    TableInit() { for (uint32_t i = 0; i < 65536; i++) f16_table[i] = half_to_float_exact((uint16_t)i); }
} table_init;

inline float h2f(const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return f16_table[h]; }

// float -> half, round to nearest even (what F16C's vcvtps2ph and ggml's GGML_FP32_TO_FP16 give)
uint16_t float_to_half(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    x &= 0x7FFFFFFF;
    if (x >= 0x7F800000) return (uint16_t)(sign | 0x7C00 | (x > 0x7F800000 ? 0x200 : 0));
    if (x >= 0x477FF000) return (uint16_t)(sign | 0x7C00);  // rounds to >= 65520: infinity
    if (x < 0x38800000) {  // subnormal half (or zero)
        if (x < 0x33000000) return (uint16_t)sign;
        const uint32_t e = x >> 23, m = (x & 0x7FFFFF) | 0x800000;
        const uint32_t shift = 126 - e;  // 14 + (113 - e)
        uint32_t r = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((x >> 13) - ((127 - 15) << 10));
    const uint32_t rem = x & 0x1FFF;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) r++;
    return (uint16_t)(sign | r);
}

inline float round_half(float f) { return f16_table[float_to_half(f)]; }

// round half to even, as _mm256_round_ps(_MM_ROUND_NEAREST) and ggml's nearest_int
inline int nearest(float f) { return (int)std::nearbyint(f); }

// ------------------------------------------------------------------------------------------------ thread pool

// Workers wait for a new task by spinning for a short while (SPIN_NS) and then sleeping on a condition variable,
// so an idle pool costs nothing and a busy machine is not fought with. Work is handed out in chunks from one atomic
// counter tagged with the task's epoch: a worker that was descheduled does not hold up the others, and a late one
// can never run a chunk of the wrong task.
class Pool {
public:
    ~Pool() {
        {
            std::lock_guard<std::mutex> lk(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
    }

    // fn(chunk) for chunk in [0, n_chunks), on up to nth threads (the caller is one of them)
    void run(int nth, int64_t n_chunks, const std::function<void(int64_t)>& fn) {
        if (nth <= 1 || n_chunks <= 1) {
            for (int64_t c = 0; c < n_chunks; c++) fn(c);
            return;
        }
        std::lock_guard<std::mutex> run_lock(run_mu_);  // one task at a time (ctypes calls release the GIL)
        ensure_workers(nth - 1);
        // close the counter while the task slot changes: a worker only runs a chunk it claimed from an open counter
        const uint64_t epoch = (counter_.load() >> 32) + 1;
        counter_.store(epoch << 32 | CLOSED);
        fn_.store(&fn);
        n_chunks_.store(n_chunks);
        active_.store(nth - 1);
        counter_.store(epoch << 32);
        if (sleepers_.load() > 0) {
            { std::lock_guard<std::mutex> lk(mu_); }
            cv_.notify_all();
        }
        work();
        for (int spins = 0; in_flight_.load() != 0; spins++) pause(spins);
    }

    void set_spin_ns(int64_t ns) { spin_ns_ = ns; }

private:
    static constexpr uint64_t CLOSED = 0xFFFFFFFFu;

    static void pause(int spins) {
#if SC_X86
        if (spins < 4096) { _mm_pause(); return; }
#endif
        sched_yield();
    }

    // claim and run chunks while the counter is open; all seq_cst, so a claim that succeeds saw the slot of its task
    void work() {
        for (;;) {
            uint64_t v = counter_.load();
            const uint64_t c = v & 0xFFFFFFFFu;
            if (c == CLOSED) return;
            const int64_t n = n_chunks_.load();
            const std::function<void(int64_t)>* fn = fn_.load();
            if ((int64_t)c >= n) return;
            if (counter_.compare_exchange_weak(v, v + 1)) (*fn)((int64_t)c);
        }
    }

    void ensure_workers(int n) {
        while ((int)workers_.size() < n) {
            const int index = (int)workers_.size();
            workers_.emplace_back([this, index] { loop(index); });
        }
    }

    void loop(int index) {
        uint64_t seen = counter_.load() >> 32, epoch = seen;
        // a task is ready when the counter is open under a new epoch
        const auto ready = [&] {
            const uint64_t v = counter_.load();
            epoch = v >> 32;
            return epoch != seen && (v & 0xFFFFFFFFu) != CLOSED;
        };
        for (;;) {
            const auto t0 = std::chrono::steady_clock::now();
            for (int spins = 0; !ready(); spins++) {
#if SC_X86
                _mm_pause();
#endif
                if ((spins & 255) != 255) continue;
                const auto waited = std::chrono::steady_clock::now() - t0;
                if (std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count() < spin_ns_) continue;
                std::unique_lock<std::mutex> lk(mu_);
                sleepers_.fetch_add(1);
                cv_.wait(lk, [&] { return stop_ || ready(); });
                sleepers_.fetch_sub(1);
                if (stop_) return;
            }
            seen = epoch;
            if (index >= active_.load()) continue;
            in_flight_.fetch_add(1);  // before claiming: the caller waits for in_flight_ == 0 after the last chunk
            work();
            in_flight_.fetch_sub(1);
        }
    }

    std::vector<std::thread> workers_;
    std::atomic<uint64_t> counter_{0};  // epoch << 32 | next chunk
    std::atomic<int64_t> n_chunks_{0};
    std::atomic<const std::function<void(int64_t)>*> fn_{nullptr};
    std::atomic<int> active_{0};
    std::atomic<int> in_flight_{0};
    std::atomic<int> sleepers_{0};
    int64_t spin_ns_ = 100000;
    bool stop_ = false;
    std::mutex mu_, run_mu_;
    std::condition_variable cv_;
};

Pool& pool() {
    static Pool p;
    return p;
}

int g_threads = 1;
bool g_use_avx2 = false;
bool g_use_vnni = false;  // AVX-512 VNNI for the X8 products (implies g_use_avx2)

// ------------------------------------------------------------------------------------------------ formats

// GGML type ids (ggml.h)
enum : int { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// Rows repacked 8 at a time by sc_pack_x8 (ggml's CPU backend repacks Q4_0/Q4_K the same way for AVX2): type id
// X8 + the GGML id of the rows' type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K). A group of 8 rows holds, per block of
// the type, its 8 blocks' bytes regrouped (as many bytes as the rows), field by field (x8_fields): the 8 fp16
// scales d side by side, then the 8 minimums (Q4_1/Q5_1: m, Q4_K: dmin), then per row 32-bit words in turn
// (Q5_0/Q5_1: the 32 high bits qh; Q4_K: the 12 scale bytes as three words), word i of row c at 4 (8 i + c), then
// the codes in 32-byte runs, each holding 4 consecutive code bytes of every row (row c at 4 c): Q8_0 bytes 4 g ..
// 4 g + 3 in run g = 0..7, each + 128 (unsigned, as vpdpbusd multiplies them); Q4/Q5 qs bytes 4 g .. 4 g + 3 in
// run g = 0..3 (low nibbles values 4 g + i, high ones 16 + 4 g + i). One 32-byte load then holds the same 4 (or 8)
// values of all 8 rows, one row per 32-bit lane, so the products land in one accumulator lane per row: no
// horizontal sums, and a block's scales are applied to 8 rows per instruction. Q4_K's codes come in 64-byte runs
// of 8 bytes per row (row c at 8 c): qs bytes 32 j + 8 g .. 32 j + 8 g + 7 in run 4 j + g (low nibbles: sub-block
// 2 j, high: 2 j + 1), so that one broadcast of 8 activation bytes serves a whole AVX-512 vector (x8_kernels.h
// dot_q4k_x8). Q5_0/Q5_1's qh bits are reordered too (q5_bit): the fifth bits of run g's 4 bytes sit where one
// shift and one mask put them at bit 4 of each byte.
// Q6_K (1680 bytes a group block, Q6K_X8): the 8 fp16 d, the int8 scales (sub-block j of row c at 8 j + c), then its
// 6-bit codes v rebuilt into 8-byte units per row (row c at 8 c) as Q4_K's runs are: 16 runs of 64 bytes of low
// nibbles, run t holding values 16 t .. 16 t + 7 (low nibbles) and 16 t + 8 .. 16 t + 15 (high nibbles) of sub-block
// t, then 8 runs of 64 bytes of the 2 high bits, run u holding at bits 2 k, 2 k + 1 those of values 32 u + 8 k + i
// (i = 0..7). One 64-byte load then holds 8 consecutive values of all 8 rows.
constexpr int X8 = 256;

// A Q6_K X8 group block: offsets of the scales, the low-nibble runs and the high-bit runs
struct Q6K_X8 {
    static constexpr int bytes = 8 * 210, scales = 16, nibbles = 144, high = nibbles + 16 * 64;
};

// where value i (0..255) of row c sits in a Q6_K X8 group block: the bytes of its low nibble and of its 2 high bits,
// and their shifts within those bytes
struct Q6KSlot { int nib, nib_shift, high, high_shift; };
inline Q6KSlot q6k_x8_slot(int c, int i) {
    const int unit = 8 * c + i % 8;
    return {Q6K_X8::nibbles + 64 * (i / 16) + unit, i % 16 / 8 * 4, Q6K_X8::high + 64 * (i / 32) + unit,
            i % 32 / 8 * 2};
}

// the 6-bit code of value i (0..255) of row c in a Q6_K X8 group block
inline int q6k_x8_code(const uint8_t* blk, int c, int i) {
    const Q6KSlot at = q6k_x8_slot(c, i);
    return (blk[at.nib] >> at.nib_shift & 0xF) | (blk[at.high] >> at.high_shift & 3) << 4;
}

// Where value i's fifth bit of a Q5_0/Q5_1 block goes in its X8 qh word: value i is nibble i / 16 of the byte i % 4
// of run i % 16 / 4 (a 32-bit lane per row), and its bit goes to that byte at bit 2 (run) + nibble
inline int q5_bit(int i) { return 8 * (i % 4) + 2 * (i % 16 / 4) + i / 16; }
inline int base_type(int wtype) { return wtype >= X8 ? wtype - X8 : wtype; }

// Activation formats. A row of K values quantized as:
//   Q8_0: per 32 values an fp16-rounded scale d and int8 codes (ggml's block_q8_0); here also the codes' sum
//   Q8_1: Q8_0 plus s = fp16(d * sum of codes) (block_q8_1)
//   Q8_K: per 256 values a float d, int8 codes and the sums of each 16 codes (block_q8_K)
// stored as separate arrays: codes [M, K] int8, d [M, K / block] float, isum int16 (for Q8_0/Q8_1 the sum of each
// 32 codes [M, K / 32]; for Q8_K per block the sums of each 16 codes, then of each 32: [M, K / 256 * 24]),
// Q8_0/Q8_1, per 16 for Q8_K), s [M, K / 32] float (Q8_1 only).
enum Act { ACT_Q8_0 = 0, ACT_Q8_1 = 1, ACT_Q8_K = 2, ACT_F32 = 3 };

int act_of(int wtype) {
    switch (base_type(wtype)) {
        case Q4_0: case Q5_0: case Q8_0: return ACT_Q8_0;
        case Q4_1: case Q5_1: return ACT_Q8_1;
        case Q4_K: case Q5_K: case Q6_K: return ACT_Q8_K;
        case F32: case F16: return ACT_F32;
        default: return -1;
    }
}

int block_size(int wtype) {
    switch (base_type(wtype)) {
        case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
        case Q4_K: case Q5_K: case Q6_K: return 256;
        default: return 1;
    }
}

int64_t row_bytes(int wtype, int64_t K) {
    switch (base_type(wtype)) {
        case F32: return K * 4;
        case F16: return K * 2;
        case Q4_0: return K / 32 * 18;
        case Q4_1: return K / 32 * 20;
        case Q5_0: return K / 32 * 22;
        case Q5_1: return K / 32 * 24;
        case Q8_0: return K / 32 * 34;
        case Q4_K: return K / 256 * 144;
        case Q5_K: return K / 256 * 176;
        case Q6_K: return K / 256 * 210;
        default: return -1;
    }
}

struct ActRows {
    int kind;
    int64_t K;
    const float* x;  // ACT_F32: the rows themselves [M, K]
    const int8_t* q;  // [M, K]
    const float* d;  // [M, K / block]
    const int16_t* isum;  // [M, K / 256 * 24] (Q8_K) or [M, K / 32]
    const float* s;  // [M, K / 32] (Q8_1)
    // With AVX2, for the X8 products (x8_kernels.h): the rows block by block, so that one pointer per array and
    // constant offsets reach block b of every row (with a pointer per row and array, 8 rows' were spilled from the
    // registers); nd() blocks of `block` values
    int64_t M = 0;
    const int8_t* qb = nullptr;  // [nd, M, block]
    // [nd, M, 32] (Q8_K, for the VNNI Q6_K products): per sub-block of 16 codes, -32 x the sum
    // of its codes 0..3 and 8..11, then of 4..7 and 12..15 (x8_kernels.h dot_q6k_x8)
    const int32_t* q6off = nullptr;
    const float* db = nullptr;  // [nd, M]
    const float* sb = nullptr;  // [nd, M] (Q8_1)
    const int32_t* isumb = nullptr;  // [nd, M]: Q8_0/Q8_1's isum widened (a broadcast from memory)
    const int16_t* ksumb = nullptr;  // [nd, M, 24]: Q8_K's isum
    int64_t nd() const { return K / (kind == ACT_Q8_K ? 256 : 32); }
    int64_t ns() const { return kind == ACT_Q8_K ? K / 256 * 24 : K / 32; }
};

// one row, scalar: the semantics of ggml's quantize_row_q8_0 / _q8_1 (AVX2 versions) and quantize_row_q8_K_ref
void quantize_row(int kind, const float* x, int64_t K, int8_t* q, float* d, int16_t* isum, float* s) {
    if (kind == ACT_Q8_K) {
        for (int64_t b = 0; b < K / 256; b++) {
            const float* xb = x + b * 256;
            int8_t* qb = q + b * 256;
            float max = 0, amax = 0;
            for (int j = 0; j < 256; j++) {
                const float ax = std::fabs(xb[j]);
                if (ax > amax) { amax = ax; max = xb[j]; }
            }
            if (amax == 0) {
                d[b] = 0;
                std::memset(qb, 0, 256);
                for (int g = 0; g < 24; g++) isum[b * 24 + g] = 0;
                continue;
            }
            const float iscale = -127.f / max;
            for (int j = 0; j < 256; j++) qb[j] = (int8_t)std::min(127, nearest(iscale * xb[j]));
            for (int g = 0; g < 16; g++) {
                int sum = 0;
                for (int j = 0; j < 16; j++) sum += qb[g * 16 + j];
                isum[b * 24 + g] = (int16_t)sum;
            }
            for (int g = 0; g < 8; g++) isum[b * 24 + 16 + g] = (int16_t)(isum[b * 24 + 2 * g] + isum[b * 24 + 2 * g + 1]);
            d[b] = 1 / iscale;
        }
        return;
    }
    for (int64_t b = 0; b < K / 32; b++) {
        const float* xb = x + b * 32;
        int8_t* qb = q + b * 32;
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = std::max(amax, std::fabs(xb[j]));
        const float db = amax / 127.f;
        const float id = amax != 0.0f ? 127.f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            qb[j] = (int8_t)nearest(xb[j] * id);
            sum += qb[j];
        }
        d[b] = round_half(db);
        isum[b] = (int16_t)sum;
        if (kind == ACT_Q8_1) s[b] = round_half(db * (float)sum);
    }
}

// ------------------------------------------------------------------------------------------------ scalar dots
// out[r] = dot(weight row, activation row r) for R rows; exact integer sums per block, float per block.

// the 6-bit scales and mins of a Q4_K/Q5_K block's 8 sub-blocks from its 12 scale bytes (ggml's get_scale_min_k4)
void q4k_scales(const uint8_t* s, int* sc, int* mn) {
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            sc[j] = s[j] & 63; mn[j] = s[j + 4] & 63;
        } else {
            sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
            mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
    }
}

void dot_scalar(int R, int wtype, const uint8_t* w, const ActRows& a, const int64_t* rows, float* out) {
    const int64_t K = a.K;
    for (int r = 0; r < R; r++) {
        const int64_t m = rows[r];
        const int8_t* q = a.q + m * K;
        float acc = 0, accm = 0;
        if (wtype == F32 || wtype == F16) {
            const float* x = a.x + m * K;
            for (int64_t k = 0; k < K; k++) {
                const float wv = wtype == F32 ? ((const float*)w)[k] : h2f(w + 2 * k);
                acc += wv * x[k];
            }
        } else {  // Q5_K against Q8_K (Q4_K, Q6_K and the 32-value block types are packed: dot_x8_rows)
            const float* d = a.d + m * a.nd();
            const int16_t* isum = a.isum + m * a.ns();
            const int bs = (int)row_bytes(wtype, 256);
            for (int64_t b = 0; b < K / 256; b++) {
                const uint8_t* blk = w + b * bs;
                const int8_t* qb = q + b * 256;
                const int16_t* bsum = isum + b * 24;
                int sumi = 0, summ = 0;
                const float dw = h2f(blk), dminw = h2f(blk + 2);
                const uint8_t* scales = blk + 4;
                const uint8_t* qh = blk + 16;
                const uint8_t* qs = blk + 48;
                int sc_all[8], mn_all[8];
                q4k_scales(scales, sc_all, mn_all);
                for (int j = 0; j < 8; j++) {
                    const int sc = sc_all[j], mn = mn_all[j];
                    const uint8_t* qq = qs + (j / 2) * 32;
                    int s = 0;
                    for (int l = 0; l < 32; l++) {
                        const int v = ((j & 1) ? (qq[l] >> 4) : (qq[l] & 0xF)) | ((qh[l] >> j) & 1) << 4;
                        s += v * qb[j * 32 + l];
                    }
                    sumi += sc * s;
                    summ += mn * (bsum[2 * j] + bsum[2 * j + 1]);
                }
                acc += (dw * d[b]) * (float)sumi;
                accm -= (dminw * d[b]) * (float)summ;
            }
        }
        out[r] = acc + accm;
    }
}

// Layout of a 32-value block type's X8 group block (see X8): offsets of the minimums, high bits and codes
template <int W>
struct X32 {
    static constexpr bool has_min = W == Q4_1 || W == Q5_1, five = W == Q5_0 || W == Q5_1;
    static constexpr int bytes = 8 * (W == Q4_0 ? 18 : W == Q4_1 ? 20 : W == Q5_0 ? 22 : W == Q5_1 ? 24 : 34);
    static constexpr int qh = has_min ? 32 : 16, codes = qh + (five ? 32 : 0);
    static constexpr int offset = W == Q4_0 ? 8 : W == Q5_0 ? 16 : 0;  // value = code - offset
    // what the X8 layout adds to each code (Q8_0's, stored unsigned for vpdpbusd; x8_kernels.h takes stored x the
    // activation's sum off where it multiplies them as stored)
    static constexpr int stored = W == Q8_0 ? 128 : 0;
};

// X8 groups of a 32-value block type against Q8_0/Q8_1: out[r * ldo + c] = dot(row c, activation row r). The
// arithmetic of dot32_x8_avx2 lane by lane (the block's exact integer sum, then one fused multiply-add), so the
// two give the same bits.
template <int W>
void dot32_x8_scalar(int R, const uint8_t* w, const ActRows& a, int64_t m, float* out, int64_t ldo) {
    using L = X32<W>;
    const int64_t K = a.K, nb = K / 32;
    for (int r = 0; r < R; r++) {
        const int8_t* q = a.q + (m + r) * K;
        const float* d = a.d + (m + r) * nb;
        const int16_t* isum = a.isum + (m + r) * nb;
        const float* sa = a.s + (m + r) * nb;
        for (int c = 0; c < 8; c++) {
            float acc = 0, accm = 0;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t* blk = w + b * L::bytes;
                uint32_t qh = 0;
                if (L::five) std::memcpy(&qh, blk + L::qh + 4 * c, 4);
                int sumi = 0;
                for (int i = 0; i < 32; i++) {
                    int v;
                    if (W == Q8_0) {
                        v = blk[L::codes + 32 * (i / 4) + 4 * c + i % 4] - L::stored;
                    } else {
                        const int byte = blk[L::codes + 32 * (i % 16 / 4) + 4 * c + i % 4];
                        v = (i < 16 ? byte & 0xF : byte >> 4) | (int)((qh >> q5_bit(i)) & 1) << 4;
                    }
                    sumi += v * q[b * 32 + i];
                }
                sumi -= L::offset * isum[b];
                acc = std::fma(h2f(blk + 2 * c) * d[b], (float)sumi, acc);
                if (L::has_min) accm = std::fma(h2f(blk + 16 + 2 * c), sa[b], accm);
            }
            out[r * ldo + c] = L::has_min ? acc + accm : acc;
        }
    }
}

// Q4_K X8 groups against Q8_K: out[r * ldo + c] = dot(row c of the group, activation row r). The arithmetic of
// x8_kernels.h dot_q4k_x8 row by row (exact integer sums per block, then one fused multiply-add per block), so the two
// give the same bits.
void dot_q4k_x8_scalar(int R, const uint8_t* w, const ActRows& a, int64_t m, float* out, int64_t ldo) {
    const int64_t K = a.K, nb = K / 256;
    for (int r = 0; r < R; r++) {
        const int8_t* q = a.q + (m + r) * K;
        const float* d = a.d + (m + r) * nb;
        const int16_t* isum = a.isum + (m + r) * nb * 24;
        for (int c = 0; c < 8; c++) {
            float acc = 0, accm = 0;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t* blk = w + b * 8 * 144;
                uint8_t scale_bytes[12];
                for (int i = 0; i < 3; i++) std::memcpy(scale_bytes + 4 * i, blk + 32 + 4 * (8 * i + c), 4);
                int sc[8], mn[8];
                q4k_scales(scale_bytes, sc, mn);
                int sumi = 0, summ = 0;
                for (int j = 0; j < 4; j++) {
                    for (int g = 0; g < 8; g++) {
                        for (int i = 0; i < 4; i++) {
                            const int t = 32 * j + 4 * g + i;  // qs byte t of row c: 8-byte unit t / 8 of it
                            const int v = blk[128 + 64 * (t / 8) + 8 * c + t % 8];
                            const int8_t* y = q + b * 256 + 64 * j + 4 * g + i;
                            sumi += sc[2 * j] * (v & 0xF) * y[0] + sc[2 * j + 1] * (v >> 4) * y[32];
                        }
                    }
                }
                for (int s = 0; s < 8; s++) summ += mn[s] * isum[b * 24 + 16 + s];
                acc = std::fma(h2f(blk + 2 * c) * d[b], (float)sumi, acc);
                accm = std::fma(h2f(blk + 16 + 2 * c) * d[b], (float)summ, accm);
            }
            out[r * ldo + c] = acc - accm;
        }
    }
}

// Q6_K X8 groups against Q8_K: out[r * ldo + c] = dot(row c of the group, activation row r). Per block the exact
// integer sum of scale x (codes . activation codes) less 32 x scale x (sums of the activation codes), then one fused
// multiply-add, as x8_kernels.h dot_q6k_x8 computes it, so the two give the same bits.
void dot_q6k_x8_scalar(int R, const uint8_t* w, const ActRows& a, int64_t m, float* out, int64_t ldo) {
    const int64_t K = a.K, nb = K / 256;
    for (int r = 0; r < R; r++) {
        const int8_t* q = a.q + (m + r) * K;
        const float* d = a.d + (m + r) * nb;
        const int16_t* isum = a.isum + (m + r) * nb * 24;
        for (int c = 0; c < 8; c++) {
            float acc = 0;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t* blk = w + b * Q6K_X8::bytes;
                int sumi = 0;
                for (int j = 0; j < 16; j++) {
                    int s = 0;
                    for (int i = 16 * j; i < 16 * j + 16; i++) s += q6k_x8_code(blk, c, i) * q[b * 256 + i];
                    sumi += (int8_t)blk[Q6K_X8::scales + 8 * j + c] * (s - 32 * isum[b * 24 + j]);
                }
                acc = std::fma(h2f(blk + 2 * c) * d[b], (float)sumi, acc);
            }
            out[r * ldo + c] = acc;
        }
    }
}

// ------------------------------------------------------------------------------------------------ AVX2 dots
#if SC_X86

SC_AVX2 inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// fp16 -> float by the F16C instruction: exact, like h2f, but without a load from its 256 KB table, which the
// weights streaming through the cache would keep evicting
SC_AVX2 inline float h2f_avx2(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

SC_AVX2 inline float hsum4(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Q5_K against Q8_K (and Q4_K, which is packed instead: dot_x8_rows)
template <int R, int W>
SC_AVX2 void dot_q45k_avx2(const uint8_t* w, const ActRows& a, const int64_t* rows, float* out) {
    const int64_t K = a.K, nb = K / 256;
    constexpr bool five = W == Q5_K;
    constexpr int bs = five ? 176 : 144;
    __m256 acc[R];
    __m128 accm[R];
    const int8_t* q[R];
    const float* d[R];
    const int16_t* bsum[R];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        accm[r] = _mm_setzero_ps();
        q[r] = a.q + rows[r] * K;
        d[r] = a.d + rows[r] * nb;
        bsum[r] = a.isum + rows[r] * nb * 24 + 16;  // the per-32 sums of block 0
    }
    const __m256i m4 = _mm256_set1_epi8(0xF);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = w + b * bs;
        const float dw = h2f_avx2(blk), dminw = h2f_avx2(blk + 2);
        // 6-bit scales and mins of the 8 sub-blocks, unpacked from 12 bytes into two words of 4 bytes each
        uint32_t v[3];
        std::memcpy(v, blk + 4, 12);
        const uint32_t sc_lo = v[0] & 0x3F3F3F3F, mn_lo = v[1] & 0x3F3F3F3F;
        const uint32_t sc_hi = (v[2] & 0x0F0F0F0F) | ((v[0] >> 6) & 0x03030303) << 4;
        const uint32_t mn_hi = ((v[2] >> 4) & 0x0F0F0F0F) | ((v[1] >> 6) & 0x03030303) << 4;
        // the 8 scales as int16 in both 128-bit halves; sub-block i's scale is picked by a byte shuffle
        const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)sc_hi, (int)sc_lo)));
        const __m128i mins = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)mn_hi, (int)mn_lo));  // 8 x int16
        const uint8_t* qs = blk + 16 + (five ? 32 : 0);
        __m256i hbits;
        if constexpr (five) hbits = _mm256_loadu_si256((const __m256i*)(blk + 16));
        __m256i sumi[R];
        for (int r = 0; r < R; r++) sumi[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {  // 64 values: sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles)
            const __m256i bytes = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(bytes, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m4);
            if constexpr (five) {
                const __m256i one = _mm256_set1_epi8(1);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j + 1), one), 4));
            }
            const __m256i s_lo = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * j))));
            const __m256i s_hi = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * j + 1))));
            for (int r = 0; r < R; r++) {
                const int8_t* y = q[r] + b * 256 + 64 * j;
                const __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)y)), s_lo);
                const __m256i p_hi =
                    _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(y + 32))), s_hi);
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p_lo, p_hi));
            }
        }
        for (int r = 0; r < R; r++) {
            const float da = d[r][b];
            const __m128i pm = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i*)(bsum[r] + b * 24)));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * da), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            accm[r] = _mm_fmadd_ps(_mm_set1_ps(dminw * da), _mm_cvtepi32_ps(pm), accm[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) - hsum4(accm[r]);
}

// float weights (F32, F16) against float rows
template <int R, int W>
SC_AVX2 void dot_float_avx2(const uint8_t* w, const ActRows& a, const int64_t* rows, float* out) {
    const int64_t K = a.K;
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 wv;
        if constexpr (W == F32) wv = _mm256_loadu_ps((const float*)w + k);
        else wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 2 * k)));
        for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(a.x + rows[r] * K + k), acc[r]);
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

SC_AVX2 float dot_f32_avx2(const float* a, const float* b, int n) {
    __m256 acc = _mm256_setzero_ps();
    for (int t = 0; t < n; t += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + t), _mm256_loadu_ps(b + t), acc);
    return hsum8(acc);
}

// e^x for x <= 0 (softmax after the max is subtracted): x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-7 polynomial
// (Cephes' expf coefficients), times 2^n built in the exponent bits. Below -87 the result is ~1e-38, not 0.
SC_AVX2 inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// SiLU-gated values with AVX2, o[j] = silu(g[j]) u[j] for j in [j0, j1): silu(x) = x / (1 + e^-x), and for x < 0
// x e^x / (1 + e^x), so exp8 always gets -|x| (libm's expf, one value at a time, was 5 % of a verify step)
SC_AVX2 void silu_glu_avx2(const float* g, const float* u, float* o, int64_t j0, int64_t j1) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    int64_t j = j0;
    for (; j + 8 <= j1; j += 8) {
        const __m256 x = _mm256_loadu_ps(g + j);
        const __m256 e = exp8(_mm256_or_ps(x, sign));  // e^-|x|
        const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), x);  // x, or x e^x where x's sign bit is set
        _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
    }
    for (; j < j1; j++) o[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
}

constexpr int64_t KEY_BLOCK = 16;  // keys (and values) attend_avx2 keeps in L1 for all heads: 8 KB at 128 dims

// o[8 NV] += sum over keys j0..j1-1 of w[k] v[k] (v's rows hd apart), in key order, the NV vectors in registers (a
// count known when compiled: a runtime one left a compare and branch around every FMA)
template <int NV>
SC_AVX2 inline void add_weighted(const float* w, const float* v, int64_t j0, int64_t j1, int hd, float* o) {
    __m256 acc[NV];
    for (int t = 0; t < NV; t++) acc[t] = _mm256_loadu_ps(o + 8 * t);
    for (int64_t k = j0; k < j1; k++) {
        const __m256 p = _mm256_set1_ps(w[k]);
        for (int t = 0; t < NV; t++) acc[t] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + k * hd + 8 * t), acc[t]);
    }
    for (int t = 0; t < NV; t++) _mm256_storeu_ps(o + 8 * t, acc[t]);
}

// Query heads h = 0..nh-1 of one KV head over its n keys: o_h[hd] = softmax(scale q_h.k_j) . v_j (q_h at q + h q_head,
// o_h at o + h o_head; scores: scratch [nh, n + 1]). The keys and values pass in blocks of KEY_BLOCK that stay in L1
// while every head of the group uses them: a head at a time re-read them from L3 or memory once per head (6 heads
// per KV head on qwen2.5-coder-1.5b: 24 MB a layer at depth 2000; blocks of 64 keys, all of L1, gained less). Per
// head the arithmetic is one head's alone, in the same order (scores 8 keys at a time, 8 independent FMA chains,
// each key's sum in dot_f32_avx2's order; exponentials 8 at a time with a scalar tail that n fixes; the weighted
// sum over the keys in order, 64 output values at a time), so a row's result depends on nothing but its own keys,
// whatever the heads share a call with.
SC_AVX2 void attend_avx2(const float* q, int64_t q_head, int nh, const float* keys, const float* vals, int64_t n,
                         int hd, float scale, float* scores, float* o, int64_t o_head) {
    for (int64_t j0 = 0; j0 < n; j0 += KEY_BLOCK) {
        const int64_t j1 = std::min(n, j0 + KEY_BLOCK);
        for (int h = 0; h < nh; h++) {
            const float* qh = q + h * q_head;
            float* sh = scores + h * (n + 1);
            int64_t j = j0;
            for (; j + 8 <= j1; j += 8) {
                const float* kj = keys + j * hd;
                __m256 acc[8];
                for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
                for (int t = 0; t < hd; t += 8) {
                    const __m256 qt = _mm256_loadu_ps(qh + t);
                    for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qt, _mm256_loadu_ps(kj + i * hd + t), acc[i]);
                }
                for (int i = 0; i < 8; i++) sh[j + i] = hsum8(acc[i]) * scale;
            }
            for (; j < j1; j++) sh[j] = dot_f32_avx2(qh, keys + j * hd, hd) * scale;
        }
    }
    for (int h = 0; h < nh; h++) {  // softmax weights in place, unnormalized; the output starts at zero
        float* sh = scores + h * (n + 1);
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; j++) mx = std::max(mx, sh[j]);
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + j), vmx));
            _mm256_storeu_ps(sh + j, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        float sum = hsum8(vsum);
        for (; j < n; j++) {
            sh[j] = std::exp(sh[j] - mx);
            sum += sh[j];
        }
        sh[n] = 1.0f / sum;  // (scores holds n + 1 values per head)
        std::fill(o + h * o_head, o + h * o_head + hd, 0.0f);
    }
    for (int64_t j0 = 0; j0 < n; j0 += KEY_BLOCK) {
        const int64_t j1 = std::min(n, j0 + KEY_BLOCK);
        for (int h = 0; h < nh; h++) {
            const float* sh = scores + h * (n + 1);
            float* oh = o + h * o_head;
            int d0 = 0;
            for (; d0 + 64 <= hd; d0 += 64) add_weighted<8>(sh, vals + d0, j0, j1, hd, oh + d0);
            for (; d0 < hd; d0 += 8) add_weighted<1>(sh, vals + d0, j0, j1, hd, oh + d0);
        }
    }
    for (int h = 0; h < nh; h++) {
        const __m256 inv = _mm256_set1_ps(scores[h * (n + 1) + n]);
        float* oh = o + h * o_head;
        for (int t = 0; t < hd; t += 8) _mm256_storeu_ps(oh + t, _mm256_mul_ps(_mm256_loadu_ps(oh + t), inv));
    }
}

// the products compiled once per instruction set (x8_kernels.h)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace x8_avx2 {
constexpr bool VNNI = false;
#include "x8_kernels.h"
}  // namespace x8_avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // gcc 12 on the AVX-512 intrinsics' own undefined operands
namespace x8_vnni {
constexpr bool VNNI = true;
#include "x8_kernels.h"
}  // namespace x8_vnni
#pragma GCC diagnostic pop
#pragma GCC pop_options

template <int R>
SC_AVX2 void dot_avx2(int wtype, const uint8_t* w, const ActRows& a, const int64_t* rows, float* out) {
    switch (wtype) {
        case Q5_K: return dot_q45k_avx2<R, Q5_K>(w, a, rows, out);
        case F32: return dot_float_avx2<R, F32>(w, a, rows, out);
        case F16: return dot_float_avx2<R, F16>(w, a, rows, out);
    }
}
// quantize_row with AVX2: the same operations on the same values, so the same codes and scales bit for bit
SC_AVX2 void quantize_row_avx2(int kind, const float* x, int64_t K, int8_t* q, float* d, int16_t* isum, float* s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    if (kind == ACT_Q8_K) {
        for (int64_t b = 0; b < K / 256; b++) {
            const float* xb = x + b * 256;
            int8_t* qb = q + b * 256;
            __m256 mx = _mm256_setzero_ps();
            for (int k = 0; k < 256; k += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + k)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float amax = _mm_cvtss_f32(m4);
            int16_t* bs = isum + b * 24;
            if (amax == 0) {
                d[b] = 0;
                std::memset(qb, 0, 256);
                for (int g = 0; g < 24; g++) bs[g] = 0;
                continue;
            }
            int first = 0;  // the first value of largest magnitude gives the scale its sign
            while (std::fabs(xb[first]) != amax) first++;
            const float iscale = -127.f / xb[first];
            const __m256 m = _mm256_set1_ps(iscale);
            const __m256i hi = _mm256_set1_epi32(127);
            for (int k = 0; k < 256; k += 32) {
                __m256i i[4];
                for (int t = 0; t < 4; t++)
                    i[t] = _mm256_min_epi32(hi, _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + k + 8 * t), m), rnd)));
                const __m256i p = _mm256_permutevar8x32_epi32(
                    _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])), perm);
                _mm256_storeu_si256((__m256i*)(qb + k), p);
                // sums of 16 codes: values k..k+15 are lanes of i[0], i[1]; k+16..k+31 of i[2], i[3]
                const __m256i s01 = _mm256_add_epi32(i[0], i[1]), s23 = _mm256_add_epi32(i[2], i[3]);
                __m128i a = _mm_add_epi32(_mm256_castsi256_si128(s01), _mm256_extracti128_si256(s01, 1));
                __m128i c = _mm_add_epi32(_mm256_castsi256_si128(s23), _mm256_extracti128_si256(s23, 1));
                a = _mm_hadd_epi32(a, c);  // [a0+a1, a2+a3, c0+c1, c2+c3]
                a = _mm_hadd_epi32(a, a);
                bs[k / 16] = (int16_t)_mm_cvtsi128_si32(a);
                bs[k / 16 + 1] = (int16_t)_mm_extract_epi32(a, 1);
            }
            for (int g = 0; g < 8; g++) bs[16 + g] = (int16_t)(bs[2 * g] + bs[2 * g + 1]);
            d[b] = 1 / iscale;
        }
        return;
    }
    for (int64_t b = 0; b < K / 32; b++) {
        const float* xb = x + b * 32;
        __m256 v[4];
        __m256 mx = _mm256_setzero_ps();
        for (int t = 0; t < 4; t++) {
            v[t] = _mm256_loadu_ps(xb + 8 * t);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[t]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float db = amax / 127.f;
        const __m256 m = _mm256_set1_ps(amax != 0.0f ? 127.f / amax : 0.0f);
        __m256i i[4];
        for (int t = 0; t < 4; t++) i[t] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[t], m), rnd));
        const __m256i p = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])), perm);
        _mm256_storeu_si256((__m256i*)(q + b * 32), p);
        __m256i t8 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t8), _mm256_extracti128_si256(t8, 1));
        t4 = _mm_hadd_epi32(t4, t4);
        t4 = _mm_hadd_epi32(t4, t4);
        const int sum = _mm_cvtsi128_si32(t4);
        d[b] = round_half(db);
        isum[b] = (int16_t)sum;
        if (kind == ACT_Q8_1) s[b] = round_half(db * (float)sum);
    }
}
#endif

// R rows of activations (R <= MAX_R) against one weight row
void dot_rows(int R, int wtype, const uint8_t* w, const ActRows& a, const int64_t* rows, float* out) {
#if SC_X86
    if (g_use_avx2) {
        switch (R) {
            case 1: return dot_avx2<1>(wtype, w, a, rows, out);
            case 2: return dot_avx2<2>(wtype, w, a, rows, out);
            case 3: return dot_avx2<3>(wtype, w, a, rows, out);
            case 4: return dot_avx2<4>(wtype, w, a, rows, out);
            case 5: return dot_avx2<5>(wtype, w, a, rows, out);
            case 6: return dot_avx2<6>(wtype, w, a, rows, out);
            case 7: return dot_avx2<7>(wtype, w, a, rows, out);
            default: return dot_avx2<8>(wtype, w, a, rows, out);
        }
    }
#endif
    dot_scalar(R, wtype, w, a, rows, out);
}

// activation rows per pass over a group of 8 packed weight rows: as many as the registers hold
// (AVX-512 has 32 vector registers, AVX2 16); the rows' arithmetic does not depend on it
int register_rows() { return g_use_vnni ? 8 : 4; }

#if SC_X86
template <int R>
void dot_x8_simd(int wtype, const uint8_t* w, const ActRows& a, int64_t m, float* out, int64_t ldo) {
    if (g_use_vnni) return x8_vnni::dot_x8<R>(wtype, w, a, m, out, ldo);
    if constexpr (R <= 4) x8_avx2::dot_x8<R>(wtype, w, a, m, out, ldo);  // (register_rows: never more rows)
}
#endif


// activation rows m .. m + R - 1 (R <= register_rows()) against one group of an X8 segment: out[r * ldo + c]
void dot_x8_rows(int R, int wtype, const uint8_t* w, const ActRows& a, int64_t m, float* out, int64_t ldo) {
#if SC_X86
    if (g_use_avx2) {
        switch (R) {
            case 1: return dot_x8_simd<1>(wtype, w, a, m, out, ldo);
            case 2: return dot_x8_simd<2>(wtype, w, a, m, out, ldo);
            case 3: return dot_x8_simd<3>(wtype, w, a, m, out, ldo);
            case 4: return dot_x8_simd<4>(wtype, w, a, m, out, ldo);
            case 5: return dot_x8_simd<5>(wtype, w, a, m, out, ldo);
            case 6: return dot_x8_simd<6>(wtype, w, a, m, out, ldo);
            case 7: return dot_x8_simd<7>(wtype, w, a, m, out, ldo);
            default: return dot_x8_simd<8>(wtype, w, a, m, out, ldo);
        }
    }
#endif
    switch (wtype - X8) {
        case Q4_0: return dot32_x8_scalar<Q4_0>(R, w, a, m, out, ldo);
        case Q4_1: return dot32_x8_scalar<Q4_1>(R, w, a, m, out, ldo);
        case Q5_0: return dot32_x8_scalar<Q5_0>(R, w, a, m, out, ldo);
        case Q5_1: return dot32_x8_scalar<Q5_1>(R, w, a, m, out, ldo);
        case Q8_0: return dot32_x8_scalar<Q8_0>(R, w, a, m, out, ldo);
        case Q4_K: return dot_q4k_x8_scalar(R, w, a, m, out, ldo);
        case Q6_K: return dot_q6k_x8_scalar(R, w, a, m, out, ldo);
    }
}

// per-thread scratch for quantized activations, reused between calls
struct ActBuffers {
    std::vector<int8_t> q;
    std::vector<int32_t> q6off;
    std::vector<float> d, s;
    std::vector<int16_t> isum;
    std::vector<int8_t> qb;
    std::vector<float> db, sb;
    std::vector<int32_t> isumb;
    std::vector<int16_t> ksumb;
};

// ActRows' block-major arrays from its row-major ones (one row: the same arrays, but for Q8_0/Q8_1's widened sums)
void block_major(ActRows& a, int64_t M, ActBuffers& buf) {
    const bool k = a.kind == ACT_Q8_K;
    const int64_t nb = a.nd(), block = a.K / nb, per = a.ns() / nb;  // per: sums per block
    a.M = M;
    if (!k) {
        buf.isumb.resize(M * nb);
        for (int64_t m = 0; m < M; m++) {
            for (int64_t b = 0; b < nb; b++) buf.isumb[b * M + m] = a.isum[m * nb + b];
        }
        a.isumb = buf.isumb.data();
    }
    if (M == 1) {
        a.qb = a.q; a.db = a.d; a.sb = a.s;
        if (k) a.ksumb = a.isum;
        return;
    }
    buf.qb.resize(M * a.K);
    buf.db.resize(M * nb);
    buf.sb.resize(a.kind == ACT_Q8_1 ? M * nb : 0);
    buf.ksumb.resize(k ? M * nb * per : 0);
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            std::memcpy(&buf.qb[(b * M + m) * block], a.q + m * a.K + b * block, block);
            buf.db[b * M + m] = a.d[m * nb + b];
            if (a.kind == ACT_Q8_1) buf.sb[b * M + m] = a.s[m * nb + b];
            if (k) std::memcpy(&buf.ksumb[(b * M + m) * per], a.isum + (m * nb + b) * per, per * sizeof(int16_t));
        }
    }
    a.qb = buf.qb.data(); a.db = buf.db.data(); a.sb = buf.sb.data();
    if (k) a.ksumb = buf.ksumb.data();
}

ActRows quantize_rows(int kind, const float* x, int64_t M, int64_t K, ActBuffers& buf) {
    ActRows a{kind, K, x, nullptr, nullptr, nullptr, nullptr};
    if (kind == ACT_F32) return a;
    const int64_t nd = a.nd(), ns = a.ns();
    buf.q.resize(M * K);
    buf.d.resize(M * nd);
    buf.isum.resize(M * ns);
    buf.s.resize(kind == ACT_Q8_1 ? M * nd : 0);
    int8_t* q = buf.q.data();
    float* d = buf.d.data();
    int16_t* isum = buf.isum.data();
    float* s = buf.s.data();
    const auto one = [&](int64_t m) {
        float* sm = kind == ACT_Q8_1 ? s + m * nd : nullptr;
#if SC_X86
        if (g_use_avx2) return quantize_row_avx2(kind, x + m * K, K, q + m * K, d + m * nd, isum + m * ns, sm);
#endif
        quantize_row(kind, x + m * K, K, q + m * K, d + m * nd, isum + m * ns, sm);
    };
    // a row per chunk, on every thread: run alone on the caller, 8 rows of 1536 values left the other threads
    // idle for ~2 % of an 8-row 1.5b forward (pool().run runs a single row in place)
    const std::function<void(int64_t)> fn = one;
    pool().run(g_threads, M, fn);
    a.q = q; a.d = d; a.isum = isum; a.s = s;
    if (g_use_avx2) block_major(a, M, buf);
    return a;
}

constexpr int64_t ROW_TILE = 64;  // activation rows kept in cache while a chunk of weight rows passes over them
constexpr int MAX_R = 8;  // activation rows multiplied with one weight row per pass (its unpacking is shared)

}  // namespace

// ------------------------------------------------------------------------------------------------ C API

extern "C" {

int sc_has_avx2() {
#if SC_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

// int8 products per second of the multiply instruction the packed products use (multiply_chains), every kernel
// thread running `rounds` rounds at once; 0 without AVX2
double sc_int8_peak(int64_t rounds) {
#if SC_X86
    if (!g_use_avx2) return 0;
    std::atomic<int64_t> products{0};
    int32_t sinks[64] = {};
    const std::function<void(int64_t)> fn = [&](int64_t t) {
        products += g_use_vnni ? x8_vnni::multiply_chains(rounds, sinks + t % 64)
                               : x8_avx2::multiply_chains(rounds, sinks + t % 64);
    };
    const auto t0 = std::chrono::steady_clock::now();
    pool().run(g_threads, g_threads, fn);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return (double)products.load() / s;
#else
    (void)rounds;
    return 0;
#endif
}

int sc_has_vnni() {
#if SC_X86
    __builtin_cpu_init();
    return sc_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

// isa: 0 = the portable scalar kernels, 1 = AVX2, 2 = AVX2 and AVX-512 VNNI (each where the CPU has it; tests
// compare them)
void sc_init(int n_threads, int isa, int64_t spin_ns) {
    g_threads = std::max(1, n_threads);
    g_use_avx2 = isa >= 1 && sc_has_avx2();
    g_use_vnni = isa >= 2 && sc_has_vnni();
    pool().set_spin_ns(spin_ns);
}

// ActRows::q6off of n sub-blocks of 16 codes (block-major, as qb)
const int32_t* q6_offsets(const int8_t* qb, int64_t n, std::vector<int32_t>& buf) {
    buf.resize(2 * n);
    int32_t* off = buf.data();  // through locals: stores into the vector's data would let its fields alias them
    for (int64_t t = 0; t < n; t++) {
        const int8_t* c = qb + 16 * t;
        int first = 0, second = 0;
        for (int i = 0; i < 4; i++) {
            first += c[i] + c[8 + i];
            second += c[4 + i] + c[12 + i];
        }
        off[2 * t] = -32 * first;
        off[2 * t + 1] = -32 * second;
    }
    return off;
}

// One weight matrix: n_seg segments stacked along the outputs (a fused q|k|v or gate|up), segment i holding n_out[i]
// rows of row_bytes(wtypes[i], K) bytes each; bias [sum n_out] or null. Filled by kernels.LinearDesc (ctypes).
constexpr int MAX_SEG = 8;
struct ScLinear {
    int32_t n_seg;
    int32_t wtypes[MAX_SEG];
    const void* weights[MAX_SEG];
    int64_t n_out[MAX_SEG];
    int64_t K;
    const float* bias;
};

// y[M, ldy] (columns [0, sum n_out)) = x[M, K] times the weights transposed, plus the bias. 0 = done.
int sc_linear(const ScLinear* w, const float* x, int64_t M, float* y, int64_t ldy) {
    const int n_seg = w->n_seg;
    const int* wtypes = w->wtypes;
    const void* const* weights = w->weights;
    const int64_t* n_out = w->n_out;
    const int64_t K = w->K;
    const float* bias = w->bias;
    if (n_seg < 1 || n_seg > MAX_SEG || M < 1) return 1;
    static thread_local ActBuffers bufs[4];
    ActRows acts[4];
    bool have[4] = {false, false, false, false};
    int64_t col0[MAX_SEG + 1], seg_bytes[MAX_SEG];  // first output column and bytes per weight row of each segment
    col0[0] = 0;
    for (int i = 0; i < n_seg; i++) {
        const int kind = act_of(wtypes[i]);
        if (kind < 0 || K % block_size(wtypes[i]) != 0 || K % 32 != 0) return 2;
        if (!have[kind]) { acts[kind] = quantize_rows(kind, x, M, K, bufs[kind]); have[kind] = true; }
        if (wtypes[i] == X8 + Q6_K && g_use_vnni && !acts[kind].q6off) {  // (x8_kernels.h dot_q6k_x8)
            acts[kind].q6off = q6_offsets(acts[kind].qb, M * K / 16, bufs[kind].q6off);
        }
        col0[i + 1] = col0[i] + n_out[i];
        seg_bytes[i] = row_bytes(wtypes[i], K);
    }
    const int64_t N = col0[n_seg];
    // chunks of weight rows, each a share of the rows left (multiples of 8, so that groups of X8 rows fall in one
    // chunk where their segment starts at one): the first long enough to amortize the hand-out, the last short so
    // that the threads finish together (equal chunks of N / 16 left one thread idle for ~3 % of an 8-row forward)
    static thread_local std::vector<int64_t> chunk_starts;
    chunk_starts.assign(1, 0);
    while (chunk_starts.back() < N) {
        const int64_t size = ((N - chunk_starts.back()) / (2 * (int64_t)g_threads) + 7) / 8 * 8;
        chunk_starts.push_back(std::min(N, chunk_starts.back() + std::max<int64_t>(8, size)));
    }
    const int64_t n_chunks = (int64_t)chunk_starts.size() - 1;
    const int64_t* bounds = chunk_starts.data();  // (a lambda naming a thread_local would read its own thread's)
    const std::function<void(int64_t)> fn = [&](int64_t c) {
        const int64_t n0 = bounds[c], n1 = bounds[c + 1];
        int64_t rows[MAX_R];
        float out[MAX_R * 8];
        for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
            const int64_t m1 = std::min(M, m0 + ROW_TILE);
            int seg = 0;
            for (int64_t n = n0; n < n1;) {
                while (n >= col0[seg + 1]) seg++;
                const int wt = wtypes[seg];
                const ActRows& a = acts[act_of(wt)];
                // one weight row, or the group of 8 packed rows holding column n (its columns before n or from n1 on
                // are another chunk's to write, those past the segment's end padding)
                const bool x8 = wt >= X8;
                const int64_t first = x8 ? col0[seg] + (n - col0[seg]) / 8 * 8 : n;
                const int64_t end = x8 ? std::min({n1, first + 8, col0[seg + 1]}) : n + 1;
                const int width = x8 ? 8 : 1, max_r = x8 ? register_rows() : MAX_R;
                const uint8_t* w_at = (const uint8_t*)weights[seg] + (first - col0[seg]) * seg_bytes[seg];
                for (int64_t m = m0; m < m1; m += max_r) {
                    const int R = (int)std::min<int64_t>(max_r, m1 - m);
                    for (int r = 0; r < R; r++) rows[r] = m + r;
                    if (x8 && n == first && end == first + 8) {  // a whole group: the kernel stores into y
                        // (copied through `out`, a store-forwarding stall and a memcpy call per row: ~5 % of a pass)
                        dot_x8_rows(R, wt, w_at, a, m, y + m * ldy + n, ldy);
                        for (int r = 0; r < R && bias; r++) {  // through a local copy: y and bias may alias
                            float v[8];
                            std::memcpy(v, y + (m + r) * ldy + n, sizeof v);
                            for (int j = 0; j < 8; j++) v[j] += bias[n + j];
                            std::memcpy(y + (m + r) * ldy + n, v, sizeof v);
                        }
                        continue;
                    }
                    if (x8) dot_x8_rows(R, wt, w_at, a, m, out, 8);
                    else dot_rows(R, wt, w_at, a, rows, out);
                    for (int r = 0; r < R; r++) {
                        for (int64_t col = n; col < end; col++) {
                            const float v = out[r * width + col - first];
                            y[(m + r) * ldy + col] = bias ? v + bias[col] : v;
                        }
                    }
                }
                n = end;
            }
        }
    };
    pool().run(g_threads, n_chunks, fn);
    return 0;
}

}  // extern "C"

namespace {

// out[D] = x / sqrt(mean(x^2) + eps) * w (ggml's rms_norm then mul: the sum of squares in double); out may be x
void rms_norm_row(const float* x, const float* w, float* out, int64_t D, float eps) {
    double sum = 0.0;
    for (int64_t j = 0; j < D; j++) sum += (double)(x[j] * x[j]);
    const float mean = (float)(sum / (double)D);
    const float scale = 1.0f / std::sqrt(mean + eps);
    for (int64_t j = 0; j < D; j++) out[j] = (x[j] * scale) * w[j];
}

// rotate the first rope_dim values of x by the angles of one table row (cos, sin [rope_dim / 2]); neox pairs i with
// i + rope_dim / 2, "norm" pairs 2i with 2i + 1
void rope_row(float* x, const float* cos, const float* sin, int rope_dim, bool neox) {
    const int half = rope_dim / 2;
    for (int i = 0; i < half; i++) {
        float* a = neox ? x + i : x + 2 * i;
        float* b = neox ? x + i + half : x + 2 * i + 1;
        const float x1 = *a, x2 = *b;
        *a = x1 * cos[i] - x2 * sin[i];
        *b = x2 * cos[i] + x1 * sin[i];
    }
}

}  // namespace

extern "C" {

// out[n, D] = x / sqrt(mean(x^2) + eps) * w per row
void sc_rms_norm(const float* x, const float* w, float* out, int64_t n, int64_t D, float eps) {
    // a row per chunk: the sum in double is one dependent chain per row (~2 us for 1536 values)
    const std::function<void(int64_t)> fn = [&](int64_t i) { rms_norm_row(x + i * D, w, out + i * D, D, eps); };
    pool().run(g_threads, n, fn);
}

// The rows of a fused q|k|v product [R, ld] made ready for attention: each head of q and k normed (when q_norm /
// k_norm are given, per head_dim) and rotated by its row's position (rope tables [n_pos, rope_dim / 2]); q goes to
// q_out [R, n_head, head_dim], k and v of the rows with row_write[r] into the caches [n_seq, n_kv_head, n_ctx,
// head_dim] at (row_seq[r], row_pos[r]). Rows without the flag (padding) are never written.
void sc_qkv_prep(const float* qkv, int64_t ld, int64_t R, int n_head, int n_kv_head, int head_dim,
                 const float* q_norm, const float* k_norm, float eps, const float* rope_cos, const float* rope_sin,
                 int rope_dim, int neox, const int64_t* row_seq, const int64_t* row_pos, const uint8_t* row_write,
                 float* k_cache, float* v_cache, int64_t n_ctx, float* q_out) {
    const int half = rope_dim / 2;
    for (int64_t r = 0; r < R; r++) {
        const float* src = qkv + r * ld;
        const float* cs = rope_cos + row_pos[r] * half;
        const float* sn = rope_sin + row_pos[r] * half;
        for (int h = 0; h < n_head; h++) {
            float* dst = q_out + (r * n_head + h) * head_dim;
            std::memcpy(dst, src + h * head_dim, sizeof(float) * head_dim);
            if (q_norm) rms_norm_row(dst, q_norm, dst, head_dim, eps);
            rope_row(dst, cs, sn, rope_dim, neox);
        }
        if (!row_write[r]) continue;
        for (int h = 0; h < n_kv_head; h++) {
            const int64_t cell = ((row_seq[r] * n_kv_head + h) * n_ctx + row_pos[r]) * head_dim;
            float* kd = k_cache + cell;
            std::memcpy(kd, src + (n_head + h) * head_dim, sizeof(float) * head_dim);
            if (k_norm) rms_norm_row(kd, k_norm, kd, head_dim, eps);
            rope_row(kd, cs, sn, rope_dim, neox);
            std::memcpy(v_cache + cell, src + (n_head + n_kv_head + h) * head_dim, sizeof(float) * head_dim);
        }
    }
}

// Causal attention of n_rows query rows over the static KV cache, one (row, head) at a time.
// q: row r, head h at q + r * q_row + h * q_head ([head_dim] contiguous); k/v cache [n_seq, n_kv_head, n_ctx,
// head_dim]; row r of sequence row_seq[r] at position row_pos[r] attends to keys [lo, row_pos[r]] with lo = 0, or
// row_pos[r] - window + 1 when window > 0. out [n_rows, n_head * head_dim]. The scores, their softmax and the
// weighted sum run over the keys in ascending order, so a row's result depends on nothing but its own keys.
void sc_attention(const float* q, int64_t q_row, int64_t q_head, int64_t n_rows, int n_head, int n_kv_head,
                  int head_dim, const float* k_cache, const float* v_cache, int64_t n_ctx, const int64_t* row_seq,
                  const int64_t* row_pos, int64_t window, float scale, float* out) {
    const int group = n_head / n_kv_head;
    const bool avx2 = g_use_avx2 && head_dim % 8 == 0;
    // a work item: one row's query heads of one KV head (attend_avx2 reads the keys once for them), the group split
    // in parts where rows x KV heads would leave threads idle
    const int64_t pairs = n_rows * n_kv_head;
    const int parts = (int)std::min<int64_t>(group, std::max<int64_t>(1, (g_threads + pairs - 1) / pairs));
    const int per = (group + parts - 1) / parts;
    const int64_t items = pairs * parts;
    const std::function<void(int64_t)> fn = [&](int64_t item) {
        static thread_local std::vector<float> scores;
        const int64_t r = item / (n_kv_head * parts);
        const int hk = (int)(item / parts % n_kv_head), h0 = hk * group + (int)(item % parts) * per;
        const int nh = std::min(per, (hk + 1) * group - h0);
        const int64_t pos = row_pos[r];
        const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        const int64_t n = pos - lo + 1;
        const int64_t base = (row_seq[r] * n_kv_head + hk) * n_ctx;
        const float* keys = k_cache + (base + lo) * head_dim;
        const float* vals = v_cache + (base + lo) * head_dim;
        const float* q0 = q + r * q_row + h0 * q_head;
        float* o0 = out + r * (int64_t)n_head * head_dim + (int64_t)h0 * head_dim;
        scores.resize(nh * (n + 1));
#if SC_X86
        if (avx2) return attend_avx2(q0, q_head, nh, keys, vals, n, head_dim, scale, scores.data(), o0, head_dim);
#endif
        for (int h = 0; h < nh; h++) {
            const float* qv = q0 + h * q_head;
            float* o = o0 + h * head_dim;
            float mx = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                const float* kj = keys + j * head_dim;
                float s = 0;
                for (int t = 0; t < head_dim; t++) s += qv[t] * kj[t];
                s *= scale;
                scores[j] = s;
                mx = std::max(mx, s);
            }
            float sum = 0;
            for (int64_t j = 0; j < n; j++) {
                scores[j] = std::exp(scores[j] - mx);
                sum += scores[j];
            }
            for (int t = 0; t < head_dim; t++) o[t] = 0;
            for (int64_t j = 0; j < n; j++) {
                const float* vj = vals + j * head_dim;
                for (int t = 0; t < head_dim; t++) o[t] = std::fma(scores[j], vj[t], o[t]);
            }
            const float inv = 1.0f / sum;
            for (int t = 0; t < head_dim; t++) o[t] *= inv;
        }
    };
    pool().run(items >= 2 ? g_threads : 1, items, fn);
}

// out[n, F] = act(gate) * up with gate_up [n, ld] holding gate in columns [0, F) and up in [F, 2F);
// act 0 = SiLU (x / (1 + e^-x)), 1 = GELU with the tanh approximation (as ggml_gelu computes it in float)
void sc_glu(const float* gate_up, int64_t ld, int64_t n, int64_t F, int act, float* out) {
    constexpr int64_t SPAN = 1024;  // columns per work item: one row's activation is split between the threads too
    const int64_t spans = (F + SPAN - 1) / SPAN;
    const std::function<void(int64_t)> fn = [&](int64_t item) {
        const int64_t i = item / spans, j0 = item % spans * SPAN, j1 = std::min(F, j0 + SPAN);
        const float* g = gate_up + i * ld;
        const float* u = g + F;
        float* o = out + i * F;
        if (act == 0) {
#if SC_X86
            if (g_use_avx2) return silu_glu_avx2(g, u, o, j0, j1);
#endif
            for (int64_t j = j0; j < j1; j++) o[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
        } else {
            const float c = 0.7978845608028654f;  // sqrt(2 / pi)
            for (int64_t j = j0; j < j1; j++) {
                const float x = g[j];
                o[j] = 0.5f * x * (1.0f + std::tanh(c * x * (1.0f + 0.044715f * x * x))) * u[j];
            }
        }
    };
    pool().run(g_threads, n * spans, fn);
}

// One decoder block (model.Block) in one call, so a decode step costs one Python round trip per layer rather than
// ten: the same entry points in the same order as the Python composition of them, hence the same bits.
struct ScBlock {
    int64_t n_embd, n_ff;
    int32_t n_head, n_kv_head, head_dim, rope_dim, neox, gelu;
    float eps, attn_scale;
    int64_t window;  // sliding window of this layer's attention (0 = none)
    const float* attn_norm;
    const float* ffn_norm;
    const float* post_attn_norm;  // null where the model has no post-norms (all but gemma3)
    const float* post_ffn_norm;
    const float* q_norm;  // null without q/k norms (qwen3 and gemma3 have them)
    const float* k_norm;
    ScLinear qkv, wo, gate_up, down;
};

// out[R, D] = x + attn(norm(x)) followed by out += ffn(norm(out)) (each branch post-normed where the block has
// post-norms). Rows, rope tables and caches as for sc_qkv_prep / sc_attention. 0 = done.
int sc_block(const ScBlock* b, const float* x, int64_t R, const float* rope_cos, const float* rope_sin,
             const int64_t* row_seq, const int64_t* row_pos, const uint8_t* row_write, float* k_cache,
             float* v_cache, int64_t n_ctx, float* out) {
    static thread_local std::vector<float> scratch;
    const int64_t D = b->n_embd, F = b->n_ff, hd = b->head_dim;
    const int64_t n_q = b->n_head * hd, n_qkv = (b->n_head + 2 * (int64_t)b->n_kv_head) * hd;
    const int64_t wide = std::max(n_qkv, 2 * F);  // qkv rows, later gate|up rows
    scratch.resize(R * (D + wide + n_q + std::max(n_q, F) + D));
    float* xn = scratch.data();  // [R, D] normed input of a branch
    float* big = xn + R * D;  // [R, wide]
    float* q = big + R * wide;  // [R, n_q]
    float* mid = q + R * n_q;  // [R, max(n_q, F)]: attention output, later the GLU output
    float* h = mid + R * std::max(n_q, F);  // [R, D]: a branch's output
    const auto add_branch = [&](const float* post_norm, const float* base) {
        if (post_norm) sc_rms_norm(h, post_norm, h, R, D, b->eps);
        for (int64_t i = 0; i < R * D; i++) out[i] = base[i] + h[i];
    };
    int rc;
    sc_rms_norm(x, b->attn_norm, xn, R, D, b->eps);
    if ((rc = sc_linear(&b->qkv, xn, R, big, n_qkv))) return rc;
    sc_qkv_prep(big, n_qkv, R, b->n_head, b->n_kv_head, b->head_dim, b->q_norm, b->k_norm, b->eps, rope_cos,
                rope_sin, b->rope_dim, b->neox, row_seq, row_pos, row_write, k_cache, v_cache, n_ctx, q);
    sc_attention(q, n_q, hd, R, b->n_head, b->n_kv_head, b->head_dim, k_cache, v_cache, n_ctx, row_seq, row_pos,
                 b->window, b->attn_scale, mid);
    if ((rc = sc_linear(&b->wo, mid, R, h, D))) return rc;
    add_branch(b->post_attn_norm, x);
    sc_rms_norm(out, b->ffn_norm, xn, R, D, b->eps);
    if ((rc = sc_linear(&b->gate_up, xn, R, big, 2 * F))) return rc;
    sc_glu(big, 2 * F, R, F, b->gelu, mid);
    if ((rc = sc_linear(&b->down, mid, R, h, D))) return rc;
    add_branch(b->post_ffn_norm, out);
    return 0;
}

// Every decoder block of a step in turn, in place on x [R, D] (the model's loop in one call: the Python around a
// call per block cost ~1 ms per token on smollm2-135m's 30 blocks). Block i attends with the rope table of its kind
// (swa[i]: 1 = the sliding-window layers' base) over its caches k_caches[i], v_caches[i]; sc_block reads its input
// only before it writes its output, so each block runs in place. Target features on request: where tap_slot is
// given ([n + 1] int32, -1 = not tapped), the input of block i (i = n: the last block's output) is copied to slot
// tap_slot[i] of taps [R, n_taps, D] -- a copy of R x D floats per tapped layer, nothing when no layer is. 0 = done.
int sc_blocks(int n, const ScBlock* const* blocks, const uint8_t* swa, float* x, int64_t R,
              const float* const* rope_cos, const float* const* rope_sin, const int64_t* row_seq,
              const int64_t* row_pos, const uint8_t* row_write, float* const* k_caches, float* const* v_caches,
              int64_t n_ctx, const int32_t* tap_slot, float* taps, int64_t n_taps) {
    const auto tap = [&](int layer) {
        if (!tap_slot || tap_slot[layer] < 0) return;
        const int64_t D = blocks[0]->n_embd;
        for (int64_t r = 0; r < R; r++)
            std::memcpy(taps + (r * n_taps + tap_slot[layer]) * D, x + r * D, D * sizeof(float));
    };
    for (int i = 0; i < n; i++) {
        tap(i);
        const int rc = sc_block(blocks[i], x, R, rope_cos[swa[i]], rope_sin[swa[i]], row_seq, row_pos, row_write,
                                k_caches[i], v_caches[i], n_ctx, x);
        if (rc) return rc;
    }
    tap(n);
    return 0;
}

// The fields of a block in the order of its X8 layout: (offset in the row's block, bytes, unit). A group block
// holds each field of the 8 rows in turn, unit u of row c at the field's start + (8 u + c) x unit.
struct Field { int offset, bytes, unit; };
const std::vector<Field>* x8_fields(int wtype) {
    static const std::vector<Field> q4_0{{0, 2, 2}, {2, 16, 4}}, q4_1{{0, 2, 2}, {2, 2, 2}, {4, 16, 4}},
        q5_0{{0, 2, 2}, {2, 4, 4}, {6, 16, 4}}, q5_1{{0, 2, 2}, {2, 2, 2}, {4, 4, 4}, {8, 16, 4}},
        q8_0{{0, 2, 2}, {2, 32, 4}}, q4_k{{0, 2, 2}, {2, 2, 2}, {4, 12, 4}, {16, 128, 8}},
        q6_k{{208, 2, 2}, {192, 16, 1}};  // and the codes, rebuilt by pack_q6k_codes
    switch (wtype) {
        case Q4_0: return &q4_0;
        case Q4_1: return &q4_1;
        case Q5_0: return &q5_0;
        case Q5_1: return &q5_1;
        case Q8_0: return &q8_0;
        case Q4_K: return &q4_k;
        case Q6_K: return &q6_k;
        default: return nullptr;
    }
}

// the 6-bit codes of 8 Q6_K blocks (row c's at rows + c * stride) into a Q6_K X8 group block's runs (Q6K_X8). A row's
// codes are decoded once, then placed 8 at a time: values 8 m .. 8 m + 7 sit in consecutive bytes of both runs, at
// the same shifts (q6k_x8_slot). Value per value through the slot map, this was a third of a 1.5b's load time.
void pack_q6k_codes(const uint8_t* rows, int64_t stride, uint8_t* block) {
    std::memset(block + Q6K_X8::nibbles, 0, Q6K_X8::bytes - Q6K_X8::nibbles);
    for (int c = 0; c < 8; c++) {
        const uint8_t* src = rows + c * stride;
        uint8_t code[256];
        // ggml's order: per half h of 128 values, value 128 h + 32 k + l takes its low nibble from ql byte
        // 64 h + l + 32 (k % 2) (k >= 2: the high nibble) and its high bits from qh byte 32 h + l at bits 2 k
        for (int h = 0; h < 2; h++) {
            for (int k = 0; k < 4; k++) {
                const uint8_t* ql = src + 64 * h + 32 * (k % 2);
                const uint8_t* qh = src + 128 + 32 * h;
                uint8_t* out = code + 128 * h + 32 * k;
                for (int l = 0; l < 32; l++) out[l] = (ql[l] >> (4 * (k / 2)) & 0xF) | (qh[l] >> (2 * k) & 3) << 4;
            }
        }
        for (int m = 0; m < 32; m++) {
            const Q6KSlot at = q6k_x8_slot(c, 8 * m);
            for (int u = 0; u < 8; u++) {
                block[at.nib + u] |= (code[8 * m + u] & 0xF) << at.nib_shift;
                block[at.high + u] |= (code[8 * m + u] >> 4) << at.high_shift;
            }
        }
    }
}

// rows src [N, row_bytes] of a type listed at X8 -> dst [ceil(N / 8) * 8, row_bytes] in its X8 layout, the rows
// past N zeros. 0 = done, 1 = a type without an X8 layout.
int sc_pack_x8(int wtype, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
    const std::vector<Field>* fields = x8_fields(wtype);
    if (!fields) return 1;
    const int64_t bs = row_bytes(wtype, block_size(wtype)), nb = K / block_size(wtype), rb = nb * bs;
    const std::function<void(int64_t)> fn = [&](int64_t group) {
        const uint8_t* rows = src + 8 * group * rb;
        std::vector<uint8_t> last;  // the last group's rows, padded with zero rows
        if (8 * (group + 1) > N) {
            last.assign(8 * rb, 0);
            std::memcpy(last.data(), rows, (N - 8 * group) * rb);
            rows = last.data();
        }
        for (int64_t b = 0; b < nb; b++) {
            uint8_t* const block = dst + (group * nb + b) * 8 * bs;
            uint8_t* o = block;
            for (const Field& f : *fields) {
                for (int c = 0; c < 8; c++) {
                    const uint8_t* from = rows + c * rb + b * bs + f.offset;
                    for (int u = 0; u < f.bytes / f.unit; u++) std::memcpy(o + (8 * u + c) * f.unit, from + u * f.unit, f.unit);
                }
                o += 8 * f.bytes;
            }
            if (wtype == Q6_K) pack_q6k_codes(rows + b * bs, rb, block);
            if (wtype == Q8_0) {  // signed codes -> unsigned (mod 256)
                for (int i = 0; i < 256; i++) block[X32<Q8_0>::codes + i] += X32<Q8_0>::stored;
            }
            if (wtype == Q5_0 || wtype == Q5_1) {  // the qh words' bits in q5_bit's order
                uint8_t* words = block + (wtype == Q5_0 ? X32<Q5_0>::qh : X32<Q5_1>::qh);
                for (int c = 0; c < 8; c++) {
                    uint32_t qh, moved = 0;
                    std::memcpy(&qh, words + 4 * c, 4);
                    for (int i = 0; i < 32; i++) moved |= (qh >> i & 1u) << q5_bit(i);
                    std::memcpy(words + 4 * c, &moved, 4);
                }
            }
        }
    };
    pool().run(g_threads, (N + 7) / 8, fn);
    return 0;
}

// ggml-style activation quantization of one row, for tests: codes [K] int8, d [K / block], isum, s
void sc_quantize_row(int kind, const float* x, int64_t K, int8_t* q, float* d, int16_t* isum, float* s) {
    quantize_row(kind, x, K, q, d, isum, s);
}

}  // extern "C"
