// GPU decoder of ddo-codec's encoded bf16 units (format version 1; the format and the lane
// scheme are documented in ddo-codec's format.rs and encode.rs). Compiled by NVRTC with
// ops/kernels.rs's PRELUDE in front; launched by ops/codec.rs, which parses and validates
// the unit's header on the host and passes the section offsets as arguments.
//
// One warp decodes one chunk of 4,096 words, a lane per interleaved stream lane:
//  - each block first copies the unit's decode table (2^lut_bits u16 entries,
//    `len << 8 | exponent`) into shared memory, and each warp copies its chunk's stream
//    (at most 3,072 16-bit words) into shared memory with 16-byte loads;
//  - at step t lane j owns words 128t + 4j .. +4: it reads their 4 sign+mantissa bytes as
//    one u32 (8 steps' worth loaded ahead), decodes 4 exponents, and writes the 4 words
//    as one u64 (a warp writes 256 contiguous bytes per step);
//  - a lane refills its 32-bit bit buffer with the chunk stream's next 16-bit word when
//    the code it looks up is longer than its valid bits; the refilling lanes of a sub-step
//    take consecutive words in lane order (ballot + popc), exactly as the encoder laid
//    them out.
// Corrupt input cannot make it read or write out of bounds: stream reads are clamped to
// the chunk's span, table lookups are masked, and every output word is written once.
// Defects it sees set bits in the status word (CODEC_BAD_*): a lookup no code starts with,
// a chunk whose stream is not consumed exactly or leaves non-zero padding bits, and (when
// verifying) a checksum that differs from the header's.
//
// Scratch (16 bytes, zero before the first launch): u64 checksum sum, u32 blocks done,
// u32 status. With `verify`, each lane hashes the u64s it writes (ddo-codec's hash.rs:
// xxHash64 rounds per lane, fmix64 of each lane's state summed over all lanes of all
// chunks); the last block to finish compares the checksum, ORs CODEC_BAD_CHECKSUM into the
// status on a mismatch and resets the sum and the block count, so the scratch is ready for
// the next launch. The status is sticky until the caller clears it.

#define CODEC_CHUNK 4096
#define CODEC_WARPS 4
#define CODEC_MAX_STREAM 3072
#define CODEC_STAGE (CODEC_MAX_STREAM + 16)
#define CODEC_PREFETCH 8

#define CODEC_BAD_CODE 1u
#define CODEC_BAD_STREAM 2u
#define CODEC_BAD_CHECKSUM 4u

#define CODEC_P1 0x9E3779B185EBCA87ull
#define CODEC_P2 0xC2B2AE3D27D4EB4Full
#define CODEC_P4 0x85EBCA77C2B2AE63ull
#define CODEC_P5 0x27D4EB2F165667C5ull

__device__ __forceinline__ u64 codec_round(u64 s, u64 v) {
    s += v * CODEC_P2;
    s = (s << 31) | (s >> 33);
    return s * CODEC_P1;
}

__device__ __forceinline__ u64 codec_fmix(u64 x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ull;
    return x ^ (x >> 33);
}

// Decodes the unit at `unit` (16-byte aligned) into `out` (8-byte aligned, 2 * words
// bytes). `raw`: the unit stores its words as they are at `mant_off`.
extern "C" __global__ void __launch_bounds__(128)
ddo_codec_decode(const unsigned char* unit, u16* out, u64 words, u64 lut_off, int lut_bits,
                 u64 chunk_off, u64 mant_off, u64 stream_off, int raw, u64* scratch,
                 int verify, u64 expected) {
    __shared__ __align__(16) u16 lut[4096];
    __shared__ __align__(16) u16 stage[CODEC_WARPS][CODEC_STAGE];
    __shared__ int last_block;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32* done = (u32*)(scratch + 1);
    u32* status = done + 1;
    u32 flags = 0;

    if (!raw) {
        const u32 entries = 1u << lut_bits;
        if (entries >= 8) {
            const uint4* src = (const uint4*)(unit + lut_off);
            for (u32 i = threadIdx.x; i < entries / 8; i += blockDim.x) ((uint4*)lut)[i] = src[i];
        } else {
            const u16* src = (const u16*)(unit + lut_off);
            for (u32 i = threadIdx.x; i < entries; i += blockDim.x) lut[i] = src[i];
        }
    }
    __syncthreads();

    const u32 mask = (1u << lut_bits) - 1;
    const u64 chunks = (words + CODEC_CHUNK - 1) / CODEC_CHUNK;
    u64 sum = 0;
    for (u64 c = (u64)blockIdx.x * CODEC_WARPS + warp; c < chunks;
         c += (u64)gridDim.x * CODEC_WARPS) {
        const u64 cbase = c * CODEC_CHUNK;
        const u32 cw = (u32)min((u64)CODEC_CHUNK, words - cbase);
        u16* o = out + cbase;
        u64 h = (c * 32 + lane + 1) * CODEC_P1;
        if (raw) {
            const u16* src = (const u16*)(unit + mant_off) + cbase;
            for (u32 w0 = lane * 4; w0 < cw; w0 += 128) {
                u64 v = 0;
                if (w0 + 4 <= cw) {
                    v = *(const u64*)(src + w0);
                    *(u64*)(o + w0) = v;
                } else {
                    for (u32 r = 0; w0 + r < cw; ++r) {
                        u16 x = src[w0 + r];
                        o[w0 + r] = x;
                        v |= (u64)x << (16 * r);
                    }
                }
                h = codec_round(h, v);
            }
        } else {
            const u32* table = (const u32*)(unit + chunk_off);
            const u32 begin = table[c], end = table[c + 1];
            u32 slen = end - begin;
            if (end < begin || slen > CODEC_MAX_STREAM) {
                flags |= CODEC_BAD_STREAM;
                slen = 0;
            }
            // The chunk's stream into shared memory: 16-byte loads from the 16-byte
            // boundary at or before its start (the stream section starts and ends on one).
            const u32 first = begin & ~7u;
            const u32 shift = begin - first;
            const uint4* src = (const uint4*)(unit + stream_off) + first / 8;
            u16* st = stage[warp];
            const u32 vecs = (shift + slen + 7) / 8;
            for (u32 i = lane; i < vecs; i += 32) ((uint4*)st)[i] = src[i];
            __syncwarp();
            const u32* mant = (const u32*)(unit + mant_off + cbase);
            const u32 below = (1u << lane) - 1;
            u32 buf = 0, bits = 0, pos = 0;
            for (u32 t0 = 0; t0 * 128 < cw; t0 += CODEC_PREFETCH) {
                u32 mb[CODEC_PREFETCH];
#pragma unroll
                for (u32 k = 0; k < CODEC_PREFETCH; ++k) {
                    const u32 w0 = (t0 + k) * 128 + lane * 4;
                    mb[k] = w0 < cw ? mant[w0 >> 2] : 0;
                }
#pragma unroll
                for (u32 k = 0; k < CODEC_PREFETCH; ++k) {
                    const u32 t = t0 + k;
                    if (t * 128 >= cw) break;
                    const u32 w0 = t * 128 + lane * 4;
                    const u32 have = w0 < cw ? min(4u, cw - w0) : 0;
                    u64 v = 0;
#pragma unroll
                    for (u32 r = 0; r < 4; ++r) {
                        const bool active = r < have;
                        u32 e = lut[buf & mask];
                        u32 len = e >> 8;
                        const bool need = active && len > bits;
                        const u32 ballot = __ballot_sync(0xffffffffu, need);
                        if (need) {
                            const u32 idx = pos + __popc(ballot & below);
                            const u32 w = idx < slen ? st[shift + idx] : 0;
                            if (idx >= slen) flags |= CODEC_BAD_STREAM;
                            buf |= w << bits;
                            bits += 16;
                            e = lut[buf & mask];
                            len = e >> 8;
                        }
                        pos += __popc(ballot);
                        if (active) {
                            if (len == 0) flags |= CODEC_BAD_CODE;
                            buf >>= len;
                            bits -= len;
                            const u32 m = (mb[k] >> (8 * r)) & 0xffu;
                            const u32 word = ((m & 0x80u) << 8) | ((e & 0xffu) << 7) | (m & 0x7fu);
                            v |= (u64)word << (16 * r);
                        }
                    }
                    if (have == 4) {
                        *(u64*)(o + w0) = v;
                    } else {
                        for (u32 r = 0; r < have; ++r) o[w0 + r] = (u16)(v >> (16 * r));
                    }
                    if (have) h = codec_round(h, v);
                }
            }
            if (pos != slen || buf != 0) flags |= CODEC_BAD_STREAM;
            __syncwarp();
        }
        sum += codec_fmix(h);
    }
    if (flags) atomicOr(status, flags);
    if (!verify) return;

    // Every lane's part of the checksum, one atomic per warp; the last block finishes.
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0 && sum != 0) atomicAdd((unsigned long long*)scratch, (unsigned long long)sum);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last_block = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (last_block && threadIdx.x == 0) {
        __threadfence();
        const u64 total = atomicAdd((unsigned long long*)scratch, 0ull);
        const u64 checksum = codec_fmix(total ^ (words * CODEC_P5) ^ CODEC_P4);
        if (checksum != expected) atomicOr(status, CODEC_BAD_CHECKSUM);
        atomicExch((unsigned long long*)scratch, 0ull);
        atomicExch(done, 0u);
    }
}

// Zeroes a decode's scratch (16 bytes) on the stream: before its first decode, and to clear
// a status the caller has read.
extern "C" __global__ void ddo_codec_scratch_clear(u64* scratch) {
    if (blockIdx.x == 0 && threadIdx.x < 2) scratch[threadIdx.x] = 0;
}
