// The rotary-embedding math, shared by the rope kernel (ops.cu) and the fused
// RoPE + KV append (attention.cu) so that both give the same bits.
#pragma once

namespace duet::cuda::detail {

// Rotates pair i (of rot_dim / 2 = half) of one head's row v, in place, for position
// p: angle p * inv_freq[i] reduced mod 2 pi in double (as the CPU does); pairs
// (2i, 2i+1) ("normal") or (i, i + half) (neox).
__device__ inline void rope_pair(float* v, int i, int half, double p, const float* inv_freq, bool neox) {
    constexpr double kTwoPi = 6.283185307179586476925286766559;
    double th = p * static_cast<double>(inv_freq[i]);
    th -= kTwoPi * nearbyint(th / kTwoPi);
    const float a = static_cast<float>(th);
    const float c = cosf(a), s = sinf(a);
    const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
    const float x0 = v[i0], x1 = v[i1];
    v[i0] = x0 * c - x1 * s;
    v[i1] = x0 * s + x1 * c;
}

}  // namespace duet::cuda::detail
