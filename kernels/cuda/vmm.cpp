#include "kernels/cuda/vmm.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdint>

namespace duet::cuda {

namespace {

// The driver functions this file uses, fetched once from the runtime.
struct Driver {
    decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
    decltype(&cuMemCreate) create = nullptr;
    decltype(&cuMemRelease) release = nullptr;
    decltype(&cuMemExportToShareableHandle) export_handle = nullptr;
    decltype(&cuMemImportFromShareableHandle) import_handle = nullptr;
    decltype(&cuMemAddressReserve) reserve = nullptr;
    decltype(&cuMemAddressFree) address_free = nullptr;
    decltype(&cuMemMap) map = nullptr;
    decltype(&cuMemUnmap) unmap = nullptr;
    decltype(&cuMemSetAccess) set_access = nullptr;
    decltype(&cuGetErrorString) error_string = nullptr;
    decltype(&cuDeviceGet) device_get = nullptr;
    decltype(&cuDeviceGetAttribute) attribute = nullptr;
    decltype(&cuDeviceTotalMem) total_mem = nullptr;
    std::string error;  // why loading failed
};

template <typename F>
bool load(const char* name, F* fn, std::string* error) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !p) {
        *error = std::string("driver entry point ") + name + ": " + (e != cudaSuccess ? cudaGetErrorString(e) : "not found");
        return false;
    }
    *fn = reinterpret_cast<F>(p);
    return true;
}

const Driver& driver() {
    static const Driver d = [] {
        Driver x;
        std::string* err = &x.error;
        (void)(load("cuMemGetAllocationGranularity", &x.granularity, err) && load("cuMemCreate", &x.create, err) &&
               load("cuMemRelease", &x.release, err) &&
               load("cuMemExportToShareableHandle", &x.export_handle, err) &&
               load("cuMemImportFromShareableHandle", &x.import_handle, err) &&
               load("cuMemAddressReserve", &x.reserve, err) && load("cuMemAddressFree", &x.address_free, err) &&
               load("cuMemMap", &x.map, err) && load("cuMemUnmap", &x.unmap, err) &&
               load("cuMemSetAccess", &x.set_access, err) && load("cuGetErrorString", &x.error_string, err) &&
               load("cuDeviceGet", &x.device_get, err) && load("cuDeviceGetAttribute", &x.attribute, err) &&
               load("cuDeviceTotalMem", &x.total_mem, err));
        return x;
    }();
    return d;
}

bool ok(CUresult r, const char* what, std::string* error) {
    if (r == CUDA_SUCCESS) return true;
    if (error) {
        const char* s = nullptr;
        if (driver().error_string) driver().error_string(r, &s);
        *error = std::string(what) + ": " + (s ? s : "CUDA error " + std::to_string(static_cast<int>(r)));
    }
    return false;
}

bool ready(int device, std::string* error) {
    if (!driver().error.empty()) {
        if (error) *error = driver().error;
        return false;
    }
    const cudaError_t e = cudaSetDevice(device);  // also makes the primary context current
    if (e != cudaSuccess) {
        cudaGetLastError();  // reported here, not by the caller's next launch check
        if (error) *error = std::string("cudaSetDevice: ") + cudaGetErrorString(e);
        return false;
    }
    return true;
}

CUmemAllocationProp props(int device) {
    CUmemAllocationProp p{};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = device;
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    return p;
}

}  // namespace

size_t vmm_granularity(int device, std::string* error) {
    if (!ready(device, error)) return 0;
    const CUmemAllocationProp p = props(device);
    size_t g = 0;
    if (!ok(driver().granularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity", error))
        return 0;
    return g;
}

size_t device_total_memory(int device, std::string* why) {
    const Driver& d = driver();
    if (!d.error.empty()) {
        if (why) *why = d.error;
        return 0;
    }
    CUdevice dev = 0;
    size_t bytes = 0;
    if (!ok(d.device_get(&dev, device), "cuDeviceGet", why) || !ok(d.total_mem(&bytes, dev), "cuDeviceTotalMem", why))
        return 0;
    return bytes;
}

bool vmm_supported(int device, std::string* why) {
    // Device attributes need no context: asking must not create one (the launcher
    // asks for every GPU it serves and then only forks and waits).
    const Driver& d = driver();
    if (!d.error.empty()) {
        if (why) *why = d.error;
        return false;
    }
    CUdevice dev = 0;
    if (!ok(d.device_get(&dev, device), "cuDeviceGet", why)) return false;
    int vmm = 0, posix = 0;
    if (!ok(d.attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev), "cuDeviceGetAttribute", why) ||
        !ok(d.attribute(&posix, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev), "cuDeviceGetAttribute",
            why))
        return false;
    if (vmm && posix) return true;
    if (why) *why = vmm ? "no POSIX file-descriptor handles for VMM allocations" : "no virtual memory management";
    return false;
}

bool vmm_create(int device, size_t bytes, SharedAllocation* out, std::string* error) {
    const size_t g = vmm_granularity(device, error);
    if (g == 0) return false;
    const Driver& d = driver();
    const CUmemAllocationProp p = props(device);
    SharedAllocation a;
    a.device = device;
    a.bytes = (bytes + g - 1) / g * g;
    CUmemGenericAllocationHandle h = 0;
    if (!ok(d.create(&h, a.bytes, &p, 0), "cuMemCreate", error)) return false;
    a.handle = h;
    int fd = -1;
    if (!ok(d.export_handle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), "cuMemExportToShareableHandle", error)) {
        d.release(h);
        return false;
    }
    a.fd = fd;
    *out = a;
    return true;
}

void vmm_release(SharedAllocation& a) {
    if (a.handle) driver().release(a.handle);
    if (a.fd >= 0) close(a.fd);
    a = SharedAllocation{};
}

bool vmm_map(int fd, size_t bytes, int device, const std::vector<int>& peers, SharedMapping* out, std::string* error) {
    const size_t g = vmm_granularity(device, error);
    if (g == 0) return false;
    if (bytes == 0 || bytes % g != 0) {
        if (error) *error = "vmm_map: " + std::to_string(bytes) + " bytes is not a multiple of the granularity " + std::to_string(g);
        return false;
    }
    const Driver& d = driver();
    CUmemGenericAllocationHandle h = 0;
    // The fd is passed by value, cast to a pointer (the driver API's convention).
    if (!ok(d.import_handle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "cuMemImportFromShareableHandle", error))
        return false;
    CUdeviceptr ptr = 0;
    if (!ok(d.reserve(&ptr, bytes, g, 0, 0), "cuMemAddressReserve", error)) {
        d.release(h);
        return false;
    }
    if (!ok(d.map(ptr, bytes, 0, h, 0), "cuMemMap", error)) {
        d.address_free(ptr, bytes);
        d.release(h);
        return false;
    }
    std::vector<CUmemAccessDesc> access = {{{CU_MEM_LOCATION_TYPE_DEVICE, device}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE}};
    for (int dev : peers)
        if (dev != device) access.push_back({{CU_MEM_LOCATION_TYPE_DEVICE, dev}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE});
    if (!ok(d.set_access(ptr, bytes, access.data(), access.size()), "cuMemSetAccess", error)) {
        d.unmap(ptr, bytes);
        d.address_free(ptr, bytes);
        d.release(h);
        return false;
    }
    out->ptr = reinterpret_cast<void*>(ptr);
    out->bytes = bytes;
    out->handle = h;
    return true;
}

void vmm_unmap(SharedMapping& m) {
    if (m.ptr) {
        const CUdeviceptr p = reinterpret_cast<CUdeviceptr>(m.ptr);
        driver().unmap(p, m.bytes);
        driver().address_free(p, m.bytes);
    }
    if (m.handle) driver().release(m.handle);
    m = SharedMapping{};
}

}  // namespace duet::cuda
