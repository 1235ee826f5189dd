#include "model/bf16_weights.h"

#include "kernels/cpu/kernels.h"

namespace duet {

Result<std::vector<uint16_t>> dequantize_bf16(const GgufTensor& t) {
    if (!dtype_supported(t.type) || t.ne[0] % dtype_block_elems(t.type) != 0)
        return make_error("tensor {}: type {} cannot be dequantized (row of {})", t.name, static_cast<uint32_t>(t.type),
                          t.ne[0]);
    const int64_t rows = t.n_elements() / t.ne[0];
    const size_t rb = t.row_bytes();
    if (t.data == nullptr || rb * static_cast<size_t>(rows) > t.nbytes)
        return make_error("tensor {}: {} bytes of data for {} rows of {} bytes", t.name, t.nbytes, rows, rb);
    std::vector<uint16_t> out(static_cast<size_t>(t.n_elements()));
    std::vector<float> row(static_cast<size_t>(t.ne[0]));
    for (int64_t r = 0; r < rows; ++r) {
        cpu::dequantize_row(t.type, t.data + static_cast<size_t>(r) * rb, row.data(), t.ne[0]);
        uint16_t* o = out.data() + static_cast<size_t>(r) * static_cast<size_t>(t.ne[0]);
        for (int64_t i = 0; i < t.ne[0]; ++i) o[i] = cpu::fp32_to_bf16(row[static_cast<size_t>(i)]);
    }
    return out;
}

}  // namespace duet
