// Linked into the release wheel's libraries only (CMakeLists.txt, GRPO_EXT_GLIBC_FLOOR, which is below 2.32):
// GCC 12's libstdc++ headers, compiled against the host's glibc 2.36, read glibc 2.32's `__libc_single_threaded` to
// skip atomic reference counts in a process with one thread. An older glibc lacks it, so each library holds its own,
// hidden, and 0: "other threads may run", which takes the atomic path, right in every process.
extern "C" {
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;
}
