// The products with rows packed 8 at a time (kernels.cpp X8) for one instruction set: included by
// kernels.cpp once per set, inside a namespace and a `#pragma GCC target` region, with VNNI true where the AVX-512
// VNNI instructions vpdpbusd (bytes times bytes summed in 32-bit lanes) and vpdpwssd (int16 pairs likewise) replace
// AVX2's vpmaddubsw + vpmaddwd pairs and vpmaddwd + vpaddd.
// Every sum is an exact integer sum, so both sets give the same bits (and the same as the scalar twins).

// acc + in each 32-bit lane the sum of the 4 products of unsigned bytes u and signed bytes y (AVX2: the pairs'
// int16 sums cannot saturate, 2 x 255 x 127 > 2^15 never happens for the codes here, at most 2 x 127 x 127)
template <bool V = VNNI>
inline __m256i dot4(__m256i acc, __m256i u, __m256i y) {
    if constexpr (V) return _mm256_dpbusd_epi32(acc, u, y);
    else return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, y), _mm256_set1_epi16(1)));
}

// acc + in each 32-bit lane the sum of the 2 products of its int16 pairs (vpdpwssd; AVX2 vpmaddwd + vpaddd)
inline __m256i dot2(__m256i acc, __m256i a, __m256i b) {
    if constexpr (VNNI) return _mm256_dpwssd_epi32(acc, a, b);
    else return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}

// in each 32-bit lane: the sum over k < N of its int16 pair in pairs[k] times (sums[2 k], sums[2 k + 1])
template <int N>
inline __m256i pair_products(const __m256i* pairs, const int16_t* sums) {
    __m256i acc = _mm256_setzero_si256();
    for (int k = 0; k < N; k++) {
        int32_t two;
        std::memcpy(&two, sums + 2 * k, 4);
        acc = dot2(acc, pairs[k], _mm256_set1_epi32(two));
    }
    return acc;
}

// For 2 or more activation rows, ask for the weight bytes PF_BYTES ahead of the block a kernel is at (the cache lines
// of [blk + PF_BYTES, blk + PF_BYTES + n)) into L2: their arithmetic otherwise ran after each memory stall instead of
// during it. 28 x 1536 x 8960 matrices streamed from memory, 2 threads, ms for 1 / 2 / 4 / 8 rows: Q6_K
// 9.5 / 18-22 / 25 / 36 -> 9.5 / 9-10 / 13.5-14.5 / 24, Q4_K 6.5 / 7.7 / 12.5-13 / 17.5 -> 6.5 / 6.5-7 / 6.5 / 11.4
// (into L1 2 KB ahead: 2 rows 13 and 7.3); one row keeps up on the hardware prefetchers alone, except over Q6_K's
// X8 blocks (the nibble and high-bit runs read as two streams): one thread, 64 MB, 8.6 GB/s without, 29-33 with
// (the file's layout had read 23.7). Prefetches past the
// weights' end fault nothing.
constexpr int PF_BYTES = 8192;
template <int n>
inline void prefetch_ahead(const uint8_t* blk) {
    for (int l = 0; l < n; l += 64) _mm_prefetch((const char*)blk + PF_BYTES + l, _MM_HINT_T1);
}

// bit j of each byte of qh's X8 words (kernels.cpp q5_bit: run g's low nibbles at j = 2 g, high ones at 2 g + 1)
// as bit 4 of the byte: the fifth bit of that byte's Q5 codes (one shift and one mask; j is a constant once unrolled)
inline __m256i fifth_bits(__m256i qh, int j) {
    const __m256i moved = j < 4 ? _mm256_slli_epi32(qh, 4 - j) : _mm256_srli_epi32(qh, j - 4);
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}

// X8 groups of a 32-value block type against Q8_0/Q8_1 (R activation rows), lane c = row c. Codes
// multiply as unsigned bytes (Q8_0: magnitudes, the signs moved to the activations) and the block's offset comes
// off the exact integer sum as offset x (sum of the activation codes).
template <int R, int W>
void dot32_x8(const uint8_t* w, const ActRows& a, int64_t m, float* out, int64_t ldo) {
    using L = X32<W>;
    __m256 acc[R], accm[R];
    for (int r = 0; r < R; r++) acc[r] = accm[r] = _mm256_setzero_ps();
    // block b of activation row m + r: ActRows' block-major arrays at [b][m + r], one pointer each for all the rows
    const int64_t M = a.M, nb = a.K / 32;
    const int8_t* q = a.qb + m * 32;
    const float* d = a.db + m;
    const int32_t* isum = a.isumb + m;
    const float* sa = L::has_min ? a.sb + m : nullptr;
    const __m256i m4 = _mm256_set1_epi8(0xF), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = w + b * L::bytes;
        if constexpr (R > 1) prefetch_ahead<L::bytes>(blk);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
        __m256i sumi[R];
        for (int r = 0; r < R; r++) sumi[r] = _mm256_setzero_si256();
        if constexpr (W == Q8_0) {  // codes stored + 128: VNNI multiplies them as they are, AVX2 signs them back
            static_assert(L::stored == 128);
            for (int g = 0; g < 8; g++) {
                const __m256i wu = _mm256_loadu_si256((const __m256i*)(blk + L::codes + 32 * g));
                const __m256i wv = _mm256_xor_si256(wu, _mm256_set1_epi8((char)0x80));  // - 128 (mod 256)
                const __m256i w_abs = _mm256_sign_epi8(wv, wv);
                for (int r = 0; r < R; r++) {
                    int32_t y;
                    std::memcpy(&y, q + 32 * r + 4 * g, 4);
                    if constexpr (VNNI) sumi[r] = dot4(sumi[r], wu, _mm256_set1_epi32(y));
                    else sumi[r] = dot4(sumi[r], w_abs, _mm256_sign_epi8(_mm256_set1_epi32(y), wv));
                }
            }
        } else {
            __m256i qh;
            if constexpr (L::five) qh = _mm256_loadu_si256((const __m256i*)(blk + L::qh));
            __m256i p[R];  // AVX2: int16 sums of up to 4 products of codes < 32 or 8 of codes < 16: below 2^15
            for (int r = 0; r < R; r++) p[r] = _mm256_setzero_si256();
            for (int g = 0; g < 4; g++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i*)(blk + L::codes + 32 * g));
                __m256i lo = _mm256_and_si256(bytes, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m4);
                if constexpr (L::five) {
                    lo = _mm256_or_si256(lo, fifth_bits(qh, 2 * g));
                    hi = _mm256_or_si256(hi, fifth_bits(qh, 2 * g + 1));
                }
                for (int r = 0; r < R; r++) {
                    int32_t y_lo, y_hi;
                    std::memcpy(&y_lo, q + 32 * r + 4 * g, 4);
                    std::memcpy(&y_hi, q + 32 * r + 16 + 4 * g, 4);
                    if constexpr (VNNI) {
                        sumi[r] = dot4(dot4(sumi[r], lo, _mm256_set1_epi32(y_lo)), hi, _mm256_set1_epi32(y_hi));
                        continue;
                    }
                    p[r] = _mm256_add_epi16(p[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(y_lo)),
                                                                   _mm256_maddubs_epi16(hi, _mm256_set1_epi32(y_hi))));
                    if (L::five && g % 2 == 1) {
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p[r], ones));
                        p[r] = _mm256_setzero_si256();
                    }
                }
            }
            if constexpr (!L::five && !VNNI) {
                for (int r = 0; r < R; r++) sumi[r] = _mm256_madd_epi16(p[r], ones);
            }
        }
        for (int r = 0; r < R; r++) {
            constexpr int offset = L::offset + (VNNI ? L::stored : 0);  // AVX2 multiplies Q8_0's signed back
            static_assert((offset & (offset - 1)) == 0, "a power of two");
            if constexpr (offset != 0) {  // a broadcast from memory and a shift (a scalar multiply and a move from a
                constexpr int shift = __builtin_ctz(offset);  // general register to a vector cost ~5 % of a pass)
                sumi[r] = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(_mm256_set1_epi32(isum[r]), shift));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(d[r])), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            if constexpr (L::has_min) {
                const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16)));
                accm[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sa[r]), accm[r]);
            }
        }
        q += 32 * M; d += M; isum += M;
        if constexpr (L::has_min) sa += M;
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * ldo, L::has_min ? _mm256_add_ps(acc[r], accm[r]) : acc[r]);
}

// From per-128-bit-lane sums laid out as the VNNI Q4_K and Q6_K products leave them (lane L: rows 2L, 2L + 1 of one
// part of the block, then the same rows of the other part): each row's two parts added, rows 0..7 in order
inline __m256i rows_in_order(__m512i sums) {
    const __m512i in_order = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13);
    const __m512i rows2 = _mm512_add_epi32(sums, _mm512_shuffle_epi32(sums, _MM_PERM_BADC));
    return _mm512_castsi512_si256(_mm512_permutexvar_epi32(in_order, rows2));
}

// byte s (0..3) of each 32-bit lane of v, as the lane's int16 pair (byte, byte): vpmaddwd sums the pair's two
// int16 products into the lane (the AVX2 Q4_K product)
inline __m256i lane_byte(__m256i v, int s) {
    const __m256i pair = _mm256_setr_epi8(0, -128, 0, -128, 4, -128, 4, -128, 8, -128, 8, -128, 12, -128, 12, -128,
                                          0, -128, 0, -128, 4, -128, 4, -128, 8, -128, 8, -128, 12, -128, 12, -128);
    return _mm256_shuffle_epi8(v, _mm256_add_epi8(pair, _mm256_set1_epi8((char)s)));  // -128 + s: still 0
}

// For the VNNI Q4_K product, per sub-block pair (2 s, 2 s + 1) with s = 0 or 1 (the pair's place in its four):
// indices into the scales as int16 (word 4 c + t: row c's sub-block t) that give, in each 128-bit lane L, the
// scales of _mm512_packs_epi32(p_lo, p_hi)'s words there: rows 2L, 2L + 1 (a lane pair each) of sub-block 2 s,
// then of sub-block 2 s + 1
struct PairScales { alignas(64) int16_t words[2][32]; };
constexpr PairScales q4k_pair_scales() {
    PairScales p{};
    for (int s = 0; s < 2; s++) {
        for (int i = 0; i < 32; i++) {
            const int L = i / 8, w = i % 8, row = 2 * L + (w / 2) % 2;
            p.words[s][i] = (int16_t)(4 * row + 2 * s + (w < 4 ? 0 : 1));
        }
    }
    return p;
}
inline constexpr PairScales Q4K_PAIR_SCALES = q4k_pair_scales();

// Q4_K X8 groups against Q8_K (R activation rows). The codes come in 64-byte runs of 8 bytes per row (row c at
// 8 c), so in 32-bit lanes row c is the lane pair (2c, 2c + 1), 4 consecutive codes each, and one 8-byte
// broadcast of activation codes serves all the rows in a vector: with AVX-512 a run is one vector (16 lanes, the
// 8 rows); with AVX2 two (rows 0..3, rows 4..7). On Zen 4 a broadcast takes a vector slot: a ymm vpdpbusd (32
// products) issues every 0.29 ns alone but every 0.55 ns with a 4-byte broadcast each (the former 4-byte runs), a
// zmm one (64 products) every 0.55 ns alone and 0.60 ns with an 8-byte broadcast each. A 62 MB Q4_K matrix, one
// thread: 1 / 4 / 8 activation rows 1.9-2.2 / 4.5-6.1 / 9.5-10.1 ms before, 1.7-1.8 / 3.8 / 8.4 ms with 8-byte runs.
// A lane's byte products within a sub-block (16 of them) add up exactly in int16 (16 x 15 x 128 < 2^15), then
// one multiply by the row's sub-block scale (AVX2: vpmaddwd per sub-block, the lane pairs meeting at the end of
// the block; VNNI: the two sub-blocks of a step packed into one vector of int16 and one vpdpwssd for both, which
// adds each lane pair too); the block's integer sum meets the float scales once. Integer sums are exact, so every
// form gives the bits of the scalar twin.
template <int R>
void dot_q4k_x8(const uint8_t* w, const ActRows& a, int64_t m, float* out, int64_t ldo) {
    const int64_t M = a.M, nb = a.K / 256;
    __m256 acc[R], accm[R];
    for (int r = 0; r < R; r++) acc[r] = accm[r] = _mm256_setzero_ps();
    // block b of activation row m + r: ActRows' block-major arrays at [b][m + r], one pointer each for all the rows
    const int8_t* q = a.qb + m * 256;
    const float* d = a.db + m;
    const int16_t* bsum = a.ksumb + m * 24 + 16;  // the per-32 sums
    const __m256i m4 = _mm256_set1_epi8(0xF), m6 = _mm256_set1_epi8(0x3F), m2 = _mm256_set1_epi8(0x03);
    // bytes 0, 1 (2, 3) of each 32-bit lane as the lane's int16 pair
    const __m256i first = _mm256_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1,
                                           0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1);
    const __m256i second = _mm256_add_epi8(first, _mm256_setr_epi8(2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0,
                                                                   2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0));
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = w + b * 8 * 144;
        if constexpr (R > 1) prefetch_ahead<8 * 144>(blk);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
        const __m256 dminw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16)));
        const __m256i v0 = _mm256_loadu_si256((const __m256i*)(blk + 32));
        const __m256i v1 = _mm256_loadu_si256((const __m256i*)(blk + 64));
        const __m256i v2 = _mm256_loadu_si256((const __m256i*)(blk + 96));
        // q4k_scales for 8 rows at once: bytes 0..3 of a lane are its sub-blocks 0..3 (lo) or 4..7 (hi)
        const __m256i sc_lo = _mm256_and_si256(v0, m6), mn_lo = _mm256_and_si256(v1, m6);
        const __m256i sc_hi = _mm256_or_si256(_mm256_and_si256(v2, m4),
                                              _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(v0, 6), m2), 4));
        const __m256i mn_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v2, 4), m4),
                                              _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(v1, 6), m2), 4));
        // the mins as int16 pairs (m0, m1), (m2, m3), (m4, m5), (m6, m7) per lane
        const __m256i mn[4] = {_mm256_shuffle_epi8(mn_lo, first), _mm256_shuffle_epi8(mn_lo, second),
                               _mm256_shuffle_epi8(mn_hi, first), _mm256_shuffle_epi8(mn_hi, second)};
        __m256i sumi[R];  // per row lane: the block's sum of scale x sub-block sum
        if constexpr (VNNI) {
            const __m512i m4w = _mm512_set1_epi8(0xF);
            // the scales as int16: sc_words[h] word 4 c + t is row c's sub-block 4 h + t
            const __m512i sc_words[2] = {_mm512_cvtepu8_epi16(sc_lo), _mm512_cvtepu8_epi16(sc_hi)};
            __m512i sum2[R];  // per 128-bit lane L: rows 2L, 2L + 1 of sub-block 2j, then of sub-block 2j + 1
            for (int r = 0; r < R; r++) sum2[r] = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {  // sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles)
                __m512i lo[4], hi[4];  // their 32 values of the 8 rows, unpacked once for all activation rows
                for (int g = 0; g < 4; g++) {
                    const __m512i bytes = _mm512_loadu_si512((const void*)(blk + 128 + 256 * j + 64 * g));
                    lo[g] = _mm512_and_si512(bytes, m4w);
                    hi[g] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), m4w);
                }
                const __m512i pick = _mm512_load_si512(Q4K_PAIR_SCALES.words[j % 2]);
                const __m512i scale = _mm512_permutexvar_epi16(pick, sc_words[j / 2]);
                for (int r = 0; r < R; r++) {
                    const int8_t* y = q + 256 * r + 64 * j;
                    __m512i p_lo = _mm512_setzero_si512(), p_hi = _mm512_setzero_si512();
                    for (int g = 0; g < 4; g++) {
                        int64_t y_lo, y_hi;
                        std::memcpy(&y_lo, y + 8 * g, 8);
                        std::memcpy(&y_hi, y + 32 + 8 * g, 8);
                        p_lo = _mm512_dpbusd_epi32(p_lo, lo[g], _mm512_set1_epi64(y_lo));
                        p_hi = _mm512_dpbusd_epi32(p_hi, hi[g], _mm512_set1_epi64(y_hi));
                    }
                    // both sub-blocks' sums as int16 (exact: |sum| <= 16 x 15 x 128 < 2^15), then one multiply by
                    // the scales that also adds each row's lane pair
                    sum2[r] = _mm512_dpwssd_epi32(sum2[r], _mm512_packs_epi32(p_lo, p_hi), scale);
                }
            }
            for (int r = 0; r < R; r++) sumi[r] = rows_in_order(sum2[r]);  // sub-blocks 2j + sub-blocks 2j + 1
        } else {
            // each row's scale bytes in both lanes of its pair: rows 0..3 (a), rows 4..7 (b)
            const __m256i dup_a = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
            const __m256i dup_b = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
            const __m256i sc_a[2] = {_mm256_permutevar8x32_epi32(sc_lo, dup_a),
                                     _mm256_permutevar8x32_epi32(sc_hi, dup_a)};
            const __m256i sc_b[2] = {_mm256_permutevar8x32_epi32(sc_lo, dup_b),
                                     _mm256_permutevar8x32_epi32(sc_hi, dup_b)};
            __m256i sum_a[R], sum_b[R];  // lane pairs of rows 0..3, of rows 4..7
            for (int r = 0; r < R; r++) sum_a[r] = sum_b[r] = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                // int16 sums of sub-blocks 2j (l) and 2j + 1 (h), rows 0..3 (a) and 4..7 (b); a run at a time (16
                // registers hold no more: the unpacked run, its activation bytes and 4 sums per activation row)
                __m256i la[R], lb[R], ha[R], hb[R];
                for (int r = 0; r < R; r++) la[r] = lb[r] = ha[r] = hb[r] = _mm256_setzero_si256();
                for (int g = 0; g < 4; g++) {
                    const uint8_t* run = blk + 128 + 256 * j + 64 * g;
                    const __m256i bytes_a = _mm256_loadu_si256((const __m256i*)run);
                    const __m256i bytes_b = _mm256_loadu_si256((const __m256i*)(run + 32));
                    const __m256i lo_a = _mm256_and_si256(bytes_a, m4), lo_b = _mm256_and_si256(bytes_b, m4);
                    const __m256i hi_a = _mm256_and_si256(_mm256_srli_epi16(bytes_a, 4), m4);
                    const __m256i hi_b = _mm256_and_si256(_mm256_srli_epi16(bytes_b, 4), m4);
                    for (int r = 0; r < R; r++) {
                        const int8_t* y = q + 256 * r + 64 * j + 8 * g;
                        int64_t y_lo, y_hi;
                        std::memcpy(&y_lo, y, 8);
                        std::memcpy(&y_hi, y + 32, 8);
                        const __m256i yl = _mm256_set1_epi64x(y_lo), yh = _mm256_set1_epi64x(y_hi);
                        la[r] = _mm256_add_epi16(la[r], _mm256_maddubs_epi16(lo_a, yl));
                        lb[r] = _mm256_add_epi16(lb[r], _mm256_maddubs_epi16(lo_b, yl));
                        ha[r] = _mm256_add_epi16(ha[r], _mm256_maddubs_epi16(hi_a, yh));
                        hb[r] = _mm256_add_epi16(hb[r], _mm256_maddubs_epi16(hi_b, yh));
                    }
                }
                const int k = j / 2, s_l = (2 * j) % 4, s_h = (2 * j + 1) % 4;
                const __m256i s_la = lane_byte(sc_a[k], s_l), s_ha = lane_byte(sc_a[k], s_h);
                const __m256i s_lb = lane_byte(sc_b[k], s_l), s_hb = lane_byte(sc_b[k], s_h);
                for (int r = 0; r < R; r++) {
                    sum_a[r] = _mm256_add_epi32(sum_a[r], _mm256_add_epi32(_mm256_madd_epi16(la[r], s_la),
                                                                           _mm256_madd_epi16(ha[r], s_ha)));
                    sum_b[r] = _mm256_add_epi32(sum_b[r], _mm256_add_epi32(_mm256_madd_epi16(lb[r], s_lb),
                                                                           _mm256_madd_epi16(hb[r], s_hb)));
                }
            }
            for (int r = 0; r < R; r++) {  // pairs summed: rows 0 1 4 5 | 2 3 6 7, then in order
                sumi[r] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(sum_a[r], sum_b[r]), _MM_SHUFFLE(3, 1, 2, 0));
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256i summ = pair_products<4>(mn, bsum + 24 * r);  // the mins times the per-32 sums
            const __m256 da = _mm256_set1_ps(d[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            accm[r] = _mm256_fmadd_ps(_mm256_mul_ps(dminw, da), _mm256_cvtepi32_ps(summ), accm[r]);
        }
        q += 256 * M; d += M; bsum += 24 * M;
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * ldo, _mm256_sub_ps(acc[r], accm[r]));
}

// Q6_K X8 groups (kernels.cpp Q6K_X8) against Q8_K (R activation rows). The integer block sum is that of scale x
// (codes - 32) . (activation codes) over the 16 sub-blocks of 16 values.
// VNNI: a run's 8 bytes per row (codes 0..63, unsigned) times one 8-byte activation broadcast each (vpdpbusd), two
// runs per sub-block, so that lane 2 c holds row c's values 0..3 and 8..11 of the sub-block and lane 2 c + 1 values
// 4..7 and 12..15. Each lane starts from -32 x the sum of its 8 activation codes (ActRows::q6off, a broadcast), so
// it ends at the sum of (weight code - 32) x (activation code) over its 8 values, |sum| <= 8 x 32 x 127 < 2^15
// (activation codes are within +-127): two sub-blocks' lanes are packed into one vector of int16 and multiplied by
// the scales with one vpdpwssd, which also adds each lane pair. 5 multiply instructions per 256 products (vpmaddubsw
// pairs added as int16 and a vpdpwssd per sub-block took 6, plus a copy of the activation codes + 128 and a constant
// of the weights per row and block to take the + 128 off again).
// AVX2: per sub-block the two 8-byte runs times their broadcasts (vpmaddubsw: int16 sums of 2 products), added (4
// products, |sum| <= 4 x 63 x 128 < 2^15) and multiplied by the rows' scales (vpmaddwd + vpaddd, 4 rows a vector);
// the -32 comes off per block as 32 x the scales times the activation's sums of 16 (q6k_offsets).
// Exact integer sums throughout: every form gives the scalar twin's bits.

// a Q6_K X8 block's high bits of the values at bits 2 k, 2 k + 1 of each byte, moved to bits 4 and 5 (k a constant)
template <class V>
inline V q6k_high(V high, int k) {
    if constexpr (sizeof(V) == 64) {
        const V moved = k < 2 ? _mm512_slli_epi16(high, 4 - 2 * k) : k == 2 ? high : _mm512_srli_epi16(high, 2);
        return _mm512_and_si512(moved, _mm512_set1_epi8(0x30));
    } else {
        const V moved = k < 2 ? _mm256_slli_epi16(high, 4 - 2 * k) : k == 2 ? high : _mm256_srli_epi16(high, 2);
        return _mm256_and_si256(moved, _mm256_set1_epi8(0x30));
    }
}

// per activation row r: off[r] lane c = sum over the block's 16 sub-blocks j of scale(row c, j) x (the activation's
// sum of the 16 codes of j, at bsum + 24 r), from the scales as int16 pairs of sub-blocks (2 p, 2 p + 1), row c in
// lane c
template <int R>
inline void q6k_offsets(const uint8_t* blk, const int16_t* bsum, __m256i* off) {
    __m256i pair[8];
    for (int p = 0; p < 8; p++) {
        const __m128i s = _mm_loadu_si128((const __m128i*)(blk + Q6K_X8::scales + 16 * p));
        pair[p] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s, _mm_srli_si128(s, 8)));
    }
    for (int r = 0; r < R; r++) off[r] = pair_products<8>(pair, bsum + 24 * r);
}

// sum[h][r] += the scaled sums of sub-block t for rows 4 h .. 4 h + 3 (AVX2: lane l is row 4 h + l / 2), activation
// row r's block at y + 256 r
template <int R>
inline void q6k_subblock_avx2(const uint8_t* blk, int t, const int8_t* y, __m256i (*sum)[R]) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i scales = _mm256_broadcastsi128_si256(
        _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)(blk + Q6K_X8::scales + 8 * t))));
    for (int h = 0; h < 2; h++) {
        const __m256i nib = _mm256_loadu_si256((const __m256i*)(blk + Q6K_X8::nibbles + 64 * t + 32 * h));
        const __m256i high = _mm256_loadu_si256((const __m256i*)(blk + Q6K_X8::high + 64 * (t / 2) + 32 * h));
        const __m256i v1 = _mm256_or_si256(_mm256_and_si256(nib, m4), q6k_high(high, 2 * (t % 2)));
        const __m256i v2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nib, 4), m4),
                                           q6k_high(high, 2 * (t % 2) + 1));
        // word w: the scale of row 4 h + w / 4 (both 128-bit halves hold the 8 rows' scales)
        const char a = (char)(8 * h), b = (char)(8 * h + 2), c = (char)(8 * h + 4), e = (char)(8 * h + 6);
        const __m256i pick = _mm256_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, b, b + 1, b, b + 1, b, b + 1, b,
                                              b + 1, c, c + 1, c, c + 1, c, c + 1, c, c + 1, e, e + 1, e, e + 1, e,
                                              e + 1, e, e + 1);
        const __m256i sc = _mm256_shuffle_epi8(scales, pick);
        for (int r = 0; r < R; r++) {
            int64_t y1, y2;
            std::memcpy(&y1, y + 256 * r + 16 * t, 8);
            std::memcpy(&y2, y + 256 * r + 16 * t + 8, 8);
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(v1, _mm256_set1_epi64x(y1)),
                                               _mm256_maddubs_epi16(v2, _mm256_set1_epi64x(y2)));
            sum[h][r] = _mm256_add_epi32(sum[h][r], _mm256_madd_epi16(p, sc));
        }
    }
}

// For the VNNI Q6_K product, per pair of sub-blocks (t, t + 1): indices into their scales as int16 (word i < 8: row
// i of sub-block t, else row i - 8 of t + 1) that give, in each 128-bit lane L, the scales of
// _mm512_packs_epi32(p_t, p_t1)'s words there: rows 2L, 2L + 1 (a lane pair each) of sub-block t, then of t + 1
struct PairRows { alignas(64) int16_t words[32]; };
constexpr PairRows q6k_pair_rows() {
    PairRows p{};
    for (int i = 0; i < 32; i++) {
        const int L = i / 8, w = i % 8;
        p.words[i] = (int16_t)((w < 4 ? 0 : 8) + 2 * L + (w % 4) / 2);
    }
    return p;
}
inline constexpr PairRows Q6K_PAIR_ROWS = q6k_pair_rows();

template <int R>
void dot_q6k_x8(const uint8_t* w, const ActRows& a, int64_t m, float* out, int64_t ldo) {
    const int64_t M = a.M, nb = a.K / 256;
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    // block b of activation row m + r: ActRows' block-major arrays at [b][m + r], one pointer each for all the rows
    const int8_t* y = a.qb + m * 256;
    const float* d = a.db + m;
    const int16_t* bsum = a.ksumb + m * 24;  // the per-16 sums
    const int32_t* off = VNNI ? a.q6off + m * 32 : nullptr;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = w + b * Q6K_X8::bytes;
        prefetch_ahead<Q6K_X8::bytes>(blk);  // one row too (see PF_BYTES)
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
        __m256i sumi[R];  // lane c: row c
        if constexpr (VNNI) {
            const __m512i m4 = _mm512_set1_epi8(0xF), pick = _mm512_load_si512(Q6K_PAIR_ROWS.words);
            __m512i sum[R];  // per 128-bit lane L: rows 2L, 2L + 1 of the even sub-blocks, then of the odd ones
            for (int r = 0; r < R; r++) sum[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int t = 0; t < 16; t += 2) {  // unrolled: the high bits' shifts are constants
                __m512i v[2][2];  // the codes (0..63) of sub-blocks t, t + 1: values 0..7 and 8..15 of each
                const __m512i high = _mm512_loadu_si512((const void*)(blk + Q6K_X8::high + 32 * t));
                for (int u = 0; u < 2; u++) {
                    const __m512i nib = _mm512_loadu_si512((const void*)(blk + Q6K_X8::nibbles + 64 * (t + u)));
                    v[u][0] = _mm512_or_si512(_mm512_and_si512(nib, m4), q6k_high(high, 2 * u));
                    v[u][1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(nib, 4), m4),
                                              q6k_high(high, 2 * u + 1));
                }
                const __m256i s16 =
                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + Q6K_X8::scales + 8 * t)));
                const __m512i sc = _mm512_permutexvar_epi16(pick, _mm512_castsi256_si512(s16));
                for (int r = 0; r < R; r++) {
                    __m512i p[2];  // lane 2 c: row c's values 0..3 and 8..11 of the sub-block, 2 c + 1: 4..7, 12..15
                    for (int u = 0; u < 2; u++) {
                        int64_t y1, y2, o;
                        std::memcpy(&y1, y + 256 * r + 16 * (t + u), 8);
                        std::memcpy(&y2, y + 256 * r + 16 * (t + u) + 8, 8);
                        std::memcpy(&o, off + 32 * r + 2 * (t + u), 8);
                        p[u] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_set1_epi64(o), v[u][0],
                                                                       _mm512_set1_epi64(y1)),
                                                   v[u][1], _mm512_set1_epi64(y2));
                    }
                    sum[r] = _mm512_dpwssd_epi32(sum[r], _mm512_packs_epi32(p[0], p[1]), sc);
                }
            }
            for (int r = 0; r < R; r++) sumi[r] = rows_in_order(sum[r]);  // even sub-blocks + odd ones
        } else {
            __m256i off16[R], sum[2][R];
            q6k_offsets<R>(blk, bsum, off16);
            for (int r = 0; r < R; r++) sum[0][r] = sum[1][r] = _mm256_setzero_si256();
#pragma GCC unroll 16
            for (int t = 0; t < 16; t++) q6k_subblock_avx2<R>(blk, t, y, sum);  // unrolled: constant shifts
            for (int r = 0; r < R; r++) {  // lane pairs summed: rows 0 1 4 5 | 2 3 6 7, then in order
                const __m256i pairs = _mm256_hadd_epi32(sum[0][r], sum[1][r]);
                sumi[r] = _mm256_sub_epi32(_mm256_permute4x64_epi64(pairs, _MM_SHUFFLE(3, 1, 2, 0)),
                                           _mm256_slli_epi32(off16[r], 5));
            }
        }
        for (int r = 0; r < R; r++) {
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(d[r])), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
        y += 256 * M; d += M; bsum += 24 * M;
        if constexpr (VNNI) off += 32 * M;
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

template <int R>
void dot_x8(int wtype, const uint8_t* w, const ActRows& a, int64_t m, float* out, int64_t ldo) {
    switch (wtype - X8) {
        case Q4_0: return dot32_x8<R, Q4_0>(w, a, m, out, ldo);
        case Q4_1: return dot32_x8<R, Q4_1>(w, a, m, out, ldo);
        case Q5_0: return dot32_x8<R, Q5_0>(w, a, m, out, ldo);
        case Q5_1: return dot32_x8<R, Q5_1>(w, a, m, out, ldo);
        case Q8_0: return dot32_x8<R, Q8_0>(w, a, m, out, ldo);
        case Q4_K: return dot_q4k_x8<R>(w, a, m, out, ldo);
        case Q6_K: return dot_q6k_x8<R>(w, a, m, out, ldo);
    }
}

// The int8 multiply rate these products are measured against: n rounds of 16 independent chains of the instruction
// that multiplies bytes (VNNI: vpdpbusd, 64 products; AVX2: vpmaddubsw, 32, its pairs added as int16). Returns the
// products done; the lanes' sum goes to *sink so that nothing is optimized away.
inline int64_t multiply_chains(int64_t n, int32_t* sink) {
    constexpr int C = 16;
    if constexpr (VNNI) {
        __m512i acc[C], u = _mm512_set1_epi8(3);
        const __m512i y = _mm512_set1_epi8(5);
        for (int i = 0; i < C; i++) acc[i] = _mm512_set1_epi32(i);
        for (int64_t k = 0; k < n; k++) {
#pragma GCC unroll 16
            for (int i = 0; i < C; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], u, y);
            __asm__ volatile("" : "+v"(u));  // a new u each round: the chains stay in the loop
        }
        for (int i = 1; i < C; i++) acc[0] = _mm512_add_epi32(acc[0], acc[i]);
        *sink = _mm512_reduce_add_epi32(acc[0]);
        return n * C * 64;
    } else {
        __m256i acc[C], u = _mm256_set1_epi8(3);
        const __m256i y = _mm256_set1_epi8(5);
        for (int i = 0; i < C; i++) acc[i] = _mm256_set1_epi16((short)i);
        for (int64_t k = 0; k < n; k++) {
#pragma GCC unroll 16
            for (int i = 0; i < C; i++) acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(u, y));
            __asm__ volatile("" : "+x"(u));
        }
        for (int i = 1; i < C; i++) acc[0] = _mm256_add_epi16(acc[0], acc[i]);
        *sink = _mm256_extract_epi16(acc[0], 0);
        return n * C * 32;
    }
}

