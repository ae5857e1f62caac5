#include "huge_pages.h"

#include <sys/mman.h>

#include <cstdint>

namespace pycomm {

namespace {
constexpr uintptr_t kHugePage = uintptr_t{2} << 20;  // x86-64's and arm64 4K-granule PMD size
// glibc serves allocations of 32 MiB and more (its largest mmap threshold)
// from a mapping of their own, so the advice never reaches memory shared
// with other, smaller allocations of the heap.
constexpr size_t kMinBytes = size_t{32} << 20;
}  // namespace

void advise_huge_pages(void* p, size_t bytes) {
#if defined(MADV_HUGEPAGE)
  if (p == nullptr || bytes < kMinBytes) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHugePage - 1);
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace pycomm
