#include "kernels/cuda/device.h"

#include <cctype>

#include <cuda_runtime.h>

#include <string>

namespace duet::cuda {

namespace {

__global__ void iota_kernel(int* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = i * 3 + 1;
}

}  // namespace

int device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();  // clear the sticky "no device" error
        return 0;
    }
    return n;
}

std::string device_name(int device) {
    cudaDeviceProp p{};
    cudaError_t e = cudaGetDeviceProperties(&p, device);
    if (e != cudaSuccess) return cudaGetErrorString(e);
    return std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
           std::to_string(p.totalGlobalMem >> 30) + " GiB)";
}

std::string pci_bus_id(int device) {
    char id[32] = {};
    if (cudaDeviceGetPCIBusId(id, sizeof id, device) != cudaSuccess) {
        cudaGetLastError();
        return "";
    }
    std::string s(id);
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
}

bool smoke_test(int device, std::string* error) {
    const int n = 1000;
    int* d = nullptr;
    int h[n];
    auto fail = [&](cudaError_t e) {
        if (error) *error = cudaGetErrorString(e);
        if (d) cudaFree(d);
        return false;
    };
    cudaError_t e;
    if ((e = cudaSetDevice(device)) != cudaSuccess) return fail(e);
    if ((e = cudaMalloc(&d, n * sizeof(int))) != cudaSuccess) return fail(e);
    iota_kernel<<<(n + 255) / 256, 256>>>(d, n);
    if ((e = cudaGetLastError()) != cudaSuccess) return fail(e);
    if ((e = cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost)) != cudaSuccess) return fail(e);
    cudaFree(d);
    for (int i = 0; i < n; ++i)
        if (h[i] != i * 3 + 1) {
            if (error) *error = "kernel wrote a wrong value at " + std::to_string(i);
            return false;
        }
    return true;
}

}  // namespace duet::cuda
