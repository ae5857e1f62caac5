// Transparent huge pages for memory that an op is about to fill whole.
// Plain C++17: no torch, no CUDA.
#pragma once

#include <cstddef>

namespace pycomm {

// Asks the kernel to back [p, p + bytes) with transparent huge pages where it
// offers them on request (THP "madvise" mode, the common default). A large
// fresh allocation (torch's CPU allocator maps one anew for each tensor of
// tens of MiB) otherwise faults in one 4 KiB page at a time on first write,
// which costs more than the collective's own copies; DTensor's full_tensor()
// and FSDP2's all-gathers write such fresh outputs at every call.
//
// Only the 2 MiB-aligned interior of a range of at least 32 MiB is advised.
// Advice only: the contents never change, and failures (THP "never", memory
// that cannot take huge pages such as some shared mappings) are ignored.
void advise_huge_pages(void* p, size_t bytes);

}  // namespace pycomm
